"""The single-stream benchmark: workloads, runner, answer checkers, plots and calibration; the
command line ``python -m hf_kvshare.bench`` is described in ``docs/workloads.md``."""

from .command import RunOptions, run_command
from .methods import MethodSpec, requires_adapters
from .runner import BenchRunner, Collector, RunConfig
from .workloads import WORKLOADS, TaskSpec, Workload, WorkloadFormatError, make_workload

__all__ = [
    "WORKLOADS",
    "BenchRunner",
    "Collector",
    "MethodSpec",
    "RunConfig",
    "RunOptions",
    "TaskSpec",
    "Workload",
    "WorkloadFormatError",
    "make_workload",
    "requires_adapters",
    "run_command",
]

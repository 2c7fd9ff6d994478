"""The single-stream benchmark: workloads, runner, answer checkers, plots and calibration.

Command line: ``python -m hf_kvshare.bench run --workload trace --shared-tokens 256 512 --methods
nonshared fullshared`` (see ``docs/workloads.md``). Every method in ``hf_kvshare.METHODS`` runs
through it unchanged; methods with ``requires_adapters = True`` need a workload whose agents name
PEFT adapters.
"""

from .methods import MethodSpec, requires_adapters
from .runner import BenchRunner, Collector, RunConfig
from .workloads import WORKLOADS, TaskSpec, Workload, WorkloadFormatError, make_workload

__all__ = [
    "WORKLOADS",
    "BenchRunner",
    "Collector",
    "MethodSpec",
    "RunConfig",
    "TaskSpec",
    "Workload",
    "WorkloadFormatError",
    "make_workload",
    "requires_adapters",
]

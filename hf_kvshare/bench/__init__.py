"""The single-stream benchmark: workloads, runner, answer checkers, plots and tau calibration.

Command line: ``python -m hf_kvshare.bench run --workload trace --shared-tokens 256 512 --methods
nonshared fullshared`` (see ``docs/workloads.md``). Every method in ``hf_kvshare.METHODS`` runs
through it unchanged; methods with ``requires_adapters = True`` need a workload whose agents name
PEFT adapters.
"""

from .calibrate import Calibration, calibrate_profile, calibrate_tau, realized_rho
from .methods import MethodSpec, requires_adapters
from .runner import BenchRunner, Collector, RunConfig
from .workloads import WORKLOADS, TaskSpec, Workload, WorkloadFormatError, make_workload

__all__ = [
    "WORKLOADS",
    "BenchRunner",
    "Calibration",
    "Collector",
    "MethodSpec",
    "RunConfig",
    "TaskSpec",
    "Workload",
    "WorkloadFormatError",
    "calibrate_profile",
    "calibrate_tau",
    "make_workload",
    "realized_rho",
    "requires_adapters",
]

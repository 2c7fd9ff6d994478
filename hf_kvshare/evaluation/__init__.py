"""Evaluation: everything that drives sessions to measure or calibrate methods (above the session).

- :mod:`.workflow`: workflows (an agent turn per step) and the runner of one in a session;
- :mod:`.protocol`: the ONE paired protocol (free-running + teacher-forced on NonShared's outputs),
  its per-turn / per-request records and summaries, and :func:`compare_methods`;
- :mod:`.metrics`: the one copy of each metric (speed statistics, agreement, KL, KV error, effective rank);
- :mod:`.transitions`: the reuse transitions of a workload, :func:`calibrate_droidspeak`;
- :mod:`.calibration`: :func:`calibrate_tau`, the threshold that reaches a target reuse ratio;
- :mod:`.coverage`: reconstruction coverage of selective recomputation (KVCMAS paper, Appendix A.1).
"""

from .calibration import Calibration, calibrate_tau, realized_rho
from .coverage import CRITERIA, CoverageReport, CriterionCoverage, entry_errors, reconstruction_coverage
from .metrics import (
    effective_rank,
    erank_by_layer,
    kv_error,
    kv_error_by_layer,
    mean_kl,
    relative_error,
    top1_agreement,
)
from .protocol import (
    REFERENCE,
    SUMMARY_COLUMNS,
    MethodPair,
    MethodReport,
    RequestRun,
    compare_methods,
    request_record,
    run_paired,
    summarize_method,
    turn_fidelity,
    turn_records,
)
from .transitions import ReuseTransition, calibrate_droidspeak, collect_transitions, has_offline_profile
from .workflow import (
    DEMO_QUERIES,
    DEMO_QUERY,
    DEMO_ROLES,
    Step,
    Workflow,
    demo_workflow,
    reusable_slots,
    run_workflow,
)

__all__ = [
    "Calibration",
    "calibrate_tau",
    "realized_rho",
    "CRITERIA",
    "CoverageReport",
    "CriterionCoverage",
    "ReuseTransition",
    "calibrate_droidspeak",
    "collect_transitions",
    "entry_errors",
    "has_offline_profile",
    "reconstruction_coverage",
    "DEMO_QUERIES",
    "DEMO_QUERY",
    "DEMO_ROLES",
    "REFERENCE",
    "SUMMARY_COLUMNS",
    "MethodPair",
    "MethodReport",
    "RequestRun",
    "Step",
    "Workflow",
    "compare_methods",
    "demo_workflow",
    "effective_rank",
    "erank_by_layer",
    "kv_error",
    "kv_error_by_layer",
    "mean_kl",
    "relative_error",
    "request_record",
    "reusable_slots",
    "run_paired",
    "run_workflow",
    "summarize_method",
    "top1_agreement",
    "turn_fidelity",
    "turn_records",
]

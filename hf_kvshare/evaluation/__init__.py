"""Evaluation: the one paired protocol (free-running + teacher-forced on NonShared's outputs), the
workflow runner, and the one copy of each metric."""

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
from .workflow import DEMO_QUERY, DEMO_ROLES, Step, Workflow, demo_workflow, reusable_slots, run_workflow

__all__ = [
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

"""Workloads: every one produces :class:`TaskSpec` requests (the JSONL task format); the registry
``WORKLOADS`` is described in ``docs/workloads.md``."""

from .autoact import AutoActWorkload
from .base import WORKLOADS, Workload, make_workload, register_workload, workload_tau
from .files import FileWorkload, kinds_report, load_table, load_task_file, validate_task_file
from .mathvista import BarChart, MathVistaWorkload
from .spec import AgentSpec, BenchStep, SlotSpec, StepSpec, TaskSpec, WorkloadFormatError
from .stress import StressWorkload
from .tasks import GSM8KWorkload, HumanEvalWorkload, MMLUWorkload
from .trace import TraceWorkload, synthetic_text
from .videomme import Clip, VideoMMEWorkload

__all__ = [
    "workload_tau",
    "WORKLOADS",
    "AgentSpec",
    "AutoActWorkload",
    "BarChart",
    "BenchStep",
    "Clip",
    "FileWorkload",
    "GSM8KWorkload",
    "HumanEvalWorkload",
    "MMLUWorkload",
    "MathVistaWorkload",
    "SlotSpec",
    "StepSpec",
    "StressWorkload",
    "TaskSpec",
    "TraceWorkload",
    "VideoMMEWorkload",
    "Workload",
    "WorkloadFormatError",
    "load_table",
    "load_task_file",
    "make_workload",
    "register_workload",
    "synthetic_text",
    "validate_task_file",
    "kinds_report",
]

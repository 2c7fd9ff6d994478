"""hf_kvshare: share KV caches between LLM agents that share one model.

>>> from hf_kvshare import load_model, Session, PF, PH  # doctest: +SKIP
>>> model, tok = load_model()  # the embedded SmolLM2-135M-Instruct, offline  # doctest: +SKIP
>>> s = Session(model, tok, method="fullshared")  # doctest: +SKIP
"""

from ._compat import CACHE_KWARG, cache_kwargs
from ._version import __version__ as __version__
from .anchors.cache import CorrectedCache
from .cache import (
    PositionMismatchError,
    Segment,
    SegmentedCache,
    SegmentKV,
    SharedCache,
)
from .evaluation import Step, Workflow, compare_methods, run_workflow
from .export import register_export_support
from .lora.cache import BaseLRCache

# importing the methods fills the registry (METHODS): the package does it, the session does not
from .methods import METHODS, Method, Placement, get_method, register
from .models import load_model
from .prefill import prefill_dense, prefill_parts
from .rope import RopeShifter
from .session import Session
from .trajectory import PF, PH, chat
from .turn import TurnResult

__all__ = [
    "BaseLRCache",
    "CACHE_KWARG",
    "CorrectedCache",
    "METHODS",
    "PF",
    "PH",
    "Method",
    "Placement",
    "PositionMismatchError",
    "RopeShifter",
    "Segment",
    "SegmentKV",
    "SegmentedCache",
    "Session",
    "SharedCache",
    "Step",
    "TurnResult",
    "Workflow",
    "cache_kwargs",
    "chat",
    "compare_methods",
    "get_method",
    "load_model",
    "prefill_dense",
    "prefill_parts",
    "register",
    "register_export_support",
    "run_workflow",
]

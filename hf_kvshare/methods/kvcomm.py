"""KVComm baseline: full-dimension anchors, context-free reference, non-chained."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..method import register
from .kvcmas import KVCMAS


@register
@dataclass(eq=False)
class KVComm(KVCMAS):
    """KVComm (Ye et al., 2025) as configured in the KVCMAS paper (B.1): every anchor stores its
    base cache and each consumer's delta densely (``O(V·N·L·D)`` per pool), corrections are
    relative to the context-free reference of the segment, V = 20, tau = 0.3, same gate,
    token-wise weighting and LFU-among-5-oldest eviction as KVCMAS."""

    name = "kvcomm"
    chained: ClassVar[bool] = False
    uses_sources: ClassVar[bool] = False

    base_rank: int | None = None
    delta_rank: int | None = None
    capacity: int = 20

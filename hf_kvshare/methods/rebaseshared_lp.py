"""ReBaseShared with lazy prefill (PReCache): a neutral base rebuilt after each turn."""

from __future__ import annotations

from ..method import register
from .lowrank_sharing import LowRankSharing


@register
class ReBaseSharedLP(LowRankSharing):
    """During the turn only the adapted path runs (as in PreLRShared). After it (counted in E2E, not
    TTFT), one prefill over the turn's new tokens with every adapter disabled extends the **neutral
    base cache** — attending only to the neutral base — and projects the adapter-free hidden states
    with every other agent's ``lora_A`` to extend their LR caches. The current agent's own LR cache
    comes from its adapted hidden states (``own_lr="adapted"``, as in the paper) or from the
    adapter-free ones (``own_lr="neutral"``). Suited to single-stream (edge) inference.
    """

    name = "rebaseshared-lp"
    precompute = True
    neutral = "lazy"

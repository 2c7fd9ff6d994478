"""ReBaseShared with double batching (PReCache): the neutral base built alongside the turn."""

from __future__ import annotations

from ..method import register
from .lowrank_sharing import LowRankSharing


@register
class ReBaseSharedDB(LowRankSharing):
    """The turn runs as a PEFT mixed-adapter batch of two, ``adapter_names=[agent, "__base__"]``, in
    prefill and in decoding. Row 0 is the agent (its view: neutral base + its LR cache, then its own
    K/V); row 1 is the adapter-free path with its own view (the neutral base) and follows row 0's
    tokens (greedy decoding). After the turn, row 1's K/V extend the neutral base and its hidden
    states (captured by the hooks) every other agent's LR cache. Same caches as
    ``rebaseshared-lp`` (allclose); only the schedule differs. Suited to batched serving.

    With ``Session.build_cache`` the cache and prompt have these two rows; call
    ``generate(..., adapter_names=[agent, "__base__"])`` (greedy) yourself. Sampled rows drift
    apart; the method then rebuilds the neutral base with a lazy prefill and warns.
    """

    name = "rebaseshared-db"
    precompute = True
    neutral = "double"

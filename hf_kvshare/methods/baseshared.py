"""BaseShared (LRAgent): one shared base cache; each agent re-processes what it has not seen."""

from __future__ import annotations

from ..method import register
from .lowrank_sharing import LowRankSharing


@register
class BaseShared(LowRankSharing):
    """Agents share the base K/V (``W x + b``, built by whichever agent first processed the context)
    and keep their own LR caches. An agent's LR cache only grows from its own hidden states, so on
    each turn it re-runs its adapted backbone over the context added since its previous turn (reading
    the shared base there, plus the LR part of that same forward), then prefills the new tokens.

    Memory as PReLRShared; compute close to NonShared for agents that rarely speak.
    """

    name = "baseshared"
    precompute = False
    neutral = None

"""PreLRShared (PReCache): every agent's LR cache is precomputed when context is first processed."""

from __future__ import annotations

from ..method import register
from .lowrank_sharing import LowRankSharing


@register
class PreLRShared(LowRankSharing):
    """When new context is first processed (the current agent's new prompt tokens and its output),
    the hooks on ``k_proj``/``v_proj`` project the same hidden states with every agent's ``lora_A``,
    extending all LR caches at once. The next agent reads ``K_base + rope(s B A x)`` over the whole
    shared trajectory and only computes its own new tokens.

    The shared base comes from the hidden states of the agent that first processed each token.
    """

    name = "prelrshared"
    precompute = True
    neutral = None

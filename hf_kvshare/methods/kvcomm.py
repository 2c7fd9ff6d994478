"""KVComm baseline: full-dimension anchors, a reference prefill of the given text, producer-sourced outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..method import register
from .kvcmas import KVCMAS


@register
@dataclass(eq=False)
class KVComm(KVCMAS):
    """KVComm (Ye et al., 2025) as its authors' code (``FastMAS/KVCOMM``) runs it: every anchor stores
    its base cache and each consumer's delta densely (``O(V·N·L·D)`` per pool), V = 20, tau = 0.3.

    - Given text (the query) is prefilled once per request after BOS + the chat header + a lead-in,
      which are then dropped (``text_source="lead"``; ``lead_in`` overrides the lead-in); the first
      consumer gates it once, every consumer obeys.
    - An agent output's source is its producer's own cache, re-positioned; the producer gates it once.
    - Anchors shorter than the segment are not used (``partial_coverage=False``: none covering it →
      the source is reused uncorrected); layer 0 is left uncorrected.

    All options of :class:`~hf_kvshare.methods.kvcmas.KVCMAS` apply. Not implemented from the
    reference: its corrections of the agent-specific prefix text (PF deltas; our PF segments are
    prefilled densely), its comparison of keys in the reader's position frame and its deltas added
    in the anchor creator's frame (ours are canonical). The earlier reading (context-free references
    for every slot, per-edge gating over a prefix) is
    ``kvcomm:gate_scope=edge,match=prefix,output_source=context_free,text_source=context_free,skip_layer0=False,pool_peak=capacity``.
    """

    name = "kvcomm"
    chained: ClassVar[bool] = False
    workload_tau: ClassVar[bool] = False  # KVComm's authors use 0.3 on every task

    base_rank: int | None = None
    delta_rank: int | None = None
    capacity: int = 20
    text_source: str = "lead"
    partial_coverage: bool = False

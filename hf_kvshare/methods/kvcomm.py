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
    - Keys are compared in the readers' frames (``key_frame="reader"``: the source where this
      consumer places it, the anchor's base where its last consumer placed it); deltas are stored
      in the absolute positions of the consumer that observed them and added unrotated
      (``delta_frame="writer"``).
    - The PF text right after a corrected segment, kept per agent (``prefix_reuse``), is corrected
      with the anchors' prefix deltas, weighted per layer and feature (``prefix_delta``).

    - Its gate and pools are the reference's (``profile="reference"``: the entropy rule alone,
      anchors added on rejection only, a whole-turn fallback); ``kvcomm:profile=reuse`` takes
      KVCMAS's agreement rule, refreshed near-duplicates and span fallback.

    All options of :class:`~hf_kvshare.methods.kvcmas.KVCMAS` apply. One difference from the
    reference stays: its agent template is prefilled once with the placeholder NAMES as text, ours
    keeps the PF text of the agent's first real turn. The earlier reading (context-free references
    for every slot, per-edge gating over a prefix, canonical frames, PF text prefilled) is
    ``kvcomm:gate_scope=edge,match=prefix,output_source=context_free,text_source=context_free,skip_layer0=False,pool_peak=capacity,delta_frame=canonical,key_frame=canonical,prefix_delta=False,prefix_reuse=False``.
    """

    name = "kvcomm"
    chained: ClassVar[bool] = False
    workload_tau: ClassVar[bool] = False  # KVComm's authors use 0.3 on every task

    base_rank: int | None = None
    delta_rank: int | None = None
    capacity: int = 20
    text_source: str = "lead"
    partial_coverage: bool = False
    key_frame: str = "reader"
    prefix_delta: bool = True
    profile: str = "reference"

"""Selective recomputation engine: recompute a subset of a reused PH segment's (token, layer) entries.

- :mod:`.stack`: :class:`DecoderStack`, the model's decoder layers run one at a time.
- :mod:`.layers`: :class:`SegmentRecompute`, a segment's rows run layer by layer over the cache.
- :mod:`.selection`: the selection criteria (KV deviation, received attention, layer profiles).
- :mod:`.boundary`: :class:`BoundaryRecorder`, hidden states at layer boundaries captured by position (the
  method mixin that keeps them per slot is :mod:`hf_kvshare.methods.boundary_capture`).

The methods built on it (CacheBlend, DroidSpeak, RelayCaching) live in :mod:`hf_kvshare.methods`;
reuse transitions and reconstruction coverage in :mod:`hf_kvshare.evaluation`.
"""

from .boundary import BOUNDARY_KEY, BoundaryRecorder
from .layers import SegmentRecompute
from .stack import DecoderStack

__all__ = [
    "BOUNDARY_KEY",
    "BoundaryRecorder",
    "DecoderStack",
    "SegmentRecompute",
]

"""Selective recomputation engine: recompute a subset of a reused PH segment's (token, layer) entries.

- :mod:`.stack`: :class:`DecoderStack`, the model's decoder layers run one at a time.
- :mod:`.layers`: :class:`SegmentRecompute`, a segment's rows run layer by layer over the cache.
- :mod:`.selection`: the selection criteria (KV deviation, received attention, layer profiles).
- :mod:`.boundary`: hidden states at layer boundaries, kept per slot to restart from.

The methods built on it (CacheBlend, DroidSpeak, RelayCaching) live in :mod:`hf_kvshare.methods`;
reuse transitions and reconstruction coverage in :mod:`hf_kvshare.evaluation`.
"""

from .boundary import BOUNDARY_KEY, BoundaryCapture, BoundaryRecorder
from .layers import SegmentRecompute
from .stack import DecoderStack

__all__ = [
    "BOUNDARY_KEY",
    "BoundaryCapture",
    "BoundaryRecorder",
    "DecoderStack",
    "SegmentRecompute",
]

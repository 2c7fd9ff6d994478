"""Selective recomputation: reuse a PH segment's cache and recompute a subset of its entries.

- :class:`CacheBlend` (``"cacheblend"``): tokens with the largest KV deviation at early check layers.
- :class:`DroidSpeak` (``"droidspeak"``): whole layers, chosen by an offline deviation profile.
- :class:`RelayCaching` (``"relaycaching"``): tokens by deviation x attention, inside middle layers.

:mod:`~hf_kvshare.recompute.coverage` measures how much of the reuse error each selection
criterion removes (the KVCMAS paper's reconstruction coverage, Appendix A.1).
"""

from .base import SelectiveRecompute
from .cacheblend import CacheBlend
from .droidspeak import DroidSpeak
from .layers import SegmentRecompute
from .relaycaching import RelayCaching
from .stack import DecoderStack

__all__ = [
    "CacheBlend",
    "DecoderStack",
    "DroidSpeak",
    "RelayCaching",
    "SegmentRecompute",
    "SelectiveRecompute",
]

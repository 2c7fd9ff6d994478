"""The built-in methods, one file each; the registry itself is :mod:`hf_kvshare.method`.

Importing this package registers every built-in method: the prompt-specialized ones
(nonshared, fullshared, kvcmas, kvcmas-nonchained, kvcomm, graphflow, on the ``anchors`` engine),
the LoRA ones (baseshared, baselrshared, prelrshared, rebaseshared-lp, rebaseshared-db, on the ``lora`` engine)
and the selective recomputation baselines (cacheblend, droidspeak, relaycaching, on the
``recompute`` engine; their unregistered base is :class:`~.selective.SelectiveRecompute`).
The method mixins live here too: :class:`~.prefix_reuse.PrefixReuse` (per-agent prefix reuse) and
:class:`~.boundary_capture.BoundaryCapture` (layer-input hidden states kept per slot).

The package ``hf_kvshare`` imports this one, so the registry is full whenever ``hf_kvshare`` is
imported; the session never imports it.
"""

from ..method import METHODS, Method, Placement, get_method, register
from .baselrshared import BaseLRShared
from .baseshared import BaseShared
from .cacheblend import CacheBlend
from .droidspeak import DroidSpeak
from .fullshared import FullShared
from .graphflow import GraphFlow
from .kvcmas import KVCMAS
from .kvcmas_nonchained import KVCMASNonChained
from .kvcomm import KVComm
from .nonshared import NonShared
from .prelrshared import PreLRShared
from .rebaseshared_db import ReBaseSharedDB
from .rebaseshared_lp import ReBaseSharedLP
from .relaycaching import RelayCaching
from .selective import SelectiveRecompute

__all__ = [
    "METHODS",
    "Method",
    "Placement",
    "get_method",
    "register",
    "NonShared",
    "FullShared",
    "KVCMAS",
    "KVCMASNonChained",
    "KVComm",
    "GraphFlow",
    "BaseShared",
    "BaseLRShared",
    "PreLRShared",
    "ReBaseSharedLP",
    "ReBaseSharedDB",
    "CacheBlend",
    "DroidSpeak",
    "RelayCaching",
    "SelectiveRecompute",
]

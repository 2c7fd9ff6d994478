"""The built-in methods, one file each; the registry itself is :mod:`hf_kvshare.method`.

Importing this package registers every built-in method: the prompt-specialized ones here
(nonshared, fullshared, kvcmas, kvcmas-nonchained, kvcomm, graphflow), the LoRA ones
(baseshared, prelrshared, rebaseshared-lp, rebaseshared-db) and the selective recomputation
baselines from ``hf_kvshare.recompute`` (cacheblend, droidspeak, relaycaching).
"""

from ..method import METHODS, Method, Placement, get_method, register
from ..recompute import CacheBlend, DroidSpeak, RelayCaching
from .baseshared import BaseShared
from .fullshared import FullShared
from .graphflow import GraphFlow
from .kvcmas import KVCMAS, KVCMASNonChained
from .kvcomm import KVComm
from .nonshared import NonShared
from .prelrshared import PreLRShared
from .rebaseshared_db import ReBaseSharedDB
from .rebaseshared_lp import ReBaseSharedLP

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
    "PreLRShared",
    "ReBaseSharedLP",
    "ReBaseSharedDB",
    "CacheBlend",
    "DroidSpeak",
    "RelayCaching",
]

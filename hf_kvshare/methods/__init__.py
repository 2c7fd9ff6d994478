"""Method registry: ``METHODS[name]`` is the class; one file per method.

Importing this package registers every built-in method.
"""

from ..recompute import CacheBlend, DroidSpeak, RelayCaching  # registers the selective recomputation methods
from .base import METHODS, Method, Placement, get_method, register
from .fullshared import FullShared
from .nonshared import NonShared

__all__ = [
    "METHODS",
    "Method",
    "Placement",
    "get_method",
    "register",
    "NonShared",
    "FullShared",
    "CacheBlend",
    "DroidSpeak",
    "RelayCaching",
]

"""Method registry: ``METHODS[name]`` is the class; one file per method.

Importing this package registers every built-in method.
"""

from . import graphflow, kvcmas, kvcomm  # noqa: F401  registers kvcmas, kvcmas-nonchained, kvcomm, graphflow
from .base import METHODS, Method, Placement, get_method, register
from .baseshared import BaseShared
from .fullshared import FullShared
from .nonshared import NonShared
from .prelrshared import PreLRShared
from .rebaseshared_db import ReBaseSharedDB
from .rebaseshared_lp import ReBaseSharedLP

__all__ = ["METHODS", "Method", "Placement", "get_method", "register", "NonShared", "FullShared"]
__all__ += ["BaseShared", "PreLRShared", "ReBaseSharedLP", "ReBaseSharedDB"]

"""PReCache machinery for agents that share one backbone and differ by LoRA adapter.

- :mod:`.adapters`: PEFT introspection (:class:`LoraBank`); agents' adapters are checked and
  activated by :mod:`hf_kvshare.agents`
- :mod:`.capture`: :class:`KVCapture`, hooks on ``k_proj``/``v_proj`` (``A x`` of every adapter, ``W x + b``)
- :mod:`.store`: :class:`LowRankStore`, the per-request base K/V + per-agent LR caches (values only
  by default, as the reference code; keys too with ``lr_keys=True``, beyond the reference)
- :mod:`.view`: :class:`LowRankView`, an agent's K/V rebuilt from the store
- :mod:`.cache`: :class:`BaseLRCache`, the cache that presents a view to ``generate``
- :mod:`.neutral`: adapter-free reconstruction, lazy prefill and double batching

The methods on this engine (``baseshared``, ``baselrshared``, ``prelrshared``, ``rebaseshared-lp``,
``rebaseshared-db``) share :class:`hf_kvshare.methods.lowrank_sharing.LowRankSharing`.
"""

from ..agents import BASE_ROW
from .adapters import KVProjection, LoraBank
from .cache import BaseLRCache
from .capture import KVCapture
from .neutral import FollowFirstRow, neutral_prefill
from .store import SHARED_LR, AgentLR, LowRankStore
from .view import AbsoluteRope, LowRankView

__all__ = [
    "BASE_ROW",
    "SHARED_LR",
    "AbsoluteRope",
    "AgentLR",
    "BaseLRCache",
    "FollowFirstRow",
    "KVCapture",
    "KVProjection",
    "LoraBank",
    "LowRankStore",
    "LowRankView",
    "neutral_prefill",
]

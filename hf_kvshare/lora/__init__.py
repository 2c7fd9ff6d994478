"""PReCache machinery for agents that share one backbone and differ by LoRA adapter.

- :mod:`.adapters`: PEFT introspection (:class:`LoraBank`), :func:`agent_adapter`
- :mod:`.capture`: :class:`KVCapture`, hooks on ``k_proj``/``v_proj`` (``A x`` of every adapter, ``W x + b``)
- :mod:`.store`: :class:`LowRankStore`, the per-request base K/V + per-agent LR caches
- :mod:`.view`: :class:`LowRankView`, an agent's K/V rebuilt from the store (read by
  :class:`hf_kvshare.cache.BaseLRCache`)
- :mod:`.neutral`: adapter-free reconstruction, lazy prefill and double batching
- :mod:`.sharing`: :class:`LowRankSharing`, the method base of ``baseshared``, ``prelrshared``,
  ``rebaseshared-lp`` and ``rebaseshared-db``
- :mod:`.autoact` / :mod:`.train_roles`: the plan/act/reflect workload and role-adapter training
"""

from .adapters import BASE_ROW, KVProjection, LoraBank, agent_adapter, check_agent_adapter
from .capture import KVCapture
from .neutral import FollowFirstRow, neutral_prefill
from .store import AgentLR, LowRankStore
from .view import AbsoluteRope, LowRankView

__all__ = [
    "BASE_ROW",
    "AbsoluteRope",
    "AgentLR",
    "FollowFirstRow",
    "KVCapture",
    "KVProjection",
    "LoraBank",
    "LowRankStore",
    "LowRankView",
    "agent_adapter",
    "check_agent_adapter",
    "neutral_prefill",
]

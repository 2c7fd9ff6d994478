"""What the connector's scheduler side (:mod:`.connector_scheduler`) and worker side
(:mod:`.connector_worker`) send each other through vLLM (its step's metadata, the worker's step
output), and the set-up both refuse: one worker, one KV cache group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .host import ServingError

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class Load:
    """Claimed K/V to write before the request's first forward."""

    request_id: str
    block_ids: list[int]
    start: int
    keys: torch.Tensor  # [layers, n, kv_heads, head_dim]: one buffer to the worker (Plan.keys)
    values: torch.Tensor


@dataclass
class Capture:
    """A finished request's K/V to read back: positions ``[0, tokens)`` of its blocks."""

    request_id: str
    block_ids: list[int]
    tokens: int


@dataclass
class HFKVShareMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)
    #: the scheduler's read-back channel (:mod:`.channel`), ``None`` without one: the worker connects
    #: to it when it first sees it and sends each capture through it
    read_back: str | None = None


@dataclass
class Captured(KVConnectorWorkerMetadata):
    """K/V read back by the worker: request id -> (keys, values), ``[layers, n, kv_heads, head_dim]``
    each (one buffer apiece back to the scheduler; ``None`` when reading failed)."""

    kv: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=dict)
    #: requests whose K/V went through the read-back channel instead (the scheduler waits for them)
    sent: set[str] = field(default_factory=set)
    #: the worker's order channel (:mod:`.channel`), once: the scheduler orders read-backs there
    orders: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, Captured):
            self.kv.update(other.kv)
            self.sent |= other.sent
            self.orders = self.orders or other.orders
        return self


def check_supported(vllm_config: VllmConfig, kv_cache_config: Any) -> None:
    """Refuse, at start-up, what the connector does not support: more than one worker (tensor or
    pipeline parallel), more than one KV cache group (sliding-window / hybrid layers)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ServingError(
            "hf_kvshare's connector supports one worker (tensor_parallel_size = pipeline_parallel_size = 1); "
            f"got {parallel.tensor_parallel_size} x {parallel.pipeline_parallel_size}"
        )
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ServingError(
            "hf_kvshare's connector supports models whose layers share one KV cache group (one block "
            f"table per request); this model has {len(groups)} (sliding-window / hybrid layers)"
        )

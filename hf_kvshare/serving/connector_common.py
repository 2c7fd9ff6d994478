"""What the connector's scheduler side (:mod:`.connector_scheduler`) and worker side
(:mod:`.connector_worker`) send each other through vLLM (its step's metadata, the worker's step
output), and the set-up both refuse: one worker, one KV cache group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # without vLLM (the fast test lane): the same messages, as plain dataclasses

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vLLM's base of a connector's step metadata (stand-in where vLLM is not installed)."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """vLLM's base of a worker's step output (stand-in where vLLM is not installed)."""

        def aggregate(self, other):  # pragma: no cover - vLLM's own calls it
            return self


from .host import ServingError

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class Source:
    """Claimed positions whose K/V are rows of a request the worker keeps (:mod:`.worker_store`): its rows
    ``[row, row + n)`` written at claim offset ``offset``, the keys re-positioned (RoPE) from position
    ``src_start`` to ``dst_start`` on the worker's device (no move when equal)."""

    request_id: str
    row: int
    n: int
    offset: int
    src_start: int
    dst_start: int


@dataclass
class Load:
    """Claimed K/V to write before the request's first forward: positions ``[start, start + tokens)``.
    No tensor: each piece is a :class:`Source` (rows the worker keeps) or a ``payload`` range (claim
    offsets ``[lo, hi)``) whose K/V came on the order channel under the request id (:mod:`.channel`;
    all ranges' rows in one message, in order)."""

    request_id: str
    block_ids: list[int]
    start: int
    tokens: int
    sources: list[Source] = field(default_factory=list)
    payload: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Capture:
    """A finished request's K/V to read back: positions ``[0, tokens)`` of its blocks. ``keep``: the
    worker also keeps them in its store (the scheduler's :class:`~.worker_store.StoreMirror` decided),
    after dropping the requests ``drop`` names."""

    request_id: str
    block_ids: list[int]
    tokens: int
    keep: bool = False
    drop: list[str] = field(default_factory=list)


@dataclass
class HFKVShareMetadata(KVConnectorMetadata):
    """One step's orders to the worker: small, no tensor (tests/test_layout.py checks the fields)."""

    loads: list[Load] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)
    #: the scheduler's read-back channel (:mod:`.channel`), ``None`` without one: the worker connects
    #: to it when it first sees it and sends each capture through it
    read_back: str | None = None
    #: kept requests the worker drops after this step's loads (the scheduler will not reference them)
    drops: list[str] = field(default_factory=list)


@dataclass
class Captured(KVConnectorWorkerMetadata):
    """K/V read back by the worker: request id -> (keys, values), ``[layers, n, kv_heads, head_dim]``
    each (one buffer apiece back to the scheduler; ``None`` when reading failed)."""

    kv: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=dict)
    #: requests whose K/V went through the read-back channel instead (the scheduler waits for them)
    sent: set[str] = field(default_factory=set)
    #: the worker's order channel (:mod:`.channel`), once: the scheduler orders read-backs there
    orders: str | None = None
    #: bytes one position's K/V take in the worker's store (every layer's keys and values), once
    bytes_per_token: int | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, Captured):
            self.kv.update(other.kv)
            self.sent |= other.sent
            self.orders = self.orders or other.orders
            self.bytes_per_token = self.bytes_per_token or other.bytes_per_token
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

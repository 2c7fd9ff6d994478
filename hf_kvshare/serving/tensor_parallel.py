"""Tensor parallel: which KV heads each worker rank of vLLM holds, and the ranks' read-backs of a
finished request assembled into all heads for its record. No vLLM import (the fast lane tests it on
CPU tensors); the connector's sides use it (:mod:`.connector_worker`: a rank writes its slice of a
claim and reads back its own heads; :mod:`.connector_scheduler`: the assembly).

A decision that needs every head (KVCMAS's gate distances, a correction's) is made once, on the
scheduler side, over the assembled heads, and reaches every rank in the same claim: the ranks never
decide apart.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PENDING", "RankAssembly", "kv_head_range", "rank_assembly", "tensor_parallel_size"]


def tensor_parallel_size(vllm_config: Any) -> int:
    """vLLM's tensor-parallel size (1 for a test's config without a parallel config)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def kv_head_range(rank: int, tp_size: int, total_kv_heads: int) -> tuple[int, int]:
    """The KV heads ``[start, stop)`` vLLM gives tensor-parallel ``rank`` of ``tp_size`` (its linear
    layers' rule): ``total_kv_heads / tp_size`` consecutive heads each, or, with fewer KV heads than
    ranks, head ``rank // (tp_size / total_kv_heads)``, replicated on that many ranks."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not one of {tp_size} tensor-parallel ranks")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over {tp_size} ranks")
        per = total_kv_heads // tp_size
        return rank * per, (rank + 1) * per
    if tp_size % total_kv_heads:
        raise ValueError(f"{total_kv_heads} KV heads do not replicate over {tp_size} ranks")
    head = rank // (tp_size // total_kv_heads)
    return head, head + 1


#: :meth:`RankAssembly.add`'s answer while a rank's read-back is still to come
PENDING = object()


class RankAssembly:
    """The ranks' read-backs of each finished request, assembled into all KV heads for its record:
    ``add(request_id, rank, kv)`` keeps one rank's ``[layers, n, its heads, head_dim]`` K/V and, once
    every rank whose heads are not yet covered has come, returns ``(keys, values)`` over all
    ``total_kv_heads`` (a replicated head is taken from the first rank that holds it); ``None`` as soon
    as one rank's read failed; :data:`PENDING` until then. One rank (no tensor parallel): ``kv`` as is.
    Not thread-safe: its caller holds the lock its read-backs arrive under."""

    def __init__(self, tp_size: int = 1, total_kv_heads: int = 1):
        self.tp_size = tp_size
        self.ranges = (
            [kv_head_range(r, tp_size, total_kv_heads) for r in range(tp_size)] if tp_size > 1 else []
        )
        #: request id -> rank -> its K/V, while ranks are missing
        self._pieces: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, request_id: str, rank: int, kv: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
        if self.tp_size == 1 or kv is None:
            self._pieces.pop(request_id, None)
            return kv
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"a read-back from rank {rank}; this server has {self.tp_size} ranks")
        pieces = self._pieces.setdefault(request_id, {})
        pieces[rank] = kv
        first: dict[tuple[int, int], int] = {}  # each head range's first rank
        for r, heads in enumerate(self.ranges):
            first.setdefault(heads, r)
        if any(r not in pieces for r in first.values()):
            return PENDING
        del self._pieces[request_id]
        order = [pieces[first[heads]] for heads in sorted(first)]
        return torch.cat([k for k, _ in order], dim=2), torch.cat([v for _, v in order], dim=2)

    def has(self, request_id: str, ranks: set[int]) -> bool:
        """Whether every one of ``ranks``' read-backs of the request is kept here (still missing others)."""
        return ranks <= set(self._pieces.get(request_id, ()))

    def discard(self, request_id: str) -> None:
        self._pieces.pop(request_id, None)


def rank_assembly(vllm_config: Any) -> RankAssembly:
    """The :class:`RankAssembly` of vLLM's tensor-parallel workers (one rank: read-backs as they come)."""
    size = tensor_parallel_size(vllm_config)
    if size == 1:
        return RankAssembly()
    return RankAssembly(size, vllm_config.model_config.get_total_num_kv_heads())

"""Tensor and pipeline parallel: which KV heads and which layers each worker rank of vLLM holds, and
the ranks' read-backs of a finished request assembled into all heads and all layers for its record.
No vLLM import (the fast lane tests it on CPU tensors); the connector's sides use it
(:mod:`.connector_worker`: a rank writes its slice of a claim and reads back its own heads of its own
layers; :mod:`.connector_scheduler`: the assembly, and each claim's K/V routed to the ranks by layers).

A worker's rank is vLLM's order of its workers: ``pp_rank * tp_size + tp_rank`` (:func:`worker_rank`):
pipeline stage ``pp_rank`` holds a run of consecutive layers (vLLM's partition; each rank announces
its own, :meth:`RankAssembly.announce`), every rank of a stage holds those layers' share of the KV
heads (:func:`kv_head_range`).

A decision that needs every head or every layer (KVCMAS's gate distances, a correction's) is made
once, on the scheduler side, over the assembled K/V, and reaches every rank in the same claim: the
ranks never decide apart. Under the worker replicas (:mod:`.replica`: a value-reading method at TP > 1
or PP > 1) nothing is assembled: every rank decides the same in lockstep on its own heads of its stage's
layers (its reductions over its tensor- and pipeline-parallel groups) and the scheduler follows rank 0's
values.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "PENDING",
    "RankAssembly",
    "kv_head_range",
    "pipeline_parallel_size",
    "rank_assembly",
    "tensor_parallel_size",
    "worker_rank",
]


def tensor_parallel_size(vllm_config: Any) -> int:
    """vLLM's tensor-parallel size (1 for a test's config without a parallel config)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def pipeline_parallel_size(vllm_config: Any) -> int:
    """vLLM's pipeline-parallel size (1 for a test's config without a parallel config)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "pipeline_parallel_size", 1) or 1)


def worker_rank(tp_rank: int, pp_rank: int, tp_size: int) -> int:
    """A worker's rank among all of vLLM's workers (its executor's order: stage by stage, each stage's
    tensor-parallel ranks in order): what the worker sends with its read-backs."""
    return pp_rank * tp_size + tp_rank


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
    """The ranks' read-backs of each finished request, assembled into all KV heads and all layers for
    its record: ``add(request_id, rank, kv)`` keeps one rank's ``[its layers, n, its heads, head_dim]``
    K/V and, once every rank whose piece is not yet covered has come, returns ``(keys, values)`` over
    all ``total_kv_heads`` of all layers (each stage's heads joined, a replicated head taken from the
    first rank that holds it, then the stages' layers in stage order); ``None`` as soon as one rank's
    read failed; :data:`PENDING` until then. One rank (no tensor or pipeline parallel): ``kv`` as is.

    The layers each rank holds come from its announcement (:meth:`announce`, checked: a stage's layers
    are consecutive and follow the stage before); :meth:`layers` routes a claim's K/V by them. Not
    thread-safe: its caller holds the lock its read-backs arrive under."""

    def __init__(self, tp_size: int = 1, total_kv_heads: int = 1, pp_size: int = 1):
        self.tp_size = tp_size
        self.pp_size = pp_size
        #: every worker rank (``pp_size * tp_size``, :func:`worker_rank`)
        self.size = tp_size * pp_size
        self.ranges = (
            [kv_head_range(r, tp_size, total_kv_heads) for r in range(tp_size)] if tp_size > 1 else []
        )
        # the ranks whose pieces make up all heads of all layers: in each stage, each head range's first
        first: dict[tuple[int, int], int] = {}
        for r, heads in enumerate(self.ranges):
            first.setdefault(heads, r)
        self._needed = [
            [stage * tp_size + first[heads] for heads in sorted(first)] if first else [stage * tp_size]
            for stage in range(pp_size)
        ]
        #: pipeline stage -> the layers ``[start, stop)`` its ranks announced
        self._stage_layers: dict[int, tuple[int, int]] = {}
        #: request id -> rank -> its K/V, while ranks are missing
        self._pieces: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, request_id: str, rank: int, kv: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
        if self.size == 1 or kv is None:
            self._pieces.pop(request_id, None)
            return kv
        self._check_rank(rank)
        pieces = self._pieces.setdefault(request_id, {})
        pieces[rank] = kv
        if any(r not in pieces for stage in self._needed for r in stage):
            return PENDING
        del self._pieces[request_id]
        stages = [[pieces[r] for r in stage] for stage in self._needed]
        keys = [
            torch.cat([k for k, _ in stage], dim=2) if len(stage) > 1 else stage[0][0] for stage in stages
        ]
        values = [
            torch.cat([v for _, v in stage], dim=2) if len(stage) > 1 else stage[0][1] for stage in stages
        ]
        if len(stages) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=0), torch.cat(values, dim=0)

    def has(self, request_id: str, ranks: set[int]) -> bool:
        """Whether every one of ``ranks``' read-backs of the request is kept here (still missing others)."""
        return ranks <= set(self._pieces.get(request_id, ()))

    def discard(self, request_id: str) -> None:
        self._pieces.pop(request_id, None)

    def announce(self, rank: int, layers: list[int]) -> None:
        """The layers (their indices in the model) worker ``rank`` holds, as it announced them: a run of
        consecutive layers, the same for every rank of its stage, after the stage before's and before
        the stage after's (vLLM's partition); ``ValueError`` otherwise (its read-backs could not be
        joined in layer order)."""
        self._check_rank(rank)
        stage = rank // self.tp_size
        if not layers or list(layers) != list(range(layers[0], layers[0] + len(layers))):
            raise ValueError(f"rank {rank} holds layers {list(layers)}: not a run of consecutive layers")
        span = (layers[0], layers[0] + len(layers))
        known = self._stage_layers.setdefault(stage, span)
        if known != span:
            raise ValueError(f"rank {rank} holds layers {span}; another rank of stage {stage} holds {known}")
        for other, (start, stop) in self._stage_layers.items():
            if (other < stage and stop > span[0]) or (other > stage and start < span[1]):
                raise ValueError(
                    f"stage {stage} holds layers [{span[0]}, {span[1]}), stage {other} [{start}, {stop}): "
                    "the stages' layers are not in stage order"
                )

    def layers(self, rank: int) -> slice | None:
        """The layers of a claim's ``[layers, ...]`` K/V worker ``rank`` holds: a slice, ``None`` until
        its stage announced them; all layers without pipeline parallel."""
        if self.pp_size == 1:
            return slice(None)
        span = self._stage_layers.get(rank // self.tp_size)
        return None if span is None else slice(*span)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"a read-back from rank {rank}; this server has {self.size} ranks")


def rank_assembly(vllm_config: Any) -> RankAssembly:
    """The :class:`RankAssembly` of vLLM's tensor- and pipeline-parallel workers (one rank: read-backs
    as they come)."""
    tp, pp = tensor_parallel_size(vllm_config), pipeline_parallel_size(vllm_config)
    if tp == 1 and pp == 1:
        return RankAssembly()
    heads = vllm_config.model_config.get_total_num_kv_heads() if tp > 1 else 1
    return RankAssembly(tp, heads, pp)

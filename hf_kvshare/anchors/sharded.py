"""The anchors engine's per-rank primitives under tensor parallel, exact to one rank (issue 51).

A tensor-parallel worker holds its own KV heads: of a layer's ``[L, D]`` keys or values matrix
(:func:`~.lowrank.to_matrix`, ``D = kv_heads * head_dim``) rank ``p`` holds the columns ``Z_p``
``[L, D_p]`` of its heads, in order (``serving.tensor_parallel.kv_head_range``; every rank holds as
many columns; with fewer KV heads than ranks, ``replicas`` consecutive ranks hold the same head).
Here the ranks compute, on ``torch.distributed`` collectives of the group a worker passes (vLLM's
``get_tp_group().device_group``; no vLLM import), what one process computes over all columns:

- :func:`sharded_factors`: :meth:`~.lowrank.MatrixFactors.from_matrix`'s factors ``A B`` of ``Z``,
  ``A`` ``[L, k]`` identical on every rank and each rank's columns ``B_p`` ``[k, D_p]`` of ``B``
  (float32 round-off from the one-rank factors; the dense rule and the rank clamp on the global ``D``).
- :func:`sharded_gate_distances`: :func:`~.correction.gate_distances` from each rank's heads of the
  values and its columns of every anchor's ``B``: one all-reduce of ``[n]`` per call, so every rank
  holds the same distances bit for bit and takes the same gate decision.
- A rank's correction rows are ``a @ b_p`` (:func:`~.correction.weighted_sum` over its factors): its
  heads of the one-rank correction, computed where its heads live.

Communication per layer and side (:func:`communication_bytes`; ``q`` the rank kept, ``p`` ranks,
``niter = 2`` as ``torch.svd_lowrank``), against today's read-back (each rank ships its ``L x D_p``
K/V, bf16, to the scheduler's host):

============  ========================================  ==================================
svd           all-reduces (float32 payload each)        all-gathers (each rank's block)
============  ========================================  ==================================
randomized    ``L >= D``: 3 of ``[L, q]``               2 of ``[D_p, q]``, 1 of ``[q, D_p]``
              ``L < D``: 2 of ``[L, q]``, 1 of ``[q, L]``  3 of ``[D_p, q]``
exact         none                                      1 of ``[L, D_p]`` (the K/V's dtype)
============  ========================================  ==================================

The exact SVD of a column-sharded matrix needs all of it: each rank sends its columns to the ``p - 1``
others and receives theirs (device to device), ``p - 1`` times its own read-back each way, then runs
the same full SVD as one rank (``p`` times the compute in the group). The randomized SVD (KVCMAS's
default) moves ``[L, q]`` float32 partial sums instead, whatever ``p``: with a ring all-reduce at
``q = 32`` and Llama-3.1-8B's 8 KV heads x 128 a rank sends 0.4x its bf16 read-back at TP = 2 and
2.7x at TP = 8 (docs/architecture.md, "The plan for KVCMAS under TP"); the bytes stay on the devices'
links, and the host holds no K/V.

The anchors engine runs on one rank's heads (SPMD) through :class:`Shard`'s hooks ``column_sum``,
``any``, ``total_columns``, ``factors`` and ``count``, called by ``lowrank.column_sum`` / ``any_rank`` /
``columns`` / ``factorize`` / ``bound_count`` with the engine's shard (``BoundedStore.shard``;
docs/architecture.md).

Under pipeline parallel a stage holds every head of its layers: :class:`StageShard` carries the same hooks
over layers (a sum over layers all-reduced over the stages, a per-layer partial placed among every
layer's first, a bound's byte count all-reduced, factorizations local; docs/architecture.md, "Pipeline
stages"). Tensor and pipeline parallel together: a rank holds its heads' columns of its stage's layers,
a :class:`StageShard` with ``heads`` (a :class:`Shard` of the stage's tensor-parallel group): a sum is
reduced over the stage's column blocks, then over the stages (the same tensor-parallel rank of each),
a bound's count over the stages only, factorizations sharded over the heads' group.

The scheduler's copy of the engine holds no K/V at all: it runs as a **follower**
(:class:`FollowerShard`) on ``meta`` stand-ins of every read-back (full width, zero bytes), and every
value a decision reads (each hook's reduced result) it takes from the leader, rank 0, whose
:class:`Shard` hands each one to its ``publish`` in call order. A follower that receives another shape
than the one it computes the hook for, or none, has left the leader's path: :class:`FollowerDiverged`.

Only this module calls ``torch.distributed`` collectives in the package (``tests/test_layout.py``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..measure import phase
from .correction import gate_distance_terms
from .lowrank import (
    FACTORIZATIONS,
    RANDOMIZED_SVD_SEED,
    FactoredKV,
    MatrixFactors,
    _truncated_svd,
    check_rank,
    check_svd,
    kept_rank,
    to_matrix,
)
from .pool import Anchor

__all__ = [
    "COLLECTIVES",
    "CollectiveCount",
    "FollowerDiverged",
    "FollowerShard",
    "Shard",
    "StageShard",
    "communication_bytes",
    "mirrors_svd_lowrank",
    "sharded_factored_kv",
    "sharded_factors",
    "sharded_gate_distances",
]

#: subspace iterations of the randomized range finder (``torch.svd_lowrank``'s default, the one-rank call's)
NITER = 2


def _published(publish: Callable[[torch.Tensor], None] | None, reduced: torch.Tensor) -> torch.Tensor:
    """``reduced``, handed to ``publish`` first (a detached CPU copy: the caller may write its own)."""
    if publish is not None:
        publish(reduced.detach().to("cpu", copy=True))
    return reduced


class CollectiveCount:
    """Calls and bytes this process handed to the collectives here: ``all_reduce`` (the tensor's
    bytes) and ``all_gather`` (this rank's block's bytes). Read by tests against
    :func:`communication_bytes`; cheap enough to stay on."""

    NAMES = ("all_reduces", "all_reduce_bytes", "all_gathers", "all_gather_bytes")

    def __init__(self) -> None:
        self._counts = dict.fromkeys(self.NAMES, 0)
        self._lock = threading.Lock()

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        """One ``kind`` (``"all_reduce"`` or ``"all_gather"``) of ``tensor``."""
        with self._lock:
            self._counts[f"{kind}s"] += 1
            self._counts[f"{kind}_bytes"] += tensor.numel() * tensor.element_size()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def since(self, snapshot: dict[str, int]) -> dict[str, int]:
        now = self.snapshot()
        return {k: now[k] - snapshot[k] for k in now}


#: the process-wide count of collectives (see :class:`CollectiveCount`)
COLLECTIVES = CollectiveCount()


@dataclass(frozen=True)
class Shard:
    """This rank's place in a column-sharded matrix: the ``group`` (``None``: the default group), this
    rank's ``width`` (its columns; the same on every rank) and ``replicas`` (consecutive ranks holding
    the same columns: vLLM's replicated KV heads, ``ranks / kv_heads``).

    ``publish`` (the leader's, rank 0's; ``None`` elsewhere): every value an engine hook returns that a
    decision reads (``column_sum``'s sum; ``any``'s flag as a 1-element float64 tensor, ``count``'s
    bytes as a 1-element int64 one) is handed to it in call order, a detached CPU copy, for a :class:`FollowerShard` to replay."""

    group: dist.ProcessGroup | None
    width: int
    replicas: int = 1
    publish: Callable[[torch.Tensor], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        size = self.size
        if self.replicas < 1 or size % self.replicas:
            raise ValueError(f"{size} ranks do not hold {self.replicas} replicas of each column block")
        if dist.get_rank(self.group) < 0:
            raise ValueError("this process is not a rank of the group")

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def owner(self) -> bool:
        """Whether this rank's columns count in a sum (the first of its replicas)."""
        return self.rank % self.replicas == 0

    @property
    def dim(self) -> int:
        """The global column count ``D``."""
        return self.width * self.blocks

    @property
    def blocks(self) -> int:
        """The distinct column blocks over the group's ranks."""
        return self.size // self.replicas

    @property
    def columns(self) -> slice:
        """This rank's columns of the global ``D``."""
        start = self.rank // self.replicas * self.width
        return slice(start, start + self.width)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the column blocks of ``partial`` (a replica's copy counted once), on every rank,
        in place: ``partial`` is this module's own work tensor."""
        partial = partial.contiguous()
        if not self.owner:
            partial.zero_()
        COLLECTIVES.add("all_reduce", partial)
        dist.all_reduce(partial, group=self.group)
        return partial

    # the anchors engine's hooks (SPMD): ``lowrank.column_sum`` / ``any_rank`` / ``columns`` / ``factorize``
    # call them under the engine's shard and do the one-rank operation without one
    #: the model's index of this member's first layer (every layer's heads: 0)
    first_layer = 0

    def column_sum(self, partial: torch.Tensor, layer_axis: int | None = None) -> torch.Tensor:
        """A sum over ``D`` each rank computed over its own columns (``partial``, any shape, the caller's
        own work tensor): the sum over every column block, the same bits on every rank (every layer is on
        every rank: ``layer_axis`` needs nothing)."""
        return self._published(self.all_reduce(partial))

    def any(self, test: bool | Callable[[], bool]) -> bool:
        """Whether ``test`` (a test of this rank's columns, e.g. "they hold NaN or inf": a bool, or a
        function computing it, which a follower never calls) holds on any rank: the same answer on
        every rank (one all-reduce of one number)."""
        flag = test() if callable(test) else test
        return bool(self._published(self.all_reduce(torch.tensor([float(flag)], dtype=torch.float64))).item())

    def _published(self, reduced: torch.Tensor) -> torch.Tensor:
        return _published(self.publish, reduced)

    def total_columns(self, local: int, layers: int | None = None) -> int:
        """A count of features over every rank from this rank's ``local`` count (a mean over ``D``, the
        rank clamp; the bytes of its heads' K/V: one rank's bytes); every layer is on every rank."""
        return local * self.blocks

    def total_layers(self, local: int) -> int:
        """The model's layer count: every rank holds every layer."""
        return local

    def count(self, count: Callable[[], int]) -> int:
        """A byte count a bound compares (``count()``, one-rank terms; every rank counts the same):
        published by the leader for the follower, which cannot count its stand-ins."""
        counted = int(count())
        self._published(torch.tensor([counted], dtype=torch.int64))
        return counted

    def factors(self, matrix: torch.Tensor, rank: int | None, svd: str) -> MatrixFactors:
        """:func:`sharded_factors` of this rank's columns ``[L, D_p]`` over the group."""
        return sharded_factors(matrix, rank, svd, self.group, replicas=self.replicas)

    def all_gather(self, block: torch.Tensor, dim: int) -> torch.Tensor:
        """Every column block's ``block`` joined along ``dim`` in column order (a replica's once)."""
        block = block.contiguous()
        blocks = [torch.empty_like(block) for _ in range(self.size)]
        COLLECTIVES.add("all_gather", block)
        dist.all_gather(blocks, block, group=self.group)
        return torch.cat(blocks[:: self.replicas], dim=dim)


@dataclass(frozen=True)
class StageShard:
    """This pipeline stage's place: the layers ``[start, stop)`` of a model of ``layers`` layers, the
    stages of ``group`` (``None``: the default group) holding the others (docs/architecture.md, "Pipeline
    stages"), every head of them, or (``heads``, tensor and pipeline parallel together) this rank's
    columns of them, the stage's tensor-parallel group sharing the others. The engine's hooks as
    :class:`Shard`'s, over layers instead of columns: ``column_sum`` all-reduces a stage's sum over its
    layers (a partial with a per-layer axis, ``layer_axis``, is first written into a zero-filled tensor
    of every layer), ``any`` and ``count`` all-reduce the stage's flag and byte count (a stage's bytes
    are its layers'), ``factors`` is local (a layer's factors are whole), ``total_columns`` keeps a
    layer's width and scales a count over this stage's layers to every layer's. ``publish``: as
    :attr:`Shard.publish` (stage 0's, for a follower).

    With ``heads`` (a :class:`Shard` of the stage's tensor-parallel group, publishing nothing) a sum and
    a flag are first reduced over the stage's column blocks (:meth:`Shard.all_reduce`: a replicated
    head's copy counted once), then over ``group``, the same tensor-parallel rank of every stage
    (:func:`pipeline_parallel_groups`): every rank of the grid holds the same bits. ``count`` stays over
    ``group`` (every rank of a stage counts the one-rank terms of its layers, ``total_columns`` times
    the column blocks as :class:`Shard`'s), ``factors`` are :func:`sharded_factors` over the heads'
    group, and ``columns`` / ``owner`` / ``replicas`` / ``blocks`` / ``all_gather`` are the heads'."""

    group: dist.ProcessGroup | None
    start: int
    stop: int
    layers: int
    publish: Callable[[torch.Tensor], None] | None = field(default=None, compare=False)
    heads: Shard | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.layers:
            raise ValueError(
                f"a pipeline stage holds layers [start, stop) of the model's {self.layers} with "
                f"0 <= start < stop <= {self.layers}, got [{self.start}, {self.stop})"
            )
        if self.heads is not None and (not isinstance(self.heads, Shard) or self.heads.publish is not None):
            raise ValueError(
                "a stage's heads are a Shard of its tensor-parallel group that publishes nothing (the stage "
                f"publishes the reduced values); got {self.heads!r}"
            )
        if dist.get_rank(self.group) < 0:
            raise ValueError("this process is not a stage of the group")

    # every column of its layers (one block, counted in every sum), or its heads' columns
    @property
    def replicas(self) -> int:
        return 1 if self.heads is None else self.heads.replicas

    @property
    def blocks(self) -> int:
        return 1 if self.heads is None else self.heads.blocks

    @property
    def owner(self) -> bool:
        return self.heads is None or self.heads.owner

    @property
    def columns(self) -> slice:
        return slice(None) if self.heads is None else self.heads.columns

    @property
    def first_layer(self) -> int:
        """The model's index of this stage's first layer (its local layer 0)."""
        return self.start

    def _over_stages(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of ``partial`` over the stages (``group``), in place."""
        partial = partial.contiguous()
        COLLECTIVES.add("all_reduce", partial)
        dist.all_reduce(partial, group=self.group)
        return partial

    def _over_heads(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of ``partial`` over the stage's column blocks (with ``heads``; else ``partial``)."""
        return partial if self.heads is None else self.heads.all_reduce(partial)

    def column_sum(self, partial: torch.Tensor, layer_axis: int | None = None) -> torch.Tensor:
        """A sum over this stage's layers (``partial``, the caller's own work tensor; with ``heads``
        over its columns) summed over every stage (and every column block); with ``layer_axis``
        (``partial`` indexed by this stage's layers there) every layer's entry in place:
        ``[..., layers, ...]``. The same bits on every rank."""
        if layer_axis is not None:
            axis = layer_axis % partial.dim()
            if partial.shape[axis] != self.stop - self.start:
                raise ValueError(
                    f"expected {self.stop - self.start} layers on axis {layer_axis} of a stage's partial, "
                    f"got shape {tuple(partial.shape)}"
                )
            partial = self._over_heads(partial)  # the stage's columns first, on the stage's layers only
            shape = list(partial.shape)
            shape[axis] = self.layers
            full = partial.new_zeros(shape)
            full.narrow(axis, self.start, self.stop - self.start).copy_(partial)
            return _published(self.publish, self._over_stages(full))
        return _published(self.publish, self._over_stages(self._over_heads(partial)))

    def any(self, test: bool | Callable[[], bool]) -> bool:
        """Whether ``test`` (of this rank's part) holds on any rank: the same answer on every rank."""
        flag = test() if callable(test) else test
        reduced = self._over_stages(self._over_heads(torch.tensor([float(flag)], dtype=torch.float64)))
        return bool(_published(self.publish, reduced).item())

    def total_columns(self, local: int, layers: int | None = None) -> int:
        """A layer's feature count (times the column blocks with ``heads``); a count over this stage's
        ``layers`` layers scaled to every layer's (every layer as wide as this stage's)."""
        local *= self.blocks
        if layers is None:
            return local
        if layers != self.stop - self.start:
            raise ValueError(f"a count over {layers} layers on a stage of {self.stop - self.start}")
        return local * self.layers // layers

    def total_layers(self, local: int) -> int:
        """The model's layer count (``local``: this stage's)."""
        return self.layers

    def count(self, count: Callable[[], int]) -> int:
        """A byte count a bound compares: this stage's layers' ``count()`` (one-rank terms: alike on
        every rank of a stage) summed over every stage (one all-reduce over ``group``, never over the
        heads), the one-rank count on every rank; published for the follower."""
        reduced = self._over_stages(torch.tensor([int(count())], dtype=torch.int64))
        return int(_published(self.publish, reduced).item())

    def factors(self, matrix: torch.Tensor, rank: int | None, svd: str) -> MatrixFactors:
        """The one-rank factors of one of this stage's layers (no communication), or with ``heads`` the
        sharded factors of its columns over the heads' group (:func:`sharded_factors`)."""
        if self.heads is not None:
            return self.heads.factors(matrix, rank, svd)
        return MatrixFactors.from_matrix(matrix, rank, svd)

    def all_gather(self, block: torch.Tensor, dim: int) -> torch.Tensor:
        """Every column block's ``block`` of this stage joined along ``dim`` (without ``heads``: ``block``)."""
        return block if self.heads is None else self.heads.all_gather(block, dim)


class FollowerDiverged(ValueError):
    """A follower received another value than the hook it runs expects, or none (its ``receive`` raised,
    e.g. timed out): it is no longer on the leader's path (a record or plan taken in another order,
    another method configuration, a lost message)."""


class FollowerShard:
    """A member of the group holding no column's values (the scheduler's copy of the engine): its K/V
    are ``meta`` stand-ins of every column (the one-rank shapes, zero bytes), and every reduced value
    a decision reads comes from ``receive`` (the leader's :attr:`Shard.publish`, in order; ``receive``
    blocks with its caller's bound and raises on timeout). No ``torch.distributed``: it joins no group.

    Its hooks are :class:`Shard`'s: ``column_sum``, ``any`` and ``count`` return the next received value
    (checked against the shape and dtype the hook computes: else :class:`FollowerDiverged`), ``total_columns`` is its own
    count (it holds every column), ``factors`` the ``meta`` factors one rank would keep. It never reads a
    ``meta`` value: what it cannot compute it receives, and anything else reading one fails loudly."""

    #: a full-width member: one block, every column, counted in every sum
    replicas = 1
    blocks = 1
    owner = True
    columns = slice(None)

    def __init__(self, receive: Callable[[], torch.Tensor]):
        self.receive = receive

    def _next(self, hook: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        try:
            received = self.receive()
        except Exception as error:  # a timeout, a closed channel: every later value would be misplaced
            raise FollowerDiverged(
                f"the follower's {hook} received nothing from the leader ({type(error).__name__}: {error}): "
                "it is no longer on the leader's path"
            ) from error
        if (
            not isinstance(received, torch.Tensor)
            or tuple(received.shape) != tuple(shape)
            or received.dtype != dtype
        ):
            got = (
                f"{tuple(received.shape)} {received.dtype}"
                if isinstance(received, torch.Tensor)
                else type(received).__name__
            )
            raise FollowerDiverged(
                f"the follower's {hook} expected a value of shape {tuple(shape)} {dtype} from the leader, "
                f"received {got}: it is no longer on the leader's path"
            )
        return received

    first_layer = 0

    def column_sum(self, partial: torch.Tensor, layer_axis: int | None = None) -> torch.Tensor:
        """The leader's sum over every column of ``partial`` (this member's is a ``meta`` stand-in, of
        every layer)."""
        return self._next("column_sum", tuple(partial.shape), partial.dtype)

    def any(self, test: bool | Callable[[], bool]) -> bool:
        """The leader's answer (``test`` is not evaluated: it would read this member's stand-ins)."""
        return bool(self._next("any", (1,), torch.float64).item())

    def total_columns(self, local: int, layers: int | None = None) -> int:
        return local

    def total_layers(self, local: int) -> int:
        return local

    def count(self, count: Callable[[], int]) -> int:
        """The leader's byte count (``count`` is not called: this member's stand-ins hold no storage as
        values do, views and copies alike)."""
        return int(self._next("count", (1,), torch.int64).item())

    def factors(self, matrix: torch.Tensor, rank: int | None, svd: str) -> MatrixFactors:
        """The factors one rank keeps of ``matrix`` ``[L, D]``, as ``meta`` stand-ins of their shapes
        (dense: the matrix itself); nothing is computed or received."""
        if matrix.dim() != 2:
            raise ValueError(f"expected an [L, D] matrix, got shape {tuple(matrix.shape)}")
        length, dim = matrix.shape
        k = kept_rank(length, dim, rank, svd)
        if k is None:
            return MatrixFactors(a=matrix.detach())
        meta = {"dtype": matrix.dtype, "device": "meta"}
        return MatrixFactors(a=torch.empty(length, k, **meta), b=torch.empty(k, dim, **meta))


def sharded_factors(
    z_local: torch.Tensor,
    rank: int | None,
    svd: str = "exact",
    group: dist.ProcessGroup | None = None,
    *,
    replicas: int = 1,
) -> MatrixFactors:
    """This rank's share of :meth:`MatrixFactors.from_matrix(Z, rank, svd) <.lowrank.MatrixFactors.from_matrix>`
    for ``Z`` column-sharded over ``group``: ``z_local`` ``[L, D_p]`` is this rank's columns.

    Returns ``MatrixFactors(a, b_local)``: ``a`` ``[L, k]`` identical on every rank, ``b_local``
    ``[k, D_p]`` this rank's columns of ``b``; ``a @ cat(every rank's b_local, dim=1)`` is the one-rank
    reconstruction to float32 round-off. The rank clamp ``min(rank, L, D)`` and the dense rule
    (``k (L + D) >= L D``: keep ``Z``; ``rank=None`` too) use the global ``D``; kept dense the result is
    ``MatrixFactors(z_local)`` (``b is None``, this rank's columns as they are), with no communication.

    ``svd="randomized"`` runs ``torch.svd_lowrank(Z, q=k, niter=2)``'s own algorithm (Halko et al.
    5.1 on the transpose when ``L < D``), its random matrix drawn as the one-rank call draws it
    (seeded by ``RANDOMIZED_SVD_SEED``, all of it on every rank, each rank using its rows where they
    meet its columns): products ``Z @ X`` are local products all-reduced, products ``Z^T @ Y`` local
    row blocks all-gathered where a QR needs them whole; the small QRs and SVD run identically on
    every rank. ``svd="exact"`` all-gathers ``Z`` (device to device) and runs the one-rank SVD.
    Counted in ``FACTORIZATIONS`` as ``from_matrix`` counts (once per rank's process).
    """
    if z_local.dim() != 2:
        raise ValueError(f"expected an [L, D_p] matrix, got shape {tuple(z_local.shape)}")
    check_rank(rank)  # bad input refused before the group is asked anything
    check_svd(svd)
    shard = Shard(group, z_local.shape[1], replicas)
    k = kept_rank(z_local.shape[0], shard.dim, rank, svd)  # the global D's rule
    FACTORIZATIONS.add(svd=k is not None)
    with phase("factorize"):
        if k is None:
            return MatrixFactors(a=z_local.detach().clone(), blocks=shard.blocks)
        if svd == "exact":
            a, b = _truncated_svd(shard.all_gather(z_local.detach(), dim=1), k, svd)
        else:
            if not mirrors_svd_lowrank():  # every rank runs the same probe: every rank refuses
                raise NotImplementedError(
                    f"torch {torch.__version__}'s svd_lowrank runs another algorithm than the one sharded "
                    "here (torch 2.13's): its factors would not be the one-rank factors; use svd='exact'"
                )
            a, b = _randomized_svd(z_local.detach(), k, shard)
        b_local = b[:, shard.columns]
        return MatrixFactors(
            a=a.to(z_local.dtype).contiguous(), b=b_local.to(z_local.dtype).contiguous(), blocks=shard.blocks
        )


def sharded_factored_kv(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    rank: int | None,
    svd: str = "exact",
    group: dist.ProcessGroup | None = None,
    *,
    replicas: int = 1,
) -> FactoredKV:
    """:meth:`FactoredKV.from_kv <.lowrank.FactoredKV.from_kv>` of a segment's K/V over every head, from
    this rank's heads: per-layer ``keys`` / ``values`` ``[batch, heads_p, L, head_dim]`` (keys canonical).
    Each layer's keys and values are factorized by :func:`sharded_factors`, layer by layer in the same
    order on every rank (the collectives pair up); ``kv_heads`` is this rank's heads, so
    ``to_heads(factors.reconstruct(), kv_heads)`` is its heads of the one-rank segment."""
    if len(keys) != len(values) or not keys:  # from_kv refuses it, before the group is asked anything
        return FactoredKV.from_kv(keys, values, rank, svd)
    return FactoredKV.from_kv(
        keys, values, rank, svd, shard=Shard(group, to_matrix(keys[0]).shape[1], replicas)
    )


class _OneProcess:
    """:class:`Shard`'s operations over one process holding every column (the probe's)."""

    def __init__(self, dim: int):
        self.dim, self.columns = dim, slice(None)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def all_gather(self, block: torch.Tensor, dim: int) -> torch.Tensor:
        return block


@functools.cache
def mirrors_svd_lowrank() -> bool:
    """Whether the installed torch's ``svd_lowrank`` runs the algorithm :func:`sharded_factors` mirrors
    (torch 2.13's ``_lowrank.py``: the transpose factored only when ``L < D``; older releases also
    factored it when ``D > q``, another random matrix): this module's one-process run against
    ``lowrank._truncated_svd`` on a tall and a wide seeded probe, once per process."""
    generator = torch.Generator().manual_seed(0)
    for shape in ((12, 8), (8, 12)):
        z = torch.randn(shape, generator=generator, dtype=torch.float64)
        a, b = _randomized_svd(z, 2, _OneProcess(z.shape[1]))
        one_a, one_b = _truncated_svd(z, 2, "randomized")
        if not torch.allclose(a @ b, one_a @ one_b, rtol=1e-9, atol=1e-12):
            return False
    return True


def _random_matrix(rows: int, q: int, like: torch.Tensor) -> torch.Tensor:
    """The range finder's ``[rows, q]`` Gaussian matrix, drawn as ``lowrank._truncated_svd``'s
    ``torch.svd_lowrank`` draws it: the first draw after seeding ``RANDOMIZED_SVD_SEED``, the global
    RNG untouched."""
    devices = [like.device] if like.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(RANDOMIZED_SVD_SEED)
        return torch.randn(rows, q, dtype=like.dtype, device=like.device)


def _randomized_svd(
    z_local: torch.Tensor, q: int, shard: Shard | _OneProcess
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U_q S_q, V_q^T)`` of the column-sharded ``Z`` as ``torch.svd_lowrank(Z, q, niter=2)`` computes
    them (``torch/_lowrank.py``: ``get_approximate_basis`` then the SVD of ``Q^H A``), ``b`` whole
    (``[q, D]``, the caller takes its columns). Each step mirrors the one-rank operation, so one rank
    gives the same bits."""
    z = z_local if z_local.dtype == torch.float64 else z_local.float()
    cols = shard.columns
    length, dim = z.shape[0], shard.dim

    def z_times(x: torch.Tensor) -> torch.Tensor:  # Z @ X, X [D, q]: [L, q] summed over the columns
        return shard.all_reduce(z @ x[cols])

    def zt_times(y: torch.Tensor) -> torch.Tensor:  # Z^T @ Y, Y [L, q]: [D, q] joined by rows
        return shard.all_gather(z.mH @ y, dim=0)

    def qr(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.qr(x).Q

    if length >= dim:  # A = Z (tall): the range of Z's columns
        basis = qr(z_times(_random_matrix(dim, q, z)))
        for _ in range(NITER):
            basis = qr(z_times(qr(zt_times(basis))))
        projected = shard.all_gather(basis.mH @ z, dim=1)  # Q^H A [q, D]
        u, s, vh = torch.linalg.svd(projected, full_matrices=False)
        return basis.matmul(u) * s, vh
    # A = Z^T (wide: svd_lowrank factors the transpose): the range of Z's rows
    basis = qr(zt_times(_random_matrix(length, q, z)))
    for _ in range(NITER):
        basis = qr(zt_times(qr(z_times(basis))))
    projected = shard.all_reduce(basis[cols].mH @ z.mH)  # Q^H A = Q^T Z^T [q, L]
    u, s, vh = torch.linalg.svd(projected, full_matrices=False)
    return vh.mH * s, basis.matmul(u).T


def sharded_gate_distances(
    values_local: list[torch.Tensor],
    anchors_local: list[Anchor],
    rows: int,
    group: dist.ProcessGroup | None = None,
    *,
    replicas: int = 1,
) -> torch.Tensor:
    """:func:`~.correction.gate_distances` over every head, from this rank's heads: ``values_local`` its
    per-layer values ``[batch, heads_p, S, head_dim]``, ``anchors_local`` the anchors (``Anchor``s) whose
    base values' factors hold ``a`` whole and this rank's columns of ``b`` (:func:`sharded_factors`;
    a dense base: this rank's columns). Every term of ``||V - A B||^2`` is a sum over columns, so each
    rank sums its own (:func:`~.correction.gate_distance_terms`) and one all-reduce of the ``[n]``
    float64 terms per call (not per layer) gives every rank the same distances, bit for bit: every rank
    then takes the same gate decision (``gate.reliability_gate``)."""
    width = values_local[0].shape[1] * values_local[0].shape[3]
    shard = Shard(group, width, replicas)
    terms = shard.all_reduce(gate_distance_terms(values_local, anchors_local, rows))
    return terms.clamp_min(0).sqrt()


def communication_bytes(
    length: int, dim: int, tp: int, rank: int, svd: str, kv_bytes: int = 2, replicas: int = 1
) -> dict[str, int]:
    """Bytes one of ``tp`` ranks hands to the collectives of :func:`sharded_factors` for one ``[L, D]``
    matrix (a layer's keys or values) at ``rank``, computed from the shapes (the counts
    :data:`COLLECTIVES` takes, float32 work): ``all_reduce`` (payloads), ``all_gather`` (this rank's
    blocks), ``sent`` (what a ring algorithm sends from each rank: ``2 (p - 1) / p`` of an all-reduce's
    payload, ``p - 1`` blocks of an all-gather), against ``read_back``: this rank's ``L x D_p`` K/V in
    ``kv_bytes`` per number (bf16: 2), what today's path ships to the scheduler's host. The exact mode
    gathers the K/V in their own dtype (``kv_bytes``). Either orientation of the randomized SVD makes
    three ``L x q`` all-reduces and three ``D_p x q`` gathers."""
    check_svd(svd)
    width = dim * replicas // tp
    k = min(rank, length, dim)
    out = {"all_reduce": 0, "all_gather": 0, "read_back": length * width * kv_bytes}
    if k * (length + dim) < length * dim:  # factorized (else kept dense: no communication)
        if svd == "exact":
            out["all_gather"] = length * width * kv_bytes
        else:
            out["all_reduce"] = (1 + NITER) * length * k * 4
            out["all_gather"] = (1 + NITER) * width * k * 4
    out["sent"] = (2 * (tp - 1) * out["all_reduce"]) // tp + (tp - 1) * out["all_gather"]
    return out


def tensor_parallel_groups(tp_size: int, timeout_s: float) -> dist.ProcessGroup:
    """This rank's tensor-parallel group for a worker's engine replica (``serving/replica.py``): a gloo
    group made by every rank of the world for every tensor-parallel group in the same order (vLLM's
    groups are consecutive ranks), so ``new_group`` pairs up. Gloo on CUDA too: the replica's collectives
    run on a thread of their own in an order unrelated to the model's, and NCCL communicators interleaved
    across threads in different orders on different ranks can deadlock; gloo's host collectives cannot
    (their tensors are small: ``[n]`` distances, the randomized SVD's ``[L, q]`` products)."""
    import datetime

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp_size:
        raise ValueError(f"a world of {world} ranks is not made of tensor-parallel groups of {tp_size}")
    mine = None
    for first in range(0, world, tp_size):
        group = dist.new_group(
            list(range(first, first + tp_size)), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
        if first <= rank < first + tp_size:
            mine = group
    return mine


def pipeline_parallel_groups(tp_size: int, pp_size: int, timeout_s: float) -> dist.ProcessGroup:
    """This rank's pipeline-parallel group for a stage's engine replica (:class:`StageShard`): a gloo
    group made by every rank of the world for every pipeline-parallel group in the same order, as
    :func:`tensor_parallel_groups` (vLLM's rank is ``pp_rank * tp_size + tp_rank``: a group is the ranks
    of one tensor-parallel rank over the stages)."""
    import datetime

    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp_size * pp_size:
        raise ValueError(
            f"a world of {world} ranks is not {tp_size} tensor- x {pp_size} pipeline-parallel ranks"
        )
    mine = None
    for first in range(tp_size):
        ranks = list(range(first, world, tp_size))
        group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        if rank in ranks:
            mine = group
    return mine

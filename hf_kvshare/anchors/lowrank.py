"""Per-layer storage of segment K/V in low-rank (truncated SVD) or dense form.

A segment's keys or values in one layer are ``[batch, kv_heads, L, head_dim]``; we store them as
one matrix ``Z`` of shape ``[L, D]`` with ``D = kv_heads * head_dim`` (batch element 0: a PH
segment's K/V is identical across a batch). KVCMAS keeps ``Z ≈ A B`` with ``A = U_r Σ_r``
``[L, r]`` and ``B = R_r^T`` ``[r, D]``; KVComm keeps ``Z`` itself.

Keys are stored in the canonical positional frame (as if the segment started at position 0);
:mod:`hf_kvshare.anchors.correction` rotates them where they are compared or applied.

Under tensor parallel a rank holds its heads' columns ``[L, D_p]`` (under pipeline parallel a stage its
layers: :class:`~.sharded.StageShard`): the anchors engine takes one shard context (:class:`~.sharded.Shard`; ``None``, the default: one process holds every column) and every
reduction over ``D`` and every factorization goes through one of the hooks here (:func:`column_sum`,
:func:`any_rank`, :func:`columns`, :func:`factorize`; a bound's byte count: :func:`bound_count`; the model's
layer indices on a pipeline stage: :func:`layer_offset`, :func:`layer_count`), which
under a shard call its methods (the collectives live in :mod:`.sharded`), so every rank gets the one-rank
result (its columns of it), and the scheduler's follower (``FollowerShard``) the leader's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..cache import storage_bytes
from ..measure import phase

if TYPE_CHECKING:  # it builds on this module
    from .sharded import Shard

#: how :meth:`MatrixFactors.from_matrix` truncates: ``"exact"`` (``torch.linalg.svd``) or
#: ``"randomized"`` (``torch.svd_lowrank(q=r, niter=2)``, as the KVCMAS reference code, seeded)
SVD = Literal["exact", "randomized"]
SVD_METHODS = ("exact", "randomized")
#: seed of the randomized range finder (fixed: anchors are reproducible, the global RNG untouched)
RANDOMIZED_SVD_SEED = 0
#: the tag of a :class:`DeferredFactoredKV` a record left as ``Method.deferred_work`` (its caller runs it)
DEFERRED_WORK = "deferred_work"


class FactorizationCount:
    """How many matrices were factorized (:meth:`MatrixFactors.from_matrix` calls: ``matrices``) and
    how many of them ran a truncated SVD (``svds``; the others were kept dense) in this process.

    Read by tests (factorizations per recorded turn, like the host-sync count) and cheap enough to
    stay on: one locked increment per matrix.

    >>> before = FACTORIZATIONS.snapshot()  # doctest: +SKIP
    >>> FACTORIZATIONS.since(before)  # doctest: +SKIP
    {'matrices': 0, 'svds': 0}
    """

    def __init__(self) -> None:
        self.matrices = 0
        self.svds = 0
        self._lock = threading.Lock()

    def add(self, svd: bool) -> None:
        with self._lock:
            self.matrices += 1
            self.svds += int(svd)

    def snapshot(self) -> dict[str, int]:
        return {"matrices": self.matrices, "svds": self.svds}

    def since(self, snapshot: dict[str, int]) -> dict[str, int]:
        now = self.snapshot()
        return {k: now[k] - snapshot[k] for k in now}


#: the process-wide count of factorizations (see :class:`FactorizationCount`)
FACTORIZATIONS = FactorizationCount()


def check_svd(svd: str) -> None:
    if svd not in SVD_METHODS:
        raise ValueError(f"svd must be one of {', '.join(map(repr, SVD_METHODS))}, got {svd!r}")


def _truncated_svd(matrix: torch.Tensor, r: int, svd: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U_r Σ_r, V_r^T)`` of ``matrix`` ``[L, D]`` in float32 (float64 stays float64)."""
    m = matrix.detach()
    m = m if m.dtype == torch.float64 else m.float()
    if svd == "exact":
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        return u[:, :r] * s[:r], vh[:r]
    devices = [m.device] if m.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(RANDOMIZED_SVD_SEED)
        u, s, v = torch.svd_lowrank(m, q=r, niter=2)
    return u * s, v.T


def check_rank(rank: int | None) -> None:
    if rank is not None and rank < 1:
        raise ValueError(f"rank must be >= 1 (or None for dense), got {rank}")


def kept_rank(length: int, dim: int, rank: int | None, svd: str) -> int | None:
    """The rank a factorization of an ``[L, D]`` matrix keeps: ``min(rank, L, D)`` (at most that many
    components exist; keeping them all is exact, so clamping loses nothing), or ``None`` where the
    matrix stays dense (``rank=None``, or factors no smaller: ``r (L + D) >= L D``). A ``rank`` below 1
    or an unknown ``svd`` is refused."""
    check_rank(rank)
    check_svd(svd)
    r = None if rank is None else min(rank, length, dim)
    return None if r is None or r * (length + dim) >= length * dim else r


def to_matrix(kv: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, L, head_dim]`` -> ``[L, kv_heads * head_dim]`` (batch element 0, a view-free copy)."""
    if kv.dim() != 4:
        raise ValueError(f"expected [batch, kv_heads, seq, head_dim], got shape {tuple(kv.shape)}")
    _, heads, length, head_dim = kv.shape
    return kv[0].transpose(0, 1).reshape(length, heads * head_dim)


def to_heads(matrix: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[L, kv_heads * head_dim]`` -> ``[1, kv_heads, L, head_dim]`` (inverse of :func:`to_matrix`)."""
    length, dim = matrix.shape
    if dim % kv_heads:
        raise ValueError(f"feature dimension {dim} is not a multiple of {kv_heads} kv heads")
    return matrix.reshape(length, kv_heads, dim // kv_heads).transpose(0, 1).unsqueeze(0)


# ------------------------------------------------------------ the engine's SPMD hooks (one rank: as is)
def column_sum(partial: torch.Tensor, shard: Shard | None, layer_axis: int | None = None) -> torch.Tensor:
    """A sum over ``D`` (and this member's layers) computed over this rank's columns (``partial``, any
    shape): as it is at one rank; under ``shard`` every rank's, all-reduced
    (:meth:`~.sharded.Shard.column_sum`; in place, so ``partial`` must be the caller's own work tensor).
    ``layer_axis``: ``partial`` keeps a per-layer axis there (this member's layers); on a pipeline stage
    the result holds every layer's (:class:`~.sharded.StageShard`)."""
    return partial if shard is None else shard.column_sum(partial, layer_axis)


def any_rank(test: bool | Callable[[], bool], shard: Shard | None) -> bool:
    """Whether a test of this rank's columns holds on any rank: the same on every rank. ``test`` is the
    flag, or a function computing it from this rank's values (a follower, holding none, never calls it:
    :class:`~.sharded.FollowerShard`)."""
    if shard is not None:
        return shard.any(test)
    return test() if callable(test) else test


def columns(local: int, shard: Shard | None, layers: int | None = None) -> int:
    """A count of features (columns) over every rank from this rank's ``local`` count; ``layers``:
    ``local`` counts this member's ``layers`` layers, scaled to every layer's on a pipeline stage."""
    return local if shard is None else shard.total_columns(local, layers)


def layer_offset(shard: Shard | None) -> int:
    """The model's index of this member's first layer: 0 but on a later pipeline stage (a layer rule
    such as ``skip_layer0`` names the model's layers)."""
    return 0 if shard is None else shard.first_layer


def layer_count(local: int, shard: Shard | None) -> int:
    """The model's layer count from this member's ``local`` layers (a pipeline stage holds some)."""
    return local if shard is None else shard.total_layers(local)


def bound_count(count: Callable[[], int], shard: Shard | None) -> int:
    """A byte count a bound compares, the same on every member: ``count()`` (this member's count, in
    one-rank terms: :func:`columns` of its K/V's bytes, :attr:`MatrixFactors.nbytes`), published by the
    leader; a follower, whose ``meta`` stand-ins neither hold nor share storage as values do, takes the
    leader's instead of calling ``count``."""
    return count() if shard is None else shard.count(count)


def factorize(matrix: torch.Tensor, rank: int | None, svd: SVD, shard: Shard | None) -> MatrixFactors:
    """:meth:`MatrixFactors.from_matrix` of this rank's columns ``[L, D_p]``: under ``shard`` the
    sharded factors (:func:`~.sharded.sharded_factors`: ``a`` whole, this rank's columns of ``b``)."""
    return MatrixFactors.from_matrix(matrix, rank, svd) if shard is None else shard.factors(matrix, rank, svd)


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """Singular values of ``[L, D]`` (descending; float64 input stays float64, anything else runs in float32)."""
    if matrix.dim() != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {tuple(matrix.shape)}")
    return torch.linalg.svdvals(matrix if matrix.dtype == torch.float64 else matrix.float())


def effective_rank(matrix: torch.Tensor, energy: float = 0.9) -> int:
    """Smallest rank whose singular values keep ``energy`` of the total ``sum(s**2)`` (paper Fig. 2).

    A zero matrix has effective rank 0.
    """
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    s2 = singular_values(matrix).double().pow(2)
    total = s2.sum()
    if total <= 0:
        return 0
    cumulative = torch.cumsum(s2, 0) / total
    return (
        int(torch.searchsorted(cumulative, torch.tensor(energy, dtype=cumulative.dtype) - 1e-12).item()) + 1
    )


@dataclass(eq=False)
class MatrixFactors:
    """An ``[L, D]`` matrix kept as ``a @ b`` (``a`` ``[L, r]``, ``b`` ``[r, D]``) or dense (``b is None``).

    >>> f = MatrixFactors.from_matrix(torch.randn(40, 64), rank=8)
    >>> f.shape, f.rank
    (torch.Size([40, 64]), 8)
    """

    a: torch.Tensor
    b: torch.Tensor | None = None
    #: the column blocks of a tensor-parallel rank's factors (:func:`~.sharded.sharded_factors`): ``b``
    #: (or a dense ``a``) holds one of them, ``a`` of factors is whole; :attr:`nbytes` counts one rank's
    blocks: int = 1

    @classmethod
    def from_matrix(cls, matrix: torch.Tensor, rank: int | None, svd: SVD = "exact") -> MatrixFactors:
        """Truncated SVD of ``matrix`` ``[L, D]`` keeping ``min(rank, L, D)`` components
        (``rank=None``: keep the matrix dense). The SVD runs in float32 and the factors are stored
        in the matrix's dtype (float64 stays float64). ``svd="exact"`` uses ``torch.linalg.svd``; ``"randomized"`` uses
        ``torch.svd_lowrank(q=r, niter=2)`` (the KVCMAS reference code's choice; seeded, so
        reproducible). Either way ``b`` has orthonormal rows.

        Factors take ``r (L + D)`` numbers against ``L D`` for the matrix; where they would not be
        smaller (short segments: ``L <= r D / (D - r)``) the matrix is kept dense instead, which
        is also exact.
        """
        if matrix.dim() != 2:
            raise ValueError(f"expected an [L, D] matrix, got shape {tuple(matrix.shape)}")
        r = kept_rank(*matrix.shape, rank, svd)
        FACTORIZATIONS.add(svd=r is not None)
        with phase("factorize"):
            if r is None:
                return cls(a=matrix.detach().clone())
            a, b = _truncated_svd(matrix, r, svd)
            return cls(a=a.to(matrix.dtype).contiguous(), b=b.to(matrix.dtype).contiguous())

    @property
    def dense(self) -> bool:
        return self.b is None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.a.shape[0], self.a.shape[1] if self.b is None else self.b.shape[1]))

    @property
    def rows(self) -> int:
        return self.a.shape[0]

    @property
    def rank(self) -> int:
        """Stored rank (``min(L, D)`` for a dense matrix)."""
        return min(self.shape) if self.b is None else self.a.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the matrix's factors as one rank holding every column keeps them (a tensor-parallel
        rank's columns count :attr:`blocks` times, the whole ``a`` of factors once): every rank and the
        follower bound the same bytes."""
        a = self.a.numel() * self.a.element_size()
        if self.b is None:
            return a * self.blocks
        return a + self.b.numel() * self.b.element_size() * self.blocks

    def reconstruct(self, rows: int | None = None) -> torch.Tensor:
        """The first ``rows`` rows (default all) of the matrix, ``[rows, D]``."""
        a = self.a if rows is None else self.a[:rows]
        return a if self.b is None else a @ self.b


@dataclass(eq=False)
class FactoredKV:
    """A segment's K/V for every layer, each layer's keys and values as :class:`MatrixFactors`.

    Keys are in the canonical frame (positions ``0 .. length - 1``).
    """

    keys: list[MatrixFactors]
    values: list[MatrixFactors]
    length: int
    kv_heads: int

    @classmethod
    def from_kv(
        cls,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        rank: int | None,
        svd: SVD = "exact",
        shard: Shard | None = None,
    ) -> FactoredKV:
        """Factorize per-layer ``keys``/``values`` ``[batch, kv_heads, L, head_dim]`` (keys already
        canonical) at ``rank`` (``None``: dense) with ``svd`` (see :meth:`MatrixFactors.from_matrix`);
        under ``shard`` this rank's heads (:func:`factorize`)."""
        if len(keys) != len(values) or not keys:
            raise ValueError(
                f"need the same non-zero number of key and value layers, got {len(keys)}/{len(values)}"
            )
        return cls(
            keys=[factorize(to_matrix(k), rank, svd, shard) for k in keys],
            values=[factorize(to_matrix(v), rank, svd, shard) for v in values],
            length=keys[0].shape[-2],
            kv_heads=keys[0].shape[1],
        )

    @classmethod
    def from_matrices(
        cls,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        rank: int | None,
        kv_heads: int,
        svd: SVD = "exact",
    ) -> FactoredKV:
        """Factorize per-layer ``[L, D]`` key/value matrices (keys canonical) at ``rank``."""
        if len(keys) != len(values) or not keys:
            raise ValueError(
                f"need the same non-zero number of key and value layers, got {len(keys)}/{len(values)}"
            )
        return cls(
            keys=[MatrixFactors.from_matrix(k, rank, svd) for k in keys],
            values=[MatrixFactors.from_matrix(v, rank, svd) for v in values],
            length=keys[0].shape[0],
            kv_heads=kv_heads,
        )

    @classmethod
    def from_layers(
        cls,
        layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
        rank: int | None,
        svd: SVD = "exact",
        shard: Shard | None = None,
    ) -> FactoredKV:
        """:meth:`from_kv` over ``(keys, values)`` of each layer in turn (an iterable, e.g. a generator
        computing each layer's matrices only when asked): one layer's tensors alive at a time, not
        every layer's. The same factors as :meth:`from_kv` (each matrix factorized on its own, the
        randomized range finder seeded per matrix)."""
        keys, values, length, kv_heads = [], [], 0, 0
        for k, v in layers:
            length, kv_heads = k.shape[-2], k.shape[1]
            keys.append(factorize(to_matrix(k), rank, svd, shard))
            values.append(factorize(to_matrix(v), rank, svd, shard))
        if not keys:
            raise ValueError("need the same non-zero number of key and value layers, got none")
        return cls(keys=keys, values=values, length=length, kv_heads=kv_heads)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in (*self.keys, *self.values))


def squared_spread(kvs: list[FactoredKV], rows: int, first_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i ||X_i - mean||^2, sum_i ||X_i||^2)`` over the first ``rows`` rows of every layer from
    ``first_layer`` on, keys and values, of the segments ``kvs``: float64 0-dim tensors on the first
    layer's device (no host read). Sums over this rank's columns: the caller sums them over a shard
    (:func:`column_sum`)."""
    device = kvs[0].values[0].a.device
    spread = torch.zeros((), dtype=torch.float64, device=device)
    size = torch.zeros((), dtype=torch.float64, device=device)
    for layer in range(first_layer, kvs[0].num_layers):
        for side in ("keys", "values"):
            stacked = torch.stack([getattr(kv, side)[layer].reconstruct(rows).double() for kv in kvs])
            spread += (stacked - stacked.mean(0)).pow(2).sum().to(device)
            size += stacked.pow(2).sum().to(device)
    return spread, size


def relative_spread(
    kvs: list[FactoredKV], rows: int, first_layer: int = 0, shard: Shard | None = None
) -> float:
    """How far apart segments (e.g. the corrections several anchors hold for one consumer) are,
    relative to their own size: ``sqrt(sum_i ||X_i - mean||^2 / sum_i ||X_i||^2)`` over the first
    ``rows`` rows of every layer from ``first_layer`` on, keys and values (0: identical; two
    opposite segments: 1; two orthogonal ones of one size: ``1/sqrt(2)``). All zero: 0. One host read.

    >>> x = FactoredKV.from_kv([torch.ones(1, 1, 4, 2)], [torch.ones(1, 1, 4, 2)], None)
    >>> relative_spread([x, x], rows=4)
    0.0
    """
    if len(kvs) < 2:
        raise ValueError(f"a spread needs at least two segments, got {len(kvs)}")
    short = [kv.length for kv in kvs if kv.length < rows]
    if short:
        raise ValueError(f"segments of {short} tokens are shorter than the {rows} rows compared")
    local = max(first_layer - layer_offset(shard), 0)  # the model's layer index: this member's
    spread, size = column_sum(torch.stack(squared_spread(kvs, rows, local)), shard).tolist()
    return 0.0 if size == 0 else (spread / size) ** 0.5


def row_energy(kv: FactoredKV, shard: Shard | None = None) -> list[float]:
    """The cumulative squared norm of ``kv``'s value rows over every layer, ``[length]`` host floats
    (entry ``i``: ``sum_layers ||values[:i + 1]||^2``). One host read."""
    device = kv.values[0].a.device
    total = torch.zeros(kv.length, dtype=torch.float64, device=device)
    for f in kv.values:
        total += f.reconstruct().double().pow(2).sum(-1).to(device)
    return column_sum(total, shard).cumsum(0).tolist()


def relative_distance(
    x: FactoredKV, y: FactoredKV, rows: int | None = None, shard: Shard | None = None
) -> float:
    """``||X - Y|| / ||Y||`` of the values of two segments over their first ``rows`` rows (default: all
    of the shorter), every layer: how nearly ``x`` duplicates ``y`` (0: the same; ``inf`` when ``y``
    is all zero and ``x`` is not). One host read."""
    rows = min(x.length, y.length) if rows is None else rows
    device = y.values[0].a.device
    diff = torch.zeros((), dtype=torch.float64, device=device)
    size = torch.zeros((), dtype=torch.float64, device=device)
    for fx, fy in zip(x.values, y.values):
        vy = fy.reconstruct(rows).double()
        diff += (fx.reconstruct(rows).double().to(vy.device) - vy).pow(2).sum().to(device)
        size += vy.pow(2).sum().to(device)
    diff, size = column_sum(torch.stack((diff, size)), shard).tolist()
    if size == 0:
        return 0.0 if diff == 0 else float("inf")
    return (diff / size) ** 0.5


class DeferredFactoredKV:
    """A :class:`FactoredKV` whose factorization waits for its first read (:meth:`resolve`).

    KVCMAS's anchor of a chained question takes each later consumer's source as its base (the
    reference's ``entry.update``): a base factorized when the anchor is stored is thrown away by the
    next consumer's rebase in the same request, read by no one. Deferred, a replaced base is never
    factorized. Until then it holds what the factorization needs: ``layers`` gives each layer's
    ``(keys, values)`` ``[1, kv_heads, L, head_dim]`` (keys canonical) when called, ``held`` the
    tensors that keeps alive (:attr:`nbytes`: their storages, each counted once and whole).
    :meth:`resolve` runs :meth:`FactoredKV.from_layers` once (the same factors as storing it
    factorized at once) and drops them. ``tag`` is the owner's (e.g. the request that stored it);
    ``shard`` the rank's (:meth:`FactoredKV.from_layers`).
    """

    def __init__(
        self,
        layers: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
        held: Callable[[], Iterable[torch.Tensor]],
        rank: int | None,
        svd: SVD,
        *,
        length: int,
        kv_heads: int,
        num_layers: int,
        tag: Any = None,
        shard: Shard | None = None,
    ):
        check_svd(svd)
        self._layers: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]] | None = layers
        self._held: Callable[[], Iterable[torch.Tensor]] | None = held
        self.rank, self.svd, self.tag, self.shard = rank, svd, tag, shard
        self.length, self.kv_heads, self.num_layers = length, kv_heads, num_layers
        self._factors: FactoredKV | None = None
        self._lock = threading.Lock()  # two readers (a session's thread and another's) factorize once

    @property
    def resolved(self) -> bool:
        return self._factors is not None

    def resolve(self) -> FactoredKV:
        """The factors (computed on the first call, then kept; the source is released)."""
        if self._factors is None:
            with self._lock:
                if self._factors is None:
                    assert self._layers is not None
                    self._factors = FactoredKV.from_layers(self._layers(), self.rank, self.svd, self.shard)
                    self._layers = self._held = None
        return self._factors

    @property
    def nbytes(self) -> int:
        """Bytes held: the factors once resolved, else the storages of the source it keeps alive."""
        if self._factors is not None:
            return self._factors.nbytes
        return columns(storage_bytes(self.keeps_alive()), self.shard)  # one rank's: every head's

    def keeps_alive(self) -> list[torch.Tensor]:
        """The source tensors it keeps alive until it is resolved (none after)."""
        held = self._held
        return [] if self._factors is not None or held is None else list(held())

    def __repr__(self) -> str:
        state = "resolved" if self.resolved else "deferred"
        return (
            f"DeferredFactoredKV({self.length} tokens, {self.num_layers} layers, rank {self.rank}, {state})"
        )

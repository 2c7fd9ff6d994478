"""Anchor pools: one per PH slot (or per producing agent), bounded capacity, LFU-among-oldest eviction;
the pools of a method instance kept in an :class:`LRUDict`, bounded by count and by bytes.

An :class:`Anchor` is one observation of a slot's content: the (canonical, factorized) cache it
was corrected *from* (``base``: the producer's own output cache, the previous hop's cache of a
chained given text, or a reference prefill) and, for each consuming agent seen, the observed
correction ``Δ = C_target - Align(base)`` (``deltas[target]``). With per-slot gating (the KVCMAS /
KVComm reference code) there is one anchor per (slot, request) and every consumer that went dense
adds its delta to it; with per-edge gating an anchor only corrects an edge whose source matches its
``source`` label and whose target it has a delta for.

Beyond the reference (KVCMAS's ``profile="reuse"``, slot scope): an observation whose base nearly
duplicates an anchor's (:meth:`AnchorPool.near_duplicate`) refreshes that anchor instead of joining
the pool (:meth:`AnchorPool.refresh`), and the anchor remembers how far each consumer's new delta was
from the one it replaced (``Anchor.agreement``); :func:`correction_agreement` reads that evidence and
the spread of the candidate anchors' deltas for the gate's agreement rule.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..budgets import check_byte_budget
from ..cache import storage_bytes
from .lowrank import (
    DEFERRED_WORK,
    DeferredFactoredKV,
    FactoredKV,
    bound_count,
    column_sum,
    columns,
    layer_offset,
    relative_distance,
    row_energy,
    squared_spread,
)

if TYPE_CHECKING:
    from .sharded import Shard

#: label of the context-free reference (the segment prefilled with nothing before it)
REFERENCE = "reference"


class LRUDict(OrderedDict):
    """A dict of at most ``limit`` entries: storing past it evicts the least recently used one.

    Storing an entry or :meth:`touch` makes it the most recently used; reading (``[]``, ``get``) does
    not (a turn reads while it builds and must change nothing until it is recorded). ``evicted``
    counts the entries evicted so far.

    ``max_bytes`` (entries with an ``nbytes``; ``None``: no bound) bounds the entries' bytes too:
    :meth:`trim`, called by the owner once an entry may have grown (a record), drops the least recently
    used entries, and the last one left sheds parts of itself (its ``shed()``: an anchor pool drops one
    anchor) or goes too, until the bytes are within the budget. ``evicted_for_bytes`` counts the entries
    and parts dropped so.

    >>> pools = LRUDict(2); pools["a"], pools["b"], pools["c"] = 1, 2, 3  # doctest: +SKIP
    >>> list(pools), pools.evicted  # doctest: +SKIP
    (['b', 'c'], 1)
    """

    def __init__(self, limit: int, max_bytes: int | None = None):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"the limit of an LRUDict must be an int >= 1, got {limit!r}")
        check_byte_budget("the max_bytes of an LRUDict", max_bytes, optional=True)
        super().__init__()
        self.limit = limit
        self.max_bytes = max_bytes
        self.evicted = 0
        self.evicted_for_bytes = 0

    def __setitem__(self, key, value) -> None:
        if key in self:
            self.move_to_end(key)
        super().__setitem__(key, value)
        while len(self) > self.limit:
            self.popitem(last=False)
            self.evicted += 1

    def touch(self, key) -> None:
        """Mark ``key`` as the most recently used (no-op when absent)."""
        if key in self:
            self.move_to_end(key)

    @property
    def nbytes(self) -> int:
        """Bytes of the entries (:func:`held_bytes`: a storage several of them keep alive counted once)."""
        return held_bytes(self.values())

    def trim(self, shard: Shard | None = None) -> None:
        """Within ``max_bytes`` (see the class docstring); nothing without a byte bound. Under ``shard``
        every member counts one rank's bytes (:func:`~.lowrank.bound_count`)."""
        if self.max_bytes is None or not self:  # empty on every member alike: nothing to count
            return
        held = bound_count(lambda: self.nbytes, shard)
        while self and held > self.max_bytes:
            oldest = next(iter(self))
            entry = super().__getitem__(oldest)
            shed = getattr(entry, "shed", None)
            if not (len(self) == 1 and shed is not None and shed()):
                self.popitem(last=False)
                self.evicted += 1
            held = bound_count(lambda: self.nbytes, shard)  # a storage the dropped part shared may be held
            self.evicted_for_bytes += 1


def held_bytes(parts: Iterable[Any]) -> int:
    """Bytes ``parts`` hold together (factors, deferred factorizations, anchors, pools, or anything
    with an ``nbytes``): their factors, plus the storages their deferred factorizations keep alive,
    each storage counted once and whole however many of them keep it (several anchors recorded from
    one request's cache keep the same layers alive)."""
    own, alive = _holding(parts)
    return own + sum(columns(storage_bytes(tensors), shard) for shard, tensors in alive.items())


def _holding(parts: Iterable[Any]) -> tuple[int, dict[Any, list[torch.Tensor]]]:
    """``(bytes of their own, the tensors whose storages they keep alive by the shard they were
    recorded under)`` of ``parts`` (one rank's bytes: a rank's K/V count as every head's)."""
    own, alive = 0, {}
    for part in parts:
        if isinstance(part, DeferredFactoredKV) and not part.resolved:
            alive.setdefault(part.shard, []).extend(part.keeps_alive())
        elif hasattr(part, "holding"):
            part_own, part_alive = part.holding()
            own += part_own
            for shard, tensors in part_alive.items():
                alive.setdefault(shard, []).extend(tensors)
        else:
            own += part.nbytes
    return own, alive


class Deltas(dict):
    """An anchor's ``consumer -> delta`` factors: a :class:`~.lowrank.DeferredFactoredKV` value (a
    record that left its factorization for later) is factorized on its first read and replaced by its
    factors, so every reader (``[]``, ``get``, ``values``, ``items``) gets factors; membership and
    iteration over the consumers never factorize. :meth:`held` gives the values as stored."""

    def __getitem__(self, key: Any) -> FactoredKV:
        value = super().__getitem__(key)
        if isinstance(value, DeferredFactoredKV):
            value = value.resolve()
            super().__setitem__(key, value)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self) -> list[FactoredKV]:  # type: ignore[override]
        return [self[key] for key in self]

    def items(self) -> list[tuple[Any, FactoredKV]]:  # type: ignore[override]
        return [(key, self[key]) for key in self]

    def held(self) -> list[FactoredKV | DeferredFactoredKV]:
        """The values as stored (a deferred one not factorized)."""
        return list(super().values())

    def deferred(self) -> bool:
        """Whether some delta still waits for its factorization."""
        return any(isinstance(v, DeferredFactoredKV) and not v.resolved for v in self.held())


@dataclass(eq=False, repr=False)
class Anchor:
    """One stored observation of a PH slot.

    Args:
        base: the cache the corrections are relative to, keys canonical: factors, or a
            :class:`~.lowrank.DeferredFactoredKV` factorized on its first read (reading ``base``
            resolves it; :attr:`base_deferred` tells without resolving; a chained question's base,
            replaced by the next consumer's rebase, is then never factorized).
        source: who produced ``base``: the source agent's name, or :data:`REFERENCE`.
        origin: identifies the exact ``base`` (request, slot, version), so that later consumers of
            the same base add their delta to this anchor instead of inserting a duplicate.
        deltas: consuming agent -> observed correction of the segment (a :class:`Deltas`: a delta
            whose factorization a record left for later is factorized on its first read).
        frame: the position frame of the deltas' keys: ``"canonical"`` (positions ``0 ..``, rotated
            to where the segment lands when applied) or ``"writer"`` (the absolute positions of the
            consumer that observed it, added unrotated: the authors' code).
        base_start: where the base's keys were last placed by a consumer that added a delta (the
            KVComm reference compares keys in that frame); the stored base keys stay canonical.
        prefix_deltas: consuming agent -> (token ids, correction) of the PF text right after the
            segment in that agent's prompt (KVComm's prefix deltas), in ``frame``.
        agreement: consuming agent -> :func:`~.lowrank.relative_spread` of its last two observed
            deltas (set when a near-duplicate observation refreshed this anchor: evidence that its
            correction repeats; absent: observed once).
        stale: consuming agents whose delta predates the anchor's current ``origin`` (a refresh
            re-keys it to the refreshing request; per request, not saved).
        energy: the base's cumulative squared value-row norms (:meth:`size`; computed by
            :meth:`measure`, dropped when the base changes; not saved).
    """

    base: FactoredKV
    source: str
    origin: Hashable
    deltas: dict[str, FactoredKV] = field(default_factory=Deltas)
    uses: int = 0
    serial: int = -1  # insertion number within its pool (set by the pool)
    frame: str = "canonical"
    base_start: int = 0
    prefix_deltas: dict[str, tuple[tuple[int, ...], FactoredKV]] = field(default_factory=dict)
    agreement: dict[str, float] = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)
    #: cumulative squared norm of the base's value rows, every layer (host floats; ``None``: not yet)
    energy: list[float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.deltas, Deltas):
            self.deltas = Deltas(self.deltas)

    def measure(self, shard: Shard | None = None) -> None:
        """Compute :attr:`energy` now (one host read; factorizes a deferred base); under ``shard`` over
        every rank's heads (:func:`~.lowrank.row_energy`)."""
        self.energy = row_energy(self.base, shard)

    def size(self, rows: int, shard: Shard | None = None) -> float:
        """``||base values[:rows]||`` over every layer (:meth:`measure` first when not known)."""
        if self.energy is None:
            self.measure(shard)
        return self.energy[min(rows, len(self.energy)) - 1] ** 0.5 if rows > 0 else 0.0

    @property
    def length(self) -> int:
        return self.__dict__["base"].length  # a deferred base knows its length: nothing factorized

    @property
    def base_deferred(self) -> bool:
        """The base is still waiting for its factorization (its first read)."""
        base = self.__dict__["base"]
        return isinstance(base, DeferredFactoredKV) and not base.resolved

    @property
    def nbytes(self) -> int:
        """Bytes held: the base's factors and the deltas' (a deferred one: the source storages it keeps
        alive, each counted once: :func:`held_bytes`)."""
        return held_bytes([self])

    def holding(self) -> tuple[int, dict[Any, list[torch.Tensor]]]:
        """Its factors' bytes and the tensors its deferred parts keep alive (:func:`held_bytes`)."""
        prefix = [d for _, d in self.prefix_deltas.values()]
        return _holding([self.__dict__["base"], *self.deltas.held(), *prefix])

    def settle_base(self, keep: Any = None) -> None:
        """Factorize a deferred base now unless it was stored under tag ``keep`` (e.g. the request still
        running, whose next consumer may replace it) or as a record's work for later (tag
        :data:`~.lowrank.DEFERRED_WORK`: its caller runs it)."""
        base = self.__dict__["base"]
        if (
            isinstance(base, DeferredFactoredKV)
            and not base.resolved
            and base.tag != DEFERRED_WORK
            and (keep is None or base.tag != keep)
        ):
            self.__dict__["base"] = base.resolve()

    def __repr__(self) -> str:
        return (
            f"Anchor({self.source!r}, origin={self.origin!r}, {self.length} tokens, "
            f"deltas for {sorted(self.deltas)}, serial {self.serial}"
            f"{', base deferred' if self.base_deferred else ''})"
        )


def _read_base(anchor: Anchor) -> FactoredKV:
    """``anchor.base``: a deferred base is factorized here, on its first read, and replaced by its factors."""
    base = anchor.__dict__["base"]
    if isinstance(base, DeferredFactoredKV):
        base = anchor.__dict__["base"] = base.resolve()
    return base


def _write_base(anchor: Anchor, base: FactoredKV | DeferredFactoredKV) -> None:
    anchor.__dict__["base"] = base
    anchor.__dict__["energy"] = None  # the size of another base


# a property over the dataclass field (set after the decorator, so the generated __init__ assigns
# through it): every reader of ``anchor.base`` gets factors
Anchor.base = property(_read_base, _write_base, doc=Anchor.__doc__)  # type: ignore[assignment]


class AnchorPool:
    """Up to ``capacity`` anchors of one PH slot, oldest first.

    When a new anchor arrives at a full pool, the least frequently used anchor among the
    ``eviction_window`` oldest is evicted (ties: the oldest), following KVComm. ``peak`` is the
    most anchors the pool holds (default ``capacity``); the reference code checks "more than V"
    before inserting, so its pools peak at ``capacity + 1``.

    >>> pool = AnchorPool("query", capacity=10)  # doctest: +SKIP
    >>> pool.insert(Anchor(base, source="planner", origin=("req0", "query", 0)))  # doctest: +SKIP
    """

    def __init__(self, slot: str, capacity: int, eviction_window: int = 5, peak: int | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if peak is not None and peak < capacity:
            raise ValueError(f"peak must be >= capacity ({capacity}), got {peak}")
        if eviction_window < 1:
            raise ValueError(f"eviction_window must be >= 1, got {eviction_window}")
        self.slot = slot
        self.capacity = capacity
        self.peak = capacity if peak is None else peak
        self.eviction_window = eviction_window
        self.anchors: list[Anchor] = []
        self._serial = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.anchors)

    def __iter__(self):
        return iter(self.anchors)

    def find(self, origin: Hashable) -> Anchor | None:
        for anchor in self.anchors:
            if anchor.origin == origin:
                return anchor
        return None

    def compatible(self, source: str, target: str) -> list[Anchor]:
        """Anchors built from a ``source`` cache that hold a correction for ``target``."""
        return [a for a in self.anchors if a.source == source and target in a.deltas]

    def gate_candidates(self, length: int) -> list[Anchor]:
        """Anchors at least ``length`` tokens long (the reference gate's full-length rule)."""
        return [a for a in self.anchors if a.length >= length]

    def with_delta(self, target: str) -> list[Anchor]:
        """Anchors holding a correction for ``target``."""
        return [a for a in self.anchors if target in a.deltas]

    def near_duplicate(
        self, base: FactoredKV | DeferredFactoredKV, source: str, threshold: float, shard: Shard | None = None
    ) -> Anchor | None:
        """The anchor whose base ``base`` nearly duplicates: the same source label and length, values
        within ``threshold`` of it relative to its size (:func:`~.lowrank.relative_distance`); the
        closest such, or ``None`` (always with ``threshold <= 0``). A deferred base of a same-length
        anchor is factorized here (it is compared)."""
        if threshold <= 0:
            return None
        found, best = None, threshold
        for anchor in self.anchors:
            if anchor.source != source or anchor.length != base.length:
                continue
            if isinstance(base, DeferredFactoredKV):
                base = base.resolve()
            distance = relative_distance(base, anchor.base, shard=shard)
            if distance <= best:
                found, best = anchor, distance
        return found

    def refresh(self, anchor: Anchor) -> None:
        """``anchor`` was observed again: it becomes the youngest (the last the LFU-among-oldest
        eviction reaches); its serial and use count stay."""
        self.anchors = [a for a in self.anchors if a is not anchor] + [anchor]

    def eviction_candidate(self) -> Anchor:
        """The anchor :meth:`insert` would evict: LFU among the ``eviction_window`` oldest."""
        if not self.anchors:
            raise ValueError(f"pool {self.slot!r} is empty; nothing to evict")
        window = self.anchors[: self.eviction_window]
        return min(window, key=lambda a: a.uses)  # min keeps the first (oldest) on ties

    def insert(self, anchor: Anchor) -> Anchor | None:
        """Add ``anchor`` (evicting one first when full); returns the evicted anchor, if any."""
        if self.find(anchor.origin) is not None:
            raise ValueError(f"pool {self.slot!r} already holds an anchor with origin {anchor.origin!r}")
        evicted = None
        if len(self.anchors) >= self.peak:
            evicted = self.eviction_candidate()
            self.anchors = [a for a in self.anchors if a is not evicted]
            self.evicted += 1
        anchor.serial = self._serial
        self._serial += 1
        self.anchors.append(anchor)
        return evicted

    def shed(self) -> bool:
        """Drop the anchor :meth:`insert` would evict (the pool's bytes over a budget); ``False`` when
        empty."""
        if not self.anchors:
            return False
        dropped = self.eviction_candidate()
        self.anchors = [a for a in self.anchors if a is not dropped]
        self.evicted += 1
        return True

    @property
    def nbytes(self) -> int:
        """Exact bytes of every stored tensor (bases and deltas; a storage several anchors keep alive
        counted once: :func:`held_bytes`)."""
        return held_bytes([self])

    def holding(self) -> tuple[int, dict[Any, list[torch.Tensor]]]:
        """Its anchors' factors' bytes and the tensors their deferred parts keep alive (:func:`held_bytes`)."""
        return _holding(self.anchors)

    def describe(self) -> dict:
        return {
            "slot": self.slot,
            "anchors": len(self.anchors),
            "capacity": self.capacity,
            "deltas": sum(len(a.deltas) for a in self.anchors),
            "evicted": self.evicted,
            "bytes": self.nbytes,
        }

    def __repr__(self) -> str:
        return (
            f"AnchorPool({self.slot!r}, {len(self.anchors)}/{self.capacity} anchors, "
            f"{self.nbytes / 2**20:.2f} MiB)"
        )


def correction_agreement(
    anchors: list[Anchor],
    rows: int,
    first_layer: int = 0,
    agent: str | None = None,
    shard: Shard | None = None,
) -> tuple[float | None, str]:
    """How well the corrections of ``anchors`` agree, for the gate's agreement rule: per consuming
    agent they hold a delta for (``agent``: that one only, a decision one consumer takes for itself),
    the :func:`~.lowrank.relative_spread` of those deltas (first ``rows`` rows, layers from
    ``first_layer``) where two or more anchors hold one, and the spread a refresh recorded
    (``Anchor.agreement``); the worst over the agents and a description (one host read). ``None``
    (with the reason) when some agent's correction was observed only once: nothing says it repeats.
    Under ``shard`` the sums are every rank's heads' (one all-reduce).

    Agreeing corrections are reliable whatever the gate weights: the weighted sum of deltas that
    agree is close to each of them, so the flat weights of equally close anchors (two anchors of the
    same text: normalized entropy 1) cost nothing."""
    agents = sorted({held for a in anchors for held in a.deltas if agent is None or held == agent})
    if not agents:
        return None, "no anchor holds a correction" + ("" if agent is None else f" for {agent!r}")
    local = max(first_layer - layer_offset(shard), 0)  # the model's layer index: this member's
    recorded, terms = {}, []  # per agent: refreshes' spreads; (agent, spread^2, size^2) of 2+ holders
    for who in agents:
        holders = [a for a in anchors if who in a.deltas]
        recorded[who] = [a.agreement[who] for a in holders if who in a.agreement]
        if len(holders) >= 2:
            terms.append((who, *squared_spread([a.deltas[who] for a in holders], rows, local)))
        elif not recorded[who]:
            return None, f"the correction for {who!r} was observed once"
    if terms:  # every agent's spread in one host read
        read = torch.stack([torch.stack((s, z)).to(terms[0][1].device) for _, s, z in terms])
        read = column_sum(read, shard).tolist()
        for (who, _, _), (spread, size) in zip(terms, read):
            recorded[who].append(0.0 if size == 0 else (spread / size) ** 0.5)
    worst_agent = max(agents, key=lambda who: max(recorded[who]))
    worst = max(recorded[worst_agent])
    return worst, f"delta spread {worst:.3g} (worst: {worst_agent!r})"


def nearest_relative(
    anchors: list[Anchor], distances: list[float], rows: int, shard: Shard | None = None
) -> float:
    """The candidate's nearest anchor, relative: ``min_a d_a / ||base_a values[:rows]||`` over
    ``anchors`` and their gate ``distances`` (host floats). Each anchor's size comes from
    :meth:`Anchor.size` (kept on the host: a read only for an anchor whose size is not known yet)."""
    near = math.inf
    for anchor, distance in zip(anchors, distances):
        size = anchor.size(rows, shard)
        near = min(near, distance / size if size > 0 else (0.0 if distance == 0 else math.inf))
    return near

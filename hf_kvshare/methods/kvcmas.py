"""KVCMAS: low-rank online anchor pools with chained correction (and its non-chained ablation).

On a workflow edge i -> j a PH segment's K/V for agent j is obtained from a *source* cache,
re-positioned to where the segment lands, plus an estimated correction:

- chained (``kvcmas``): the source is agent i's materialized cache of the segment (dense or
  itself corrected). The first agent to see a segment computes it densely, so its cache is exact,
  and no reference prefill ever runs.
- non-chained (``kvcmas-nonchained``, and ``kvcomm``): the source is the context-free reference
  (the segment prefilled alone, once per request, outside the workflow), so even the first
  agent's segment is corrected.

The correction is a token-wise weighted sum of the deltas stored in the slot's anchor pool,
accepted only when the normalized entropy of the gate weights is at most ``tau``; otherwise the
segment is prefilled densely and, after the turn's first token, the source and the exact observed
correction ``C_j - Align(C_src)`` are factorized (rank ``base_rank`` / ``delta_rank``) into the
pool. See :mod:`hf_kvshare.anchors`.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..anchors import (
    REFERENCE,
    Anchor,
    AnchorPool,
    FactoredKV,
    GateDecision,
    ModelBinding,
    RequestStates,
    apply_correction,
    canonical_keys,
    comparison_prefix,
    context_free_reference,
    match,
    reliability_gate,
    token_weights,
)
from ..anchors.cache import CorrectedCache
from ..cache import SegmentKV, config_signature
from ..method import Method, Placement, register

if TYPE_CHECKING:
    from ..session import Session
    from ..turn import Turn

#: anchors making up this much of the gate's mass count as used (LFU bookkeeping, as KVComm)
USAGE_MASS = 0.9


@dataclass
class Edge:
    """What the method decided for one PH span of a turn (kept in ``turn.scratch`` until record)."""

    slot: str
    source: SegmentKV | None  # None: first agent to see the slot
    label: str | None = None  # source agent, or REFERENCE
    origin: Hashable = None
    decision: GateDecision | None = None
    candidates: int = 0
    rows: int = 0
    distances: list[float] | None = None

    def report(self) -> dict[str, Any]:
        if self.source is None:
            return {"gate": "first", "reason": "first agent to see the slot: dense, exact"}
        info: dict[str, Any] = {"gate": "accepted" if self.decision.accepted else "fallback"}
        if self.decision.entropy is not None:
            info["entropy"] = self.decision.entropy
        if not self.decision.accepted:
            info["reason"] = self.decision.reason
        info["anchors"] = self.candidates
        if self.distances is not None:
            info["distances"] = self.distances
        return info


def _check_rank(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int or None (dense), got {value!r}")


@register
@dataclass(eq=False)
class KVCMAS(Method):
    """KVCMAS (chained correction, low-rank anchors). Defaults are the paper's.

    Args:
        base_rank: rank of the stored source caches (used only for matching); ``None`` keeps them dense.
        delta_rank: rank of the stored corrections; ``None`` keeps them dense. A rank above a
            segment's ``min(L, D)`` stores all ``min(L, D)`` components (exact); one above the
            model's ``D = kv_heads * head_dim`` is clamped to ``D`` with a warning when attached.
        capacity: anchors per PH slot pool (V).
        tau: normalized-entropy threshold of the reliability gate (0 disables correction).
        temperature: gate softmax temperature T.
        token_temperature: temperature of the token-wise interpolation weights.
        eviction_window: a full pool evicts the least frequently used of this many oldest anchors.

    >>> method = KVCMAS()  # one instance, shared by every request's Session  # doctest: +SKIP
    >>> for query in queries:  # doctest: +SKIP
    ...     run_workflow(Session(model, tok, method), demo_workflow(tok, query))
    >>> method.state_bytes(), method.pools["query"]  # doctest: +SKIP
    """

    name = "kvcmas"
    chained: ClassVar[bool] = True
    uses_sources: ClassVar[bool] = True

    base_rank: int | None = 32
    delta_rank: int | None = 32
    capacity: int = 10
    tau: float = 0.3
    temperature: float = 1.0
    token_temperature: float = 1.0
    eviction_window: int = 5

    def __post_init__(self) -> None:
        _check_rank("base_rank", self.base_rank)
        _check_rank("delta_rank", self.delta_rank)
        if not isinstance(self.capacity, int) or self.capacity < 2:
            raise ValueError(
                f"capacity must be an int >= 2 (the gate needs two compatible anchors), got {self.capacity!r}"
            )
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau is a normalized entropy threshold in [0, 1], got {self.tau}")
        for knob in ("temperature", "token_temperature"):
            if getattr(self, knob) <= 0:
                raise ValueError(f"{knob} must be > 0, got {getattr(self, knob)}")
        if not isinstance(self.eviction_window, int) or self.eviction_window < 1:
            raise ValueError(f"eviction_window must be an int >= 1, got {self.eviction_window!r}")
        self.pools: dict[str, AnchorPool] = {}
        self._binding = ModelBinding(type(self).__name__)
        self._requests = RequestStates()

    # ------------------------------------------------------------------ state
    def attach(self, model: torch.nn.Module) -> None:
        self._binding.bind(model)
        _, kv_heads, head_dim = config_signature(model.config)
        dim = kv_heads * head_dim
        for knob in ("base_rank", "delta_rank"):
            rank = getattr(self, knob)
            if rank is not None and rank > dim:
                warnings.warn(
                    f"{knob}={rank} exceeds the model's K/V feature dimension D = {kv_heads} kv heads x "
                    f"{head_dim} = {dim}; clamped to {dim} (full rank, exact)",
                    UserWarning,
                    stacklevel=3,
                )
                setattr(self, knob, dim)

    def clear(self) -> None:
        """Drop every pool and per-request state, and forget the model."""
        self.pools = {}
        self._binding.clear()
        self._requests.clear()

    def request_state_bytes(self, session: Session) -> int:
        """The request's context-free references (non-chained correction keeps one per slot)."""
        return self._requests.nbytes(session)

    def state_bytes(self) -> int:
        """Exact bytes of all anchor pools (every stored factor / dense tensor)."""
        return sum(p.nbytes for p in self.pools.values())

    def pool_report(self) -> list[dict[str, Any]]:
        return [pool.describe() for pool in self.pools.values()]

    # ----------------------------------------------------------------- build
    def new_cache(self, turn: Turn) -> CorrectedCache:
        return CorrectedCache(turn.model.config, method=self.name)

    def build(self, turn: Turn) -> CorrectedCache:
        self._binding.bind(turn.model)
        cache = super().build(turn)
        edges = turn.scratch.get(self.name, {})
        for seg in cache.segments:
            edge = edges.get(seg.start)
            if seg.kind == "PH" and edge is not None and seg.provenance == "dense":
                seg.info.update(edge.report())
        return cache

    def _source(self, turn: Turn, span) -> SegmentKV | None:
        if self.chained:
            return turn.session.slots[span.name].latest
        state = self._requests.get(turn.session)
        reference = state.references.get(span.name)
        if reference is None:  # a prefill outside the workflow, once per request and slot
            ids = turn.session.slots[span.name].token_ids.to(turn.session.device)
            reference = state.references[span.name] = context_free_reference(turn.model, ids)
            turn.stats.tokens_prefilled += ids.numel()
        return reference

    def _origin(self, turn: Turn, slot: str) -> Hashable:
        state = self._requests.get(turn.session)
        if self.chained:  # this exact materialization of the slot in this request
            return (state.uid, slot, state.versions.get(slot, 0))
        return (state.uid, slot)  # the request's reference: one anchor, a delta per consumer

    def placeholder(self, turn: Turn, span, cache) -> Placement | None:
        edges = turn.scratch.setdefault(self.name, {})
        source = self._source(turn, span)
        edge = edges[span.start] = Edge(slot=span.name, source=source)
        if source is None:
            return None
        edge.label = source.agent if self.chained else REFERENCE
        edge.origin = self._origin(turn, span.name)
        pool = self.pools.get(span.name)
        candidates = pool.compatible(edge.label, turn.agent) if pool is not None else []
        rows = comparison_prefix(candidates, span.length)
        eligible = [a for a in candidates if a.length >= rows] if rows else []
        edge.candidates = len(eligible)
        if len(eligible) < 2:
            edge.decision = GateDecision(False, f"fewer than 2 compatible anchors ({len(candidates)})")
            return None
        found = match(source, eligible, turn.shifter, rows)
        edge.decision = reliability_gate(found.gate_distances, self.tau, self.temperature)
        edge.distances = [float(d) for d in found.gate_distances]
        if not edge.decision.accepted:
            return None
        edge.rows = rows
        kv = apply_correction(
            source,
            eligible,
            turn.agent,
            token_weights(found.key_distances, self.token_temperature),
            token_weights(found.value_distances, self.token_temperature),
            span.start,
            turn.shifter,
        )
        self._count_uses(eligible, edge.decision.weights)
        info = {
            "gate": "accepted",
            "entropy": edge.decision.entropy,
            "tau": self.tau,
            "anchors": [a.serial for a in eligible],
            "weights": [float(w) for w in edge.decision.weights],
            "distances": edge.distances,
            "rows": f"{rows}/{span.length}",
        }
        return Placement(kv=kv, provenance="corrected", source_agent=edge.label, info=info)

    @staticmethod
    def _count_uses(anchors: list[Anchor], weights: list[float]) -> None:
        order = sorted(range(len(anchors)), key=lambda i: -weights[i])
        mass = 0.0
        for i in order:
            anchors[i].uses += 1
            mass += weights[i]
            if mass >= USAGE_MASS:
                break

    # ---------------------------------------------------------------- record
    def record(self, turn: Turn, cache) -> None:
        """After the first token: insert an anchor for every gate fallback (accepted corrections are
        never inserted), then note which slots now hold a new materialization."""
        state = self._requests.get(turn.session)
        edges = turn.scratch.get(self.name, {})
        for span in turn.spans:
            edge = edges.get(span.start)
            if span.kind != "PH" or edge is None or edge.source is None or edge.decision.accepted:
                continue
            exact = cache.extract(span.start, span.end, agent=turn.agent)
            self._insert(edge, exact, turn)
        if self.chained:
            for span in turn.spans:
                if span.kind == "PH":
                    state.versions[span.name] = state.versions.get(span.name, 0) + 1

    def _insert(self, edge: Edge, exact: SegmentKV, turn: Turn) -> None:
        pool = self.pools.get(edge.slot)
        if pool is None:
            pool = self.pools[edge.slot] = AnchorPool(edge.slot, self.capacity, self.eviction_window)
        anchor = pool.find(edge.origin)
        if anchor is not None and turn.agent in anchor.deltas:
            return  # this consumer's correction of this base is already stored
        source_keys = canonical_keys(edge.source, turn.shifter)
        delta = FactoredKV.from_kv(
            [k - s for k, s in zip(canonical_keys(exact, turn.shifter), source_keys)],
            [v[:1] - s[:1] for v, s in zip(exact.values, edge.source.values)],
            self.delta_rank,
        )
        if anchor is None:
            base = FactoredKV.from_kv(source_keys, [v[:1] for v in edge.source.values], self.base_rank)
            anchor = Anchor(base=base, source=edge.label, origin=edge.origin)
            anchor.deltas[turn.agent] = delta
            pool.insert(anchor)
        else:
            anchor.deltas[turn.agent] = delta


@register
@dataclass(eq=False)
class KVCMASNonChained(KVCMAS):
    """The ablation of KVCMAS: the same low-rank pool, corrections relative to a context-free
    reference (prefilled once per request and slot, outside the workflow) instead of chaining."""

    name = "kvcmas-nonchained"
    chained: ClassVar[bool] = False
    uses_sources: ClassVar[bool] = False

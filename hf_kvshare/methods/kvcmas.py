"""KVCMAS: low-rank online anchor pools with chained correction (and its non-chained ablation).

A PH segment's K/V for a consuming agent is obtained from a *source* cache, re-positioned to where
the segment lands, plus an estimated correction: a token-wise weighted sum of the deltas stored in
the slot's anchor pool. The defaults follow the authors' reference code (``hjeon2k/KVCMAS`` on
``FastMAS/KVCOMM``); the earlier readings stay available as named options.

Sources (``output_source`` for agent outputs, ``text_source`` for given text such as the query):

- ``"producer"`` (outputs): the producer's own cache of its output, re-positioned (reference).
- ``"chained"``: the latest hop's materialized cache of the slot (dense or itself corrected). For
  given text this is KVCMAS's chaining of the question hop to hop (reference); the first hop of a
  request computes it densely. For outputs it is the previous reading of the segment.
- ``"first"`` (given text): the first consumer's dense cache, for every later hop (the reference
  code's ``--no-chained``: the question harvested once, a star).
- ``"lead"`` (given text): KVComm's reference prefill: BOS + chat header + a lead-in, then the
  text, the leading tokens dropped (:func:`~hf_kvshare.anchors.state.reference_prefill`).
- ``"context_free"``: the segment prefilled alone at positions ``0 ..`` (our earlier reading).

Gating (``gate_scope``):

- ``"slot"`` (reference): one gate decision per (slot, request), taken by the producer right after
  its turn for an output, by the first consumer for a reference-prefilled given text; chained /
  first given text is not gated. The candidate's values are compared (L2 over every layer, computed
  from the factors) with every pooled anchor at least as long (``match="full"``; fewer than two →
  reject). Every consumer obeys: a consumer of a rejected slot without its own delta in the slot's
  anchor of this request prefills (with ``turn_fallback="turn"``, the reference, its whole turn;
  ``"span"``: that span only) and adds its delta to the one anchor of (slot, request); otherwise it
  reuses every PH span, corrected by the anchors holding its delta (the anchors covering the
  segment, else the longest: ``partial_coverage``), uncorrected when none does. Token weights are
  computed once per (slot, request, anchor set) and reused by later consumers
  (``weights_cache``). Pools are per producing agent for outputs (``agent#2`` shares ``agent``'s).
- ``"edge"`` (our earlier reading): every (source, consumer) edge is gated separately over the
  anchors built from the same source label holding the consumer's delta; ``match="prefix"``
  compares over the longest prefix two anchors cover. Anchors are split by source version.

``tau = 0`` accepts nothing and reuses nothing: every PH span is prefilled (NonShared exactly),
while the pools still learn.

The previous behaviour of each method, for ablations::

    kvcmas:gate_scope=edge,match=prefix,output_source=chained,skip_layer0=False,svd=exact,pool_peak=capacity,delta_frame=canonical
    kvcmas-nonchained:gate_scope=edge,match=prefix,output_source=context_free,text_source=context_free,skip_layer0=False,svd=exact,pool_peak=capacity,delta_frame=canonical
    kvcomm:gate_scope=edge,match=prefix,output_source=context_free,text_source=context_free,skip_layer0=False,pool_peak=capacity,delta_frame=canonical,key_frame=canonical,prefix_delta=False
"""

from __future__ import annotations

import math
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
    LRUDict,
    RequestStates,
    apply_correction,
    canonical_keys,
    comparison_prefix,
    covering,
    gate_distances,
    match,
    prefix_correction,
    prefix_weights,
    reference_lead,
    reference_prefill,
    reliability_gate,
    token_distances,
    token_weights,
    usage_crossing,
    usage_reference,
)
from ..anchors.cache import CorrectedCache
from ..anchors.lowrank import SVD_METHODS
from ..anchors.persist import TensorTable, move_state_to_model, pools_from_state, pools_to_state
from ..cache import SegmentKV, check_finite, config_signature
from ..method import Method, Placement, register
from ..trajectory import tokenize_text
from .prefix_reuse import PrefixReuse

if TYPE_CHECKING:
    from ..session import Session
    from ..turn import Turn

#: anchors making up this much of the gate's mass count as used (LFU bookkeeping, as KVComm)
USAGE_MASS = 0.9

CHOICES: dict[str, tuple[str, ...]] = {
    "gate_scope": ("slot", "edge"),
    "output_source": ("producer", "chained", "context_free"),
    "text_source": ("chained", "first", "lead", "context_free"),
    "match": ("full", "prefix"),
    "turn_fallback": ("turn", "span"),
    "svd": SVD_METHODS,
    "pool_peak": ("capacity+1", "capacity"),
    "delta_frame": ("writer", "canonical"),
    "key_frame": ("canonical", "reader"),
}


@dataclass
class Edge:
    """What the method decided for one PH span of a turn (kept in ``turn.scratch`` until record)."""

    slot: str
    source: SegmentKV | None  # None: first agent to see the slot
    label: str | None = None  # source agent, or REFERENCE
    origin: Hashable = None
    pool: str = ""
    rebase: bool = False  # the anchor's base follows this source (chained sources)
    decision: GateDecision | None = None  # None: not gated (chained / first given text)
    dense: str | None = None  # why the span is prefilled: "first", "fallback", "turn"
    reason: str = ""
    candidates: int = 0
    rows: int = 0
    distances: list[float] | None = None

    def report(self) -> dict[str, Any]:
        if self.source is None:
            return {"gate": "first", "reason": "first agent to see the slot: dense, exact"}
        info: dict[str, Any] = {}
        if self.dense == "turn":
            info["gate"], info["reason"] = "turn", self.reason
        elif self.decision is None:
            info["gate"] = "ungated" if self.dense is None else "fallback"
        else:
            info["gate"] = "accepted" if self.decision.accepted and self.dense is None else "fallback"
        if self.decision is not None and self.decision.entropy is not None:
            info["entropy"] = self.decision.entropy
        if info["gate"] == "fallback":
            info["reason"] = self.reason or (self.decision.reason if self.decision else "")
        info["anchors"] = self.candidates
        if self.distances is not None:
            info["distances"] = self.distances
        return info


def _check_rank(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int or None (dense), got {value!r}")


def check_tau(method: str, tau: Any) -> None:
    """``tau`` must be a real number (not a bool) in ``[0, 1]``; the message names the method."""
    real = isinstance(tau, (int, float)) and not isinstance(tau, bool)
    if not real or not math.isfinite(tau):
        raise ValueError(f"{method}: tau must be a real number in [0, 1], got {tau!r} ({type(tau).__name__})")
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"{method}: tau is a normalized entropy threshold in [0, 1], got {tau!r}")


@register
@dataclass(eq=False)
class KVCMAS(PrefixReuse, Method):
    """KVCMAS (chained correction, low-rank anchors). Defaults follow the authors' reference code.

    Args:
        base_rank: rank of the stored source caches (used only for matching); ``None`` keeps them dense.
        delta_rank: rank of the stored corrections; ``None`` keeps them dense. A rank above a
            segment's ``min(L, D)`` stores all ``min(L, D)`` components (exact); one above the
            model's ``D = kv_heads * head_dim`` is clamped to ``D`` with a warning when attached.
        capacity: anchors per pool (V).
        tau: normalized-entropy threshold of the reliability gate, a real number in [0, 1]
            (0 disables reuse). The benchmark's workloads set 0.29 (MMLU), 0.32 (GSM8K) and 0.34
            (HumanEval) unless given.
        temperature: gate softmax temperature T.
        token_temperature: temperature of the token-wise interpolation weights.
        eviction_window: a full pool evicts the least frequently used of this many oldest anchors.
        gate_scope: ``"slot"`` (one decision per (slot, request), consumers obey; reference) or
            ``"edge"`` (every edge gated on its own; earlier reading).
        output_source: ``"producer"`` (reference), ``"chained"`` or ``"context_free"``: where an agent
            output's source cache comes from (module docstring).
        text_source: ``"chained"`` (reference KVCMAS), ``"first"`` (reference ``--no-chained``),
            ``"lead"`` (reference KVComm) or ``"context_free"``: the same for given text.
        match: ``"full"`` (gate over the full length among anchors at least that long; reference)
            or ``"prefix"`` (over the longest prefix two anchors cover).
        turn_fallback: ``"turn"`` (a consumer obeying a rejection prefills its whole turn;
            reference) or ``"span"`` (only the rejected spans). Slot scope only.
        partial_coverage: with no anchor covering the segment, the longest correct their rows
            (reference KVCMAS); ``False``: reuse uncorrected (reference KVComm).
        skip_layer0: leave layer 0 uncorrected (reference; its K/V do not depend on the context).
        weights_cache: reuse token weights per (slot, request, anchor set) across consumers (reference).
        svd: ``"randomized"`` (``torch.svd_lowrank(q=r, niter=2)``, seeded; reference) or ``"exact"``.
        pool_peak: ``"capacity+1"`` (evict when more than V are held, as the reference) or ``"capacity"``.
        delta_frame: ``"writer"`` (reference: a delta's keys are stored in the absolute positions of
            the consumer that observed it, ``C_j - Align(C_src)`` as Eq. 12 reads, and added unrotated
            wherever the segment lands) or ``"canonical"`` (keys moved to positions ``0 ..`` and
            rotated to the target: the paper's "the corrected keys are then aligned to their target
            positions"; our earlier reading).
        key_frame: where the token weights compare keys: ``"canonical"`` (source and anchor base at
            positions ``0 ..``; reference KVCMAS) or ``"reader"`` (the source where this consumer
            places it, each anchor's base where its last consumer placed it; reference KVComm).
        prefix_delta: correct the PF text right after a corrected PH span (kept by ``prefix_reuse``)
            with the anchors' prefix deltas, weighted per layer and feature (reference KVComm; the
            KVCMAS reference runs with them off, ``--rank-pf 0``). Stored dense, in ``delta_frame``;
            slot scope only (the per-edge reading corrects no PF text).
        lead_in: the text between the chat header and a ``"lead"`` given text; ``None``: the last line
            of the PF segment before it in the first consumer's turn (when it holds no special token).
        prefix_reuse: an agent's PF text, computed on its first use, is placed on its later reuse
            turns re-positioned without correction (the reference's prefix delta off:
            :class:`~hf_kvshare.method.PrefixReuse`). Not on a turn that is dense (``tau = 0``, a gate
            fallback or ``turn_fallback="turn"``), so the exact settings stay exact.
        prefix_scope: ``"agent"`` (reference: kept in the instance across requests, as the authors'
            code keeps an agent's template K/V in class-level memory) or ``"request"`` (kept for one
            request).
        max_pools: pools kept by the instance (one per producing agent or PH slot name); past it the
            least recently used pool (read or written by a recorded turn) is dropped, so a workload
            with a new name per request (``doc{i}``) stays bounded. :meth:`state_summary` reports it.

    >>> method = KVCMAS()  # one instance, shared by every request's Session  # doctest: +SKIP
    >>> for query in queries:  # doctest: +SKIP
    ...     run_workflow(Session(model, tok, method), demo_workflow(tok, query))
    >>> method.state_bytes(), method.pools["query"]  # doctest: +SKIP
    """

    name = "kvcmas"
    #: the class's default given-text source chains hop to hop
    chained: ClassVar[bool] = True
    #: the benchmark gives this method its workload's tau (0.29 MMLU, 0.32 GSM8K, 0.34 HumanEval,
    #: as the KVCMAS authors ran them) unless its options set one
    workload_tau: ClassVar[bool] = True
    LEGACY_OPTIONS: ClassVar[dict[str, Any]] = {
        "delta_frame": "canonical",
        "key_frame": "canonical",
        "prefix_delta": False,
    }

    base_rank: int | None = 32
    delta_rank: int | None = 32
    capacity: int = 10
    tau: float = 0.3
    temperature: float = 1.0
    token_temperature: float = 1.0
    eviction_window: int = 5
    gate_scope: str = "slot"
    output_source: str = "producer"
    text_source: str = "chained"
    match: str = "full"
    turn_fallback: str = "turn"
    partial_coverage: bool = True
    skip_layer0: bool = True
    weights_cache: bool = True
    svd: str = "randomized"
    pool_peak: str = "capacity+1"
    delta_frame: str = "writer"
    key_frame: str = "canonical"
    prefix_delta: bool = False
    lead_in: str | None = None
    prefix_reuse: bool = True
    prefix_scope: str = "agent"
    max_pools: int = 64

    def __post_init__(self) -> None:
        self.check_prefix_reuse()
        _check_rank("base_rank", self.base_rank)
        _check_rank("delta_rank", self.delta_rank)
        if not isinstance(self.capacity, int) or self.capacity < 2:
            raise ValueError(
                f"capacity must be an int >= 2 (the gate needs two compatible anchors), got {self.capacity!r}"
            )
        check_tau(self.name, self.tau)
        for knob in ("temperature", "token_temperature"):
            value = getattr(self, knob)
            real = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not real or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"{self.name}: {knob} must be a finite real number > 0, got {value!r} ({type(value).__name__})"
                )
        if not isinstance(self.eviction_window, int) or self.eviction_window < 1:
            raise ValueError(f"eviction_window must be an int >= 1, got {self.eviction_window!r}")
        for knob, choices in CHOICES.items():
            if getattr(self, knob) not in choices:
                raise ValueError(
                    f"{self.name}: {knob} must be one of {', '.join(map(repr, choices))}, got {getattr(self, knob)!r}"
                )
        if self.lead_in is not None and not isinstance(self.lead_in, str):
            raise ValueError(f"{self.name}: lead_in must be a string or None, got {self.lead_in!r}")
        for knob in ("partial_coverage", "skip_layer0", "weights_cache", "prefix_delta"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"{self.name}: {knob} must be True or False, got {getattr(self, knob)!r}")
        if isinstance(self.max_pools, bool) or not isinstance(self.max_pools, int) or self.max_pools < 1:
            raise ValueError(f"{self.name}: max_pools must be an int >= 1, got {self.max_pools!r}")
        self.pools: LRUDict = LRUDict(self.max_pools)
        self._requests = RequestStates()

    @property
    def uses_sources(self) -> bool:  # type: ignore[override]
        """The session keeps slot caches unless every source is a reference prefill."""
        return self.output_source != "context_free" or self.text_source not in ("lead", "context_free")

    # ------------------------------------------------------------------ state
    def attach(self, model: torch.nn.Module) -> None:
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
        """Drop every pool, kept prefix and per-request state, and forget the model."""
        self.pools = LRUDict(self.max_pools)
        self.clear_prefixes()
        self.binding.clear()
        self._requests.clear()

    def on_bind(self, model: torch.nn.Module) -> None:
        move_state_to_model(self, model)  # loaded state onto the model's device

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The anchor pools (in order, with LFU counters and serials) and the next request uid."""
        table = TensorTable()
        meta = {
            "pools": pools_to_state(self.pools, table),
            "next_request": self._requests.next_uid,
            "evicted": self.pools.evicted,
        }
        kept, kept_meta = self.export_prefixes()  # the agents' kept PF text (prefix_scope="agent")
        return {**table.tensors, **kept}, {**meta, "prefixes": kept_meta}

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Replace the pools (per-request state of live sessions is dropped)."""
        try:
            pools = pools_from_state(meta["pools"], tensors)
            next_uid = int(meta["next_request"])
        except (KeyError, TypeError, IndexError) as error:
            raise ValueError(f"{self.name}: saved state metadata is damaged ({error!r})") from error
        frames = {a.frame for pool in pools.values() for a in pool}
        if frames - {self.delta_frame}:
            raise ValueError(
                f"{self.name}: the saved anchors hold deltas in the {', '.join(sorted(frames))} frame but this "
                f"instance has delta_frame={self.delta_frame!r}; load them into {self.name}:delta_frame="
                f"{sorted(frames)[0]} (states saved before delta_frame existed are 'canonical')"
            )
        self.import_prefixes(tensors, meta.get("prefixes", []))  # raises before replacing anything
        self.pools = LRUDict(self.max_pools)
        self.pools.update(pools)  # in the saved order: least recently used first
        self.pools.evicted = int(meta.get("evicted", 0))
        self._requests = RequestStates(next_uid)

    def request_state_bytes(self, session: Session) -> int:
        """The request's reference prefills, the producer caches the session no longer holds and the
        kept PF text (``prefix_reuse``)."""
        return self._requests.nbytes(session) + super().request_state_bytes(session)

    def state_bytes(self) -> int:
        """Exact bytes of all anchor pools (every stored factor / dense tensor) and kept PF text."""
        return sum(p.nbytes for p in self.pools.values()) + self.prefix_state_bytes()

    def state_summary(self) -> dict[str, Any]:
        return {
            "bytes": self.state_bytes(),
            "pools": len(self.pools),
            "max_pools": self.pools.limit,
            "evicted_pools": self.pools.evicted,
            "anchors": sum(len(p) for p in self.pools.values()),
            "prefixes": len(self.__dict__.get("_kept_prefixes", {})),
        }

    def pool_report(self) -> list[dict[str, Any]]:
        return [pool.describe() for pool in self.pools.values()]

    def _pool(self, key: str) -> AnchorPool:
        pool = self.pools.get(key)
        if pool is None:
            peak = self.capacity + 1 if self.pool_peak == "capacity+1" else self.capacity
            pool = self.pools[key] = AnchorPool(key, self.capacity, self.eviction_window, peak=peak)
        return pool

    def _pool_key(self, turn: Turn, slot: str) -> str:
        producer = turn.slot(slot).producer
        return producer if self.gate_scope == "slot" and producer is not None else slot

    # ---------------------------------------------------------------- sources
    def _source_kind(self, turn: Turn, slot: str) -> str:
        return self.output_source if turn.slot(slot).producer is not None else self.text_source

    def _source(self, turn: Turn, span) -> tuple[SegmentKV | None, str | None]:
        """The span's source cache and its label (source agent or REFERENCE)."""
        kind = self._source_kind(turn, span.name)
        slot = turn.slot(span.name)
        if kind == "chained":
            source = slot.latest
        elif kind in ("producer", "first"):
            source = self._requests.get(turn.request).produced.get(span.name)
        else:
            return self._reference(turn, span, kind), REFERENCE
        return source, None if source is None else source.agent

    def _reference(self, turn: Turn, span, kind: str) -> SegmentKV:
        """A reference prefill, once per request and slot, outside the workflow (counted as computed)."""
        state = self._requests.get(turn.request)
        reference = state.references.get(span.name)
        if reference is None:
            ids = turn.slot(span.name).token_ids.to(turn.device)
            lead = torch.zeros(0, dtype=torch.long)
            if kind == "lead":
                lead_in = self.lead_in if self.lead_in is not None else _lead_in(turn, span)
                lead = tokenize_text(turn.tokenizer, reference_lead(turn.tokenizer, lead_in))
            reference = state.references[span.name] = reference_prefill(turn.model, lead, ids)
            turn.stats.tokens_prefilled += lead.numel() + ids.numel()
        return reference

    def _origin(self, turn: Turn, slot: str) -> Hashable:
        state = self._requests.get(turn.request)
        if self.gate_scope == "edge" and self._source_kind(turn, slot) == "chained":
            return (state.uid, slot, state.versions.get(slot, 0))  # this exact materialization
        return (state.uid, slot)  # one anchor per (slot, request), a delta per consumer

    # ----------------------------------------------------------------- build
    def new_cache(self, turn: Turn) -> CorrectedCache:
        return CorrectedCache(turn.model.config, method=self.name)

    def plan(self, turn: Turn) -> None:
        self.bind_once(turn.model)
        if self.gate_scope == "slot":
            self._plan(turn)

    def finish(self, turn: Turn, cache) -> None:
        edges = turn.scratch.get(self.name, {})
        for seg in cache.segments:
            edge = edges.get(seg.start)
            if seg.kind == "PH" and edge is not None and seg.provenance == "dense":
                seg.info.update(edge.report())

    def prefix_reuse_allowed(self, turn: Turn) -> bool:
        """Kept PF text is placed only on a reuse turn: ``tau > 0`` and (slot scope) no PH span of the
        turn prefilled because of a gate rejection (the reference's dense mode prefills everything)."""
        if self.tau == 0:
            return False
        edges = turn.scratch.get(self.name, {}) if self.gate_scope == "slot" else {}
        return not any(edge.dense in ("fallback", "turn") for edge in edges.values())

    def placeholder(self, turn: Turn, span, cache) -> Placement | None:
        if self.gate_scope == "slot":
            return self._place(turn, span)
        return self._edge_placeholder(turn, span)

    # ------------------------------------------------------ slot scope (reference)
    def _gated(self, turn: Turn, slot: str) -> bool:
        return self._source_kind(turn, slot) not in ("chained", "first") or (
            turn.slot(slot).producer is not None
        )

    def _gate(
        self, pool_key: str, candidate: SegmentKV
    ) -> tuple[GateDecision, list[Anchor], torch.Tensor | None]:
        """The reference gate (``predict_as_anchor``) of ``candidate`` against pool ``pool_key``."""
        pool = self.pools.get(pool_key)
        anchors = list(pool) if pool is not None else []
        length = candidate.length
        if self.match == "full":
            rows, eligible = length, [a for a in anchors if a.length >= length]
        else:
            rows = comparison_prefix(anchors, length)
            eligible = [a for a in anchors if a.length >= rows] if rows else []
        if len(eligible) < 2:
            why = f"fewer than 2 anchors at least {rows or length} tokens long ({len(eligible)} of {len(anchors)})"
            return GateDecision(False, why), eligible, None
        distances = gate_distances(candidate.values, eligible, rows)
        decision = reliability_gate(distances, self.tau, self.temperature)
        return decision, eligible, distances

    def _pending(self, turn: Turn) -> dict[str, Any]:
        """What this turn will change in the method's and the request's state, applied by :meth:`record`
        only (a turn that fails before leaves the LFU counters and the gate decisions as they were)."""
        return turn.scratch.setdefault(f"{self.name}.pending", {"decisions": {}, "reports": {}, "uses": []})

    def _commit(self, turn: Turn) -> None:
        pending = turn.scratch.pop(f"{self.name}.pending", None) or {
            "decisions": {},
            "reports": {},
            "uses": [],
        }
        state = self._requests.get(turn.request)
        state.decisions.update(pending["decisions"])
        state.gate_reports.update(pending["reports"])
        for anchor in pending["uses"]:
            anchor.uses += 1
        for edge in turn.scratch.get(self.name, {}).values():  # pools this turn read or wrote: most recent
            self.pools.touch(edge.pool)

    def _gate_report(self, turn: Turn, slot: str) -> tuple[int, list[float] | None]:
        state = self._requests.get(turn.request)
        return state.gate_reports.get(slot) or self._pending(turn)["reports"].get(slot, (0, None))

    def _decide(self, turn: Turn, slot: str, candidate: SegmentKV) -> GateDecision:
        state = self._requests.get(turn.request)
        pending = self._pending(turn)
        decision = state.decisions.get(slot)
        if decision is None:
            decision = pending["decisions"].get(slot)
        if decision is None:
            decision, eligible, distances = self._gate(self._pool_key(turn, slot), candidate)
            pending["decisions"][slot] = decision
            pending["reports"][slot] = (len(eligible), None if distances is None else decision.distances)
            if decision.accepted:
                pending["uses"].extend(eligible[i] for i in usage_reference(decision.weights, USAGE_MASS))
        return decision

    def _plan(self, turn: Turn) -> None:
        """Decide every PH span of the turn before building (the turn is the unit of obeying)."""
        edges = turn.scratch[self.name] = {}
        for span in turn.spans:
            if span.kind != "PH":
                continue
            source, label = self._source(turn, span)
            edge = edges[span.start] = Edge(
                slot=span.name,
                source=source,
                label=label,
                origin=self._origin(turn, span.name),
                pool=self._pool_key(turn, span.name),
                rebase=self._source_kind(turn, span.name) == "chained",
            )
            if source is None:
                edge.dense = "first"
                continue
            if self._gated(turn, span.name):
                edge.decision = self._decide(turn, span.name, source)
                edge.candidates, edge.distances = self._gate_report(turn, span.name)
            pool = self.pools.get(edge.pool)
            anchor = pool.find(edge.origin) if pool is not None else None
            own = anchor is not None and turn.agent in anchor.deltas
            if self.tau == 0:
                edge.dense, edge.reason = "fallback", "tau = 0: no reuse"
            elif edge.decision is not None and not edge.decision.accepted and not own:
                edge.dense = "fallback"
            elif edge.decision is None and self.turn_fallback == "span":
                if pool is None or not pool.with_delta(turn.agent):
                    edge.dense, edge.reason = "fallback", f"no anchor holds a correction for {turn.agent!r}"
        if self.turn_fallback == "turn":
            rejected = [e.slot for e in edges.values() if e.dense]
            for edge in edges.values():
                if rejected and edge.dense is None:
                    edge.dense, edge.reason = "turn", f"the turn is dense: {', '.join(rejected)} not reusable"

    def _place(self, turn: Turn, span) -> Placement | None:
        edge = turn.scratch[self.name][span.start]
        if edge.dense is not None:
            return None
        gate = "ungated" if edge.decision is None else "accepted"
        info: dict[str, Any] = {"gate": gate, "tau": self.tau}
        if edge.decision is not None and edge.decision.entropy is not None:
            info["entropy"] = edge.decision.entropy
        pool = self.pools.get(edge.pool)
        usable = pool.with_delta(turn.agent) if pool is not None else []
        anchors, rows = covering(usable, span.length, self.partial_coverage)
        if not anchors:
            info["reason"] = f"no anchor holds a correction for {turn.agent!r}: reused uncorrected"
            return Placement(kv=edge.source, provenance="reused", source_agent=edge.label, info=info)
        edge.rows = rows
        reader = span.start if self.key_frame == "reader" else None
        wk, wv, cached = self._token_weights(turn, edge, anchors, rows, reader)
        kv = apply_correction(
            edge.source, anchors, turn.agent, wk, wv, span.start, turn.shifter, skip_layer0=self.skip_layer0
        )
        info.update(
            anchors=[a.serial for a in anchors],
            rows=f"{rows}/{span.length}",
            weights_cached=cached,
        )
        following = _following_pf(turn, span)
        if self.prefix_delta and self.prefix_reuse and following is not None and rows == span.length:
            key = ("prefix", edge.slot, edge.pool, tuple(a.serial for a in anchors))
            weights, _ = self._cached_weights(
                turn, key, lambda: prefix_weights(edge.source, anchors, turn.shifter, reader)
            )
            turn.scratch.setdefault(f"{self.name}.pf", {})[following.start] = (anchors, *weights)
        return Placement(kv=kv, provenance="corrected", source_agent=edge.label, info=info)

    def _cached_weights(
        self, turn: Turn, key: tuple, compute
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
        """``(weights, reused)``: weights computed once per (slot, request, anchor set) and reused by
        later consumers (``weights_cache``, as the reference caches them), else every time."""
        state = self._requests.get(turn.request)
        if self.weights_cache and key in state.weights:
            return state.weights[key], True
        weights = compute()
        if self.weights_cache:
            state.weights[key] = weights
        return weights, False

    def _token_weights(self, turn: Turn, edge: Edge, anchors: list[Anchor], rows: int, reader: int | None):
        def compute():
            kd, vd = token_distances(edge.source, anchors, turn.shifter, rows, reader_start=reader)
            return token_weights(kd, self.token_temperature), token_weights(vd, self.token_temperature)

        key = (edge.slot, edge.pool, tuple(a.serial for a in anchors), rows)
        (wk, wv), cached = self._cached_weights(turn, key, compute)
        return wk, wv, cached

    def prefix(self, turn: Turn, span, cache) -> Placement | None:
        """Kept PF text (``prefix_reuse``); with ``prefix_delta``, the PF right after a corrected PH span
        gets the anchors' prefix deltas for this agent (all of the PH's anchors must hold one for
        this exact PF text, else it stays as placed)."""
        placement = super().prefix(turn, span, cache)
        pending = turn.scratch.get(f"{self.name}.pf", {}).get(span.start)
        if placement is None or pending is None:
            return placement
        anchors, wk, wv = pending
        ids = tuple(span.token_ids.tolist())
        held = [a.prefix_deltas.get(turn.agent) for a in anchors]
        if any(h is None or h[0] != ids for h in held):
            placement.info["prefix_delta"] = "not every anchor holds a correction of this PF text"
            return placement
        placement.kv = prefix_correction(
            placement.kv, [h[1] for h in held], wk, wv, anchors[0].frame, turn.shifter, self.skip_layer0
        )
        placement.info["prefix_delta"] = [a.serial for a in anchors]
        return placement

    # ------------------------------------------------------ edge scope (earlier reading)
    def _edge_placeholder(self, turn: Turn, span) -> Placement | None:
        edges = turn.scratch.setdefault(self.name, {})
        source, label = self._source(turn, span)
        edge = edges[span.start] = Edge(slot=span.name, source=source, label=label, pool=span.name)
        if source is None:
            return None
        edge.origin = self._origin(turn, span.name)
        if self.tau == 0:
            edge.decision = GateDecision(False, "tau = 0: no reuse")
            return None
        pool = self.pools.get(span.name)
        candidates = pool.compatible(edge.label, turn.agent) if pool is not None else []
        if self.match == "prefix":
            rows = comparison_prefix(candidates, span.length)
            eligible = [a for a in candidates if a.length >= rows] if rows else []
        else:
            rows, eligible = span.length, [a for a in candidates if a.length >= span.length]
        edge.candidates = len(eligible)
        if len(eligible) < 2:
            edge.decision = GateDecision(False, f"fewer than 2 compatible anchors ({len(candidates)})")
            return None
        found = match(source, eligible, turn.shifter, rows)
        edge.decision = reliability_gate(found.gate_distances, self.tau, self.temperature)
        edge.distances = list(edge.decision.distances)  # read back with the decision: no extra sync
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
            skip_layer0=self.skip_layer0,
        )
        self._pending(turn)["uses"].extend(
            eligible[i] for i in usage_crossing(edge.decision.weights, USAGE_MASS)
        )
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

    # ---------------------------------------------------------------- record
    def record(self, turn: Turn, cache) -> None:
        """After the first token: keep the producer's cache of the output (and its gate decision),
        then store the observed corrections of the spans that were prefilled because of a rejection
        (accepted corrections are never inserted)."""
        state = self._requests.get(turn.request)
        slots = turn.slots
        output = slots[turn.output_slot].latest
        self._check_finite(turn, cache, output)  # before anything changes
        if output is not None and self.output_source == "producer":
            state.produced[turn.output_slot] = output
        edges = turn.scratch.get(self.name, {})
        for span in turn.spans:
            if span.kind != "PH":
                continue
            if (
                self.text_source == "first"
                and span.name not in state.produced
                and slots[span.name].producer is None
            ):
                if slots[span.name].latest is not None:
                    state.produced[span.name] = slots[span.name].latest
            edge = edges.get(span.start)
            if edge is None or edge.source is None:
                continue
            if self.gate_scope == "edge":
                if not edge.decision.accepted:
                    self._insert_edge(edge, cache.extract(span.start, span.end, agent=turn.agent), turn)
                continue
            if edge.dense is None:
                continue
            rejected = edge.decision is not None and not edge.decision.accepted
            if rejected or edge.decision is None:  # ungated given text: admitted while the pool has room
                exact = cache.extract(span.start, span.end, agent=turn.agent)
                self._add_delta(
                    edge, exact, turn, may_evict=edge.decision is not None, span=span, cache=cache
                )
        if self.gate_scope == "slot" and output is not None and self.output_source != "context_free":
            self._decide(turn, turn.output_slot, output)  # the producer gates its own output, once
        if self.gate_scope == "edge":
            for span in turn.spans:
                if span.kind == "PH":
                    state.versions[span.name] = state.versions.get(span.name, 0) + 1
        super().record(turn, cache)  # PrefixReuse: keep the agent's newly computed PF text
        self._commit(turn)

    def _check_finite(self, turn: Turn, cache, output: SegmentKV | None) -> None:
        """Refuse non-finite K/V before it becomes a source or enters a pool (nothing changed yet);
        every segment of the turn in one host read."""
        checks = []
        if output is not None and self.output_source != "context_free":
            checks.append((f"{self.name}: the output slot {turn.output_slot!r}", output))
        edges = turn.scratch.get(self.name, {})
        for span in turn.spans:
            edge = edges.get(span.start) if span.kind == "PH" else None
            if edge is None or edge.source is None:
                continue
            checks.append((f"{self.name}: the source of PH slot {span.name!r}", edge.source))
            checks.append(
                (f"{self.name}: PH slot {span.name!r} of this turn", cache.extract(span.start, span.end))
            )
        check_finite(checks)

    def _difference(
        self, exact: SegmentKV, source: SegmentKV, turn: Turn, source_keys: list[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``C_consumer - Align(C_source)`` (Eq. 12) per layer, batch element 0, keys in ``delta_frame``
        (``source_keys``: the source's canonical keys when already computed)."""
        if self.delta_frame == "writer":
            placed = source.repositioned(turn.shifter, exact.start)
            keys = [k[:1] - s[:1] for k, s in zip(exact.keys, placed.keys)]
        else:
            source_keys = source_keys or canonical_keys(source, turn.shifter)
            keys = [k - s for k, s in zip(canonical_keys(exact, turn.shifter), source_keys)]
        return keys, [v[:1] - s[:1] for v, s in zip(exact.values, source.values)]

    def _delta(self, edge: Edge, exact: SegmentKV, turn: Turn) -> tuple[FactoredKV, list[torch.Tensor]]:
        """The consumer's observed correction of a PH span, factorized at ``delta_rank``; and the
        source's canonical keys (for the base)."""
        source_keys = canonical_keys(edge.source, turn.shifter)
        keys, values = self._difference(exact, edge.source, turn, source_keys)
        return FactoredKV.from_kv(keys, values, self.delta_rank, self.svd), source_keys

    def _prefix_delta(self, turn: Turn, span, cache) -> tuple[tuple[int, ...], FactoredKV] | None:
        """The correction of the PF text right after ``span`` in this dense turn: its exact K/V minus
        the agent's kept PF (as ``prefix_reuse`` would place it; zero when this turn is the one that
        keeps it), dense, keys in ``delta_frame``."""
        following = _following_pf(turn, span)
        if following is None:
            return None
        ids = tuple(following.token_ids.tolist())
        exact = cache.extract(following.start, following.end, agent=turn.agent)
        kept = self.prefix_store(turn).get((turn.agent, ids))
        keys, values = self._difference(exact, exact if kept is None else kept, turn)
        return ids, FactoredKV.from_kv(keys, values, None)

    def _base(self, edge: Edge, source_keys: list[torch.Tensor]) -> FactoredKV:
        return FactoredKV.from_kv(source_keys, [v[:1] for v in edge.source.values], self.base_rank, self.svd)

    def _add_delta(self, edge: Edge, exact: SegmentKV, turn: Turn, may_evict: bool, span, cache) -> None:
        """Add this consumer's delta to the one anchor of (slot, request), creating it if needed
        (``may_evict=False``: only while the pool has room; a frozen pool is never evicted)."""
        pool = self._pool(edge.pool)
        anchor = pool.find(edge.origin)
        if anchor is None and not may_evict and len(pool) >= self.capacity:
            return
        delta, source_keys = self._delta(edge, exact, turn)
        prefix = self._prefix_delta(turn, span, cache) if self.prefix_delta and self.prefix_reuse else None
        new = anchor is None
        if new:
            anchor = Anchor(
                base=self._base(edge, source_keys),
                source=edge.label,
                origin=edge.origin,
                frame=self.delta_frame,
            )
        elif edge.rebase:  # the reference's entry.update: the base becomes this consumer's source
            anchor.base, anchor.source = self._base(edge, source_keys), edge.label
        anchor.deltas[turn.agent] = delta
        anchor.base_start = exact.start  # ... as this consumer placed it (KVComm compares keys there)
        if prefix is not None:
            anchor.prefix_deltas[turn.agent] = prefix
        if new:
            pool.insert(anchor)

    def _insert_edge(self, edge: Edge, exact: SegmentKV, turn: Turn) -> None:
        pool = self._pool(edge.slot)
        anchor = pool.find(edge.origin)
        if anchor is not None and turn.agent in anchor.deltas:
            return  # this consumer's correction of this base is already stored
        delta, source_keys = self._delta(edge, exact, turn)
        if anchor is None:
            anchor = Anchor(
                base=self._base(edge, source_keys),
                source=edge.label,
                origin=edge.origin,
                frame=self.delta_frame,
                base_start=exact.start,
            )
            anchor.deltas[turn.agent] = delta
            pool.insert(anchor)
        else:
            anchor.deltas[turn.agent] = delta


def _following_pf(turn: Turn, span):
    """The PF span right after ``span`` in the turn's prompt, or ``None``."""
    index = next(i for i, s in enumerate(turn.spans) if s.start == span.start)
    if index + 1 < len(turn.spans) and turn.spans[index + 1].kind == "PF":
        return turn.spans[index + 1]
    return None


def _lead_in(turn: Turn, span) -> str:
    """The last line of the PF segment right before ``span`` (``""`` when it holds a special token
    such as a chat header, or when ``span`` follows another PH or starts the prompt)."""
    index = next(i for i, s in enumerate(turn.spans) if s.start == span.start)
    if index == 0 or turn.spans[index - 1].kind != "PF":
        return ""
    text = turn.spans[index - 1].spec.text
    cut = text.rstrip().rfind("\n")
    line = text[cut + 1 :]
    special = getattr(turn.tokenizer, "all_special_tokens", None) or []
    return "" if any(tok and tok in line for tok in special) else line

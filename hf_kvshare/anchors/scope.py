"""The common part of the two gate scopes of online anchor correction (KVCMAS, KVComm): the
interface a method drives from its hooks, the per-span record of what was decided (:class:`Edge`),
where a PH span's source cache comes from, the pending/commit step, and the observed deltas.

A scope is driven exactly as the method contract is (``Method.build`` or a serving host):

- :meth:`Scope.plan` (``Method.plan``): decide before anything is placed;
- :meth:`Scope.place` (``Method.placeholder``): a PH span's K/V as a :class:`Reuse`, or ``None``
  (prefill it); :meth:`Scope.correct_prefix` (``Method.prefix``): the kept PF text after a
  corrected span, corrected; :meth:`Scope.dense_turn`: the turn prefills its kept PF text too;
- :meth:`Scope.report` (``Method.finish``): the gate outcome on the dense PH rows;
- :meth:`Scope.learn` then :meth:`Scope.commit` (``Method.record``): store what the turn observed,
  then apply the pending changes (gate decisions, LFU counters, pool recency). A turn that fails
  before changes nothing;
- :meth:`Scope.deferred_work` (``Method.deferred_work``): with ``defer_factorization``, the anchors'
  factorizations the records stored for later, one callable each (a reader that gets there first
  factorizes it itself: the same factors).

The implementations are :class:`~.slot_scope.SlotScope` (the reference: one decision per (slot,
request), obeyed by every consumer) and :class:`~.edge_scope.EdgeScope` (every edge gated on its own).
A scope reads its knobs live from ``options`` (the method: the fields documented on
:class:`~hf_kvshare.methods.kvcmas.KVCMAS`, and ``prefix_store(turn)``, its kept PF text), keeps its
pools and per-request state in a :class:`~.store.BoundedStore`, and reads a request only through
the Turn's read API.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..segment_kv import OTHER_RANK, SegmentKV, check_finite
from ..trajectory import tokenize_text
from .correction import canonical_key_layers, canonical_keys
from .gate import GateDecision
from .lowrank import DEFERRED_WORK, DeferredFactoredKV, FactoredKV, any_rank, layer_offset
from .pool import REFERENCE, AnchorPool, LRUDict
from .state import RequestState, reference_lead, reference_prefill
from .store import BoundedStore

if TYPE_CHECKING:
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
    pool: str = ""
    rebase: bool = False  # the anchor's base follows this source (chained sources)
    decision: GateDecision | None = None  # None: not gated (chained / first given text)
    dense: str | None = None  # why the span is prefilled: "first", "fallback", "turn"
    reason: str = ""
    candidates: int = 0
    rows: int = 0
    distances: list[float] | None = None
    #: ``verify_tokens``: the gate's rejection a verification probe may overturn (``""``: none), and what
    #: the probe found (:meth:`~hf_kvshare.anchors.verify.Probe.report`; ``None``: not probed)
    rejected: str = ""
    probe: dict[str, Any] | None = None

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
        if self.probe is not None:
            info["verify"] = self.probe
        return info


@dataclass
class Reuse:
    """A PH span's K/V obtained without prefilling it (the method returns it as a ``Placement``)."""

    kv: SegmentKV
    provenance: str  # "reused" (uncorrected) or "corrected"
    source_agent: str | None
    info: dict[str, Any] = field(default_factory=dict)
    #: tokens served through the correction (``None``: all when ``provenance == "corrected"``); fewer
    #: with partial coverage: the rows past the longest anchor are reused uncorrected
    corrected_tokens: int | None = None
    #: tokens not computed for this agent (``None``: all); a verification probe computes its own
    reused_tokens: int | None = None


class Scope:
    """One gate scope (module docstring). ``name`` keys the turn's scratch (``turn.scratch[name]``:
    start -> :class:`Edge`)."""

    def __init__(self, name: str, options: Any, store: BoundedStore):
        self.name, self.options, self.store = name, options, store
        #: the factorizations records stored for later (``defer_factorization``), weakly: an anchor
        #: evicted before its turn came is not factorized at all (:meth:`deferred_work`)
        self._later: list[weakref.ref] = []

    def deferred_work(self) -> list[Callable[[], None]]:
        """The factorizations the records since the last call left for later, one callable per
        delta or base (each factorizes it, a no-op once a reader did or the anchor is gone); empty
        unless ``defer_factorization``. The caller runs them when it likes: the session at once
        (in the record, as without deferral), the serving host on its background thread when no plan
        waits."""
        refs, self._later = self._later, []
        return [functools.partial(_resolve, ref) for ref in refs]

    @property
    def deferring(self) -> bool:
        return bool(getattr(self.options, "defer_factorization", False))

    @property
    def skips_layer0(self) -> bool:
        """Whether this member's first layer is left uncorrected: ``skip_layer0`` names the model's layer
        0, which a later pipeline stage does not hold (:func:`~.lowrank.layer_offset`)."""
        return bool(self.options.skip_layer0) and layer_offset(self.store.shard) == 0

    def deferred_factors(
        self,
        layers: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
        held: SegmentKV,
        *others: SegmentKV,
        rank: int | None,
        tag: Any,
    ) -> DeferredFactoredKV:
        """A factorization of ``layers()`` on its first read: it holds the K/V of ``held`` (whose shape
        it has) and ``others`` (``layers`` reads them) until then."""
        kvs = (held, *others)
        return DeferredFactoredKV(
            layers,
            lambda: [t for kv in kvs for t in (*kv.keys, *kv.values)],
            rank,
            self.options.svd,
            length=held.length,
            kv_heads=held.keys[0].shape[1],
            num_layers=held.num_layers,
            tag=tag,
            shard=self.store.shard,
        )

    def later(
        self,
        layers: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
        held: SegmentKV,
        *others: SegmentKV,
        rank: int | None,
    ) -> DeferredFactoredKV:
        """:meth:`deferred_factors` stored as a record's work for later (:meth:`deferred_work`)."""
        deferred = self.deferred_factors(layers, held, *others, rank=rank, tag=DEFERRED_WORK)
        self._later.append(weakref.ref(deferred))
        return deferred

    # ---------------------------------------------------------------- interface
    def plan(self, turn: Turn) -> None:
        """Decide before any span is placed (nothing by default: decided per span)."""

    def place(self, turn: Turn, span, cache=None) -> Reuse | None:
        """The span's K/V, or ``None`` (prefill it); ``cache``: the turn's cache, complete up to the span
        where the method reads it (``verify_tokens``)."""
        raise NotImplementedError

    def dense_turn(self, turn: Turn) -> bool:
        """The turn prefills because of a gate rejection (kept PF text is then not placed either)."""
        return False

    def correct_prefix(self, turn: Turn, span, kv: SegmentKV) -> tuple[SegmentKV, Any] | None:
        """``(kv, report)``: the kept PF text ``kv`` of ``span`` corrected, or ``None`` (as placed)."""
        return None

    def report(self, turn: Turn, cache) -> None:
        """Write each edge's gate outcome on its dense PH row of the built cache."""
        edges = self.edges(turn)
        for seg in cache.segments:
            edge = edges.get(seg.start)
            if seg.kind == "PH" and edge is not None and seg.provenance == "dense":
                seg.info.update(edge.report())

    def learn(self, turn: Turn, cache) -> None:
        """After the first token: keep the producer's cache of the output, then store what each PH span
        observed (:meth:`observe`, :meth:`learned`); nothing changes when the turn holds non-finite K/V."""
        o = self.options
        state = self.request(turn)
        slots = turn.slots
        output = slots[turn.output_slot].latest
        self.check_finite(turn, cache, output)  # before anything changes
        self.settle(turn)
        if output is not None and o.output_source == "producer":
            state.produced[turn.output_slot] = output
        edges = self.edges(turn)
        for span in turn.spans:
            if span.kind != "PH":
                continue
            if (
                slots[span.name].producer is None
                and self.source_kind(turn, span.name) == "first"
                and span.name not in state.produced
            ):
                if slots[span.name].latest is not None:
                    state.produced[span.name] = slots[span.name].latest
            edge = edges.get(span.start)
            if edge is None or edge.source is None:
                continue
            self.observe(turn, span, edge, cache)
        self.learned(turn, output)

    def observe(self, turn: Turn, span, edge: Edge, cache) -> None:
        """Store what PH ``span`` (with a source) observed in this recorded turn."""

    def learned(self, turn: Turn, output: SegmentKV | None) -> None:
        """After every span was observed (``output``: the turn's output cache)."""

    def commit(self, turn: Turn) -> None:
        """Apply what :meth:`pending` collected: gate decisions and reports, LFU counters, pool recency."""
        pending = turn.scratch.pop(f"{self.name}.pending", None) or {
            "decisions": {},
            "reports": {},
            "uses": [],
        }
        state = self.request(turn)
        state.decisions.update(pending["decisions"])
        state.gate_reports.update(pending["reports"])
        for anchor in pending["uses"]:
            anchor.uses += 1
        for edge in self.edges(turn).values():  # pools this turn read or wrote: most recent
            self.pools.touch(edge.pool)

    # ------------------------------------------------------------------ state
    @property
    def pools(self) -> LRUDict:
        return self.store.entries

    def request(self, turn: Turn) -> RequestState:
        return self.store.requests.get(turn.request)

    def edges(self, turn: Turn) -> dict[int, Edge]:
        return turn.scratch.get(self.name, {})

    def pending(self, turn: Turn) -> dict[str, Any]:
        """What this turn will change in the method's and the request's state, applied by :meth:`commit`
        only (a turn that fails before leaves the LFU counters and the gate decisions as they were)."""
        return turn.scratch.setdefault(f"{self.name}.pending", {"decisions": {}, "reports": {}, "uses": []})

    def pool(self, key: str) -> AnchorPool:
        """Pool ``key``, created empty when missing."""
        o = self.options
        pool = self.pools.get(key)
        if pool is None:
            peak = o.capacity + 1 if o.pool_peak == "capacity+1" else o.capacity
            pool = self.pools[key] = AnchorPool(key, o.capacity, o.eviction_window, peak=peak)
        return pool

    # ---------------------------------------------------------------- sources
    def source_kind(self, turn: Turn, slot: str) -> str:
        """Where the slot's source comes from (:meth:`slot_source_kind` of the turn's slot)."""
        return self.slot_source_kind(turn.slot(slot))

    def slot_source_kind(self, held: Any) -> str:
        """Where ``held``'s (a request's slot) source comes from: ``output_source`` for an output,
        ``observation_source`` for an observation (unless ``"question"``: read as the question),
        ``text_source`` for the question."""
        o = self.options
        if held.producer is not None:
            return o.output_source
        if held.kind == "observation" and o.observation_source != "question":
            return o.observation_source
        return o.text_source

    def source(self, turn: Turn, span) -> tuple[SegmentKV | None, str | None]:
        """The span's source cache and its label (source agent or REFERENCE)."""
        kind = self.source_kind(turn, span.name)
        slot = turn.slot(span.name)
        if kind == "chained":
            source = slot.latest
        elif kind in ("producer", "first"):
            source = self.request(turn).produced.get(span.name)
        else:
            return self.reference(turn, span, kind), REFERENCE
        return source, None if source is None else source.agent

    def reference(self, turn: Turn, span, kind: str) -> SegmentKV:
        """A reference prefill, once per request and slot, outside the workflow (counted as computed)."""
        state = self.request(turn)
        reference = state.references.get(span.name)
        if reference is None:
            ids = turn.slot(span.name).token_ids.to(turn.device)
            lead = torch.zeros(0, dtype=torch.long)
            if kind == "lead":
                lead_in = (
                    self.options.lead_in if self.options.lead_in is not None else lead_in_line(turn, span)
                )
                lead = tokenize_text(turn.tokenizer, reference_lead(turn.tokenizer, lead_in))
            visual = turn.slot(span.name).visual  # an image / video slot: its features, not its ids
            embeds = None if visual is None else visual.embeds(turn.model)
            reference = state.references[span.name] = reference_prefill(
                turn.model, lead, ids, embeds, None if visual is None else visual.rope
            )
            turn.stats.tokens_prefilled += lead.numel() + ids.numel()
        return reference

    def origin(self, turn: Turn, slot: str) -> Hashable:
        """One anchor per (slot, request), a delta per consumer."""
        return (self.request(turn).uid, slot)

    # ----------------------------------------------------------------- deltas
    def check_finite(self, turn: Turn, cache, output: SegmentKV | None) -> None:
        """Refuse non-finite K/V before it becomes a source or enters a pool (nothing changed yet);
        every segment of the turn in one host read (under a shard: any rank's heads, every rank refuses)."""
        checks = []
        if output is not None and self.options.output_source != "context_free":
            checks.append((f"{self.name}: the output slot {turn.output_slot!r}", output))
        edges = self.edges(turn)
        for span in turn.spans:
            edge = edges.get(span.start) if span.kind == "PH" else None
            if edge is None or edge.source is None:
                continue
            checks.append((f"{self.name}: the source of PH slot {span.name!r}", edge.source))
            with cache.sharing_storage():  # views: checked where they sit, not copied
                exact = cache.extract(span.start, span.end)
            checks.append((f"{self.name}: PH slot {span.name!r} of this turn", exact))
        refused: list[ValueError] = []

        def non_finite() -> bool:  # this rank's heads (a follower holds none: it takes the leader's answer)
            try:
                check_finite(checks, layer_offset(self.store.shard))
            except ValueError as error:
                refused.append(error)
            return bool(refused)

        if any_rank(non_finite, self.store.shard):  # every rank of the shard refuses the turn
            if refused:
                raise refused[0]
            raise ValueError(
                f"{self.name}: non-finite K/V (NaN or inf) in {OTHER_RANK} of this turn; such K/V is never "
                "reused or stored (the turn changed nothing)"
            )

    def difference(
        self, exact: SegmentKV, source: SegmentKV, turn: Turn, source_keys: list[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``C_consumer - Align(C_source)`` (Eq. 12) per layer, batch element 0, keys in ``delta_frame``
        (``source_keys``: the source's canonical keys when already computed)."""
        pairs = list(self.difference_layers(exact, source, turn, source_keys))
        return [k for k, _ in pairs], [v for _, v in pairs]

    def difference_layers(
        self, exact: SegmentKV, source: SegmentKV, turn: Turn, source_keys: list[torch.Tensor] | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`difference` one layer at a time (a generator: the source re-positioned and the
        difference computed for a layer only when it is asked for; the same values)."""
        return _difference_layers(exact, source, turn.shifter, self.options.delta_frame, source_keys)

    def delta(
        self, edge: Edge, exact: SegmentKV, turn: Turn
    ) -> tuple[FactoredKV, Callable[[], Iterable[torch.Tensor]]]:
        """The consumer's observed correction of a PH span, factorized at ``delta_rank`` layer by layer
        (one layer's difference alive at a time); and the source's canonical keys (for the base) as a
        callable: the ones the delta computed (canonical frame), else computed layer by layer when
        asked (the writer frame's delta needs none: a turn that stores no base rotates nothing).
        With ``defer_factorization`` the delta is stored for later (:meth:`later`: it holds this
        consumer's and the source's K/V until then) and the keys are computed when asked."""
        if self.deferring:
            source, shifter, frame = edge.source, turn.shifter, self.options.delta_frame
            delta = self.later(
                lambda: _difference_layers(exact, source, shifter, frame),
                exact,
                source,
                rank=self.options.delta_rank,
            )
            return delta, lambda: canonical_key_layers(source, shifter)
        canonical = (
            canonical_keys(edge.source, turn.shifter) if self.options.delta_frame != "writer" else None
        )

        def source_keys() -> Iterable[torch.Tensor]:
            return canonical if canonical is not None else canonical_key_layers(edge.source, turn.shifter)

        layers = self.difference_layers(exact, edge.source, turn, canonical)
        delta = FactoredKV.from_layers(layers, self.options.delta_rank, self.options.svd, self.store.shard)
        return delta, source_keys

    def base(
        self, edge: Edge, source_keys: Callable[[], Iterable[torch.Tensor]]
    ) -> FactoredKV | DeferredFactoredKV:
        """An anchor's base: the source, keys canonical, factorized at ``base_rank`` (layer by layer;
        with ``defer_factorization`` stored for later, holding the source until then)."""
        source = edge.source

        def layers() -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
            return zip(source_keys(), (v[:1] for v in source.values))

        if self.deferring:
            return self.later(layers, source, rank=self.options.base_rank)
        return FactoredKV.from_layers(layers(), self.options.base_rank, self.options.svd, self.store.shard)

    def deferred_base(self, edge: Edge, turn: Turn) -> DeferredFactoredKV:
        """:meth:`base`, factorized on its first read (or when the request ends) instead of now: a
        chained question's base, which the next consumer's rebase replaces in the same request. It
        holds the source (the slot's K/V of the previous hop) until then; the same factors (the
        canonical keys are computed again, layer by layer, from the source)."""
        source, shifter = edge.source, turn.shifter
        state = self.request(turn)

        def layers() -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
            return zip(canonical_key_layers(source, shifter), (v[:1] for v in source.values))

        deferred = self.deferred_factors(layers, source, rank=self.options.base_rank, tag=state.uid)
        state.deferred.append(weakref.ref(deferred))
        return deferred

    def settle(self, turn: Turn) -> None:
        """Factorize the deferred bases other requests stored (a request whose session is still alive
        but no longer running: its next consumer will not replace them)."""
        uid = self.request(turn).uid
        for pool in self.pools.values():
            for anchor in pool:
                anchor.settle_base(keep=uid)


def _resolve(ref: weakref.ref) -> None:
    deferred = ref()
    if deferred is not None:
        deferred.resolve()


def _difference_layers(
    exact: SegmentKV,
    source: SegmentKV,
    shifter,
    frame: str,
    source_keys: list[torch.Tensor] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """:meth:`Scope.difference_layers` from what it reads alone (a deferred delta holds no turn)."""
    if frame == "writer":
        placed = source.keys_at(shifter, exact.start)
        keys = (k[:1] - s[:1] for k, s in zip(exact.keys, placed))
    else:
        if source_keys is None:  # one layer's rotated keys at a time
            source_keys = canonical_key_layers(source, shifter)
        keys = (k - s for k, s in zip(canonical_key_layers(exact, shifter), source_keys))
    for key, v, s in zip(keys, exact.values, source.values):
        yield key, v[:1] - s[:1]


def span_index(turn: Turn, span) -> int:
    return next(i for i, s in enumerate(turn.spans) if s.start == span.start)


def following_pf(turn: Turn, span):
    """The PF span right after ``span`` in the turn's prompt, or ``None``."""
    index = span_index(turn, span)
    if index + 1 < len(turn.spans) and turn.spans[index + 1].kind == "PF":
        return turn.spans[index + 1]
    return None


def lead_in_line(turn: Turn, span) -> str:
    """The last line of the PF segment right before ``span`` (``""`` when it holds a special token
    such as a chat header, or when ``span`` follows another PH or starts the prompt)."""
    index = span_index(turn, span)
    if index == 0 or turn.spans[index - 1].kind != "PF":
        return ""
    text = turn.spans[index - 1].spec.text
    cut = text.rstrip().rfind("\n")
    line = text[cut + 1 :]
    special = getattr(turn.tokenizer, "all_special_tokens", None) or []
    return "" if any(tok and tok in line for tok in special) else line

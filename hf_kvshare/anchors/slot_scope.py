"""Slot scope, the reference gating of KVCMAS / KVComm (``gate_scope="slot"``).

One gate decision per (slot, request), taken by the producer right after its turn for an output
(:meth:`SlotScope.learned`), by the first consumer for a reference-prefilled given text
(:meth:`SlotScope.plan`); chained / first given text is not gated. Every consumer obeys: a consumer
of a rejected slot without its own delta in the slot's anchor of this request prefills (its whole
turn with ``turn_fallback="turn"``) and adds its delta to the one anchor of (slot, request)
(:meth:`SlotScope.observe`); otherwise it reuses every PH span, corrected by the anchors holding its
delta (:meth:`SlotScope.place`). Token weights are computed once per (slot, request, anchor set)
(``weights_cache``). Pools are per producing agent for outputs.

Beyond the reference (the options KVCMAS's ``profile="reuse"`` sets; ``profile="reference"`` turns
each off):

- ``agreement > 0``: the gate also judges the correction, not only the weights
  (:meth:`SlotScope.gate`). Where the entropy rule rejects, the slot is accepted when the candidate
  anchors' corrections agree (:func:`~.pool.correction_agreement`: for every consumer they hold a
  delta for, the deltas' spread relative to their size, and what refreshes recorded, at most
  ``agreement``), however flat the weights: two anchors of the same text are equally close
  (normalized entropy 1, which the reference rejects forever) and their corrections agree. One
  anchor suffices when a refresh showed that its corrections repeat. Anchors that disagree are still
  rejected.
- ``nearest > 0``: an acceptance (by either rule) stands only when the candidate is near an anchor
  (:meth:`SlotScope.near`): corrections observed on other content do not carry over.
- ``duplicate > 0``: a new observation whose base nearly duplicates an anchor of the pool (values
  within ``duplicate`` of it, relative) refreshes that anchor (its base, each consumer's delta and the
  spread from the delta it replaced) instead of joining the pool: no duplicate anchors
  (:meth:`SlotScope._add_delta`).
- ``learn_dense``: every span prefilled with a source adds its exact delta (a whole-turn fallback's,
  an accepted slot's prefilled for another reason), not only a rejected one's.
- ``piecewise``: a span fewer than two anchors cover whole is not rejected by the length rule: the
  gate compares the longest prefix two anchors cover (:meth:`SlotScope.piecewise_rows`), and
  :meth:`SlotScope.place` corrects it window by window (:func:`~.correction.windows`,
  :func:`~.correction.apply_piecewise`), the rows past the longest anchor reused uncorrected.
- ``verify_tokens > 0`` (off in both profiles): each correction is verified on a probe of the span's
  last tokens (:mod:`.verify`) when placed, and prefilled when the probe rejects it; a span the gate
  rejected is probed too when an anchor holds the consumer's correction (:attr:`Edge.rejected`), and
  placed when the probe accepts it. A span no longer than the probe is prefilled (the probe would
  recompute all of it).
"""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..cache import SegmentKV
from ..measure import phase
from ..recompute.stack import DecoderStack
from .correction import (
    apply_correction,
    apply_piecewise,
    comparison_prefix,
    covering,
    gate_distances,
    guard_estimate,
    prefix_correction,
    prefix_weights,
    shrink,
    token_distances,
    token_weights,
    windows,
)
from .gate import GateDecision, reliability_gate, usage_reference
from .lowrank import DeferredFactoredKV, FactoredKV, layer_offset, relative_spread
from .pool import Anchor, correction_agreement, nearest_relative
from .scope import USAGE_MASS, Edge, Reuse, Scope, following_pf
from .verify import Probe, covers_span, verify_correction, whole_span_reason

#: a repeated place's suffix (``doc#2``, ``agent.m1#3``): :meth:`SlotScope.pool_key` pools it with ``doc``
_AGAIN = re.compile(r"#\d+$")

if TYPE_CHECKING:
    from ..turn import Turn


class SlotScope(Scope):
    """The reference gate scope (module docstring)."""

    # ---------------------------------------------------------------- plan
    def plan(self, turn: Turn) -> None:
        """Decide every PH span of the turn before building (the turn is the unit of obeying)."""
        o = self.options
        edges = turn.scratch[self.name] = {}
        for span in turn.spans:
            if span.kind != "PH":
                continue
            source, label = self.source(turn, span)
            edge = edges[span.start] = Edge(
                slot=span.name,
                source=source,
                label=label,
                origin=self.origin(turn, span.name),
                pool=self.pool_key(turn, span.name),
                rebase=self.source_kind(turn, span.name) == "chained",
            )
            if source is None:
                edge.dense = "first"
                continue
            if self.gated(turn, span.name):
                key = self.decision_key(turn, span.name)
                # gate_chained: a per-edge decision judges its consumer's corrections (paper: every anchor)
                agent = turn.agent if o.gate_chained and self.per_edge(turn, span.name) else None
                edge.decision = self.decide(turn, key, source, pool=edge.pool, agent=agent)
                edge.candidates, edge.distances = self.gate_report(turn, key)
            pool = self.pools.get(edge.pool)
            anchor = pool.find(edge.origin) if pool is not None else None
            # this consumer's delta in this request's anchor (not one a refresh carried over)
            own = anchor is not None and turn.agent in anchor.deltas and turn.agent not in anchor.stale
            if o.tau == 0:
                edge.dense, edge.reason = "fallback", "tau = 0: no reuse"
            elif edge.decision is not None and not edge.decision.accepted and not own:
                if self.verifying and pool is not None and pool.with_delta(turn.agent):
                    edge.rejected = edge.decision.reason or "rejected"  # the probe decides (place)
                else:
                    edge.dense = "fallback"
            elif edge.decision is None and o.turn_fallback == "span":
                if pool is None or not pool.with_delta(turn.agent):
                    edge.dense, edge.reason = "fallback", f"no anchor holds a correction for {turn.agent!r}"
        if o.turn_fallback == "turn":
            rejected = [e.slot for e in edges.values() if e.dense]
            for edge in edges.values():
                if rejected and edge.dense is None:
                    edge.dense, edge.reason = "turn", f"the turn is dense: {', '.join(rejected)} not reusable"

    def pool_key(self, turn: Turn, slot: str) -> str:
        """Outputs pool per producing agent (``agent#2`` shares ``agent``'s); given text per place: a piece
        (``doc[s:e]``) with its slot, and ``doc#2`` with ``doc`` (the server's default layout names the
        next document at the same place of an agent's prompt so when one task holds both: without this
        every new document at that place would start an empty pool)."""
        held = turn.slot(slot)
        if held.producer is not None:
            return held.producer
        name = held.piece_of[0] if held.piece_of is not None else slot
        return _AGAIN.sub("", name)

    def gated(self, turn: Turn, slot: str) -> bool:
        """Outputs and reference-prefilled given text are gated; a chained / first question only with
        ``gating="paper"`` (every PH span gated), a chained one also with ``gate_chained``."""
        if self.options.gating == "paper" or turn.slot(slot).producer is not None:
            return True
        kind = self.source_kind(turn, slot)
        return kind not in ("chained", "first") or (kind == "chained" and self.options.gate_chained)

    def per_edge(self, turn: Turn, slot: str) -> bool:
        """A chained source (a new one each hop) gated (``gating="paper"`` or ``gate_chained``) is
        gated by each consumer on its own source, with its own corrections (:meth:`decision_key`)."""
        o = self.options
        return (o.gating == "paper" or o.gate_chained) and self.source_kind(turn, slot) == "chained"

    def decision_key(self, turn: Turn, slot: str) -> str:
        """One decision per (slot, request); a chained source gated per edge (:meth:`per_edge`): (slot,
        this turn)."""
        return f"{slot}@{turn.output_slot}" if self.per_edge(turn, slot) else slot

    def gate(
        self, pool_key: str, candidate: SegmentKV, agent: str | None = None
    ) -> tuple[GateDecision, list[Anchor], torch.Tensor | None]:
        """The reference gate (``predict_as_anchor``) of ``candidate`` against pool ``pool_key``, and
        the rules beyond it (module docstring); ``agent`` (a per-edge decision): over the anchors
        holding that consumer's correction alone (those its placement reads), judging its corrections
        only; else over every anchor, judging every consumer's."""
        o = self.options
        pool = self.pools.get(pool_key)
        anchors = [] if pool is None else list(pool) if agent is None else pool.with_delta(agent)
        if agent is not None and not anchors:  # as an ungated span says it (``turn_fallback="span"``)
            return GateDecision(False, f"no anchor holds a correction for {agent!r}"), [], None
        length = candidate.length
        if o.match == "full":
            rows, eligible = length, [a for a in anchors if a.length >= length]
        else:
            rows = comparison_prefix(anchors, length)
            eligible = [a for a in anchors if a.length >= rows] if rows else []
        if o.piecewise and len(eligible) < 2 and anchors:
            rows, eligible = self.piecewise_rows(anchors, length, rows, eligible)
        judge = o.agreement > 0 and o.tau > 0  # the agreement rule; one anchor may then suffice
        if len(eligible) < (1 if judge else 2):
            why = f"fewer than 2 anchors at least {rows or length} tokens long ({len(eligible)} of {len(anchors)})"
            return GateDecision(False, why), eligible, None
        with phase("gate"):
            distances = gate_distances(candidate.values, eligible, rows, self.store.shard)
            decision = reliability_gate(distances, o.tau, o.temperature)
            if len(eligible) < 2:
                decision.reason = (
                    f"fewer than 2 anchors at least {rows or length} tokens long (1 of {len(anchors)})"
                )
            if judge and not decision.accepted:
                decision = self.agreement(decision, eligible, rows, agent)
            if o.nearest > 0 and decision.accepted:
                decision = self.near(decision, eligible, rows, agent)
        return decision, eligible, distances

    @staticmethod
    def piecewise_rows(
        anchors: list[Anchor], length: int, rows: int, eligible: list[Anchor]
    ) -> tuple[int, list[Anchor]]:
        """``piecewise``: a span fewer than two anchors cover whole (the reference's length rule) is
        gated over the longest prefix two anchors cover, or with one anchor in the pool over its
        length; the span is then corrected window by window (:meth:`place`). ``(rows, eligible)``
        unchanged when that gives nothing new (a single anchor already covering the span)."""
        prefix = comparison_prefix(anchors, length)
        if prefix == 0:  # one anchor in the pool
            prefix = min(length, anchors[0].length)
        if prefix == rows:
            return rows, eligible
        return prefix, [a for a in anchors if a.length >= prefix]

    def agreement(
        self, decision: GateDecision, eligible: list[Anchor], rows: int, agent: str | None = None
    ) -> GateDecision:
        """The agreement rule (``agreement > 0``): ``decision`` (rejected by the entropy rule) accepted
        when the corrections of ``eligible`` agree within ``agreement``
        (:func:`~.pool.correction_agreement`), else kept with the reason extended."""
        o = self.options
        spread, why = correction_agreement(eligible, rows, 1 if o.skip_layer0 else 0, agent, self.store.shard)
        if spread is not None and spread <= o.agreement:
            weights = decision.weights or [1.0]  # one anchor: the entropy rule computed no weights
            return GateDecision(
                True,
                f"anchors agree: {why} <= {o.agreement:g}",
                entropy=decision.entropy,
                weights=weights,
                distances=decision.distances,
            )
        tail = why if spread is None else f"anchors disagree: {why} > {o.agreement:g}"
        decision.reason = f"{decision.reason}; {tail}"
        return decision

    def near(
        self, decision: GateDecision, eligible: list[Anchor], rows: int, agent: str | None = None
    ) -> GateDecision:
        """``nearest > 0``: an accepted ``decision`` stands when the candidate is near an anchor, its
        nearest one's gate distance at most ``nearest`` of that anchor's size
        (:func:`~.pool.nearest_relative`): a correction observed on other content (another output of
        the producer) does not carry over on the weights alone. With ``trust_agreement`` a far
        candidate still stands when the anchors' corrections agree (the agreement rule's test): a
        correction that repeats over other content does not depend on the content, so how far the
        candidate is does not matter; anchors that disagree (or a correction seen once) refuse it."""
        o = self.options
        near = nearest_relative(eligible, decision.distances, rows, self.store.shard)
        if near <= o.nearest:
            return decision
        entropy_rule = decision.entropy is not None and decision.entropy <= o.tau
        rule = "accepted" if entropy_rule else "anchors agree"  # (their spread: fp-sensitive, left out)
        far = f"{near:.2g} > {o.nearest:g}"
        if o.trust_agreement and o.agreement > 0:
            if not entropy_rule:  # accepted by the agreement rule: its anchors agree
                decision.reason = f"{decision.reason}; the candidate is far ({far}), the corrections agree"
                return decision
            spread, why = correction_agreement(
                eligible, rows, 1 if o.skip_layer0 else 0, agent, self.store.shard
            )
            if spread is not None and spread <= o.agreement:
                decision.reason = (
                    f"accepted; the candidate is far ({far}), the corrections agree: {why} <= {o.agreement:g}"
                )
                return decision
            tail = why if spread is None else f"anchors disagree: {why} > {o.agreement:g}"
            reason = f"{rule}; but the candidate is far from every anchor: {far}; {tail}"
        else:
            reason = f"{rule}; but the candidate is far from every anchor: {far}"
        return GateDecision(False, reason, decision.entropy, decision.weights, decision.distances)

    def decide(
        self, turn: Turn, slot: str, candidate: SegmentKV, pool: str | None = None, agent: str | None = None
    ) -> GateDecision:
        """The slot's decision for this request (``slot``: its decision key): taken (pending until
        commit) the first time it is asked, against pool ``pool`` (default: the slot's), judging
        ``agent``'s corrections alone when given (:meth:`gate`)."""
        state = self.request(turn)
        pending = self.pending(turn)
        decision = state.decisions.get(slot)
        if decision is None:
            decision = pending["decisions"].get(slot)
        if decision is None:
            decision, eligible, distances = self.gate(pool or self.pool_key(turn, slot), candidate, agent)
            pending["decisions"][slot] = decision
            pending["reports"][slot] = (len(eligible), None if distances is None else decision.distances)
            if decision.accepted:
                pending["uses"].extend(eligible[i] for i in usage_reference(decision.weights, USAGE_MASS))
        return decision

    def gate_report(self, turn: Turn, slot: str) -> tuple[int, list[float] | None]:
        state = self.request(turn)
        return state.gate_reports.get(slot) or self.pending(turn)["reports"].get(slot, (0, None))

    def dense_turn(self, turn: Turn) -> bool:
        """With ``turn_fallback="turn"`` (the reference's dense mode) a rejection prefills the whole
        turn, its kept PF text too; with ``"span"`` only the rejected spans, so the agent's kept text
        is still placed (before 2026-12-02 it was prefilled there too: on a server, whose claim is one
        range from the prompt's start, a span fallback then claimed nothing at all)."""
        if self.options.turn_fallback != "turn":
            return False
        return any(edge.dense in ("fallback", "turn") for edge in self.edges(turn).values())

    def report(self, turn: Turn, cache) -> None:
        """:meth:`Scope.report` for the spans this scope had prefilled: a row the method placed keeps
        its placement's report even where the engine computed it again (a server's claim that ended
        before it), as a placed span does in a Session."""
        edges = self.edges(turn)
        for seg in cache.segments:
            edge = edges.get(seg.start)
            placed = edge is not None and edge.source is not None and edge.dense is None
            if seg.kind == "PH" and edge is not None and seg.provenance == "dense" and not placed:
                seg.info.update(edge.report())

    # --------------------------------------------------------------- place
    def place(self, turn: Turn, span, cache=None) -> Reuse | None:
        """A PH span's K/V: the source corrected by the anchors holding this agent's delta (reused
        uncorrected where none does); with ``verify_tokens`` the correction is verified on a probe
        (:mod:`.verify`) on the turn's ``cache``, and a gate rejection the probe may overturn
        (:attr:`Edge.rejected`) is placed only when the probe accepts it."""
        o = self.options
        edge = turn.scratch[self.name][span.start]
        if edge.dense is not None:
            return None
        gate = "ungated" if edge.decision is None else "accepted"
        info: dict[str, Any] = {"gate": gate, "tau": o.tau}
        if edge.decision is not None and edge.decision.entropy is not None:
            info["entropy"] = edge.decision.entropy
        pool = self.pools.get(edge.pool)
        usable = pool.with_delta(turn.agent) if pool is not None else []
        anchors, rows = covering(usable, span.length, o.partial_coverage)
        if not anchors:
            if edge.rejected:  # nothing to verify: prefilled as the rejection says
                edge.dense = "fallback"
                return None
            info["reason"] = f"no anchor holds a correction for {turn.agent!r}: reused uncorrected"
            return Reuse(kv=edge.source, provenance="reused", source_agent=edge.label, info=info)
        reader = span.start if o.key_frame == "reader" else None
        pieces = windows(usable, span.length) if o.piecewise and rows < span.length else None
        if pieces is not None and len(pieces) > 1:  # window by window, every anchor covering a row
            anchors, rows = pieces[0][2], pieces[-1][1]
            wk, wv, cached = self.piecewise_weights(turn, edge, pieces, reader)
            kv = apply_piecewise(
                edge.source,
                anchors,
                turn.agent,
                wk,
                wv,
                span.start,
                turn.shifter,
                skip_layer0=self.skips_layer0,
            )
            info["windows"] = [[first, last, len(chosen)] for first, last, chosen in pieces]
        else:
            wk, wv, cached = self.token_weights(turn, edge, anchors, rows, reader)
            kv = apply_correction(
                edge.source,
                anchors,
                turn.agent,
                wk,
                wv,
                span.start,
                turn.shifter,
                skip_layer0=self.skips_layer0,
            )
        info.update(anchors=[a.serial for a in anchors], rows=f"{rows}/{span.length}", weights_cached=cached)
        if o.guard:
            # a piecewise span's guard is estimated on its first window (every anchor covers it)
            checked = rows if pieces is None or len(pieces) < 2 else pieces[0][1]
            kv, scales = self.guard(turn, edge, anchors, kv, checked, span)
            first = 1 if o.skip_layer0 else 0
            info["guard"] = {
                "key_scales": [round(x, 4) for x in scales[0]],
                "value_scales": [round(x, 4) for x in scales[1]],
            }
            if all(x == 0 for side in scales for x in side[first:]):
                if edge.rejected:
                    edge.dense = "fallback"
                    return None
                info["reason"] = (
                    "guard: no held-out gain from the correction in any layer: reused uncorrected"
                )
                return Reuse(kv=edge.source, provenance="reused", source_agent=edge.label, info=info)
        reused = None
        if self.verifying and cache is not None and covers_span(o.verify_tokens, span.length):
            # the probe would compute every row: the span is prefilled (the same K/V), not corrected; a
            # span the gate rejected keeps the gate's reason
            edge.dense = "fallback"
            if not edge.rejected:
                edge.reason = whole_span_reason(o.verify_tokens, span.length)
            return None
        if self.verifying and cache is not None:
            probe = self.verify(turn, span, edge, kv, cache)
            threshold, scale = o.verify_threshold, o.verify_scale
            edge.probe = info["verify"] = probe.report(threshold, scale)
            if not probe.accepts(threshold, scale):
                edge.dense, edge.reason = "fallback", probe.reason(threshold, scale)
                turn.stats.tokens_prefilled += probe.tokens  # computed for the probe, then not used
                return None
            if edge.rejected:
                info["gate"] = "accepted"
                info["reason"] = f"the gate rejected ({edge.rejected}); the verification probe accepted"
            kv, reused = probe.kv, span.length - probe.tokens  # the probe's tokens: exact, not corrected
            rows -= probe.within(rows)
        elif edge.rejected:  # no cache to verify on: as the gate decided
            edge.dense = "fallback"
            return None
        edge.rows = rows
        following = following_pf(turn, span)
        if o.prefix_delta and o.prefix_reuse and following is not None and rows == span.length:
            key = ("prefix", edge.slot, edge.pool, tuple(a.serial for a in anchors))
            weights, _ = self.cached_weights(
                turn, key, lambda: prefix_weights(edge.source, anchors, turn.shifter, reader)
            )
            turn.scratch.setdefault(f"{self.name}.pf", {})[following.start] = (anchors, *weights)
        return Reuse(
            kv=kv,
            provenance="corrected",
            source_agent=edge.label,
            info=info,
            corrected_tokens=rows,
            reused_tokens=reused,
        )

    @property
    def verifying(self) -> bool:
        """``verify_tokens > 0``: each correction is verified on a probe before it is placed."""
        return getattr(self.options, "verify_tokens", 0) > 0

    def verify(self, turn: Turn, span, edge: Edge, kv: SegmentKV, cache) -> Probe:
        """The verification probe of ``kv``, the span's correction (:func:`~.verify.verify_correction`)."""
        o = self.options
        stack = self.__dict__.get("_stack")
        if stack is None or stack.model is not turn.model:
            stack = self.__dict__["_stack"] = DecoderStack(turn.model)
        embeds = None if span.visual is None else span.visual.embeds(turn.model)
        return verify_correction(
            stack,
            cache,
            kv,
            edge.source,
            span.token_ids,
            span.start,
            turn.shifter,
            o.verify_tokens,
            first_layer=1 if o.skip_layer0 else 0,
            embeds=embeds,
            place=o.verify_rows,
        )

    def guard(
        self, turn: Turn, edge: Edge, anchors: list[Anchor], kv, rows: int, span
    ) -> tuple[SegmentKV, list[list[float]]]:
        """``guard=True`` (ours, beyond the paper): the corrected ``kv`` with each layer's correction
        (keys and values apart) shrunk toward zero by its held-out reliability
        (:func:`~.correction.guard_estimate`: each anchor's delta predicted from the others), and the
        scales. Computed once per (slot, request, anchor set, rows) with ``weights_cache``."""
        key = ("guard", edge.slot, edge.pool, tuple(a.serial for a in anchors), rows, turn.agent)
        with phase("gate"):
            (estimate,), _ = self.cached_weights(
                turn,
                key,
                lambda: (
                    guard_estimate(
                        anchors,
                        turn.agent,
                        rows,
                        turn.shifter,
                        self.options.token_temperature,
                        self.store.shard,
                    ),
                ),
            )
            scales = estimate.scales.tolist()
        if self.options.skip_layer0:
            scales[0][0] = scales[1][0] = 1.0  # layer 0 is uncorrected already
        if any(s != 1 for side in scales for s in side):
            first = layer_offset(self.store.shard)  # the scales are the model's layers': shrink this member's
            mine = [side[first : first + kv.num_layers] for side in scales]
            kv = shrink(kv, edge.source.repositioned(turn.shifter, span.start), mine)
        return kv, scales

    def cached_weights(
        self, turn: Turn, key: tuple, compute
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
        """``(weights, reused)``: weights computed once per (slot, request, anchor set) and reused by
        later consumers (``weights_cache``, as the reference caches them), else every time."""
        state = self.request(turn)
        if self.options.weights_cache and key in state.weights:
            return state.weights[key], True
        weights = compute()
        if self.options.weights_cache:
            state.weights[key] = weights
        return weights, False

    def piecewise_weights(self, turn: Turn, edge: Edge, pieces: list, reader: int | None):
        """``[n, rows]`` key and value weights of a piecewise correction (:func:`~.correction.windows`;
        ``n``: the first window's anchors, all of them): each window's rows take the token weights of
        its own anchors (:meth:`token_weights`, cached per anchor set), 0 for the anchors shorter than
        the window. The longest window first, so each anchor's distances are computed once, over its
        whole length (:meth:`distances`)."""
        anchors, rows = pieces[0][2], pieces[-1][1]
        index = {a.serial: i for i, a in enumerate(anchors)}
        wk = wv = None
        all_cached = True
        for first, last, chosen in reversed(pieces):
            k, v, cached = self.token_weights(turn, edge, chosen, last, reader)
            all_cached &= cached
            if wk is None:
                wk = torch.zeros(len(anchors), rows, dtype=k.dtype, device=k.device)
                wv = torch.zeros_like(wk)
            at = [index[a.serial] for a in chosen]
            wk[at, first:last] = k[:, first:last]
            wv[at, first:last] = v[:, first:last]
        return wk, wv, all_cached

    def token_weights(self, turn: Turn, edge: Edge, anchors: list[Anchor], rows: int, reader: int | None):
        temperature = self.options.token_temperature

        def compute():
            kd, vd = self.distances(turn, edge.slot, edge.pool, edge.source, anchors, rows, reader)
            return token_weights(kd, temperature), token_weights(vd, temperature)

        key = (edge.slot, edge.pool, tuple(a.serial for a in anchors), rows)
        (wk, wv), cached = self.cached_weights(turn, key, compute)
        return wk, wv, cached

    def distances(
        self,
        turn: Turn,
        slot: str,
        pool: str,
        source: SegmentKV,
        anchors: list[Anchor],
        rows: int,
        reader: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~.correction.token_distances` of ``source`` from ``anchors`` (``[n, rows]`` keys,
        values), each anchor's computed once per request and source (``weights_cache``): a token's
        distance from one anchor depends on that anchor and the source alone, so consumers whose
        weights take other anchor sets (each the anchors holding its own delta) share the rows they
        have in common, and rows the gate already computed (:meth:`prime`) are not computed again. The
        missing anchors are compared together, as before; an anchor whose base was replaced since
        (a rebase, a deferred base factorized) is compared again."""
        if not self.options.weights_cache:
            return token_distances(source, anchors, turn.shifter, rows, reader, self.store.shard)
        store = self.request(turn).distances
        key = (slot, pool, reader)
        held = store.get(key)
        if held is None or held[0]() is not source:  # weakly: the session decides how long a source lives
            held = store[key] = (weakref.ref(source), {})
        known = held[1]

        def fresh(a: Anchor) -> bool:
            entry = known.get(a.serial)
            return entry is not None and entry[0] is a.__dict__["base"] and entry[1].shape[-1] >= rows

        missing = [a for a in anchors if not fresh(a)]
        if missing:
            kd, vd = token_distances(source, missing, turn.shifter, rows, reader, self.store.shard)
            for a, k, v in zip(missing, kd, vd):
                known[a.serial] = (a.__dict__["base"], k, v)
        if len(missing) == len(anchors):  # all computed just now, in this order
            return kd, vd
        rows_of = [known[a.serial] for a in anchors]
        return torch.stack([e[1][:rows] for e in rows_of]), torch.stack([e[2][:rows] for e in rows_of])

    def prime(self, turn: Turn, slot: str, source: SegmentKV, anchors: list[Anchor]) -> None:
        """In a turn's record, off the next turn's critical path: the token distances of a source the
        next consumers will correct from ``anchors`` (:meth:`distances`), for their weights. Sources:
        an output after its producer's accepted gate, and a chained slot's latest cache (the next hop's
        source: this turn's materialization of the question or document). Only anchors of the covering
        length holding some delta (those a consumer's weights read), whose base is factorized (a
        deferred base is read, so factorized, only by a placement); a consumer whose anchor set has
        others computes those when it places the span. Only the anchor sets of later consumers (the
        other agents holding a delta) whose weights the request does not cache already: a consumer
        takes cached weights of its anchor set (``weights_cache``, keyed by slot and anchor set as the
        reference's, not by source), so nothing computed for it here would be read."""
        rows, pool = source.length, self.pool_key(turn, slot)
        if not (self.options.weights_cache and self.options.key_frame == "canonical"):
            return
        full = [a for a in anchors if a.length >= rows]
        weights = self.request(turn).weights
        needed: dict[int, Anchor] = {}
        # a later consumer: another agent holding a delta here; its weights take the full-length anchors
        # holding its delta, unless the request caches weights for that anchor set (it takes those)
        for agent in sorted({agent for a in full for agent in a.deltas} - {turn.agent}):
            chosen = [a for a in full if agent in a.deltas]
            if (slot, pool, tuple(a.serial for a in chosen), rows) not in weights:
                needed.update((a.serial, a) for a in chosen if not a.base_deferred)
        if needed:
            with phase("gate"):
                self.distances(turn, slot, pool, source, [a for a in full if a.serial in needed], rows)

    def correct_prefix(self, turn: Turn, span, kv: SegmentKV) -> tuple[SegmentKV, Any] | None:
        """With ``prefix_delta``, the PF right after a corrected PH span gets the anchors' prefix deltas
        for this agent (all of the PH's anchors must hold one for this exact PF text, else it stays as
        placed)."""
        pending = turn.scratch.get(f"{self.name}.pf", {}).get(span.start)
        if pending is None:
            return None
        anchors, wk, wv = pending
        ids = tuple(span.token_ids.tolist())
        held = [a.prefix_deltas.get(turn.agent) for a in anchors]
        if any(h is None or h[0] != ids for h in held):
            return kv, "not every anchor holds a correction of this PF text"
        kv = prefix_correction(
            kv, [h[1] for h in held], wk, wv, anchors[0].frame, turn.shifter, self.skips_layer0
        )
        return kv, [a.serial for a in anchors]

    # --------------------------------------------------------------- learn
    def observe(self, turn: Turn, span, edge: Edge, cache) -> None:
        """A span prefilled because of a rejection (or an ungated given text) adds its delta."""
        if edge.dense is None:
            return
        rejected = edge.decision is not None and not edge.decision.accepted
        rejected = rejected or (edge.probe is not None and not edge.probe["accepted"])
        # ungated given text: admitted while the pool has room; ``learn_dense``: every exact delta
        if rejected or edge.decision is None or self.options.learn_dense:
            with cache.sharing_storage():  # a view of the turn's cache: the delta is computed from it
                exact = cache.extract(span.start, span.end, agent=turn.agent)
            self.add_delta(edge, exact, turn, may_evict=edge.decision is not None, span=span, cache=cache)

    def learned(self, turn: Turn, output: SegmentKV | None) -> None:
        rejected = False
        if output is not None and self.options.output_source != "context_free":
            decision = self.decide(turn, turn.output_slot, output)  # the producer gates its own output, once
            pool = self.pools.get(self.pool_key(turn, turn.output_slot))
            if decision.accepted and pool is not None:
                self.prime(turn, turn.output_slot, output, list(pool))
            rejected = not decision.accepted
        if rejected and self.options.turn_fallback == "turn":
            return  # the next consumer reads this output: its whole turn is dense, nothing to prime
        for name in dict.fromkeys(s.name for s in turn.spans if s.kind == "PH"):  # the next hop's sources
            latest = turn.slot(name).latest
            pool = self.pools.get(self.pool_key(turn, name))
            if latest is not None and pool is not None and self.source_kind(turn, name) == "chained":
                self.prime(turn, name, latest, list(pool))

    def add_delta(self, edge: Edge, exact: SegmentKV, turn: Turn, may_evict: bool, span, cache) -> None:
        """Add this consumer's delta to the one anchor of (slot, request), creating it if needed
        (``may_evict=False``: only while the pool has room; a frozen pool is never evicted)."""
        with phase("anchor_store"):
            self._add_delta(edge, exact, turn, may_evict, span, cache)

    def _add_delta(self, edge: Edge, exact: SegmentKV, turn: Turn, may_evict: bool, span, cache) -> None:
        o = self.options
        pool = self.pool(edge.pool)
        anchor = pool.find(edge.origin)
        if anchor is None and not may_evict and len(pool) >= o.capacity:
            return
        delta, source_keys = self.delta(edge, exact, turn)
        prefix = self.prefix_delta(turn, span, cache) if o.prefix_delta and o.prefix_reuse else None
        new = anchor is None
        # a chained source's base is replaced by the next consumer's (the rebase below), most often in
        # this same request: with ``defer_base``, factorized on its first read, so a replaced one never is
        defer = edge.rebase and o.defer_base
        base = (lambda: self.deferred_base(edge, turn)) if defer else (lambda: self.base(edge, source_keys))
        if new and o.duplicate > 0:
            fresh = base()
            duplicate = pool.near_duplicate(fresh, edge.label, o.duplicate, self.store.shard)
            if duplicate is not None:  # it refreshes that anchor instead of joining the pool
                anchor, new = duplicate, False
                anchor.base, anchor.source, anchor.origin = fresh, edge.label, edge.origin
                anchor.stale = set(anchor.deltas) - {turn.agent}  # theirs are from an earlier request
                pool.refresh(anchor)
            else:
                anchor = Anchor(base=fresh, source=edge.label, origin=edge.origin, frame=o.delta_frame)
        elif new:
            anchor = Anchor(base=base(), source=edge.label, origin=edge.origin, frame=o.delta_frame)
        elif edge.rebase:  # the reference's entry.update: the base becomes this consumer's source
            anchor.base, anchor.source = base(), edge.label
        if o.nearest > 0 and anchor.energy is None and not anchor.base_deferred:
            anchor.measure(
                self.store.shard
            )  # its size, for the gate's nearness (here, off the next gate's host reads)
        if o.agreement > 0 and turn.agent in anchor.deltas:  # evidence: does its correction repeat?
            held, now = anchor.deltas[turn.agent], delta
            now = now.resolve() if isinstance(now, DeferredFactoredKV) else now
            anchor.agreement[turn.agent] = relative_spread(
                [held, now], min(held.length, now.length), 1 if o.skip_layer0 else 0, self.store.shard
            )
        anchor.stale.discard(turn.agent)
        anchor.deltas[turn.agent] = delta
        anchor.base_start = exact.start  # ... as this consumer placed it (KVComm compares keys there)
        if prefix is not None:
            anchor.prefix_deltas[turn.agent] = prefix
        if new:
            pool.insert(anchor)

    def prefix_delta(self, turn: Turn, span, cache) -> tuple[tuple[int, ...], FactoredKV] | None:
        """The correction of the PF text right after ``span`` in this dense turn: its exact K/V minus
        the agent's kept PF (as ``prefix_reuse`` would place it; zero when this turn is the one that
        keeps it), dense, keys in ``delta_frame``."""
        following = following_pf(turn, span)
        if following is None:
            return None
        ids = tuple(following.token_ids.tolist())
        exact = cache.extract(following.start, following.end, agent=turn.agent)
        kept = self.options.prefix_store(turn).get((turn.agent, ids))
        keys, values = self.difference(exact, exact if kept is None else kept, turn)
        return ids, FactoredKV.from_kv(keys, values, None, shard=self.store.shard)

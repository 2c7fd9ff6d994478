"""Edge scope, the earlier reading of KVCMAS / KVComm gating (``gate_scope="edge"``).

Every (source, consumer) edge is gated on its own when its span is placed (:meth:`EdgeScope.place`),
over the anchors of the slot's pool built from the same source label that hold the consumer's
delta; ``match="prefix"`` compares over the longest prefix two anchors cover. A rejected edge stores
its observed delta in its own anchor (:meth:`EdgeScope.observe`); anchors of a chained source are
split by source version (:meth:`EdgeScope.origin`, bumped in :meth:`EdgeScope.learned`). No PF text
is corrected.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from ..cache import SegmentKV
from ..measure import phase
from .correction import apply_correction, comparison_prefix, match, token_weights
from .gate import GateDecision, reliability_gate, usage_crossing
from .pool import Anchor
from .scope import USAGE_MASS, Edge, Reuse, Scope

if TYPE_CHECKING:
    from ..turn import Turn


class EdgeScope(Scope):
    """The per-edge gate scope (module docstring)."""

    def origin(self, turn: Turn, slot: str) -> Hashable:
        if self.source_kind(turn, slot) == "chained":
            state = self.request(turn)
            return (state.uid, slot, state.versions.get(slot, 0))  # this exact materialization
        return super().origin(turn, slot)

    def place(self, turn: Turn, span, cache=None) -> Reuse | None:
        o = self.options
        edges = turn.scratch.setdefault(self.name, {})
        source, label = self.source(turn, span)
        edge = edges[span.start] = Edge(slot=span.name, source=source, label=label, pool=span.name)
        if source is None:
            return None
        edge.origin = self.origin(turn, span.name)
        if o.tau == 0:
            edge.decision = GateDecision(False, "tau = 0: no reuse")
            return None
        pool = self.pools.get(span.name)
        candidates = pool.compatible(edge.label, turn.agent) if pool is not None else []
        if o.match == "prefix":
            rows = comparison_prefix(candidates, span.length)
            eligible = [a for a in candidates if a.length >= rows] if rows else []
        else:
            rows, eligible = span.length, [a for a in candidates if a.length >= span.length]
        edge.candidates = len(eligible)
        if len(eligible) < 2:
            edge.decision = GateDecision(False, f"fewer than 2 compatible anchors ({len(candidates)})")
            return None
        with phase("gate"):
            found = match(source, eligible, turn.shifter, rows, self.store.shard)
            edge.decision = reliability_gate(found.gate_distances, o.tau, o.temperature)
        edge.distances = list(edge.decision.distances)  # read back with the decision: no extra sync
        if not edge.decision.accepted:
            return None
        edge.rows = rows
        kv = apply_correction(
            source,
            eligible,
            turn.agent,
            token_weights(found.key_distances, o.token_temperature),
            token_weights(found.value_distances, o.token_temperature),
            span.start,
            turn.shifter,
            skip_layer0=self.skips_layer0,
        )
        self.pending(turn)["uses"].extend(
            eligible[i] for i in usage_crossing(edge.decision.weights, USAGE_MASS)
        )
        info = {
            "gate": "accepted",
            "entropy": edge.decision.entropy,
            "tau": o.tau,
            "anchors": [a.serial for a in eligible],
            "weights": [float(w) for w in edge.decision.weights],
            "distances": edge.distances,
            "rows": f"{rows}/{span.length}",
        }
        return Reuse(kv=kv, provenance="corrected", source_agent=edge.label, info=info, corrected_tokens=rows)

    def observe(self, turn: Turn, span, edge: Edge, cache) -> None:
        """A rejected edge stores its observed correction (accepted corrections are never inserted)."""
        if not edge.decision.accepted:
            with cache.sharing_storage():  # a view of the turn's cache: the delta is computed from it
                exact = cache.extract(span.start, span.end, agent=turn.agent)
            self.insert(edge, exact, turn)

    def learned(self, turn: Turn, output: SegmentKV | None) -> None:
        state = self.request(turn)
        for span in turn.spans:
            if span.kind == "PH":
                state.versions[span.name] = state.versions.get(span.name, 0) + 1

    def insert(self, edge: Edge, exact: SegmentKV, turn: Turn) -> None:
        with phase("anchor_store"):
            self._insert(edge, exact, turn)

    def _insert(self, edge: Edge, exact: SegmentKV, turn: Turn) -> None:
        pool = self.pool(edge.slot)
        anchor = pool.find(edge.origin)
        if anchor is not None and turn.agent in anchor.deltas:
            return  # this consumer's correction of this base is already stored
        delta, source_keys = self.delta(edge, exact, turn)
        if anchor is None:
            anchor = Anchor(
                base=self.base(edge, source_keys),
                source=edge.label,
                origin=edge.origin,
                frame=self.options.delta_frame,
                base_start=exact.start,
            )
            anchor.deltas[turn.agent] = delta
            pool.insert(anchor)
        else:
            anchor.deltas[turn.agent] = delta

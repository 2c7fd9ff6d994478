"""GraphFlow baseline: preconstructed corrections for recurring (slot, agent) relations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..anchors import (
    REFERENCE,
    RelationProfile,
    canonical_keys,
    context_free_reference,
)
from ..anchors.cache import CorrectedCache
from ..anchors.correction import corrected_kv
from ..anchors.persist import TensorTable, move_state_to_model, profiles_from_state, profiles_to_state
from ..anchors.store import BoundedStore, Stored, check_rank, clamp_ranks
from ..method import Method, Placement, register
from ..persistence import state_dims

if TYPE_CHECKING:
    from ..session import Session
    from ..turn import Turn


@register
@dataclass(eq=False)
class GraphFlow(Method):
    """GraphFlow (Li et al., 2026) as the KVCMAS paper implements it (B.1): one correction per
    recurring (PH slot, consuming agent) relation, relative to the context-free reference of the
    segment, calibrated on earlier requests and applied to new requests without online matching.

    A relation is calibrated densely on its first ``calibration_requests`` requests (the exact
    delta ``C_agent - Align(C_ref)`` of each, averaged position-wise), then frozen and applied to
    every later request: ``C_hat = Align(C_ref) + Rot(Δ_profile)`` over the rows the profile covers,
    the re-positioned reference for the rest. ``rank`` stores the frozen profile as a truncated
    SVD (8 is the paper's A.2 setting for recurring-PF deltas); ``None`` keeps it dense.

    ``max_profiles`` bounds the relations kept (default 256); past it the least recently used one
    (used by a recorded turn) is dropped; :meth:`state_summary` reports it.

    >>> method = GraphFlow(calibration_requests=2)  # doctest: +SKIP
    """

    name = "graphflow"
    uses_sources: ClassVar[bool] = False
    corrects: ClassVar[bool] = True
    rank_options: ClassVar[tuple[str, ...]] = ("rank",)
    state_keys: ClassVar[tuple[str, ...] | None] = ("profiles", "next_request", "evicted")

    calibration_requests: int = 2
    rank: int | None = None
    max_profiles: int = 256

    def __post_init__(self) -> None:
        if (
            isinstance(self.calibration_requests, bool)
            or not isinstance(self.calibration_requests, int)
            or self.calibration_requests < 1
        ):
            raise ValueError(f"calibration_requests must be an int >= 1, got {self.calibration_requests!r}")
        check_rank("rank", self.rank)
        if (
            isinstance(self.max_profiles, bool)
            or not isinstance(self.max_profiles, int)
            or self.max_profiles < 1
        ):
            raise ValueError(f"max_profiles must be an int >= 1, got {self.max_profiles!r}")
        self._store = BoundedStore(
            self.name, "profiles", self.max_profiles, profiles_to_state, profiles_from_state
        )

    #: (PH slot, consuming agent) -> its :class:`~hf_kvshare.anchors.RelationProfile`, least recently used first
    profiles = Stored("entries")
    _requests = Stored("requests")

    def attach(self, model: torch.nn.Module) -> None:
        ranks = clamp_ranks(model.config, rank=self.rank)
        self.record_clamp(ranks)  # a saved state compares the rank as given, clamped to the model
        self.rank = ranks["rank"]

    def clear(self) -> None:
        self._store.clear()
        self.binding.clear()

    def on_bind(self, model: torch.nn.Module) -> None:
        move_state_to_model(self, model)  # loaded state onto the model's device

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every profile (calibrating sums or frozen correction) and the next request uid."""
        table = TensorTable()
        return table.tensors, self._store.export(table)

    def stage_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], model=None):
        """The profiles of a saved state, checked (shapes against each other and the saved model)
        and built aside; the swap replaces them."""
        profiles, next_uid, evicted = self._store.read(tensors, meta, state_dims(model))
        return lambda: self._store.replace(profiles, next_uid, evicted)

    def request_state_bytes(self, session: Session) -> int:
        """The request's context-free references (non-chained correction keeps one per slot)."""
        return self._requests.nbytes(session)

    def state_bytes(self) -> int:
        """Exact bytes of every profile (running sums while calibrating, the frozen profile after)."""
        return self._store.nbytes

    def state_summary(self) -> dict[str, Any]:
        return {"bytes": self.state_bytes(), **self._store.summary()}

    def new_cache(self, turn: Turn) -> CorrectedCache:
        return CorrectedCache(turn.model.config, method=self.name)

    def _reference(self, turn: Turn, slot: str):
        state = self._requests.get(turn.request)
        reference = state.references.get(slot)
        if reference is None:
            ids = turn.slot(slot).token_ids.to(turn.device)
            visual = turn.slot(slot).visual  # an image / video slot: its features, not its ids
            embeds = None if visual is None else visual.embeds(turn.model)
            reference = state.references[slot] = context_free_reference(
                turn.model, ids, embeds, None if visual is None else visual.rope
            )
            turn.stats.tokens_prefilled += ids.numel()
        return reference

    def plan(self, turn: Turn) -> None:
        self.bind_once(turn.model)

    def finish(self, turn: Turn, cache) -> None:
        for seg in cache.segments:
            if seg.kind == "PH" and seg.provenance == "dense":
                profile = self.profiles.get((seg.name, turn.agent))
                done = 0 if profile is None else len(profile.requests)
                seg.info.update({"gate": "calibrating", "calibrated": f"{done}/{self.calibration_requests}"})

    def placeholder(self, turn: Turn, span, cache) -> Placement | None:
        profile = self.profiles.get((span.name, turn.agent))
        reference = self._reference(turn, span.name)
        if profile is None or not profile.ready:
            return None
        rows = min(span.length, profile.length)
        kv = corrected_kv(
            reference, span.start, turn.shifter, rows, lambda layer: profile.layer_delta(layer, rows)
        )
        info: dict[str, Any] = {
            "gate": "profile",
            "rows": f"{rows}/{span.length}",
            "calibrated": len(profile.requests),
        }
        return Placement(kv=kv, provenance="corrected", source_agent=REFERENCE, info=info)

    def record(self, turn: Turn, cache) -> None:
        """Calibrate: every densely computed PH segment adds its exact delta to its relation's profile."""
        state = self._requests.get(turn.request)
        observed = []  # computed and checked first: a refusal changes no profile
        for span in turn.spans:
            if span.kind != "PH":
                continue
            key = (span.name, turn.agent)
            profile = self.profiles.get(key)
            if profile is not None and (profile.ready or state.uid in profile.requests):
                continue
            if any(key == seen[0] for seen in observed):
                continue  # the slot twice in one prompt: one observation per request
            reference = state.references[span.name]
            exact = cache.extract(span.start, span.end)
            exact.check_finite(f"{self.name}: PH slot {span.name!r} of this turn")
            reference.check_finite(f"{self.name}: the reference of PH slot {span.name!r}")
            delta_keys = [
                k - r
                for k, r in zip(canonical_keys(exact, turn.shifter), canonical_keys(reference, turn.shifter))
            ]
            delta_values = [v[:1] - r[:1] for v, r in zip(exact.values, reference.values)]
            observed.append((key, delta_keys, delta_values))
        for span in turn.spans:  # relations this turn used: most recent
            if span.kind == "PH":
                self.profiles.touch((span.name, turn.agent))
        for key, delta_keys, delta_values in observed:
            profile = self.profiles.get(key)
            if profile is None:
                profile = self.profiles[key] = RelationProfile(
                    key[0], key[1], self.calibration_requests, self.rank
                )
            profile.observe(state.uid, delta_keys, delta_values)

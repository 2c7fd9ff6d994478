"""Boundary hidden states kept per slot: the method side of :mod:`hf_kvshare.recompute.boundary`.

:class:`BoundaryCapture` is a method mixin (the selective-recomputation methods, the evaluation's
dense transition recorder): while a turn builds and generates, a
:class:`~hf_kvshare.recompute.boundary.BoundaryRecorder` captures the inputs of the layers the
method restarts from; after the turn ``record`` stores each slot's rows next to its ``latest`` K/V
(``slot.extras[BOUNDARY_KEY]``), where a later turn reads them (:meth:`BoundaryCapture.source_boundary`).
The engine module keeps the capture machinery only.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from ..recompute.boundary import BOUNDARY_KEY, BoundaryRecorder

if TYPE_CHECKING:
    from ..cache import SharedCache
    from ..turn import Turn

_SCRATCH_KEY = "recompute.boundary_recorder"


class BoundaryCapture:
    """Method mixin: keep the boundary hidden states of every PH slot and output next to ``slot.latest``.

    Subclasses provide ``self.stack`` (a :class:`~hf_kvshare.recompute.stack.DecoderStack`) and
    :meth:`boundary_layers`. ``build`` and ``generation_context`` record while the turn runs;
    ``record`` stores each slot's rows in ``slot.extras[BOUNDARY_KEY]``.
    """

    def boundary_layers(self) -> tuple[int, ...]:
        """Layers whose input must be kept per slot (layer 0 never: its input is the embedding)."""
        return ()

    def recorder(self, turn: Turn) -> BoundaryRecorder | None:
        return turn.scratch.get(_SCRATCH_KEY)

    def build(self, turn: Turn) -> SharedCache:
        layers = tuple(layer for layer in self.boundary_layers() if layer > 0)
        if not layers:
            return super().build(turn)  # type: ignore[misc]
        recorder = BoundaryRecorder(self.stack, layers)  # type: ignore[attr-defined]
        turn.scratch[_SCRATCH_KEY] = recorder
        with recorder.active():
            return super().build(turn)  # type: ignore[misc]

    def generation_context(self, turn: Turn) -> contextlib.AbstractContextManager:
        recorder = self.recorder(turn)
        return recorder.active() if recorder is not None else contextlib.nullcontext()

    def record(self, turn: Turn, cache: SharedCache) -> None:
        super().record(turn, cache)  # type: ignore[misc]
        recorder = self.recorder(turn)
        if recorder is None:
            return
        slots = turn.slots
        for span in turn.spans:
            if span.kind == "PH":
                slots[span.name].extras[BOUNDARY_KEY] = recorder.rows_by_layer(span.start, span.end)
        output = slots[turn.output_slot]
        start = turn.prompt_length
        output.extras[BOUNDARY_KEY] = recorder.rows_by_layer(start, start + output.token_ids.numel())
        del turn.scratch[_SCRATCH_KEY]

    def source_boundary(self, turn: Turn, slot_name: str, layer: int) -> torch.Tensor:
        """The input of ``layer`` ``[1, S, hidden]`` kept with slot ``slot_name``'s latest K/V; a piece of
        a slot (``"<slot>[s:e]"``) not recorded on its own yet reads its rows of the parent's."""
        slot = turn.slot(slot_name)
        stored = slot.extras.get(BOUNDARY_KEY)
        if stored is None and slot.piece_of is not None:
            parent, start, end = slot.piece_of
            rows = turn.slot(parent).extras.get(BOUNDARY_KEY, {})
            stored = {layer: kept[:, start:end] for layer, kept in rows.items()}
        stored = stored or {}
        if layer not in stored:
            kept = sorted(stored) or "none"
            raise ValueError(
                f"slot {slot_name!r} keeps no input hidden state of layer {layer} (kept layers: {kept}); "
                f"{type(self).__name__} restarts there. The slot's cache was made before the method's layers "
                "were configured (e.g. calibrated or re-configured mid-session): start a new Session"
            )
        return stored[layer]

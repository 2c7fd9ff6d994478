"""Boundary hidden states: the input of a decoder layer, kept per PH slot.

A method that recomputes from layer ``a`` onwards without running layers ``0 .. a-1`` (DroidSpeak's
layer groups, RelayCaching's middle layers) restarts from the hidden state that entered layer ``a``
when the reused K/V was made (DroidSpeak's "E cache"). :class:`BoundaryRecorder` captures those
inputs, by absolute position, for everything a turn feeds through the model (dense prefill,
recomputation, generation). The method side (recording while a turn runs, storing the rows next to
each slot's ``latest`` K/V in ``slot.extras``) is the mixin
:class:`~hf_kvshare.methods.boundary_capture.BoundaryCapture`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from ..hooks import thread_hook

if TYPE_CHECKING:
    from .stack import DecoderStack

#: key of the boundary hidden states in ``Slot.extras``: ``{layer: [1, S, hidden]}``
BOUNDARY_KEY = "recompute.boundary_hidden"


class BoundaryRecorder:
    """Records the input hidden state of decoder ``layers`` at every absolute position fed through them.

    Args:
        stack: the model's decoder stack.
        layers: layer indices whose input to keep.

    Inside :meth:`active`, forward pre-hooks on those layers copy each call's ``hidden_states``
    ``[1, n, hidden]`` to the rows given by its ``position_ids``; a later write to a position
    replaces an earlier one. :meth:`put` writes rows directly (e.g. a reused segment's source rows).
    """

    def __init__(self, stack: DecoderStack, layers: Sequence[int]):
        self.stack = stack
        self.layers = tuple(sorted(set(int(layer) for layer in layers)))
        for layer in self.layers:
            stack.check_layer(layer, "a boundary layer")
        self._rows: dict[int, torch.Tensor] = {}
        self._filled: dict[int, torch.Tensor] = {}

    def _ensure(self, layer: int, end: int, like: torch.Tensor) -> None:
        rows = self._rows.get(layer)
        if rows is not None and rows.shape[0] >= end:
            return
        size = max(end, 2 * (rows.shape[0] if rows is not None else 0), 64)
        new_rows = torch.zeros(size, like.shape[-1], dtype=like.dtype, device=like.device)
        new_filled = torch.zeros(size, dtype=torch.bool, device=like.device)
        if rows is not None:
            new_rows[: rows.shape[0]] = rows
            new_filled[: rows.shape[0]] = self._filled[layer]
        self._rows[layer], self._filled[layer] = new_rows, new_filled

    def write(self, layer: int, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store ``hidden`` ``[1, n, hidden]`` (or ``[n, hidden]``) at absolute ``positions`` ``[n]``."""
        positions = torch.as_tensor(positions, dtype=torch.long).flatten().to(hidden.device)
        rows = hidden.detach().reshape(-1, hidden.shape[-1])
        if rows.shape[0] != positions.numel():
            raise ValueError(f"{rows.shape[0]} hidden rows for {positions.numel()} positions")
        if positions.numel() == 0:
            return
        self._ensure(layer, int(positions.max()) + 1, rows)
        self._rows[layer][positions] = rows.to(self._rows[layer].dtype)
        self._filled[layer][positions] = True

    def put(self, layer: int, start: int, hidden: torch.Tensor) -> None:
        """Store ``hidden`` ``[1, n, hidden]`` at positions ``start .. start + n - 1``."""
        n = hidden.shape[-2]
        self.write(layer, torch.arange(start, start + n), hidden)

    def rows(self, layer: int, start: int, end: int) -> torch.Tensor:
        """The recorded inputs of ``layer`` at positions ``[start, end)`` as ``[1, end - start, hidden]``."""
        filled = self._filled.get(layer)
        if filled is None or filled.shape[0] < end or not bool(filled[start:end].all()):
            missing = (
                end - start
                if filled is None
                else int((~filled[start:end]).sum()) + max(0, end - filled.shape[0])
            )
            raise ValueError(
                f"no recorded input of layer {layer} for {missing} of the positions [{start}, {end}); "
                "the recorder only sees what runs through the model while it is active"
            )
        return self._rows[layer][start:end][None].clone()

    def rows_by_layer(self, start: int, end: int) -> dict[int, torch.Tensor]:
        """:meth:`rows` of every recorded layer (what a slot keeps under :data:`BOUNDARY_KEY`)."""
        return {layer: self.rows(layer, start, end) for layer in self.layers}

    def _hook(self, layer: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            positions = kwargs.get("position_ids")
            if hidden is None or positions is None:
                raise RuntimeError(
                    f"decoder layer {layer} was called without hidden states and position_ids; "
                    "boundary hidden states need both"
                )
            if hidden.shape[0] != 1:
                raise RuntimeError(
                    f"boundary hidden states are recorded for batch size 1; got {hidden.shape[0]}"
                )
            self.write(layer, positions[0] if positions.dim() == 2 else positions, hidden[0])

        return hook

    @contextlib.contextmanager
    def active(self) -> Iterator[BoundaryRecorder]:
        """Record while inside (hooks are removed on exit, also on error). Only calls made by this
        thread are recorded: another thread running the same model meanwhile is not seen."""
        handles = [
            self.stack.layers[layer].register_forward_pre_hook(
                thread_hook(self._hook(layer)), with_kwargs=True
            )
            for layer in self.layers
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

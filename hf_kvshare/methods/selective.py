"""The shared shape of the selective-recomputation methods.

A PH segment whose slot was materialized earlier in the session is served from that K/V (moved
to where the segment lands, as FullShared does); a subset ``T`` of its (token, layer) entries is
then recomputed under this agent's context and written over the reused ones (the KVCMAS paper's
Eq. 3). Subclasses decide ``T`` in :meth:`SelectiveRecompute.recompute`.

``rho`` is the reuse ratio: the fraction of the segment's (token, layer) entries kept from the
reused cache, i.e. not recomputed. ``rho = 0`` recomputes every entry (the dense cache,
NonShared); ``rho = 1`` recomputes none (FullShared). A placement reports the entries it reused
as token-equivalents (reused entries / layers), so a turn's ``reuse_ratio`` is this entry fraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..method import Method, Placement
from ..recompute.layers import SegmentRecompute
from ..recompute.stack import DecoderStack
from .boundary_capture import BoundaryCapture

if TYPE_CHECKING:
    from ..cache import SharedCache
    from ..trajectory import Span
    from ..turn import Turn


@dataclass(eq=False)
class SelectiveRecompute(BoundaryCapture, Method):
    """Base of CacheBlend, DroidSpeak and RelayCaching (not registered itself).

    Args:
        rho: reuse ratio in ``[0, 1]``: fraction of the segment's (token, layer) entries reused.
    """

    rho: float = 0.9

    reads_prefix = True  # recomputed queries attend over the cache built so far
    supports_batch = False  # selections are per sequence

    def __post_init__(self) -> None:
        if isinstance(self.rho, bool) or not isinstance(self.rho, (int, float)) or not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"rho (the reuse ratio) must be a number in [0, 1]; got {self.rho!r}")
        self._stack: DecoderStack | None = None

    # ------------------------------------------------------------ model binding
    @property
    def stack(self) -> DecoderStack:
        if self._stack is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a model (create a Session with it)")
        return self._stack

    def attach(self, model: torch.nn.Module) -> None:
        if self._stack is None or self._stack.model is not model:
            stack = DecoderStack(model)
            self.check_model(stack)
            self._stack = stack

    def check_model(self, stack: DecoderStack) -> None:
        """Validate the knobs against the model (layer indices ...); raise ``ValueError``."""

    # ------------------------------------------------------------ building
    def placeholder(self, turn: Turn, span: Span, cache: SharedCache) -> Placement | None:
        source = turn.slot(span.name).latest
        if source is None:
            return None  # first time this slot is seen: dense
        recorder = self.recorder(turn)
        if recorder is not None:  # the reused rows' boundary inputs are the source's until recomputed
            for layer in recorder.layers:
                recorder.put(layer, span.start, self.source_boundary(turn, span.name, layer))
        embeds = None if span.visual is None else span.visual.embeds(turn.model)  # an image's features
        # the source stays where it sits: the engine re-positions a layer when it reads it, and its
        # result is assembled layer by layer as the cache copies it in (no whole copy of the segment)
        engine = SegmentRecompute(
            self.stack, cache, source, span.token_ids, embeds, start=span.start, shifter=turn.shifter
        )
        final_rows, info = self.recompute(engine, turn, span)
        new_kv, entries = engine.result(final_rows)
        total = span.length * self.stack.num_layers
        reused_entries = total - entries
        info = {"rho": reused_entries / total, **info}
        return Placement(
            kv=new_kv,
            provenance="recomputed" if entries else "reused",
            source_agent=source.agent,
            info=info,
            reused_tokens=_token_equivalents(reused_entries, self.stack.num_layers),
        )

    def recompute(
        self, engine: SegmentRecompute, turn: Turn, span: Span
    ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Run the layers this method recomputes through ``engine``.

        Returns the final token rows ``[k]`` whose fresh K/V are written (``None``: every row run
        through each layer) and report info for the segment table.
        """
        raise NotImplementedError

    def boundary_input(self, engine: SegmentRecompute, turn: Turn, span: Span, layer: int) -> torch.Tensor:
        """Input hidden states ``[1, S, hidden]`` of ``layer`` for the segment: the embeddings for
        layer 0, else the hidden state kept with the reused cache."""
        if layer == 0:
            return engine.embeddings()
        return self.source_boundary(turn, span.name, layer).to(self.stack.device)


def _token_equivalents(entries: int, num_layers: int) -> float | int:
    value = entries / num_layers
    return int(value) if value.is_integer() else value


def budget_entries(rho: float, tokens: int, layers: int) -> int:
    """Entries to recompute for reuse ratio ``rho``: ``round((1 - rho) * tokens * layers)``."""
    return int(round((1.0 - rho) * tokens * layers))

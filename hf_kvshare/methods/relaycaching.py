"""RelayCaching (Geng et al., 2026): recompute important, deviating tokens inside middle layers.

RelayCaching reuses earlier agents' caches and observes that prefix-induced deviations are sparse
and localized to a range of layers and tokens; it selects tokens by KV deviation combined with
attention importance and recomputes them only inside critical middle layers. No public code
exists; this implementation follows that description (and the KVCMAS paper's Section 2.2):

- the band ``[a, b)`` of critical layers is a fraction of depth (default the middle half);
- every segment token restarts at layer ``a`` from the hidden state that entered ``a`` when the
  reused cache was made (kept per slot), runs layer ``a`` under this agent's context, and at the
  check layer ``a + 1`` each token is scored by ``KV deviation x received attention`` (attention
  summed over the segment's queries, averaged over heads);
- the top tokens are carried through ``a + 1 .. b - 1`` and their K/V replaced there.

The reuse ratio counts (token, layer) entries: ``(1 - rho) * S * L`` entries are recomputed,
i.e. ``k = (1 - rho) * S * L / (b - a)`` tokens in the band. A budget larger than the band holds
(``k > S``) widens it to ``[0, b')`` from the embeddings, so ``rho = 0`` recomputes everything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..method import register
from ..recompute.layers import SegmentRecompute
from ..recompute.selection import top_k
from ..recompute.stack import DecoderStack
from .selective import SelectiveRecompute, budget_entries

if TYPE_CHECKING:
    from ..trajectory import Span
    from ..turn import Turn


@register
@dataclass(eq=False)
class RelayCaching(SelectiveRecompute):
    """Token-selective recomputation by deviation x attention, restricted to middle layers.

    Args:
        rho: reuse ratio over (token, layer) entries.
        band: the critical layers as fractions of depth ``(start, end)``: layers
            ``round(start * L) .. round(end * L) - 1``; at least two layers (a restart layer and a
            check layer).

    >>> session = Session(model, tok, method="relaycaching", rho=0.9, band=(0.25, 0.75))  # doctest: +SKIP
    """

    name = "relaycaching"

    rho: float = 0.9
    band: Sequence[float] = (0.25, 0.75)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.band, Sequence) or isinstance(self.band, (str, bytes)):
            raise TypeError(
                "relaycaching: band must be two fractions of depth (start, end), 0 <= start < end <= 1; got "
                f"{self.band!r} ({type(self.band).__name__})"
            )
        band = tuple(self.band)
        if (
            len(band) != 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in band)
            or not 0.0 <= band[0] < band[1] <= 1.0
        ):
            raise ValueError(f"band must be two fractions of depth 0 <= start < end <= 1; got {self.band!r}")
        self.band = (float(band[0]), float(band[1]))

    def band_layers(self, num_layers: int) -> tuple[int, int]:
        """The band ``(a, b)`` as layer indices for a model of ``num_layers`` layers."""
        a, b = round(self.band[0] * num_layers), round(self.band[1] * num_layers)
        if b - a < 2:
            raise ValueError(
                f"band {self.band} covers layers [{a}, {b}) of {num_layers}; it needs at least two layers "
                "(a restart layer and a check layer)"
            )
        return a, b

    def check_model(self, stack: DecoderStack) -> None:
        a, b = self.band_layers(stack.num_layers)
        if self.rho < 1.0:  # scores attention at the layer after the restart: needs that layer's queries
            stack.query_source(min(a + 1, stack.num_layers - 1))

    def recompute_plan(self, length: int, num_layers: int) -> tuple[int, int, int]:
        """``(a, b, k)``: recompute ``k`` of ``length`` tokens in layers ``a .. b - 1`` (not the contract's
        ``plan(turn)`` hook, which RelayCaching leaves as it is)."""
        a, b = self.band_layers(num_layers)
        budget = budget_entries(self.rho, length, num_layers)
        if budget <= length * (b - a):
            return a, b, int(round(budget / (b - a)))
        b = min(num_layers, max(b, math.ceil(budget / length)))
        return 0, b, min(length, int(round(budget / b)))

    def boundary_layers(self) -> tuple[int, ...]:
        if self._stack is None:
            return ()
        a, _ = self.band_layers(self._stack.num_layers)
        return (a,) if a > 0 else ()

    # ------------------------------------------------------------ scoring
    def check(
        self, engine: SegmentRecompute, hidden: torch.Tensor, start: int, keep: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Run every token through layer ``start`` (from ``hidden`` ``[1, S, hidden]``) and score
        them at ``start + 1``; keep the ``keep`` best by deviation x attention (``None``: keep all).

        Returns the outputs of ``start + 1`` for the kept rows, the kept rows and the scores
        ``{"deviation": [S], "attention": [S]}``.
        """
        scores: dict[str, torch.Tensor] = {}

        def choose(probe) -> torch.Tensor:
            scores["deviation"], scores["attention"] = probe.deviation(), probe.attention()
            if keep is None:
                return torch.arange(probe.rows.numel())
            return top_k(scores["deviation"] * scores["attention"], keep)

        hidden, rows = engine.run_layer(start, hidden, engine.all_rows())
        hidden, rows = engine.run_layer(start + 1, hidden, rows, choose, attention=True)
        return hidden, rows, scores

    # ------------------------------------------------------------ building
    def recompute(
        self, engine: SegmentRecompute, turn: Turn, span: Span
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        a, b, k = self.recompute_plan(engine.length, self.stack.num_layers)
        info = {"band": f"{a}-{b - 1}", "recomputed_tokens": k}
        if k == 0:
            return engine.all_rows()[:0], info
        hidden, rows, _ = self.check(engine, self.boundary_input(engine, turn, span, a), a, k)
        for layer in range(a + 2, b):
            hidden, rows = engine.run_layer(layer, hidden, rows)
        return rows, info

"""CacheBlend (Yao et al., EuroSys 2025): recompute the tokens whose K/V deviates most.

The reused (re-positioned) K/V of a PH segment is blended with a fresh computation: every token
runs through the layers up to the check layer(s), where the tokens with the largest KV deviation
(recomputed vs reused) are selected; only those are carried through the following layers, their
queries attending over the full cache (prefix, the selected tokens' fresh K/V, the other tokens'
reused K/V), and their fresh K/V replace the reused ones in every layer.

Layer 0 cannot be a check layer: its K/V depend on the token and its position only, so reused and
fresh K/V agree there. The default check layer is 1, as in LMCache's implementation. With several
check layers, each keeps fewer candidates than the previous one (gradual filtering), down to
``(1 - rho) * S`` tokens at the last one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..method import register
from ..recompute.layers import SegmentRecompute
from ..recompute.selection import gradual_keep_counts, top_k
from ..recompute.stack import DecoderStack
from .selective import SelectiveRecompute

if TYPE_CHECKING:
    from ..trajectory import Span
    from ..turn import Turn


@register
@dataclass(eq=False)
class CacheBlend(SelectiveRecompute):
    """Token-selective recomputation by KV deviation at early check layers.

    Args:
        rho: reuse ratio: ``round((1 - rho) * S)`` tokens of an ``S``-token segment are recomputed
            in every layer (their K/V replaced), the others reused in every layer.
        check_layers: layer indices (``>= 1``, increasing) where the deviation is measured; every
            token runs through the layers up to the first one.

    >>> session = Session(model, tok, method="cacheblend", rho=0.85)  # doctest: +SKIP
    >>> session.run_turn("coder", [PF("You code.\\n"), PH("query"), PF("\\nCode:")])  # doctest: +SKIP
    """

    name = "cacheblend"

    rho: float = 0.9
    check_layers: Sequence[int] = (1,)

    def __post_init__(self) -> None:
        super().__post_init__()
        given = self.check_layers
        if isinstance(given, int) and not isinstance(given, bool):
            layers = (given,)
        elif isinstance(given, Sequence) and not isinstance(given, (str, bytes)):
            layers = tuple(given)
        else:
            raise TypeError(
                "cacheblend: check_layers must be a layer index or a list of layer indices (ints >= 1, "
                f"increasing); got {given!r} ({type(given).__name__})"
            )
        if not layers:
            raise ValueError("check_layers must name at least one layer")
        if any(not isinstance(layer, int) or isinstance(layer, bool) for layer in layers):
            raise ValueError(f"check_layers must be layer indices (ints); got {self.check_layers!r}")
        if layers[0] < 1:
            raise ValueError(
                f"check layers must be >= 1 (layer 0's K/V depend only on the token and its position, so its "
                f"deviation is zero); got {list(layers)}"
            )
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"check_layers must be strictly increasing; got {list(layers)}")
        self.check_layers = layers

    def check_model(self, stack: DecoderStack) -> None:
        if self.check_layers[-1] >= stack.num_layers:
            raise ValueError(
                f"check_layers {list(self.check_layers)} must be below the model's {stack.num_layers} layers"
            )

    def tokens_to_recompute(self, length: int) -> int:
        """``round((1 - rho) * length)``."""
        return int(round((1.0 - self.rho) * length))

    def select_tokens(self, engine: SegmentRecompute) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Run every token up to the last check layer and select the recomputed tokens there.

        Returns the selected rows' outputs of the last check layer ``[1, k, hidden]``, the rows
        ``[k]`` (ascending token indices in the segment) and the last check layer index.
        """
        k = self.tokens_to_recompute(engine.length)
        counts = gradual_keep_counts(engine.length, k, len(self.check_layers))
        hidden, rows = engine.embeddings(), engine.all_rows()
        last = self.check_layers[-1]
        for layer in range(last + 1):
            choose = None
            if layer in self.check_layers:
                keep = counts[self.check_layers.index(layer)]
                choose = _top_deviation(keep)
            hidden, rows = engine.run_layer(layer, hidden, rows, choose)
        return hidden, rows, last

    def recompute(
        self, engine: SegmentRecompute, turn: Turn, span: Span
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.tokens_to_recompute(engine.length) == 0:
            return engine.all_rows()[:0], {"recomputed_tokens": 0}
        hidden, rows, last = self.select_tokens(engine)
        for layer in range(last + 1, self.stack.num_layers):
            hidden, rows = engine.run_layer(layer, hidden, rows)
        return rows, {"recomputed_tokens": int(rows.numel()), "check_layers": list(self.check_layers)}


def _top_deviation(k: int):
    def choose(probe) -> torch.Tensor:
        return top_k(probe.deviation(), min(k, probe.rows.numel()))

    return choose

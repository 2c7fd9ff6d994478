"""Verify a correction on a small probe before it is used (KVCMAS's ``verify_tokens``).

The gate judges a correction from the pool alone (match weights, distances, the anchors' agreement);
it cannot tell a good correction of far content from a bad one. The probe asks the model instead: the
exact K/V of ``k`` tokens of the span (its last, or spread over it: :func:`probe_rows`), computed in one pass of those tokens only, through every
decoder layer, attending to the agent's prefix (the cache built so far) and the *corrected* span (the
selective-recompute engine :class:`~hf_kvshare.recompute.layers.SegmentRecompute`, the one CacheBlend
runs). Their error on the probe tokens says how well the corrected span serves what reads it:

- ``error``: the corrected K/V's distance to the probe's exact K/V, relative to the exact K/V's size
  (keys and values apart, over the layers the correction touches; the larger of the two);
- ``uncorrected``: the same for the source re-positioned, uncorrected (FullShared's K/V there);
- ``ratio = error / uncorrected``: how much of the source's error the correction leaves.

:meth:`Probe.accepts` takes the correction when ``ratio <= threshold`` (``scale="source"``: the
correction must remove enough of the source's error) or ``error <= threshold`` (``scale="exact"``: the
corrected K/V must be close enough to the exact ones, however close the source already was); under
:data:`NEGLIGIBLE` always (the source was already exact there). The probe's exact K/V replace the corrected
ones on its tokens (:attr:`Probe.kv`): they are computed anyway. A probe as long as the span
(:func:`covers_span`) would recompute all of it: the span is prefilled instead, its cause
``verify_whole``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..cache import SegmentKV
from ..recompute.layers import SegmentRecompute

if TYPE_CHECKING:
    from ..cache import SegmentedCache
    from ..recompute.stack import DecoderStack
    from ..rope import RopeShifter

#: where a probe's tokens sit in the span (:func:`probe_rows`)
PLACES = ("last", "spread")
#: what a probe's error is measured against (:meth:`Probe.accepts`)
SCALES = ("source", "exact")
#: a probe error under this (relative to the exact K/V's size) is accepted whatever the ratio: the
#: source was exact there already, and the ratio of two rounding errors says nothing
NEGLIGIBLE = 1e-3


@dataclass
class Probe:
    """What a probe found for one corrected span (module docstring)."""

    kv: SegmentKV  # the corrected K/V with the probe tokens' exact K/V written in
    tokens: int  # probe tokens
    error: float
    uncorrected: float
    rows: tuple[int, ...] = ()  # the probe's rows in the span (:func:`probe_rows`)

    def within(self, n: int) -> int:
        """How many probe tokens lie in the span's first ``n`` rows."""
        return sum(1 for r in self.rows if r < n)

    @property
    def ratio(self) -> float:
        if self.uncorrected > 0:
            return self.error / self.uncorrected
        return 0.0 if self.error == 0 else math.inf

    def accepts(self, threshold: float, scale: str = "source") -> bool:
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {', '.join(map(repr, SCALES))}, got {scale!r}")
        measured = self.ratio if scale == "source" else self.error
        return self.error <= NEGLIGIBLE or measured <= threshold

    def report(self, threshold: float, scale: str = "source") -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "error": round(self.error, 6),
            "uncorrected": round(self.uncorrected, 6),
            "ratio": round(self.ratio, 4) if math.isfinite(self.ratio) else None,
            "threshold": threshold,
            "scale": scale,
            "accepted": self.accepts(threshold, scale),
        }

    def reason(self, threshold: float, scale: str = "source") -> str:
        """Why a rejected probe sends its span dense (the text :mod:`hf_kvshare.reasons` classifies)."""
        if scale == "exact":
            return (
                f"verification probe rejected the correction: error {self.error:.3g} of the exact K/V's size "
                f"on its {self.tokens} tokens > {threshold:g} (the uncorrected source's: {self.uncorrected:.3g})"
            )
        return (
            f"verification probe rejected the correction: error {self.error:.3g} is {self.ratio:.2g} of the "
            f"uncorrected source's {self.uncorrected:.3g} on its {self.tokens} tokens > {threshold:g}"
        )


def covers_span(tokens: int, length: int) -> bool:
    """Whether a probe of ``tokens`` tokens takes every row of a span of ``length`` (:func:`probe_rows`):
    it would compute the whole span exactly, a prefill of it, so the span is prefilled instead
    (:func:`whole_span_reason`) and neither corrected nor probed."""
    return int(tokens) >= int(length)


def whole_span_reason(tokens: int, length: int) -> str:
    """Why a span a probe would cover whole is prefilled (the text :mod:`hf_kvshare.reasons` classifies)."""
    return (
        f"verification probe covers the whole span ({tokens} probe tokens, the span {length}): "
        "prefilled, its K/V computed exactly, not corrected"
    )


def probe_rows(
    length: int, tokens: int, device: torch.device | str | None = None, place: str = "last"
) -> torch.Tensor:
    """The probe's rows of a span of ``length`` tokens: ``min(tokens, length)`` of them, its last
    (``place="last"``) or spread evenly from its first to its last (``"spread"``)."""
    if place not in PLACES:
        raise ValueError(f"place must be one of {', '.join(map(repr, PLACES))}, got {place!r}")
    k = max(0, min(int(tokens), int(length)))
    if place == "spread" and k > 1:
        return torch.linspace(0, length - 1, k, device=device).round().long().unique()
    return torch.arange(length - k, length, device=device)


def verify_correction(
    stack: DecoderStack,
    cache: SegmentedCache,
    corrected: SegmentKV,
    source: SegmentKV,
    token_ids: torch.Tensor,
    start: int,
    shifter: RopeShifter,
    tokens: int,
    first_layer: int = 1,
    embeds: torch.Tensor | None = None,
    place: str = "last",
) -> Probe:
    """Run the probe over the span's last ``tokens`` tokens.

    Args:
        stack: the model's decoder stack.
        cache: the turn's cache, complete up to ``start`` (the agent's prefix).
        corrected: the span's corrected K/V at ``start``.
        source: the span's source (where it sat; re-positioned here for the uncorrected error).
        token_ids: the span's ids ``[S]``; ``embeds`` its input embeddings where ids do not give them.
        first_layer: the first layer compared (1 when the correction leaves layer 0 as placed: there
            the re-positioned source is exact).
    """
    engine = SegmentRecompute(stack, cache, corrected, token_ids, embeds, start=start, shifter=shifter)
    rows = probe_rows(engine.length, tokens, stack.device, place)
    hidden = engine.embeddings()[:, rows]
    for layer in range(stack.num_layers):
        hidden, _ = engine.run_layer(layer, hidden, rows)
    # per compared layer: squared distances of the corrected and the uncorrected K/V to the exact, and
    # the exact's squared size, keys and values apart; summed on the device, read once
    terms: list[torch.Tensor] = []
    for layer, keys in enumerate(source.keys_at(shifter, start)):
        if layer < first_layer:
            continue
        _, fresh_k, fresh_v = engine.fresh[layer]
        corr_k, corr_v = engine.reused(layer)
        for fresh, corr, unc in ((fresh_k, corr_k, keys), (fresh_v, corr_v, source.values[layer])):
            exact = fresh.float()
            terms.append(
                torch.stack(
                    [
                        (corr[..., rows, :].float() - exact).square().sum(),
                        (unc[..., rows, :].to(exact.device).float() - exact).square().sum(),
                        exact.square().sum(),
                    ]
                )
            )
    if not terms:
        raise ValueError(
            f"no layer to compare: the model has {stack.num_layers}, the first compared is {first_layer}"
        )
    sums = torch.stack(terms).double().view(-1, 2, 3).sum(0).cpu()  # [keys, values] x [corr, unc, size]
    size = sums[:, 2].clamp_min(torch.finfo(torch.float64).tiny)
    error = float((sums[:, 0] / size).sqrt().max())
    uncorrected = float((sums[:, 1] / size).sqrt().max())
    kv, _ = engine.result()
    return Probe(
        kv=kv, tokens=int(rows.numel()), error=error, uncorrected=uncorrected, rows=tuple(rows.tolist())
    )

"""Anchor matching and correction, layer by layer (paper Section 3.3 and Appendix A.3).

Given the source cache of a PH segment (another agent's materialized cache, or the context-free
reference) and the compatible anchors of its slot:

1. :func:`comparison_prefix`: the prefix ``k`` the anchors can cover. A length-``S`` segment is
   corrected with anchors covering all ``S`` tokens when at least two do; otherwise over the
   longest prefix two anchors cover, and the remaining rows keep the re-positioned source.
2. :func:`match`: one pass over the layers reconstructs each anchor's base (rows ``:k``) and
   accumulates the gate distance (values, all layers) and the token-wise mean absolute
   distances (keys in the canonical frame, values), without keeping any reconstruction.
3. :func:`apply_correction`: a second pass materializes the target cache layer by layer:
   ``C_hat = Align(C_src) + Rot(sum_v w_v[t] A_v B_v)``, the weights ``w`` token-wise (softmax of
   ``-distance / T`` over anchors), separately for keys and values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache import SegmentKV
from ..rope import RopeShifter
from .lowrank import MatrixFactors, to_heads, to_matrix
from .pool import Anchor


def comparison_prefix(anchors: list[Anchor], length: int) -> int:
    """``min(length, second-longest anchor length)``: the longest prefix at least two anchors cover
    (0 when fewer than two anchors are given)."""
    if len(anchors) < 2:
        return 0
    lengths = sorted((a.length for a in anchors), reverse=True)
    return min(length, lengths[1])


def canonical_keys(kv: SegmentKV, shifter: RopeShifter, rows: int | None = None) -> list[torch.Tensor]:
    """``kv``'s keys (first ``rows`` rows) moved to positions ``0 ..``, batch element 0."""
    rows = kv.length if rows is None else rows
    rotation = shifter.rotation(kv.start, 0, rows)
    return [shifter.apply(k[:1, :, :rows], rotation) for k in kv.keys]


@dataclass
class Match:
    """Distances between a source cache and ``anchors`` over the prefix ``prefix``.

    ``gate_distances`` ``[n]``: ``sqrt(sum_layers ||V_src[:k] - V_anchor[:k]||_F^2)``.
    ``key_distances`` / ``value_distances`` ``[n, k]``: mean absolute difference per token over
    layers, heads and head dims (keys compared in the canonical frame).
    """

    anchors: list[Anchor]
    prefix: int
    gate_distances: torch.Tensor
    key_distances: torch.Tensor
    value_distances: torch.Tensor


def match(source: SegmentKV, anchors: list[Anchor], shifter: RopeShifter, prefix: int) -> Match:
    """Compare ``source`` (rows ``:prefix``) with every anchor's reconstructed base, layer by layer."""
    if not anchors:
        raise ValueError("match needs at least one anchor")
    if prefix < 1 or prefix > source.length:
        raise ValueError(f"prefix must be in [1, {source.length}] (the source length), got {prefix}")
    short = [a.serial for a in anchors if a.length < prefix]
    if short:
        raise ValueError(f"anchors {short} are shorter than the comparison prefix {prefix}")
    if anchors[0].base.num_layers != source.num_layers:
        raise ValueError(f"anchors have {anchors[0].base.num_layers} layers, the source {source.num_layers}")
    n = len(anchors)
    rotation = shifter.rotation(source.start, 0, prefix)
    device = source.values[0].device
    gate_sq = torch.zeros(n, dtype=torch.float64, device=device)
    key_abs = torch.zeros(n, prefix, dtype=torch.float64, device=device)
    value_abs = torch.zeros(n, prefix, dtype=torch.float64, device=device)
    features = 0
    for layer in range(source.num_layers):
        src_v = to_matrix(source.values[layer][:1, :, :prefix]).float()
        src_k = to_matrix(shifter.apply(source.keys[layer][:1, :, :prefix], rotation)).float()
        features += src_v.shape[1]
        for i, anchor in enumerate(anchors):
            dv = src_v - anchor.base.values[layer].reconstruct(prefix).float()
            dk = src_k - anchor.base.keys[layer].reconstruct(prefix).float()
            gate_sq[i] += dv.double().pow(2).sum()
            value_abs[i] += dv.abs().sum(-1).double()
            key_abs[i] += dk.abs().sum(-1).double()
    return Match(
        anchors=list(anchors),
        prefix=prefix,
        gate_distances=gate_sq.sqrt().cpu(),
        key_distances=(key_abs / features).cpu(),
        value_distances=(value_abs / features).cpu(),
    )


def token_weights(token_distances: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token interpolation weights ``softmax_v(-distance[v, t] / T)``, ``[n, k]`` float32."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.softmax(-token_distances / temperature, dim=0).float()


def weighted_sum(factors: list[MatrixFactors], weights: torch.Tensor, rows: int) -> torch.Tensor:
    """``sum_v weights[v, :, None] * factors[v][:rows]`` ``[rows, D]`` without densifying low-rank terms.

    Low-rank terms are combined as one product ``[w_1 A_1 | ... | w_n A_n] @ [B_1; ...; B_n]``.
    """
    weights = weights.to(factors[0].a.device)
    dense = [(w, f) for w, f in zip(weights, factors) if f.dense]
    low = [(w, f) for w, f in zip(weights, factors) if not f.dense]
    out = None
    if low:
        a = torch.cat([w[:, None] * f.a[:rows].float() for w, f in low], dim=1)
        b = torch.cat([f.b.float() for _, f in low], dim=0)
        out = a @ b
    for w, f in dense:
        term = w[:, None] * f.a[:rows].float()
        out = term if out is None else out + term
    return out


def corrected_kv(
    source: SegmentKV,
    target_start: int,
    shifter: RopeShifter,
    rows: int,
    layer_delta: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> SegmentKV:
    """``Align(source) + Rot(delta)`` at ``target_start``, one layer at a time.

    ``layer_delta(layer)`` returns the canonical key and value corrections ``[rows, D]`` of the
    first ``rows`` tokens; rows ``rows:`` keep the re-positioned source. Only the output (batch 1)
    is materialized in full dimension.
    """
    if not 0 <= rows <= source.length:
        raise ValueError(f"cannot correct {rows} rows of a {source.length}-token source")
    heads = source.keys[0].shape[1]
    to_target = shifter.rotation(source.start, target_start, source.length)
    delta_to_target = shifter.rotation(0, target_start, rows) if rows else None
    keys, values = [], []
    for layer in range(source.num_layers):
        k_src, v_src = source.keys[layer][:1], source.values[layer][:1]
        key = shifter.apply(k_src, to_target)
        key = key.clone() if key is k_src else key
        value = v_src.clone()
        if rows:
            delta_k, delta_v = layer_delta(layer)
            key[:, :, :rows] += shifter.apply(to_heads(delta_k, heads), delta_to_target).to(key.dtype)
            value[:, :, :rows] += to_heads(delta_v, heads).to(value.dtype)
        keys.append(key)
        values.append(value)
    return SegmentKV(keys=keys, values=values, start=target_start, agent=source.agent)


def apply_correction(
    source: SegmentKV,
    anchors: list[Anchor],
    target: str,
    key_weights: torch.Tensor,
    value_weights: torch.Tensor,
    target_start: int,
    shifter: RopeShifter,
) -> SegmentKV:
    """Materialize the corrected cache of ``source`` at ``target_start``, layer by layer (Eq. 8).

    Args:
        source: per-layer K/V ``[batch, kv_heads, S, head_dim]`` (batch element 0 is used).
        anchors: the anchors whose ``deltas[target]`` are combined.
        key_weights / value_weights: ``[n, k]`` token-wise weights (``k <= S`` rows are corrected;
            rows ``k:`` keep the re-positioned source).
        target_start: where the segment lands in the target prompt.

    Returns:
        A :class:`SegmentKV` of batch 1 at ``target_start`` (``agent`` = the source's).
    """
    n, k = key_weights.shape
    if value_weights.shape != key_weights.shape or n != len(anchors):
        raise ValueError(
            f"expected [n={len(anchors)}, k] key and value weights, got {tuple(key_weights.shape)} "
            f"and {tuple(value_weights.shape)}"
        )
    missing = [a.serial for a in anchors if target not in a.deltas]
    if missing:
        raise ValueError(f"anchors {missing} hold no correction for {target!r}")
    short = [a.serial for a in anchors if a.deltas[target].length < k]
    if short:
        raise ValueError(f"anchors {short} hold corrections shorter than the {k} rows to correct")
    deltas = [a.deltas[target] for a in anchors]

    def layer_delta(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            weighted_sum([d.keys[layer] for d in deltas], key_weights, k),
            weighted_sum([d.values[layer] for d in deltas], value_weights, k),
        )

    return corrected_kv(source, target_start, shifter, k, layer_delta)

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

The reference code's per-slot gate splits this: :func:`gate_distances` (value L2 over the full
length, computed from the low-rank factors without reconstructing any anchor), :func:`covering`
(which anchors correct which rows) and :func:`token_distances` (the token-wise L1 distances, one
batched reconstruction per layer). Layer 0 can be left uncorrected (``skip_layer0``): its K/V
depend on the token and its position only, so the re-positioned source is already exact there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..cache import SegmentKV
from ..rope import RopeShifter
from .corrected import CorrectedKV, LowRankDelta
from .lowrank import FactoredKV, MatrixFactors, column_sum, columns, layer_count, to_heads, to_matrix
from .pool import Anchor

if TYPE_CHECKING:
    from .sharded import Shard


def comparison_prefix(anchors: list[Anchor], length: int) -> int:
    """``min(length, second-longest anchor length)``: the longest prefix at least two anchors cover
    (0 when fewer than two anchors are given)."""
    if len(anchors) < 2:
        return 0
    lengths = sorted((a.length for a in anchors), reverse=True)
    return min(length, lengths[1])


def covering(anchors: list[Anchor], length: int, partial: bool = True) -> tuple[list[Anchor], int]:
    """The reference code's variable-length rule: the anchors at least ``length`` long correct all
    ``length`` rows; if there are none and ``partial``, the longest anchors correct their
    ``max length`` rows (the rest keep the re-positioned source); else ``([], 0)``."""
    full = [a for a in anchors if a.length >= length]
    if full:
        return full, length
    if not partial or not anchors:
        return [], 0
    longest = max(a.length for a in anchors)
    return [a for a in anchors if a.length == longest], longest


def windows(anchors: list[Anchor], length: int) -> list[tuple[int, int, list[Anchor]]]:
    """Piecewise coverage of a ``length``-token span (``profile="reuse"``): ``(first, last, anchors)`` per
    window, each window ``[first, last)`` corrected by the anchors at least ``last`` long, the windows
    ending at the anchors' distinct lengths (and ``length``), so that each row is corrected by every
    anchor covering it. Rows past the longest anchor are in no window (the caller reuses them
    uncorrected). An anchor covering the whole span gives one window (:func:`covering`'s rule)."""
    ends = sorted({min(a.length, length) for a in anchors})
    out, first = [], 0
    for last in ends:
        out.append((first, last, [a for a in anchors if a.length >= last]))
        first = last
    return out


def gate_distances(
    values: list[torch.Tensor], anchors: list[Anchor], rows: int, shard: Shard | None = None
) -> torch.Tensor:
    """``sqrt(sum_layers ||V[:rows] - A B[:rows]||_F^2)`` per anchor, ``[n]`` float64 on the values'
    device (no host synchronisation), from the factors.

    Per layer, with the anchor base ``A B`` (``A`` ``[L, r]``, ``B`` ``[r, D]``)::

        ||V - A B||^2 = ||V||^2 - 2 <V B^T, A> + tr((A^T A)(B B^T))

    ``V B^T`` is one GEMM over every anchor's ``B`` stacked ``[sum r, D]``; no anchor is
    reconstructed at ``[rows, D]``. Dense anchors are compared directly. Works in the values'
    dtype when it is float64, else float32 with float64 accumulation.

    Args:
        values: the candidate's per-layer values ``[batch, kv_heads, S, head_dim]`` (batch 0, ``S >= rows``).
        anchors: anchors at least ``rows`` long.
        shard: this rank's heads of ``values`` and of the anchors' factors (:mod:`.sharded`): the
            terms summed over every rank (one all-reduce), the same distances on every rank.
    """
    terms = column_sum(gate_distance_terms(values, anchors, rows), shard)
    return terms.clamp_min(0).sqrt()  # one transfer for the gate


def gate_distance_terms(values: list[torch.Tensor], anchors: list[Anchor], rows: int) -> torch.Tensor:
    """The squared distances of :func:`gate_distances` before their clamp and root, ``[n]`` float64:
    each term a sum over the columns (heads) compared, so that tensor-parallel ranks holding their own
    heads sum their terms across ranks (:func:`~.sharded.sharded_gate_distances`)."""
    if not anchors:
        raise ValueError("gate_distances needs at least one anchor")
    short = [a.serial for a in anchors if a.length < rows]
    if short:
        raise ValueError(f"anchors {short} are shorter than the {rows} rows compared")
    work = torch.float64 if values[0].dtype == torch.float64 else torch.float32
    device = values[0].device
    total = torch.zeros(len(anchors), dtype=torch.float64, device=device)
    for layer, value in enumerate(values):
        v = to_matrix(value[:1, :, :rows]).to(work)
        norm = v.double().pow(2).sum()
        factors = [a.base.values[layer] for a in anchors]
        low = [i for i, f in enumerate(factors) if not f.dense]
        if low:
            stacked = torch.cat([factors[i].b.to(work) for i in low], dim=0)  # [sum r, D]
            projected = v @ stacked.T  # [rows, sum r]: the one GEMM
            offset = 0
            for i in low:
                a = factors[i].a[:rows].to(work)
                b = factors[i].b.to(work)
                r = a.shape[1]
                cross = (projected[:, offset : offset + r].double() * a.double()).sum()
                quad = ((a.T @ a).double() * (b @ b.T).double()).sum()
                total[i] += (norm - 2 * cross + quad).to(device)  # layers may sit on other devices
                offset += r
        for i, f in enumerate(factors):
            if f.dense:
                total[i] += (v - f.a[:rows].to(work)).double().pow(2).sum().to(device)
    return total  # on the values' device


#: rows of a source compared at a time by :func:`token_distances` (bounds its transient memory)
DISTANCE_ROWS = 512


def token_distances(
    source: SegmentKV,
    anchors: list[Anchor],
    shifter: RopeShifter,
    rows: int,
    reader_start: int | None = None,
    shard: Shard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-wise mean absolute distances ``[n, rows]`` (keys, values) between ``source`` and each
    anchor's base, over layers, heads and head dims: the inputs of :func:`token_weights`.

    Computed :data:`DISTANCE_ROWS` rows at a time, layer by layer, one anchor's reconstruction at a
    time: the transient memory is a few ``[DISTANCE_ROWS, D]`` matrices whatever the segment's length
    and the number of anchors (a record that computes them for the next turn stays within a small
    fraction of a segment), and a token's distance from an anchor does not depend on the other
    anchors compared or on the rows around it.

    Keys are compared in the canonical frame (both at positions ``0 ..``; the KVCMAS reference), or
    with ``reader_start`` in the KVComm reference's frames: the source placed at ``reader_start`` (where
    this reader puts it) against each anchor's base placed at its ``base_start``. Under ``shard`` (this
    rank's heads) the sums and the feature count are every rank's (one all-reduce)."""
    if not anchors:
        raise ValueError("token_distances needs at least one anchor")
    if not 1 <= rows <= source.length or any(a.length < rows for a in anchors):
        raise ValueError(f"cannot compare {rows} rows of a {source.length}-token source with these anchors")
    device = source.values[0].device
    n = len(anchors)
    key_abs = torch.zeros(n, rows, dtype=torch.float64, device=device)
    value_abs = torch.zeros(n, rows, dtype=torch.float64, device=device)
    heads = source.keys[0].shape[1]
    features = columns(sum(v.shape[1] * v.shape[3] for v in source.values), shard, source.num_layers)
    target = 0 if reader_start is None else reader_start
    for first in range(0, rows, DISTANCE_ROWS):
        last = min(rows, first + DISTANCE_ROWS)
        rotation = shifter.rotation(source.start + first, target + first, last - first)
        placed = None if reader_start is None else _base_rotations(anchors, shifter, last - first, first)
        for layer in range(source.num_layers):
            for acc, pick in ((key_abs, "keys"), (value_abs, "values")):
                src = getattr(source, pick)[layer][:1, :, first:last]
                if pick == "keys":
                    src = shifter.apply(src, rotation, layer=layer)
                src = to_matrix(src).float()
                for i, a in enumerate(anchors):
                    factors = getattr(a.base, pick)[layer]
                    recon = factors.a[first:last].float()
                    # a new tensor from here on (the product, a rotation or a copy), so the difference
                    # and its absolute value are taken in place: the same values, no more temporaries
                    recon = recon.clone() if factors.b is None else recon @ factors.b.float()
                    if placed is not None and pick == "keys":
                        recon = to_matrix(
                            shifter.apply(to_heads(recon, heads), placed[i], layer=layer)
                        ).float()
                    # per-layer devices (device_map): accumulate on the source's first layer's
                    acc[i, first:last] += recon.sub_(src).abs_().sum(-1).double().to(device)
    key_abs, value_abs = column_sum(torch.stack((key_abs, value_abs)), shard)
    return key_abs / features, value_abs / features  # stay on the device: weights are applied there


def _base_rotations(anchors: list[Anchor], shifter: RopeShifter, rows: int, first: int = 0) -> list:
    """Per anchor, the rotation moving its canonical base rows ``first .. first + rows`` to where it was
    last placed (``base_start + first ..``); anchors placed alike share one."""
    cache: dict[int, object] = {}
    for a in anchors:
        if a.base_start not in cache:
            cache[a.base_start] = shifter.rotation(first, a.base_start + first, rows)
    return [cache[a.base_start] for a in anchors]


def prefix_weights(
    source: SegmentKV, anchors: list[Anchor], shifter: RopeShifter, reader_start: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KVComm reference's weights of the prefix (PF) deltas: per layer and feature (head x
    head dim), ``softmax`` over anchors of ``-||source - base tail||_2`` over the segment's ``S``
    tokens, where the base tail is each anchor's last ``S`` rows. Returns ``[n, layers, D]`` float32
    for keys and values. Keys in the canonical frame, or with ``reader_start`` as
    :func:`token_distances` places them."""
    rows = source.length
    if not anchors or any(a.length < rows for a in anchors):
        raise ValueError(f"prefix weights need anchors at least {rows} tokens long")
    rotation = shifter.rotation(source.start, 0 if reader_start is None else reader_start, rows)
    heads = source.keys[0].shape[1]
    key_w, value_w = [], []
    for layer in range(source.num_layers):
        src_v = to_matrix(source.values[layer][:1]).float()
        src_k = to_matrix(shifter.apply(source.keys[layer][:1], rotation, layer=layer)).float()
        tails_k, tails_v = [], []
        for a in anchors:
            first = a.length - rows
            k = _rows_from(a.base.keys[layer], first).float()
            if reader_start is not None:  # else: the tail rows as the canonical base holds them
                turn = shifter.rotation(first, a.base_start + first, rows)
                k = to_matrix(shifter.apply(to_heads(k, heads), turn, layer=layer)).float()
            tails_k.append(k)
            tails_v.append(_rows_from(a.base.values[layer], first).float())
        key_w.append(torch.softmax(-(torch.stack(tails_k) - src_k).norm(dim=1), dim=0))
        value_w.append(torch.softmax(-(torch.stack(tails_v) - src_v).norm(dim=1), dim=0))
    return torch.stack(key_w, dim=1), torch.stack(value_w, dim=1)


def _rows_from(factors: MatrixFactors, first: int) -> torch.Tensor:
    """Rows ``first:`` of the matrix (a low-rank one reconstructs only those rows)."""
    tail = factors.a[first:]
    return tail if factors.b is None else tail @ factors.b


def prefix_correction(
    kv: SegmentKV,
    deltas: list[FactoredKV],
    key_weights: torch.Tensor,
    value_weights: torch.Tensor,
    frame: str,
    shifter: RopeShifter,
    skip_layer0: bool = True,
) -> SegmentKV:
    """``kv`` (PF text placed at ``kv.start``) plus ``sum_a w[a, layer, feature] * delta_a`` per layer
    (the weights of :func:`prefix_weights` broadcast over tokens); ``frame="canonical"`` deltas are
    rotated to ``kv.start``, ``"writer"`` ones added as stored. Layer 0 is left as placed."""
    if any(d.length != kv.length for d in deltas):
        raise ValueError(
            f"prefix deltas of {[d.length for d in deltas]} tokens for a {kv.length}-token PF segment"
        )
    heads = kv.keys[0].shape[1]
    rotation = shifter.rotation(0, kv.start, kv.length) if frame == "canonical" else None
    keys, values = list(kv.keys), list(kv.values)
    for layer in range(kv.num_layers):
        if skip_layer0 and layer == 0:
            continue
        dk = sum(
            w[layer][None, :] * d.keys[layer].reconstruct(d.length).float()
            for w, d in zip(key_weights, deltas)
        )
        dv = sum(
            w[layer][None, :] * d.values[layer].reconstruct(d.length).float()
            for w, d in zip(value_weights, deltas)
        )
        keys[layer] = keys[layer][:1] + shifter.apply(to_heads(dk, heads), rotation, layer=layer).to(
            keys[layer].dtype
        )
        values[layer] = values[layer][:1] + to_heads(dv, heads).to(values[layer].dtype)
    return SegmentKV(keys=keys, values=values, start=kv.start, agent=kv.agent)


def canonical_keys(kv: SegmentKV, shifter: RopeShifter, rows: int | None = None) -> list[torch.Tensor]:
    """``kv``'s keys (first ``rows`` rows) moved to positions ``0 ..``, batch element 0."""
    return list(canonical_key_layers(kv, shifter, rows))


def canonical_key_layers(
    kv: SegmentKV, shifter: RopeShifter, rows: int | None = None
) -> Iterator[torch.Tensor]:
    """:func:`canonical_keys` one layer at a time (a generator: a consumer that factorizes each layer
    holds one layer's rotated keys at once); the same values."""
    rows = kv.length if rows is None else rows
    rotation = shifter.rotation(kv.start, 0, rows)
    for i, k in enumerate(kv.keys):
        yield shifter.apply(k[:1, :, :rows], rotation, layer=i)


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


def match(
    source: SegmentKV, anchors: list[Anchor], shifter: RopeShifter, prefix: int, shard: Shard | None = None
) -> Match:
    """Compare ``source`` (rows ``:prefix``) with every anchor's base: :func:`gate_distances` and
    :func:`token_distances` over the prefix (under ``shard``: over every rank's heads)."""
    if not anchors:
        raise ValueError("match needs at least one anchor")
    if prefix < 1 or prefix > source.length:
        raise ValueError(f"prefix must be in [1, {source.length}] (the source length), got {prefix}")
    short = [a.serial for a in anchors if a.length < prefix]
    if short:
        raise ValueError(f"anchors {short} are shorter than the comparison prefix {prefix}")
    if anchors[0].base.num_layers != source.num_layers:
        raise ValueError(f"anchors have {anchors[0].base.num_layers} layers, the source {source.num_layers}")
    key_distances, value_distances = token_distances(source, anchors, shifter, prefix, shard=shard)
    return Match(
        anchors=list(anchors),
        prefix=prefix,
        gate_distances=gate_distances(source.values, anchors, prefix, shard),
        key_distances=key_distances,
        value_distances=value_distances,
    )


def token_weights(token_distances: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token interpolation weights ``softmax_v(-distance[v, t] / T)``, ``[n, k]`` float32."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.softmax(-token_distances / temperature, dim=0).float()


def weighted_factors(
    factors: list[MatrixFactors], weights: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The low-rank terms of :func:`weighted_sum` as one product's factors ``(a, b)``: ``a = [w_1 A_1 |
    ... | w_n A_n]`` ``[rows, sum r]`` float32, ``b = [B_1; ...; B_n]`` ``[sum r, D]`` (``None`` without
    a low-rank term). ``a @ b`` is their sum: what a serving worker computes on its device."""
    weights = weights.to(factors[0].a.device)
    low = [(w, f) for w, f in zip(weights, factors) if not f.dense]
    if not low:
        return None
    # each weighted block written straight into its columns (no per-anchor product, then a cat)
    ranks = [f.a.shape[1] for _, f in low]
    a = torch.empty(rows, sum(ranks), dtype=torch.float32, device=weights.device)
    offset = 0
    for (w, f), r in zip(low, ranks):
        torch.mul(w[:, None], f.a[:rows], out=a[:, offset : offset + r])
        offset += r
    return a, torch.cat([f.b.float() for _, f in low], dim=0)


def weighted_sum(factors: list[MatrixFactors], weights: torch.Tensor, rows: int) -> torch.Tensor:
    """``sum_v weights[v, :, None] * factors[v][:rows]`` ``[rows, D]`` without densifying low-rank terms.

    Low-rank terms are combined as one product ``[w_1 A_1 | ... | w_n A_n] @ [B_1; ...; B_n]``
    (:func:`weighted_factors`).
    """
    weights = weights.to(factors[0].a.device)
    low = weighted_factors(factors, weights, rows)
    out = None if low is None else low[0] @ low[1]
    for w, f in zip(weights, factors):
        if f.dense:
            term = w[:, None] * f.a[:rows].float()
            out = term if out is None else out.add_(term)
    return out


def piecewise_factors(
    factors: list[MatrixFactors], weights: torch.Tensor, lengths: list[int], rows: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The low-rank terms of :func:`piecewise_sum` as one product's factors ``(a, b)`` (rows of ``a``
    past a factor's length zero), as :func:`weighted_factors`; ``None`` without a low-rank term."""
    weights = weights.to(factors[0].a.device)
    low = [(w, f, n) for w, f, n in zip(weights, factors, lengths) if not f.dense]
    if not low:
        return None
    ranks = [f.a.shape[1] for _, f, _ in low]
    a = torch.zeros(rows, sum(ranks), dtype=torch.float32, device=weights.device)
    offset = 0
    for (w, f, n), r in zip(low, ranks):
        n = min(n, rows)
        torch.mul(w[:n, None], f.a[:n], out=a[:n, offset : offset + r])
        offset += r
    return a, torch.cat([f.b.float() for _, f, _ in low], dim=0)


def piecewise_sum(
    factors: list[MatrixFactors], weights: torch.Tensor, lengths: list[int], rows: int
) -> torch.Tensor:
    """``sum_v weights[v, :, None] * factors[v]`` ``[rows, D]`` where factor ``v`` holds only its first
    ``lengths[v]`` rows (its rows past them count as zero: the weights there are 0 in a piecewise
    correction); low-rank terms combined in one product (:func:`piecewise_factors`)."""
    weights = weights.to(factors[0].a.device)
    out = torch.zeros(rows, factors[0].shape[1], dtype=torch.float32, device=weights.device)
    low = piecewise_factors(factors, weights, lengths, rows)
    if low is not None:
        out += low[0] @ low[1]
    for w, f, n in zip(weights, factors, lengths):
        if f.dense:
            n = min(n, rows)
            out[:n] += w[:n, None] * f.a[:n].float()
    return out


def apply_piecewise(
    source: SegmentKV,
    anchors: list[Anchor],
    target: str,
    key_weights: torch.Tensor,
    value_weights: torch.Tensor,
    target_start: int,
    shifter: RopeShifter,
    skip_layer0: bool = False,
) -> CorrectedKV:
    """:func:`apply_correction` window by window (:func:`windows`): ``key_weights`` / ``value_weights``
    ``[n, rows]`` hold, per row, the weights of the anchors covering it (0 for an anchor shorter than
    the row), so each window's rows get the weighted sum of its own anchors' deltas; rows ``rows:``
    keep the re-positioned source."""
    rows = key_weights.shape[1]
    deltas = _checked_deltas(anchors, target, key_weights, value_weights, "rows")
    frame = _one_frame(anchors)
    lengths = [min(a.length, d.length) for a, d in zip(anchors, deltas)]

    def layer_delta(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            piecewise_sum([d.keys[layer] for d in deltas], key_weights, lengths, rows),
            piecewise_sum([d.values[layer] for d in deltas], value_weights, lengths, rows),
        )

    def layer_factors(layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...] | None:
        return _factor_pair(
            piecewise_factors([d.keys[layer] for d in deltas], key_weights, lengths, rows),
            piecewise_factors([d.values[layer] for d in deltas], value_weights, lengths, rows),
        )

    kv = corrected_kv(source, target_start, shifter, rows, layer_delta, skip_layer0, frame=frame)
    return _with_factors(kv, deltas, layer_factors, frame, skip_layer0)


def corrected_kv(
    source: SegmentKV,
    target_start: int,
    shifter: RopeShifter,
    rows: int,
    layer_delta: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    skip_layer0: bool = False,
    frame: str = "canonical",
) -> CorrectedKV:
    """``Align(source) + Rot(delta)`` at ``target_start``, one layer at a time, computed where it is read
    (:class:`~hf_kvshare.anchors.corrected.CorrectedKV`: a cache laying it out writes each layer straight into its
    slots; reading ``keys`` / ``values`` computes them all, batch 1).

    ``layer_delta(layer)`` returns the key and value corrections ``[rows, D]`` of the first ``rows``
    tokens, keys canonical (rotated to the target) or, with ``frame="writer"``, in the absolute
    positions of the consumer that observed them (added as they are: the authors' code); rows
    ``rows:`` keep the re-positioned source. ``skip_layer0``: layer 0 keeps the re-positioned source.
    ``layer_delta`` is called when a layer is written, so what it reads must stay unchanged until then.
    """
    if not 0 <= rows <= source.length:
        raise ValueError(f"cannot correct {rows} rows of a {source.length}-token source")
    if frame not in ("canonical", "writer"):
        raise ValueError(f"frame must be 'canonical' or 'writer', got {frame!r}")
    heads = source.keys[0].shape[1]
    delta_to_target = shifter.rotation(0, target_start, rows) if rows and frame == "canonical" else None

    def target_delta(layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if skip_layer0 and layer == 0:
            return None
        delta_k, delta_v = layer_delta(layer)
        delta_k = to_heads(delta_k, heads)
        if delta_to_target is not None:
            delta_k = shifter.apply_into(delta_k, delta_to_target, torch.empty_like(delta_k), layer=layer)
        return delta_k, to_heads(delta_v, heads)

    return CorrectedKV(source=source, start=target_start, rows=rows, delta=target_delta, shifter=shifter)


def apply_correction(
    source: SegmentKV,
    anchors: list[Anchor],
    target: str,
    key_weights: torch.Tensor,
    value_weights: torch.Tensor,
    target_start: int,
    shifter: RopeShifter,
    skip_layer0: bool = False,
) -> SegmentKV:
    """Materialize the corrected cache of ``source`` at ``target_start``, layer by layer (Eq. 8).

    Args:
        source: per-layer K/V ``[batch, kv_heads, S, head_dim]`` (batch element 0 is used).
        anchors: the anchors whose ``deltas[target]`` are combined.
        key_weights / value_weights: ``[n, k]`` token-wise weights (``k <= S`` rows are corrected;
            rows ``k:`` keep the re-positioned source).
        target_start: where the segment lands in the target prompt.
        skip_layer0: leave layer 0 uncorrected (the reference code's choice).

    Returns:
        A :class:`~hf_kvshare.anchors.corrected.CorrectedKV` of batch 1 at ``target_start`` (``agent`` = the
        source's), computed where it is read or laid out (:func:`corrected_kv`).
    """
    k = key_weights.shape[1]
    deltas = _checked_deltas(anchors, target, key_weights, value_weights, "k")
    short = [a.serial for a, d in zip(anchors, deltas) if d.length < k]
    if short:
        raise ValueError(f"anchors {short} hold corrections shorter than the {k} rows to correct")
    frame = _one_frame(anchors)

    def layer_delta(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            weighted_sum([d.keys[layer] for d in deltas], key_weights, k),
            weighted_sum([d.values[layer] for d in deltas], value_weights, k),
        )

    def layer_factors(layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...] | None:
        return _factor_pair(
            weighted_factors([d.keys[layer] for d in deltas], key_weights, k),
            weighted_factors([d.values[layer] for d in deltas], value_weights, k),
        )

    kv = corrected_kv(source, target_start, shifter, k, layer_delta, skip_layer0, frame=frame)
    return _with_factors(kv, deltas, layer_factors, frame, skip_layer0)


def _factor_pair(keys: Any, values: Any) -> tuple[tuple[torch.Tensor, torch.Tensor], ...] | None:
    return None if keys is None or values is None else (keys, values)


def _with_factors(
    kv: CorrectedKV, deltas: list[FactoredKV], layer_factors: Callable, frame: str, skip_layer0: bool
) -> CorrectedKV:
    """``kv`` with its delta exposed as low-rank factors (:class:`~.corrected.LowRankDelta`) when every
    anchor's delta is low rank in every layer (a dense term: not exposed; the rows are computed here)."""
    if all(not f.dense for d in deltas for f in (*d.keys, *d.values)):
        kv.low_rank = LowRankDelta(rows=kv.rows, frame=frame, skip_layer0=skip_layer0, factors=layer_factors)
    return kv


@dataclass
class GuardEstimate:
    """The guard's held-out estimate for one anchor set and consumer (:func:`guard_estimate`).

    ``scales`` ``[2, layers]`` (keys, values): the factor in ``[0, 1]`` the correction of each layer is
    served at. ``errors`` ``[3, 2, layers]``: the held-out squared error summed over the anchors with
    the correction at scale 1 (as the authors apply it), at ``scales`` and at 0 (uncorrected), so
    ``errors[1] <= errors[2]`` everywhere: never worse than no correction in this space."""

    scales: torch.Tensor
    errors: torch.Tensor


def _base_segment(anchor: Anchor, rows: int) -> SegmentKV:
    """An anchor's base (rows ``:rows``) as a segment at positions ``0 ..`` (its keys are canonical)."""
    base, heads = anchor.base, anchor.base.kv_heads
    keys = [to_heads(f.reconstruct(rows).float(), heads) for f in base.keys]
    values = [to_heads(f.reconstruct(rows).float(), heads) for f in base.values]
    return SegmentKV(keys=keys, values=values, start=0, agent=anchor.source)


def guard_estimate(
    anchors: list[Anchor],
    target: str,
    rows: int,
    shifter: RopeShifter,
    temperature: float = 1.0,
    shard: Shard | None = None,
) -> GuardEstimate:
    """Ours, beyond the paper: how far the correction of ``target`` from these anchors can be trusted,
    estimated by leaving each anchor out. Anchor ``a``'s base plays the new source; its delta is
    predicted from the others exactly as a source's is (token weights of :func:`token_distances`,
    keys compared canonically, then :func:`weighted_sum` of their deltas), and compared with the
    delta ``a`` observed. Per layer and for keys and values apart, the served scale is the least-
    squares factor of the predictions, clamped to ``[0, 1]``::

        scale = clamp(sum_a <delta_a, pred_a> / sum_a ||pred_a||^2, 0, 1)

    Scale 0 (uncorrected) is among those the fit chooses from, so the held-out error at the served
    scale is never above the uncorrected one. Fewer than two anchors leave nothing to hold out: every
    scale is 0. Under ``shard`` (this rank's heads) the sums are every rank's (one all-reduce); on a
    pipeline stage the scales and errors are every layer's (the model's layer indices)."""
    missing = [a.serial for a in anchors if target not in a.deltas]
    if missing:
        raise ValueError(f"anchors {missing} hold no correction for {target!r}")
    short = [a.serial for a in anchors if a.length < rows or a.deltas[target].length < rows]
    if rows < 1 or short:
        raise ValueError(f"cannot estimate {rows} rows with anchors {short or [a.serial for a in anchors]}")
    layers = anchors[0].base.num_layers
    device = anchors[0].base.values[0].a.device
    if len(anchors) < 2:  # a constant, on the host: nothing to read back (a follower's anchors are meta)
        zero = torch.zeros(2, layer_count(layers, shard), dtype=torch.float64)  # every stage's layers
        return GuardEstimate(scales=zero, errors=torch.stack((zero, zero, zero)))
    cross = torch.zeros(2, layers, dtype=torch.float64, device=device)  # <delta, pred>
    power = torch.zeros(2, layers, dtype=torch.float64, device=device)  # ||pred||^2
    energy = torch.zeros(2, layers, dtype=torch.float64, device=device)  # ||delta||^2
    for i, held in enumerate(anchors):
        others = anchors[:i] + anchors[i + 1 :]
        kd, vd = token_distances(_base_segment(held, rows), others, shifter, rows, shard=shard)
        weights = (token_weights(kd, temperature), token_weights(vd, temperature))
        for layer in range(layers):
            for side, pick in enumerate(("keys", "values")):
                truth = getattr(held.deltas[target], pick)[layer].reconstruct(rows).float()
                pred = weighted_sum(
                    [getattr(a.deltas[target], pick)[layer] for a in others], weights[side], rows
                )
                truth, pred = truth.double(), pred.double().to(truth.device)
                cross[side, layer] += (truth * pred).sum().to(device)
                power[side, layer] += pred.pow(2).sum().to(device)
                energy[side, layer] += truth.pow(2).sum().to(device)
    # per layer: on a pipeline stage every stage's layers in place ([3, 2, every layer])
    cross, power, energy = column_sum(torch.stack((cross, power, energy)), shard, layer_axis=-1)
    scales = torch.where(power > 0, cross / power.clamp_min(1e-300), torch.zeros_like(power)).clamp(0, 1)

    def error(scale: torch.Tensor) -> torch.Tensor:  # sum_a ||delta_a - scale pred_a||^2
        return energy - 2 * scale * cross + scale.pow(2) * power

    errors = torch.stack((error(torch.ones_like(scales)), error(scales), energy))
    return GuardEstimate(scales=scales, errors=errors)


def shrink(corrected: SegmentKV, placed: SegmentKV, scales: list[list[float]]) -> SegmentKV:
    """``placed + scale (corrected - placed)`` per layer, keys with ``scales[0]`` and values with
    ``scales[1]`` (``placed``: the uncorrected source re-positioned where ``corrected`` lands)."""
    if placed.start != corrected.start or placed.length != corrected.length:
        raise ValueError(
            f"shrink needs the uncorrected segment where the corrected one lands "
            f"({placed.start}+{placed.length} vs {corrected.start}+{corrected.length})"
        )
    if [len(s) for s in scales] != [corrected.num_layers] * 2:
        raise ValueError(f"expected key and value scales for {corrected.num_layers} layers")

    def blend(c: torch.Tensor, p: torch.Tensor, scale: float) -> torch.Tensor:
        if scale == 1:
            return c
        if scale == 0:
            return p[:1]
        return p[:1] + (c - p[:1]) * scale

    keys = [blend(c, p, s) for c, p, s in zip(corrected.keys, placed.keys, scales[0])]
    values = [blend(c, p, s) for c, p, s in zip(corrected.values, placed.values, scales[1])]
    return SegmentKV(keys=keys, values=values, start=corrected.start, agent=corrected.agent)


def _checked_deltas(
    anchors: Sequence[Anchor], target: str, key_weights: torch.Tensor, value_weights: torch.Tensor, dim: str
) -> list:
    """Each anchor's delta for ``target``, after checking the ``[n, dim]`` key / value weights fit the
    anchors and every anchor holds one (:func:`apply_correction`, :func:`apply_piecewise`)."""
    if value_weights.shape != key_weights.shape or key_weights.shape[0] != len(anchors):
        raise ValueError(
            f"expected [n={len(anchors)}, {dim}] key and value weights, got {tuple(key_weights.shape)} "
            f"and {tuple(value_weights.shape)}"
        )
    missing = [a.serial for a in anchors if target not in a.deltas]
    if missing:
        raise ValueError(f"anchors {missing} hold no correction for {target!r}")
    return [a.deltas[target] for a in anchors]


def _one_frame(anchors: Sequence[Anchor]) -> str:
    """The delta frame the anchors share (a mix cannot be summed)."""
    frames = {a.frame for a in anchors}
    if len(frames) > 1:
        raise ValueError(f"anchors {[a.serial for a in anchors]} mix delta frames {sorted(frames)}")
    return frames.pop()

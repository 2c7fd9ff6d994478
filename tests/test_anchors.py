"""Anchor storage, gate, eviction and correction math (no model forward passes)."""

from __future__ import annotations

import math

import pytest
import torch
from anchor_helpers import HEAD_DIM, HEADS, LAYERS, make_anchor, random_kv
from tiny import tiny_model

from hf_kvshare import RopeShifter, SegmentKV
from hf_kvshare.anchors import (
    Anchor,
    AnchorPool,
    FactoredKV,
    MatrixFactors,
    RelationProfile,
    apply_correction,
    apply_piecewise,
    canonical_keys,
    comparison_prefix,
    context_free_reference,
    covering,
    effective_rank,
    gate_distances,
    gate_weights,
    match,
    normalized_entropy,
    prefix_correction,
    prefix_weights,
    reference_prefill,
    reliability_gate,
    to_heads,
    to_matrix,
    token_distances,
    usage_crossing,
    usage_reference,
    windows,
)
from hf_kvshare.cache import SegmentedCache
from hf_kvshare.prefill import prefill_dense


@pytest.fixture(scope="module")
def shifter():
    return RopeShifter.from_model(tiny_model("llama"))


def anchor_from(base: SegmentKV, shifter, deltas: dict[str, SegmentKV], rank=None, source="src", origin=None):
    factored = FactoredKV.from_kv(canonical_keys(base, shifter), base.values, rank)
    anchor = Anchor(base=factored, source=source, origin=origin if origin is not None else id(base))
    for target, d in deltas.items():
        anchor.deltas[target] = FactoredKV.from_kv(d.keys, d.values, rank)
    return anchor


# ------------------------------------------------------------------ low rank
def test_matrix_layout_roundtrip():
    kv = torch.randn(1, HEADS, 7, HEAD_DIM)
    m = to_matrix(kv)
    assert m.shape == (7, HEADS * HEAD_DIM)
    assert torch.equal(m[3, HEAD_DIM : 2 * HEAD_DIM], kv[0, 1, 3])  # head 1 of token 3
    assert torch.equal(to_heads(m, HEADS), kv)


@pytest.mark.parametrize("shape", [(40, 32), (12, 32)])
def test_full_rank_reconstructs_a_delta_exactly(shape):
    delta = torch.randn(*shape)
    full = MatrixFactors.from_matrix(delta, rank=min(shape))
    assert full.rank == min(shape)
    assert torch.allclose(full.reconstruct(), delta, atol=1e-5)
    # asking for more than min(L, D) keeps min(L, D) components: still exact, no more storage
    over = MatrixFactors.from_matrix(delta, rank=500)
    assert over.rank == min(shape) and over.nbytes == full.nbytes
    assert torch.allclose(over.reconstruct(rows=5), delta[:5], atol=1e-5)


def test_truncation_keeps_the_top_singular_directions():
    u, _ = torch.linalg.qr(torch.randn(50, 50))
    v, _ = torch.linalg.qr(torch.randn(32, 32))
    s = torch.tensor([10.0, 5.0, 1.0] + [1e-3] * 29)
    m = u[:, :32] @ torch.diag(s) @ v.T
    f = MatrixFactors.from_matrix(m, rank=2)
    assert f.a.shape == (50, 2) and f.b.shape == (2, 32)
    err = (f.reconstruct() - m).norm() / m.norm()
    assert abs(err.item() - math.sqrt((1 + 29e-6) / (100 + 25 + 1 + 29e-6))) < 1e-4
    assert effective_rank(m, 0.9) == 2 and effective_rank(m, 0.999) == 3
    assert effective_rank(torch.zeros(4, 4)) == 0


def test_byte_accounting_is_exact():
    m = torch.randn(100, 32)
    assert MatrixFactors.from_matrix(m, None).nbytes == 100 * 32 * 4
    assert MatrixFactors.from_matrix(m, 8).nbytes == (100 * 8 + 8 * 32) * 4
    # factors only where they are smaller: 16 * (20 + 32) >= 20 * 32, so a short segment stays dense
    short = MatrixFactors.from_matrix(torch.randn(20, 32), 16)
    assert short.dense and short.nbytes == 20 * 32 * 4
    assert not MatrixFactors.from_matrix(torch.randn(60, 32), 16).dense
    half = MatrixFactors.from_matrix(m.half(), 8)
    assert half.a.dtype == torch.float16 and half.nbytes == (100 * 8 + 8 * 32) * 2
    kv = random_kv(100)
    assert FactoredKV.from_kv(kv.keys, kv.values, 8).nbytes == LAYERS * 2 * (100 * 8 + 8 * 32) * 4
    assert FactoredKV.from_kv(kv.keys, kv.values, None).nbytes == kv.nbytes


def test_bad_rank_refused():
    with pytest.raises(ValueError, match="rank must be >= 1"):
        MatrixFactors.from_matrix(torch.randn(4, 4), rank=0)
    with pytest.raises(ValueError, match=r"\[L, D\] matrix"):
        MatrixFactors.from_matrix(torch.randn(4), rank=2)


# ---------------------------------------------------------------------- gate
def test_gate_weights_and_entropy_on_hand_built_distances():
    w = gate_weights(torch.tensor([0.0, math.log(3.0)]))
    assert torch.allclose(w, torch.tensor([0.75, 0.25], dtype=torch.float64))
    expected = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))  # / log2(2) = 1
    assert normalized_entropy(w) == pytest.approx(expected)
    assert reliability_gate(torch.tensor([0.0, math.log(3.0)]), tau=0.9).accepted
    rejected = reliability_gate(torch.tensor([0.0, math.log(3.0)]), tau=0.8)
    assert not rejected.accepted and "entropy" in rejected.reason
    # equal distances: uniform weights, entropy exactly 1 whatever the count
    for n in (2, 3, 7):
        d = reliability_gate(torch.full((n,), 4.2), tau=1.0)
        assert d.entropy == pytest.approx(1.0) and d.accepted
        assert d.weights == pytest.approx([1 / n] * n)
    # three anchors, temperature: d / T
    w3 = gate_weights(torch.tensor([1.0, 2.0, 3.0]), temperature=0.5)
    z = torch.tensor([-2.0, -4.0, -6.0], dtype=torch.float64).exp()
    assert torch.allclose(w3, z / z.sum())
    assert normalized_entropy(w3) == pytest.approx(-(w3 * w3.log2()).sum().item() / math.log2(3))
    # far apart: peaked, accepted
    assert reliability_gate(torch.tensor([0.0, 30.0, 40.0]), tau=0.3).entropy < 1e-9


def test_gate_needs_two_anchors_and_tau_zero_accepts_nothing():
    assert not reliability_gate(torch.tensor([1.0]), tau=1.0).accepted
    assert "fewer than 2" in reliability_gate(torch.tensor([]), tau=1.0).reason
    far = reliability_gate(torch.tensor([0.0, 1e4]), tau=0.0)  # weights round to (1, 0)
    assert far.entropy == 0.0 and not far.accepted
    with pytest.raises(ValueError, match="temperature"):
        gate_weights(torch.tensor([1.0, 2.0]), temperature=0)


# ------------------------------------------------------------------ eviction
def test_eviction_picks_lfu_among_the_five_oldest():
    pool = AnchorPool("query", capacity=7)
    for i, uses in enumerate([5, 3, 4, 1, 2, 0, 0]):
        pool.insert(make_anchor(i))
        pool.anchors[-1].uses = uses
    # the two newest are never used, but only the 5 oldest are candidates: origin 3 (1 use) goes
    assert pool.eviction_candidate().origin == 3
    evicted = pool.insert(make_anchor(7))
    assert evicted.origin == 3 and [a.origin for a in pool] == [0, 1, 2, 4, 5, 6, 7]
    # ties go to the oldest
    for a in pool:
        a.uses = 1
    assert pool.insert(make_anchor(8)).origin == 0


def test_capacity_is_never_exceeded_and_bytes_add_up():
    pool = AnchorPool("query", capacity=4, eviction_window=5)
    for i in range(30):
        pool.insert(make_anchor(i, length=3 + i % 5))
        pool.anchors[i % len(pool)].uses += i % 3
        assert len(pool) <= 4
    assert pool.evicted == 26
    assert pool.nbytes == sum(a.base.nbytes for a in pool)
    with pytest.raises(ValueError, match="already holds"):
        pool.insert(make_anchor(pool.anchors[0].origin))
    with pytest.raises(ValueError, match="capacity"):
        AnchorPool("q", capacity=0)


def test_compatible_needs_matching_source_and_target_delta(shifter):
    base = random_kv(5)
    pool = AnchorPool("query", capacity=10)
    pool.insert(anchor_from(base, shifter, {"coder": random_kv(5, seed=1)}, source="planner", origin=1))
    pool.insert(anchor_from(base, shifter, {"coder": random_kv(5, seed=2)}, source="designer", origin=2))
    pool.insert(anchor_from(base, shifter, {"final": random_kv(5, seed=3)}, source="planner", origin=3))
    assert [a.origin for a in pool.compatible("planner", "coder")] == [1]
    assert pool.compatible("planner", "critic") == []


# ---------------------------------------------------------------- correction
def test_comparison_prefix_rule():
    anchors = [make_anchor(i, length=n) for i, n in enumerate([10, 6, 4])]
    assert comparison_prefix(anchors, 8) == 6  # two anchors cover 6 tokens
    assert comparison_prefix(anchors, 5) == 5  # two anchors cover all 5
    assert comparison_prefix(anchors[:1], 5) == 0


def test_variable_length_corrects_the_covered_prefix_and_keeps_the_source_after(shifter):
    """S = 8 with anchors of 10, 6 and 4 tokens: rows :6 corrected, rows 6: the re-positioned source."""
    source = random_kv(8, start=11, seed=5)
    ones = SegmentKV(
        keys=[torch.ones(1, HEADS, 10, HEAD_DIM) for _ in range(LAYERS)],
        values=[torch.full((1, HEADS, 10, HEAD_DIM), 2.0) for _ in range(LAYERS)],
        start=0,
    )
    anchors = []
    for i, n in enumerate([10, 6, 4]):
        deltas = {"coder": ones.prefix(n)}
        anchors.append(anchor_from(random_kv(n, seed=20 + i), shifter, deltas, rank=None, origin=i))
    k = comparison_prefix(anchors, source.length)
    eligible = [a for a in anchors if a.length >= k]
    assert k == 6 and len(eligible) == 2
    found = match(source, eligible, shifter, k)
    assert found.gate_distances.shape == (2,) and found.key_distances.shape == (2, 6)
    w = torch.full((2, k), 0.5)
    out = apply_correction(source, eligible, "coder", w, w, 30, shifter)
    aligned = source.repositioned(shifter, 30)
    delta_k = shifter.reposition(torch.ones(1, HEADS, k, HEAD_DIM), 0, 30)
    for layer in range(LAYERS):
        assert torch.allclose(out.values[layer][:, :, :6], aligned.values[layer][:, :, :6] + 2.0, atol=1e-5)
        assert torch.equal(out.values[layer][:, :, 6:], aligned.values[layer][:, :, 6:])
        assert torch.allclose(out.keys[layer][:, :, :6], aligned.keys[layer][:, :, :6] + delta_k, atol=1e-5)
        assert torch.allclose(out.keys[layer][:, :, 6:], aligned.keys[layer][:, :, 6:], atol=1e-6)
    assert out.start == 30 and out.length == 8


def test_windows_correct_each_row_with_every_anchor_covering_it():
    anchors = [
        Anchor(base=FactoredKV.from_kv(*_kv_lists(n), None), source="src", origin=i)
        for i, n in enumerate([6, 4, 6])
    ]
    pieces = windows(anchors, 8)  # longer than every anchor: rows 6: in no window
    assert [(first, last, [a.origin for a in chosen]) for first, last, chosen in pieces] == [
        (0, 4, [0, 1, 2]),
        (4, 6, [0, 2]),
    ]
    assert [(f, la) for f, la, _ in windows(anchors, 5)] == [(0, 4), (4, 5)]  # the span's end closes one


def _kv_lists(n: int):
    kv = random_kv(n, seed=n)
    return kv.keys, kv.values


@pytest.mark.parametrize("rank", [None, 2])
@pytest.mark.parametrize("frame", ["canonical", "writer"])
def test_a_piecewise_correction_is_each_windows_correction(shifter, rank, frame):
    """A span of 8 with anchors of 6, 4 and 6 tokens (constructed deltas): rows :4 get the correction of
    all three anchors, rows 4:6 that of the two 6-token ones (their own weights), rows 6: the
    re-positioned source; each window equals :func:`apply_correction` of its anchors, and the sum by hand."""
    source = random_kv(8, start=11, seed=5)
    deltas = [random_kv(n, seed=40 + i, scale=0.1) for i, n in enumerate([6, 4, 6])]
    anchors = [
        anchor_from(random_kv(d.length, seed=20 + i), shifter, {"coder": d}, rank=rank, origin=i)
        for i, d in enumerate(deltas)
    ]
    for a in anchors:
        a.frame = frame
    g = torch.Generator().manual_seed(3)
    first_k, first_v = (torch.softmax(torch.randn(3, 4, generator=g), 0) for _ in range(2))
    second_k, second_v = (torch.softmax(torch.randn(2, 6, generator=g), 0) for _ in range(2))
    wk, wv = torch.zeros(3, 6), torch.zeros(3, 6)
    wk[:, :4], wv[:, :4] = first_k, first_v
    wk[[0, 2], 4:6], wv[[0, 2], 4:6] = second_k[:, 4:6], second_v[:, 4:6]
    target = 30
    out = apply_piecewise(source, anchors, "coder", wk, wv, target, shifter)
    first = apply_correction(source, anchors, "coder", first_k, first_v, target, shifter)
    second = apply_correction(source, [anchors[0], anchors[2]], "coder", second_k, second_v, target, shifter)
    aligned = source.repositioned(shifter, target)
    for layer in range(LAYERS):
        for pick in ("keys", "values"):
            got = getattr(out, pick)[layer]
            assert torch.allclose(got[:, :, :4], getattr(first, pick)[layer][:, :, :4], atol=1e-5), pick
            assert torch.allclose(got[:, :, 4:6], getattr(second, pick)[layer][:, :, 4:6], atol=1e-5), pick
            assert torch.equal(got[:, :, 6:], getattr(aligned, pick)[layer][:, :, 6:]), pick
        # the values by hand: Align(source) + sum_v w_v[t] delta_v[t] over the window's anchors
        stored = [a.deltas["coder"].values[layer].reconstruct() for a in anchors]
        by_hand = torch.zeros(6, HEADS * HEAD_DIM)
        by_hand[:4] = sum(first_v[i, :, None] * stored[i][:4] for i in range(3))
        by_hand[4:6] = sum(second_v[j, 4:6, None] * stored[i][4:6] for j, i in enumerate([0, 2]))
        expected = aligned.values[layer][:, :, :6] + to_heads(by_hand, HEADS)
        assert torch.allclose(out.values[layer][:, :, :6], expected, atol=1e-5)
    assert out.start == target and out.length == 8


def test_match_distances_and_token_weights_follow_the_definitions(shifter):
    source = random_kv(6, start=4, seed=1)
    near = anchor_from(random_kv(6, start=9, seed=1), shifter, {}, origin=0)  # same content, elsewhere
    far = anchor_from(random_kv(6, seed=2), shifter, {}, origin=1)
    found = match(source, [near, far], shifter, 6)
    assert found.gate_distances[0] < 1e-4  # keys compared in the canonical frame, values unrotated
    other = random_kv(6, seed=2)
    expected = math.sqrt(sum((source.values[i] - other.values[i]).pow(2).sum().item() for i in range(LAYERS)))
    assert found.gate_distances[1].item() == pytest.approx(expected, rel=1e-5)
    mean_abs = sum((source.values[i] - other.values[i]).abs()[0].sum((0, 2)) for i in range(LAYERS))
    assert torch.allclose(found.value_distances[1].float(), mean_abs / (LAYERS * HEADS * HEAD_DIM), atol=1e-5)


def test_full_rank_anchor_of_the_same_content_corrects_exactly(shifter):
    """An anchor built from this exact source and the exact target gives back the target."""
    source = random_kv(9, start=3, seed=7)
    target = random_kv(9, start=20, seed=8)
    canonical_target = canonical_keys(target, shifter)
    canonical_source = canonical_keys(source, shifter)
    delta = SegmentKV(
        keys=[t - s for t, s in zip(canonical_target, canonical_source)],
        values=[t - s for t, s in zip(target.values, source.values)],
        start=0,
    )
    anchors = [
        anchor_from(source, shifter, {"coder": delta}, rank=HEADS * HEAD_DIM, origin=i) for i in range(2)
    ]
    w = torch.rand(2, 9)
    w = w / w.sum(0)  # any convex combination of identical deltas is the delta
    out = apply_correction(source, anchors, "coder", w, w, 20, shifter)
    for layer in range(LAYERS):
        assert torch.allclose(out.keys[layer], target.keys[layer], atol=1e-4)
        assert torch.allclose(out.values[layer], target.values[layer], atol=1e-4)


def test_correction_refuses_missing_deltas(shifter):
    source = random_kv(4)
    anchors = [
        anchor_from(random_kv(4, seed=i), shifter, {"coder": random_kv(4)}, origin=i) for i in range(2)
    ]
    w = torch.full((2, 4), 0.5)
    with pytest.raises(ValueError, match="no correction for 'final'"):
        apply_correction(source, anchors, "final", w, w, 0, shifter)
    with pytest.raises(ValueError, match="comparison prefix"):
        match(source, [make_anchor(9, length=2)], shifter, 4)


def test_relation_profile_averages_then_freezes():
    profile = RelationProfile("query", "coder", calibration_requests=2, rank=None)
    a, b = random_kv(4, seed=1), random_kv(6, seed=2)
    assert profile.observe(0, a.keys, a.values) and not profile.ready
    assert not profile.observe(0, b.keys, b.values)  # same request counted once
    with pytest.raises(ValueError, match="calibrating"):
        profile.layer_delta(0, 4)
    assert profile.observe(1, b.keys, b.values) and profile.ready
    k, v = profile.layer_delta(1, 6)
    assert torch.allclose(v[:4], (to_matrix(a.values[1]) + to_matrix(b.values[1])[:4]) / 2, atol=1e-6)
    assert torch.allclose(v[4:], to_matrix(b.values[1])[4:], atol=1e-6)  # only b covers rows 4, 5
    assert profile.nbytes == LAYERS * 2 * 6 * HEADS * HEAD_DIM * 4
    assert not profile.observe(2, a.keys, a.values)  # frozen


# ------------------------------------------------------- reference-code semantics
def test_factor_space_gate_distances_equal_full_dimension_ones():
    """||V - AB||^2 = ||V||^2 - 2<VB^T, A> + tr(A^T A B B^T): exact up to fp64 rounding, for
    low-rank (exact and randomized SVD) and dense anchors, over the full length or a prefix."""
    g = torch.Generator().manual_seed(3)

    def kv64(length):
        return [
            torch.randn(1, HEADS, length, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(LAYERS)
        ]

    values = kv64(12)
    anchors = []
    for i, (length, rank, svd) in enumerate([(12, 4, "exact"), (15, 6, "randomized"), (12, None, "exact")]):
        base = FactoredKV.from_kv(kv64(length), kv64(length), rank, svd)
        anchors.append(Anchor(base=base, source="src", origin=i))
    for rows in (12, 7):
        got = gate_distances(values, anchors, rows)
        expected = [
            math.sqrt(
                sum(
                    (to_matrix(values[layer][:, :, :rows]) - a.base.values[layer].reconstruct(rows))
                    .pow(2)
                    .sum()
                    .item()
                    for layer in range(LAYERS)
                )
            )
            for a in anchors
        ]
        assert got.dtype == torch.float64
        assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="shorter than the 13 rows"):
        gate_distances(values, anchors, 13)


def test_token_distances_match_the_joint_pass(shifter):
    source = random_kv(6, start=4, seed=1)
    anchors = [
        anchor_from(random_kv(n, seed=10 + n), shifter, {}, rank=r, origin=n) for n, r in ((6, 3), (8, 3))
    ]
    found = match(source, anchors, shifter, 6)
    kd, vd = token_distances(source, anchors, shifter, 6)
    assert torch.allclose(kd, found.key_distances, atol=1e-6) and torch.allclose(
        vd, found.value_distances, atol=1e-6
    )


def test_randomized_svd_is_seeded_and_leaves_the_global_rng_alone():
    m = torch.randn(40, 32)
    state = torch.random.get_rng_state()
    a = MatrixFactors.from_matrix(m, rank=4, svd="randomized")
    assert torch.equal(torch.random.get_rng_state(), state)
    b = MatrixFactors.from_matrix(m, rank=4, svd="randomized")
    assert torch.equal(a.a, b.a) and torch.equal(a.b, b.b) and a.rank == 4
    assert torch.allclose(a.b @ a.b.T, torch.eye(4), atol=1e-5)  # orthonormal rows, like the exact SVD
    exact = MatrixFactors.from_matrix(m, rank=4)
    err = (a.reconstruct() - m).norm() / (exact.reconstruct() - m).norm()
    assert 1.0 - 1e-4 <= err < 1.2  # close to the optimal rank-4 error
    with pytest.raises(ValueError, match="svd must be one of"):
        MatrixFactors.from_matrix(m, rank=4, svd="fast")


def test_covering_rule_full_then_longest():
    anchors = [make_anchor(i, length=n) for i, n in enumerate([5, 9, 12, 5])]
    chosen, rows = covering(anchors, 9)
    assert [a.length for a in chosen] == [9, 12] and rows == 9
    chosen, rows = covering(anchors[::3], 9)  # none covers 9: the longest correct their 5 rows
    assert [a.length for a in chosen] == [5, 5] and rows == 5
    assert covering(anchors[::3], 9, partial=False) == ([], 0)
    assert covering([], 9) == ([], 0)


def test_layer0_is_left_uncorrected(shifter):
    source = random_kv(5, start=2, seed=4)
    delta = random_kv(5, seed=6)
    anchors = [anchor_from(random_kv(5, seed=i), shifter, {"coder": delta}, origin=i) for i in range(2)]
    w = torch.full((2, 5), 0.5)
    skipped = apply_correction(source, anchors, "coder", w, w, 9, shifter, skip_layer0=True)
    full = apply_correction(source, anchors, "coder", w, w, 9, shifter)
    aligned = source.repositioned(shifter, 9)
    assert torch.equal(skipped.values[0], aligned.values[0])
    assert torch.allclose(skipped.keys[0], aligned.keys[0], atol=1e-6)
    assert not torch.allclose(full.values[0], aligned.values[0])
    for layer in range(1, LAYERS):
        assert torch.equal(skipped.values[layer], full.values[layer])


def test_usage_counter_reference_rule():
    assert sorted(usage_reference([0.5, 0.3, 0.2])) == [0, 1]  # the anchor crossing 0.9 is not counted
    assert sorted(usage_reference([0.95, 0.05])) == [0, 1]  # top weight >= 0.9: every anchor
    assert sorted(usage_crossing([0.5, 0.3, 0.2])) == [0, 1, 2]  # the per-edge rule counts it


def test_pool_peak_reference_holds_one_more():
    pool = AnchorPool("q", capacity=2, peak=3)
    for i in range(4):
        pool.insert(make_anchor(i))
    assert len(pool) == 3 and pool.evicted == 1
    with pytest.raises(ValueError, match="peak must be >= capacity"):
        AnchorPool("q", capacity=3, peak=2)


def test_reference_prefill_keeps_and_drops_the_lead():
    model = tiny_model("llama")
    lead = torch.tensor([1, 17, 23, 5])
    ids = torch.tensor([40, 41, 42, 43, 44, 45])
    ref = reference_prefill(model, lead, ids)
    assert ref.length == ids.numel() and ref.start == lead.numel() and ref.agent == "reference"
    full = SegmentedCache(model.config)
    prefill_dense(full, model, torch.cat([lead, ids])[None])
    whole = full.extract(lead.numel(), lead.numel() + ids.numel())
    for layer in range(ref.num_layers):
        assert torch.equal(ref.keys[layer], whole.keys[layer]) and torch.equal(
            ref.values[layer], whole.values[layer]
        )
    alone = context_free_reference(model, ids)  # no lead: the first token is an attention sink
    assert alone.start == 0
    assert not torch.allclose(ref.values[1][:, :, 0], alone.values[1][:, :, 0], atol=1e-4)
    empty = reference_prefill(model, torch.zeros(0, dtype=torch.long), ids)
    assert empty.start == 0 and torch.equal(empty.values[1], alone.values[1])


# ------------------------------------------------------------------ frames (issue 11)
def writer_anchor(base: SegmentKV, shifter, delta: SegmentKV, base_start: int, origin) -> Anchor:
    anchor = anchor_from(base, shifter, {"coder": delta}, origin=origin)
    anchor.frame, anchor.base_start = "writer", base_start
    return anchor


def test_writer_frame_deltas_are_added_unrotated_and_canonical_ones_rotated(shifter):
    """The authors' code adds a delta where its writer observed it (no rotation); the canonical frame
    rotates it to where the segment lands. Values never rotate."""
    source = random_kv(6, start=3, seed=1)
    delta = random_kv(6, seed=2, scale=0.1)
    w = torch.full((2, 6), 0.5)
    target = 17
    aligned = source.repositioned(shifter, target)
    for frame in ("writer", "canonical"):
        anchors = [writer_anchor(random_kv(6, seed=3 + i), shifter, delta, 40, origin=i) for i in range(2)]
        for a in anchors:
            a.frame = frame
        out = apply_correction(source, anchors, "coder", w, w, target, shifter)
        for layer in range(LAYERS):
            expected = (
                delta.keys[layer] if frame == "writer" else shifter.reposition(delta.keys[layer], 0, target)
            )
            assert torch.allclose(out.keys[layer], aligned.keys[layer] + expected, atol=1e-5), frame
            assert torch.allclose(out.values[layer], aligned.values[layer] + delta.values[layer], atol=1e-6)
    anchors[0].frame = "writer"
    with pytest.raises(ValueError, match="mix delta frames"):
        apply_correction(source, anchors, "coder", w, w, target, shifter)


def test_reader_frame_token_distances_compare_where_each_side_was_placed(shifter):
    """KVComm's reference compares the source placed at the reader's position with each anchor's base
    placed where its last consumer put it; the canonical frame moves both to 0."""
    source = random_kv(5, start=2, seed=1)
    bases = [random_kv(7, seed=5), random_kv(5, seed=6)]
    anchors = [writer_anchor(b, shifter, b, base_start=9 + 4 * i, origin=i) for i, b in enumerate(bases)]
    reader = 21
    kd, vd = token_distances(source, anchors, shifter, 5, reader_start=reader)
    placed = source.repositioned(shifter, reader)
    for i, (a, b) in enumerate(zip(anchors, bases)):
        moved = b.prefix(5).repositioned(shifter, a.base_start)
        want_k = sum((placed.keys[layer] - moved.keys[layer]).abs()[0].sum((0, 2)) for layer in range(LAYERS))
        want_v = sum(
            (source.values[layer] - b.values[layer][:, :, :5]).abs()[0].sum((0, 2)) for layer in range(LAYERS)
        )
        assert torch.allclose(kd[i].float(), want_k / (LAYERS * HEADS * HEAD_DIM), atol=1e-5)
        assert torch.allclose(vd[i].float(), want_v / (LAYERS * HEADS * HEAD_DIM), atol=1e-5)
    canonical, _ = token_distances(source, anchors, shifter, 5)
    assert not torch.allclose(canonical, kd)  # the frames differ when the positions do


def test_prefix_weights_and_correction_follow_the_reference(shifter):
    """Weights per (layer, feature): softmax over anchors of -L2 over the segment's tokens between the
    source and each anchor's last S base rows; the PF correction adds sum_a w * delta_a, layer 0 kept."""
    source = random_kv(4, start=0, seed=1)
    bases = [random_kv(6, seed=7), random_kv(4, seed=8)]
    anchors = [writer_anchor(b, shifter, b, base_start=0, origin=i) for i, b in enumerate(bases)]
    wk, wv = prefix_weights(source, anchors, shifter, reader_start=0)
    assert wk.shape == wv.shape == (2, LAYERS, HEADS * HEAD_DIM)
    assert torch.allclose(wk.sum(0), torch.ones(LAYERS, HEADS * HEAD_DIM))
    for layer in range(LAYERS):
        dist = torch.stack(
            [
                (to_matrix(source.values[layer]) - to_matrix(b.values[layer])[b.length - 4 :]).norm(dim=0)
                for b in bases
            ]
        )
        assert torch.allclose(wv[:, layer], torch.softmax(-dist, dim=0), atol=1e-5)
    pf = random_kv(3, start=11, seed=9)
    deltas = [
        FactoredKV.from_kv(d.keys, d.values, None) for d in (random_kv(3, seed=10), random_kv(3, seed=11))
    ]
    out = prefix_correction(pf, deltas, wk, wv, "writer", shifter)
    for layer in range(LAYERS):
        if layer == 0:
            assert torch.equal(out.keys[0], pf.keys[0]) and torch.equal(out.values[0], pf.values[0])
            continue
        want = sum(w[layer] * d.values[layer].reconstruct() for w, d in zip(wv, deltas))
        assert torch.allclose(to_matrix(out.values[layer]), to_matrix(pf.values[layer]) + want, atol=1e-5)
    with pytest.raises(ValueError, match="prefix deltas of"):
        prefix_correction(random_kv(5, start=11), deltas, wk, wv, "writer", shifter)


@pytest.mark.parametrize("frame", ["canonical", "writer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_corrected_kv_is_its_formula_bit_for_bit(shifter, frame, dtype):
    """``Align(source) + Rot(delta)`` on the first ``rows`` rows, layer 0 skipped, written with
    :meth:`RopeShifter.apply` and plain tensor arithmetic: the same bits (keys written straight into
    their tensor by ``apply_into`` must not change a value)."""
    from hf_kvshare.anchors.correction import corrected_kv
    from hf_kvshare.anchors.lowrank import to_heads

    base = random_kv(7, start=4, seed=3)
    source = SegmentKV(
        keys=[k.to(dtype) for k in base.keys], values=[v.to(dtype) for v in base.values], start=4
    )
    g = torch.Generator().manual_seed(5)
    deltas = [
        (torch.randn(5, HEADS * HEAD_DIM, generator=g), torch.randn(5, HEADS * HEAD_DIM, generator=g))
        for _ in range(LAYERS)
    ]
    out = corrected_kv(source, 19, shifter, 5, lambda layer: deltas[layer], skip_layer0=True, frame=frame)
    to_target = shifter.rotation(4, 19, 7)
    for layer in range(LAYERS):
        key = shifter.apply(source.keys[layer], to_target).clone()
        value = source.values[layer].clone()
        if layer:
            dk = to_heads(deltas[layer][0], HEADS)
            if frame == "canonical":
                dk = shifter.apply(dk, shifter.rotation(0, 19, 5))
            key[:, :, :5] += dk.to(dtype)
            value[:, :, :5] += to_heads(deltas[layer][1], HEADS).to(dtype)
        assert out.keys[layer].dtype == dtype and torch.equal(out.keys[layer], key)
        assert torch.equal(out.values[layer], value)
    assert out.start == 19
    # the source is left as it was
    assert all(torch.equal(k, b.to(dtype)) for k, b in zip(source.keys, base.keys))

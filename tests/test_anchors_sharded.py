"""The anchors engine's per-rank primitives (``anchors/sharded.py``) against the one-process engine.

One group of 3 gloo ranks on CPU is started once for the module (forkserver: the package imported once);
every case runs on a sub-group of 1, 2 or 3 of them, and each rank saves what it computed. The tests
compare the ranks' results with ``MatrixFactors.from_matrix`` / ``gate_distances`` / ``weighted_sum`` on
the same seeded data: float32 and float64, both SVD modes, tall and wide matrices (``svd_lowrank``
factors the transpose when ``L < D``), 4 heads over 2 ranks, 6 over 3, a head replicated on 2 ranks,
the dense fallback and the rank clamp on the global ``D``, and every rank's distances bit for bit equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks, spawns_ranks
from torch._lowrank import get_approximate_basis

from hf_kvshare.anchors import Anchor, FactoredKV, MatrixFactors, gate_distances, reliability_gate, to_heads
from hf_kvshare.anchors.correction import weighted_sum
from hf_kvshare.anchors.lowrank import FACTORIZATIONS
from hf_kvshare.anchors.sharded import (
    COLLECTIVES,
    communication_bytes,
    mirrors_svd_lowrank,
    sharded_factored_kv,
    sharded_factors,
    sharded_gate_distances,
)

WORLD = 3
#: ``(name, L, heads, head_dim, rank, ranks, replicas)``: every factor case runs in both SVD modes and dtypes
SHAPES = [
    ("tall_6_heads", 64, 6, 4, 4, (1, 2, 3), 1),
    ("wide_6_heads", 16, 6, 4, 3, (1, 2, 3), 1),
    ("tall_4_heads", 48, 4, 8, 5, (2,), 1),
    ("wide_4_heads", 12, 4, 8, 4, (2,), 1),
    ("replicated_head", 64, 1, 16, 4, (2,), 2),
    ("replicated_head_wide", 12, 1, 32, 4, (2,), 2),
    # rank 10 > a rank's 8 columns: the clamp uses the global D = 24
    ("rank_over_local_columns", 200, 6, 4, 10, (3,), 1),
    # 6 rows: min(8, 6, 24) = 6 components take no fewer numbers than the matrix: kept dense
    ("dense_fallback", 6, 6, 4, 8, (1, 2, 3), 1),
]
SVDS = ("exact", "randomized")
DTYPES = (torch.float32, torch.float64)
#: gate cases: ``(name, heads, head_dim, ranks, replicas)``; 3 layers, 4 anchors (one dense), 40 rows of 48
GATES = [("gate_6_heads", 6, 4, (1, 2, 3), 1), ("gate_replicated", 1, 8, (2,), 2)]
GATE_LAYERS, GATE_ROWS, GATE_LENGTH, GATE_RANK = 3, 40, 48, 4


def matrix(seed: int, length: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A seeded ``[L, D]`` matrix of decaying spectrum plus noise (not of low rank: the randomized SVD's
    result depends on its random matrix)."""
    g = torch.Generator().manual_seed(seed)
    k = min(length, dim)
    left = torch.randn(length, k, generator=g, dtype=torch.float64)
    right = torch.randn(k, dim, generator=g, dtype=torch.float64)
    scale = torch.logspace(0, -1.5, k, dtype=torch.float64)
    return ((left * scale) @ right).to(dtype)


def heads_of(z: torch.Tensor, ranks: int, replicas: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s columns of ``z`` (consecutive blocks, ``replicas`` ranks a block)."""
    return z[:, head_slice(z.shape[1], ranks, replicas, rank)]


def head_slice(heads: int, ranks: int, replicas: int, rank: int) -> slice:
    """Rank ``rank``'s heads of ``heads`` (or columns of ``heads`` columns): ``kv_head_range``'s rule."""
    per = heads * replicas // ranks
    start = rank // replicas * per
    return slice(start, start + per)


def _factor_cases():
    for seed, (name, length, heads, head_dim, rank, ranks, replicas) in enumerate(SHAPES):
        for svd in SVDS:
            for dtype in DTYPES:
                for size in ranks:
                    case = f"{name}-{svd}-{str(dtype)[6:]}-{size}"
                    yield case, seed, length, heads * head_dim, rank, svd, dtype, size, replicas


def _anchor(values: list[MatrixFactors], serial: int) -> Anchor:
    kv = FactoredKV(keys=values, values=values, length=values[0].rows, kv_heads=1)
    return Anchor(base=kv, source=f"agent{serial}", origin=(serial,), serial=serial)


def _gate_inputs(heads: int, head_dim: int):
    """Per-layer values ``[1, heads, S, head_dim]`` and 4 anchors' per-layer value matrices ``[L, D]``."""
    dim = heads * head_dim
    values = [matrix(100 + layer, GATE_LENGTH, dim, torch.float32) for layer in range(GATE_LAYERS)]
    anchors = [
        [
            values[layer] + 0.1 * (i + 1) * matrix(200 + 10 * i + layer, GATE_LENGTH, dim, torch.float32)
            for layer in range(GATE_LAYERS)
        ]
        for i in range(4)
    ]
    as_heads = [v.reshape(GATE_LENGTH, heads, head_dim).transpose(0, 1).unsqueeze(0) for v in values]
    return as_heads, anchors


SEGMENT_HEADS, SEGMENT_LAYERS = 6, 2


def _segment() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A seeded segment's per-layer keys and values ``[1, 6 heads, 40, 4]``."""

    def layer(seed: int) -> torch.Tensor:
        return (
            matrix(seed, 40, SEGMENT_HEADS * 4, torch.float32)
            .reshape(40, SEGMENT_HEADS, 4)
            .transpose(0, 1)[None]
        )

    return [layer(300 + i) for i in range(SEGMENT_LAYERS)], [layer(400 + i) for i in range(SEGMENT_LAYERS)]


def _rank_main(rank: int) -> dict:
    groups = {size: dist.new_group(list(range(size))) for size in (1, 2)}
    groups[WORLD] = None  # the default group
    results = {}
    for name, seed, length, dim, keep, svd, dtype, size, replicas in _factor_cases():
        if rank < size:
            before, sent = FACTORIZATIONS.snapshot(), COLLECTIVES.snapshot()
            z = heads_of(matrix(seed, length, dim, dtype), size, replicas, rank)
            f = sharded_factors(z, keep, svd, groups[size], replicas=replicas)
            results[name] = (f.a, f.b, FACTORIZATIONS.since(before), COLLECTIVES.since(sent))
    if rank < 2:  # Llama-3.1-8B's shape at TP = 2: one 8K-token layer side, rank 32 (docs/architecture.md)
        z = torch.randn(8192, 512, generator=torch.Generator().manual_seed(rank))
        sent = COLLECTIVES.snapshot()
        sharded_factors(z, 32, "randomized", groups[2])
        results["llama_8k_tp2"] = COLLECTIVES.since(sent)
    for svd in SVDS:
        for size in (1, 2, 3):
            if rank < size:
                keys, values = _segment()
                own = head_slice(SEGMENT_HEADS, size, 1, rank)
                kv = sharded_factored_kv(
                    [k[:, own] for k in keys], [v[:, own] for v in values], 4, svd, groups[size]
                )
                heads = [to_heads(f.reconstruct(), kv.kv_heads) for f in (*kv.keys, *kv.values)]
                results[f"segment-{svd}-{size}"] = (kv.length, kv.kv_heads, heads)
    for name, heads, head_dim, ranks, replicas in GATES:
        for svd in SVDS:
            for size in ranks:
                if rank >= size:
                    continue
                values, anchors = _gate_inputs(heads, head_dim)
                local_values = [v[:, head_slice(heads, size, replicas, rank)] for v in values]
                local_anchors = [
                    _anchor(
                        [
                            MatrixFactors(heads_of(m, size, replicas, rank).clone())
                            if i == 3  # a dense anchor: this rank's columns
                            else sharded_factors(
                                heads_of(m, size, replicas, rank),
                                GATE_RANK,
                                svd,
                                groups[size],
                                replicas=replicas,
                            )
                            for m in layers
                        ],
                        i,
                    )
                    for i, layers in enumerate(anchors)
                ]
                sent = COLLECTIVES.snapshot()
                distances = sharded_gate_distances(
                    local_values, local_anchors, GATE_ROWS, groups[size], replicas=replicas
                )
                weights = torch.linspace(0.1, 0.9, GATE_ROWS * 3).reshape(3, GATE_ROWS)
                corrections = [
                    weighted_sum([a.base.values[layer] for a in local_anchors[:3]], weights, GATE_ROWS)
                    for layer in range(GATE_LAYERS)
                ]
                results[f"{name}-{svd}-{size}"] = (distances, corrections, COLLECTIVES.since(sent))
    return results


@pytest.fixture(scope="module")
@spawns_ranks
def ranks(tmp_path_factory) -> list[dict]:
    """Every rank's results of every case (one group of :data:`WORLD` gloo processes for the module)."""
    return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("sharded"))


def _relative(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / y.double().norm())


@pytest.mark.parametrize("case", list(_factor_cases()), ids=lambda c: c[0])
def test_the_ranks_factors_reconstruct_the_one_rank_factors(ranks, case):
    name, seed, length, dim, keep, svd, dtype, size, replicas = case
    z = matrix(seed, length, dim, dtype)
    one = MatrixFactors.from_matrix(z, keep, svd)
    a = [ranks[r][name][0] for r in range(size)]
    b = [ranks[r][name][1] for r in range(size)]
    if one.dense:  # each rank keeps its columns as they are
        assert all(x is None for x in b)
        assert torch.equal(torch.cat(a[::replicas], dim=1), z)
    else:
        assert all(torch.equal(x, a[0]) for x in a), "a differs between ranks"
        assert a[0].dtype == b[0].dtype == dtype and a[0].shape == one.a.shape
        joined = torch.cat(b[::replicas], dim=1)
        assert joined.shape == one.b.shape
        if svd == "exact" or size == 1:  # the one-rank SVD of the gathered Z / the very same operations
            assert torch.equal(a[0], one.a) and torch.equal(joined, one.b)
        else:  # more ranks sum in another order
            assert _relative(a[0] @ joined, one.reconstruct()) <= 1e-5
    for r in range(size):
        counts, sent = ranks[r][name][2], ranks[r][name][3]
        assert counts == {"matrices": 1, "svds": int(not one.dense)}
        expected = communication_bytes(
            length, dim, size, keep, svd, kv_bytes=z.element_size(), replicas=replicas
        )
        scale = 2 if dtype == torch.float64 and svd == "randomized" else 1  # float64 work: 8 bytes a number
        assert sent["all_reduce_bytes"] == expected["all_reduce"] * scale
        assert sent["all_gather_bytes"] == expected["all_gather"] * scale


def test_a_different_random_matrix_gives_other_factors():
    """The randomized cases above are sensitive to the random matrix: the one-rank factors of another
    draw differ far beyond the 1e-5 the ranks are held to."""
    z = matrix(7, 64, 24, torch.float32)
    one = MatrixFactors.from_matrix(z, 4, "randomized").reconstruct()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        u, s, v = torch.svd_lowrank(z, q=4, niter=2)
    assert _relative((u * s) @ v.T, one) > 1e-3


@pytest.mark.parametrize(
    "case",
    [(n, h, d, s, rep, svd) for n, h, d, ranks_, rep in GATES for svd in SVDS for s in ranks_],
    ids=str,
)
def test_the_ranks_gate_distances_and_corrections_are_the_one_rank_ones(ranks, case):
    name, heads, head_dim, size, replicas, svd = case
    key = f"{name}-{svd}-{size}"
    values, anchors = _gate_inputs(heads, head_dim)
    one = [
        _anchor(
            [
                MatrixFactors(m.clone()) if i == 3 else MatrixFactors.from_matrix(m, GATE_RANK, svd)
                for m in layers
            ],
            i,
        )
        for i, layers in enumerate(anchors)
    ]
    expected = gate_distances(values, one, GATE_ROWS)
    distances = [ranks[r][key][0] for r in range(size)]
    assert all(torch.equal(d, distances[0]) for d in distances), "the ranks' distances differ"
    assert distances[0].dtype == torch.float64
    assert _relative(distances[0], expected) <= (0.0 if size == 1 else 1e-6)
    decisions = [reliability_gate(d, tau=0.9) for d in distances]
    assert all(d == decisions[0] for d in decisions)
    assert decisions[0].accepted == reliability_gate(expected, tau=0.9).accepted
    assert all(
        ranks[r][key][2]
        == {"all_reduces": 1, "all_reduce_bytes": 8 * 4, "all_gathers": 0, "all_gather_bytes": 0}
        for r in range(size)
    )
    # each rank's correction rows are its heads of the one-rank correction
    weights = torch.linspace(0.1, 0.9, GATE_ROWS * 3).reshape(3, GATE_ROWS)
    for layer in range(GATE_LAYERS):
        whole = weighted_sum([a.base.values[layer] for a in one[:3]], weights, GATE_ROWS)
        joined = torch.cat([ranks[r][key][1][layer] for r in range(0, size, replicas)], dim=1)
        assert _relative(joined, whole) <= (0.0 if size == 1 else 1e-5)


@pytest.mark.parametrize("svd", SVDS)
@pytest.mark.parametrize("size", (1, 2, 3))
def test_a_segments_factors_per_rank_are_its_heads_of_the_one_rank_segment(ranks, svd, size):
    """``sharded_factored_kv``: each rank's factors reconstruct its heads of the one-rank segment."""
    keys, values = _segment()
    one = FactoredKV.from_kv(keys, values, 4, svd)
    wholes = [to_heads(f.reconstruct(), SEGMENT_HEADS) for f in (*one.keys, *one.values)]
    parts = [ranks[r][f"segment-{svd}-{size}"] for r in range(size)]
    assert all(length == 40 and heads == SEGMENT_HEADS // size for length, heads, _ in parts)
    for i, whole in enumerate(wholes):
        joined = torch.cat([heads[i] for _, _, heads in parts], dim=1)
        assert _relative(joined, whole) <= (0.0 if size == 1 else 1e-5)  # a @ b_p: products of other widths


def test_the_installed_torch_runs_the_mirrored_svd_lowrank_and_another_is_detected(monkeypatch):
    """``sharded_factors`` refuses the randomized mode on a torch whose ``svd_lowrank`` runs another
    algorithm (older releases factored the transpose of tall matrices too): the probe tells them apart."""
    assert mirrors_svd_lowrank()

    def transposed(a, q, niter):  # older releases (``D > q``): the range of the rows, whatever the shape
        basis = get_approximate_basis(a.mT, q, niter=niter)
        u, s, vh = torch.linalg.svd(a @ basis, full_matrices=False)
        return u, s, basis @ vh.mH

    mirrors_svd_lowrank.cache_clear()
    monkeypatch.setattr(torch, "svd_lowrank", transposed)
    try:
        assert not mirrors_svd_lowrank()
    finally:
        monkeypatch.undo()
        mirrors_svd_lowrank.cache_clear()
    assert mirrors_svd_lowrank()


def test_bad_input_is_refused_before_any_communication():
    z = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        sharded_factors(z, 0, "exact")
    with pytest.raises(ValueError, match="svd must be one of"):
        sharded_factors(z, 2, "lanczos")
    with pytest.raises(ValueError, match=r"expected an \[L, D_p\] matrix"):
        sharded_factors(z[None], 2, "exact")
    with pytest.raises(ValueError, match="svd must be one of"):
        communication_bytes(8, 4, 2, 2, "lanczos")


def test_the_bytes_counted_at_llama_shapes_are_the_computed_ones(ranks):
    """The TP = 2, 8K row of docs/architecture.md's table, counted on two ranks: 3 all-reduces of
    ``[8192, 32]`` and 3 all-gathers of ``[512, 32]`` float32 per rank."""
    expected = communication_bytes(8192, 1024, 2, 32, "randomized")
    for r in range(2):
        assert ranks[r]["llama_8k_tp2"] == {
            "all_reduces": 3,
            "all_reduce_bytes": expected["all_reduce"],
            "all_gathers": 3,
            "all_gather_bytes": expected["all_gather"],
        }
    assert expected["all_reduce"] == 3 * 8192 * 32 * 4 and expected["sent"] < expected["read_back"]


def test_communication_bytes_against_the_read_back():
    """Llama-3.1-8B's shapes (8 KV heads x 128, rank 32): the randomized SVD's all-reduces are
    ``3 L q`` float32 numbers whatever the ranks; the exact mode gathers as much as the read-back."""
    for length in (8192, 32768):
        for tp in (2, 8):
            randomized = communication_bytes(length, 1024, tp, 32, "randomized")
            exact = communication_bytes(length, 1024, tp, 32, "exact")
            assert randomized["all_reduce"] == 3 * length * 32 * 4
            assert randomized["all_gather"] == 3 * (1024 // tp) * 32 * 4
            assert exact["all_gather"] == exact["read_back"] == length * (1024 // tp) * 2
            assert exact["sent"] == (tp - 1) * exact["read_back"]
    assert communication_bytes(6, 24, 3, 8, "randomized")["sent"] == 0  # kept dense

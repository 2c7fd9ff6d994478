"""The served KVCMAS / KVComm engine on a rank of a tensor x pipeline grid (SPMD, issue 51 item 2).

The spmd test's trajectory (``tests/anchors_trajectory.py``) on 4 gloo ranks, 2 pipeline stages of the
tiny 3-layer model (stage 0 layers ``[0, 2)``, stage 1 ``[2, 3)``: uneven) x 2 tensor-parallel ranks
each (vLLM's rank ``pp_rank * 2 + tp_rank``): each rank's :class:`~hf_kvshare.serving.host.Sharing` holds
a skeleton with its KV heads of its stage's layers, its method runs on a
:class:`~hf_kvshare.anchors.sharded.StageShard` whose ``heads`` are its stage's tensor-parallel
:class:`~hf_kvshare.anchors.sharded.Shard` (made by :func:`~hf_kvshare.serving.replica.stage_shard`, as
a worker makes it), and it gets only its heads of its layers of every read-back. Against one rank over
every head and layer: the same claims, placements, gate decisions, stores and evictions (a small byte
budget), each rank's claimed K/V its heads of its layers of the one-rank K/V to 1e-5, the same pools and
pool numbers, one KV head replicated on both ranks of a stage counted once; a NaN in one rank's part
refused on every rank; the follower replaying world rank 0's publication decides what one rank decides.
The 4 ranks are spawned once per module."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from anchors_trajectory import (
    KV_HEADS,
    assert_same_pools,
    assert_same_steps,
    counted,
    embedded_tokenizer,
    engine_run,
    follow,
    one_rank_runs,
    pool_numbers,
    served,
    sharing_for,
    trajectory,
)
from gloo_ranks import run_ranks, spawns_ranks
from tiny import tiny_model

from hf_kvshare.anchors.lowrank import any_rank
from hf_kvshare.anchors.sharded import COLLECTIVES, Shard, StageShard
from hf_kvshare.serving.replica import stage_shard
from hf_kvshare.serving.tensor_parallel import kv_head_range

pytestmark = pytest.mark.xdist_group("test_anchors_grid")  # one spawn of the 4 ranks

#: each stage's layers of the tiny model's 3
STAGES = [(0, 2), (2, 3)]
TP = 2
PP = len(STAGES)
WORLD = TP * PP
#: the spmd test's cases (the replicated one: the model's one KV head on both ranks of each stage)
CASES = ("kvcmas", "kvcmas-guard", "kvcomm", "kvcmas-replicated", "kvcmas-small")
#: the rank whose read-back holds a NaN in the refusal's case: stage 1, tensor-parallel rank 1
POISONED = 3


def place(rank: int, kv_heads: int) -> tuple[int, int, int, int, int]:
    """World ``rank``'s stage layers ``[start, stop)``, KV heads ``[first, last)`` and replicas."""
    start, stop = STAGES[rank // TP]
    first, last = kv_head_range(rank % TP, TP, kv_heads)
    return start, stop, first, last, max(1, TP // kv_heads)


def _gather(rank: int, kv_heads: int, layers: int):
    """Every rank's heads of its layers of a ``[layers_s, m, heads_p, head_dim]`` tensor joined into
    every head of every layer (a replicated head from its first rank only)."""
    start, stop, first, last, replicas = place(rank, kv_heads)

    def gather(x: torch.Tensor) -> torch.Tensor:
        full = x.new_zeros((layers, x.shape[1], kv_heads, x.shape[3]))
        if rank % TP % replicas == 0:
            full[start:stop, :, first:last] = x
        dist.all_reduce(full)
        return full

    return gather


def _shard(base: StageShard, rank: int, kv_heads: int, head_dim: int, publish) -> StageShard:
    """The case's shard on ``base``'s groups: its heads' width and replicas, rank 0 publishing."""
    start, stop, first, last, replicas = place(rank, kv_heads)
    heads = Shard(base.heads.group, (last - first) * head_dim, replicas)
    return StageShard(
        base.group, start, stop, base.layers, publish=publish if rank == 0 else None, heads=heads
    )


def _grid_main(rank: int) -> dict:
    tokenizer = embedded_tokenizer()
    config = tiny_model("llama").config
    layers, head_dim = config.num_hidden_layers, config.hidden_size // config.num_attention_heads
    start, stop, first, last, _ = place(rank, 2)
    # the groups a worker makes at start-up (every rank, the same order): its stage's TP, then PP
    base = stage_shard(PP, start, stop, layers, 60, None, tp_size=TP, width=(last - first) * head_dim)
    results = {
        "any": [any_rank(rank == r, base) for r in range(WORLD)],
        "groups": (dist.get_process_group_ranks(base.heads.group), dist.get_process_group_ranks(base.group)),
    }
    try:  # a heads' shard that would publish the stage's partial sums
        StageShard(base.group, start, stop, layers, heads=Shard(base.heads.group, 16, publish=print))
    except ValueError as error:
        results["publishing heads"] = str(error)
    for case in CASES:
        kv_heads = KV_HEADS.get(case, 2)
        start, stop, first, last, _ = place(rank, kv_heads)
        method = served(case)
        published: list[torch.Tensor] = []  # world rank 0's reduced values, in call order
        shard = _shard(base, rank, kv_heads, head_dim, published.append)
        method.run_on_shard(shard)
        own = tiny_model("llama", num_key_value_heads=last - first, num_hidden_layers=stop - start)
        sharing = sharing_for(case, own, tokenizer, method)
        before = COLLECTIVES.snapshot()
        run = engine_run(
            tiny_model("llama", num_key_value_heads=kv_heads),
            slice(first, last),
            _gather(rank, kv_heads, layers),
            slice(start, stop),
        )
        steps = trajectory(sharing, tokenizer, run)
        results[case] = {
            "steps": steps,
            "collectives": COLLECTIVES.since(before),
            "pools": pool_numbers(method, shard),
            "ranks": (method.base_rank, method.delta_rank),
            "published": published,
            "counted": counted(sharing),
        }
    results["nan"] = _non_finite_on_one_rank(rank, base, tokenizer, head_dim)
    return results


def _non_finite_on_one_rank(rank: int, base: StageShard, tokenizer, head_dim: int) -> dict:
    """KVCMAS's first request, its read-back NaN in rank :data:`POISONED`'s part only: refused on every
    rank."""
    start, stop, first, last, _ = place(rank, 2)
    published: list[torch.Tensor] = []
    method = served("kvcmas")
    method.run_on_shard(_shard(base, rank, 2, head_dim, published.append))
    own = tiny_model("llama", num_key_value_heads=last - first, num_hidden_layers=stop - start)
    sharing = sharing_for("kvcmas", own, tokenizer, method)
    run = engine_run(tiny_model("llama"), slice(first, last), _gather(rank, 2, 3), slice(start, stop))

    def poisoned(plan, keys, values, index):
        out, k, v = run(plan, keys, values, index)
        if rank == POISONED:
            v[0, 0, 0, 0] = float("nan")
        return out, k, v

    step = trajectory(sharing, tokenizer, poisoned, requests=1)[0]
    return {"error": step["error"], "errors": sharing.errors, "out": step["out"], "published": published}


@pytest.fixture(scope="module")
@spawns_ranks
def grid(tmp_path_factory) -> list[dict]:
    return run_ranks(_grid_main, WORLD, tmp_path_factory.mktemp("anchors-grid"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    return one_rank_runs(tmp_path_factory)


def test_the_groups_are_the_stages_tensor_parallel_ranks_and_each_tensor_parallel_ranks_stages(grid):
    for rank in range(WORLD):
        stage = rank // TP
        assert grid[rank]["groups"] == (
            list(range(stage * TP, stage * TP + TP)),
            list(range(rank % TP, WORLD, TP)),
        ), rank


@pytest.mark.parametrize("case", CASES)
def test_every_rank_decides_and_claims_what_one_rank_does(grid, one_rank, case):
    reference = one_rank[case]["steps"]
    outcomes = [g.get("gate") for step in reference for g in step["gates"] if g]
    provenances = [p[0] for step in reference for p in step["placed"] if p]
    assert "accepted" in outcomes and "fallback" in outcomes and "corrected" in provenances
    kv_heads = KV_HEADS.get(case, 2)
    for rank in range(WORLD):
        start, stop, first, last, _ = place(rank, kv_heads)
        mine = grid[rank][case]
        assert mine["collectives"]["all_reduces"] > 0
        assert mine["ranks"] == one_rank[case]["ranks"]  # the rank clamp: every head's width
        part = (slice(start, stop), slice(None), slice(first, last))
        assert_same_steps(mine["steps"], reference, f"{case}, rank {rank}", part)
    gates = [[step["gates"] for step in grid[rank][case]["steps"]] for rank in range(WORLD)]
    assert all(g == gates[0] for g in gates)  # the same numbers on every rank, bit for bit
    if case == "kvcmas":  # the factors of a layer's columns are sharded over the stage's heads
        assert all(grid[rank][case]["collectives"]["all_gathers"] > 0 for rank in range(WORLD))


@pytest.mark.parametrize("case", CASES)
def test_every_rank_holds_the_one_rank_pools_and_bounds_one_ranks_bytes(grid, one_rank, case):
    reference = one_rank[case]["pools"]
    for rank in range(WORLD):
        assert_same_pools(grid[rank][case]["pools"], reference, rank)
    # the slots' bound compares the one-rank bytes on every rank; the summaries count each stage's own
    # (every rank of a stage alike: its heads times the column blocks), which add up to one rank's
    slots, prefixes, anchors = one_rank[case]["counted"]
    assert [grid[rank][case]["counted"][0] for rank in range(WORLD)] == [slots] * WORLD
    for tp_rank in range(TP):
        ranks = range(tp_rank, WORLD, TP)
        assert sum(grid[r][case]["counted"][1] for r in ranks) == prefixes, (case, tp_rank)
        assert sum(grid[r][case]["counted"][2] for r in ranks) == anchors, (case, tp_rank)
    for stage in range(PP):
        assert grid[stage * TP][case]["counted"] == grid[stage * TP + 1][case]["counted"], (case, stage)


def test_the_small_budget_evicts_by_bytes_on_every_rank(grid, one_rank):
    last = one_rank["kvcmas-small"]["steps"][-1]["stores"]
    assert last["evicted"][0] > 0 and last["prefixes"][1] > 0 and last["pool_evictions"][1] > 0, last
    assert all(grid[rank]["kvcmas-small"]["steps"][-1]["stores"] == last for rank in range(WORLD))


def test_a_test_of_one_ranks_part_is_answered_alike_on_every_rank(grid):
    assert all(grid[rank]["any"] == [True] * WORLD for rank in range(WORLD))


def test_a_stages_heads_that_would_publish_are_refused(grid):
    assert all("publishes nothing" in grid[rank]["publishing heads"] for rank in range(WORLD))


def test_a_nan_in_one_ranks_part_refuses_the_record_on_every_rank(grid):
    for rank in range(WORLD):
        nan = grid[rank]["nan"]
        assert nan["error"] is not None and nan["errors"] == 1, (rank, nan)
        if rank == POISONED:  # its first layer, the model's 2
            assert "NaN or inf) in layer 2 (values)" in nan["error"], nan["error"]
        else:
            assert "another tensor- or pipeline-parallel rank's K/V" in nan["error"], (rank, nan["error"])
    leader = {"published": grid[0]["nan"]["published"], "steps": [grid[0]["nan"]]}
    mine = follow("kvcmas", leader, requests=1)
    assert mine["steps"][0]["error"] is not None and mine["left"] == 0


@pytest.mark.parametrize("case", CASES)
def test_the_follower_of_rank_0_decides_what_one_rank_decides(grid, one_rank, case):
    """The scheduler's follower (every head of every layer, ``meta`` stand-ins) replaying world rank 0's
    publication: the reduced values are the one-rank ones, so it decides, holds and evicts what one
    rank does."""
    mine = follow(case, grid[0][case])
    assert mine["left"] == 0  # every published value replayed, none left over
    for index, (got, want) in enumerate(zip(mine["steps"], one_rank[case]["steps"], strict=True)):
        for key in ("claim", "placed", "out", "stores"):
            assert got[key] == want[key], (case, index, key)
        assert got["gates"] == grid[0][case]["steps"][index]["gates"], (case, index)  # its numbers
    assert mine["pools"] == grid[0][case]["pools"]
    assert mine["held"] == 0
    assert mine["counted"][0] == one_rank[case]["counted"][0]

"""The served KVCMAS / KVComm engine run on one pipeline stage's layers (SPMD, issue 51 item 2).

The spmd test's trajectory (``tests/anchors_trajectory.py``) on 2 gloo stages of the tiny 3-layer model,
stage 0 holding layers ``[0, 2)`` and stage 1 layer ``[2, 3)`` (uneven, as vLLM may split them): each
stage's :class:`~hf_kvshare.serving.host.Sharing` holds a skeleton model whose config has its layers, its
method runs on a :class:`~hf_kvshare.anchors.sharded.StageShard` and it gets only its layers of every
read-back. The engine's forward needs every layer: the stages gather their claimed K/V for it. Against one
rank over every layer: the same claims, placements, gate decisions (the guard's per-layer scales too),
stores and evictions under a small byte budget, each stage's claimed K/V its layers of the one-rank K/V
to 1e-5, the same pools and the numbers the gate's rules reduce from them; ``skip_layer0`` (on in the
served KVCMAS) names the model's layer 0, held by stage 0 only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from anchors_trajectory import (
    assert_same_pools,
    assert_same_steps,
    corrections_non_finite_on_rank_1,
    counted,
    embedded_tokenizer,
    engine_run,
    follow,
    nan_on_rank_1,
    one_rank_runs,
    pool_numbers,
    served,
    sharing_for,
    trajectory,
)
from gloo_ranks import run_ranks, spawns_ranks
from tiny import tiny_model

from hf_kvshare.anchors.lowrank import any_rank
from hf_kvshare.anchors.sharded import COLLECTIVES, StageShard, pipeline_parallel_groups

#: each stage's layers of the tiny model's 3
STAGES = [(0, 2), (2, 3)]
WORLD = len(STAGES)
#: the spmd test's cases that shard nothing by heads (its replicated-head case is tensor parallel's)
CASES = ("kvcmas", "kvcmas-guard", "kvcomm", "kvcmas-small")


def _gather_layers(start: int, stop: int, layers: int):
    """Every stage's layers of a ``[layers_s, m, heads, head_dim]`` tensor joined in layer order."""

    def gather(x: torch.Tensor) -> torch.Tensor:
        full = x.new_zeros((layers, *x.shape[1:]))
        full[start:stop] = x
        dist.all_reduce(full)
        return full

    return gather


def _stage_main(rank: int) -> dict:
    tokenizer = embedded_tokenizer()
    layers = tiny_model("llama").config.num_hidden_layers
    start, stop = STAGES[rank]
    group = pipeline_parallel_groups(1, WORLD, 60)  # what a stage's replica would make at start-up
    # a test of one stage's layers answered alike on every stage
    results = {"any": [any_rank(rank == r, StageShard(group, start, stop, layers)) for r in range(WORLD)]}
    for case in CASES:
        model = tiny_model("llama")
        own = tiny_model("llama", num_hidden_layers=stop - start)  # this stage's skeleton: its layers
        method = served(case)
        published: list[torch.Tensor] = []  # stage 0's reduced values, in call order
        shard = StageShard(group, start, stop, layers, publish=published.append if rank == 0 else None)
        method.run_on_shard(shard)
        sharing = sharing_for(case, own, tokenizer, method)
        before = COLLECTIVES.snapshot()
        run = engine_run(model, slice(None), _gather_layers(start, stop, layers), slice(start, stop))
        steps = trajectory(sharing, tokenizer, run)
        results[case] = {
            "steps": steps,
            "collectives": COLLECTIVES.since(before),
            "pools": pool_numbers(method, shard),
            "ranks": (method.base_rank, method.delta_rank),
            "published": published,
            "counted": counted(sharing),
        }
    results["nan"] = _non_finite_on_one_stage(rank, tokenizer, layers)
    results["nan-correction"] = _correction_non_finite_on_one_stage(rank, tokenizer, group, layers)
    return results


def _non_finite_on_one_stage(rank: int, tokenizer, layers: int) -> dict:
    """KVCMAS's first request, its read-back NaN in stage 1's layer only: refused on every stage."""
    start, stop = STAGES[rank]
    method = served("kvcmas")
    published: list[torch.Tensor] = []
    method.run_on_shard(
        StageShard(None, start, stop, layers, publish=published.append if rank == 0 else None)
    )
    sharing = sharing_for("kvcmas", tiny_model("llama", num_hidden_layers=stop - start), tokenizer, method)
    run = engine_run(
        tiny_model("llama"), slice(None), _gather_layers(start, stop, layers), slice(start, stop)
    )

    step = trajectory(sharing, tokenizer, nan_on_rank_1(rank, run), requests=1)[0]
    return {"error": step["error"], "errors": sharing.errors, "out": step["out"], "published": published}


def _correction_non_finite_on_one_stage(rank: int, tokenizer, group, layers: int) -> dict:
    """KVCMAS's trajectory with every correction stage 1 computes non-finite (its layers only): the
    first plan that computes one is refused on every stage."""
    start, stop = STAGES[rank]
    shard = StageShard(group, start, stop, layers)
    method = served("kvcmas")
    method.run_on_shard(shard)
    sharing = sharing_for("kvcmas", tiny_model("llama", num_hidden_layers=stop - start), tokenizer, method)
    run = engine_run(
        tiny_model("llama"), slice(None), _gather_layers(start, stop, layers), slice(start, stop)
    )
    return corrections_non_finite_on_rank_1(rank, shard, sharing, tokenizer, run)


@pytest.fixture(scope="module")
@spawns_ranks
def stages(tmp_path_factory) -> list[dict]:
    return run_ranks(_stage_main, WORLD, tmp_path_factory.mktemp("anchors-stages"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    return one_rank_runs(tmp_path_factory)


@pytest.mark.parametrize("case", CASES)
def test_every_stage_decides_and_claims_what_one_rank_does(stages, one_rank, case):
    reference = one_rank[case]["steps"]
    outcomes = [g.get("gate") for step in reference for g in step["gates"] if g]
    provenances = [p[0] for step in reference for p in step["placed"] if p]
    assert "accepted" in outcomes and "fallback" in outcomes and "corrected" in provenances
    for rank, (start, stop) in enumerate(STAGES):
        mine = stages[rank][case]
        assert mine["collectives"]["all_reduces"] > 0
        assert mine["collectives"]["all_gathers"] == 0  # a layer's factors are the stage's own
        assert mine["ranks"] == one_rank[case]["ranks"]  # the rank clamp: a layer's width
        assert_same_steps(mine["steps"], reference, f"{case}, stage {rank}", (slice(start, stop),))
    gates = [[step["gates"] for step in stages[rank][case]["steps"]] for rank in range(WORLD)]
    assert all(g == gates[0] for g in gates)  # the same numbers on every stage, bit for bit


@pytest.mark.parametrize("case", CASES)
def test_every_stage_holds_the_one_rank_pools_and_bounds_one_ranks_bytes(stages, one_rank, case):
    reference = one_rank[case]["pools"]
    for rank in range(WORLD):
        assert_same_pools(stages[rank][case]["pools"], reference, rank)
    # the slots' bound compares the one-rank bytes on every stage; the summaries count each stage's own,
    # which add up to one rank's
    slots, prefixes, anchors = one_rank[case]["counted"]
    assert [stages[rank][case]["counted"][0] for rank in range(WORLD)] == [slots] * WORLD
    assert sum(stages[rank][case]["counted"][1] for rank in range(WORLD)) == prefixes
    assert sum(stages[rank][case]["counted"][2] for rank in range(WORLD)) == anchors
    assert all(0 < stages[rank][case]["counted"][2] < anchors for rank in range(WORLD)) or anchors == 0


def test_the_small_budget_evicts_by_bytes_on_every_stage(stages):
    last = stages[0]["kvcmas-small"]["steps"][-1]["stores"]
    assert last["evicted"][0] or last["evicted"][1]
    assert last["prefixes"][1] > 0 or any(last["pool_evictions"])


def test_a_test_of_one_stages_layers_is_answered_alike_on_every_stage(stages):
    assert all(stages[rank]["any"] == [True] * WORLD for rank in range(WORLD))


def test_a_nan_in_one_stages_layers_refuses_the_record_on_every_stage(stages):
    for rank in range(WORLD):
        nan = stages[rank]["nan"]
        assert nan["error"] is not None and nan["errors"] == 1, (rank, nan)
    # stage 1 names the model's layer (its first, the model's 2), stage 0 the other rank
    assert "NaN or inf) in layer 2 (values)" in stages[1]["nan"]["error"]
    assert "another tensor- or pipeline-parallel rank's K/V" in stages[0]["nan"]["error"]


def test_a_correction_non_finite_in_one_stages_layers_refuses_the_plan_on_every_stage(stages):
    """Stage 1's corrections NaN: the plan that computes one is refused on both stages, stage 1 naming
    the model's layer (its first, 2), stage 0 the other stage's K/V; their collectives still pair."""
    mine, other = stages[0]["nan-correction"], stages[1]["nan-correction"]
    assert len(mine["steps"]) == len(other["steps"]) > 1 and mine["errors"] == other["errors"] == 1
    assert "NaN or inf) in layer 2 (values)" in other["steps"][-1]["error"]
    assert "another tensor- or pipeline-parallel rank's K/V" in mine["steps"][-1]["error"]
    assert mine["paired"] is other["paired"] is True


def test_a_stage_outside_the_model_is_refused():
    with pytest.raises(ValueError, match="0 <= start < stop <= 3"):
        StageShard(None, 2, 4, 3)


@pytest.mark.parametrize("case", CASES)
def test_the_follower_of_stage_0_decides_what_one_rank_decides(stages, one_rank, case):
    """The scheduler's follower (every layer, ``meta`` stand-ins) replaying stage 0's publication: the
    reduced values are the one-rank ones, so it decides, holds and evicts what one rank does."""
    mine = follow(case, stages[0][case])
    assert mine["left"] == 0  # every published value replayed, none left over
    for index, (got, want) in enumerate(zip(mine["steps"], one_rank[case]["steps"], strict=True)):
        for key in ("claim", "placed", "out", "stores"):
            assert got[key] == want[key], (case, index, key)
        assert got["gates"] == stages[0][case]["steps"][index]["gates"], (case, index)  # its numbers
    assert mine["pools"] == stages[0][case]["pools"]
    assert mine["held"] == 0
    assert mine["counted"][0] == one_rank[case]["counted"][0]


def test_the_follower_of_stage_0_refuses_a_nan_in_stage_1s_layers(stages):
    leader = {"published": stages[0]["nan"]["published"], "steps": [stages[0]["nan"]]}
    mine = follow("kvcmas", leader, requests=1)
    assert mine["steps"][0]["error"] is not None and mine["left"] == 0

"""The follower of the anchors engine (issue 51 item 2): the scheduler's copy runs on ``meta`` stand-ins
and takes every value a decision reads from the leader (rank 0), in order
(:class:`~hf_kvshare.anchors.sharded.FollowerShard`)."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from anchors_trajectory import (
    GROUP,
    follow,
    one_rank_runs,
    rank_runs,
    served,
    sharing_for,
    stand_ins,
    trajectory,
)
from gloo_ranks import spawns_ranks
from tiny import embedded_tokenizer, tiny_model

from hf_kvshare.anchors.lowrank import any_rank, column_sum, columns, factorize, kept_rank
from hf_kvshare.anchors.sharded import FollowerDiverged, FollowerShard


def replay(values: list[torch.Tensor]) -> FollowerShard:
    queue = iter(values)
    return FollowerShard(lambda: next(queue))


def test_the_follower_returns_what_the_leader_published_in_order():
    sums = [torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64)]
    follower = replay([sums[0], torch.tensor([1.0], dtype=torch.float64), sums[1]])
    partial = torch.empty(2, dtype=torch.float64, device="meta")
    assert column_sum(partial, follower) is sums[0]

    def reads_values() -> bool:
        raise AssertionError("a follower never evaluates a test of its stand-ins")

    assert any_rank(reads_values, follower) is True
    assert column_sum(torch.empty(1, dtype=torch.float64, device="meta"), follower).tolist() == [3.0]
    assert columns(32, follower) == 32  # it holds every column


def test_a_value_of_another_shape_is_a_diverged_follower():
    follower = replay([torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(
        FollowerDiverged, match=r"column_sum expected a value of shape \(2,\) torch.float32.*received \(3,\)"
    ):
        column_sum(torch.empty(2, device="meta"), follower)
    assert issubclass(FollowerDiverged, ValueError)
    with pytest.raises(FollowerDiverged, match="any expected"):
        any_rank(True, replay([torch.zeros(2, dtype=torch.float64)]))


def test_a_follower_that_receives_nothing_has_diverged():
    """``receive`` raising (the transport's timeout) leaves every later value misplaced: diverged."""

    def timed_out() -> torch.Tensor:
        raise TimeoutError("no value from rank 0 in 30 s")

    with pytest.raises(
        FollowerDiverged, match="any received nothing from the leader .TimeoutError: no value"
    ):
        any_rank(True, FollowerShard(timed_out))


@pytest.mark.parametrize(("length", "rank"), [(40, 4), (3, 4), (40, None)])
def test_the_followers_factors_are_meta_of_the_shapes_one_rank_keeps(length, rank):
    matrix = torch.empty(length, 32, dtype=torch.bfloat16, device="meta")
    factors = factorize(matrix, rank, "randomized", replay([]))
    one = factorize(torch.randn(length, 32, dtype=torch.bfloat16), rank, "randomized", None)
    assert factors.shape == one.shape and factors.rank == one.rank and factors.dense == one.dense
    assert factors.nbytes == one.nbytes  # the one-rank bytes from the shapes alone
    assert factors.a.is_meta and (factors.b is None or factors.b.is_meta)
    assert kept_rank(length, 32, rank, "randomized") == (None if factors.dense else factors.rank)


# ------------------------------------------------------------------ the follower of the gloo ranks' trajectory
pytestmark = pytest.mark.xdist_group(GROUP)  # with test_anchors_spmd (the ranks spawn once per run)


@pytest.fixture(scope="session")  # session, not module: the module's xdist group is GROUP, the spawn's
@spawns_ranks
def ranks(tmp_path_factory) -> list[dict]:
    return rank_runs(tmp_path_factory)


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory) -> dict:
    return one_rank_runs(tmp_path_factory)


CASE_NAMES = ["kvcmas", "kvcmas-guard", "kvcomm", "kvcmas-replicated", "kvcmas-small"]


@pytest.fixture(scope="session")
def followers(ranks) -> dict:
    return {case: follow(case, ranks[0][case]) for case in CASE_NAMES}


def _decisions(step: dict) -> dict:
    return {key: step[key] for key in ("claim", "placed", "gates", "out", "stores")}


@pytest.mark.parametrize("case", CASE_NAMES)
def test_the_follower_decides_what_every_rank_and_one_rank_decide(ranks, one_rank, followers, case):
    mine = followers[case]
    assert mine["left"] == 0  # every published value replayed, none left over
    for rank in range(len(ranks)):
        theirs = ranks[rank][case]["steps"]
        assert len(mine["steps"]) == len(theirs)
        for index, (got, want) in enumerate(zip(mine["steps"], theirs)):
            assert _decisions(got) == _decisions(want), (case, rank, index)
    for index, (got, want) in enumerate(zip(mine["steps"], one_rank[case]["steps"])):
        assert got["claim"] == want["claim"] and got["placed"] == want["placed"], (case, index)
        assert got["stores"] == want["stores"], (case, index)
    if case == "kvcmas-small":  # the bounds were hit: tasks, kept prefixes and anchors evicted by bytes
        last = mine["steps"][-1]["stores"]
        assert last["evicted"][0] > 0 and last["prefixes"][1] > 0 and last["pool_evictions"][1] > 0, last
    assert mine["pools"] == ranks[0][case]["pools"]  # the leader's numbers, received bit for bit
    assert mine["held"] == 0  # stand-ins: the follower holds no K/V, no factors
    # the bounds count one rank's bytes on every member: the slots' (the leader's, on the follower)
    assert mine["counted"][0] == ranks[0][case]["counted"][0] == one_rank[case]["counted"][0] > 0
    # the kept prefixes and the pools, as summarized: every member's one rank's (the follower's by its
    # stand-ins' shapes, which hold no bytes)
    assert ranks[0][case]["counted"] == ranks[1][case]["counted"] == one_rank[case]["counted"]
    assert mine["counted"][1:] == one_rank[case]["counted"][1:]


def test_a_read_back_non_finite_on_one_ranks_heads_is_refused_by_every_rank_and_the_follower(ranks):
    """The host's finiteness check of a read-back goes through ``any_rank``: rank 1 finds the NaN in its
    heads, rank 0 refuses the record for it, and so does the follower (rank 0's answer)."""
    assert "NaN or inf" in ranks[1]["nan"]["error"]
    assert "another tensor- or pipeline-parallel rank's K/V" in ranks[0]["nan"]["error"]
    assert ranks[0]["nan"]["errors"] == ranks[1]["nan"]["errors"] == 1
    leader = {"published": ranks[0]["nan"]["published"], "steps": [ranks[0]["nan"]]}
    mine = follow("kvcmas", leader, requests=1)
    assert "another tensor- or pipeline-parallel rank's K/V" in mine["steps"][0]["error"]
    assert mine["left"] == 0


def test_a_correction_non_finite_in_one_ranks_heads_refuses_the_plan_on_every_rank_and_the_follower(ranks):
    """A corrected placement each rank computes in its heads: NaN on rank 1 only. The walk goes on past
    it (every rank makes the same collectives: one more pairs up after it) and the plan is refused on
    every rank, through ``any_rank``, and on the follower (rank 0's answer)."""
    mine, other = ranks[0]["nan-correction"], ranks[1]["nan-correction"]
    assert len(mine["steps"]) == len(other["steps"]) > 1  # requests before it: nothing to correct yet
    assert "NaN or inf" in other["steps"][-1]["error"]
    assert "another tensor- or pipeline-parallel rank's K/V" in mine["steps"][-1]["error"]
    assert mine["errors"] == other["errors"] == 1
    assert mine["steps"][-1]["stores"] == other["steps"][-1]["stores"]  # the refusal changed nothing
    assert mine["paired"] is other["paired"] is True
    leader = {"published": mine["published"][:-1], "steps": mine["steps"]}  # the test's own any_rank last
    model = tiny_model("llama")
    method = served("kvcmas")
    queue = deque(leader["published"])
    method.run_on_shard(FollowerShard(queue.popleft))
    followed = trajectory(
        sharing_for("kvcmas", model, embedded_tokenizer(), method),
        embedded_tokenizer(),
        stand_ins(model.config, leader),
        until_refused=True,
    )
    assert len(followed) == len(mine["steps"]) and not queue
    assert "another tensor- or pipeline-parallel rank's K/V" in followed[-1]["error"]


def test_a_value_of_another_shape_from_the_leader_stops_the_follower(ranks):
    """A corrupted publication (a sum of another shape) is a diverged follower: raised by ``Sharing``
    (not counted as one request's error: no later decision of the follower could be trusted)."""
    published = list(ranks[0]["kvcmas"]["published"])
    at = next(i for i, value in enumerate(published) if value.numel() > 1)  # a column_sum's
    published[at] = torch.zeros(published[at].numel() + 1, dtype=published[at].dtype)
    with pytest.raises(FollowerDiverged, match="column_sum expected a value of shape"):
        follow("kvcmas", ranks[0]["kvcmas"], published)


def test_a_saved_state_is_refused_under_a_shard(tiny_llama):
    """A saved state holds every head's anchors: an engine on a shard (here the follower) refuses to load
    it, saying why, and keeps its own state."""
    one = served("kvcmas")
    one.bind(tiny_llama)
    tensors, meta = one.export_state()
    method = served("kvcmas")
    method.run_on_shard(replay([]))
    method.bind(tiny_llama)
    with pytest.raises(ValueError, match="a saved state loads on one rank only"):
        method.import_state(tensors, meta)

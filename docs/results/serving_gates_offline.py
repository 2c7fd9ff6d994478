"""KVCMAS's gates on the served trace's requests, without vLLM: the serving host (``Sharing``) driven
by an HF stand-in for the engine, in three orders.

    OMP_NUM_THREADS=1 python docs/results/serving_gates_offline.py [ORDER ...] [--warmup-tasks N ...]
        [--record-phases] [--method kvcmas:defer_factorization=False]
    # ~3 min per order and warm-up count on one core

The requests are the ones ``hf-kvshare bench serve --shared-tokens 1024 --agents 4 --tasks 5
--output-tokens 8 --warmup-tasks 3 --explicit-layout`` sends in repeat 0 at its first QPS (the
same documents, the chat messages with a message per segment, the explicit layout), the prompt the
model's chat template makes of them, and the method with the options serving states. Warm-up tasks
run one request at a time; the timed tasks then in ORDER:

- ``task``: one task after the other (what a Session does);
- ``agent``: the bench's ``--order agent`` (every task's first agent, then every task's second, ...), each
  request planned, run and recorded before the next (a server at a very low rate);
- ``wave``: the bench's ``--order agent``, every task's request of one position planned before any of them is
  run and recorded (a server at a high rate: plans run ahead of the other tasks' records).

The engine is :func:`hf_kvshare.serving.standin.engine` (a prefill of the claimed-from hit, the
claimed K/V written, greedy generation over the rest; what ``tests/test_serving.py`` uses), so outputs are the HF model's, not
vLLM's. Prints per task each agent's treatment (``C`` corrected, ``R`` reused uncorrected, ``D``
dense) and, for a dense turn, each gated slot's outcome (entropy, anchors compared). Not a benchmark.
``--record-phases`` prints each plan's time, each record's and its phases (``hf_kvshare.measure.phase``: factorize,
anchor_store, gate); ``--method`` gives the method with options, as the bench writes it (default kvcmas).
``--profile`` prints a cProfile of the timed tasks' plans and of their records apart (the 30 most
expensive calls by cumulative time) and their mean times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

import torch

from hf_kvshare import load_model
from hf_kvshare.bench import serve as sb
from hf_kvshare.bench.methods import MethodSpec
from hf_kvshare.serving.client import task_trajectory, task_turns
from hf_kvshare.serving.host import Sharing
from hf_kvshare.serving.standin import engine


def treatment(plan):
    kinds = [
        p.provenance if p else "dense" for s, p in zip(plan.turn.spans, plan.placements) if s.kind == "PH"
    ]
    if all(k == "dense" for k in kinds):
        return "D"
    return "C" if "corrected" in kinds else "R"


def gates(plan):
    """The gate outcome of each gated PH span (the serving report's, known once recorded)."""
    out = []
    for seg in plan.report()["segments"]:
        g = seg.get("gate") or {}
        if g.get("gate") in (None, "first", "ungated"):
            continue
        h = f"H={g['entropy']:.2f}," if "entropy" in g else ""
        out.append(f"{seg['name']}:{g['gate']}({h}n={g.get('anchors')})")
    return out


class Task:
    def __init__(self, spec, name):
        self.traj = task_trajectory(spec, name)
        self.turns = list(task_turns(spec))
        self.row: list[str] = []
        self.notes: list[str] = []


class Driver:
    """The serving host and the stand-in engine, one request at a time."""

    def __init__(self, model, tok, method="kvcmas", phases=False):
        self.model, self.tok = model, tok
        spec = MethodSpec.parse(method)
        self.sharing = Sharing(model, tok, spec.name, **spec.kwargs)
        self.n = 0
        self.phases = phases
        #: cProfiles of plans and records while profiling (``None``: not profiling)
        self.profiles: dict[str, cProfile.Profile] | None = None
        self.times: dict[str, list[float]] = {"plan": [], "record": []}

    def _profiled(self, what, call):
        if self.profiles is None:
            return call()
        self.profiles[what].enable()
        try:
            return call()
        finally:
            self.profiles[what].disable()

    def plan(self, task, position):
        agent, messages, slot, max_tokens, min_tokens = task.turns[position]
        request = task.traj.request(
            agent, messages, output_slot=slot, max_tokens=max_tokens, min_tokens=min_tokens
        )
        body = request.body("model", explicit_layout=True)
        prompt = self.tok.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        self.n += 1
        plan = self._profiled(
            "plan", lambda: self.sharing.plan(f"r{self.n}", prompt, body["kv_transfer_params"], 0)
        )
        assert plan.error is None, plan.error
        if self.profiles is not None:
            self.times["plan"].append(plan.plan_s)
        return plan, slot, max_tokens

    def run(self, task, planned):
        plan, slot, max_tokens = planned
        out, k, v = engine(self.model, plan, max_tokens, min_new_tokens=max_tokens)
        self._profiled("record", lambda: self.sharing.record(plan, k, v, out, set(), settle=False))
        assert plan.error is None, plan.error
        if self.profiles is not None:
            self.times["record"].append(plan.record_s)
        if self.phases:
            times = " ".join(f"{n}={t:.3f}" for n, t in sorted(plan.record_phases.items()))
            print(
                f"    {task.traj.task} {plan.turn.agent}: plan {plan.plan_s:.3f} s, record {plan.record_s:.3f} s ({times}); "
                f"{len(plan.deferred)} parts left for later",
                flush=True,
            )
        for work in plan.deferred:  # what the serving host's settle jobs run after the record
            self.sharing.settle(work)
        task.traj.record(slot, self.tok.decode(out, skip_special_tokens=True))
        t = treatment(plan)
        task.row.append(t)
        if t == "D" and plan.turn.agent != task.turns[0][0]:
            task.notes.append(f"{plan.turn.agent}: {' '.join(gates(plan))}")


def run_order(model, tok, order, warmup, method="kvcmas", phases=False, profile=False):
    workload = sb.ServeTrace(shared_tokens=1024, agents=4, tasks=5, output_tokens=8)
    d = Driver(model, tok, method, phases)
    warm = [Task(s, f"warmup-0-{i}") for i, s in enumerate(sb.warmup_tasks(workload, warmup, tok, 0, 0))]
    for task in warm:
        for p in range(len(task.turns)):
            d.run(task, d.plan(task, p))
    if profile:  # the timed tasks only
        d.profiles = {"plan": cProfile.Profile(), "record": cProfile.Profile()}
    seed = sb.run_seed(0, "run", 0, 0)
    timed = [Task(s, f"{seed:x}-{s.id}") for s in workload.task_specs(tok, seed)]
    if order == "task":
        for task in timed:
            for p in range(len(task.turns)):
                d.run(task, d.plan(task, p))
    elif order == "agent":
        for p in range(workload.agents):
            for task in timed:
                d.run(task, d.plan(task, p))
    elif order == "wave":
        for p in range(workload.agents):
            planned = [d.plan(task, p) for task in timed]
            for task, pl in zip(timed, planned):
                d.run(task, pl)
    else:
        raise SystemExit(f"unknown order {order!r}: task, agent or wave")
    reuse = sum(1 for t in timed for x in t.row[1:] if x != "D")
    print(
        f"== {order}, {warmup} warm-up tasks: warm-up {' '.join(''.join(t.row) for t in warm)}  "
        f"timed {' '.join(''.join(t.row) for t in timed)}  (reuse turns {reuse} of "
        f"{sum(len(t.row) - 1 for t in timed)})",
        flush=True,
    )
    for t in warm + timed:
        for note in t.notes:
            print("   ", note, flush=True)
    if d.profiles is not None:
        for what, prof in d.profiles.items():
            times = d.times[what]
            print(
                f"== {what}s: {len(times)}, mean {sum(times) / max(1, len(times)):.3f} s (under the profiler)"
            )
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
            print(out.getvalue(), flush=True)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("orders", nargs="*", default=["task", "agent", "wave"])
    parser.add_argument("--warmup-tasks", type=int, nargs="+", default=[3])
    parser.add_argument("--record-phases", action="store_true")
    parser.add_argument("--method", default="kvcmas")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load_model()
    for warmup in args.warmup_tasks:
        for order in args.orders:
            run_order(model, tok, order, warmup, args.method, args.record_phases, args.profile)


if __name__ == "__main__":
    main(sys.argv[1:])

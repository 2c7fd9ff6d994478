"""KVCMAS's per-anchor token distances (computed once per request and source, an accepted output's at
its producer's record) against computing them at every placement, on the trace workload, both ways in
one run.

    OMP_NUM_THREADS=1 python docs/results/distances_ab.py [SHARED_TOKENS] [OUTPUT_TOKENS]   # 2048 32

4 requests (3 agents; the first 2 warm up the pools); each request runs the default ``kvcmas`` ("per
anchor") and then a copy whose slot scope computes ``token_distances`` for every placement's anchor
set, as before ("per placement": ``SlotScope.distances`` and ``SlotScope.prime`` replaced in this
script only), each with its own method instance. Prints the reuse turns' TTFT and the seconds spent
in ``token_distances`` by turn, whether the output tokens are equal, and the means after the warm-up.
Not a benchmark: run it alone on the machine.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import hf_kvshare.anchors.slot_scope as slot_scope
from hf_kvshare import Session, load_model
from hf_kvshare.bench.workloads.trace import TraceWorkload
from hf_kvshare.evaluation.workflow import run_workflow
from hf_kvshare.methods.kvcmas import KVCMAS

torch.set_num_threads(1)
shared = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
output = int(sys.argv[2]) if len(sys.argv) > 2 else 32
model, tok = load_model()
workload = TraceWorkload(shared_tokens=shared, agents=3, rounds=1, output_tokens=output, requests=4)
flows = [t.to_workflow(tok) for t in workload.tasks(tok)]
PER_ANCHOR = (slot_scope.SlotScope.distances, slot_scope.SlotScope.prime)
inner = slot_scope.token_distances
spent = [0.0]


def timed(*args, **kwargs):
    start = time.perf_counter()
    out = inner(*args, **kwargs)
    spent[0] += time.perf_counter() - start
    return out


slot_scope.token_distances = timed


def per_placement(self, turn, slot, pool, source, anchors, rows, reader=None):
    return slot_scope.token_distances(source, anchors, turn.shifter, rows, reader_start=reader)


ways = {
    "per anchor": (PER_ANCHOR, KVCMAS()),
    "per placement": ((per_placement, lambda *a, **k: None), KVCMAS()),
}
ttft: dict[str, list[float]] = {k: [] for k in ways}
for i, flow in enumerate(flows):
    outputs = {}
    for way, ((distances, prime), method) in ways.items():
        slot_scope.SlotScope.distances, slot_scope.SlotScope.prime = distances, prime
        session = Session(model, tok, method)
        spent[0] = 0.0
        turns = run_workflow(session, flow)
        outputs[way] = [t.output_ids.tolist() for t in turns]
        if i >= 2:
            ttft[way] += [t.ttft_s for t in turns[1:]]
        print(
            f"request {i} {way}: reuse-turn TTFT",
            [round(t.ttft_s, 3) for t in turns[1:]],
            "rho",
            [round(t.reuse_ratio, 2) for t in turns[1:]],
            f"token_distances {spent[0]:.3f} s in the request",
            flush=True,
        )
    slot_scope.SlotScope.distances, slot_scope.SlotScope.prime = PER_ANCHOR
    print(f"request {i}: same output tokens: {outputs['per anchor'] == outputs['per placement']}", flush=True)
a, p = statistics.mean(ttft["per anchor"]), statistics.mean(ttft["per placement"])
print(f"mean reuse-turn TTFT per anchor {a:.3f} s, per placement {p:.3f} s, ratio {a / p:.2f}")

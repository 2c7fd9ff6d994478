"""Where a KVCMAS reuse turn spends its time beyond FullShared's (controlled trace, one length).

    OMP_NUM_THREADS=1 python docs/results/profile_kvcmas.py [SHARED_TOKENS]   # default 2048

Runs 4 requests of the trace workload (3 agents, 32 output tokens) with
``fullshared:prefix_reuse=True`` and the default ``kvcmas``, one instance each; for the last two
requests prints every reuse turn's TTFT and the seconds spent in ``gate_distances``,
``token_distances`` and ``apply_correction`` (wall-clock timers around the functions where the anchor
scopes call them; ``CorrectedKV.write_layer`` / ``_materialize``: where the correction is computed since
it is written where it lands; ``token_distances`` mostly runs in records, primed for the next turn, not in a
TTFT). Not a benchmark: run it alone on the machine.
"""

from __future__ import annotations

import collections
import sys
import time

import torch

import hf_kvshare.anchors.edge_scope as E
import hf_kvshare.anchors.slot_scope as S
import hf_kvshare.cache as C
import hf_kvshare.methods.kvcmas as K
from hf_kvshare import Session, load_model
from hf_kvshare.bench.workloads.trace import TraceWorkload
from hf_kvshare.evaluation.workflow import run_workflow
from hf_kvshare.methods.fullshared import FullShared

torch.set_num_threads(1)
shared = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
model, tok = load_model()
flows = [
    t.to_workflow(tok)
    for t in TraceWorkload(shared_tokens=shared, agents=3, rounds=1, output_tokens=32, requests=4).tasks(tok)
]
seconds: dict[str, float] = collections.defaultdict(float)
measuring = [False]


def timed(module, name: str) -> None:
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        if measuring[0]:
            seconds[name] += time.perf_counter() - start
        return out

    setattr(module, name, wrapper)  # the anchor scopes look these up in their module at call time


for module, names in (
    (S, ("gate_distances", "token_distances", "apply_correction")),
    (E, ("apply_correction",)),
):
    for name in names:
        timed(module, name)
# since 2026-12-05 apply_correction returns a CorrectedKV computed where the cache lays it out: its
# arithmetic is in CorrectedKV.write_layer (or in _materialize where something reads it whole)
timed(C.CorrectedKV, "write_layer")
timed(C.CorrectedKV, "_materialize")
for label, method in (
    ("fullshared:prefix_reuse=True", FullShared(prefix_reuse=True)),
    ("kvcmas", K.KVCMAS()),
):
    seconds.clear()
    for i, flow in enumerate(flows):
        measuring[0] = i >= 2  # the first two requests warm up (anchor pools, kept prefixes)
        turns = run_workflow(Session(model, tok, method), flow)
        if measuring[0]:
            print(
                f"{label} request {i}: reuse-turn TTFT",
                [round(t.ttft_s, 3) for t in turns[1:]],
                "rho",
                [round(t.reuse_ratio, 2) for t in turns[1:]],
            )
    print(f"{label}: seconds in", {k: round(v, 3) for k, v in seconds.items()} or "-")

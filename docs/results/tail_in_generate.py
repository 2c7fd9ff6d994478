"""The trailing agent text in generate's first forward, against prefilling it in build (trace workload).

    OMP_NUM_THREADS=1 python docs/results/tail_in_generate.py [SHARED_TOKENS] [OUTPUT_TOKENS]   # 2048 16

For each method (``fullshared``, ``fullshared:prefix_reuse=True``, ``kvcmas``) runs the same requests
of the trace workload (3 agents) twice, alternating request by request: as the session runs it now
(``Method.tail_for_generate``: the run of computed agent text after the last placed or PH span is
left to generate's first forward) and with that text prefilled in build (the behaviour before, a
subclass whose ``tail_for_generate`` returns nothing), each with its own method instance. Prints every
reuse turn's TTFT and whether the output tokens are equal, then the mean TTFT of the reuse turns after
the first (warm-up) request and the ratio. Since acc4b89 the text is left to generate only when every
part before it is placed, so ``fullshared`` (its template computed before the document) runs the same
path both ways; the run in docs/results/runs/tail-in-generate/ (at 1e65350) is the measurement that
rule came from. Not a benchmark: run it alone on the machine.
"""

from __future__ import annotations

import statistics
import sys

import torch

from hf_kvshare import Session, load_model
from hf_kvshare.bench.workloads.trace import TraceWorkload
from hf_kvshare.evaluation.workflow import run_workflow
from hf_kvshare.methods.fullshared import FullShared
from hf_kvshare.methods.kvcmas import KVCMAS

torch.set_num_threads(1)
shared = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
output = int(sys.argv[2]) if len(sys.argv) > 2 else 16
requests = 3
model, tok = load_model()
workload = TraceWorkload(shared_tokens=shared, agents=3, rounds=1, output_tokens=output, requests=requests)
flows = [t.to_workflow(tok) for t in workload.tasks(tok)]


def prefilling(cls):
    """``cls`` with the trailing agent text prefilled in build (the behaviour before)."""

    class Prefills(cls):
        name = f"{cls.name}-prefills-tail"

        def tail_for_generate(self, turn, parts):
            return []

    return Prefills


for label, make in (
    ("fullshared", lambda c: c()),
    ("fullshared:prefix_reuse=True", lambda c: c(prefix_reuse=True)),
    ("kvcmas", lambda c: c()),
):
    cls = KVCMAS if label == "kvcmas" else FullShared
    methods = {"generate": make(cls), "build": make(prefilling(cls))}
    ttft: dict[str, list[float]] = {k: [] for k in methods}
    for i, flow in enumerate(flows):
        outputs = {}
        for where, method in methods.items():
            turns = run_workflow(Session(model, tok, method), flow)
            outputs[where] = [t.output_ids.tolist() for t in turns]
            if i:  # the first request warms up (pools, kept prefixes)
                ttft[where] += [t.ttft_s for t in turns[1:]]
            print(
                f"{label} request {i} tail in {where}: reuse-turn TTFT",
                [round(t.ttft_s, 3) for t in turns[1:]],
                "rho",
                [round(t.reuse_ratio, 2) for t in turns[1:]],
                flush=True,
            )
        print(
            f"{label} request {i}: same output tokens: {outputs['generate'] == outputs['build']}", flush=True
        )
    g, b = statistics.mean(ttft["generate"]), statistics.mean(ttft["build"])
    print(f"{label}: mean reuse-turn TTFT tail in generate {g:.3f} s, in build {b:.3f} s, ratio {g / b:.2f}")

"""Reuse-turn TTFT of the trace workload per method, one request at a time (single stream).

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 [SHARED=2048] [OUT=32] python benchmarks/reuse_ttft.py

Runs 4 requests of the trace workload (3 agents, SHARED shared tokens, OUT output tokens) through
``fullshared``, ``fullshared:prefix_reuse=True`` and ``kvcmas``, request by request, and prints the
reuse turns' TTFT of the last two requests (the first two warm up pools and kept prefixes) and a
digest of every method's output tokens (equal digests: the same tokens). For an A/B of two commits,
run it against each checkout in turn (``PYTHONPATH=CHECKOUT``), alternating, on a quiet machine.
Not a benchmark (``hf-kvshare bench run`` is): a quick like-for-like check of a placement change.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics

import torch

from hf_kvshare import Session, get_method, load_model, run_workflow
from hf_kvshare.bench.workloads.trace import TraceWorkload

torch.set_num_threads(1)
shared = int(os.environ.get("SHARED", "2048"))
output = int(os.environ.get("OUT", "32"))
model, tok = load_model()
workload = TraceWorkload(shared_tokens=shared, agents=3, rounds=1, output_tokens=output, requests=4)
flows = [t.to_workflow(tok) for t in workload.tasks(tok)]
methods = {
    "fullshared": get_method("fullshared"),
    "fullshared:prefix_reuse=True": get_method("fullshared", prefix_reuse=True),
    "kvcmas": get_method("kvcmas"),
}
ttft: dict[str, list[float]] = {name: [] for name in methods}
outputs: dict[str, list] = {name: [] for name in methods}
for i, flow in enumerate(flows):
    for name, method in methods.items():
        turns = run_workflow(Session(model, tok, method), flow)
        outputs[name].append([t.output_ids.tolist() for t in turns])
        if i >= 2:
            ttft[name] += [t.ttft_s for t in turns[1:]]
for name, times in ttft.items():
    print(
        f"{name}: reuse TTFT {[round(x, 3) for x in times]} "
        f"mean {statistics.mean(times):.3f} median {statistics.median(times):.3f}"
    )
digests = {name: hashlib.sha1(json.dumps(o).encode()).hexdigest()[:10] for name, o in outputs.items()}
print("outputs digest", digests)

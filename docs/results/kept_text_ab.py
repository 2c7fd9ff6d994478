"""A first agent's kept system text computed with its new document, against placing it (trace workload).

    OMP_NUM_THREADS=1 python docs/results/kept_text_ab.py [SHARED_TOKENS] [OUTPUT_TOKENS] [REQUESTS]   # 2048 16 4

With prefix reuse, a request's first agent finds its system text kept from the previous request and
its document new: placing the text makes the document's dense prefill a forward from behind it, to
which transformers gives SDPA an explicit ``[q, kv]`` mask (the whole query x key rectangle computed).
``Method.build`` now computes the text with the document where that is cheaper
(``prefill.recompute_is_cheaper``). For ``fullshared:prefix_reuse=True`` and ``kvcmas`` this runs the
same requests both ways, alternating request by request, each way with its own method instance:
``computed`` (the session as it is) and ``placed`` (the rule off: ``recompute_is_cheaper`` patched to
say no inside ``hf_kvshare.method``). Prints per request the first agent's TTFT, the reuse turns'
TTFT and the request's E2E, whether the output tokens are equal, then the means over the requests
after the first (which keeps nothing yet, so both ways run the same path). Not a benchmark: run it
alone on the machine.
"""

from __future__ import annotations

import statistics
import sys
from contextlib import nullcontext
from unittest import mock

import torch

from hf_kvshare import Session, load_model
from hf_kvshare.bench.workloads.trace import TraceWorkload
from hf_kvshare.evaluation.workflow import run_workflow
from hf_kvshare.methods.fullshared import FullShared
from hf_kvshare.methods.kvcmas import KVCMAS

torch.set_num_threads(1)
shared = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
output = int(sys.argv[2]) if len(sys.argv) > 2 else 16
requests = int(sys.argv[3]) if len(sys.argv) > 3 else 4
model, tok = load_model()
workload = TraceWorkload(shared_tokens=shared, agents=3, rounds=1, output_tokens=output, requests=requests)
flows = [t.to_workflow(tok) for t in workload.tasks(tok)]

for label, make in (
    ("fullshared:prefix_reuse=True", lambda: FullShared(prefix_reuse=True)),
    ("kvcmas", KVCMAS),
):
    methods = {"computed": make(), "placed": make()}
    first: dict[str, list[float]] = {k: [] for k in methods}
    reuse: dict[str, list[float]] = {k: [] for k in methods}
    e2e: dict[str, list[float]] = {k: [] for k in methods}
    for i, flow in enumerate(flows):
        outputs = {}
        for way, method in methods.items():
            off = mock.patch("hf_kvshare.method.recompute_is_cheaper", return_value=False)
            with off if way == "placed" else nullcontext():
                turns = run_workflow(Session(model, tok, method), flow)
            outputs[way] = [t.output_ids.tolist() for t in turns]
            rows = turns[0].segments
            if i:
                first[way].append(turns[0].ttft_s)
                reuse[way] += [t.ttft_s for t in turns[1:]]
                e2e[way].append(sum(t.e2e_s for t in turns))
            print(
                f"{label} request {i} {way}: first agent TTFT {turns[0].ttft_s:.3f} s "
                f"(its text {rows[0].provenance}{' recomputed' if rows[0].info.get('prefix_recomputed') else ''}), "
                f"reuse turns {[round(t.ttft_s, 3) for t in turns[1:]]}, E2E {sum(t.e2e_s for t in turns):.2f} s, "
                f"rho {[round(t.reuse_ratio, 2) for t in turns[1:]]}",
                flush=True,
            )
        print(
            f"{label} request {i}: same output tokens: {outputs['computed'] == outputs['placed']}", flush=True
        )
    for name, values in (("first-agent TTFT", first), ("reuse-turn TTFT", reuse), ("E2E per request", e2e)):
        c, p = statistics.mean(values["computed"]), statistics.mean(values["placed"])
        print(f"{label}: mean {name}: computed {c:.3f} s, placed {p:.3f} s, ratio {c / p:.2f}")

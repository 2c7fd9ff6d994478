"""Where a FullShared reuse turn spends its TTFT (trace, 2,048 shared tokens): cProfile of one request.

    OMP_NUM_THREADS=1 python benchmarks/profile_fullshared.py [SHARED_TOKENS]   # default 2048

Runs one request of the trace workload (3 agents, 1 output token) to warm up, then profiles the next
request and prints each turn's TTFT and the 45 most expensive calls by cumulative time. What to read:
``prefill.py:_one_forward`` (the dense tokens, interleaved with the placed segment: one forward),
``generation/utils.py:_prefill`` (generate's own forward over the prompt's last token),
``cache.py:reserve`` / ``rope.py:apply`` / ``torch.cat`` (placing the segment). Not a benchmark: run
it alone on the machine.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from hf_kvshare import Session, get_method, load_model, run_workflow
from hf_kvshare.bench.workloads.trace import TraceWorkload

torch.set_num_threads(1)
shared = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
model, tok = load_model()
workload = TraceWorkload(shared_tokens=shared, agents=3, rounds=1, output_tokens=1, requests=2)
flows = [t.to_workflow(tok) for t in workload.tasks(tok)]
method = get_method("fullshared")
run_workflow(Session(model, tok, method), flows[0])
profile = cProfile.Profile()
profile.enable()
turns = run_workflow(Session(model, tok, method), flows[1])
profile.disable()
for turn in turns:
    print(
        f"{turn.agent}: TTFT {turn.ttft_s:.3f} s, {turn.tokens_prefilled} prefilled, {turn.tokens_reused} reused"
    )
pstats.Stats(profile).sort_stats("cumulative").print_stats(45)

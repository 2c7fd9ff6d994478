"""Where a KVCMAS reuse turn spends its time beyond FullShared's (controlled trace, one length).

    OMP_NUM_THREADS=1 python benchmarks/profile_kvcmas.py [SHARED_TOKENS]   # default 2048

Runs 4 requests of the trace workload (3 agents, 32 output tokens) with
``fullshared:prefix_reuse=True`` and the default ``kvcmas``, one instance each; for the last two
requests (the first two warm up the anchor pools and kept prefixes) prints every reuse turn's TTFT
and, from a cProfile of those requests, the cumulative seconds of the correction's functions:
``gate_distances``, ``token_distances``, ``apply_correction`` and ``write_layer`` / the
materialization of a corrected K/V (where the correction is computed: it is written where the cache
lays it out). ``token_distances`` mostly runs in records, primed for the next turn, not in a TTFT.
Public API only (the session, the registry, the trace workload); the profiler's overhead inflates
the absolute seconds a little. Not a benchmark: run it alone on the machine.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from hf_kvshare import Session, get_method, load_model, run_workflow
from hf_kvshare.bench.workloads.trace import TraceWorkload

#: the functions reported (matched by name wherever they live)
WATCHED = ("gate_distances", "token_distances", "apply_correction", "write_layer", "materialize")


def seconds_in(profile: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds of the :data:`WATCHED` functions in ``profile``."""
    found: dict[str, float] = {}
    for (_file, _line, name), (_cc, _nc, _tt, cumulative, _callers) in pstats.Stats(profile).stats.items():
        for watched in WATCHED:
            if watched in name:
                found[name] = found.get(name, 0.0) + cumulative
    return found


def main() -> None:
    torch.set_num_threads(1)
    shared = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    model, tok = load_model()
    workload = TraceWorkload(shared_tokens=shared, agents=3, rounds=1, output_tokens=32, requests=4)
    flows = [task.to_workflow(tok) for task in workload.tasks(tok)]
    for label in ("fullshared:prefix_reuse=True", "kvcmas"):
        name, _, options = label.partition(":")
        method = get_method(name, prefix_reuse=True) if options else get_method(name)
        profile = cProfile.Profile()
        for i, flow in enumerate(flows):
            measured = i >= 2
            if measured:
                profile.enable()
            turns = run_workflow(Session(model, tok, method), flow)
            if measured:
                profile.disable()
                print(
                    f"{label} request {i}: reuse-turn TTFT",
                    [round(t.ttft_s, 3) for t in turns[1:]],
                    "rho",
                    [round(t.reuse_ratio, 2) for t in turns[1:]],
                )
        found = seconds_in(profile)
        print(f"{label}: seconds in", {k: round(v, 3) for k, v in sorted(found.items())} or "-")


if __name__ == "__main__":
    main()

"""Test helper: the three-agent coding workflow of the KVCMAS tests (``test_kvcmas.py``,
``test_end_to_end.py``, ``test_host_syncs.py``, ``test_memory.py``, ``test_deferred_factorization.py``):
each request a fresh Session, each agent reading the query and the earlier agents' outputs."""

from __future__ import annotations

from hf_kvshare import PF, PH, Session
from hf_kvshare.methods.kvcmas import KVCMAS
from hf_kvshare.methods.kvcmas_nonchained import KVCMASNonChained
from hf_kvshare.methods.kvcomm import KVComm

AGENTS = ["planner", "designer", "coder"]
QUERIES = [
    "Sort a list of numbers and explain the complexity of the algorithm.",
    "Compute the sum of all prime numbers below fifty, step by step.",
    "Write a short poem about the sea, the moon and a lighthouse.",
]
#: the options that keep the earlier (per-edge, prefix, chained-output) behaviour of each method
EDGE = dict(gate_scope="edge", match="prefix", skip_layer0=False, svd="exact", pool_peak="capacity")
PREVIOUS = {
    KVCMAS: dict(EDGE, output_source="chained"),
    KVCMASNonChained: dict(EDGE, output_source="context_free", text_source="context_free"),
    KVComm: dict(EDGE, output_source="context_free", text_source="context_free"),
}


def turn_segments(i: int, query: str | None):
    agent = AGENTS[i]
    segments = [PF(f"You are the {agent}; role number {i}.\n"), PH("query", query)]
    for earlier in AGENTS[:i]:
        segments += [PF(f"\nNotes from the {earlier}: "), PH(earlier)]
    segments.append(PF("\nAnswer:"))
    return segments


def run_request(model, tok, method, query, forced=None, keep_cache=False, new_tokens=3):
    session = Session(model, tok, method)
    return [
        session.run_turn(
            agent,
            turn_segments(i, query),
            max_new_tokens=new_tokens,
            force_output=None if forced is None else forced[i],
            keep_cache=keep_cache,
        )
        for i, agent in enumerate(AGENTS)
    ]


def run_forced(model, tok, method, query, reference):
    return run_request(model, tok, method, query, forced=[t.output_ids for t in reference], keep_cache=True)

"""KVCMAS on the embedded SmolLM2-135M model (marked: real_model)."""

from __future__ import annotations

import pytest

from hf_kvshare import PF, PH, Session
from hf_kvshare.evaluation.metrics import kv_error, mean_kl
from hf_kvshare.methods.kvcmas import KVCMAS
from hf_kvshare.methods.kvcmas_nonchained import KVCMASNonChained

pytestmark = pytest.mark.real_model
#: the earlier reading (per-edge gates over a prefix, chained outputs / context-free references)
EDGE = dict(gate_scope="edge", match="prefix", skip_layer0=False, svd="exact", pool_peak="capacity")

ROLES = {
    "planner": "You are a careful planner. Break the task into short numbered steps.\n",
    "coder": "You are a Python expert. Write clean, correct Python code for the task.\n",
}
QUERIES = [
    'def add(a: int, b: int) -> int:\n    """ Return the sum of a and b. """',
    'def is_even(n: int) -> bool:\n    """ Return True when n is even. """',
    'def reverse(s: str) -> str:\n    """ Return s reversed, for example \'abc\' -> \'cba\'. """',
]


def request(model, tok, method, query):
    """Two agents; every output is teacher-forced to the same short text (one forward per turn)."""
    forced = tok(" 1. Read the task. 2. Write it.", add_special_tokens=False).input_ids
    session = Session(model, tok, method)
    turns = []
    for i, agent in enumerate(ROLES):
        segments = [PF(ROLES[agent] + "Task:\n"), PH("query", query)]
        if i:
            segments += [PF("\nPlan:\n"), PH("planner")]
        segments.append(PF("\nAnswer:"))
        turns.append(
            session.run_turn(
                agent,
                segments,
                max_new_tokens=3,
                force_output=None if forced is None else forced[i],
                keep_cache=True,
            )
        )
    return turns


def test_identical_requests_are_corrected_exactly_through_all_layers(real):
    model, tok = real
    exact = request(model, tok, "nonshared", QUERIES[0])
    method = KVCMAS(tau=1.0)
    for _ in range(3):
        got = request(model, tok, method, QUERIES[0])
    seg = got[1].cache.segment("query")
    assert seg.provenance == "corrected" and seg.source_agent == "planner"
    for s in got[1].cache.placeholders():
        assert kv_error(got[1].cache, exact[1].cache, s.start, s.end) < 1e-4
    assert got[1].logits.argmax(-1).tolist() == exact[1].logits.argmax(-1).tolist()


def test_chained_correction_beats_nonchained_on_new_content(real):
    """After two requests fill the pools, a new request is corrected by both; chaining keeps the first
    agent exact and the second agent's query much closer to the exact cache (paper Fig. 3b)."""
    model, tok = real
    chained = KVCMAS(**EDGE, output_source="chained")
    nonchained = KVCMASNonChained(**EDGE, output_source="context_free", text_source="context_free")
    for query in QUERIES[:2]:
        for method in (chained, nonchained):
            request(model, tok, method, query)
    exact = request(model, tok, "nonshared", QUERIES[2])
    a = request(model, tok, chained, QUERIES[2])
    b = request(model, tok, nonchained, QUERIES[2])
    # on the real model the gate distances are far apart: the gate accepts at the default tau
    seg = a[1].cache.segment("query")
    assert seg.provenance == "corrected" and seg.info["entropy"] <= 0.3
    assert a[0].cache.segment("query").provenance == "dense"  # the first agent stays exact
    assert b[0].cache.segment("query").provenance == "corrected"  # non-chained corrects it too
    q = exact[1].cache.segment("query")
    err_chained = kv_error(a[1].cache, exact[1].cache, q.start, q.end)
    err_nonchained = kv_error(b[1].cache, exact[1].cache, q.start, q.end)
    assert 0 < err_chained < 0.5 * err_nonchained, (err_chained, err_nonchained)
    assert mean_kl(exact[1].logits, a[1].logits) < mean_kl(exact[1].logits, b[1].logits)

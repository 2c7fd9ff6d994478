"""Selective recomputation on the embedded SmolLM2-135M model (marked: real_model)."""

from __future__ import annotations

import pytest

from hf_kvshare import PH, Session, chat
from hf_kvshare.evaluation import Step, Workflow, calibrate_droidspeak
from hf_kvshare.evaluation.metrics import kv_error
from hf_kvshare.methods import CacheBlend, DroidSpeak, RelayCaching

pytestmark = pytest.mark.real_model

QUERY = "Write a Python function that checks whether a string is a palindrome, ignoring case."
CALIBRATION_QUERY = "Write a Python function that returns the largest of three numbers."


def steps(tok, query):
    planner = chat(
        tok,
        [
            {"role": "system", "content": "You are a careful planner. List the steps."},
            {"role": "user", "content": ["Task:\n", PH("query", query)]},
        ],
    )
    coder = chat(
        tok,
        [
            {"role": "system", "content": "You are a Python expert. Write the code."},
            {"role": "user", "content": ["Task:\n", PH("query", query), "\n\nPlan:\n", PH("planner")]},
        ],
    )
    return [("planner", planner), ("coder", coder)]


def run(model, tok, method, forced=None, n=12):
    session = Session(model, tok, method)
    return [
        session.run_turn(
            agent,
            segments,
            max_new_tokens=n,
            keep_cache=True,
            force_output=None if forced is None else forced[i],
        )
        for i, (agent, segments) in enumerate(steps(tok, QUERY))
    ]


def ph_error(turn, reference):
    segments = [s for s in turn.cache.segments if s.kind == "PH"]
    return sum(kv_error(turn.cache, reference.cache, s.start, s.end) for s in segments) / len(segments)


def test_recomputation_on_the_embedded_model(real):
    model, tok = real
    exact = run(model, tok, "nonshared")
    # rho = 0: every entry recomputed through the layer-by-layer machinery = NonShared, token for token
    dense = run(model, tok, CacheBlend(rho=0.0))
    assert [t.output_ids.tolist() for t in dense] == [t.output_ids.tolist() for t in exact]
    assert ph_error(dense[1], exact[1]) < 1e-4

    forced = [t.output_ids for t in exact]
    full = run(model, tok, "fullshared", forced=forced)
    droidspeak = DroidSpeak(rho=0.9)
    calibration = Workflow(
        [Step(agent, segments) for agent, segments in steps(tok, CALIBRATION_QUERY)], max_new_tokens=8
    )
    profile = calibrate_droidspeak(droidspeak, model, tok, [calibration])
    assert len(profile) == 30 and profile[0] < 1e-8 < max(profile)
    base = ph_error(full[1], exact[1])
    assert base > 1e-3
    for method in (CacheBlend(rho=0.9), RelayCaching(rho=0.9), droidspeak):
        got = run(model, tok, method, forced=forced)
        assert 0.85 < got[1].reuse_ratio < 0.95, (method, got[1].reuse_ratio)
        assert ph_error(got[1], exact[1]) < base, method  # recomputing 10% of the entries removes some error

"""Hardening (issue 13, items 1-7): threads, one model per method instance, caches bound to their
model, finite K/V, failed turns that mutate nothing, bounded cross-request state, clear errors."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny import STEPS, tiny_model

from hf_kvshare import METHODS, Session
from hf_kvshare._compat import cache_kwargs

# ---------------------------------------------------------------- 1. threads

THREAD_METHODS = {
    "nonshared": {},
    "cacheblend": {"rho": 0.5},
    "droidspeak": {"rho": 0.4, "layer_profile": [0.0, 2.0, 0.5, 1.0]},
    "relaycaching": {"rho": 0.5},
    "fullshared": {},
    "kvcmas": {},
    "kvcomm": {},
    "graphflow": {},
}


def _workflow(model, tokenizer, method, request: int) -> list[list[int]]:
    session = Session(model, tokenizer, METHODS[method](**THREAD_METHODS[method]))
    out = []
    for agent, segments in STEPS:
        segments = [s for s in segments]
        result = session.run_turn(agent, segments, max_new_tokens=4 + request % 3)
        out.append(result.output_ids.tolist())
    return out


def test_sessions_on_one_model_in_threads_equal_a_sequential_run(tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    jobs = [(method, r) for r in range(2) for method in THREAD_METHODS]
    expected = {job: _workflow(model, tokenizer, *job) for job in jobs}
    got: dict = {}
    errors: list = []
    barrier = threading.Barrier(2)

    def worker(my_jobs):
        barrier.wait()
        try:
            for _ in range(2):
                for job in my_jobs:
                    got.setdefault(job, []).append(_workflow(model, tokenizer, *job))
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(jobs[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    wrong = [job for job, runs in got.items() if any(run != expected[job] for run in runs)]
    assert not wrong, f"{len(wrong)} of {len(got)} requests differ from the sequential run: {wrong}"


# ---------------------------------------------------------------- 2. one model per method instance


@pytest.mark.parametrize("name", [n for n, c in METHODS.items() if not c.requires_adapters])
def test_a_method_instance_refuses_a_second_model(name, tokenizer):
    first, second = (
        tiny_model("llama", seed=3, num_hidden_layers=4),
        tiny_model("llama", seed=4, num_hidden_layers=4),
    )
    method = METHODS[name](**THREAD_METHODS.get(name, {}))
    Session(first, tokenizer, method).run_turn(*STEPS[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="bound to .* cannot be used with"):
        Session(second, tokenizer, method)
    Session(first, tokenizer, method).run_turn(*STEPS[0], max_new_tokens=2)  # the first model still works


# ---------------------------------------------------------------- 3. caches bound to their model


def test_a_cache_refuses_another_model_in_generate(tokenizer):
    four = tiny_model("llama", seed=3, num_hidden_layers=4)
    three = tiny_model("llama", seed=3, num_hidden_layers=3)  # same head shape, one layer less
    other = tiny_model("llama", seed=5, num_hidden_layers=4)  # same shape, other weights
    cache, prompt = Session(four, tokenizer, "fullshared").build_cache(*STEPS[0])
    for model in (three, other):
        with pytest.raises(ValueError, match="cache/model mismatch"):
            model.generate(input_ids=prompt, **cache_kwargs(cache.copy()), max_new_tokens=2, do_sample=False)
    assert cache.get_seq_length() == prompt.shape[1] - 1  # refused before anything was written
    with pytest.raises(ValueError, match="cache/model mismatch"):
        cache.copy().append_dense(other, prompt[0, -1:])
    # the same weights in another object are the same model
    twin = tiny_model("llama", seed=3, num_hidden_layers=4)
    out = twin.generate(input_ids=prompt, **cache_kwargs(cache.copy()), max_new_tokens=3, do_sample=False)
    plain = four.generate(input_ids=prompt, max_new_tokens=3, do_sample=False)
    assert out.tolist() == plain.tolist()


# ---------------------------------------------------------------- 4./5. non-finite K/V, failed turns


def _state(session, method) -> tuple:
    """Everything a failed turn must leave as it was: slots, their K/V, turns, pools and counters."""
    slots = tuple(
        (name, slot.token_ids.tolist(), None if slot.latest is None else id(slot.latest))
        for name, slot in sorted(session.slots.items())
    )
    pools = getattr(method, "pools", {})
    anchors = tuple(
        (key, tuple((a.serial, a.uses, tuple(sorted(a.deltas))) for a in pool))
        for key, pool in sorted(pools.items())
    )
    profiles = tuple(sorted((k, tuple(p.requests)) for k, p in getattr(method, "profiles", {}).items()))
    requests = getattr(method, "_requests", None)
    decisions = None
    if requests is not None:
        state = requests.get(session)
        decisions = (tuple(sorted(state.decisions)), tuple(sorted(state.gate_reports)))
    return slots, len(session.turns), method.state_bytes(), anchors, profiles, decisions


@pytest.mark.parametrize("name", ["fullshared", "kvcmas", "kvcomm"])
def test_non_finite_kv_is_never_reused_or_pooled(name, tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    method = METHODS[name](**THREAD_METHODS.get(name, {}))
    for _ in range(2):  # earlier requests: pools hold anchors
        session = Session(model, tokenizer, method)
        for agent, segments in STEPS:
            session.run_turn(agent, segments, max_new_tokens=3)
    session = Session(model, tokenizer, method)
    session.run_turn(*STEPS[0], max_new_tokens=3)
    session.slots["first"].latest.keys[2][..., 1, 0] = float(
        "nan"
    )  # the output's K/V: every method reuses it
    before = _state(session, method)
    with pytest.raises(ValueError, match=r"PH slot 'first'.*non-finite K/V .* layer 2 \(keys\)"):
        session.run_turn(*STEPS[1], max_new_tokens=3)
    assert _state(session, method) == before


def test_non_finite_output_never_becomes_a_source_or_an_anchor(tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    with torch.no_grad():  # a model that yields inf K/V at layer 1 for every token
        model.model.layers[1].self_attn.v_proj.bias = torch.nn.Parameter(torch.full((32,), float("inf")))
    for name in ("kvcmas", "kvcomm", "graphflow"):
        method = METHODS[name]()
        session = Session(model, tokenizer, method)
        before = _state(session, method)
        with pytest.raises(ValueError, match=r"non-finite K/V .* layer 1 \(values\)"):
            for agent, segments in STEPS[:2]:
                session.run_turn(agent, segments, max_new_tokens=2)
        assert (
            method.state_bytes() == 0
            and not getattr(method, "pools", {})
            and not getattr(method, "profiles", {})
        )
        del before


class _Boom(Exception):
    pass


def _boom(input_ids, scores):
    raise _Boom("failed inside generate")


@pytest.mark.parametrize("name", ["kvcmas", "kvcomm", "graphflow"])
def test_a_turn_failing_inside_generate_changes_nothing(name, tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    options = {"tau": 1.0} if name != "graphflow" else {"calibration_requests": 1}
    method = METHODS[name](**options)
    for _ in range(3):  # pools fill up; the gate (tau = 1) then accepts
        session = Session(model, tokenizer, method)
        for agent, segments in STEPS:
            session.run_turn(agent, segments, max_new_tokens=3)
    session = Session(model, tokenizer, method)
    session.run_turn(*STEPS[0], max_new_tokens=3)
    before = _state(session, method)
    with pytest.raises(_Boom):
        session.run_turn(*STEPS[1], max_new_tokens=3, logits_processor=[_boom])
    assert _state(session, method) == before
    result = session.run_turn(*STEPS[1], max_new_tokens=3)  # the same turn then runs normally
    assert any(seg.provenance == "corrected" for seg in result.segments)

"""Non-finite K/V is never reused, pooled or recorded (check_finite names the first bad tensor), and a
turn that fails (non-finite K/V, an error inside generate) leaves the session and the method's state
as they were: slots, their K/V, turns, pools, profiles, gate decisions; the same turn then runs."""

from __future__ import annotations

import pytest
import torch
from tiny import METHOD_OPTIONS, STEPS, tiny_model

from hf_kvshare import METHODS, Session


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_names_the_first_bad_tensor_in_every_dtype(dtype, bad):
    from hf_kvshare.cache import SegmentKV, check_finite

    def kv(n):
        return SegmentKV(
            keys=[torch.randn(1, 2, n, 4, dtype=dtype) * 1e3 for _ in range(3)],
            values=[torch.randn(1, 2, n, 4, dtype=dtype) for _ in range(3)],
            start=0,
        )

    good, empty, broken = kv(5), kv(0), kv(5)
    check_finite([("good", good), ("empty", empty)])  # large finite values and empty tensors pass
    broken.values[1][0, 1, 3, 2] = bad
    broken.keys[2][0, 0, 0, 0] = bad
    with pytest.raises(ValueError, match=r"^broken: non-finite K/V \(NaN or inf\) in layer 1 \(values\)"):
        check_finite([("good", good), ("empty", empty), ("broken", broken)])


@pytest.mark.parametrize("name", ["fullshared", "kvcmas", "kvcomm"])
def test_non_finite_kv_is_never_reused_or_pooled(name, tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    method = METHODS[name](**METHOD_OPTIONS.get(name, {}))
    for _ in range(2):  # earlier requests: pools hold anchors
        session = Session(model, tokenizer, method)
        for agent, segments in STEPS:
            session.run_turn(agent, segments, max_new_tokens=3)
    session = Session(model, tokenizer, method)
    session.run_turn(*STEPS[0], max_new_tokens=3)
    output = session.slots["first"].latest  # the output's K/V: every method reuses it
    if output is None:  # freed by the session: the method holds the producer's cache (kvcmas, kvcomm)
        output = method._requests.get(session).produced["first"]
    output.keys[2][..., 1, 0] = float("nan")
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


@pytest.mark.parametrize(
    "name, options, failing",
    [
        ("kvcomm", {"tau": 1.0}, 0),  # the query's first consumer gates it while building
        ("kvcmas", {"tau": 1.0, "gate_scope": "edge"}, 1),  # every edge gated while building
        ("kvcmas", {"tau": 1.0}, 1),
        ("graphflow", {"calibration_requests": 1}, 1),
    ],
)
def test_a_turn_failing_inside_generate_changes_nothing(name, options, failing, tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    method = METHODS[name](**options)
    for _ in range(3):  # pools fill up; the gate (tau = 1) then accepts
        session = Session(model, tokenizer, method)
        for agent, segments in STEPS:
            session.run_turn(agent, segments, max_new_tokens=3)
    session = Session(model, tokenizer, method)
    for agent, segments in STEPS[:failing]:
        session.run_turn(agent, segments, max_new_tokens=3)
    before = _state(session, method)
    with pytest.raises(_Boom):
        session.run_turn(*STEPS[failing], max_new_tokens=3, logits_processor=[_boom])
    assert _state(session, method) == before
    result = session.run_turn(*STEPS[failing], max_new_tokens=3)  # the same turn then runs normally
    assert any(seg.provenance == "corrected" for seg in result.segments)

"""KVCMAS, its non-chained ablation, KVComm and GraphFlow through Sessions on tiny random models."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from anchor_helpers import make_anchor, random_kv
from kvcmas_workflow import AGENTS, PREVIOUS, QUERIES, run_forced, run_request, turn_segments
from tiny import tiny_model

from hf_kvshare import METHODS, PF, PH, Session
from hf_kvshare.anchors import CorrectedCache, to_heads
from hf_kvshare.anchors.correction import guard_estimate
from hf_kvshare.anchors.lowrank import FactoredKV
from hf_kvshare.anchors.pool import Anchor
from hf_kvshare.anchors.slot_scope import SlotScope
from hf_kvshare.evaluation.metrics import kv_error
from hf_kvshare.methods.graphflow import GraphFlow
from hf_kvshare.methods.kvcmas import KVCMAS
from hf_kvshare.methods.kvcmas_nonchained import KVCMASNonChained
from hf_kvshare.methods.kvcomm import KVComm

ANCHOR_METHODS = [KVCMAS, KVCMASNonChained, KVComm]


def test_registry_and_defaults_are_the_papers():
    assert {"kvcmas", "kvcmas-nonchained", "kvcomm", "graphflow"} <= set(METHODS)
    m = METHODS["kvcmas"]()
    assert (m.base_rank, m.delta_rank, m.capacity, m.tau, m.temperature, m.eviction_window) == (
        32,
        32,
        10,
        0.3,
        1.0,
        5,
    )
    c = METHODS["kvcomm"]()
    assert (c.base_rank, c.delta_rank, c.capacity, c.tau) == (None, None, 20, 0.3)
    assert KVCMAS.chained and not KVCMASNonChained.chained and not KVComm.chained
    assert repr(KVCMAS(delta_rank=8)).startswith("KVCMAS(base_rank=32, delta_rank=8")


def check_exact_without_reuse(model, tok, cls):
    exact = [run_request(model, tok, "nonshared", q) for q in QUERIES[:2]]
    method = cls() if cls is GraphFlow else cls(tau=0.0)
    for query, ref in zip(QUERIES[:2], exact):  # the pools fill, tau = 0 accepts nothing
        got = run_request(model, tok, method, query)
        assert [t.output_ids.tolist() for t in got] == [t.output_ids.tolist() for t in ref]
        assert all(t.reuse_ratio == 0.0 for t in got)
    if cls is not GraphFlow:
        assert method.state_bytes() > 0 and all(len(p) >= 1 for p in method.pools.values())
        # first request on an empty pool at the default tau: also exact
        got = run_request(model, tok, cls(), QUERIES[0])
        assert [t.output_ids.tolist() for t in got] == [t.output_ids.tolist() for t in exact[0]]


def test_kvcmas_empty_pool_and_tau_zero_reproduce_nonshared_token_for_token(tiny, tokenizer):
    check_exact_without_reuse(tiny, tokenizer, KVCMAS)


@pytest.mark.parametrize("cls", [KVCMASNonChained, KVComm, GraphFlow])
def test_baselines_without_reuse_reproduce_nonshared_token_for_token(tiny_llama, tokenizer, cls):
    check_exact_without_reuse(tiny_llama, tokenizer, cls)


def exact_forced(model, tok, query):
    """NonShared's turns teacher-forced on its own outputs (logits and exact caches kept)."""
    return run_forced(model, tok, "nonshared", query, run_request(model, tok, "nonshared", query))


@pytest.mark.parametrize(
    "cls, previous, expected",
    [(KVCMAS, False, 5), (KVCMASNonChained, False, 5), (KVComm, False, 6)]
    + [(KVCMAS, True, 5), (KVCMASNonChained, True, 6), (KVComm, True, 6)],
)
def test_identical_requests_are_corrected_exactly(tiny_llama, tokenizer, cls, previous, expected):
    """Two earlier requests with the same content give identical anchors, so the correction of a
    third is the exact delta (any convex combination of equal deltas): the cache equals NonShared's."""
    ref = exact_forced(tiny_llama, tokenizer, QUERIES[0])
    method = cls(
        tau=1.0, **(PREVIOUS[cls] if previous else {})
    )  # identical anchors: uniform weights, entropy 1
    for _ in range(2):
        run_forced(tiny_llama, tokenizer, method, QUERIES[0], ref)
    got = run_forced(tiny_llama, tokenizer, method, QUERIES[0], ref)
    corrected = 0
    for turn, exact in zip(got, ref):
        assert isinstance(turn.cache, CorrectedCache)
        for seg in turn.cache.placeholders():
            assert kv_error(turn.cache, exact.cache, seg.start, seg.end) < 1e-4, (turn.agent, seg)
            corrected += seg.provenance == "corrected"
        assert torch.allclose(turn.logits, exact.logits, atol=1e-3)
    # KVCMAS (chained or star): the first agent's query is dense (exact); a reference prefill
    # (KVComm, the earlier non-chained reading) is corrected for the first agent too
    assert corrected == expected  # 1 + 2 + 3 PH segments


@pytest.mark.parametrize("cls", [KVCMAS, KVComm])
def test_a_session_writes_corrections_into_the_turn_cache_never_whole_beside_it(
    tiny_llama, tokenizer, monkeypatch, cls
):
    """A corrected segment reaches the turn's cache layer by layer (``CorrectedKV.write_layer`` in the
    cache's slots): no turn materializes one, and every turn's cache and logits are the ones a
    correction computed whole first gives (the generic path, forced), bit for bit."""
    from hf_kvshare.anchors.corrected import CorrectedKV

    ref = exact_forced(tiny_llama, tokenizer, QUERIES[0])
    whole = []
    inner = CorrectedKV._materialize
    monkeypatch.setattr(CorrectedKV, "_materialize", lambda self: whole.append(self) or inner(self))

    def requests():
        method = cls(tau=1.0)
        return [run_forced(tiny_llama, tokenizer, method, QUERIES[0], ref) for _ in range(3)]

    in_place = requests()
    corrected = sum(
        seg.provenance == "corrected" for req in in_place for t in req for seg in t.cache.placeholders()
    )
    assert corrected >= 5 and whole == []
    monkeypatch.setattr(CorrectedKV, "deferred", False)  # every part read as plain K/V
    generic = requests()
    assert len(whole) == corrected
    for a_req, b_req in zip(in_place, generic):
        for a, b in zip(a_req, b_req):
            assert a.cache.segments == b.cache.segments and torch.equal(a.logits, b.logits)
            for layer in range(a.cache.num_layers):
                assert all(
                    torch.equal(x, y) for x, y in zip(a.cache.layer_kv(layer), b.cache.layer_kv(layer))
                )


def test_chained_and_nonchained_coincide_when_corrections_are_exact(tiny_llama, tokenizer):
    ref = exact_forced(tiny_llama, tokenizer, QUERIES[1])
    caches = {}
    for cls in (KVCMAS, KVCMASNonChained):
        method = cls(tau=1.0)
        for _ in range(2):
            run_forced(tiny_llama, tokenizer, method, QUERIES[1], ref)
        caches[cls.name] = run_forced(tiny_llama, tokenizer, method, QUERIES[1], ref)
    for a, b in zip(caches["kvcmas"], caches["kvcmas-nonchained"]):
        for seg in a.cache.placeholders():
            assert kv_error(a.cache, b.cache, seg.start, seg.end) < 1e-4
        assert a.logits.argmax(-1).tolist() == b.logits.argmax(-1).tolist()


def test_provenance_recorded_and_reported(tiny_llama, tokenizer):
    method = KVCMAS(tau=1.0, **PREVIOUS[KVCMAS])  # per-edge gate over a prefix (earlier reading)
    for query in QUERIES:
        got = run_request(tiny_llama, tokenizer, method, query, keep_cache=True)
    planner, designer = got[0].cache, got[1].cache
    assert planner.segment("query").provenance == "dense" and planner.segment("query").info["gate"] == "first"
    seg = designer.segment("query")
    assert seg.provenance == "corrected" and seg.source_agent == "planner"
    assert seg.info["gate"] == "accepted" and 0.0 <= seg.info["entropy"] <= 1.0
    assert len(seg.info["anchors"]) == len(seg.info["weights"]) >= 2
    assert sum(seg.info["weights"]) == pytest.approx(1.0)
    rows, total = map(int, seg.info["rows"].split("/"))  # queries differ in length: prefix rule
    assert total == seg.length and 1 <= rows <= total
    assert got[1].reuse_ratio > 0 and got[1].tokens_reused == sum(
        s.length for s in designer.placeholders() if s.provenance == "corrected"
    )
    text = str(designer)
    assert (
        "CorrectedCache (kvcmas)" in text
        and "2 corrected, 0 reused, 0 gate fallback, 0 other dense" in text
        and "gate=accepted" in text
    )
    summary = designer.summary()
    assert summary["corrected"] + summary["fallback"] + summary["dense"] == len(designer.placeholders())
    # the anchors used were counted (LFU bookkeeping)
    assert sum(a.uses for a in method.pools["query"]) >= 1


def test_fallback_reason_in_report_and_pool_update(tiny_llama, tokenizer):
    method = KVCMAS(
        **PREVIOUS[KVCMAS]
    )  # per-edge anchors (earlier reading); tiny random values: gate weights are flat, every edge falls back
    for query in QUERIES:
        got = run_request(tiny_llama, tokenizer, method, query, keep_cache=True)
    seg = got[2].cache.segment("designer")
    assert seg.provenance == "dense" and seg.info["gate"] == "fallback"
    assert "entropy" in seg.info["reason"] or "fewer than 2" in seg.info["reason"]
    # one anchor per fallback edge, built from the source agent's cache, holding the consumer's delta
    pool = method.pools["query"]
    assert {a.source for a in pool} == {"planner", "designer"}
    assert all(len(a.deltas) == 1 for a in pool)
    assert all(len(p) <= p.capacity for p in method.pools.values())


def test_nonchained_anchor_holds_a_delta_per_consumer(tiny_llama, tokenizer):
    method = KVComm()
    run_request(tiny_llama, tokenizer, method, QUERIES[0])
    (anchor,) = method.pools["query"].anchors  # one reference per request and slot
    assert anchor.source == "reference" and set(anchor.deltas) == set(AGENTS)
    assert set(method.pools["planner"].anchors[0].deltas) == {"designer", "coder"}


def test_pool_bytes_low_rank_versus_dense(tiny_llama, tokenizer):
    """KVComm stores O(V·N·L·D), KVCMAS O(V·N·r·(L+D)): exact bytes from the stored tensors."""
    dense, low = KVComm(), KVCMASNonChained(base_rank=4, delta_rank=4)
    for method in (dense, low):
        run_request(tiny_llama, tokenizer, method, QUERIES[0])
    d_anchor, l_anchor = dense.pools["query"].anchors[0], low.pools["query"].anchors[0]
    length, dim, layers = d_anchor.length, 32, 3
    # KVComm also keeps, per consumer, the dense correction of the PF text after the segment
    assert set(d_anchor.prefix_deltas) == set(d_anchor.deltas) and not l_anchor.prefix_deltas
    prefix = sum(2 * layers * d.length * dim * 4 for _, d in d_anchor.prefix_deltas.values())
    assert d_anchor.nbytes == 2 * layers * length * dim * 4 * (1 + len(d_anchor.deltas)) + prefix
    assert l_anchor.nbytes == 2 * layers * 4 * (length + dim) * 4 * (1 + len(l_anchor.deltas))
    # state: the pools plus the agents' kept PF text (prefix_scope="agent")
    assert (
        dense.state_bytes()
        == sum(a.nbytes for p in dense.pools.values() for a in p) + dense.prefix_state_bytes()
    )
    assert low.prefix_state_bytes() == dense.prefix_state_bytes() > 0  # the same agents' text
    assert low.state_bytes() < dense.state_bytes()


def test_graphflow_calibrates_then_applies_without_matching(tiny_llama, tokenizer):
    method = GraphFlow(calibration_requests=2)
    for query in QUERIES[:2]:
        got = run_request(tiny_llama, tokenizer, method, query, keep_cache=True)
        assert all(t.reuse_ratio == 0 for t in got)
    assert got[0].cache.segment("query").info["gate"] == "calibrating"
    bytes_before = method.state_bytes()
    got = run_request(tiny_llama, tokenizer, method, QUERIES[2], keep_cache=True)
    assert all(t.reuse_ratio == 1.0 for t in got)
    seg = got[2].cache.segment("planner")
    assert seg.provenance == "corrected" and seg.source_agent == "reference" and seg.info["gate"] == "profile"
    assert method.state_bytes() == bytes_before  # frozen: nothing learned online
    low = GraphFlow(calibration_requests=1, rank=2)
    run_request(tiny_llama, tokenizer, low, QUERIES[0])
    assert all(p.ready and p.frozen.keys[1].rank <= 2 for p in low.profiles.values())


def test_batched_build_cache_expands_corrections(tiny_llama, tokenizer):
    method = KVComm(tau=1.0, **PREVIOUS[KVComm])  # prefix matching: the queries differ in length
    for query in QUERIES[:2]:
        run_request(tiny_llama, tokenizer, method, query)
    cache, ids = Session(tiny_llama, tokenizer, method).build_cache(
        "planner", turn_segments(0, QUERIES[2]), 2
    )
    assert ids.shape[0] == 2 and cache.layer_kv(1)[0].shape[0] == 2
    seg = cache.segment("query")
    assert seg.provenance == "corrected"
    keys = cache.layer_kv(1)[0][..., seg.start : seg.end, :]
    assert torch.equal(keys[0], keys[1])


def test_reference_prefill_counts_as_computed(tiny_llama, tokenizer):
    ref = run_request(tiny_llama, tokenizer, "nonshared", QUERIES[0])
    got = run_request(tiny_llama, tokenizer, KVComm(**PREVIOUS[KVComm]), QUERIES[0])
    # the first consumer of each slot also prefills the slot alone (outside the workflow)
    assert got[0].tokens_prefilled == ref[0].tokens_prefilled + ref[0].ph_tokens
    chained = run_request(tiny_llama, tokenizer, KVCMAS(), QUERIES[0])
    assert [t.tokens_prefilled for t in chained] == [t.tokens_prefilled for t in ref]


def test_loops_and_fan_in(tiny_llama, tokenizer):
    """Each incoming segment is gated separately; a second round reads the first round's outputs."""
    method = KVCMAS(tau=1.0, **PREVIOUS[KVCMAS])  # per-edge gates (earlier reading)
    for query in QUERIES:
        session = Session(tiny_llama, tokenizer, method)
        session.run_turn("a", [PF("You are A.\n"), PH("query", query), PF("\nA:")], max_new_tokens=3)
        session.run_turn("b", [PF("You are B.\n"), PH("query"), PF("\nB:")], max_new_tokens=3)
        r = session.run_turn(
            "a",
            [PF("You are A again.\n"), PH("query"), PF("\nFrom A: "), PH("a"), PF("\nFrom B: "), PH("b")],
            max_new_tokens=3,
            keep_cache=True,
        )
    assert r.output_slot == "a#2"
    infos = {s.name: s.info["gate"] for s in r.cache.placeholders()}
    assert set(infos) == {"query", "a", "b"} and infos["query"] == "accepted"
    assert set(method.pools) == {"query", "a", "b"}


# ------------------------------------------------- reference-code semantics (defaults)
def test_gate_once_per_slot_and_request_every_consumer_obeys(tiny_llama, tokenizer, monkeypatch):
    calls = []
    gate = SlotScope.gate

    def counted(self, pool_key, candidate, agent=None):
        calls.append(pool_key)
        return gate(self, pool_key, candidate, agent)

    monkeypatch.setattr(SlotScope, "gate", counted)
    for cls, given in ((KVCMAS, []), (KVComm, ["query"])):
        method = cls(tau=1.0, profile="reference")  # the reference's decisions (n < 2: rejected)
        for n, query in enumerate((QUERIES[0], QUERIES[0], QUERIES[0], QUERIES[1])):
            calls.clear()
            session = Session(tiny_llama, tokenizer, method)
            turns = []
            for i, agent in enumerate(AGENTS):
                turns.append(
                    session.run_turn(agent, turn_segments(i, query), max_new_tokens=3, keep_cache=True)
                )
                if i == 0:  # the producer gated its output in its own record
                    assert "planner" in method._requests.get(session).decisions
            # one decision per gated slot: the query (KVComm only, at its first consumer) and every output
            assert sorted(calls) == sorted(given + AGENTS)
            decisions = method._requests.get(session).decisions
            for slot in ("planner", "query"):
                if slot not in decisions:
                    continue
                readers = [
                    t.cache.segment(slot)
                    for t in turns
                    if any(s.name == slot for s in t.cache.placeholders())
                ]
                gates = {seg.info["gate"] for seg in readers}
                if decisions[slot].accepted:  # reused, or dense because another slot made the turn dense
                    assert gates <= {"accepted", "turn"}, (cls.name, slot, gates)
                else:
                    assert gates == {"fallback"} and {seg.provenance for seg in readers} == {"dense"}
            if n < 2:  # fewer than 2 anchors: rejected; the consumers prefill their whole turns
                assert not decisions["planner"].accepted
                assert turns[1].reuse_ratio == turns[2].reuse_ratio == 0.0
            elif n == 2:  # the same query a third time, tau = 1: accepted; every PH span reused
                assert decisions["planner"].accepted and turns[2].reuse_ratio == 1.0


def test_rejection_feeds_one_anchor_per_slot_and_request(tiny_llama, tokenizer):
    method = KVCMAS()
    run_request(tiny_llama, tokenizer, method, QUERIES[0])
    # pools per producer for outputs; every consumer that went dense added its delta to one anchor
    assert {k: [set(a.deltas) for a in p] for k, p in method.pools.items()} == {
        "query": [{"designer", "coder"}],  # chained question: no anchor for the first hop (no source)
        "planner": [{"designer", "coder"}],
        "designer": [{"coder"}],
    }
    (anchor,) = method.pools["planner"].anchors
    assert anchor.source == "planner" and anchor.origin[1] == "planner"
    query = method.pools["query"].anchors[0]
    assert query.source == "designer"  # the base follows the latest consumer's (chained) source
    kvcomm = KVComm()
    run_request(tiny_llama, tokenizer, kvcomm, QUERIES[0])
    assert set(kvcomm.pools["query"].anchors[0].deltas) == set(AGENTS)


def test_outputs_are_sourced_from_the_producers_own_cache(tiny_llama, tokenizer):
    """A consumer without a delta reuses the producer's cache re-positioned (no correction); a later
    consumer gets the same source, not the first consumer's cache of the segment."""
    method = KVCMAS(tau=1.0, profile="reference")  # the reference's pools: an anchor per request
    for _ in range(2):
        run_request(tiny_llama, tokenizer, method, QUERIES[0])
    session = Session(tiny_llama, tokenizer, method)
    session.run_turn("planner", turn_segments(0, QUERIES[0]), max_new_tokens=3)
    produced = method._requests.get(session).produced["planner"]
    # the method holds the producer's cache; the session's copy, which no later turn reads, is freed
    assert produced.agent == "planner" and session.slots["planner"].latest is None
    designer = session.run_turn("designer", turn_segments(1, QUERIES[0]), max_new_tokens=3, keep_cache=True)
    assert designer.cache.segment("planner").provenance == "corrected"
    assert session.slots["planner"].latest is None  # the designer's copy is not a source: not kept
    segments = [PF("You review.\n"), PH("query"), PF("\nPlan: "), PH("planner"), PF("\nOK?")]
    reviewer = session.run_turn("reviewer", segments, max_new_tokens=3, keep_cache=True)
    seg = reviewer.cache.segment("planner")
    assert (
        seg.provenance == "reused"
        and seg.source_agent == "planner"
        and "no anchor holds" in seg.info["reason"]
    )
    expected = produced.repositioned(session.shifter, seg.start)
    got = reviewer.cache.extract(seg.start, seg.end)
    for layer in range(got.num_layers):
        assert torch.allclose(got.keys[layer], expected.keys[layer], atol=1e-6)
        assert torch.equal(got.values[layer], expected.values[layer])
    assert reviewer.tokens_prefilled == reviewer.prompt_ids.numel() - reviewer.ph_tokens
    # the earlier reading chains outputs too: the reviewer would read the designer's cache
    chained = KVCMAS(tau=1.0, output_source="chained")
    assert (
        chained.uses_sources
        and KVComm(output_source="context_free", text_source="context_free").uses_sources is False
    )


def test_corrected_outputs_leave_layer0_as_the_producer_computed_it(tiny_llama, tokenizer):
    ref = exact_forced(tiny_llama, tokenizer, QUERIES[0])
    method = KVCMAS(tau=1.0)
    for _ in range(2):
        run_forced(tiny_llama, tokenizer, method, QUERIES[0], ref)
    session = Session(tiny_llama, tokenizer, method)
    turns = [
        session.run_turn(a, turn_segments(i, QUERIES[0]), force_output=ref[i].output_ids, keep_cache=True)
        for i, a in enumerate(AGENTS[:2])
    ]
    seg = turns[1].cache.segment("planner")
    assert seg.provenance == "corrected"
    produced = method._requests.get(session).produced["planner"].repositioned(session.shifter, seg.start)
    got = turns[1].cache.extract(seg.start, seg.end)
    assert torch.equal(got.values[0], produced.values[0])
    assert torch.allclose(got.keys[0], produced.keys[0], atol=1e-6)
    assert not torch.equal(got.values[1], produced.values[1])  # corrected from layer 1 on
    assert kv_error(turns[1].cache, ref[1].cache, seg.start, seg.end) < 1e-4


def test_token_weights_are_computed_once_per_anchor_set(tiny_llama, tokenizer):
    method = KVCMAS(tau=1.0)
    for _ in range(2):
        run_request(tiny_llama, tokenizer, method, QUERIES[0])
    got = run_request(tiny_llama, tokenizer, method, QUERIES[0], keep_cache=True)
    first, second = got[1].cache.segment("planner"), got[2].cache.segment("planner")
    assert first.info["weights_cached"] is False and second.info["weights_cached"] is True
    assert first.info["anchors"] == second.info["anchors"]
    assert not KVCMAS(tau=1.0, weights_cache=False).weights_cache


def test_full_length_rule_of_the_gate(tiny_llama):
    method = KVCMAS(tau=1.0, profile="reference")  # the reference's gate (the candidate is random)
    candidate = random_kv(6, seed=9)
    pool = method.scope.pool("planner")
    for i, n in enumerate([5, 6, 9]):
        pool.insert(make_anchor(i, length=n))
    decision, eligible, distances = method.scope.gate("planner", candidate)
    assert [a.length for a in eligible] == [6, 9] and decision.accepted and len(distances) == 2
    method.pools["planner"].anchors.pop()  # {5, 6}: one anchor covers the candidate
    decision, eligible, _ = method.scope.gate("planner", candidate)
    assert not decision.accepted and "fewer than 2 anchors at least 6 tokens long (1 of 2)" in decision.reason
    prefix = KVCMAS(tau=1.0, match="prefix", profile="reference")  # the earlier reading: over 5 rows
    prefix.pools["planner"] = method.pools["planner"]
    decision, eligible, _ = prefix.scope.gate("planner", candidate)
    assert decision.accepted and len(eligible) == 2


def test_tau_zero_reuses_nothing_even_ungated_text(tiny_llama, tokenizer):
    method = KVCMAS(tau=0.0)
    for query in QUERIES[:2]:
        session = Session(tiny_llama, tokenizer, method)
        session.run_turn("a", [PF("You are A.\n"), PH("query", query), PF("\nA:")], max_new_tokens=3)
        r = session.run_turn("b", [PF("You are B.\n"), PH("query"), PF("\nB:")], max_new_tokens=3)
        assert r.reuse_ratio == 0.0


def test_kvcomm_reference_prefill_of_the_query(tiny_llama, tokenizer):
    ref = run_request(tiny_llama, tokenizer, "nonshared", QUERIES[0])
    method = KVComm()
    session = Session(tiny_llama, tokenizer, method)
    first = session.run_turn("planner", turn_segments(0, QUERIES[0]), max_new_tokens=3)
    reference = method._requests.get(session).references["query"]
    lead = "<|im_start|><|im_start|>user<|im_end|>\nYou are the planner; role number 0.\n"
    lead_ids = tokenizer(lead, add_special_tokens=False).input_ids
    assert reference.start == len(lead_ids) and reference.length == session.slots["query"].token_ids.numel()
    assert first.tokens_prefilled == ref[0].tokens_prefilled + len(lead_ids) + ref[0].ph_tokens
    assert list(method._requests.get(session).references) == ["query"]  # outputs: producer-sourced
    custom = KVComm(lead_in="Task:\n")
    session = Session(tiny_llama, tokenizer, custom)
    session.run_turn("planner", turn_segments(0, QUERIES[0]), max_new_tokens=3)
    assert custom._requests.get(session).references["query"].start == len(
        tokenizer("<|im_start|><|im_start|>user<|im_end|>\nTask:\n", add_special_tokens=False).input_ids
    )


# ----------------------------------------------------------------- bad input
def test_pools_bound_to_one_model(tiny_llama, tokenizer):
    method = KVCMAS()
    run_request(tiny_llama, tokenizer, method, QUERIES[0])
    before = method.state_bytes()
    other = tiny_model("llama", seed=1)  # same shapes, other weights
    with pytest.raises(ValueError, match="bound to .*create one method instance per model"):
        Session(other, tokenizer, method)
    assert method.state_bytes() == before
    method.clear()
    assert method.state_bytes() == 0
    Session(other, tokenizer, method)  # rebinds after clear()


def test_rank_above_feature_dim_is_clamped_with_a_warning(tiny_llama, tokenizer):
    method = KVCMAS(base_rank=100, delta_rank=16)
    with pytest.warns(UserWarning, match="base_rank=100 exceeds .* D = 2 kv heads x 16 = 32; clamped to 32"):
        Session(tiny_llama, tokenizer, method)
    assert (method.base_rank, method.delta_rank) == (32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Session(tiny_llama, tokenizer, method)  # once clamped, no more warnings


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"base_rank": 0}, "base_rank must be a positive int"),
        ({"delta_rank": 2.5}, "delta_rank must be a positive int"),
        ({"capacity": 1}, "capacity must be an int >= 2"),
        ({"tau": 1.5}, r"tau is a normalized entropy threshold in \[0, 1\]"),
        ({"temperature": 0}, "temperature must be a finite real number > 0"),
        ({"eviction_window": 0}, "eviction_window must be an int >= 1"),
    ],
)
def test_bad_knobs_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCMAS(**kwargs)


@pytest.mark.parametrize("cls", ANCHOR_METHODS)
@pytest.mark.parametrize("tau", [True, "0.3", float("nan"), float("inf"), -0.1, 1.01, None])
def test_tau_must_be_a_real_number_in_the_unit_interval(cls, tau):
    with pytest.raises(ValueError, match=rf"{cls.name}: tau .*\[0, 1\].*got {re.escape(repr(tau))}"):
        cls(tau=tau)
    assert cls(tau=0).tau == 0 and cls(tau=1).tau == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gate_scope": "request"}, "gate_scope must be one of 'slot', 'edge'"),
        ({"output_source": "lead"}, "output_source must be one of"),
        ({"text_source": "producer"}, "text_source must be one of"),
        ({"svd": "fast"}, "svd must be one of 'exact', 'randomized'"),
        ({"skip_layer0": 1}, "skip_layer0 must be True or False"),
        ({"lead_in": 3}, "lead_in must be a string or None"),
        ({"delta_frame": "reader"}, "delta_frame must be one of 'writer', 'canonical'"),
        ({"key_frame": "writer"}, "key_frame must be one of 'canonical', 'reader'"),
        ({"prefix_delta": "yes"}, "prefix_delta must be True or False"),
    ],
)
def test_bad_choices_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCMAS(**kwargs)


def test_slot_text_conflict_refused_and_pools_untouched(tiny_llama, tokenizer):
    method = KVCMAS()
    session = Session(tiny_llama, tokenizer, method)
    session.run_turn("planner", turn_segments(0, QUERIES[0]), max_new_tokens=3)
    before = (method.state_bytes(), dict(session.slots))
    with pytest.raises(ValueError, match="already holds"):
        session.run_turn("designer", turn_segments(1, QUERIES[1]), max_new_tokens=3)
    assert (method.state_bytes(), dict(session.slots)) == before


LONG_QUERY = "Explain, in detail and with examples, how a hash map resolves collisions and grows its table."
SHORT_QUERY = "Reverse a linked list in place."


def pf_errors(model, tok, method):
    """KV error of the PF text right after the query, per agent, in a third request that repeats the
    second (the first request's PF text is the one the agents keep)."""
    ref = exact_forced(model, tok, SHORT_QUERY)
    run_forced(model, tok, method, LONG_QUERY, exact_forced(model, tok, LONG_QUERY))
    run_forced(model, tok, method, SHORT_QUERY, ref)
    got = run_forced(model, tok, method, SHORT_QUERY, ref)
    errors, infos = [], []
    for turn, exact in zip(got, ref):
        segments = turn.cache.segments
        i = next(i for i, s in enumerate(segments) if s.kind == "PH" and s.name == "query")
        assert segments[i].provenance == "corrected"
        pf = segments[i + 1]
        assert pf.kind == "PF" and pf.provenance == "reused"
        errors.append(kv_error(turn.cache, exact.cache, pf.start, pf.end))
        infos.append(pf.info)
    return errors, infos


def test_kvcomm_prefix_deltas_correct_the_reused_pf_text(tiny_llama, tokenizer):
    """KVComm's reference corrects the PF text after a corrected segment with per-consumer prefix
    deltas; without them the kept PF text (computed after another query) is reused as it is."""
    with_delta, infos = pf_errors(tiny_llama, tokenizer, KVComm(tau=1.0))
    without, plain = pf_errors(tiny_llama, tokenizer, KVComm(tau=1.0, prefix_delta=False))
    assert all(isinstance(info["prefix_delta"], list) for info in infos)
    assert all("prefix_delta" not in info for info in plain)
    assert all(w < 0.9 * wo for w, wo in zip(with_delta, without)), (with_delta, without)


def test_deltas_are_stored_in_the_writers_frame_and_bases_follow_the_last_consumer(tiny_llama, tokenizer):
    """Eq. 12 as the authors' code stores it: ``C_consumer - Align(C_source)`` at the consumer's
    positions (``delta_frame="writer"``); the canonical frame stores the same difference at 0."""
    stored = {}
    for frame in ("writer", "canonical"):
        method = KVComm(tau=1.0, delta_frame=frame)
        session = Session(tiny_llama, tokenizer, method)
        turns = [
            session.run_turn(agent, turn_segments(i, QUERIES[0]), max_new_tokens=3, keep_cache=True)
            for i, agent in enumerate(AGENTS)
        ]
        anchor = method.pools["query"].anchors[0]
        reference = method._requests.get(session).references["query"]
        assert anchor.frame == frame
        last = turns[-1].cache.segment("query")
        assert anchor.base_start == last.start  # the coder was the last to add its delta
        exact = turns[-1].cache.extract(last.start, last.end)
        placed = reference.repositioned(session.shifter, last.start)
        for layer in range(3):
            diff = exact.keys[layer] - placed.keys[layer]
            if frame == "canonical":
                diff = session.shifter.reposition(diff, last.start, 0)
            got = to_heads(anchor.deltas["coder"].keys[layer].reconstruct(), 2)
            assert torch.allclose(got, diff, atol=1e-5), (frame, layer)
        stored[frame] = anchor
    assert KVCMAS().delta_frame == KVComm().delta_frame == "writer"
    assert (KVCMAS().key_frame, KVComm().key_frame) == ("canonical", "reader")
    assert (KVCMAS().prefix_delta, KVComm().prefix_delta) == (False, True)


# ---------------------------------------------------------------- guard (ours, beyond the paper)
def synthetic_anchor(base, delta, serial):
    """An anchor of ``base`` with the coder's ``delta`` (per-layer ``[1, kv_heads, S, head_dim]``)."""
    anchor = Anchor(base=FactoredKV.from_kv(base, base, None), source="planner", origin=serial)
    anchor.deltas["coder"] = FactoredKV.from_kv(delta, delta, None)
    anchor.serial = serial
    return anchor


def test_guard_estimate_keeps_consistent_deltas_and_drops_contradictory_ones(tiny_llama, tokenizer):
    """Held out, a delta the other anchors predict well keeps its scale near 1; deltas that contradict
    each other (the same kind of base, opposite corrections: anchors learned in unrelated contexts)
    are served at 0, where the authors' correction (scale 1) is worse than none."""
    shifter = Session(tiny_llama, tokenizer, "nonshared").shifter
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, 2, 5, 16, generator=g) for _ in range(3)]
    delta = [torch.randn(1, 2, 5, 16, generator=g) for _ in range(3)]

    def near(x, eps=0.01):
        return [t + eps * torch.randn(t.shape, generator=g) for t in x]

    consistent = [synthetic_anchor(near(base), near(delta), i) for i in range(3)]
    est = guard_estimate(consistent, "coder", 5, shifter)
    assert (est.scales > 0.95).all() and (est.scales <= 1).all()
    assert (est.errors[1] <= est.errors[2] + 1e-9).all() and (est.errors[1] < 0.01 * est.errors[2]).all()

    contradictory = [
        synthetic_anchor(near(base), near([s * d for d in delta]), i) for i, s in enumerate((1, -1))
    ]
    est = guard_estimate(contradictory, "coder", 5, shifter)
    assert (est.errors[0] > 3 * est.errors[2]).all()  # the unguarded correction: 4x the uncorrected error
    assert (est.scales == 0).all() and torch.equal(est.errors[1], est.errors[2])
    one = guard_estimate(consistent[:1], "coder", 5, shifter)  # nothing to hold out
    assert (one.scales == 0).all()
    with pytest.raises(ValueError, match="hold no correction for 'designer'"):
        guard_estimate(consistent, "designer", 5, shifter)
    with pytest.raises(ValueError, match="cannot estimate 6 rows"):
        guard_estimate(consistent, "coder", 6, shifter)


def guarded_request(model, tok, guard, seen):
    """Warm-up requests whose agents read the query after unrelated prefixes (alternating), then a
    request with the usual roles; ``seen`` collects (scales, estimate, served, placed, authors') per
    corrected span of the last request."""
    method = KVCMAS(tau=1.0, guard=guard, profile="reference")  # the authors' gate accepts these
    unrelated = [
        [PF(f"Ignore all this: zebra {k} quantum {agent} wombat orchestra, number {i * 7 + k}.\n" * 2)]
        for k in range(2)
        for i, agent in enumerate(AGENTS)
    ]
    for n, query in enumerate((QUERIES[0], QUERIES[1], QUERIES[0], QUERIES[1])):
        session = Session(model, tok, method)
        for i, agent in enumerate(AGENTS):
            prefix = unrelated[(n % 2) * len(AGENTS) + i]
            session.run_turn(agent, prefix + turn_segments(i, query)[1:], max_new_tokens=3)
    seen.clear()
    return run_request(model, tok, method, QUERIES[2], keep_cache=True), method


def test_guard_never_serves_a_correction_worse_than_fullshared_in_its_space(
    tiny_llama, tokenizer, monkeypatch
):
    """``guard=True``: over the held-out anchors the served correction's error is never above the
    uncorrected source's (FullShared's reading of the slot), while the authors' correction (scale 1) is
    above it here; the cache holds exactly the shrunk K/V."""
    seen = []
    original = SlotScope.guard

    def spy(self, turn, edge, anchors, kv, rows, span):
        served, scales = original(self, turn, edge, anchors, kv, rows, span)
        est = guard_estimate(anchors, turn.agent, rows, turn.shifter)
        seen.append(
            (
                turn.agent,
                span.name,
                scales,
                est,
                served,
                edge.source.repositioned(turn.shifter, span.start),
                kv,
            )
        )
        return served, scales

    monkeypatch.setattr(SlotScope, "guard", spy)
    turns, method = guarded_request(tiny_llama, tokenizer, True, seen)
    assert seen, "no span was corrected"
    hurt = 0
    for agent, name, scales, est, served, placed, authors in seen:
        assert (est.errors[1] <= est.errors[2] + 1e-6 * est.errors[2].max()).all(), (agent, name)
        worse = est.errors[0][:, 1:] > est.errors[2][:, 1:]  # layer 0 is left uncorrected
        hurt += int(worse.sum())
        assert (torch.tensor(scales)[:, 1:][worse] < 1).all()
        turn = next(t for t in turns if t.agent == agent)
        seg = turn.cache.segment(name)
        cached = turn.cache.extract(seg.start, seg.end)
        for layer in range(3):
            for side, pick in enumerate(("keys", "values")):
                s = scales[side][layer] if layer else 1.0
                want = getattr(placed, pick)[layer] + s * (
                    getattr(authors, pick)[layer] - getattr(placed, pick)[layer]
                )
                assert torch.allclose(getattr(served, pick)[layer], want, atol=1e-5)
                if seg.provenance == "corrected":
                    assert torch.allclose(getattr(cached, pick)[layer][:1], want, atol=1e-5)
    assert hurt, "the case must hold a layer where the unguarded correction is worse than none"
    infos = [s.info for t in turns for s in t.cache.placeholders() if "guard" in s.info]
    assert infos and all(len(i["guard"]["key_scales"]) == 3 for i in infos)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"guard": "yes"}, "guard must be True or False, got 'yes'"),
        ({"guard": True, "gate_scope": "edge"}, "guard=True checks the slot scope's corrections"),
    ],
)
def test_guard_bad_input_refused(kwargs, message):
    for cls in (KVCMAS, KVComm):
        with pytest.raises(ValueError, match=message):
            cls(**kwargs)


def _counting_distances(monkeypatch):
    """Every ``token_distances`` call of the slot scope: (source length, anchor serials), in order."""
    import hf_kvshare.anchors.slot_scope as slot_scope

    calls: list[tuple[int, tuple[int, ...]]] = []
    inner = slot_scope.token_distances

    def counted(source, anchors, *args, **kwargs):
        calls.append((id(source), tuple(a.serial for a in anchors)))
        return inner(source, anchors, *args, **kwargs)

    monkeypatch.setattr(slot_scope, "token_distances", counted)
    return calls


def test_token_distances_are_computed_once_per_anchor_and_source(tiny_llama, tokenizer, monkeypatch):
    """Each anchor's token distances from a source are computed once per request, whichever anchor
    set a consumer's weights take; an accepted output's are computed at its producer's record (the
    gate) and so are the chained question's for the next hop, so the consumers' placements compare
    no anchor for them; the question's next sources are not compared at all (later consumers take the
    weights cached for the slot, as the reference)."""
    method = KVCMAS(tau=1.0)
    for _ in range(2):
        run_request(tiny_llama, tokenizer, method, QUERIES[0])
    calls = _counting_distances(monkeypatch)
    session = Session(tiny_llama, tokenizer, method)
    turns, during = [], []
    for i, agent in enumerate(AGENTS):
        before = len(calls)
        turns.append(session.run_turn(agent, turn_segments(i, QUERIES[0]), max_new_tokens=3, keep_cache=True))
        during.append(calls[before:])
    pairs = [(source, serial) for source, serials in calls for serial in serials]
    assert pairs and len(pairs) == len(set(pairs))  # no (source, anchor) compared twice
    state = method._requests.get(session)
    planner = id(state.produced["planner"])
    assert [s for t in turns[1:] for s in [t.cache.segment("planner")] if s.provenance != "corrected"] == []
    assert [t.cache.segment("query").provenance for t in turns[1:]] == ["corrected", "corrected"]
    first = {source for source, _ in during[0]}  # the planner's record: its output, its question
    assert planner in first and len(first) == 2
    assert not first & {source for turn in during[1:] for source, _ in turn}  # no consumer again
    question_sources = {key[0]: held[0]() for key, held in state.distances.items()}
    # the designer's source, primed by the planner, is held weakly: once later hops replaced the
    # question's latest cache the session dropped it, and these distances do not keep it alive
    assert question_sources["query"] is None


def test_per_anchor_distances_give_the_weights_of_a_fresh_computation(tiny_llama, tokenizer):
    """The weights served from per-anchor distances (primed at the gate, shared across consumers) equal
    recomputing them for every consumer (``weights_cache=False``): the same tokens and corrected K/V."""
    runs = []
    for cache in (True, False):
        method = KVCMAS(tau=1.0, weights_cache=cache)
        for _ in range(2):
            run_request(tiny_llama, tokenizer, method, QUERIES[0])
        runs.append(run_request(tiny_llama, tokenizer, method, QUERIES[0], keep_cache=True))
    cached, fresh = runs
    assert any(s.provenance == "corrected" for t in cached for s in t.cache.segments)
    for a, b in zip(cached, fresh):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        for layer in range(a.cache.num_layers):
            ka, va = a.cache.layer_kv(layer)
            kb, vb = b.cache.layer_kv(layer)
            torch.testing.assert_close(ka, kb, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(va, vb, rtol=1e-6, atol=1e-6)


def test_a_chained_source_is_primed_for_a_consumer_whose_anchor_set_has_no_cached_weights(
    tiny_llama, tokenizer, monkeypatch
):
    """The question's next source is primed in the record for the later consumers whose anchor sets
    the request holds no weights for (the served trace's critic): here the coder's anchor set differs
    from the designer's, so the coder's placement compares nothing; it used to be skipped whenever any
    weights of the slot were cached, and the coder compared its anchors from that source when placing."""
    method = KVCMAS(tau=1.0, profile="reference")  # the reference's pools: an anchor per request
    for _ in range(2):
        run_request(tiny_llama, tokenizer, method, QUERIES[0])
    pool = method.pools["query"]
    assert [sorted(a.deltas) for a in pool] == [["coder", "designer"]] * 2
    del pool.anchors[1].deltas["coder"]  # the coder's anchors: {0}; the designer's: {0, 1}
    calls = _counting_distances(monkeypatch)
    session = Session(tiny_llama, tokenizer, method)
    during = []
    for i, agent in enumerate(AGENTS):
        before = len(calls)
        result = session.run_turn(agent, turn_segments(i, QUERIES[0]), max_new_tokens=3, keep_cache=True)
        during.append(calls[before:])
    assert result.cache.segment("query").provenance == "corrected"
    assert result.cache.segment("query").info["anchors"] == [0]
    state = method._requests.get(session)
    # the coder's turn compares only its own output (its gate, in its record)
    assert {source for source, _ in during[2]} <= {id(state.produced["coder"])}
    pairs = [(source, serial) for source, serials in calls for serial in serials]
    assert len(pairs) == len(set(pairs))


def test_a_span_fallback_still_places_the_agents_kept_text(tiny_llama, tokenizer):
    """``turn_fallback="span"``: a rejected gate prefills only the rejected span, so the consumer's kept
    PF text (prefix reuse) is placed as on an accepted turn; the reference's ``"turn"`` prefills it
    too. (Before: both prefilled it; on a server, whose claim starts at the prompt's first token, a
    span fallback then claimed nothing.)"""
    kinds = {}
    for mode in ("turn", "span"):
        method = KVCMAS(turn_fallback=mode)
        for _ in range(2):  # the second request: kept text exists, the planner's gate has < 2 anchors
            got = run_request(tiny_llama, tokenizer, method, QUERIES[0], keep_cache=True)
        designer = got[1].cache
        assert designer.segment("planner").info["gate"] == "fallback"
        assert designer.segment("planner").provenance == "dense"
        kinds[mode] = {s.name: s.provenance for s in designer.segments if s.kind == "PF"}
    assert set(kinds["turn"].values()) == {"dense"}
    assert set(kinds["span"].values()) == {"reused"}, kinds["span"]

"""KVCMAS's gate and pools beyond the reference (``profile="reuse"``, the default) and the reference
kept as one option (``profile="reference"``): the gate judges the correction (agreeing anchors are
accepted however flat their weights, disagreeing ones still rejected), a near-duplicate refreshes an
anchor instead of joining the pool, and a team's repeated documents are reused after warm-up."""

from __future__ import annotations

import pytest
import torch
from anchor_helpers import random_kv
from documents_workflow import AGENTS, NOTES, TASKS, run_workflow, turn_segments

from hf_kvshare import PF, PH, Session
from hf_kvshare.anchors.lowrank import FactoredKV, relative_spread
from hf_kvshare.anchors.pool import Anchor, AnchorPool
from hf_kvshare.cache import SegmentKV
from hf_kvshare.methods.kvcmas import KVCMAS
from hf_kvshare.methods.kvcomm import KVComm


def decisions(results) -> list[str]:
    """Each turn's PH spans as ``slot:provenance/gate``."""
    return [
        " ".join(f"{s.name}:{s.provenance}/{s.info.get('gate')}" for s in r.cache.segments if s.kind == "PH")
        for r in results
    ]


# ------------------------------------------------------------------ the gate judges the correction
def _anchor(base: SegmentKV, delta: SegmentKV, origin: int) -> Anchor:
    anchor = Anchor(base=FactoredKV.from_kv(base.keys, base.values, None), source="planner", origin=origin)
    anchor.deltas["coder"] = FactoredKV.from_kv(delta.keys, delta.values, None)
    return anchor


def _scaled(kv: SegmentKV, factor: float, noise: SegmentKV | None = None, eps: float = 0.0) -> SegmentKV:
    def mix(x, n):
        return x * factor + (0 if n is None else eps * n)

    nk = noise.keys if noise is not None else [None] * len(kv.keys)
    nv = noise.values if noise is not None else [None] * len(kv.values)
    return SegmentKV(
        keys=[mix(k, n) for k, n in zip(kv.keys, nk)],
        values=[mix(v, n) for v, n in zip(kv.values, nv)],
        start=0,
        agent="src",
    )


def _gate(method: KVCMAS, deltas: list[SegmentKV], candidate: SegmentKV | None = None):
    base = random_kv(6, seed=1)
    pool = method.scope.pool("planner")
    for i, delta in enumerate(deltas):
        pool.insert(_anchor(base, delta, i))  # the same base: equally close, flat weights
    return method.scope.gate("planner", base if candidate is None else candidate)  # the same text


def test_the_gate_accepts_agreeing_anchors_however_flat_their_weights():
    delta = random_kv(6, seed=2)
    agreeing = [delta, _scaled(delta, 1.0, random_kv(6, seed=3), eps=0.05)]
    decision, eligible, _ = _gate(KVCMAS(), agreeing)
    assert len(eligible) == 2 and decision.entropy == pytest.approx(1.0)  # the weights are flat
    assert decision.accepted and decision.reason.startswith("anchors agree: delta spread")
    assert decision.weights == pytest.approx([0.5, 0.5])
    # the reference gate (the entropy rule alone) rejects the same anchors: entropy 1 > tau 0.3
    decision, _, _ = _gate(KVCMAS(profile="reference"), agreeing)
    assert not decision.accepted and decision.reason == "entropy 1 > tau 0.3"
    decision, _, _ = _gate(KVCMAS(agreement=0), agreeing)  # the rule off
    assert not decision.accepted


def test_agreeing_anchors_are_accepted_for_a_candidate_far_from_every_anchor():
    """The gate judges the correction: a candidate far from every anchor (another text) is accepted
    when the anchors' corrections agree (they do not depend on the content), by either rule; with
    ``trust_agreement=False`` (the rule before) it is refused whatever rule accepted it; the reference
    applies them."""
    delta = random_kv(6, seed=2)
    far = random_kv(6, seed=9)
    decision, _, _ = _gate(KVCMAS(), [delta, delta], candidate=far)
    assert decision.accepted and decision.reason.startswith("anchors agree: delta spread")
    assert "the candidate is far (" in decision.reason and decision.weights == pytest.approx([0.5, 0.5])
    decision, _, _ = _gate(KVCMAS(tau=1.0), [delta, delta], candidate=far)  # the entropy rule accepted
    assert decision.accepted and decision.reason.startswith("accepted; the candidate is far (")
    assert "the corrections agree: delta spread" in decision.reason
    for knobs in ({}, {"tau": 1.0}):  # the rule before: every acceptance needs a near candidate
        decision, _, _ = _gate(KVCMAS(trust_agreement=False, **knobs), [delta, delta], candidate=far)
        assert not decision.accepted and "but the candidate is far from every anchor" in decision.reason
    assert _gate(KVCMAS(nearest=0), [delta, delta], candidate=far)[0].accepted  # the check off
    assert _gate(KVCMAS(profile="reference", tau=1.0), [delta, delta], candidate=far)[0].accepted
    assert KVCMAS(profile="reference").trust_agreement is False


@pytest.mark.parametrize("second", ["opposite", "unrelated", "once"])
def test_a_far_candidate_is_still_refused_when_the_anchors_disagree(second):
    """Far from every anchor and accepted by the entropy rule (tau 1) alone: refused when the anchors'
    corrections disagree or were observed once (nothing says they repeat); a near candidate stands."""
    delta, far = random_kv(6, seed=2), random_kv(6, seed=9)
    deltas = {"opposite": [delta, _scaled(delta, -1.0)], "unrelated": [delta, random_kv(6, seed=4)]}
    method = KVCMAS(tau=1.0)
    if second == "once":  # two anchors, each holding another consumer's correction
        base = random_kv(6, seed=1)
        pool = method.scope.pool("planner")
        pool.insert(_anchor(base, delta, 0))
        pool.insert(_anchor(base, delta, 1))
        pool.anchors[1].deltas["designer"] = pool.anchors[1].deltas.pop("coder")
        decision, _, _ = method.scope.gate("planner", far)
        assert not decision.accepted and "but the candidate is far from every anchor" in decision.reason
        assert "the correction for 'coder' was observed once" in decision.reason
        return
    decision, _, _ = _gate(method, deltas[second], candidate=far)
    assert not decision.accepted and decision.reason.startswith("accepted; but the candidate is far from")
    assert "anchors disagree: delta spread" in decision.reason
    assert _gate(KVCMAS(tau=1.0), deltas[second])[0].accepted  # the same text: near, it stands


@pytest.mark.parametrize("second", ["opposite", "unrelated", "twice as large"])
def test_the_gate_still_rejects_disagreeing_anchors(second):
    delta = random_kv(6, seed=2)
    other = {
        "opposite": _scaled(delta, -1.0),
        "unrelated": random_kv(6, seed=4),
        "twice as large": _scaled(delta, 2.0),
    }[second]
    decision, eligible, _ = _gate(KVCMAS(), [delta, other])
    assert len(eligible) == 2 and not decision.accepted
    assert "entropy 1 > tau 0.3; anchors disagree: delta spread" in decision.reason
    # a looser threshold accepts what it covers, never an opposite correction (spread 1)
    decision, _, _ = _gate(KVCMAS(agreement=0.99), [delta, other])
    assert decision.accepted == (second != "opposite")


def test_one_anchor_is_judged_by_what_its_refreshes_recorded():
    base, delta = random_kv(6, seed=1), random_kv(6, seed=2)
    method = KVCMAS()
    pool = method.scope.pool("planner")
    pool.insert(_anchor(base, delta, 0))
    decision, _, _ = method.scope.gate("planner", base)
    assert not decision.accepted and "the correction for 'coder' was observed once" in decision.reason
    pool.anchors[0].agreement["coder"] = 0.01  # a refresh saw it repeat
    decision, eligible, _ = method.scope.gate("planner", base)
    assert decision.accepted and len(eligible) == 1 and decision.weights == [1.0]
    pool.anchors[0].agreement["coder"] = 0.6  # ... or change
    decision, _, _ = method.scope.gate("planner", base)
    assert not decision.accepted and "anchors disagree" in decision.reason
    decision, _, _ = KVCMAS(profile="reference").scope.gate("planner", base)
    assert not decision.accepted  # the reference needs two anchors


def test_relative_spread_reads_as_documented():
    x = FactoredKV.from_kv(random_kv(5, seed=1).keys, random_kv(5, seed=1).values, None)
    minus = FactoredKV.from_kv(
        [-k for k in random_kv(5, seed=1).keys], [-v for v in random_kv(5, seed=1).values], None
    )
    assert relative_spread([x, x], 5) == 0.0
    assert relative_spread([x, minus], 5) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least two"):
        relative_spread([x], 5)
    with pytest.raises(ValueError, match="shorter than the 6 rows"):
        relative_spread([x, x], 6)


# ------------------------------------------------------------------ the chained question, gated
def test_a_per_edge_decision_judges_its_own_consumers_corrections():
    """A chained question is gated by each consumer on its own: ``agent`` judges that consumer's
    corrections alone. Two anchors (other requests' questions, far from the candidate) whose
    corrections for the coder agree and for the designer disagree: the coder's edge is accepted, the
    designer's refused, and a slot decision (every consumer's) refuses."""
    delta, other, far = random_kv(6, seed=2), random_kv(6, seed=4), random_kv(6, seed=9)
    method = KVCMAS()
    pool = method.scope.pool("task")
    base = random_kv(6, seed=1)
    for origin, designer in enumerate((delta, other)):
        anchor = _anchor(base, delta, origin)  # the coder's: the same correction twice
        anchor.deltas["designer"] = FactoredKV.from_kv(designer.keys, designer.values, None)
        pool.insert(anchor)
    coder, _, _ = method.scope.gate("task", far, agent="coder")
    assert coder.accepted and coder.reason.startswith("anchors agree: delta spread 0 (worst: 'coder')")
    designer, _, _ = method.scope.gate("task", far, agent="designer")
    assert not designer.accepted and "anchors disagree: delta spread" in designer.reason
    assert "(worst: 'designer')" in designer.reason
    assert not method.scope.gate("task", far)[0].accepted
    critic, eligible, _ = method.scope.gate("task", far, agent="critic")  # no anchor holds its correction
    assert (
        not critic.accepted and not eligible and critic.reason == "no anchor holds a correction for 'critic'"
    )


def test_the_chained_question_is_gated_with_gate_chained_and_ungated_by_default_and_under_reference(
    tiny_llama, tokenizer
):
    """The stress workload's case: the reference admits a chained question ungated (corrected with
    deltas observed on other requests' questions); ``gate_chained=True`` gates each consumer's edge, so
    a later hop's question is accepted (its corrections agree) or prefilled and learned, never
    corrected ungated. Both profiles leave it off (measured: it reused nothing on four workloads)."""
    results = run_workflow(tiny_llama, tokenizer, KVCMAS(gate_chained=True))
    gates = [r.cache.segment("task").info.get("gate") for r in results]
    assert gates[0] == "first" and "ungated" not in gates, gates
    for r in results:
        seg = r.cache.segment("task")
        if seg.provenance == "corrected":
            assert seg.info["gate"] == "accepted" and seg.info["tau"] == 0.3
        elif seg.info["gate"] == "fallback":
            assert seg.info["reason"], seg.info
    assert KVCMAS().gate_chained is False and KVCMAS(profile="reference").gate_chained is False
    assert KVComm().gate_chained is False
    assert KVCMAS(profile="reference", gate_chained=True).gate_chained  # given options win


# ------------------------------------------------------------------ a span longer than every anchor
def _longer(kv: SegmentKV, extra: int) -> SegmentKV:
    """``kv`` followed by ``extra`` other rows: the same text, then more."""
    tail = random_kv(extra, seed=8)
    return SegmentKV(
        keys=[torch.cat((k, t), dim=2) for k, t in zip(kv.keys, tail.keys)],
        values=[torch.cat((v, t), dim=2) for v, t in zip(kv.values, tail.values)],
        start=0,
        agent="src",
    )


def test_a_span_longer_than_every_anchor_is_gated_over_their_prefix_under_reuse_only():
    """The reference's length rule (an anchor corrects only a span no longer than itself) rejects a
    span longer than every anchor; ``reuse`` gates it over the prefix the anchors cover."""
    delta = random_kv(6, seed=2)
    agreeing = [delta, _scaled(delta, 1.0, random_kv(6, seed=3), eps=0.05)]
    longer = _longer(random_kv(6, seed=1), 3)  # _gate's base, then 3 more rows
    decision, eligible, _ = _gate(KVCMAS(), agreeing, candidate=longer)
    assert decision.accepted and len(eligible) == 2 and decision.reason.startswith("anchors agree")
    for method in (KVCMAS(profile="reference", tau=1.0), KVCMAS(piecewise=False)):
        decision, eligible, _ = _gate(method, agreeing, candidate=longer)
        assert not decision.accepted and not eligible
        assert decision.reason == "fewer than 2 anchors at least 9 tokens long (0 of 2)"
    assert KVCMAS().piecewise and not KVCMAS(profile="reference").piecewise and not KVComm().piecewise


# ------------------------------------------------------------------ no duplicate anchors
def test_near_duplicate_is_found_by_its_base():
    pool = AnchorPool("doc", capacity=4)
    kv = random_kv(6, seed=1)
    pool.insert(_anchor(kv, random_kv(6, seed=2), 0))
    pool.insert(_anchor(random_kv(6, seed=5), random_kv(6, seed=2), 1))
    same = FactoredKV.from_kv(kv.keys, [v * 1.01 for v in kv.values], None)
    assert pool.near_duplicate(same, "planner", 0.05).origin == 0
    assert pool.near_duplicate(same, "planner", 0.0) is None  # off
    assert pool.near_duplicate(same, "reference", 0.05) is None  # another source
    other = FactoredKV.from_kv(random_kv(6, seed=7).keys, random_kv(6, seed=7).values, None)
    assert pool.near_duplicate(other, "planner", 0.05) is None
    pool.refresh(pool.anchors[0])  # the youngest now, serial kept
    assert [a.origin for a in pool] == [1, 0] and pool.anchors[1].serial == 0


@pytest.fixture(scope="module")
def reuse_run(tiny_llama, tokenizer):
    method = KVCMAS()
    return method, run_workflow(tiny_llama, tokenizer, method)


def test_repeated_documents_refresh_one_anchor_instead_of_joining_the_pool(reuse_run, tiny_llama, tokenizer):
    method, _ = reuse_run
    for slot in ("note0", "note1"):
        (anchor,) = method.pools[slot].anchors  # one anchor, refreshed every time the notes were prefilled
        assert set(anchor.deltas) == set(AGENTS) and set(anchor.agreement) == set(AGENTS)
        assert all(0 <= s <= method.agreement for s in anchor.agreement.values())
    reference = KVCMAS(profile="reference")
    run_workflow(tiny_llama, tokenizer, reference, requests=3)
    assert [len(reference.pools[slot]) for slot in ("note0", "note1")] == [3, 3]  # a duplicate per request


# ------------------------------------------------------------------ repeated documents are reused
def test_repeated_documents_are_reused_after_warm_up_under_the_new_default(reuse_run):
    _, results = reuse_run
    warm = results[2 * len(AGENTS) :]  # requests 0 and 1 fill and refresh the pools
    assert all(r.reuse_ratio > 0 for r in warm), [r.reuse_ratio for r in warm]
    for r in warm:
        for slot in ("note0", "note1"):
            seg = r.cache.segment(slot)
            assert seg.provenance == "corrected" and seg.info["gate"] == "accepted"
    # the first refresh leaves the other consumers' deltas stale: they still prefill in request 1
    assert "note0:dense/fallback" in decisions(results[4:5])[0]


def test_a_longer_document_is_corrected_piecewise_under_reuse_and_dense_under_reference(
    tiny_llama, tokenizer
):
    """Request 3 reads note0 with a sentence more: longer than every anchor of its pool. ``reuse``
    corrects it over the rows the anchor covers (the rest reused uncorrected), not dense; the
    reference sends it dense by its length rule."""
    longer = NOTES[0] + " Escalate to the on-call engineer after the second retry."

    def last_request(method):
        run_workflow(tiny_llama, tokenizer, method, requests=3)
        session, out = Session(tiny_llama, tokenizer, method), []
        for i, agent in enumerate(AGENTS):
            segments = [
                PH("note0", longer, kind="observation") if getattr(s, "slot", None) == "note0" else s
                for s in turn_segments(i, TASKS[3])
            ]
            out.append(session.run_turn(agent, segments, max_new_tokens=4, keep_cache=True))
        return out

    n = len(tokenizer(NOTES[0], add_special_tokens=False).input_ids)
    for r in last_request(KVCMAS()):
        seg = r.cache.segment("note0")
        assert seg.provenance == "corrected" and seg.info["gate"] == "accepted", seg.info
        assert seg.info["rows"] == f"{n}/{seg.end - seg.start}" and seg.end - seg.start > n
    for r in last_request(KVCMAS(profile="reference", tau=1.0)):
        seg = r.cache.segment("note0")
        assert seg.provenance == "dense"
        assert f"fewer than 2 anchors at least {seg.end - seg.start} tokens long" in seg.info["reason"], (
            seg.info
        )


def test_a_growing_document_is_corrected_window_by_window(tiny_llama, tokenizer):
    """note0 grows over the requests (17, 23, then 33 tokens): the third request's span is longer than
    both anchors; its rows :17 are corrected by both, rows 17:23 by the 23-token one, the rest reused
    uncorrected. The reference prefills it."""
    growing = [
        NOTES[0],
        NOTES[0] + " Retries wait ten seconds.",
        NOTES[0] + " Retries wait ten seconds. Failures page the on-call engineer.",
    ]
    lengths = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in growing]

    def third_request(method):
        out = []
        for task, note in zip(TASKS, growing):
            session = Session(tiny_llama, tokenizer, method)
            for i, agent in enumerate(AGENTS):
                segments = [
                    PH("note0", note, kind="observation") if getattr(s, "slot", None) == "note0" else s
                    for s in turn_segments(i, task)
                ]
                out.append(session.run_turn(agent, segments, max_new_tokens=4, keep_cache=True))
        return [r.cache.segment("note0") for r in out[-len(AGENTS) :]]

    reuse = KVCMAS()
    for seg in third_request(reuse):
        assert seg.provenance == "corrected" and seg.info["gate"] == "accepted", seg.info
        assert seg.info["windows"] == [[0, lengths[0], 2], [lengths[0], lengths[1], 1]]
        assert seg.info["rows"] == f"{lengths[1]}/{lengths[2]}"
    assert sorted(a.length for a in reuse.pools["note0"]) == lengths[:2]
    for seg in third_request(KVCMAS(profile="reference", tau=1.0)):
        assert seg.provenance == "dense" and "fewer than 2 anchors at least" in seg.info["reason"], seg.info


# ------------------------------------------------------------------ the reference, one option
#: the decisions of main at fbca01c (before profiles existed) on this workflow: produced by running
#: `decisions(run_workflow(model, tok, KVCMAS(tau=tau)))` with main's code and pasted here
_FIRST = "task:dense/first note0:dense/fallback note1:dense/fallback"
_REJECTED = [
    _FIRST,
    "task:dense/turn note0:dense/fallback note1:dense/fallback planner:dense/fallback",
    "task:dense/turn note0:dense/fallback note1:dense/fallback planner:dense/fallback designer:dense/fallback",
]
_ACCEPTED = [
    "task:dense/first note0:dense/turn note1:dense/turn",
    "task:corrected/ungated note0:corrected/accepted note1:corrected/accepted planner:corrected/accepted",
    "task:corrected/ungated note0:corrected/accepted note1:corrected/accepted planner:corrected/accepted "
    "designer:corrected/accepted",
]
MAIN_DECISIONS = {
    "tau=0.3": _REJECTED * 4,  # main's defaults: rho = 0 on every turn
    "tau=1.0": _REJECTED * 2 + _ACCEPTED * 2,
}


@pytest.mark.parametrize("tau", [0.3, 1.0])
def test_the_reference_profile_reproduces_mains_decisions(tau, tiny_llama, tokenizer):
    got = decisions(run_workflow(tiny_llama, tokenizer, KVCMAS(profile="reference", tau=tau)))
    assert got == MAIN_DECISIONS[f"tau={tau}"]


def test_profiles_set_their_knobs_and_given_options_win():
    knobs = ("agreement", "nearest", "duplicate", "learn_dense", "turn_fallback")
    reference, reuse = KVCMAS(profile="reference"), KVCMAS()
    assert [getattr(reference, k) for k in knobs] == [0.0, 0.0, 0.0, False, "turn"]
    assert reuse.profile == "reuse" and [getattr(reuse, k) for k in knobs] == [0.3, 0.5, 0.05, True, "span"]
    assert KVCMAS(profile="reference", turn_fallback="span").turn_fallback == "span"
    assert KVComm().profile == "reference" and KVComm().agreement == 0.0  # as its authors' code runs it
    with pytest.raises(ValueError, match="profile must be one of 'reuse', 'reference'"):
        KVCMAS(profile="paper")
    with pytest.raises(ValueError, match="agreement must be a finite real number >= 0"):
        KVCMAS(agreement=-0.1)
    with pytest.raises(ValueError, match="learn_dense must be True or False"):
        KVCMAS(learn_dense="yes")


def test_refresh_evidence_survives_save_and_load(reuse_run, tiny_llama, tmp_path):
    method, _ = reuse_run
    method.save_state(tmp_path / "state")
    fresh = KVCMAS()
    fresh.load_state(tmp_path / "state", tiny_llama)
    for slot in ("note0", "note1"):
        assert fresh.pools[slot].anchors[0].agreement == method.pools[slot].anchors[0].agreement
    # a state saved before profiles existed was built with the reference's rules
    legacy = ("profile", "agreement", "nearest", "duplicate", "learn_dense")
    assert [KVCMAS.LEGACY_OPTIONS[k] for k in legacy] == ["reference", 0.0, 0.0, 0.0, False]


def test_a_repeated_place_and_a_piece_pool_with_their_slot(tiny_llama, tokenizer):
    """Given text pools per place: ``doc#2`` (the server's default layout's name for the next document at
    the same place of an agent's prompt within one task) and a piece ``doc[s:e]`` learn in ``doc``'s pool,
    so a server without task ids does not start an empty pool for every new document."""
    from hf_kvshare import PH, Session, get_method

    method = get_method("kvcmas")
    session = Session(tiny_llama, tokenizer, method=method, match_text=False)
    docs = {
        "doc": "The river Lune reaches the sea at Plover Scar near Glasson, by the lighthouse.",
        "doc#2": "The river Wyre reaches the sea at Fleetwood, past the ferry and the old docks.",
    }
    for slot, text in docs.items():
        for agent in ("a1", "a2", "a3"):
            given = PH(slot, text) if agent == "a1" else PH(slot)
            session.run_turn(agent, [PF(f"You are {agent}.\n"), given, PF("\nWhere?")], max_new_tokens=2)
    session.run_turn("a2", [PF("Quote:\n"), PH("doc#2[2:12]"), PF("\nWho?")], max_new_tokens=2)
    given_pools = {key for key in method.pools if key not in ("a1", "a2", "a3")}
    assert given_pools == {"doc"}, given_pools

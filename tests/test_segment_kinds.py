"""Kinds of given text (question / observation) and outputs passed on as text (issue 24, items 1-2)."""

from __future__ import annotations

import pytest
import torch

from hf_kvshare import PF, PH, Session
from hf_kvshare.turn import Slot, given_text_slot, output_with_tokens


def test_default_kinds_first_given_text_is_the_question(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer, "nonshared")
    session.run_turn(
        "a", [PF("Task: "), PH("query", "Sort a list."), PF(" Doc: "), PH("doc", "lists")], max_new_tokens=2
    )
    session.run_turn("b", [PH("query"), PF(" Test: "), PH("log", "ok"), PF(" Ans:")], max_new_tokens=2)
    kinds = {name: slot.kind for name, slot in session.slots.items()}
    assert kinds == {"query": "question", "doc": "observation", "a": None, "log": "observation", "b": None}


def test_stated_kinds_and_bad_kinds(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer, "nonshared")
    session.run_turn(
        "a", [PH("doc", "a document", kind="observation"), PF(" Q: "), PH("q", "why?")], max_new_tokens=2
    )
    assert session.slots["doc"].kind == "observation"
    assert session.slots["q"].kind == "observation"  # the first given text was not the question
    with pytest.raises(ValueError, match="kind must be one of"):
        PH("x", "text", kind="document")
    with pytest.raises(TypeError):
        PF("text", kind="question")  # PF segments have no kind
    before = (dict(session.slots), len(session.turns))
    session.run_turn("b", [PH("q2", "the question", kind="question"), PF(" go")], max_new_tokens=1)
    with pytest.raises(ValueError, match="a request has one question"):
        session.run_turn("c", [PF("x "), PH("q3", "another question", kind="question"), PF(" go")])
    with pytest.raises(ValueError, match="stated as kind='question'"):
        session.run_turn("c", [PF("x "), PH("doc", kind="question")])
    with pytest.raises(ValueError, match="output of 'a'"):
        session.run_turn("c", [PF("x "), PH("a", kind="observation")])
    assert "q3" not in session.slots and len(session.turns) == before[1] + 1


def test_output_passed_as_text_is_the_output(tiny_llama, tokenizer):
    for method in ("fullshared", "kvcmas"):
        session = Session(tiny_llama, tokenizer, method)
        text = " First sort the numbers, then return them."
        reply = tokenizer(text, add_special_tokens=False)["input_ids"]  # a reply that round-trips
        session.run_turn(
            "planner",
            [PF("Plan: "), PH("query", "Sort a list of numbers."), PF("\nPlan:")],
            force_output=reply,
        )
        r = session.run_turn(
            "coder",
            [PF("Code: "), PH("query"), PF("\nPlan: "), PH("plan", text), PF("\nCode:")],
            max_new_tokens=2,
        )
        ph = [s for s in r.segments if s.kind == "PH"]
        assert [s.name for s in ph] == ["query", "planner"]  # read under the output's name
        assert "plan" not in session.slots and session.aliases == {"plan": "planner"}
        if method == "fullshared":
            assert ph[1].provenance == "reused" and ph[1].source_agent == "planner"
        # a later reference by the given name is the same output
        r = session.run_turn("critic", [PF("Crit: "), PH("plan"), PF("\nOK?")], max_new_tokens=1)
        assert [s.name for s in r.segments if s.kind == "PH"] == ["planner"]


def test_one_token_different_is_given_text(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer, "fullshared")
    ids = tokenizer(" First sort the numbers, then return them.", add_special_tokens=False)["input_ids"]
    session.run_turn(
        "planner", [PF("Plan: "), PH("query", "Sort a list of numbers."), PF("\nPlan:")], force_output=ids
    )
    text = tokenizer.decode(ids[:-1]) + "!"  # the last token different
    other = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert other[:-1] == ids[:-1] and len(other) == len(ids) and other[-1] != ids[-1]
    r = session.run_turn("coder", [PF("Code: "), PH("plan", text), PF("\nCode:")], max_new_tokens=1)
    seg = next(s for s in r.segments if s.kind == "PH")
    assert seg.name == "plan" and seg.provenance == "dense"
    assert session.slots["plan"].kind == "observation" and session.aliases == {}


def test_given_text_slot_is_a_host_level_rule(tokenizer):
    out = Slot(name="a", token_ids=torch.tensor([5, 6, 7]), text="x", producer="a")
    q = Slot(name="q", token_ids=torch.tensor([1]), text="q", kind="question")
    slots = {"q": q, "a": out}
    assert output_with_tokens(slots, torch.tensor([5, 6, 7])) is out
    assert given_text_slot(PH("t", "x"), torch.tensor([5, 6, 7]), slots) is out
    stated = given_text_slot(PH("t", "x", kind="observation"), torch.tensor([5, 6, 7]), slots)
    assert stated.name == "t" and stated.kind == "observation"  # a stated kind keeps it given text
    assert given_text_slot(PH("t", "x"), torch.tensor([5, 6, 8]), slots).kind == "observation"
    assert given_text_slot(PH("t", "x"), torch.tensor([5]), {}).kind == "question"


def test_task_format_carries_kinds(tokenizer):
    from hf_kvshare.bench.workloads import TaskSpec, WorkloadFormatError, kinds_report

    record = {
        "agents": [{"name": "a"}, {"name": "b"}],
        "slots": [{"name": "doc", "text": "a document"}, {"name": "q", "text": "why?", "kind": "question"}],
        "schedule": [{"agent": "a", "reads": ["doc", "q"]}, {"agent": "b", "reads": ["q", "a"]}],
    }
    task = TaskSpec.from_record(record)
    assert task.slot_kinds() == {"doc": "observation", "q": "question"}
    assert kinds_report([task]) == "given slots: 1 question, 1 observation"
    phs = [s for s in task.to_workflow(tokenizer).steps[0].segments if isinstance(s, PH)]
    assert [(p.slot, p.kind) for p in phs] == [("doc", "observation"), ("q", "question")]
    assert TaskSpec.from_record(task.to_record()).slot_kinds() == task.slot_kinds()
    unstated = TaskSpec.from_record(
        {**record, "slots": [{"name": "doc", "text": "d"}, {"name": "q", "text": "w"}]}
    )
    assert unstated.slot_kinds() == {"doc": "question", "q": "observation"}
    bad = {**record, "slots": [{"name": "doc", "text": "d", "kind": "document"}, {"name": "q", "text": "w"}]}
    with pytest.raises(WorkloadFormatError, match=r"slots\[0\].kind: unknown kind 'document'"):
        TaskSpec.from_record(bad)
    two = {
        **record,
        "slots": [
            {"name": "doc", "text": "d", "kind": "question"},
            {"name": "q", "text": "w", "kind": "question"},
        ],
    }
    with pytest.raises(WorkloadFormatError, match=r"slots\[1\].kind: a request has one question"):
        TaskSpec.from_record(two)
    on_step = {**record, "schedule": [{"agent": "a", "reads": ["doc"], "kind": "question"}]}
    with pytest.raises(WorkloadFormatError, match=r"schedule\[0\].kind: unknown field"):
        TaskSpec.from_record(on_step)


# ---------------------------------------------------------------- item 3: observations as conditions
def _request(model, tok, method, i):
    """Three agents reading the question and a document (an observation); the last two read the first's output."""
    session = Session(model, tok, method)
    query, doc = (
        f"Question {i}: sort these {i + 3} numbers.",
        f"Document {i}: a list holds {i} items in order.",
    )
    out = [
        session.run_turn(
            "a", [PF("A: "), PH("query", query), PF("\nDoc: "), PH("doc", doc), PF("\nA:")], max_new_tokens=3
        )
    ]
    for agent in ("b", "c"):
        out.append(
            session.run_turn(
                agent,
                [
                    PF(f"{agent}: "),
                    PH("query"),
                    PF("\nDoc: "),
                    PH("doc"),
                    PF("\nA said: "),
                    PH("a"),
                    PF("\n>"),
                ],
                max_new_tokens=3,
            )
        )
    return session, out


def _ph(result, name):
    return next(s for s in result.segments if s.kind == "PH" and s.name == name)


@pytest.mark.parametrize("name", ["kvcmas", "kvcomm"])
def test_observations_gated_once_per_request_and_anchored_on_rejection(tiny_llama, tokenizer, name):
    from hf_kvshare import get_method

    method = get_method(name, tau=1.0, profile="reference")  # the reference's pools and decisions
    for i in range(2):  # fewer than two anchors: rejected, every consumer prefills and adds its delta
        session, turns = _request(tiny_llama, tokenizer, method, i)
        state = method._requests.get(session)
        assert state.decisions["doc"].accepted is False
        assert "doc" in state.references  # the reference prefill (lead-in dropped), not a chained source
        assert [_ph(t, "doc").provenance for t in turns] == ["dense"] * 3
        assert _ph(turns[1], "doc").info["gate"] == "fallback"
        assert len(method.pools["doc"]) == i + 1
        anchor = method.pools["doc"].find((state.uid, "doc"))
        assert sorted(anchor.deltas) == ["a", "b", "c"]
    session, turns = _request(tiny_llama, tokenizer, method, 2)  # two anchors: gated (tau 1 accepts)
    state = method._requests.get(session)
    assert state.decisions["doc"].accepted
    docs = [_ph(t, "doc") for t in turns]
    assert [d.provenance for d in docs[1:]] == ["corrected"] * 2 and docs[1].info["gate"] == "accepted"
    # the first hop: KVCMAS's chained question is new there, so the reference prefills the whole turn
    assert docs[0].provenance == ("dense" if name == "kvcmas" else "corrected")
    assert len(method.pools["doc"]) == 2  # accepted corrections are never inserted
    if name == "kvcmas":  # the question stays chained and ungated
        assert "query" not in state.decisions and _ph(turns[1], "query").info["gate"] == "ungated"
    else:  # KVComm gates its question too
        assert "query" in state.decisions


def test_observations_read_as_the_question_is_the_earlier_reading(tiny_llama, tokenizer):
    from hf_kvshare import get_method

    method = get_method("kvcmas", tau=1.0, observation_source="question", gate_chained=False)
    for i in range(3):
        session, turns = _request(tiny_llama, tokenizer, method, i)
    state = method._requests.get(session)
    assert "doc" not in state.decisions and "doc" not in state.references
    assert _ph(turns[1], "doc").info["gate"] == "ungated"


def test_paper_gating_gates_every_edge_with_fewer_than_two_anchors_dense(tiny_llama, tokenizer):
    from hf_kvshare import get_method

    method = get_method("kvcmas", tau=1.0, gating="paper")
    session, turns = _request(tiny_llama, tokenizer, method, 0)
    state = method._requests.get(session)
    assert {"query@b", "query@c", "doc", "a"} <= set(state.decisions)  # the chained question: per edge
    assert not any(d.accepted for d in state.decisions.values())
    assert all(s.provenance == "dense" for t in turns for s in t.segments if s.kind == "PH")
    assert "fewer than 2 anchors" in _ph(turns[1], "query").info["reason"]
    with pytest.raises(ValueError, match="gating='paper' is a slot-scope reading"):
        get_method("kvcmas", gating="paper", gate_scope="edge")
    for bad in ({"gating": "text"}, {"observation_source": "chained"}):
        with pytest.raises(ValueError, match="must be one of"):
            get_method("kvcomm", **bad)


def test_states_saved_before_kinds_load_as_the_earlier_reading(tiny_llama, tokenizer, tmp_path):
    import json

    from hf_kvshare import get_method

    method = get_method("kvcmas", tau=1.0)
    _request(tiny_llama, tokenizer, method, 0)
    from safetensors.torch import load_file, save_file

    method.save_state(tmp_path)
    header = json.loads((tmp_path / "state.json").read_text())
    for option in ("observation_source", "gating"):  # as written before the options existed
        del header["options"][option]
    del header["checksum"], header["requested"]  # and before checksums (state format 1)
    header["format"] = 1
    (tmp_path / "state.json").write_text(json.dumps(header))
    save_file(load_file(str(tmp_path / "state.safetensors")), str(tmp_path / "state.safetensors"))
    with pytest.raises(ValueError, match="observation_source: saved 'question', this instance 'lead'"):
        get_method("kvcmas", tau=1.0).load_state(tmp_path, tiny_llama, allow_legacy=True)
    earlier = get_method("kvcmas", tau=1.0, observation_source="question")
    earlier.load_state(tmp_path, tiny_llama, allow_legacy=True)
    assert earlier.state_summary()["anchors"] == method.state_summary()["anchors"]


# ------------------------------------------------------------------ item 4: reuse accounting
def _split_sums(turn):
    dense = sum(s.length for s in turn.segments if s.kind == "PH" and s.provenance == "dense")
    acc = turn.accounting()
    assert acc["tokens_corrected"] + acc["tokens_reused_uncorrected"] + acc["tokens_recomputed"] + acc[
        "ph_prefilled"
    ] == pytest.approx(turn.ph_tokens)
    return acc, dense


@pytest.mark.parametrize("name", ["kvcmas", "fullshared", "cacheblend"])
def test_accounting_sums_to_the_shared_tokens(tiny_llama, tokenizer, name):
    from hf_kvshare import get_method

    method = get_method(
        name, **({"tau": 1.0} if name == "kvcmas" else {"rho": 0.5} if name == "cacheblend" else {})
    )
    for i in range(3):
        _, turns = _request(tiny_llama, tokenizer, method, i)
        for turn in turns:
            acc, dense = _split_sums(turn)
            if name != "cacheblend":
                assert acc["ph_prefilled"] == dense and acc["tokens_recomputed"] == 0
            corrected = sum(s.length for s in turn.segments if s.kind == "PH" and s.provenance == "corrected")
            assert acc["tokens_corrected"] == corrected  # full coverage on these: every row
            if name == "kvcmas":
                assert turn.corrects and acc["paper_reuse_ratio"] == pytest.approx(corrected / turn.ph_tokens)
            else:
                assert not turn.corrects and acc["paper_reuse_ratio"] == pytest.approx(turn.reuse_ratio)
    if name == "cacheblend":
        assert acc["tokens_recomputed"] > 0 and acc["tokens_corrected"] == 0
    if name == "kvcmas":
        assert acc["tokens_corrected"] > 0


def test_a_run_with_no_gated_slot_reports_reused_uncorrected_and_warns_once(tiny_llama, tokenizer):
    import warnings

    from hf_kvshare import get_method
    from hf_kvshare.evaluation import protocol

    # KVCMAS on the question alone: chained and ungated; its anchors take deltas from dense turns only,
    # and with the first hop the only dense one (it has no source) none is ever stored
    # (the reference profile: profile="reuse" prefills a span no anchor corrects, and learns from it)
    method = "kvcmas:tau=1.0,profile=reference"

    m = get_method("kvcmas", tau=1.0, profile="reference")
    records = []
    session = Session(tiny_llama, tokenizer, m)
    first = session.run_turn("a", [PF("A: "), PH("query", "Sort the numbers."), PF("\nA:")], max_new_tokens=2)
    for agent in ("b", "c"):  # no gated slot: the chained question is reused as its latest hop left it
        r = session.run_turn(agent, [PF(f"{agent}: "), PH("query"), PF("\n>")], max_new_tokens=2)
        assert _ph(r, "query").provenance == "reused" and r.tokens_reused_uncorrected == r.ph_tokens
        records.append({"method": method, **r.metrics()})
    records.insert(0, {"method": method, **first.metrics()})
    protocol._WARNED_UNCORRECTED.discard(method)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = protocol.reuse_accounting(records)
        again = protocol.reuse_accounting(records)
    assert out == again and out["uncorrected_run"] is True
    assert out["corrected_share"] == 0 and out["paper_reuse_ratio"] == 0 and out["uncorrected_share"] > 0
    assert sum(out[c] for c in protocol.SPLIT.values()) == pytest.approx(1.0)
    assert len([w for w in caught if "served the whole run uncorrected" in str(w.message)]) == 1

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

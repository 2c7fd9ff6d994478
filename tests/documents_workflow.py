"""Test helper: a team's repeated-documents workflow (``test_kvcmas_gate.py``, ``test_kvcmas_verify.py``):
three agents, each request a task and the same two reference notes, each agent reading the earlier
agents' outputs."""

from __future__ import annotations

from hf_kvshare import PF, PH, Session

AGENTS = ["planner", "designer", "coder"]
#: a team's fixed reference documents: the same two notes in every request
NOTES = [
    "Note A: the service keeps one queue per tenant and retries failed jobs twice.",
    "Note B: every response must cite the ticket number and stay under fifty words.",
]
TASKS = [
    "Sort a list of numbers and explain the complexity.",
    "Compute the sum of all primes below fifty.",
    "Write a short poem about the sea.",
    "Parse a date string and print the weekday.",
]


def turn_segments(i: int, task: str):
    """Agent ``i``'s prompt: its role, the task, the two notes, the earlier agents' outputs."""
    segments = [
        PF(f"You are the {AGENTS[i]}.\nTask: "),
        PH("task", task, kind="question"),
        PF("\nReference notes:\n"),
        PH("note0", NOTES[0], kind="observation"),
        PF("\n"),
        PH("note1", NOTES[1], kind="observation"),
    ]
    for earlier in AGENTS[:i]:
        segments += [PF(f"\nFrom the {earlier}: "), PH(earlier)]
    segments.append(PF("\nAnswer:"))
    return segments


def run_workflow(model, tok, method, requests: int = len(TASKS)):
    """The repeated-documents workflow, one Session per request; the turns' results."""
    results = []
    for task in TASKS[:requests]:
        session = Session(model, tok, method)
        for i, agent in enumerate(AGENTS):
            results.append(session.run_turn(agent, turn_segments(i, task), max_new_tokens=4, keep_cache=True))
    return results

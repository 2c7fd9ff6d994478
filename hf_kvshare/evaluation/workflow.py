"""Multi-agent workflows: an ordered list of agent turns, run in one :class:`Session`.

A :class:`Workflow` is a request: each :class:`Step` is one agent turn whose segments may refer
to earlier outputs with ``PH("<agent>")`` (or the step's explicit ``output_slot``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from ..agents import activate_adapter
from ..session import Session
from ..trajectory import PF, PH, SegmentSpec, chat
from ..turn import TurnResult


@dataclass
class Step:
    """One agent turn.

    Args:
        agent: the agent's name (on a ``PeftModel``, its adapter's name unless ``adapter`` is set).
        segments: a list of PF/PH specs, or chat messages.
        max_new_tokens: overrides the workflow's.
        output_slot: the PH slot the output is recorded as (default: the agent's name, then ``name#2``...).
        adapter: the PEFT adapter this turn runs with; the turn's agent is then the adapter.
        generate_kwargs: extra ``generate`` arguments for this turn.
    """

    agent: str
    segments: Any
    max_new_tokens: int | None = None
    output_slot: str = ""
    adapter: str | None = None
    generate_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Workflow:
    steps: list[Step]
    max_new_tokens: int = 48
    name: str = "workflow"


def run_workflow(
    session: Session,
    workflow: Workflow,
    force_outputs: Sequence[Any] | None = None,
    keep_cache: bool = False,
    progress: bool = False,
    desc: str = "",
) -> list[TurnResult]:
    """Run every step of ``workflow`` in ``session``; ``force_outputs[i]`` teacher-forces step i."""
    results = []
    steps = tqdm(
        workflow.steps,
        desc=desc or f"{session.method.name} turns",
        leave=False,
        disable=not progress,
        unit="turn",
    )
    for i, step in enumerate(steps):
        if step.adapter:
            activate_adapter(session.model, step.adapter)
        forced = None if force_outputs is None else force_outputs[i]
        results.append(
            session.run_turn(
                step.adapter or step.agent,
                step.segments,
                max_new_tokens=step.max_new_tokens or workflow.max_new_tokens,
                output_slot=step.output_slot or None,
                force_output=forced,
                keep_cache=keep_cache,
                **(step.generate_kwargs if forced is None else {}),  # a forced turn does not generate
            )
        )
    return results


def reusable_slots(results: Sequence[TurnResult]) -> list[set[str]]:
    """Per turn, the PH slots it read that an earlier turn of the request read or produced."""
    seen: set[str] = set()
    out = []
    for turn in results:
        read = {s.name for s in turn.segments if s.kind == "PH"}
        out.append(read & seen)
        seen.update(read)
        seen.add(turn.output_slot)
    return out


# ---------------------------------------------------------------- the demo workflow
DEMO_QUERY = (
    "A small library lends books for 14 days. The fine is 25 cents per day for the first week late "
    "and 50 cents per day after that. Write a function that returns the fine for a book returned "
    "`days` days after it was borrowed, and explain the edge cases."
)

#: twenty small programming tasks for demo requests (the demo workflow's query)
DEMO_QUERIES = [
    "Write a Python function that returns the n-th Fibonacci number and explain its time complexity.",
    "A train leaves at 9:40 and arrives at 13:15. Write a function that computes the travel time in minutes "
    "for any two times on the same day.",
    "Write a function that checks whether a string is a palindrome, ignoring case, spaces and punctuation.",
    "Given a list of integers, return the length of the longest strictly increasing subsequence.",
    "Write a function that merges two sorted lists into one sorted list without calling sort().",
    "A shop gives 10% off orders over 50 dollars and 20% off orders over 100 dollars. Write a function that "
    "returns the final price of an order.",
    "Write a function that counts the vowels in a sentence and returns a dictionary from vowel to count.",
    "Implement binary search over a sorted list of numbers; return the index of the target or -1.",
    "Write a function that converts a Roman numeral such as 'MCMXCIV' to an integer.",
    "Given a list of words, group the anagrams together and return the groups as lists.",
    "Write a function that returns True when every opening bracket in a string is closed in the right order.",
    "A parking garage charges 3 dollars for the first hour and 2 dollars for each extra started hour, at most "
    "20 dollars a day. Write a function for the fee.",
    "Write a function that rotates a square matrix by 90 degrees clockwise in place.",
    "Given a list of meeting intervals, merge all overlapping intervals and return the result sorted.",
    "Write a function that returns the k most frequent words of a text, ties broken alphabetically.",
    "Write a function that computes the greatest common divisor of two integers with Euclid's algorithm.",
    "A library lends books for 14 days with a fine of 25 cents a day, 50 cents after the first week late. "
    "Write a function for the fine.",
    "Write a function that flattens a nested list of integers of any depth into a flat list.",
    "Given the prices of a stock on consecutive days, return the best profit from one buy and one sell.",
    "Write a function that checks whether a 9x9 Sudoku board filled so far breaks any row, column or box rule.",
]

DEMO_ROLES = {
    "planner": "You are a careful planner. Break the user's task into short numbered steps.",
    "designer": "You are an algorithm designer. Propose the simplest correct algorithm and its edge cases.",
    "coder": "You are a Python expert. Write clean, correct Python code for the task.",
    "final": "You are the final reviewer. Read the team's notes and give the final answer concisely.",
}


def demo_workflow(tokenizer, query: str = DEMO_QUERY, max_new_tokens: int = 48) -> Workflow:
    """Three role agents in sequence (each reads the query and the earlier roles' outputs), then a
    final agent reading all three outputs; laid out with the tokenizer's chat template."""
    steps = []
    roles = [r for r in DEMO_ROLES if r != "final"]
    for i, role in enumerate([*roles, "final"]):
        content: list[SegmentSpec | str] = [PF("Task:\n"), PH("query", query)]
        for earlier in roles[:i]:
            content += [PF(f"\n\nNotes from the {earlier}:\n"), PH(earlier)]
        content.append(PF("\n\nYour answer:" if role != "final" else "\n\nGive the final answer:"))
        messages = [{"role": "system", "content": DEMO_ROLES[role]}, {"role": "user", "content": content}]
        steps.append(Step(agent=role, segments=chat(tokenizer, messages)))
    return Workflow(steps=steps, max_new_tokens=max_new_tokens, name="demo-4-agents")

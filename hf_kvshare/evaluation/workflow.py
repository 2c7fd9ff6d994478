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
        workflow.steps, desc=desc or f"{session.method.name} turns", leave=False, disable=not progress, unit="turn"
    )
    for i, step in enumerate(steps):
        if step.adapter:
            activate_adapter(session.model, step.adapter)
        results.append(
            session.run_turn(
                step.adapter or step.agent,
                step.segments,
                max_new_tokens=step.max_new_tokens or workflow.max_new_tokens,
                output_slot=step.output_slot or None,
                force_output=None if force_outputs is None else force_outputs[i],
                keep_cache=keep_cache,
                **step.generate_kwargs,
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

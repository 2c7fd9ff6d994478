"""Multi-agent workflows and side-by-side method comparison.

A :class:`Workflow` is an ordered list of steps; each step is one agent turn whose segments may
refer to earlier outputs with ``PH("<agent>")``. :func:`compare_methods` runs it once per
method, free-running (TTFT, reuse, outputs) and teacher-forced on NonShared's outputs (top-1
agreement, KL, KV error against the exact cache), so every method sees identical prompts in the
fidelity pass.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from .fidelity import kv_error, mean_kl, top1_agreement
from .session import Session, TurnResult
from .trajectory import PF, PH, SegmentSpec, chat


@dataclass
class Step:
    agent: str
    segments: Any  # list of PF/PH, or chat messages
    max_new_tokens: int | None = None


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
) -> list[TurnResult]:
    """Run every step of ``workflow`` in ``session``; ``force_outputs[i]`` teacher-forces step i."""
    results = []
    steps = tqdm(workflow.steps, desc=f"{session.method.name} turns", leave=False, disable=not progress)
    for i, step in enumerate(steps):
        results.append(
            session.run_turn(
                step.agent,
                step.segments,
                max_new_tokens=step.max_new_tokens or workflow.max_new_tokens,
                force_output=None if force_outputs is None else force_outputs[i],
                keep_cache=keep_cache,
            )
        )
    return results


@dataclass
class MethodReport:
    method: str
    free: list[TurnResult]
    forced: list[TurnResult]
    per_turn: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, reference: MethodReport | None = None) -> dict[str, Any]:
        reuse_turns = [t for t in self.free if t.ph_tokens]
        out = {
            "method": self.method,
            "ttft_s": statistics.mean(t.ttft_s for t in self.free),
            "e2e_s": statistics.mean(t.e2e_s for t in self.free),
            "reuse_ratio": sum(t.tokens_reused for t in reuse_turns)
            / max(sum(t.ph_tokens for t in reuse_turns), 1),
            "agreement": statistics.mean(r["agreement"] for r in self.per_turn),
            "kl": statistics.mean(r["kl"] for r in self.per_turn),
            "kv_error": statistics.mean(r["kv_error"] for r in self.per_turn),
            "peak_memory_mb": max(t.peak_memory_bytes for t in self.free) / 2**20,
        }
        if reference is not None:
            out["ttft_ratio"] = (
                statistics.mean(t.ttft_s for t in reference.free) / out["ttft_s"]
                if out["ttft_s"] > 0
                else float("nan")
            )
            out["exact_match"] = statistics.mean(
                float(a.output_ids.tolist() == b.output_ids.tolist())
                for a, b in zip(self.free, reference.free)
            )
        return out


def compare_methods(
    model,
    tokenizer,
    workflow: Workflow | Callable[[], Workflow],
    methods: Sequence[Any],
    progress: bool = True,
) -> dict[str, MethodReport]:
    """Run ``workflow`` with NonShared and every method in ``methods`` (names or instances).

    A method given by name gets a fresh instance for each pass, so state that outlives a request
    (KVCMAS's anchor pools, GraphFlow's profiles) starts empty. An instance is used for both passes
    and keeps that state across calls: pass instances to compare methods over several workflows.

    Returns one :class:`MethodReport` per method, NonShared included as ``"nonshared"``.
    """
    make = workflow if callable(workflow) else (lambda: workflow)
    reference_free = run_workflow(Session(model, tokenizer, "nonshared"), make(), progress=progress)
    forced_ids = [t.output_ids for t in reference_free]
    reference_forced = run_workflow(
        Session(model, tokenizer, "nonshared"),
        make(),
        force_outputs=forced_ids,
        keep_cache=True,
        progress=progress,
    )
    reports = {}
    wanted = [m for m in methods if m != "nonshared"]
    for method in tqdm(["nonshared", *wanted], desc="methods", disable=not progress):
        if method == "nonshared":
            free, forced = reference_free, reference_forced
        else:
            free = run_workflow(Session(model, tokenizer, method), make(), progress=progress)
            forced = run_workflow(
                Session(model, tokenizer, method),
                make(),
                force_outputs=forced_ids,
                keep_cache=True,
                progress=progress,
            )
        name = method if isinstance(method, str) else method.name
        report = MethodReport(method=name, free=free, forced=forced)
        for turn, ref in zip(forced, reference_forced):
            ph = [s for s in turn.segments if s.kind == "PH"]
            errors = [kv_error(turn.cache, ref.cache, s.start, s.end) for s in ph]
            report.per_turn.append(
                {
                    "agent": turn.agent,
                    "agreement": top1_agreement(ref.logits, turn.logits),
                    "kl": mean_kl(ref.logits, turn.logits),
                    "kv_error": statistics.mean(errors) if errors else 0.0,
                    "reuse_ratio": turn.reuse_ratio,
                }
            )
        if forced is not reference_forced:
            for turn in forced:
                turn.cache = None  # keep only the numbers
        reports[name] = report
    for ref in reference_forced:
        ref.cache = None
    return reports


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

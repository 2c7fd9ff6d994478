"""Controlled traces (the seeds' serving-efficiency setup, single stream): see the ``trace`` row of
the workload table in ``docs/workloads.md``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .base import Workload, register_workload
from .spec import AgentSpec, SlotSpec, StepSpec, TaskSpec, trajectory_task

ROLES = [
    ("planner", "You are the planner. Break the work into small steps and keep the team on track."),
    ("researcher", "You are the researcher. Pull the relevant facts out of the shared material."),
    ("critic", "You are the critic. Point out gaps, risks and mistakes in what the team wrote."),
    ("coder", "You are the programmer. Turn the team's conclusions into precise instructions."),
    ("writer", "You are the writer. Summarize the team's findings clearly for a reader."),
    ("tester", "You are the tester. Propose checks that would show whether the plan works."),
    ("analyst", "You are the analyst. Quantify the options and compare them with numbers."),
    ("reviewer", "You are the reviewer. Decide what is ready and what needs another pass."),
]

_SUBJECTS, _VERBS, _OBJECTS, _TAILS = (
    words.split("|")
    for words in (
        "the council|the engineer|a farmer|the library|our team|the river|a small shop|the old mill|the committee|a student|the bakery|the museum|the city|a volunteer|the budget",
        "reviewed|planned|measured|repaired|described|funded|opened|compared|questioned|improved|delayed|approved|studied|visited|reported",
        "the bridge|a new roof|the water supply|three options|the spring schedule|the costs|a public survey|the north road|two proposals|the storage rooms|the harvest|a safety review|the opening hours|the archive|the main hall",
        "before winter|after a long debate|with care|for the third time|in the morning|despite the rain|within budget|at the last meeting|without delay|for the neighbours",
    )
)


def synthetic_text(tokenizer: Any, n_tokens: int, rng: random.Random) -> str:
    """Plain English-like text that tokenizes (on its own) to exactly ``n_tokens`` tokens."""
    if n_tokens < 1:
        raise ValueError(f"shared_tokens must be >= 1, got {n_tokens}")
    sentences: list[str] = []
    length = 0
    while length < n_tokens + 8:
        sentence = f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
        sentences.append(sentence)
        length += len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
    text = " ".join(sentences)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    longer = range(n_tokens, min(n_tokens + 8, len(ids)) + 1)  # a boundary may merge on re-tokenizing
    for cut in [*longer, *range(n_tokens - 1, max(n_tokens - 8, 0), -1)]:
        candidate = tokenizer.decode(ids[:cut])
        if len(tokenizer(candidate, add_special_tokens=False)["input_ids"]) == n_tokens:
            return candidate
    raise RuntimeError(f"could not build a text of exactly {n_tokens} tokens with this tokenizer")


@register_workload
@dataclass
class TraceWorkload(Workload):
    """N agents x R rounds over a shared context of a fixed length; fixed-length outputs fed forward."""

    name = "trace"
    description = (
        "controlled trace: N agents x R rounds, shared context of a fixed length, fixed-length outputs"
    )

    shared_tokens: int = 512
    agents: int = 3
    rounds: int = 1
    output_tokens: int = 32
    requests: int = 1
    #: agents run with PEFT adapters named after their roles (planner, researcher, ...; load them
    #: with ``--adapter ROLE=PATH``): the workload of the PReCache methods' timings, laid out as
    #: PReCache's setting is: one append-only trajectory (the context, then per turn an instruction
    #: naming the role and the output), agents differing by adapter only
    agent_adapters: bool = False

    def __post_init__(self) -> None:
        for field_name in ("shared_tokens", "agents", "rounds", "output_tokens", "requests"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"trace: {field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.agents > len(ROLES):
            raise ValueError(f"trace: at most {len(ROLES)} agents, got {self.agents}")

    def tag(self) -> str:
        tag = f"trace-S{self.shared_tokens}-N{self.agents}-R{self.rounds}-O{self.output_tokens}-Q{self.requests}"
        return tag + ("-lora" if self.agent_adapters else "")

    def params(self) -> dict[str, Any]:
        params = super().params()
        if not self.agent_adapters:  # runs from before the option keep their configuration
            del params["agent_adapters"]
        return params

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        if self.agent_adapters:
            return self._trajectory_tasks(tokenizer, seed)
        roles = ROLES[: self.agents]
        agents = [
            AgentSpec(
                name=name,
                system=system,
                tail="\n\nContinue the team's work:",
                adapter=name if self.agent_adapters else None,
            )
            for name, system in roles
        ]
        tasks = []
        for r in range(self.requests):
            rng = random.Random(f"{seed}-{r}")
            context = synthetic_text(tokenizer, self.shared_tokens, rng)
            schedule, outputs = [], []
            for _ in range(self.rounds):
                for name, _ in roles:
                    n = sum(1 for o in outputs if o.split("#")[0] == name) + 1
                    schedule.append(
                        StepSpec(
                            agent=name,
                            reads=("context", *outputs),
                            max_new_tokens=self.output_tokens,
                            min_new_tokens=self.output_tokens,
                        )
                    )
                    outputs.append(name if n == 1 else f"{name}#{n}")
            tasks.append(
                TaskSpec(
                    id=f"trace-{r}",
                    agents=agents,
                    slots=[SlotSpec(name="context", text=context, label="Shared notes")],
                    schedule=schedule,
                    max_new_tokens=self.output_tokens,
                )
            )
        return tasks

    def _trajectory_tasks(self, tokenizer: Any, seed: int) -> list[TaskSpec]:
        """The context, then per turn an instruction naming the role and its output, as one append-only
        trajectory (:func:`~.spec.trajectory_task`, as the AutoAct workload lays its requests out)."""
        roles = [name for name, _ in ROLES[: self.agents]]
        turns = [
            (name, f"\n\nContinue the team's work as the {name}:")
            for _ in range(self.rounds)
            for name in roles
        ]
        tasks = []
        for r in range(self.requests):
            context = synthetic_text(tokenizer, self.shared_tokens, random.Random(f"{seed}-{r}"))
            tasks.append(
                trajectory_task(
                    f"trace-{r}",
                    roles,
                    turns,
                    self.output_tokens,
                    leading=(SlotSpec(name="context", text=context),),
                    step_tokens=self.output_tokens,
                )
            )
        return tasks

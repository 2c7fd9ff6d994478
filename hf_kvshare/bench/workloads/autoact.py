"""Multi-LoRA AutoAct loop: plan -> act -> reflect agents that differ by LoRA adapter.

The episodes are those of :mod:`hf_kvshare.bench.workloads.autoact_world`, the environment the role
adapters are trained on, with the environment replayed (a turn sees the page the reference action
looked up, whatever the agent wrote, so every method sees the same prompts). Every turn's prompt is
the whole trajectory so far plus its own new instruction (a PH slot too, since later agents read
it). More in ``docs/workloads.md`` ("LoRA agents").
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .autoact_world import ROLES, TRAINING_FILLER, World, gold_turns, instruction
from .base import Workload, register_workload, select
from .files import load_table
from .spec import TaskSpec, trajectory_task

#: questions generated per world seed (a request index past it is an error)
WORLD_QUESTIONS = 64


@register_workload
@dataclass
class AutoActWorkload(Workload):
    """plan/act/reflect episodes; agents are LoRA adapters named plan/act/reflect."""

    name = "autoact"
    description = (
        "multi-LoRA plan/act/reflect episodes over an append-only trajectory, AutoAct-style "
        "(needs --adapter plan/act/reflect)"
    )

    hops: int = 1  # generated questions: how many countries to walk north (1 -> 3 lookups, 8 turns)
    limit: int | None = 4
    offset: int = 0
    max_new_tokens: int = 64  # turns end at <|im_end|>; a final reflection needs ~40 tokens
    data: str | None = None  # a table with a `question` (and optional `answer`) column
    rounds: int = 1  # --data questions: plan/act/reflect rounds

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        if self.rounds < 1:
            raise ValueError(f"autoact: rounds must be >= 1, got {self.rounds}")
        if self.hops < 1:
            raise ValueError(f"autoact: hops must be >= 1, got {self.hops}")
        if self.data is None:
            if self.rounds != 1:
                raise ValueError(
                    f"autoact: rounds ({self.rounds}) applies to --data questions; a generated episode's "
                    "length follows its question (set it with hops)"
                )
            return self._world_tasks(seed)
        return self._data_tasks()

    def _world_tasks(self, seed: int) -> list[TaskSpec]:
        world = World.generate(seed=seed, filler=TRAINING_FILLER)  # the adapters' world
        rng = random.Random(f"autoact-bench-{seed}")  # not the training questions' stream
        questions = [world.question("chain", self.hops, rng) for _ in range(WORLD_QUESTIONS)]
        tasks = []
        for i in select(len(questions), self.offset, self.limit):
            question = questions[i]
            turns = [(t.agent, t.instruction) for t in gold_turns(world, question)]
            tasks.append(self._task(f"autoact-{i}", turns, question.answer))
        return tasks

    def _data_tasks(self) -> list[TaskSpec]:
        table = load_table(self.data, None, "test")
        if "question" not in table.column_names:
            raise ValueError(f"{self.data}: needs a `question` column; found {', '.join(table.column_names)}")
        answers = table["answer"] if "answer" in table.column_names else None
        tasks = []
        for i in select(len(table), self.offset, self.limit):
            turns = [
                (role, instruction(role, first=r == 0 and role == ROLES[0], question=table[i]["question"]))
                for r in range(self.rounds)
                for role in ROLES
            ]
            answer = None if answers is None or answers[i] is None else str(answers[i])
            tasks.append(self._task(f"autoact-{i}", turns, answer))
        return tasks

    def _task(self, task_id: str, turns: list[tuple[str, str]], answer: str | None) -> TaskSpec:
        """One request: turn ``t`` reads the trajectory so far plus its instruction slot ``instruction<t>``
        and writes ``<agent>@<t>`` (:func:`~.spec.trajectory_task`; the instructions carry the chat
        markup the adapters were trained on)."""
        return trajectory_task(task_id, list(ROLES), turns, self.max_new_tokens, answer=answer)

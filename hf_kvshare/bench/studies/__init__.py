"""Studies behind the figures in ``docs/results/``: each is a bench configuration (``bench run``
arguments) plus extra :class:`~hf_kvshare.bench.runner.Collector` objects, with no run loop of its
own; ``python -m hf_kvshare.bench study <name> [bench run options]`` (see ``docs/workloads.md``).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from ..report import markdown_table, report, write_csv
from ..runner import Collector


class TableCollector(Collector):
    """A collector whose rows become ``<configuration>/<name>.csv`` and a markdown section."""

    name = "rows"
    title = ""
    columns: list[tuple[str, str, str]] = []

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def finish(self, runner) -> None:
        if self.rows:
            write_csv(runner.dir / f"{self.name}.csv", self.rows)

    def markdown(self) -> str:
        if not self.rows:
            return ""
        return f"\n## {self.title}\n\n" + markdown_table(self.rows, self.columns)


def run_study(
    name: str,
    defaults: Sequence[str],
    argv: Sequence[str],
    collectors: Sequence[TableCollector],
    intro: str,
    shown: Sequence[str] | None = None,
) -> int:
    """``bench run`` with the study's ``defaults`` then the user's ``argv`` (later options win), the
    study's collectors attached; writes ``<configuration>/<name>.md``: the command, the bench's
    summary and hop tables, and each collector's table. ``shown``: the arguments the report's command
    line shows (default ``argv``)."""
    from ..__main__ import run_command

    code, runners = run_command([*defaults, *argv], collectors, prog=f"study {name}")
    if code:
        return code
    command = shlex.join(
        ["python", "-m", "hf_kvshare.bench", "study", name, *(argv if shown is None else shown)]
    )
    for runner in runners:
        parts = [
            f"# {name} study\n",
            intro.strip() + "\n",
            f"Command: `{command}`\n",
            report([runner.dir], "fidelity", by_hop=("kv_error", "agreement")),
            *(c.markdown() for c in collectors),
        ]
        path = runner.dir / f"{name}.md"
        path.write_text("\n".join(p for p in parts if p) + "\n")
        print(f"study report: {path}")
    return 0

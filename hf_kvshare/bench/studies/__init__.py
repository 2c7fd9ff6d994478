"""Studies behind the figures in ``docs/results/``: each is a bench configuration (a
:class:`~hf_kvshare.bench.command.RunOptions`, the user's ``bench run`` arguments over the study's
defaults) plus extra :class:`~hf_kvshare.bench.runner.Collector` objects, with no run loop of its
own; ``python -m hf_kvshare.bench study <name> [bench run options]`` (see ``docs/workloads.md``).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from ..command import RunOptions
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


def study_options(name: str, argv: Sequence[str], defaults: Mapping[str, Any]) -> RunOptions:
    """The study's :class:`~hf_kvshare.bench.command.RunOptions`: ``bench run``'s options from the
    user's ``argv`` over the study's ``defaults`` (``RunOptions`` fields; what ``argv`` gives wins)."""
    from .. import __main__ as cli

    return cli.parse_run(argv, f"study {name}", defaults)


def run_study(
    name: str,
    options: RunOptions,
    collectors: Sequence[TableCollector],
    intro: str,
    shown: Sequence[str],
) -> int:
    """``bench run`` with the study's ``options`` (:func:`study_options`), its collectors attached;
    writes ``<configuration>/<name>.md``: the command (``shown``: the arguments it shows), the bench's
    summary and hop tables, and each collector's table."""
    from .. import __main__ as cli
    from ..command import run_command

    code, runners = run_command(options, collectors, prog=f"{cli.PROG} study {name}")
    if code:
        return code
    command = shlex.join(["python", "-m", "hf_kvshare.bench", "study", name, *shown])
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

"""PReCache study: the LoRA-agent methods on the AutoAct plan -> act -> reflect loop with role adapters.

    python -m hf_kvshare.bench study precache --adapters runs/adapters --out runs/studies --threads 1

``--adapters DIR`` loads ``DIR/<role>`` for each role, training them first when missing
(``--adapter NAME=PATH`` works as in ``bench run``); :class:`AdapterFree` tells whether the role
format comes from the adapters.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from ...prefill import model_input_device
from ..workloads.autoact_world import ROLES
from . import TableCollector, run_study, study_options

DEFAULTS = {"workload": "autoact"}
METHODS = [
    "nonshared",
    "fullshared",
    "baseshared",
    "prelrshared",
    "prelrshared:materialize=lazy",
    "rebaseshared-lp",
    "rebaseshared-db",
]
ROLE_FORMAT = {
    "plan": re.compile(r"^\s*Thought:"),
    "act": re.compile(r"Action:\s*Lookup\[[^\]]+\]"),
    "reflect": re.compile(r"^\s*Reflection:"),
}


class AdapterFree(TableCollector):
    """The first ``count`` NonShared prompts of each recorded request answered with the adapters
    disabled (greedy, as many tokens as NonShared generated): does the role format need the adapters?"""

    name, title = "adapter_free", "Role format with and without the adapters (NonShared prompts)"
    columns = [
        ("agent", "agent", ""),
        ("turns", "turns", "d"),
        ("with_adapter", "role format, adapter", ".2f"),
        ("adapter_free", "role format, adapters off", ".2f"),
    ]

    def __init__(self, count: int = 6) -> None:
        super().__init__()
        self.count, self.turns = count, []

    def collect(self, runner, task, index, run) -> None:
        model = runner.model
        for turn in run.free[run.reference][: self.count]:
            ids = turn.prompt_ids[None].to(model_input_device(model))
            n = max(int(turn.output_ids.numel()), 1)
            with torch.no_grad(), model.disable_adapter():
                out = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
                )
            text = runner.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            pattern = ROLE_FORMAT.get(turn.agent)
            if pattern is not None:
                self.turns.append((turn.agent, bool(pattern.search(turn.text)), bool(pattern.search(text))))

    def finish(self, runner) -> None:
        for agent in ROLES:
            rows = [t for t in self.turns if t[0] == agent]
            if rows:
                self.rows.append(
                    {
                        "agent": agent,
                        "turns": len(rows),
                        "with_adapter": sum(r[1] for r in rows) / len(rows),
                        "adapter_free": sum(r[2] for r in rows) / len(rows),
                    }
                )
        super().finish(runner)


def role_adapters(directory: str, progress: bool = True) -> dict[str, str]:
    """``{role: DIR/role}`` for every role (``--adapter ROLE=DIR/ROLE``), training the adapters into
    ``DIR`` when missing."""
    path = Path(directory)
    if not all((path / r / "adapter_config.json").exists() for r in ROLES):
        from ..train_roles import train_roles

        print(
            f"no role adapters in {path}: training them (python -m hf_kvshare.bench.train_roles --out {path})"
        )
        train_roles(path, progress=progress)
    return {r: str(path / r) for r in ROLES}


def main(argv: list[str] | None = None) -> int:
    argv = shown = list(sys.argv[1:] if argv is None else argv)
    defaults = {**DEFAULTS, "methods": METHODS}
    if "--adapters" in argv:
        i = argv.index("--adapters")
        if i + 1 >= len(argv):
            raise SystemExit("--adapters expects a directory")
        defaults["adapters"] = role_adapters(argv[i + 1], progress="--no-progress" not in argv)
        argv = argv[:i] + argv[i + 2 :]
    options = study_options("precache", argv, defaults)
    return run_study("precache", options, [AdapterFree()], __doc__.split("\n\n")[0], shown)


if __name__ == "__main__":
    raise SystemExit(main())

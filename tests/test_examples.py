"""The shipped example task file (examples/tasks.jsonl) and the task-file example of
docs/workloads.md: JSONL, valid, the same requests, and runnable by the bench (tiny random Llama)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench_helpers import save_tiny

from hf_kvshare.bench.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tasks.jsonl"


def test_docs_example_is_the_shipped_jsonl_file():
    docs = (ROOT / "docs" / "workloads.md").read_text()
    blocks = re.findall(r"```jsonl\n(.*?)```", docs, flags=re.S)
    assert blocks == [EXAMPLE.read_text()]
    lines = EXAMPLE.read_text().splitlines()
    assert len(lines) >= 2 and all(isinstance(json.loads(line), dict) for line in lines)  # one object a line
    assert "```json\n{" not in docs  # no pretty-printed task left


def test_validate_and_run_the_example(tmp_path, tokenizer, capsys):
    assert main(["validate", str(EXAMPLE)]) == 0
    assert "2 tasks, 6 agent turns: OK" in capsys.readouterr().out
    assert main(["validate", str(EXAMPLE), "--adapter", "plan"]) == 0  # its agents name no adapter
    model = save_tiny(tmp_path / "tiny", tokenizer)
    argv = ["run", "--workload", "file", "--data", str(EXAMPLE), "--model", str(model)]
    argv += ["--methods", "fullshared", "--out", str(tmp_path / "out"), "--no-progress", "--no-plots"]
    assert main(argv) == 0
    config = next(d for d in (tmp_path / "out").iterdir() if (d / "summary.json").exists())
    summary = json.loads((config / "summary.json").read_text())
    assert [m["method"] for m in summary["methods"]] == ["nonshared", "fullshared", "limit"]
    assert all(
        m["turns"] == 6 for m in summary["methods"] if m["method"] != "limit"
    )  # limit: reuse turns only

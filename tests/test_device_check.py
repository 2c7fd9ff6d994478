"""`bash scripts/device_check.sh --tiny`: the CPU mode of the prepared device check keeps working."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_script_hands_the_check_to_pythons_module(tmp_path):
    """The script runs ``$PYTHON -m hf_kvshare.bench.device_check --out $OUT ARGS`` with the checkout on
    the import path: a true subprocess, with a stand-in ``$PYTHON`` that records what it was given (the
    tiny check itself runs in-process below, without a second interpreter importing the package)."""
    stand_in = tmp_path / "python"
    stand_in.write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" > "$OUT/argv"\nprintf "%s" "$PYTHONPATH" > "$OUT/path"\n'
    )
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "PYTHON": str(stand_in)}
    result = subprocess.run(
        ["bash", "scripts/device_check.sh", "--tiny"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    argv = (out / "argv").read_text().splitlines()
    assert argv == ["-m", "hf_kvshare.bench.device_check", "--out", str(out), "--tiny"]
    assert (out / "path").read_text().split(os.pathsep)[0] == str(ROOT)


def test_the_module_runs_as_a_program(monkeypatch, capsys):
    """What the script's ``-m`` starts: the module's ``__main__`` guard calls ``main`` (run in-process)."""
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["device_check", "--help"])
    monkeypatch.delitem(sys.modules, "hf_kvshare.bench.device_check", raising=False)
    try:
        runpy.run_module("hf_kvshare.bench.device_check", run_name="__main__")
    except SystemExit as stop:
        assert stop.code == 0
    else:
        raise AssertionError("the module's __main__ guard did not run main (no exit)")
    assert "--tiny" in capsys.readouterr().out


def test_device_check_tiny_mode_writes_json_and_table(tmp_path, monkeypatch, capsys):
    from hf_kvshare.bench import device_check

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = device_check.main(["--tiny", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err[-4000:]
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert data["tiny"] and data["exactness"]["passed"], data["exactness"]
    assert data["exactness"]["nonshared_tokens"] == data["exactness"]["generate_tokens"]
    methods = {(r["method"], r["lora"]) for r in data["rows"]}
    expected = {"nonshared", "fullshared", "fullshared:prefix_reuse=True", "kvcmas:tau=1.0", "kvcomm:tau=1.0"}
    expected.add("cacheblend")
    assert {(m, False) for m in expected} <= methods
    assert {("prelrshared", True), ("rebaseshared-lp", True)} <= methods
    limits = [r for r in data["rows"] if r["method"] == "limit"]
    assert limits and all(r["ttft_mean_s"] > 0 for r in limits)  # the physical-limit row of each sweep
    for row in data["rows"]:
        if row["method"] == "limit":
            continue
        assert row["shared_tokens"] == 256 and row["ttft_mean_s"] > 0 and row["peak_memory_mb"] > 0, row
        assert "agreement" not in row  # random weights: no fidelity
    lora = [r for r in data["rows"] if r["lora"] and r["method"] not in ("nonshared", "limit")]
    assert lora and all(r["reuse_ratio"] > 0.5 for r in lora), lora  # the trajectory is shared
    corrected = [r for r in data["rows"] if r["method"].startswith(("kvcmas", "kvcomm"))]
    assert all(r["reuse_ratio"] > 0.5 for r in corrected), corrected  # the correction path was timed
    table = (tmp_path / "device_check.md").read_text()
    assert "| 256 | kvcmas:tau=1.0 |" in table and "random weights" in table
    assert "| record s |" in table  # the time after the first token, split
    assert "| TTFT s (all turns) |" in table  # the first agents' turns too
    assert all(r["ttft_all_mean_s"] > 0 for r in data["rows"] if r["method"] != "limit")


def test_a_check_stopped_by_sigint_keeps_the_configurations_that_finished(tmp_path, monkeypatch):
    """`timeout -s INT` during the LoRA stage: exit 1, both files written, marked incomplete, with the
    rows of the sweep that finished (read back from its summaries)."""
    from hf_kvshare.bench import device_check

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(device_check, "make_lora_adapters", stopped)
    assert device_check.main(["--tiny", "--out", str(tmp_path)]) == 1
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert "stopped (SIGINT)" in data["interrupted"] and data["exactness"]["passed"]
    methods = {r["method"] for r in data["rows"]}
    assert {"nonshared", "fullshared", "kvcmas:tau=1.0", "kvcomm:tau=1.0", "cacheblend"} <= methods
    assert not any(r["lora"] for r in data["rows"])
    assert all(
        r["shared_tokens"] == 256 and r["ttft_mean_s"] > 0 for r in data["rows"] if r["method"] != "limit"
    )
    assert "**incomplete**" in (tmp_path / "device_check.md").read_text()

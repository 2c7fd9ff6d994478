"""``bench run --state-out DIR`` / ``--state-in DIR``: a run starts warm from the method states an
earlier run saved (issue 13, item 9)."""

from __future__ import annotations

import json
import shutil

import pytest
from bench_helpers import save_tiny

from hf_kvshare.bench.__main__ import main

#: the runs read a saved model folder once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("folders_read_once")

TRACE = ["--workload", "trace", "--shared-tokens", "16", "--agents", "3", "--output-tokens", "2"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), tokenizer)


def summary(out, method):
    (config,) = [d for d in out.iterdir() if (d / "config.json").exists()]
    return config, json.loads((config / method / "summary.json").read_text())


def test_a_run_starts_warm_from_saved_state(tiny_dir, tmp_path, capsys):
    """GraphFlow calibrates densely on 2 requests: saved after them, a 1-request run corrects at once."""
    common = [*TRACE, "--methods", "graphflow", "--model", str(tiny_dir), "--no-progress", "--no-plots"]
    state = tmp_path / "state"
    assert (
        main(["run", *common, "--requests", "2", "--out", str(tmp_path / "calib"), "--state-out", str(state)])
        == 0
    )
    for tag in ("graphflow", "nonshared"):
        assert (state / tag / "state.json").is_file() and (
            state / tag / "forced" / "state.safetensors"
        ).is_file()
    assert json.loads((state / "graphflow" / "state.json").read_text())["meta"]["profiles"]
    assert main(["run", *common, "--requests", "1", "--out", str(tmp_path / "cold")]) == 0
    assert summary(tmp_path / "cold", "graphflow")[1]["reuse_ratio"] == 0.0
    assert (
        main(["run", *common, "--requests", "1", "--out", str(tmp_path / "warm"), "--state-in", str(state)])
        == 0
    )
    config, warm = summary(tmp_path / "warm", "graphflow")
    assert warm["reuse_ratio"] == 1.0 and "-S" in config.name
    assert warm["config"]["state_in"] == str(state)
    # a state directory without the method, or one saved with other options, is refused before any output
    assert (
        main(
            [
                "run",
                *common,
                "--methods",
                "kvcmas",
                "--requests",
                "1",
                "--out",
                str(tmp_path / "x"),
                "--state-in",
                str(state),
            ]
        )
        == 2
    )
    assert "no saved state for this method" in capsys.readouterr().err
    shutil.copytree(state / "graphflow", state / "graphflow-calibration_requests_3")
    assert (
        main(
            [
                "run",
                *TRACE,
                "--methods",
                "graphflow:calibration_requests=3",
                "--model",
                str(tiny_dir),
                "--no-progress",
                "--no-plots",
                "--requests",
                "1",
                "--out",
                str(tmp_path / "y"),
                "--state-in",
                str(state),
            ]
        )
        == 2
    )
    assert "other options" in capsys.readouterr().err

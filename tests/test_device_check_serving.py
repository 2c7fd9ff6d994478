"""`bash scripts/device_check.sh --serving`: its arguments, its plan (``--dry-run``) and its refusal
where vLLM's GPU wheel or a CUDA device is missing (the lent device has neither vLLM nor a way to
bring it); the runs themselves need a GPU with vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.sh"


def run_script(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": sys.executable, "VLLM_PYTHON": sys.executable, "OUT": str(tmp_path)}
    return subprocess.run(
        ["bash", str(SCRIPT), "--serving", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**environ, **env},
    )


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "ten"], "--budget ten"),
        (["--qps", "0"], "--qps: 0"),
        (["--shared-tokens", "8192,lots"], "--shared-tokens: lots"),
        (["--qps"], "--qps needs a value"),
        (["--fast"], "unknown argument --fast"),
    ],
)
def test_bad_arguments_stop_with_usage_before_anything_runs(args, message, tmp_path):
    result = run_script(*args, tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "usage: bash scripts/device_check.sh --serving" in result.stderr
    assert not any(tmp_path.iterdir())


def test_the_dry_run_prints_one_bench_serve_per_length_and_method(tmp_path):
    result = run_script("--dry-run", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if " -m hf_kvshare.bench serve " in line]
    assert len(commands) == 6
    for n, method in [(n, m) for n in (8192, 32768) for m in ("plain", "fullshared", "kvcmas")]:
        [command] = [c for c in commands if f"--shared-tokens {n} " in c and f"S{n}-{method} " in c]
        assert "--qps 0.25 2 8 " in command and "--dtype bfloat16" in command
        assert "--vllm-arg=--load-format=dummy" in command and "--gpu-memory-utilization=0.9" in command
    assert "model-llama-3.1-8b" in result.stdout
    assert not any(tmp_path.iterdir())  # nothing run, nothing written


def test_the_tiny_dry_run_is_the_cpu_smoke_plan(tmp_path):
    result = run_script("--tiny", "--dry-run", "--qps", "0.5,1", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if " -m hf_kvshare.bench serve " in line]
    assert len(commands) == 2 and all("--shared-tokens 256 " in c and "--qps 0.5 1 " in c for c in commands)
    assert all("--dtype float32" in c and "gpu-memory" not in c for c in commands)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine may have vLLM: the check would run")
def test_without_vllms_gpu_wheel_it_stops_saying_what_is_missing(tmp_path):
    result = run_script(tmp_path=tmp_path)
    assert result.returncode == 3, result.stderr
    err = " ".join(result.stderr.split())
    assert "cannot run:" in err
    assert any(
        cause in err for cause in ("vLLM is not installed", "not a CUDA build", "sees no CUDA device")
    ), err
    assert "228 MiB" in err and "64 MiB" in err and "no vLLM" in err
    assert not any(tmp_path.iterdir())

"""The GPU image has no `datasets` and no `gguf`: the package, the bench and its trace workload must
work without them, and a feature that needs one must name it."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

BLOCKED_SCRIPT = textwrap.dedent(
    """
    import sys
    for name in ("datasets", "gguf"):
        sys.modules[name] = None  # `import name` now raises ImportError, as if not installed

    import hf_kvshare
    import hf_kvshare.bench
    import hf_kvshare.bench.__main__
    from hf_kvshare.bench.workloads import make_workload
    from hf_kvshare.random_models import byte_tokenizer

    tok = byte_tokenizer()
    tasks = make_workload("trace", shared_tokens=64, requests=1).tasks(tok, 0)
    workflow = tasks[0].to_workflow(tok)
    assert len(workflow.steps) == 3, workflow
    try:
        make_workload("file", data="tasks.jsonl").tasks(tok, 0)
    except FileNotFoundError:
        pass  # checked before datasets is needed
    from hf_kvshare.bench.workloads.files import _load_dataset
    try:
        _load_dataset("json", {}, "tasks.jsonl")
    except ModuleNotFoundError as e:
        assert e.name == "datasets" and "pip install datasets" in str(e), e
    else:
        raise AssertionError("datasets is blocked, the load should have failed")
    from hf_kvshare.models import _require_gguf
    try:
        _require_gguf("smollm2-135m")
    except ModuleNotFoundError as e:
        assert e.name == "gguf" and "gguf" in str(e), e
    else:
        raise AssertionError("gguf is blocked, the check should have failed")
    print("OK", sorted(m for m in sys.modules if m.split(".")[0] in ("datasets", "gguf") and sys.modules[m]))
    """
)


def test_package_bench_and_trace_work_without_datasets_and_gguf():
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK []"), result.stdout


def test_transformers_floor_admits_the_gpu_image():
    """The H200 image ships transformers 5.17: the floor in pyproject must not exclude it."""
    text = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"transformers>=([0-9.]+)', text)
    assert floor is not None, "pyproject.toml has no transformers>= floor"
    assert Version(floor.group(1)) <= Version("5.17")


def test_a_turn_on_a_model_without_adapters_loads_no_peft(tiny_llama, tokenizer, monkeypatch):
    """PEFT (~1.7 CPU-s to import) is loaded by whoever builds adapters, never by a plain model's turn:
    asking whether a model is a ``PeftModel`` reads ``sys.modules`` (docs/architecture.md)."""
    from hf_kvshare import PF, Session

    for name in [m for m in sys.modules if m == "peft" or m.startswith("peft.")]:
        monkeypatch.delitem(sys.modules, name)  # as in a fresh process; restored after the test
    for method in ("nonshared", "fullshared"):
        Session(tiny_llama, tokenizer, method).run_turn("a", [PF("Hello there.")], max_new_tokens=2)
    assert "peft" not in sys.modules

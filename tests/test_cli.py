"""The ``hf-kvshare`` command: subcommands, ``--version``, usage lines, and the demo's checks before
the model loads (tiny random Llama saved to a directory; the real-model demo is in test_real_model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from bench_helpers import save_tiny

import hf_kvshare
from hf_kvshare import METHODS
from hf_kvshare.cli import COMMANDS, demo_methods, main

#: the runs read a saved model folder once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("folders_read_once")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_model_load(monkeypatch):
    import hf_kvshare.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(hf_kvshare.models, "load_model", refuse)


def test_one_console_script_with_subcommands():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"hf-kvshare": "hf_kvshare.cli:main"}
    assert set(COMMANDS) == {"demo", "bench", "train-roles", "serve"}


def test_help_lists_every_command_and_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-kvshare ") and all(f"\n  {c} " in out for c in COMMANDS)
    assert main([]) == 2 and "usage: hf-kvshare" in capsys.readouterr().err
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"hf-kvshare {hf_kvshare.__version__} (transformers ")
    assert main(["frobnicate"]) == 2 and "unknown command 'frobnicate'" in capsys.readouterr().err


def test_usage_lines_name_the_command_as_invoked(capsys):
    assert main(["bench", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: hf-kvshare bench {run,")
    for argv, prog in (
        (["bench", "run", "--help"], "usage: hf-kvshare bench run "),
        (["demo", "--help"], "usage: hf-kvshare demo "),
        (["train-roles", "--help"], "usage: hf-kvshare train-roles "),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(prog)
    # the bench on its own keeps its own name
    from hf_kvshare.bench.__main__ import main as bench_main

    with pytest.raises(SystemExit):
        bench_main(["run", "--help"])
    assert capsys.readouterr().out.startswith("usage: python -m hf_kvshare.bench run ")


def test_python_dash_m_is_the_same_command():
    out = subprocess.run(
        [sys.executable, "-m", "hf_kvshare", "--help"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.startswith("usage: python -m hf_kvshare ") and "train-roles" in out and "bench" in out


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-kvshare demo: error: "), err
    return lines[0]


@pytest.mark.parametrize("method", sorted(n for n, c in METHODS.items() if c.requires_adapters))
def test_demo_refuses_lora_agent_methods_before_loading(method, capsys, no_model_load):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--methods", "fullshared", method])
    line = one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2 and "differ by LoRA adapter" in line and "--workload autoact" in line
    assert method not in demo_methods()


@pytest.mark.parametrize(
    "methods, message",
    [
        (["droidspeak"], "offline profile"),
        (["droidspeak:rho=0.5"], "droidspeak:layer_profile=PATH"),
        (["kvcmas:tau=abc"], "tau must be a real number"),
        (["nope"], "unknown method 'nope'"),
    ],
)
def test_demo_argument_errors_before_loading(methods, message, capsys, no_model_load):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--methods", *methods])
    assert exit_info.value.code == 2 and message in one_line(capsys.readouterr().err)


def test_demo_runs_methods_with_options_on_a_local_model(tmp_path, tokenizer, capsys):
    model_dir = save_tiny(tmp_path / "tiny", tokenizer)
    argv = ["demo", "--model", str(model_dir), "--max-new-tokens", "2", "--no-progress"]
    assert main([*argv, "--methods", "fullshared", "droidspeak:rho=1.0", "kvcmas:tau=0.5"]) == 0
    out = capsys.readouterr().out
    assert all(m in out for m in ("nonshared", "fullshared", "droidspeak:rho=1.0", "kvcmas:tau=0.5"))
    # a profile of the wrong length is known only once the model is loaded: still one line, exit 2
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--methods", "droidspeak:rho=0.5,layer_profile=[1.0,2.0,3.0]"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading messages
    assert exit_info.value.code == 2 and "layer profile has 3 entries" in one_line(last)


def test_demo_runs_a_visual_workload_on_a_vision_language_model(tmp_path, capsys):
    """``demo --workload mathvista``: the bench's first drawn chart shared by its agents, every method
    beside NonShared; NonShared's own row is exact (KV error 0, same output)."""
    from tiny import save_tiny_vlm

    vlm = save_tiny_vlm(tmp_path / "vlm")
    argv = ["demo", "--workload", "mathvista", "--model", str(vlm), "--max-new-tokens", "2", "--no-progress"]
    assert main([*argv, "--methods", "fullshared", "kvcmas"]) == 0
    captured = capsys.readouterr()
    assert "mathvista task mathvista-0" in captured.err
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines() if line.split()}
    assert {"nonshared", "fullshared", "kvcmas"} <= set(rows)
    per_turn = [line.split() for line in captured.out.split("per turn")[1].splitlines() if line.strip()]
    fullshared = next(
        line for line in per_turn if line[0] == "fullshared"
    )  # fidelity ran on the image workflow
    assert "mathematical_analyst:" in fullshared and "final:" in fullshared


def test_demo_refuses_a_visual_workload_on_a_text_model_before_loading(capsys, no_model_load):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--workload", "mathvista"])
    err = one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2 and "text-only model" in err and "--workload mathvista" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--workload", "nosuch"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err

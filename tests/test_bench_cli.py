"""The benchmark CLI end to end on a tiny random Llama, for every registered method.

Methods registered later (kvcmas, cacheblend, precache, ...) are covered automatically: the
tests iterate over ``hf_kvshare.METHODS``. A method with ``requires_adapters = True`` runs on the
multi-LoRA workload with tiny random adapters instead of the prompt-specialized ones.
"""

from __future__ import annotations

import json
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from bench_helpers import GRAPH_TASKS, save_random_adapters, save_tiny, trace_args, write_jsonl

from hf_kvshare import METHODS
from hf_kvshare.bench import make_workload
from hf_kvshare.bench.__main__ import main
from hf_kvshare.bench.methods import MethodSpec, requires_adapters
from hf_kvshare.evaluation import calibrate_tau, realized_rho
from hf_kvshare.methods import Method, Placement

#: the runs read the tiny folder once (tests/conftest.py); the module's shared runs below read it themselves
pytestmark = pytest.mark.usefixtures("folders_read_once")

PROMPT_METHODS = sorted(n for n, c in METHODS.items() if not requires_adapters(c))
ALL_METHODS = sorted(METHODS)
TRACE = trace_args(rounds=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), tokenizer)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return save_random_adapters(tmp_path_factory.mktemp("adapters"))


def bench(*argv) -> int:
    return main([str(a) for a in argv])


def only_config(out: Path) -> Path:
    dirs = [d for d in out.iterdir() if d.is_dir() and (d / "config.json").exists()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def calibration_slice(tasks, tok) -> tuple[list, list]:
    """The workflows of ``tasks`` and their reusable slots, as ``bench calibrate`` passes them."""
    return [t.to_workflow(tok) for t in tasks], [t.reused_slots() for t in tasks]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_method_output(config_dir: Path, method: str, n_turns: int, n_requests: int) -> dict:
    tag = MethodSpec.parse(method).tag
    turns = read_jsonl(config_dir / tag / "turns.jsonl")
    requests = read_jsonl(config_dir / tag / "requests.jsonl")
    reference = read_jsonl(config_dir / "nonshared" / "turns.jsonl")
    assert len(turns) == n_turns and len(requests) == n_requests
    for t, r in zip(turns, reference):
        # every method sees the same prompts; fidelity numbers are proper
        assert (t["request"], t["position"], t["prompt_tokens"]) == (
            r["request"],
            r["position"],
            r["prompt_tokens"],
        )
        assert (
            0.0 <= t["agreement"] <= 1.0 and t["kl"] >= -1e-6 and t["kv_error"] is None or t["kv_error"] >= 0
        )
        assert t["reuse_ratio"] is None or 0.0 <= t["reuse_ratio"] <= 1.0
        assert t["output_tokens"] >= 1 and t["ttft_s"] > 0 and t["e2e_s"] >= t["ttft_s"]
    summary = json.loads((config_dir / tag / "summary.json").read_text())
    assert summary["turns"] == n_turns and summary["config"]["method"] == MethodSpec.parse(method).name
    return summary


# ----------------------------------------------------------- every method
@dataclass
class SharedRun:
    """One ``bench run`` of many methods, shared by the tests of a module (each checks its method's
    folder: methods run interleaved, each with its own instances, so a method's records are what a
    run of that method alone writes; NonShared, the model load and the plots are paid once)."""

    code: int
    out: Path
    printed: str


def shared_run(tmp_path_factory, name: str, *argv) -> SharedRun:
    import contextlib
    import io

    out = tmp_path_factory.mktemp(name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = bench("run", *argv, "--out", out, "--no-progress")
    return SharedRun(code, out, printed.getvalue())


@pytest.fixture(scope="module")
def trace_run(tiny_dir, tmp_path_factory) -> SharedRun:
    """Every prompt method on the controlled trace, with plots."""
    return shared_run(
        tmp_path_factory, "trace-run", *TRACE, "--methods", *PROMPT_METHODS, "--model", tiny_dir
    )


@pytest.fixture(scope="module")
def graph_run(tiny_dir, tmp_path_factory) -> SharedRun:
    """Every prompt method on the task-file graph."""
    data = write_jsonl(tmp_path_factory.mktemp("graph") / "graph.jsonl", GRAPH_TASKS)
    argv = ["--workload", "file", "--data", data, "--methods", *PROMPT_METHODS, "--model", tiny_dir]
    return shared_run(tmp_path_factory, "graph-run", *argv, "--no-plots")


@pytest.fixture(scope="module")
def lora_run(tiny_dir, adapters, tmp_path_factory) -> SharedRun:
    """Every method on the multi-LoRA workload with the random adapters."""
    argv = ["--workload", "autoact", "--limit", "1", "--max-new-tokens", "3", "--methods", *ALL_METHODS]
    argv += ["--model", tiny_dir, *[f"--adapter={name}={path}" for name, path in adapters.items()]]
    return shared_run(tmp_path_factory, "lora-run", *argv, "--no-plots")


@pytest.mark.parametrize("method", PROMPT_METHODS)
def test_every_method_on_a_controlled_trace(method, trace_run):
    assert trace_run.code == 0
    config = only_config(trace_run.out)
    summary = check_method_output(config, method, n_turns=6, n_requests=1)
    ref = json.loads((config / "nonshared" / "summary.json").read_text())
    assert (
        ref["agreement"] == 1.0
        and ref["kv_error"] == 0.0
        and ref["reuse_ratio"] == 0.0
        and ref["exact_match"] == 1.0
    )
    assert summary["reuse_turns"] == 5 and 0.0 <= summary["reuse_ratio"] <= 1.0
    if method == "fullshared":
        assert summary["reuse_ratio"] == 1.0 and summary["kv_error"] > 1e-4
    # what the session keeps for reuse: slot sources (chained, recomputing methods) or context-free
    # references (non-chained correction); NonShared keeps nothing
    assert (ref["request_state_mb"] == 0) and (summary["request_state_mb"] > 0) == (method != "nonshared")
    # the configuration summary (JSON + CSV), the plots and the printed table
    table = json.loads((config / "summary.json").read_text())
    assert [m["method"] for m in table["methods"]][0] == "nonshared"
    assert method in (config / "summary.csv").read_text()
    for name in ("fidelity_vs_ttft", "kv_error_by_layer", "kv_error_by_agent", "effective_rank_by_layer"):
        assert (config / "plots" / f"{name}.csv").exists() and (config / "plots" / f"{name}.png").exists()
    assert re.search(rf"(?<![\w-]){re.escape(method)}(?![\w-])", trace_run.printed)  # its row of the table


@pytest.mark.parametrize("method", PROMPT_METHODS)
def test_every_method_on_a_task_file_graph(method, graph_run):
    assert graph_run.code == 0
    config = only_config(graph_run.out)
    summary = check_method_output(config, method, n_turns=7, n_requests=2)
    assert summary["checked"] == 1  # graph-1 has a numeric checker, graph-2 none
    turns = read_jsonl(config / MethodSpec.parse(method).tag / "turns.jsonl")
    assert [t["output_slot"] for t in turns] == [
        "planner",
        "coder",
        "tester",
        "judge",
        "planner#2",
        "a",
        "verdict",
    ]
    assert turns[2]["output_tokens"] <= 2 and turns[4]["output_tokens"] >= 2  # per-step max/min new tokens


@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_method_on_the_multi_lora_workload(method, adapters, lora_run):
    assert lora_run.code == 0
    config = only_config(lora_run.out)
    summary = check_method_output(config, method, n_turns=8, n_requests=1)
    turns = read_jsonl(config / MethodSpec.parse(method).tag / "turns.jsonl")
    assert [t["agent"] for t in turns] == ["plan", "act", "plan", "act", "reflect", "plan", "act", "reflect"]
    # what the session keeps for reuse: PReCache its base + LR caches, FullShared the slots' K/V,
    # NonShared nothing
    if MethodSpec.parse(method).requires_adapters or method == "fullshared":
        assert summary["request_state_mb"] > 0
    elif method == "nonshared":
        assert summary["request_state_mb"] == 0
    assert summary["config"]["adapters"] == {k: str(v) for k, v in adapters.items()}


def test_adapters_change_the_reference(tiny_dir, adapters, tmp_path, capsys):
    """The agent's adapter is really active: NonShared's outputs differ from the base model's."""
    common = [
        "run",
        "--workload",
        "autoact",
        "--limit",
        "1",
        "--max-new-tokens",
        "4",
        "--methods",
        "nonshared",
        "--model",
        tiny_dir,
        "--no-progress",
        "--no-plots",
        "--no-fidelity",
    ]
    bench(*common, "--out", tmp_path / "lora", *[f"--adapter={n}={p}" for n, p in adapters.items()])
    assert bench(*common, "--out", tmp_path / "base") == 2
    assert "which are not loaded (loaded: none); pass --adapter NAME=PATH" in capsys.readouterr().err
    lora = read_jsonl(only_config(tmp_path / "lora") / "nonshared" / "turns.jsonl")
    plan_only = [
        "--adapter=plan=" + str(adapters["plan"]),
        "--adapter=act=" + str(adapters["plan"]),
        "--adapter=reflect=" + str(adapters["plan"]),
    ]
    bench(*common, "--out", tmp_path / "plan", *plan_only)
    same = read_jsonl(only_config(tmp_path / "plan") / "nonshared" / "turns.jsonl")
    assert lora[0]["output_ids"] == same[0]["output_ids"]  # the plan turn uses the plan adapter in both
    assert [t["output_ids"] for t in lora[1:]] != [t["output_ids"] for t in same[1:]]


# ------------------------------------------------------------ skip if done
def test_runs_already_done_are_skipped(tiny_dir, tmp_path, capsys):
    base = ["run", *TRACE, "--model", tiny_dir, "--out", tmp_path, "--no-progress", "--no-plots"]
    assert bench(*base, "--methods", "nonshared") == 0
    config = only_config(tmp_path)
    ref_turns = (config / "nonshared" / "turns.jsonl").read_text()
    stamp = (config / "nonshared" / "summary.json").stat().st_mtime_ns
    capsys.readouterr()
    assert bench(*base, "--methods", "nonshared", "fullshared") == 0  # only fullshared runs
    out = capsys.readouterr().out
    assert "skipped: nonshared" in out and "fullshared" in out
    assert (config / "nonshared" / "summary.json").stat().st_mtime_ns == stamp
    assert (config / "nonshared" / "turns.jsonl").read_text() == ref_turns
    full_stamp = (config / "fullshared" / "summary.json").stat().st_mtime_ns
    assert bench(*base, "--methods", "fullshared") == 0  # everything done: nothing runs
    assert "skipped: nonshared, fullshared" in capsys.readouterr().out
    assert (config / "fullshared" / "summary.json").stat().st_mtime_ns == full_stamp
    rows = json.loads((config / "summary.json").read_text())["methods"]
    assert [m["method"] for m in rows] == ["nonshared", "fullshared", "limit"]  # limit: bench/limit.py
    # --redo runs them again
    assert bench(*base, "--methods", "fullshared", "--redo") == 0
    assert (config / "fullshared" / "summary.json").stat().st_mtime_ns != full_stamp
    # a different configuration in the same directory is refused, not mixed in
    assert bench(*base, "--methods", "fullshared", "--no-erank") == 2
    assert "different configuration" in capsys.readouterr().err
    # an unfinished method (no summary.json) is run again
    (config / "fullshared" / "summary.json").unlink()
    assert bench(*base, "--methods", "fullshared") == 0
    assert (config / "fullshared" / "summary.json").exists()


def test_sweep_writes_one_directory_per_length_and_a_sweep_plot(tiny_dir, tmp_path, capsys):
    args = [
        "run",
        "--workload",
        "trace",
        "--shared-tokens",
        "16",
        "32",
        "--agents",
        "2",
        "--output-tokens",
        "2",
    ]
    assert bench(*args, "--model", tiny_dir, "--out", tmp_path, "--no-progress", "--no-fidelity") == 0
    configs = sorted(d.name for d in tmp_path.iterdir() if d.name.startswith("trace"))
    assert [c.split("__")[0] for c in configs] == ["trace-S16-N2-R1-O2-Q1", "trace-S32-N2-R1-O2-Q1"]
    sweep = next((tmp_path / "plots").iterdir())
    rows = (sweep / "ttft_vs_shared_tokens.csv").read_text().splitlines()
    assert rows[0].startswith("shared_tokens,method") and len(rows) == 1 + 2 * 3  # + the limit row
    assert sum(",limit," in row for row in rows) == 2
    assert (sweep / "ttft_vs_shared_tokens.png").exists()
    summary = json.loads((tmp_path / configs[0] / "summary.json").read_text())["methods"][1]
    assert "agreement" not in summary and summary["reuse_ratio"] == 1.0  # speed only
    # the plot command redraws from the directories; report prints markdown tables
    assert bench("plot", tmp_path, "--out", tmp_path / "again") == 0
    assert (tmp_path / "again" / "ttft_vs_shared_tokens.csv").exists()
    capsys.readouterr()
    assert bench("report", tmp_path, "--kind", "speed") == 0
    report = capsys.readouterr().out
    # per configuration: its speed table, then why what was not shared was not (a row per method)
    assert report.count("not shared, by cause") == 2 and report.count("| nonshared |") == 2 * 2
    assert "| fullshared | " in report and "NonShared/TTFT" in report


# ------------------------------------------------------------- bad input
def test_cli_errors(tiny_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench("run", *TRACE, "--methods", "nope", "--model", tiny_dir)
    assert "unknown method 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench("run", *TRACE, "--methods", "fullshared:tau=0.3", "--model", tiny_dir)
    assert "has no option tau" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench("run", "--workload", "humaneval", "--hops", "3", "--model", tiny_dir)
    assert "does not take hops" in capsys.readouterr().err
    rc = bench(
        "run",
        "--workload",
        "gsm8k",
        "--data",
        tmp_path / "none.jsonl",
        "--model",
        tiny_dir,
        "--out",
        tmp_path,
    )
    assert rc == 2 and "none.jsonl' does not exist" in capsys.readouterr().err
    assert main([]) == 2 and main(["frobnicate"]) == 2
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"agents": [{"name": "a"}], "schedule": [{"agent": "b"}]}])
    assert bench("validate", bad) == 1
    assert "bad.jsonl line 1: schedule[0].agent: unknown agent 'b'" in capsys.readouterr().err
    good = write_jsonl(tmp_path / "good.jsonl", GRAPH_TASKS)
    assert bench("validate", good) == 0 and "2 tasks, 7 agent turns: OK" in capsys.readouterr().out


def test_workload_tau_defaults_and_overrides(tiny_dir, tmp_path, capsys):
    from hf_kvshare.bench.runner import BenchRunner, RunConfig
    from hf_kvshare.bench.workloads import workload_tau

    assert [workload_tau(w) for w in ("humaneval", "gsm8k", "mmlu", "trace")] == [0.34, 0.32, 0.29, None]
    workload = make_workload("humaneval")
    config = RunConfig(workload=workload.name, workload_params=workload.params(), model="m")
    runner = BenchRunner(None, None, workload, config, tmp_path / "out")
    kvcmas = MethodSpec.parse("kvcmas")
    assert runner.method_defaults(kvcmas) == {"tau": 0.34} == runner.method_config(kvcmas)["method_options"]
    assert kvcmas.create(runner.method_defaults(kvcmas)).tau == 0.34 and kvcmas.tag == "kvcmas"
    assert runner.method_defaults(MethodSpec.parse("kvcmas-nonchained")) == {"tau": 0.34}
    assert runner.method_defaults(MethodSpec.parse("kvcmas:tau=0.5")) == {}  # set explicitly: kept
    assert runner.method_defaults(MethodSpec.parse("kvcomm")) == {}  # KVComm keeps 0.3 everywhere
    assert runner.method_defaults(MethodSpec.parse("fullshared")) == {}
    assert BenchRunner(None, None, workload, config, tmp_path, tau={"humaneval": 0.4, "mmlu": 0.2}).tau == 0.4
    with pytest.raises(ValueError, match=r"unknown workload\(s\) 'humaneva'; known workloads: .*humaneval"):
        BenchRunner(None, None, workload, config, tmp_path, tau={"humaneva": 0.4})
    with pytest.raises(ValueError, match=r"'humaneval' must be a real number in \[0, 1\], got 1.5"):
        workload_tau("humaneval", {"humaneval": 1.5})
    with pytest.raises(SystemExit):
        bench("run", *TRACE, "--workload-tau", "nosuch=0.3", "--model", tiny_dir, "--out", tmp_path / "cli")
    assert "unknown workload(s) 'nosuch'" in capsys.readouterr().err and not (tmp_path / "cli").exists()
    with pytest.raises(SystemExit):
        bench("run", *TRACE, "--workload-tau", "trace=high", "--model", tiny_dir, "--out", tmp_path / "cli")
    assert "--workload-tau expects NAME=TAU" in capsys.readouterr().err


def test_method_option_parsing(monkeypatch):
    from hf_kvshare.bench.methods import _parse_value, _split_options

    spec = MethodSpec.parse("nonshared")
    assert spec.tag == "nonshared" and spec.kwargs == {} and spec.option_names() == []
    assert MethodSpec.parse("fullshared") == MethodSpec("fullshared")
    values = [_parse_value(v) for v in ("0.4", "16", "true", "None", "abc", "[1, 2]")]
    assert values == [0.4, 16, True, None, "abc", (1, 2)]
    assert _split_options("a=1,layers=[1, 2],b=x") == ["a=1", "layers=[1, 2]", "b=x"]
    monkeypatch.setitem(METHODS, ThresholdMethod.name, ThresholdMethod)
    spec = MethodSpec.parse("threshold-test: tau = 0.25")
    assert (
        spec.kwargs == {"tau": 0.25}
        and spec.tag == "threshold-test-tau_0.25"
        and str(spec) == "threshold-test:tau=0.25"
    )
    # directory names in plain characters; options that are not plain words (paths) add a hash
    tags = {MethodSpec.parse(f"threshold-test:tau={p}").tag for p in ("a/x.json", "b/x.json", "-1", "1e-05")}
    assert len(tags) == 4 and all(
        re.fullmatch(r"threshold-test-tau_[A-Za-z0-9_.-]+-[0-9a-f]{8}", t) for t in tags
    )
    assert spec.create().tau == 0.25
    with pytest.raises(ValueError, match="not of the form key=value"):
        MethodSpec.parse("threshold-test:0.25")
    with pytest.raises(ValueError, match="creating method threshold-test:tau=x"):
        MethodSpec(ThresholdMethod.name, (("tau", "x"), ("rank", 3))).create()


# ---------------------------------------------------- capability and calibration
@dataclass
class ThresholdMethod(Method):
    """A fake method with a tau knob: reuses a shared segment when a fixed per-(slot, agent) score <= tau."""

    name = "threshold-test"
    tau: float = 0.5

    def placeholder(self, turn, span, cache):
        source = turn.slot(span.name).latest
        if source is None:
            return None
        if _score(span.name, turn.agent) > self.tau:
            return None
        return Placement(kv=source.repositioned(turn.shifter, span.start), source_agent=source.agent)


def _score(slot: str, agent: str) -> float:
    import zlib

    return (zlib.crc32(f"{slot}/{agent}".encode()) % 1000) / 1000


class NeedsAdapters(Method):
    name = "needs-adapters-test"
    requires_adapters = True


def test_methods_requiring_adapters_are_refused_on_plain_workloads(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(METHODS, NeedsAdapters.name, NeedsAdapters)
    out = tmp_path / "out"
    rc = bench(
        "run", *TRACE, "--methods", NeedsAdapters.name, "--model", tiny_dir, "--out", out, "--no-progress"
    )
    assert rc == 2 and "needs agents that run with LoRA adapters" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written
    assert bench("list") == 0 and "needs-adapters-test" in capsys.readouterr().out


def test_tau_calibration_with_a_fake_threshold_method(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(METHODS, ThresholdMethod.name, ThresholdMethod)
    from hf_kvshare.models import load_model

    model, tok = load_model(str(tiny_dir))
    tasks = make_workload("trace", shared_tokens=8, agents=4, rounds=2, output_tokens=2).tasks(tok)
    flows, slots = calibration_slice(tasks, tok)
    rho = {t: realized_rho(model, tok, flows, ThresholdMethod(tau=t), slots) for t in (0.0, 0.5, 1.0)}
    assert rho[0.0] < rho[0.5] < rho[1.0] == 1.0
    result = calibrate_tau(
        model,
        tok,
        flows,
        ThresholdMethod,
        rho[0.5],
        reusable=slots,
        tolerance=0.0,
        iterations=8,
        progress=False,
    )
    assert result.rho == pytest.approx(rho[0.5]) and result.evaluations[:2] == [(0.0, rho[0.0]), (1.0, 1.0)]
    assert realized_rho(model, tok, flows, ThresholdMethod(tau=result.tau), slots) == pytest.approx(rho[0.5])
    # out of range: the nearest end, with a note
    high = calibrate_tau(model, tok, flows, ThresholdMethod, 1.0, reusable=slots, tau_max=0.5, progress=False)
    assert high.tau == 0.5 and "outside the reachable range" in high.note
    with pytest.raises(ValueError, match="has no `tau` option"):
        calibrate_tau(model, tok, flows, METHODS["fullshared"], 0.5, reusable=slots, progress=False)
    # the command writes the result
    rc = bench(
        "calibrate", "--method", ThresholdMethod.name, "--target-rho", round(rho[0.5], 4), "--tolerance", "0.001",
        "--workload", "trace", "--shared-tokens", "8", "--agents", "4", "--rounds", "2", "--output-tokens", "2",
        "--model", tiny_dir, "--out", tmp_path, "--no-progress",
    )  # fmt: skip
    assert rc == 0
    saved = json.loads(next((tmp_path / "calibration").iterdir()).read_text())
    assert saved["rho"] == pytest.approx(rho[0.5], abs=1e-3) and saved["workload"] == "trace"
    assert (
        bench(
            "calibrate",
            "--method",
            "fullshared",
            "--target-rho",
            "0.5",
            *TRACE,
            "--model",
            tiny_dir,
            "--out",
            tmp_path,
            "--no-progress",
        )
        == 2
    )
    assert "no `tau` option" in capsys.readouterr().err


# ---------------------------------------------------------------- studies
def test_study_dispatch(monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("hf_kvshare.bench.studies.fakestudy")
    fake.main = lambda argv: calls.append(list(argv)) or 3
    monkeypatch.setitem(sys.modules, "hf_kvshare.bench.studies.fakestudy", fake)
    assert main(["study", "fakestudy", "--x", "1"]) == 3 and calls == [["--x", "1"]]
    assert main(["study", "no_such_study"]) == 2
    err = capsys.readouterr().err
    assert "no study named 'no_such_study'" in err and "hf_kvshare.bench.studies.no_such_study" in err
    assert main(["study"]) == 2


def test_run_options_are_the_command_line_with_its_defaults():
    """`bench run`'s argv parses into the RunOptions the studies and the device check build directly:
    same defaults, adapters and workload taus as dicts, study defaults overridden by argv."""
    from hf_kvshare.bench import RunOptions
    from hf_kvshare.bench.__main__ import parse_run

    assert parse_run(["--workload", "trace"]) == RunOptions(workload="trace")
    given = parse_run(
        ["--workload", "trace", "--agents", "2", "--adapter", "a=adapter-a", "--workload-tau", "gsm8k=0.5"],
        defaults={"workload": "humaneval", "agents": 4, "limit": 3, "methods": ["kvcmas"]},
    )
    expected = RunOptions(
        workload="trace",
        agents=2,
        limit=3,
        methods=["kvcmas"],
        adapters={"a": "adapter-a"},
        workload_tau={"gsm8k": 0.5},
    )
    assert given == expected
    assert parse_run([], defaults={"workload": "gsm8k", "adapters": {"b": "adapter-b"}}).adapters == {
        "b": "adapter-b"
    }


def test_python_dash_m_entry_point(tmp_path):
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "hf_kvshare.bench", "--help"], capture_output=True, text=True, check=True
    )
    assert "run" in out.stdout and "calibrate" in out.stdout


def test_offline_profile_calibration_feeds_droidspeak_runs(tiny_dir, tmp_path, capsys):
    """droidspeak at a rho that recomputes layers needs its offline profile: without one the run is
    refused before writing anything; `calibrate` (no --target-rho) writes it; the run takes its path."""
    out = tmp_path / "runs"
    rc = bench(
        "run", *TRACE, "--methods", "droidspeak:rho=0.5", "--model", tiny_dir, "--out", out, "--no-progress"
    )
    err = capsys.readouterr().err
    assert rc == 2 and "droidspeak" in err and "offline profile" in err and "calibrate" in err
    assert not list(out.glob("*/droidspeak*/turns.jsonl"))
    # a tau-calibrated method without --target-rho, and droidspeak with one, are usage errors
    for method, extra in (("kvcmas", ()), ("droidspeak", ("--target-rho", "0.5"))):
        with pytest.raises(SystemExit):
            bench("calibrate", "--method", method, *extra, *TRACE, "--model", tiny_dir, "--out", tmp_path)
    rc = bench(
        "calibrate", "--method", "droidspeak", *TRACE, "--model", tiny_dir, "--out", tmp_path, "--no-progress"
    )
    printed = capsys.readouterr().out
    assert rc == 0
    (path,) = (tmp_path / "calibration").glob("droidspeak*__profile.json")
    saved = json.loads(path.read_text())
    assert len(saved["layer_profile"]) == 4 and all(x >= 0 for x in saved["layer_profile"])
    assert saved["workload"] == "trace" and f"droidspeak:layer_profile={path}" in printed
    # the printed option runs, and recomputes the 2 most deviating layers of the profile
    spec = f"droidspeak:rho=0.5,layer_profile={path}"
    argv = [*TRACE, "--methods", spec, "--model", tiny_dir, "--out", out, "--no-progress", "--no-plots"]
    assert bench("run", *argv) == 0  # (the plots: test_every_method_on_a_controlled_trace)
    summary = check_method_output(only_config(out), spec, n_turns=6, n_requests=1)
    assert summary["reuse_ratio"] == pytest.approx(0.5)


def test_droidspeak_profile_from_a_file(tmp_path):
    from hf_kvshare.methods import DroidSpeak

    listed = tmp_path / "list.json"
    listed.write_text("[0.1, 0.3, 0.2]")
    keyed = tmp_path / "keyed.json"
    keyed.write_text(json.dumps({"method": "droidspeak", "layer_profile": [0.5, 0.1]}))
    assert DroidSpeak(layer_profile=str(listed)).layer_profile == [0.1, 0.3, 0.2]
    assert DroidSpeak(layer_profile=keyed).layer_profile == [0.5, 0.1]
    bad = tmp_path / "bad.json"
    for text, match in (
        ("{", "is not JSON"),
        ('{"x": 1}', "no 'layer_profile' key"),
        ('"abc"', "list of numbers"),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            DroidSpeak(layer_profile=bad)
    with pytest.raises(ValueError, match="no such file"):
        DroidSpeak(layer_profile=str(tmp_path / "missing.json"))


def test_warmup_requests_fill_state_and_are_not_recorded(tiny_dir, tmp_path, capsys):
    """GraphFlow calibrates densely on its first 2 requests: with --warmup 2 the recorded request
    is the first one it corrects (rho 1), without it the summary mixes in the calibration."""
    trace = ["--workload", "trace", "--shared-tokens", "16", "--agents", "3", "--output-tokens", "2"]
    common = [*trace, "--methods", "graphflow", "--model", tiny_dir, "--no-progress", "--no-plots"]
    assert bench("run", *common, "--requests", "3", "--warmup", "2", "--out", tmp_path / "warm") == 0
    config = only_config(tmp_path / "warm")
    assert (
        "-W2__" in config.name and json.loads((config / "config.json").read_text())["config"]["warmup"] == 2
    )
    warm = check_method_output(config, "graphflow", n_turns=3, n_requests=1)
    assert warm["reuse_ratio"] == 1.0 and {
        r["request"] for r in read_jsonl(config / "graphflow/turns.jsonl")
    } == {"trace-2"}
    assert bench("run", *common, "--requests", "3", "--out", tmp_path / "cold") == 0
    cold = check_method_output(only_config(tmp_path / "cold"), "graphflow", n_turns=9, n_requests=3)
    assert "warmup" not in json.loads((only_config(tmp_path / "cold") / "config.json").read_text())["config"]
    assert cold["reuse_ratio"] == pytest.approx(1 / 3)
    # nothing left to measure; a negative count
    assert bench("run", *common, "--requests", "2", "--warmup", "2", "--out", tmp_path / "none") == 2
    assert "leaves no request to measure" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench("run", *common, "--warmup", "-1", "--out", tmp_path / "neg")


def test_realized_rho_skips_warmup_requests(tiny_dir):
    from hf_kvshare.models import load_model

    model, tok = load_model(str(tiny_dir))
    tasks = make_workload("trace", shared_tokens=8, agents=3, output_tokens=2, requests=3).tasks(tok)
    flows, slots = calibration_slice(tasks, tok)
    spec = MethodSpec("graphflow")  # calibrates (dense) on 2 requests, then corrects every relation
    assert realized_rho(model, tok, flows, spec.create(), slots) == pytest.approx(1 / 3)
    assert realized_rho(model, tok, flows, spec.create(), slots, warmup=2) == 1.0
    with pytest.raises(ValueError, match="leaves none"):
        realized_rho(model, tok, flows, spec.create(), slots, warmup=3)


def test_bad_adapter_paths_are_refused_before_loading(tmp_path, capsys, no_model_load):
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, message in ((empty, "has no adapter_config.json"), (tmp_path / "nope", "no such directory")):
        with pytest.raises(SystemExit) as exit_info:
            bench(
                "run",
                "--workload",
                "autoact",
                "--adapter",
                f"plan={path}",
                "--methods",
                "nonshared",
                "--out",
                tmp_path,
            )
        assert exit_info.value.code == 2
        assert one_line_error(capsys.readouterr().err, message)


# ------------------------------------------------- argument errors, before the model loads
@pytest.fixture
def no_model_load(monkeypatch):
    """Make any model load fail loudly: argument errors must be reported before it."""
    import hf_kvshare.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(hf_kvshare.models, "load_model", refuse)


def one_line_error(err: str, *expected: str, about: str = "") -> bool:
    """``err`` is one ``PROG: error: ...`` line holding every ``expected`` text, and it lists no
    registered method twice (``about``: the method the error is about, which it may name again)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert ": error: " in lines[0] and all(text in lines[0] for text in expected), err
    names = [name for name in METHODS if name != about]
    counts = {name: len(re.findall(rf"(?<![\w-]){re.escape(name)}(?![\w-])", lines[0])) for name in names}
    assert all(n <= 1 for n in counts.values()), counts
    return True


ARGUMENT_ERRORS = [
    (["--methods", "kvcmas:tau=abc"], "tau must be a real number"),
    (["--methods", "nope"], "unknown method 'nope'"),
    (["--methods", "fullshared:tau=0.3"], "has no option tau"),
    (["--threads", "0"], "--threads: expected an integer >= 1, got 0"),
    (["--dtype", "int4"], "--dtype: expected one of float32, bfloat16, float16, got 'int4'"),
    (["--device", "banana"], "expected a torch device"),
    (["--warmup", "-1"], "expected an integer >= 0"),
    (["--adapter", "plan"], "--adapter expects NAME=PATH"),
]


@pytest.mark.parametrize("extra, message", ARGUMENT_ERRORS, ids=[" ".join(a) for a, _ in ARGUMENT_ERRORS])
def test_argument_errors_are_one_line_before_the_model_loads(extra, message, tmp_path, capsys, no_model_load):
    with pytest.raises(SystemExit) as exit_info:
        bench("run", *TRACE, *extra, "--out", tmp_path / "out", "--no-progress")
    assert exit_info.value.code == 2
    about = extra[1].partition(":")[0] if extra[0] == "--methods" else ""
    assert one_line_error(capsys.readouterr().err, message, about=about)
    assert not (tmp_path / "out").exists()


def test_file_workload_errors_before_the_model_loads(tmp_path, capsys, no_model_load):
    with pytest.raises(SystemExit) as exit_info:
        bench("run", "--workload", "file", "--out", tmp_path)
    assert exit_info.value.code == 2 and one_line_error(capsys.readouterr().err, "needs --data PATH")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"agents": [{"name": "a"}], "schedule": [{"agent": "b"}]}])
    with pytest.raises(SystemExit):
        bench("run", "--workload", "file", "--data", bad, "--out", tmp_path)
    assert one_line_error(capsys.readouterr().err, "bad.jsonl line 1: schedule[0].agent: unknown agent 'b'")
    with_adapter = [{**GRAPH_TASKS[1], "agents": [{"name": "a", "adapter": "plan"}, {"name": "b"}]}]
    data = write_jsonl(tmp_path / "adapters.jsonl", with_adapter)
    with pytest.raises(SystemExit):
        bench("run", "--workload", "file", "--data", data, "--out", tmp_path)
    assert one_line_error(capsys.readouterr().err, "adapter 'plan', which is not loaded")


def test_device_without_a_gpu_is_an_argument_error(tmp_path, capsys, no_model_load, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        bench("run", *TRACE, "--device", "cuda", "--out", tmp_path)
    assert exit_info.value.code == 2
    assert one_line_error(capsys.readouterr().err, "'cuda': no CUDA device is available")


def test_validate_checks_adapter_names(tmp_path, capsys):
    with_adapter = [{**GRAPH_TASKS[1], "agents": [{"name": "a", "adapter": "plan"}, {"name": "b"}]}]
    data = write_jsonl(tmp_path / "adapters.jsonl", with_adapter)
    assert bench("validate", data) == 0  # no --adapter: adapter names are not checked
    capsys.readouterr()
    assert bench("validate", data, "--adapter", "act=runs/act") == 1
    assert "agent 'a' runs with adapter 'plan', which is not loaded (loaded: act" in capsys.readouterr().err
    assert bench("validate", data, "--adapter", "plan", "--adapter", "act") == 0


def test_validate_checks_max_new_tokens_against_the_model(tiny_dir, tmp_path, capsys):
    """--model reads the model's config only: every turn's max_new_tokens + 1 prompt token must fit."""
    step = json.loads(json.dumps(GRAPH_TASKS[0]))
    step["schedule"][2]["max_new_tokens"] = 4096  # tiny_dir: max_position_embeddings 4096
    data = write_jsonl(tmp_path / "long.jsonl", [GRAPH_TASKS[1], step])
    assert bench("validate", data) == 0  # without --model the positions are not checked
    capsys.readouterr()
    assert bench("validate", data, "--model", tiny_dir) == 1
    assert capsys.readouterr().err.strip() == (
        "error: long.jsonl line 2: schedule[2].max_new_tokens: 4096 new tokens plus at least 1 prompt token "
        f"exceed the 4096 positions of model {tiny_dir} (max_position_embeddings); at most 4095"
    )
    step["schedule"][2]["max_new_tokens"] = 4095
    write_jsonl(data, [GRAPH_TASKS[1], step])
    assert bench("validate", data, "--model", tiny_dir) == 0
    assert "OK (fits the 4096 positions of" in capsys.readouterr().out
    # random:NAME and the embedded model: their configs, no weights
    huge = write_jsonl(tmp_path / "huge.jsonl", [{**GRAPH_TASKS[1], "max_new_tokens": 131072}])
    assert bench("validate", huge, "--model", "random:tiny-llama") == 1
    assert "line 1: max_new_tokens: 131072 new tokens" in capsys.readouterr().err
    assert bench("validate", huge, "--model", "smollm2-135m") == 1
    assert "exceed the 8192 positions of model smollm2-135m" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench("validate", data, "--model", "random:nope")
    assert exit_info.value.code == 2 and one_line_error(
        capsys.readouterr().err, "unknown random model 'nope'"
    )


def test_run_refuses_max_new_tokens_beyond_the_positions_before_loading(
    tiny_dir, tmp_path, capsys, no_model_load
):
    long_task = write_jsonl(tmp_path / "long.jsonl", [{**GRAPH_TASKS[1], "max_new_tokens": 5000}])
    for workload in (["--workload", "file", "--data", long_task], [*TRACE, "--output-tokens", "4096"]):
        with pytest.raises(SystemExit) as exit_info:
            bench("run", *workload, "--model", tiny_dir, "--out", tmp_path / "out")
        assert exit_info.value.code == 2
        expected = "long.jsonl line 1: max_new_tokens: 5000" if "file" in workload else "--output-tokens 4096"
        assert one_line_error(capsys.readouterr().err, expected, "4096 positions of model")
        assert not (tmp_path / "out").exists()


def test_runner_refuses_requests_beyond_the_positions(tmp_path, tokenizer):
    from hf_kvshare.bench.runner import BenchInputError, BenchRunner, RunConfig
    from hf_kvshare.models import load_model

    model, tok = load_model(str(save_tiny(tmp_path / "short", tokenizer, max_position_embeddings=32)))
    workload = make_workload("trace", shared_tokens=8, agents=2, output_tokens=32, requests=1)
    config = RunConfig(workload.name, workload.params(), model="short", fidelity=False)
    runner = BenchRunner(model, tok, workload, config, tmp_path / "out", progress=False)
    with pytest.raises(
        BenchInputError, match=r"request 'trace-0': .*32 new tokens .* the 32 positions of model short"
    ):
        runner.run([MethodSpec("fullshared")])
    assert not (tmp_path / "out").exists()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_that_cannot_start_leaves_no_directory(tiny_dir, finished_run, tmp_path, capsys):
    """Failures after the model loads but before the first request (a method refusing the model when it
    binds, a missing saved state) leave no configuration directory; an existing one is untouched."""
    import shutil

    profile = tmp_path / "profile.json"
    profile.write_text("[0.1, 0.2, 0.3]")  # 3 layers; the tiny model has 4: refused when bound
    bad = ["--methods", f"droidspeak:layer_profile={profile}"]
    common = [*TRACE, "--model", tiny_dir, "--no-progress", "--no-plots"]
    assert bench("run", *common, *bad, "--out", tmp_path / "fresh") == 2
    assert "the layer profile has 3 entries but the model has 4" in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()
    empty = tmp_path / "no-state"
    empty.mkdir()
    argv = ["--methods", "fullshared", "--state-in", empty]
    assert bench("run", *common, *argv, "--out", tmp_path / "fresh" / "deeper") == 2
    assert "no saved state for this method" in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()
    # an existing configuration with results: neither the failed run nor --redo touches it
    shutil.copytree(finished_run, tmp_path / "kept")  # a finished fullshared run of the same trace
    before = _files(tmp_path / "kept")
    assert "nonshared/summary.json" in "".join(before)
    for redo in ([], ["--redo"]):
        assert bench("run", *common, *bad, *redo, "--out", tmp_path / "kept") == 2
        assert _files(tmp_path / "kept") == before
    capsys.readouterr()
    # a run that starts keeps what it wrote: --redo replaces the summaries once it has run
    assert bench("run", *common, "--methods", "fullshared", "--redo", "--out", tmp_path / "kept") == 0
    assert "already done" not in capsys.readouterr().out
    assert set(_files(tmp_path / "kept")) == set(before)


def test_limit_row_is_measured_beside_the_methods(trace_run):
    """The `limit` pseudo-method: one forward over each reuse turn's non-reused tokens on top of the
    reused K/V, measured in the same run, with its NonShared/limit ratio in the summaries."""
    assert trace_run.code == 0
    config = only_config(trace_run.out)
    turns = read_jsonl(config / "limit" / "turns.jsonl")
    fullshared = read_jsonl(config / "fullshared" / "turns.jsonl")
    assert len(turns) == sum(t["reuse_turn"] for t in fullshared) == 5
    assert all(t["method"] == "limit" and t["ttft_s"] > 0 and t["reused_tokens"] > 0 for t in turns)
    rows = {m["method"]: m for m in json.loads((config / "summary.json").read_text())["methods"]}
    assert list(rows)[0] == "nonshared" and {"fullshared", "limit"} <= set(rows)
    assert rows["limit"]["reuse_turns"] == 5 and rows["limit"]["ttft_ratio"] > 0
    assert "limit" in (config / "summary.csv").read_text()


def test_limit_runs_one_forward_over_the_non_reused_tokens(tiny_dir, tokenizer):
    import torch

    from hf_kvshare import Session
    from hf_kvshare.bench.limit import limit_ttft
    from hf_kvshare.models import load_model

    model, _ = load_model(str(tiny_dir))
    session = Session(model, tokenizer, "nonshared")
    from tiny import STEPS

    results = [session.run_turn(agent, segments, max_new_tokens=3) for agent, segments in STEPS]
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    try:
        with torch.no_grad():
            exact = session.build_cache(*STEPS[2])[0]
        calls.clear()
        assert limit_ttft(model, results[2], {"query", "first", "second"}, exact) > 0
    finally:
        handle.remove()
    assert len(calls) == 1
    assert limit_ttft(model, results[0], set()) is None  # nothing reusable: no limit row


def test_validate_reports_the_kinds_of_given_text(capsys):
    """``validate`` says how many given slots are questions and observations (stated or by the default)."""
    from hf_kvshare.bench.workloads import validate_task_file
    from hf_kvshare.bench.workloads.files import kinds_report

    data = Path(__file__).resolve().parent.parent / "examples" / "observations.jsonl"
    assert bench("validate", str(data)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == kinds_report(validate_task_file(str(data)))
    question, observation = (
        int(part.split()[0]) for part in out[-1].removeprefix("given slots: ").split(", ")
    )
    assert question == 13 and observation > 0  # one question per task, the rest observations


# ------------------------------------------- environment failures: one line, nothing half-written (issue 26)
def _fifo(tmp_path: Path) -> Path:
    import os

    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _alarm(seconds: int = 20):
    """Fail (not hang) a test whose read never ends."""
    import signal

    def ring(*_):
        raise AssertionError(f"still reading after {seconds} s")

    signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)


@pytest.mark.parametrize("where", ["file", "under-a-file", "unwritable"])
@pytest.mark.parametrize("option", ["--out", "--state-out"])
def test_output_places_that_cannot_be_written_are_one_line_before_the_model_loads(
    where, option, tmp_path, capsys, no_model_load
):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = {"file": blocker, "under-a-file": blocker / "deeper", "unwritable": Path("/proc/hfkv-out")}[
        where
    ]
    others = ["--out", tmp_path / "out"] if option == "--state-out" else []
    with pytest.raises(SystemExit) as exit_info:
        bench("run", *TRACE, "--methods", "nonshared", *others, option, target, "--no-progress")
    assert exit_info.value.code == 2
    expected = "not writable" if where == "unwritable" else "exists and is not a directory"
    assert one_line_error(capsys.readouterr().err, option, expected)
    assert blocker.read_text() == "x" and not (tmp_path / "out").exists()


def test_a_state_dir_that_is_a_file_is_one_line_before_the_model_loads(tmp_path, capsys, no_model_load):
    state = tmp_path / "state"
    state.write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        bench("run", *TRACE, "--methods", "nonshared", "--state-in", state, "--out", tmp_path / "out")
    assert exit_info.value.code == 2
    assert one_line_error(capsys.readouterr().err, "--state-in", "is not a directory")
    assert not (tmp_path / "out").exists()


def test_a_truncated_saved_state_is_one_line_and_leaves_no_directory(tiny_dir, tmp_path, capsys):
    common = [*TRACE, "--methods", "graphflow", "--model", tiny_dir, "--no-progress", "--no-plots"]
    state = tmp_path / "state"
    assert bench("run", *common, "--requests", "1", "--out", tmp_path / "first", "--state-out", state) == 0
    capsys.readouterr()
    for victim in sorted(state.rglob("state.*")):
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
        assert bench("run", *common, "--requests", "1", "--out", tmp_path / "warm", "--state-in", state) == 2
        err = capsys.readouterr().err  # after the model's loading lines: one error line
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: "), err
        assert "--state-in" in err.strip().splitlines()[-1] or "saved" in err.strip().splitlines()[-1], err
        assert not (tmp_path / "warm").exists()
        victim.write_bytes(data)


def test_a_state_save_that_fails_leaves_the_earlier_states_whole(tiny_dir, tmp_path, capsys, monkeypatch):
    """``--state-out`` over an earlier run's states: a save that fails (disk full) on the last file
    leaves every method's earlier state as it was (not the new free state beside the old forced
    one), no hidden folder, and one error line; a save that succeeds replaces them all."""
    import errno

    from hf_kvshare.persistence import StatePersistence

    common = [*TRACE, "--methods", "graphflow", "--model", tiny_dir, "--no-progress", "--no-plots"]
    state = tmp_path / "state"
    assert bench("run", *common, "--requests", "2", "--out", tmp_path / "first", "--state-out", state) == 0
    before = {p.relative_to(state): p.read_bytes() for p in sorted(state.rglob("*")) if p.is_file()}
    assert {p.parent.name for p in before} >= {"graphflow", "nonshared", "forced"}
    original, calls = StatePersistence.save_state, []

    def full_disk(self, directory, model=None):
        calls.append(type(self).__name__)
        if len(calls) == 4:  # the last save: graphflow's fidelity instance
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return original(self, directory, model=model)

    monkeypatch.setattr(StatePersistence, "save_state", full_disk)
    capsys.readouterr()
    assert bench("run", *common, "--requests", "1", "--out", tmp_path / "second", "--state-out", state) == 1
    assert calls[-2:] == ["GraphFlow", "GraphFlow"]
    assert one_line_error(capsys.readouterr().err.strip().splitlines()[-1], "No space left on device")
    after = {p.relative_to(state): p.read_bytes() for p in sorted(state.rglob("*")) if p.is_file()}
    assert after == before and sorted(p.name for p in state.iterdir()) == ["graphflow", "nonshared"]
    monkeypatch.setattr(StatePersistence, "save_state", original)  # the control: a save that completes
    assert bench("run", *common, "--requests", "1", "--out", tmp_path / "third", "--state-out", state) == 0
    saved = state / "graphflow" / "state.json"
    assert saved.read_bytes() != before[saved.relative_to(state)]
    assert sorted(p.name for p in state.iterdir()) == ["graphflow", "nonshared"]


HOSTILE_TASK_FILES = {
    "non-utf8": lambda tmp: _write_bytes(tmp / "t.jsonl", b'{"id": "\xff\xfe"}\n'),
    "deeply-nested": lambda tmp: _write_bytes(tmp / "t.jsonl", b"[" * 100000 + b"]" * 100000 + b"\n"),
    "directory": lambda tmp: tmp,
    "fifo": _fifo,
    "dev-zero": lambda tmp: Path("/dev/zero"),
}
TASK_FILE_ERRORS = {
    "non-utf8": "is not UTF-8",
    "deeply-nested": "nested too deeply",
    "directory": "must be a regular file, got a directory",
    "fifo": "must be a regular file, got a FIFO",
    "dev-zero": "must be a regular file, got a character device",
}


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("kind", sorted(HOSTILE_TASK_FILES))
def test_hostile_task_files_are_one_line_before_the_model_loads(kind, tmp_path, capsys, no_model_load):
    data = HOSTILE_TASK_FILES[kind](tmp_path)
    _alarm()
    try:
        with pytest.raises(SystemExit) as exit_info:
            bench("run", "--workload", "file", "--data", data, "--out", tmp_path / "out", "--no-progress")
        assert exit_info.value.code == 2
        assert one_line_error(capsys.readouterr().err, TASK_FILE_ERRORS[kind])
        assert bench("validate", data) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and TASK_FILE_ERRORS[kind] in err[0], err
    finally:
        import signal

        signal.alarm(0)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["directory", "fifo", "dev-zero"])
def test_a_droidspeak_profile_that_is_not_a_file_is_one_line_before_the_model_loads(
    kind, tmp_path, capsys, no_model_load
):
    path = HOSTILE_TASK_FILES[kind](tmp_path)
    _alarm()
    try:
        for command in (
            ["run", *TRACE, "--methods", f"droidspeak:layer_profile={path}", "--out", tmp_path / "out"],
            ["calibrate", *TRACE, "--method", f"droidspeak:layer_profile={path}", "--out", tmp_path / "out"],
        ):
            with pytest.raises(SystemExit) as exit_info:
                bench(*command, "--no-progress")
            assert exit_info.value.code == 2
            assert one_line_error(
                capsys.readouterr().err, TASK_FILE_ERRORS[kind], "layer_profile", about="droidspeak"
            )
    finally:
        import signal

        signal.alarm(0)
    assert not (tmp_path / "out").exists()


def test_a_task_file_edited_in_place_runs_its_new_rows(tmp_path):
    import os

    from hf_kvshare.bench.workloads import load_task_file

    first = {**GRAPH_TASKS[0], "id": "aaaa"}
    second = {**GRAPH_TASKS[0], "id": "bbbb"}  # the same size
    path = write_jsonl(tmp_path / "tasks.jsonl", [first])
    stamp = os.stat(path)
    assert [t.id for t in load_task_file(path)] == ["aaaa"]
    write_jsonl(path, [second])
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert os.stat(path).st_size == stamp.st_size and os.stat(path).st_mtime_ns == stamp.st_mtime_ns
    assert [t.id for t in load_task_file(path)] == ["bbbb"]


def test_an_environment_failure_inside_a_command_is_one_line(monkeypatch, capsys):
    import errno

    from hf_kvshare.bench import __main__ as bench_main

    def full(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/somewhere/summary.json")

    monkeypatch.setitem(bench_main.COMMANDS, "run", full)
    assert bench("run") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: OSError '/somewhere/summary.json': No space left on device" in err[0], (
        err
    )


def test_a_json_write_that_fails_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    from hf_kvshare.bench.runner import write_json

    path = tmp_path / "summary.json"
    write_json(path, {"a": 1})
    real = Path.write_text

    def half(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError):
        write_json(path, {"a": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1} and sorted(p.name for p in tmp_path.iterdir()) == [
        "summary.json"
    ]


# --------------------------------- nothing half-written, every subcommand one line (issue 26, item 1)
def _stray(root: Path) -> list[str]:
    """What a later run could wrongly trust or what a run leaves behind: a method folder holding
    records without its summary, hidden partial folders, temporary files."""
    found = []
    for path in root.rglob("*") if root.exists() else ():
        name = path.name
        if name.endswith(".tmp") or ".partial-" in name or ".old-" in name:
            found.append(str(path.relative_to(root)))
        elif path.is_dir() and (path / "turns.jsonl").exists() and not (path / "summary.json").exists():
            found.append(str(path.relative_to(root)))
    return found


@pytest.mark.parametrize("failure", ["disk-full", "interrupted"])
def test_a_run_that_fails_midway_leaves_no_half_method_folder(
    failure, tiny_dir, tmp_path, capsys, monkeypatch
):
    """The run fails after its first request (the disk fills up as the summaries are written, or
    Ctrl-C): one error line, and no method folder that a later run would trust or run half from."""
    import errno

    import hf_kvshare.bench.runner as runner_module

    def fail(*args, **kwargs):
        if failure == "disk-full":
            raise OSError(errno.ENOSPC, "No space left on device", "summary.json")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner_module, "summarize_method", fail)
    argv = ["run", *TRACE, "--methods", "fullshared", "--model", tiny_dir, "--no-progress", "--no-plots"]
    if failure == "disk-full":
        assert bench(*argv, "--out", tmp_path) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].endswith("error: OSError 'summary.json': No space left on device"), err
    else:
        with pytest.raises(KeyboardInterrupt):
            bench(*argv, "--out", tmp_path)
    assert _stray(tmp_path) == []
    config = only_config(tmp_path)
    assert not (config / "fullshared").exists() and not (config / "nonshared").exists()
    monkeypatch.undo()
    assert bench(*argv, "--out", tmp_path) == 0  # the next run runs everything, from the start
    assert "already done" not in capsys.readouterr().out and _stray(tmp_path) == []


def test_redo_keeps_the_earlier_results_until_the_new_ones_are_complete(
    tiny_dir, finished_run, tmp_path, monkeypatch
):
    import hf_kvshare.bench.runner as runner_module

    argv = ["run", *TRACE, "--methods", "fullshared", "--model", tiny_dir, "--no-progress", "--no-plots"]
    out = _copy_run(finished_run, tmp_path)
    before = _files(tmp_path)
    real = runner_module.summarize_method
    calls = []

    def second_fails(*args, **kwargs):  # nonshared's summary is computed, fullshared's fails
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "summarize_method", second_fails)
    assert bench(*argv, "--redo", "--out", out) == 1
    assert _files(tmp_path) == before and _stray(tmp_path) == []


def test_a_killed_runs_partial_folder_is_neither_trusted_nor_kept(tiny_dir, finished_run, tmp_path, capsys):
    """A run killed (SIGKILL) while it wrote leaves a hidden partial folder, even one holding a
    summary (killed between the summary and the rename): the next run neither counts it as done nor
    lists it, and removes it (its process is gone)."""
    import shutil

    argv = ["run", *TRACE, "--methods", "fullshared", "--model", tiny_dir, "--no-progress", "--no-plots"]
    done = only_config(finished_run)
    out = tmp_path / "out"
    config = out / done.name
    config.mkdir(parents=True)
    shutil.copy(done / "config.json", config / "config.json")
    dead = 2**22 + 12345  # above the default pid_max: no such process
    for tag in ("nonshared", "fullshared"):
        shutil.copytree(done / tag, config / f".{tag}.partial-{dead}")
    capsys.readouterr()
    assert bench(*argv, "--out", out) == 0
    assert "already done" not in capsys.readouterr().out
    assert sorted(p.name for p in config.iterdir() if p.is_dir()) == ["fullshared", "limit", "nonshared"]
    rows = json.loads((config / "summary.json").read_text())["methods"]
    assert [m["method"] for m in rows] == ["nonshared", "fullshared", "limit"]


@pytest.mark.parametrize(
    "damage, expected",
    [
        (b'{"config": ', "is not valid JSON"),
        (b"[1, 2]", "must hold a JSON object, got list"),
        (b"\xff\xfe", "is not UTF-8"),
        (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    ],
    ids=["truncated", "not-an-object", "non-utf8", "deeply-nested"],
)
def test_a_damaged_earlier_result_is_one_line_when_the_run_resumes(
    damage, expected, tiny_dir, finished_run, tmp_path, capsys
):
    argv = ["run", *TRACE, "--methods", "fullshared", "--model", tiny_dir, "--no-progress", "--no-plots"]
    out = _copy_run(finished_run, tmp_path)
    victim = only_config(out) / "fullshared" / "summary.json"
    victim.write_bytes(damage)
    capsys.readouterr()
    assert bench(*argv, "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and err[-1].startswith("error: "), err
    assert expected in err[-1] and "summary.json" in err[-1] and "--redo" in err[-1], err
    assert victim.read_bytes() == damage  # nothing replaced without --redo
    if damage.startswith(b'{"config"'):  # --redo replaces it (once: the same for every damage)
        assert bench(*argv, "--redo", "--out", out) == 0
        assert json.loads(victim.read_text())["method"] == "fullshared"


@pytest.fixture(scope="module")
def finished_run(tiny_dir, tmp_path_factory) -> Path:
    """One finished configuration (fullshared with plots), for the commands that read runs."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("finished")
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            bench(
                "run", *TRACE, "--methods", "fullshared", "--model", tiny_dir, "--out", out, "--no-progress"
            )
            == 0
        )
    return out


def _copy_run(finished: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(finished, tmp_path / "out"))


READ_DAMAGE = {
    "truncated": (b"{", "is not valid JSON"),
    "not-an-object": (b"[1, 2]", "must hold a JSON object"),
    "no-methods": (b'{"config": {}}', "expected 'methods'"),
    "non-utf8": (b"\xff\xfe", "is not UTF-8"),
    "deeply-nested": (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    "fifo": (None, "must be a regular file, got a FIFO"),
}


@pytest.mark.parametrize("command", ["report", "plot"])
@pytest.mark.parametrize("damage", sorted(READ_DAMAGE))
def test_report_and_plot_refuse_a_damaged_summary_in_one_line(
    command, damage, finished_run, tmp_path, capsys
):
    import os

    out = _copy_run(finished_run, tmp_path)
    summary = only_config(out) / "summary.json"
    data, expected = READ_DAMAGE[damage]
    if data is None:
        summary.unlink()
        os.mkfifo(summary)
    else:
        summary.write_bytes(data)
    plots = {p: p.read_bytes() for p in (only_config(out) / "plots").iterdir()}
    _alarm()
    try:
        with pytest.raises(SystemExit) as exit_info:
            bench(command, out)
    finally:
        import signal

        signal.alarm(0)
    assert exit_info.value.code == 2
    assert one_line_error(capsys.readouterr().err, expected, "summary.json")
    assert {p: p.read_bytes() for p in (only_config(out) / "plots").iterdir()} == plots  # nothing redrawn


@pytest.mark.parametrize("where", ["out-is-a-file", "plots-read-only"])
def test_plot_checks_where_it_writes_before_drawing(where, finished_run, tmp_path, capsys, monkeypatch):
    from hf_kvshare.bench import plots

    out = _copy_run(finished_run, tmp_path)
    monkeypatch.setattr(plots, "_pyplot", lambda: pytest.fail("a figure was drawn before the check"))
    if where == "out-is-a-file":
        blocker = tmp_path / "blocker"
        blocker.write_text("x")
        argv, expected = ["--out", blocker], ("--out", "exists and is not a directory")
    else:
        import hf_kvshare.bench.inputs as inputs

        real = inputs.tempfile.mkstemp

        def read_only(*args, dir=None, **kwargs):
            if dir is not None and Path(dir).name == "plots":
                raise OSError(30, "Read-only file system")
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(inputs.tempfile, "mkstemp", read_only)
        argv, expected = [], ("plots", "is not writable (Read-only file system)")
    with pytest.raises(SystemExit) as exit_info:
        bench("plot", out, *argv)
    assert exit_info.value.code == 2
    assert one_line_error(capsys.readouterr().err, *expected)


def test_serve_checks_its_output_place_before_vllm(tmp_path, capsys, monkeypatch):
    import subprocess

    from hf_kvshare.serving.server import Server

    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: pytest.fail("vLLM was probed before --out was checked")
    )
    monkeypatch.setattr(Server, "__init__", lambda *a, **k: pytest.fail("a server was prepared"))
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    for argv, expected in (
        (["--out", blocker / "deeper"], ("--out", "exists and is not a directory")),
        (["--out", tmp_path / "out", "--port", "70000"], ("--port 70000", "not a TCP port")),
    ):
        assert bench("serve", *argv, "--vllm-python", sys.executable) == 2
        assert one_line_error(capsys.readouterr().err, *expected)
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_dangling_symlink_is_named_as_one(tmp_path, capsys, no_model_load):
    import os

    link = tmp_path / "link"
    os.symlink(tmp_path / "nowhere", link)
    with pytest.raises(SystemExit) as exit_info:
        bench("run", *TRACE, "--out", link / "runs", "--no-progress")
    assert exit_info.value.code == 2
    assert one_line_error(capsys.readouterr().err, "--out", "is a symbolic link to a missing target")
    assert not (tmp_path / "nowhere").exists()


MORE_ARGUMENT_ERRORS = [
    (["--workload", "gsm8k", "--limit", "-1"], "--limit: expected an integer >= 0, got -1"),
    (["--workload", "gsm8k", "--offset", "-5"], "--offset: expected an integer >= 0, got -5"),
    (["--workload", "gsm8k", "--max-new-tokens", "-3"], "--max-new-tokens: expected an integer >= 1"),
    ([*TRACE, "--exec-timeout", "-1"], "--exec-timeout: expected a finite number > 0, got -1"),
    ([*TRACE, "--exec-timeout", "nan"], "--exec-timeout: expected a finite number > 0, got nan"),
    ([*TRACE, "--seed", str(2**70)], "--seed: expected an integer in [0, 4294967295]"),
    ([*TRACE, "--threads", str(10**12)], "--threads: expected an integer >= 1 and at most 4096"),
    ([*TRACE, "--num-layers", "0"], "--num-layers: expected an integer >= 1, got 0"),
    ([*TRACE, "--limit", "1" * 5000], "--limit: expected an integer >= 0, got '111"),
    ([*TRACE, "--adapter", "a=/dev/zero"], "--adapter a=/dev/zero: expected a PEFT adapter directory"),
]


@pytest.mark.parametrize(
    "argv, message", MORE_ARGUMENT_ERRORS, ids=[" ".join(a[-2:])[:40] for a, _ in MORE_ARGUMENT_ERRORS]
)
def test_more_argument_errors_are_one_line_before_the_model_loads(
    argv, message, tmp_path, capsys, no_model_load
):
    with pytest.raises(SystemExit) as exit_info:
        bench("run", *argv, "--out", tmp_path / "out", "--no-progress")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert one_line_error(err, message) and len(err) < 600
    assert not (tmp_path / "out").exists()


CALIBRATE_ERRORS = [
    (["--target-rho", "2"], "--target-rho: expected a reuse ratio in [0, 1], got 2"),
    (["--target-rho", "nan"], "--target-rho: expected a reuse ratio in [0, 1], got nan"),
    (
        ["--target-rho", "0.5", "--tau-min", "0.9", "--tau-max", "0.1"],
        "--tau-min < --tau-max, got 0.9 and 0.1",
    ),
    (["--target-rho", "0.5", "--iterations", "-2"], "--iterations: expected an integer >= 1, got -2"),
    (["--target-rho", "0.5", "--tolerance", "-1"], "--tolerance: expected a finite number >= 0, got -1"),
]


@pytest.mark.parametrize("argv, message", CALIBRATE_ERRORS, ids=[" ".join(a) for a, _ in CALIBRATE_ERRORS])
def test_calibrate_numbers_are_checked_before_the_model_loads(argv, message, tmp_path, capsys, no_model_load):
    with pytest.raises(SystemExit) as exit_info:
        bench("calibrate", *TRACE, "--method", "kvcmas", *argv, "--out", tmp_path / "out")
    assert exit_info.value.code == 2
    assert one_line_error(capsys.readouterr().err, message, about="kvcmas")
    assert not (tmp_path / "out").exists()


def test_a_task_file_with_an_integer_too_long_to_convert_is_one_line(tmp_path, capsys, no_model_load):
    data = _write_bytes(tmp_path / "t.jsonl", b'{"id": "x", "max_new_tokens": ' + b"1" * 5000 + b"}\n")
    with pytest.raises(SystemExit) as exit_info:
        bench("run", "--workload", "file", "--data", data, "--out", tmp_path / "out")
    assert exit_info.value.code == 2
    assert one_line_error(capsys.readouterr().err, "t.jsonl line 1: not valid JSON here")
    assert bench("validate", data) == 1
    assert "t.jsonl line 1: not valid JSON here" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["os.path", "../../etc", "json.decoder"])
def test_a_study_name_that_is_no_study_is_one_line(name, capsys):
    assert bench("study", name) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no study named {name!r}" in err[0] and "available: coverage" in err[0], err


def test_a_sweep_frees_each_configurations_method_instances_when_it_ends(tiny_dir, tmp_path):
    """A configuration's method instances (their anchor pools) do not outlive it: before, every runner
    of a sweep kept its instances, alive through the next configurations' turns and in their peaks
    (docs/results/gpu.md: KVComm's pools of the 8K configuration in the 32K one's)."""
    import gc
    import weakref

    from hf_kvshare.bench.command import RunOptions, run_command
    from hf_kvshare.bench.runner import Collector

    refs: list[weakref.ref] = []

    class Watch(Collector):
        def finish(self, runner):  # collectors still read the instances at the run's end
            refs.extend(weakref.ref(pair.free) for pair in runner.pairs)

    options = RunOptions(
        workload="trace",
        model=str(tiny_dir),
        shared_tokens=[16, 32],
        agents=2,
        output_tokens=2,
        methods=["fullshared", "kvcmas"],
        no_fidelity=True,
        no_plots=True,
        no_progress=True,
        out=str(tmp_path),
    )
    code, runners = run_command(options, collectors=[Watch()])
    gc.collect()
    assert code == 0 and len(runners) == 2 and all(r.pairs == [] for r in runners)
    assert len(refs) >= 2 * 2 and all(ref() is None for ref in refs)

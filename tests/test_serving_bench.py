"""``hf-kvshare bench serve`` and the serving client: the pure parts run without vLLM (no server);
the end-to-end run is marked ``serving`` and skipped where vLLM is not installed."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from live_server import has_vllm

from hf_kvshare.bench import serve as sb
from hf_kvshare.serving.client import ChatTrajectory, task_requests, task_trajectory, task_turns
from hf_kvshare.trajectory import PF, PH, chat

# -- Poisson schedule ------------------------------------------------------------------------------


def test_poisson_schedule_is_seeded_sorted_and_bounded():
    a = sb.poisson_schedule(200, 2.0, seed=7)
    assert a == sb.poisson_schedule(200, 2.0, seed=7)
    assert a != sb.poisson_schedule(200, 2.0, seed=8)
    assert len(a) == 200 and a[0] == 0.0 and a == sorted(a)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.5) < 0.1  # mean inter-arrival 1 / qps
    bounded = sb.poisson_schedule(200, 2.0, seed=7, max_duration=10.0)
    assert bounded == [t for t in a if t <= 10.0] and len(bounded) < 200
    assert sb.poisson_schedule(0, 1.0, 0) == []


@pytest.mark.parametrize("qps", [0, -1, float("inf"), float("nan")])
def test_poisson_schedule_refuses_bad_rates(qps):
    with pytest.raises(ValueError, match="qps"):
        sb.poisson_schedule(4, qps, 0)


def test_plan_orders_with_dependencies():
    arrivals = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    plan = sb.plan_run(tasks=3, agents=2, arrivals=arrivals, order="agent")
    assert [(p.task, p.position, p.depends_on) for p in plan] == [
        (0, 0, None),
        (1, 0, None),
        (2, 0, None),
        (0, 1, 0),
        (1, 1, 1),
        (2, 1, 2),
    ]
    assert len(sb.plan_run(3, 2, [0.0, 0.1])) == 2  # a time bound cuts the plan
    # task-major (the authors' serving traces, the default): one task's agents, then the next task's
    task_major = sb.plan_run(tasks=3, agents=2, arrivals=arrivals)
    assert task_major == sb.plan_run(tasks=3, agents=2, arrivals=arrivals, order="task")
    assert [(p.task, p.position, p.depends_on) for p in task_major] == [
        (0, 0, None),
        (0, 1, 0),
        (1, 0, None),
        (1, 1, 2),
        (2, 0, None),
        (2, 1, 4),
    ]
    with pytest.raises(ValueError, match="order must be one of agent, task; got 'tasks'"):
        sb.plan_run(3, 2, [0.0], order="tasks")
    assert sb.build_parser("hf-kvshare bench").parse_args([]).order == "task"  # the CLI's default too


# -- summaries, CSV / JSON ---------------------------------------------------------------------------


def _record(i, ttft, position=0, ok=True, sent=0.0, finished=1.0, tokens=4):
    return {
        "request": i,
        "position": position,
        "ok": ok,
        "ttft_s": ttft if ok else None,
        "sent_s": sent,
        "finished_s": finished,
        "e2e_s": finished - sent,
        "completion_tokens": tokens if ok else None,
        "prompt_tokens": 100,
        "dependency_wait_s": 0.0,
    }


def test_summary_percentiles_and_throughput():
    records = [
        _record(i, t, position=i % 2, finished=2.0 + i) for i, t in enumerate([1.0, 2.0, 3.0, 4.0, 5.0])
    ]
    records.append({"request": 5, "position": 1, "ok": False, "sent_s": None})  # not sent
    records.append(_record(6, None, ok=False, sent=1.0))  # failed
    row = sb.summarize_run(records, wall_s=9.0)
    assert row["requests"] == 7 and row["completed"] == 5 and row["failed"] == 1 and row["not_sent"] == 1
    assert row["ttft_p50_s"] == 3.0
    assert row["ttft_p90_s"] == pytest.approx(4.6)  # linear interpolation (numpy's default)
    assert row["reuse_ttft_p50_s"] == 3.0  # positions 1 and 3: TTFT 2.0 and 4.0
    assert row["output_tokens"] == 20
    assert row["throughput_tok_s"] == pytest.approx(20 / 6.0)  # first send 0, last finish 6
    assert row["cached_tokens"] is None  # the server did not report it


def test_summary_of_nothing_is_nan_not_an_error():
    row = sb.summarize_run([{"request": 0, "position": 0, "ok": False, "sent_s": None}])
    assert row["completed"] == 0 and math.isnan(row["ttft_p50_s"]) and math.isnan(row["throughput_tok_s"])


def test_metrics_parsing_and_deltas():
    text = (
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="model"} 1344.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="model"} 4000.0\n'
        "process_open_fds 12\n"
    )
    after = sb.parse_metrics(text)
    assert after["vllm:prefix_cache_hits_total"] == 1344.0
    before = {"vllm:prefix_cache_hits_total": 344.0}
    assert sb.metric_delta(before, after, *sb.PREFIX_HITS) == 1000.0
    assert sb.metric_delta(before, after, *sb.PREFIX_QUERIES) == 4000.0
    assert sb.metric_delta(before, after, "vllm:nothing") is None
    assert "no connector" in sb.connector_columns("plain", [])["rho_note"]


def _report(claimed, ph, supplied_ph, supplied_pf):
    return {
        "claimed": claimed,
        "supplied_tokens": supplied_ph + supplied_pf,
        "ph_tokens": ph,
        "supplied_ph_tokens": supplied_ph,
        "supplied_pf_tokens": supplied_pf,
        "prefix_cache_hit": 0,
        "segments": [{"kind": "PH", "span": [3, 3 + ph], "placed": True, "provenance": "reused"}],
        "error": None,
    }


def test_connector_columns_from_the_per_request_reports(tmp_path):
    """Supplied tokens and rho are the connector's own per-request counts (exact), matched to the
    bench's requests by the request_id it sent (vLLM: chatcmpl-<id>-<random suffix>)."""
    spec = sb.RunSpec("fullshared", 2.0, 0, 7, 10.0, 10.0, "model", "agent-first")
    path = tmp_path / "reports.jsonl"
    lines = [
        {"request_id": f"chatcmpl-{spec.request_id(0)}-a1b2c3d4", **_report(None, 256, 0, 0)},
        {"request_id": f"chatcmpl-{spec.request_id(1)}-e5f6a7b8", **_report([0, 300], 260, 256, 44)},
        {"request_id": "chatcmpl-someone-else-12345678", **_report([0, 9], 9, 9, 0)},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    found = sb.read_reports(path, [spec.request_id(0), spec.request_id(1)], wait_s=0)
    assert set(found) == {spec.request_id(0), spec.request_id(1)}
    records = [
        {"request": i, "ok": True, "connector": sb.compact_report(found[spec.request_id(i)])} for i in (0, 1)
    ]
    records.append({"request": 2, "ok": True})  # no report
    cols = sb.connector_columns("fullshared", records)
    assert cols["supplied_tokens"] == 300 and cols["supplied_ph_tokens"] == 256 and cols["ph_tokens"] == 516
    assert cols["rho"] == pytest.approx(256 / 516) and cols["claimed_requests"] == 1
    assert "1 of 3 completed requests without a report" in cols["rho_note"]
    assert records[1]["connector"]["segments"] == [["PH", 3, 263, "reused"]]
    assert sb.connector_columns("fullshared", [{"request": 0, "ok": True}])["rho"] is None
    # the method's admission time per request and the engine's wait for it, from the same reports
    assert cols["plan_mean_s"] is None and cols["admission_wait_p50_s"] is None  # reports without them
    timed = [
        {
            "request": i,
            "ok": True,
            "connector": {**_report(None, 10, 0, 0), "plan_s": p, "admission_wait_s": w, "record_s": w},
        }
        for i, (p, w) in enumerate([(0.1, 0.5), (0.3, 1.5), (0.2, None)])
    ]
    cols = sb.connector_columns("fullshared", timed)
    assert cols["plan_mean_s"] == pytest.approx(0.2) and cols["admission_wait_p50_s"] == pytest.approx(1.0)
    assert (
        cols["record_mean_s"] == pytest.approx(1.0)
        and sb.compact_report(timed[1]["connector"])["record_s"] == 1.5
    )
    assert sb.compact_report(timed[0]["connector"])["plan_s"] == 0.1
    # where the admission wait went: the queue before the plan, "not decided yet" answers, the decision
    assert cols["plan_queue_p50_s"] is None and cols["not_ready_requests"] is None
    behind = {"task record": 0.25, "settle": 0.05}
    queued = [
        {
            "request": i,
            "ok": True,
            "connector": sb.compact_report(
                {
                    **_report(None, 10, 0, 0),
                    "plan_queue_s": q,
                    "not_ready": n,
                    "taken_after_s": t,
                    "plan_behind": behind,
                }
            ),
        }
        for i, (q, n, t) in enumerate([(0.3, 0, 0.01), (0.1, 2, 1.5), (0.2, 1, None)])
    ]
    queued[0]["ttft_s"], queued[0]["connector"]["queued_s"], queued[0]["connector"]["admission_wait_s"] = (
        1.0,
        0.1,
        0.4,
    )
    queued[1]["ttft_s"], queued[1]["connector"]["admission_wait_s"] = 2.0, 0.5  # queued_s None: 0
    cols = sb.connector_columns("kvcmas", queued)
    assert cols["after_admission_p50_s"] == pytest.approx((0.5 + 1.5) / 2)  # the third has no TTFT
    assert cols["plan_queue_p50_s"] == pytest.approx(0.2) and cols["not_ready_requests"] == 2
    assert cols["taken_after_p50_s"] == pytest.approx(0.755)
    assert queued[0]["connector"]["plan_behind"] == behind and queued[1]["connector"]["not_ready"] == 2
    # a gate's outcome per segment where the method gates, and the requests a rejection sent dense
    assert cols["gate_rejected_requests"] is None  # reports without gate outcomes
    fallback = {"gate": "fallback", "anchors": 2, "entropy": 0.45, "reason": "entropy 0.45 > tau 0.3"}
    gated = [
        {**_report(None, 10, 0, 0), "segments": [{"kind": "PH", "span": [0, 10], "placed": False, "gate": g}]}
        for g in (fallback, {"gate": "accepted", "anchors": 3, "entropy": 0.1}, {"gate": "first"})
    ]
    compact = [sb.compact_report(r) for r in gated]
    assert compact[0]["segments"] == [["PH", 0, 10, "dense", fallback]]
    assert [c["gate_rejected"] for c in compact] == [True, False, False]
    assert sb.compact_report(_report(None, 10, 0, 0))["gate_rejected"] is None
    records = [{"request": i, "ok": True, "connector": c} for i, c in enumerate(compact)]
    cols = sb.connector_columns("kvcmas", records)
    assert cols["gate_rejected_requests"] == 1 and "anchors" not in cols["rho_note"]
    # a rejection for want of anchors says so (the pools were still filling: warm up longer)
    unfilled = {**fallback, "reason": "fewer than 2 anchors at least 7 tokens long (1 of 1)"}
    records[0]["connector"] = sb.compact_report(
        {**gated[0], "segments": [{**gated[0]["segments"][0], "gate": unfilled}]}
    )
    assert records[0]["connector"]["gate_unfilled"] and not compact[0]["gate_unfilled"]
    assert (
        "1 of 3 requests dense because a gate had fewer than 2 anchors"
        in (sb.connector_columns("kvcmas", records)["rho_note"])
    )
    # the store's evictions (cumulative since the server started) as of the run's last report
    assert cols["store_evicted_tasks"] is None
    stored = [
        {
            "request": i,
            "ok": True,
            "connector": sb.compact_report({**_report(None, 10, 0, 0), "store": {"evicted_tasks": n}}),
        }
        for i, n in enumerate([0, 3, 2])
    ]
    assert sb.connector_columns("fullshared", stored)["store_evicted_tasks"] == 3
    # what the server held beyond vLLM's KV cache: the most over the run's reports, from a report file's
    # line (method_bytes) or a reply's (the method's whole state summary)
    assert cols["store_bytes_max"] is None and cols["method_bytes_max"] is None
    held = [
        {"store": {"bytes": 500, "method_bytes": 70}},
        {"store": {"bytes": 900, "method_state": {"bytes": 40, "anchors": 2}}},
        {"store": {"bytes": 300, "method_bytes": None}},
    ]
    held = [
        {"request": i, "ok": True, "connector": sb.compact_report({**_report(None, 10, 0, 0), **h})}
        for i, h in enumerate(held)
    ]
    assert [r["connector"]["method_bytes"] for r in held] == [70, 40, None]
    cols = sb.connector_columns("kvcmas", held)
    assert cols["store_bytes_max"] == 900 and cols["method_bytes_max"] == 70


def test_exact_match_against_plain():
    plain = [{"request": i, "ok": True, "token_ids": [i, i + 1]} for i in range(4)]
    same = [dict(r) for r in plain]
    assert sb.exact_match(same, plain)[0] == 1.0
    other = [dict(r) for r in plain]
    other[2] = {**other[2], "token_ids": [9, 9]}
    value, note = sb.exact_match(other, plain)
    assert value == 0.75 and "first differing: request 2" in note
    rows = [
        {"method": "plain", "repeat": 0, "qps": 2.0},
        {"method": "nonshared", "repeat": 0, "qps": 2.0},
        {"method": "fullshared", "repeat": 0, "qps": 0.5},
    ]
    sb.fill_exact(
        rows, {("plain", 0, 2.0): plain, ("nonshared", 0, 2.0): same, ("fullshared", 0, 0.5): other}
    )
    assert rows[0]["exact_note"] == "the reference" and rows[1]["exact_match"] == 1.0
    assert rows[2]["exact_match"] is None and "no plain run" in rows[2]["exact_note"]


def test_outputs_json_csv_and_figure(tmp_path):
    rows = []
    for method, scale in (("plain", 4.0), ("document-first", 1.0), ("fullshared", 1.2)):
        for qps in (0.5, 2.0):
            rows.append(
                {
                    "method": method,
                    "qps": qps,
                    "repeat": 0,
                    "ttft_p50_s": scale * qps,
                    "ttft_p90_s": 2 * scale * qps,
                }
            )
    rows.append({"method": "kvcmas", "qps": 0.5, "repeat": 0, "ttft_p50_s": float("nan"), "ttft_p90_s": None})
    config = {"model": "m", "workload": {"agents": 4, "shared_tokens": 256, "output_tokens": 4, "tasks": 2}}
    written = sb.write_outputs(tmp_path, config, rows, plots=True)
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["config"] == config and data["rows"][-1]["ttft_p50_s"] is None  # NaN written as null
    with open(tmp_path / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(sb.SUMMARY_COLUMNS) and len(table) == 7
    assert table[0]["method"] == "plain" and float(table[1]["ttft_p50_s"]) == 8.0
    curves = sb.curves(rows)
    assert "kvcmas" not in curves and curves["plain"] == [(0.5, 2.0, 4.0), (2.0, 8.0, 16.0)]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "ttft_vs_qps.png") in written and (tmp_path / "ttft_vs_qps.png").stat().st_size > 0


def test_an_incomplete_summary_is_refused_by_every_reader(tmp_path):
    from hf_kvshare.bench.report import read_configuration_summary

    rows = [{"method": "plain", "qps": 1.0, "repeat": 0, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2}]
    config = {"model": "m", "workload": {"agents": 2, "shared_tokens": 16, "output_tokens": 2, "tasks": 1}}
    sb.write_outputs(tmp_path / "done", config, rows, plots=False)
    assert list(sb.iter_rows(tmp_path / "done" / "summary.json")) == rows
    assert sb.summary_complete(tmp_path / "done" / "summary.json")
    sb.write_outputs(tmp_path / "cut", config, rows, plots=False, complete=False, stopped="interrupted")
    summary = tmp_path / "cut" / "summary.json"
    assert not sb.summary_complete(summary)  # the skip-if-done check replaces it instead of refusing
    with pytest.raises(ValueError, match=r"incomplete run \(interrupted\)"):
        list(sb.iter_rows(summary))
    with pytest.raises(ValueError, match=r"is an incomplete run \(interrupted\): not read"):
        read_configuration_summary(tmp_path / "cut")  # report and plot


class _Interrupt(KeyboardInterrupt):
    pass


@pytest.mark.parametrize("failure", [_Interrupt, RuntimeError])
def test_an_interrupted_or_failed_serve_run_never_looks_finished(failure, tmp_path, monkeypatch, capsys):
    """The serve loop with the server, the warm-up and the client replaced (no vLLM): a finished run
    is renamed into place; a second run of the same folder (``--redo``) that is interrupted or fails
    at its second configuration leaves the first run's folder byte for byte, and its own rows only in
    a hidden partial folder whose summary is marked incomplete (which the next run removes)."""
    import contextlib

    import transformers

    from hf_kvshare.bench.report import find_configurations

    out = tmp_path / "out" / "serve-config"
    plan = sb.Plan(
        sb.ServeTrace(16, 2, 1, 2),
        ["plain"],
        [sb.ServerGroup("plain", ["plain"])],
        [1.0, 2.0],
        tmp_path,
        out,
        512,
    )
    calls = []

    def run_once(port, spec, workload, tokenizer, log=None):
        calls.append(spec.qps)
        if fail_at is not None and len(calls) == fail_at:
            raise failure("the server went away")
        records = [{**_record(i, 0.1 * len(calls), position=i), "method": spec.method} for i in range(2)]
        return {
            "method": spec.method,
            "qps": spec.qps,
            "repeat": spec.repeat,
            **sb.summarize_run(records),
        }, records

    from hf_kvshare.bench.serve import cli, runs

    monkeypatch.setattr(cli, "validate", lambda args, prog: plan)
    monkeypatch.setattr(runs, "group_server", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(runs, "warm_up", lambda *a, **k: None)
    monkeypatch.setattr(runs, "run_once", run_once)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    argv = [
        "--methods",
        "plain",
        "--qps",
        "1",
        "2",
        "--port",
        "9",
        "--no-plots",
        "--out",
        str(tmp_path / "out"),
    ]
    fail_at = None
    assert sb.main(argv) == 0
    finished = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert (
        len(list(sb.iter_rows(out / "summary.json"))) == 2
        and len(finished["requests.jsonl"].splitlines()) == 4
    )
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["serve-config"]  # no partial folder left
    capsys.readouterr()
    fail_at = len(calls) + 2  # the second configuration of the second run
    assert sb.main([*argv, "--redo"]) == (130 if failure is _Interrupt else 1)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == finished
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "1 row(s) so far" in err and "incomplete" in err, err
    (partial,) = [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]
    assert partial.name.startswith(".serve-config.partial-")
    cut = json.loads((partial / "summary.json").read_text())
    assert cut["complete"] is False and len(cut["rows"]) == 1
    assert cut["stopped"] == ("interrupted" if failure is _Interrupt else "error: the server went away")
    with pytest.raises(ValueError, match="incomplete run"):
        list(sb.iter_rows(partial / "summary.json"))
    assert find_configurations([tmp_path / "out"]) == [out]  # report never finds the partial folder
    fail_at = None
    assert sb.main([*argv, "--redo"]) == 0  # the next run removes it and replaces the finished one
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["serve-config"]
    assert (
        json.loads((out / "summary.json").read_text())["rows"] != json.loads(finished["summary.json"])["rows"]
    )


# -- workload: fresh documents, layouts ------------------------------------------------------------


def test_fresh_documents_per_run(tokenizer):
    w = sb.ServeTrace(shared_tokens=64, agents=3, tasks=2, output_tokens=4)
    seeds = {sb.run_seed(0, "run", r, q) for r in range(2) for q in range(3)}
    assert len(seeds) == 6  # every run its own seed, the same for every method
    docs = []
    for seed in sorted(seeds):
        tasks = w.task_specs(tokenizer, seed)
        assert len(tasks) == 2
        for t in tasks:
            (slot,) = t.slots
            assert len(tokenizer(slot.text, add_special_tokens=False)["input_ids"]) == 64
            docs.append(slot.text)
    assert len(set(docs)) == len(docs)  # no document served twice
    assert w.task_specs(tokenizer, 5)[0].slots[0].text == w.task_specs(tokenizer, 5)[0].slots[0].text


def test_every_row_of_a_rate_arrives_on_one_schedule(tokenizer):
    """Document-first reads documents of its own (it shares the plain row's server) but must arrive on
    the plain and connector rows' Poisson schedule: a bound measured under another load (its own
    schedule until 2026-12-03: 9.8 s for the first five arrivals at 0.5 QPS against 3.4 s) is no bound."""
    w = sb.ServeTrace(shared_tokens=64, agents=4, tasks=5, output_tokens=4)
    args = argparse.Namespace(
        seed=3,
        max_duration=600.0,
        request_timeout=60.0,
        explicit_layout=True,
        joined_messages=False,
        order="task",
    )
    n = w.tasks * w.agents
    for qi, qps in enumerate((0.5, 2.0)):
        specs = {
            m: sb.run_spec(m, qps, qi, 0, args, None) for m in ("plain", sb.DOC_FIRST, "fullshared", "kvcmas")
        }
        schedules = {m: s.arrivals(n) for m, s in specs.items()}
        assert len({tuple(a) for a in schedules.values()}) == 1 and len(schedules["plain"]) == n
        docs = {m: [t.slots[0].text for t in w.task_specs(tokenizer, s.seed)] for m, s in specs.items()}
        assert docs["plain"] == docs["fullshared"] == docs["kvcmas"]
        assert not set(docs[sb.DOC_FIRST]) & set(docs["plain"])
        assert specs[sb.DOC_FIRST].layout == sb.DOC_FIRST and specs["plain"].layout == "agent-first"
        assert not specs["plain"].explicit_layout and specs["fullshared"].explicit_layout
    other = sb.run_spec("plain", 0.5, 1, 0, args, None)  # another rate's run: its own schedule
    assert other.arrivals(n) != sb.run_spec("plain", 0.5, 0, 0, args, None).arrivals(n)


def test_every_server_of_a_repeat_warms_up_on_the_same_documents(tokenizer, monkeypatch):
    """Warm-up tasks teach a method's pools (KVCMAS's gates depend on them): every server of a repeat
    gets the same ones whatever port it listens on, other repeats and the timed runs other ones."""
    w = sb.ServeTrace(shared_tokens=64, agents=2, tasks=3, output_tokens=4)

    def docs(tasks):
        return [t.slots[0].text for t in tasks]

    first = docs(sb.warmup_tasks(w, 2, tokenizer, seed=0, repeat=0))
    assert len(first) == 2 and first == docs(sb.warmup_tasks(w, 2, tokenizer, seed=0, repeat=0))
    assert not set(first) & set(docs(sb.warmup_tasks(w, 2, tokenizer, seed=0, repeat=1)))
    timed = {d for q in range(2) for d in docs(w.task_specs(tokenizer, sb.run_seed(0, "run", 0, q)))}
    assert not set(first) & timed

    # and warm_up sends those documents on any port
    from hf_kvshare.bench.serve import client

    sent = []
    monkeypatch.setattr(
        client, "stream_chat", lambda port, body, timeout: sent.append(body) or {"ok": True, "text": "x"}
    )
    plan = type("P", (), {"workload": w})()
    args = type("A", (), {"warmup_tasks": 2, "seed": 0, "request_timeout": 1.0})()
    bodies = []
    for port in (8001, 8002):
        sent.clear()
        sb.warm_up(port, plan, args, tokenizer, 0)
        bodies.append(json.dumps(sent, sort_keys=True))
    contents = [str(m["content"]) for body in sent for m in body["messages"]]
    assert bodies[0] == bodies[1] and all(any(d in c for c in contents) for d in first)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"agents": 9}, "at most 8 agents"),
        ({"tasks": 0}, "--tasks"),
        ({"shared_tokens": 0}, "--shared-tokens"),
        ({"tasks": 500, "agents": 8}, "requests per run"),
    ],
)
def test_workload_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sb.ServeTrace(**kwargs)


def test_document_first_layout(tokenizer):
    (task,) = sb.ServeTrace(shared_tokens=32, agents=2, tasks=1, output_tokens=4).task_specs(tokenizer, 1)
    doc = task.slots[0].text
    first, second = task_requests(task, {"planner": "Plan: fix the roof."})
    moved = sb.document_first(second)
    assert moved.messages[0]["role"] == "system" and moved.messages[0]["content"].startswith(doc)
    assert second.messages[0]["content"] in moved.messages[0]["content"]  # the agent's own prompt follows
    assert sum(m["content"].count(doc) for m in moved.messages) == 1  # moved, not copied
    assert any("Plan: fix the roof." in m["content"] for m in moved.messages[1:])
    a, b = (
        tokenizer(
            tokenizer.apply_chat_template(sb.document_first(r).messages, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for r in (first, second)
    )
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= 32  # the two agents share the document as a prefix (what vLLM's cache can hit)
    with pytest.raises(ValueError, match="does not read slot"):
        sb.document_first(first, slot="nowhere")


# -- the client: requests from a trajectory -------------------------------------------------------


def test_client_requests_from_a_bench_task_match_the_session_layout(tokenizer):
    """Joined messages, rendered with the chat template, are exactly the text the bench's Session
    prompt (TaskSpec.to_workflow) tokenizes; the split layout gives every shared text a message."""
    (task,) = sb.ServeTrace(shared_tokens=40, agents=3, tasks=1, output_tokens=4).task_specs(tokenizer, 3)
    replies = {"planner": "First, list the costs.", "researcher": "The roof is old."}
    joined = task_requests(task, replies, split=False)
    workflow = task.to_workflow(tokenizer)
    for request, step in zip(joined, workflow.steps):
        expected = "".join(
            seg.text
            if isinstance(seg, PF)
            else (task.slots[0].text if seg.slot == "context" else replies[seg.slot])
            for seg in step.segments
        )
        assert (
            tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
            == expected
        )
        assert request.output_slot == step.output_slot and request.max_tokens == request.min_tokens == 4
    split = task_requests(task, replies)
    last = split[-1]
    assert [last.text(s) for s in last.spans] == [
        task.slots[0].text,
        replies["planner"],
        replies["researcher"],
    ]
    assert all(last.messages[s.message]["content"] == last.text(s) for s in last.spans)  # whole messages
    assert [m["role"] for m in last.messages][0] == "system"


def test_client_explicit_layout_and_bodies():
    traj = ChatTrajectory({"doc": "The shared document."}, task="t1")
    r1 = traj.request(
        "planner",
        [{"role": "system", "content": "You plan."}, {"role": "user", "content": [PH("doc"), "\n\nPlan:"]}],
        max_tokens=8,
        min_tokens=8,
    )
    assert r1.output_slot == "planner" and r1.reads == ("doc",)
    assert r1.kv_transfer_params() == {
        "hf_kvshare": {
            "task": "t1",
            "agent": "planner",
            "output": "planner",
            "segments": [{"slot": "doc", "text": "The shared document."}],
        }
    }
    traj.record(r1.output_slot, "Step one.")
    r2 = traj.request(
        "critic", [{"role": "user", "content": ["Notes:\n", PH("doc"), "\n", PH("planner"), "\nCritique:"]}]
    )
    assert [m["content"] for m in r2.messages] == [
        "Notes:\n",
        "The shared document.",
        "Step one.",
        "\nCritique:",
    ]
    assert r2.kv_transfer_params()["hf_kvshare"]["segments"] == [
        {"slot": "doc", "text": "The shared document."},
        {"slot": "planner"},
    ]
    body = r1.body("m", stream=True, explicit_layout=True)
    assert body["min_tokens"] == 8 and body["max_tokens"] == 8 and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True} and "kv_transfer_params" in body
    kwargs = r1.openai_kwargs("m", explicit_layout=True)
    assert set(kwargs["extra_body"]) == {"min_tokens", "kv_transfer_params"} and kwargs["max_tokens"] == 8
    assert traj.output_slot("planner") == "planner#2"


def test_client_refuses_unknown_slots_and_bad_items():
    traj = ChatTrajectory()
    with pytest.raises(ValueError, match="has no text yet"):
        traj.request("a", [{"role": "user", "content": [PH("nowhere")]}])
    with pytest.raises(TypeError, match="str, PF or PH"):
        traj.request("a", [{"role": "user", "content": [3]}])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        traj.request("a", [{"content": "x"}])
    with pytest.raises(ValueError, match="another text"):
        ChatTrajectory({"d": "one"}).request("a", [{"role": "user", "content": [PH("d", "two")]}])
    traj.request(
        "a", [{"role": "user", "content": [PH("q", "What is 2+2?")]}]
    )  # a PH with text defines its slot
    assert traj.slots == {"q": "What is 2+2?"}


def test_task_turns_cover_the_schedule(tokenizer):
    (task,) = sb.ServeTrace(shared_tokens=16, agents=4, tasks=1, output_tokens=2).task_specs(tokenizer, 0)
    turns = list(task_turns(task))
    assert [t[0] for t in turns] == [s.agent for s in task.schedule]
    assert task_trajectory(task, "x").task == "x"
    chat(tokenizer, turns[0][1])  # the same messages are valid Session input (PH slots kept)


def test_task_turns_and_the_workflow_lay_a_task_out_alike(tokenizer):
    """One source (TaskSpec.turns) for the HF workflow and the served requests: the same messages, and
    a given slot's stated kind reaches the explicit layout."""
    from hf_kvshare.bench.workloads import TaskSpec

    task = TaskSpec.from_record(
        {
            "id": "obs",
            "agents": [{"name": "reader", "system": "You read."}, {"name": "judge"}],
            "slots": [
                {"name": "q", "text": "Which tide is higher?"},
                {"name": "tool", "text": "High water 14:05, 5.1 m; 02:40, 4.8 m.", "kind": "observation"},
            ],
            "schedule": [
                {"agent": "reader", "reads": ["q", "tool"]},
                {"agent": "judge", "reads": ["reader", "tool"]},
            ],
        }
    )
    workflow = task.to_workflow(tokenizer)
    turns = list(task_turns(task))
    for step, (agent, messages, output, max_tokens, _) in zip(workflow.steps, turns):
        assert (step.agent, step.output_slot, step.max_new_tokens) == (agent, output, max_tokens)
        assert chat(tokenizer, messages) == step.segments
    traj = task_trajectory(task)
    first = traj.request(*turns[0][:2], output_slot=turns[0][2])
    segments = first.kv_transfer_params()["hf_kvshare"]["segments"]
    # stated where the default would read it otherwise (the question is the default)
    assert [(s["slot"], s.get("kind")) for s in segments] == [("q", None), ("tool", "observation")]


def test_agreement_and_forced_requests():
    ref = [[5, 6, 7], [8, 9]]
    got = [[5, 1, 7], [None, 9]]  # None: a position the server tokenized otherwise, not counted
    result = sb.agreement(ref, got)
    assert result["agreement"] == pytest.approx(3 / 4) and result["forced_positions"] == 4
    assert result["first_token_agreement"] == 1.0  # the second reply's first position is not counted
    assert math.isnan(sb.agreement([], [])["agreement"])
    traj = ChatTrajectory({"doc": "Some shared text."})
    request = traj.request("a", [{"role": "user", "content": [PH("doc")]}], max_tokens=4, min_tokens=4)
    first = sb.forced_body(request, "", "m")
    assert first["max_tokens"] == 1 and "min_tokens" not in first and first["return_token_ids"] is True
    assert first["messages"] == request.messages and "continue_final_message" not in first
    later = sb.forced_body(request, "The plan", "m", explicit_layout=True)
    assert later["messages"][-1] == {"role": "assistant", "content": "The plan"}
    assert later["continue_final_message"] is True and later["add_generation_prompt"] is False
    assert "prompt_logprobs" not in later and "kv_transfer_params" in later


# -- the command line: every argument checked before a server starts -------------------------------


def _serve(*argv, env=None):
    return subprocess.run(
        [sys.executable, "-m", "hf_kvshare", "bench", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--qps", "0"], "--qps: expected a positive number"),
        (["--methods", "plain", "bogus"], "unknown method 'bogus'"),
        (["--methods", "plain", "plain"], "names a method twice"),
        (["--qps", "1", "1"], "names a rate twice"),
        (["--agents", "9"], "at most 8 agents"),
        (["--agreement", "--methods", "document-first"], "--agreement needs plain"),
        (["--methods", "plain", "--vllm-python", "/nonexistent/python"], "no such file"),
    ],
)
def test_cli_argument_errors_are_one_line(argv, message, tmp_path, capsys):
    try:
        code = sb.main([*argv, "--out", str(tmp_path / "out")], prog="hf-kvshare bench")
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # nothing written, no server started


def test_cli_dispatch_and_a_python_without_vllm(tmp_path, capsys):
    """``hf-kvshare bench serve`` reaches this command; a Python without vLLM is refused up front (run
    in-process: ``python -m hf_kvshare`` itself is tests/test_cli.py's subprocess test)."""
    from hf_kvshare.cli import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this Python has vLLM")
    argv = ["--methods", "plain", "--vllm-python", sys.executable, "--out", str(tmp_path / "out")]
    code = main(["bench", "serve", *argv])
    err = capsys.readouterr().err
    assert code == 2 and "vLLM is not installed there" in err, err
    assert not (tmp_path / "out").exists()


# -- the one vLLM launcher (hf_kvshare.serving.server.Server) -----------------------------------------


def test_the_plain_rows_and_the_connector_rows_start_vllm_through_one_launcher(tmp_path):
    """``Server(method=None)`` is plain vLLM (no connector, no middleware, no method variable); the
    bench's environment is set over the process's; every server's command is vLLM's OpenAI server."""
    from hf_kvshare.serving.middleware import ENV
    from hf_kvshare.serving.server import MIDDLEWARE, Server

    env = sb.server_env(threads=3, kv_cache_gib=2)
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "PATH" not in env
    plain = Server(tmp_path, None, port=5, vllm_args=["--dtype", "float32"], env=env, python="py")
    assert plain.command() == [
        "py", "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path),
        "--host", sb.HOST, "--port", "5", "--dtype", "float32",
    ]  # fmt: skip
    environment = plain.environment()
    assert environment["OMP_NUM_THREADS"] == "3" and ENV not in environment and "PATH" in environment
    connector = Server(tmp_path, "fullshared", port=5, env={sb.REPORTS: "r.jsonl"})
    command = connector.command()
    assert "--kv-transfer-config" in command and command[command.index("--middleware") + 1] == MIDDLEWARE
    assert connector.environment()[sb.REPORTS] == "r.jsonl" and ENV in connector.environment()
    with pytest.raises(ValueError, match="--middleware is set by"):
        Server(tmp_path, "fullshared", port=5, vllm_args=["--middleware", "x"])
    Server(tmp_path, None, port=5, vllm_args=["--middleware", "x"])  # plain vLLM sets none of its own
    with pytest.raises(ValueError, match="--port is set by"):
        Server(tmp_path, None, vllm_args=["--port", "1"])
    with pytest.raises(ValueError, match="listens on 127.0.0.1 only"):
        Server(tmp_path, None, vllm_args=["--host", "0.0.0.0"])
    with pytest.raises(ValueError, match="takes no method options"):
        Server(tmp_path, None, {"prefix_reuse": True})


def test_a_server_that_exits_is_reported_with_its_log_and_stopped(tmp_path):
    """A Python without vLLM: the launcher's process exits; ``running`` raises with the log's path (the
    command line first, then the server's output) and leaves no process behind."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this Python has vLLM")
    from hf_kvshare.serving.server import Server

    log = tmp_path / "logs" / "plain.log"
    server = Server(tmp_path, None, log=log, python=sys.executable)
    cause = "No module named 'vllm'"  # the cause, read back from the log, named in the error
    with pytest.raises(RuntimeError, match=rf"exited \(code 1\) before it answered: .*{cause}.*; see {log}"):
        with sb.running(server, startup_timeout=120):
            pytest.fail("a server without vLLM answered")
    assert server.process is None and server._opened_log is None
    lines = log.read_text().splitlines()
    assert lines[0] == " ".join(server.command()) and "vllm" in "\n".join(lines[1:])


def test_the_bench_launchers_old_names_are_deprecated_aliases(tmp_path):
    from hf_kvshare.serving.server import Server

    with pytest.warns(DeprecationWarning, match="serving.server.Server"):
        assert sb.connector_server_class() is Server
    with pytest.warns(DeprecationWarning, match=r"serving.server.Server\(model_dir, None"):
        launcher = sb.VLLMServer(sys.executable, tmp_path, 5, [], tmp_path / "x.log", {}, 1.0)
    assert hasattr(launcher, "__enter__")  # a context manager, as VLLMServer was; not started here


# -- end to end (a server) -------------------------------------------------------------------------

VLLM_PYTHON = os.environ.get(sb.VLLM_PYTHON_ENV) or sys.executable
#: the model the end-to-end test serves (an HF folder, or an embedded name the serving package writes)
SERVE_MODEL = os.environ.get("HF_KVSHARE_SERVE_MODEL", "smollm2-135m")


@pytest.mark.serving
@pytest.mark.skipif(
    not has_vllm(VLLM_PYTHON), reason=f"needs vLLM in {VLLM_PYTHON} (set ${sb.VLLM_PYTHON_ENV})"
)
def test_bench_serve_runs_plain_and_document_first(tmp_path):
    out = tmp_path / "out"
    result = _serve(
        "--methods", "plain", "document-first", "--qps", "4", "--shared-tokens", "160", "--agents", "2",
        "--tasks", "2", "--output-tokens", "2", "--max-duration", "120", "--request-timeout", "120",
        "--warmup-tasks", "0", "--vllm-python", VLLM_PYTHON, "--vllm-arg=--enforce-eager", "--no-plots",
        "--model", SERVE_MODEL, "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (summary,) = out.glob("*/summary.json")
    rows = {r["method"]: r for r in json.loads(summary.read_text())["rows"]}
    assert set(rows) == {"plain", "document-first"}
    assert all(r["completed"] == 4 for r in rows.values())
    # the second agent hits the document (vLLM CPU caches whole blocks of 128 tokens: 160 + header > 128)
    assert rows["document-first"]["prefix_cache_hits"] > 0


@pytest.mark.serving
@pytest.mark.skipif(
    not has_vllm(VLLM_PYTHON), reason=f"needs vLLM in {VLLM_PYTHON} (set ${sb.VLLM_PYTHON_ENV})"
)
def test_bench_serve_runs_a_connector_method_with_agreement(tmp_path):
    out = tmp_path / "out"
    result = _serve(
        "--methods", "plain", "fullshared", "--qps", "4", "--shared-tokens", "64", "--agents", "2",
        "--tasks", "2", "--output-tokens", "2", "--max-duration", "120", "--request-timeout", "120",
        "--warmup-tasks", "0", "--agreement", "--agreement-tasks", "1", "--explicit-layout",
        "--vllm-python", VLLM_PYTHON, "--vllm-arg=--enforce-eager", "--no-plots", "--model", SERVE_MODEL,
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (summary,) = out.glob("*/summary.json")
    rows = {r["method"]: r for r in json.loads(summary.read_text())["rows"]}
    assert rows["fullshared"]["completed"] == 4 and rows["fullshared"]["failed"] == 0
    assert rows["fullshared"]["agreement"] is not None  # forced positions were counted
    assert rows["fullshared"]["supplied_tokens"] is not None  # vLLM's connector counter is read
    # the connector's records took finished requests' K/V on its path (the side channels, on the
    # scheduler's order) or its one fallback (the step's output)
    (requests,) = out.glob("*/requests.jsonl")
    reports = [json.loads(line).get("connector") for line in requests.read_text().splitlines()]
    reads = {r["read_back"] for r in reports if r}
    assert "at finish" in reads and reads <= {"at finish", "step output"}, reports
    assert rows["fullshared"]["read_back_p50_s"] is not None


def test_bench_serve_passes_the_store_budgets_to_every_server(tmp_path):
    """``--max-store-bytes`` / ``--device-store-bytes`` reach the launcher's ``Server`` of a group and of
    each replica (the device check's 32K rows need a store larger than the 2 GiB default); unset, the
    launcher's defaults; a bad value is refused by the parser."""
    from types import SimpleNamespace

    from hf_kvshare.bench.serve import cli, runs
    from hf_kvshare.serving.server import DEFAULT_MAX_BYTES

    parser = cli.build_parser("bench serve")
    base = ["--methods", "fullshared", "--out", str(tmp_path)]
    plan = SimpleNamespace(model_dir=str(tmp_path))
    group = sb.ServerGroup("fullshared", ["fullshared"], "fullshared", {})

    def server(argv):
        args = parser.parse_args([*base, *argv])
        return runs.ServerLaunch(group, plan, args, {}, []).server(1, tmp_path / "log")

    given = server(["--max-store-bytes", "64000000000", "--device-store-bytes", "0"])
    assert (given.max_bytes, given.device_store_bytes) == (64_000_000_000, 0)
    # each replica is built by the same launch: the same budgets, its own port and log
    router = ["--router", sys.executable]  # any executable: nothing is started
    args = parser.parse_args([*base, "--max-store-bytes", "64000000000", "--replicas", "2", *router])
    launch = runs.ServerLaunch(group, plan, args, {}, [])
    replicas = launch.replicas(40000, tmp_path / "log.log")
    assert [s.max_bytes for s in replicas.servers] == [64_000_000_000] * 2
    assert [s.port for s in replicas.servers] == list(runs.replica_ports(40000, 2)[0])
    default = server([])
    assert (default.max_bytes, default.device_store_bytes) == (DEFAULT_MAX_BYTES, None)
    # the worker replicas' switch (tensor parallel): on by default, off with the flag
    assert default.worker_replicas is True and server(["--no-worker-replicas"]).worker_replicas is False
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--max-store-bytes", "-1"])

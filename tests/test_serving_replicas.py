"""Replicas behind vLLM's router (``hf_kvshare.serving.replicas``): the command lines, the affinity
header, the warnings (no router or vLLM needed); the router in front of stand-in servers (needs
``vllm-router``); and, marked ``serving``, ``bench serve --replicas 2`` on vLLM against one server."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from live_server import has_vllm

from hf_kvshare.bench import serve as sb
from hf_kvshare.bench.serve.client import read_reports
from hf_kvshare.bench.serve.runs import replica_columns
from hf_kvshare.serving import replicas as rp
from hf_kvshare.serving.client import SESSION_HEADER, ChatTrajectory
from hf_kvshare.serving.server import Server
from hf_kvshare.trajectory import PH

ROUTER = rp.find_router()
needs_router = pytest.mark.skipif(
    ROUTER is None,
    reason="vllm-router is not installed (pip install vllm-router; .ci/run's serving lane has it)",
)


# -- command lines, ports, affinity ----------------------------------------------------------------


def test_router_command_names_the_replicas_ports_and_policy():
    command = rp.router_command(
        "/x/vllm-router", ["http://127.0.0.1:8001", "http://127.0.0.1:8002"], 8000, 8003
    )
    assert command[0] == "/x/vllm-router"
    flags = " ".join(command[1:])
    assert "--host 127.0.0.1 --port 8000" in flags
    assert "--worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002 --policy consistent_hash" in flags
    assert "--prometheus-host 127.0.0.1 --prometheus-port 8003" in flags  # not the shared default 29000
    assert rp.router_command("r", ["u"], 1, 2, "round_robin", ["--log-level", "info"])[-2:] == [
        "--log-level",
        "info",
    ]
    with pytest.raises(ValueError, match="router policy 'sticky'.*consistent_hash"):
        rp.router_command("r", ["u"], 1, 2, "sticky")


def test_replica_ports_follow_the_router():
    assert rp.replica_ports(8000, 2) == ([8001, 8002], 8003)
    assert rp.replica_ports(9000, 1) == ([9001], 9002)


@pytest.mark.parametrize("policy", ["consistent_hash", "sticky_least_loaded"])
def test_affinity_policies_are_not_warned_about(policy):
    assert rp.affinity_warning(policy) is None


@pytest.mark.parametrize("policy", ["round_robin", "random", "cache_aware", "power_of_two", "kv_aware"])
def test_a_policy_without_affinity_is_warned_about_with_the_fix(policy):
    warning = rp.affinity_warning(policy)
    assert f"{policy!r} has no session affinity" in warning and "sharing misses" in warning
    assert "--policy consistent_hash" in warning and f"'{SESSION_HEADER}: <task>'" in warning


def test_the_header_is_the_task():
    assert SESSION_HEADER == "X-Session-ID"  # the first header vllm-router's consistent_hash reads
    body = {"kv_transfer_params": {"hf_kvshare": {"task": "t7", "agent": "a", "segments": []}}}
    assert rp.session_headers(body) == {"X-Session-ID": "t7"}
    assert rp.session_headers({"model": "m"}) == {}  # no task: the router hashes the body
    assert rp.session_headers(task="t8") == {"X-Session-ID": "t8"}
    traj = ChatTrajectory({"doc": "Shared notes."}, task="t9")
    request = traj.request("critic", [{"role": "user", "content": [PH("doc"), "Answer:"]}])
    assert request.headers() == {"X-Session-ID": "t9"}
    assert request.headers() == rp.session_headers(request.body("m", explicit_layout=True))
    untasked = ChatTrajectory({"doc": "Shared notes."}).request("a", [{"role": "user", "content": "hi"}])
    assert untasked.headers() == {}


def test_replicate_builds_servers_on_consecutive_ports(tmp_path):
    template = Server(tmp_path, None, port=8000, vllm_args=["--dtype", "float32"], log=tmp_path / "s.log")
    group = rp.replicate(template, 2, router="/bin/true", router_log=tmp_path / "router.log")
    assert [s.port for s in group.servers] == [8001, 8002] and group.port == 8000
    assert group.ports == [8000, 8003, 8001, 8002]
    assert [Path(s.log).name for s in group.servers] == ["s.replica0.log", "s.replica1.log"]
    assert all(s.vllm_args == ["--dtype", "float32"] and s.method is None for s in group.servers)
    assert "--worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002" in " ".join(group.router.command)
    assert group.warning is None
    assert rp.replicate(template, 2, router="/bin/true", policy="round_robin").warning
    with pytest.raises(ValueError, match="router policy"):
        rp.replicate(template, 2, router="/bin/true", policy="nope")


def test_replicas_are_configured_as_their_template(tmp_path):
    """Every keyword the launcher's ``Server`` takes reaches each replica as the template has it (a new
    one is not dropped on the way: ``in_process`` was), except the port and the log each replica owns."""
    template = Server(
        tmp_path,
        "kvcmas",
        {"tau": 0.5},
        port=8000,
        max_bytes=1 << 20,
        max_tasks=3,
        max_prefix_bytes=1 << 18,
        background=False,
        read_back_channel=False,
        device_store_bytes=1 << 22,
        in_process=False,
        worker_replicas=False,
        python="/usr/bin/python3",
        env={"X": "1"},
    )
    own = {"self", "port", "log", "model_dir", "method", "options"}
    names = [n for n in inspect.signature(Server.__init__).parameters if n not in own]
    for replica in rp.replicate(template, 2, router="/bin/true").servers:
        for name in names:
            assert getattr(replica, name, None) == getattr(template, name, None), name


def test_a_missing_router_is_refused_with_the_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(rp.ROUTER_ENV, raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert rp.find_router() is None
    with pytest.raises(RuntimeError, match="pip install vllm-router"):
        rp.replicate(Server(tmp_path, None, port=8000), 2)


def test_serve_refuses_bad_replica_counts(capsys):
    from hf_kvshare.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--replicas", "0"])
    assert e.value.code == 2 and "--replicas 0" in capsys.readouterr().err


def _bench_args(tmp_path, *extra):
    return sb.build_parser("hf-kvshare bench").parse_args(
        ["--out", str(tmp_path / "out"), "--vllm-python", sys.executable, *extra]
    )


def test_bench_serve_replica_options(tmp_path, capsys):
    args = _bench_args(tmp_path)
    assert args.replicas == 1 and args.router_policy == "consistent_hash"
    with pytest.raises(ValueError, match="pip install vllm-router"):
        sb.validate(_bench_args(tmp_path, "--replicas", "2", "--router", str(tmp_path / "none")), "p")
    with pytest.raises(ValueError, match="--port 65534: the router's metrics and 2 replicas"):
        sb.validate(_bench_args(tmp_path, "--replicas", "2", "--port", "65534"), "p")
    # a router policy without affinity: warned about (before the vLLM probe), the fix named
    with contextlib.suppress(ValueError):  # without vLLM here, validation stops later; the warning came first
        sb.validate(
            _bench_args(
                tmp_path, "--replicas", "2", "--router", "/bin/true", "--router-policy", "round_robin"
            ),
            "p",
        )
    assert "warning: router policy 'round_robin' has no session affinity" in capsys.readouterr().err


def test_replica_columns_count_requests_and_tasks_per_replica():
    records = [
        {"task": 0, "replica": 1},
        {"task": 0, "replica": 1},
        {"task": 1, "replica": 0},
        {"task": 2, "replica": 0},
        {"task": 2, "replica": 1},  # task 2 split: sharing missed
        {"task": 3},  # not reported
    ]
    assert replica_columns(records, 2) == {
        "replica_requests": [2, 3],
        "replica_tasks": [2, 2],
        "tasks_on_several_replicas": 1,
    }


def test_read_reports_tags_each_replica(tmp_path):
    paths = [tmp_path / "r0.jsonl", tmp_path / "r1.jsonl"]
    paths[0].write_text(json.dumps({"request_id": "chatcmpl-a-1", "supplied_tokens": 3}) + "\n")
    paths[1].write_text(json.dumps({"request_id": "chatcmpl-b-2", "supplied_tokens": 5}) + "\n")
    found = read_reports(paths, ["a", "b"], wait_s=0)
    assert found["a"]["replica"] == 0 and found["b"]["replica"] == 1
    assert "replica" not in read_reports(paths[0], ["a"], wait_s=0)["a"]  # one server: untagged


# -- the router in front of stand-in servers (no vLLM) ------------------------------------------------

#: a stand-in for ``python -m vllm.entrypoints.openai.api_server``: answers /health and /v1/models, and
#: each chat request with its own port
STANDIN = textwrap.dedent(
    """\
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    port = int(sys.argv[sys.argv.index("--port") + 1])
    served = [0]
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass
        def reply(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path == "/metrics":  # as vLLM counts finished requests
                data = f'vllm:request_success_total{{finished_reason="stop"}} {served[0]}.0\\n'.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.reply({"object": "list", "data": [{"id": "model", "object": "model"}]})
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            served[0] += 1
            self.reply({"port": port, "session": self.headers.get("X-Session-ID")})
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def _standin_python(tmp_path: Path) -> str:
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    return str(python)


def _post(url: str, headers: dict[str, str], content: str) -> dict:
    body = json.dumps({"model": "model", "messages": [{"role": "user", "content": content}]}).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", body, {"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _free_run(n: int) -> int:
    from hf_kvshare.bench.serve.runs import free_ports

    return free_ports(n)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_router
def test_the_router_sends_each_task_to_one_replica(tmp_path):
    template = Server(tmp_path, None, port=_free_run(4), python=_standin_python(tmp_path))
    group = rp.replicate(template, 2, router_log=tmp_path / "router.log")
    with group:
        group.wait_ready(60)
        pids = [group.router.process.pid, *(s.process.pid for s in group.servers)]
        served: dict[str, set[int]] = {}
        for task in [f"task-{i}" for i in range(8)]:
            for turn in range(3):  # each turn a different prompt, as a task's agents send
                answer = _post(group.url, {SESSION_HEADER: task}, f"agent {turn} of {task}")
                assert answer["session"] == task  # the header reaches the replica
                served.setdefault(task, set()).add(answer["port"])
        assert all(len(ports) == 1 for ports in served.values()), served
        assert set().union(*served.values()) == {s.port for s in group.servers}  # both replicas serve
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)  # every process stopped with the set


@needs_router
def test_every_process_dies_with_the_wrapper(tmp_path):
    """``hf-kvshare serve --replicas 2`` killed (SIGKILL: no handler runs) takes the router and the
    replicas with it (``PR_SET_PDEATHSIG``)."""
    port = _free_run(4)
    code = textwrap.dedent(
        f"""\
        import sys, time
        from hf_kvshare.serving import replicas as rp
        from hf_kvshare.serving.server import Server
        group = rp.replicate(Server({str(tmp_path)!r}, None, port={port}, python={_standin_python(tmp_path)!r}), 2)
        group.start()
        group.wait_ready(60)
        print("PIDS", *(str(p) for p in [group.router.process.pid, *(s.process.pid for s in group.servers)]), flush=True)
        time.sleep(600)
        """
    )
    wrapper = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        line = ""
        while line is not None and not line.startswith("PIDS"):  # the servers' output comes first
            line = wrapper.stdout.readline() or None
        pids = [int(p) for p in (line or "PIDS").split()[1:]]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
    finally:
        wrapper.kill()
        wrapper.wait()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


@needs_router
def test_without_affinity_a_router_scatters_a_task_and_the_probe_says_so(tmp_path):
    """What the warning is about: no affinity, and a task's turns reach both replicas; the probe
    ``bench serve --url`` runs finds it (and finds none behind a consistent_hash router)."""
    template = Server(tmp_path, None, port=_free_run(4), python=_standin_python(tmp_path))
    group = rp.replicate(template, 2, policy="round_robin")
    assert group.warning is not None
    with group:
        group.wait_ready(60)
        ports = {_post(group.url, {SESSION_HEADER: "one-task"}, f"turn {i}")["port"] for i in range(4)}
        assert len(ports) == 2
        assert rp.router_workers(group.url) and len(rp.served_counts(rp.router_workers(group.url))) == 2
        warning = rp.probe_affinity(group.url, "model")
        assert "to 2 replicas" in warning and "--policy consistent_hash" in warning
    template.port = _free_run(4)  # fresh ports: the replicas' last connections may linger in TIME_WAIT
    with rp.replicate(template, 2) as group:
        group.wait_ready(60)
        assert rp.probe_affinity(group.url, "model") is None
        counts = rp.served_counts([s.url for s in group.servers])
        assert sorted(counts) == [0, 4]  # the probe's four requests on one replica
    assert rp.probe_affinity(template.url, "model") is None  # nothing answers: nothing to check


def test_bench_serve_url_is_checked(tmp_path):
    for extra, match in [
        (["--url", "http://example.com:8000"], "give http://127.0.0.1:PORT"),
        (["--url", "http://127.0.0.1"], "give http://127.0.0.1:PORT"),
        (["--url", "http://127.0.0.1:9", "--replicas", "2", "--router", "/bin/true"], "without --replicas"),
        (["--url", "http://127.0.0.1:9", "--methods", "plain", "fullshared"], "the one method"),
        (["--url", "http://127.0.0.1:9", "--methods", "fullshared"], "no model listed on /v1/models"),
    ]:
        with pytest.raises(ValueError, match=match):
            sb.validate(_bench_args(tmp_path, *extra), "p")


# -- on vLLM: bench serve through two replicas and the router, against one server ---------------------

VLLM_PYTHON = os.environ.get(sb.VLLM_PYTHON_ENV) or sys.executable
SERVE_MODEL = os.environ.get("HF_KVSHARE_SERVE_MODEL", "smollm2-135m")


def _bench(out: Path, *extra: str) -> dict:
    argv = [
        "--methods", "fullshared:prefix_reuse=True", "--qps", "4", "--shared-tokens", "160", "--agents", "3",
        "--tasks", "4", "--output-tokens", "2", "--max-duration", "120", "--request-timeout", "120",
        "--warmup-tasks", "3", "--explicit-layout", "--vllm-python", VLLM_PYTHON,
        "--vllm-arg=--enforce-eager", "--kv-cache-gib", "1", "--no-plots", "--model", SERVE_MODEL,
        "--out", str(out), *extra,
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "hf_kvshare", "bench", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (summary,) = out.glob("*/summary.json")
    (row,) = json.loads(summary.read_text())["rows"]
    return row


@pytest.mark.serving
@pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")
@pytest.mark.skipif(
    not has_vllm(VLLM_PYTHON), reason=f"needs vLLM in {VLLM_PYTHON} (set ${sb.VLLM_PYTHON_ENV})"
)
def test_two_replicas_behind_the_router_share_as_one_server(tmp_path):
    """Every task's requests on one replica, and the same reuse as one server's. Each replica is warmed
    up with the same 3 tasks (sent to it directly): FullShared's kept agent text (``prefix_reuse``) is
    state across tasks, and it reaches its steady state after ~3 tasks on a server; with one warm-up
    task a replica, which sees half the timed tasks, would still be learning when one server is not."""
    one = _bench(tmp_path / "one")
    two = _bench(tmp_path / "two", "--replicas", "2")
    assert one["completed"] == two["completed"] == 12
    assert two["tasks_on_several_replicas"] == 0  # every task served by one replica
    assert sum(two["replica_requests"]) == 12 and sum(two["replica_tasks"]) == 4
    (requests,) = (tmp_path / "two").glob("*/requests.jsonl")
    served: dict[int, set[int]] = {}
    for line in requests.read_text().splitlines():
        record = json.loads(line)
        served.setdefault(record["task"], set()).add(record["replica"])
    assert all(len(r) == 1 for r in served.values()), served
    assert one["rho"] is not None and two["rho"] == pytest.approx(one["rho"])
    assert two["supplied_tokens"] == one["supplied_tokens"]


@needs_router
def test_serve_with_a_policy_without_affinity_warns_with_the_fix(tmp_path, capfd):
    """``hf-kvshare serve --replicas 2 --router-policy round_robin``: the warning, then it serves; a
    process that exits stops the rest (the router here)."""
    import threading

    template = Server(tmp_path, None, port=_free_run(4), python=_standin_python(tmp_path))
    group = rp.replicate(template, 2, policy="round_robin")
    codes = []
    thread = threading.Thread(target=lambda: codes.append(rp.run(group, timeout=60)))
    thread.start()
    deadline = time.monotonic() + 60
    while not group.running() and time.monotonic() < deadline:
        time.sleep(0.2)
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{group.url}/health", timeout=2)
            break
        except OSError:
            time.sleep(0.2)
    servers = [s.process.pid for s in group.servers]
    group.router.process.terminate()
    thread.join(30)
    assert codes == [1]
    err = capfd.readouterr().err
    assert "warning: router policy 'round_robin' has no session affinity" in err
    assert "--policy consistent_hash" in err and "X-Session-ID: <task>" in err
    time.sleep(1)
    assert not any(_alive(p) for p in servers)

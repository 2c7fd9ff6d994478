"""The serving lane's live vLLM server (vLLM's OpenAI server with the connector, on 127.0.0.1), written
once for its test modules: :func:`start_server` starts a module's server, :func:`stopped_after` stops it
after the module (a fixture's body; :func:`embedded_server` the embedded model's) and :func:`post` sends it a request; :func:`has_vllm` says whether a
Python has vLLM (the live tests' skip condition)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


@functools.cache
def has_vllm(python: str) -> bool:
    """Whether ``python`` can import vLLM: this interpreter answers in-process, another one (the serving
    lane's ``$HF_KVSHARE_VLLM_PYTHON``) through one probe per test process, not one per module."""
    if python == sys.executable:
        return importlib.util.find_spec("vllm") is not None
    if not Path(python).exists():
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0


#: vLLM's arguments for a test's server: small, float32 (exact comparisons)
TEST_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "2"]


def start_server(
    folder: Path,
    model: str,
    method: str,
    options: dict[str, Any],
    *,
    max_bytes: int,
    vllm_args: Sequence[str] = (),
    eager: bool = True,
    name: str = "vllm",
    in_process: bool = True,
) -> Any:
    """A server of ``model`` (an embedded model's name: served from the folder hf_kvshare writes) with
    ``method`` and ``options``, started and ready (~1-2 min on 2 CPUs; the log's tail printed when it
    never is): :data:`TEST_ARGS` plus ``vllm_args`` (and ``--enforce-eager`` where ``eager``), its log ``folder/<name>.log``, each recorded
    request's report line in ``server.reports`` (``folder/<name>.reports.jsonl``), vLLM's development
    endpoints on (``POST /reset_prefix_cache``); ``in_process=False``: the connector's K/V handoff off."""
    from hf_kvshare.serving.connector import REPORTS_ENV
    from hf_kvshare.serving.models import served_model_dir
    from hf_kvshare.serving.server import Server

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log, reports = folder / f"{name}.log", folder / f"{name}.reports.jsonl"
    srv = Server(
        served_model_dir(model),
        method,
        options,
        vllm_args=[*TEST_ARGS, *(["--enforce-eager"] if eager else []), *vllm_args],
        max_bytes=max_bytes,
        log=log,
        in_process=in_process,
        env={REPORTS_ENV: str(reports), "VLLM_SERVER_DEV_MODE": "1"},
    )
    srv.reports = reports
    srv.start()
    try:
        srv.wait_ready(timeout=480)
    except RuntimeError:
        srv.stop()
        print(log.read_text()[-4000:])
        raise
    return srv


def stopped_after(srv: Any) -> Iterator[Any]:
    """A module fixture's body (``yield from stopped_after(start_server(...))``): the server for the
    module, stopped after it, nothing left running."""
    try:
        yield srv
    finally:
        process = srv.process
        srv.stop()
    assert process.returncode is not None  # stopped: nothing left running


#: the embedded model's server of ``test_serving_vllm.py`` and ``test_agent_frameworks.py``: FullShared with
#: prefix reuse, its store bounded by ``EMBEDDED_MAX_BYTES``
EMBEDDED_METHOD = "fullshared"
EMBEDDED_OPTIONS = {"prefix_reuse": True}
EMBEDDED_MAX_BYTES = 64 << 20


def embedded_server(folder: Path) -> Iterator[Any]:
    """A module fixture's body: the embedded model's server (:data:`EMBEDDED_METHOD`) for the module."""
    yield from stopped_after(
        start_server(folder, "smollm2-135m", EMBEDDED_METHOD, EMBEDDED_OPTIONS, max_bytes=EMBEDDED_MAX_BYTES)
    )


def post(server: Any, path: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, Any]:
    """``POST`` ``body`` as JSON to the server's ``path``: the status and the decoded reply."""
    request = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def reset_prefix_cache(server: Any, tries: int = 20) -> tuple[int, Any]:
    """Empty vLLM's prefix cache (``POST /reset_prefix_cache``, a development endpoint), retried while it
    fails (it does while blocks are held); every answer must be a 200. The last answer's status and reply
    (``reply["success"]``: emptied)."""
    for _ in range(tries):
        status, reset = post(server, "/reset_prefix_cache", {})
        assert status == 200, reset
        if reset.get("success"):
            break
        time.sleep(0.5)
    return status, reset


def report_lines(server: Any, n: int, timeout: float = 120.0) -> list[dict[str, Any]]:
    """The connector's report lines (``$HF_KVSHARE_REPORTS``, ``server.reports``) once there are ``n`` of
    them, or what there is after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.reports.read_text() if server.reports.exists() else ""
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)

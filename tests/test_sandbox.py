"""The HumanEval sandbox cannot be fooled into a pass, escapes neither its directory, the network nor
its timeout, and keeps bounded output (issue 13, item 8)."""

import os
import random
import resource
import socket
import time

import pytest

from hf_kvshare.bench import checkers
from hf_kvshare.bench.sandbox import isolation_unavailable, run_python

PROBLEM = {
    "task_id": "toy/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}
ISOLATION = isolation_unavailable()
needs_isolation = pytest.mark.skipif(
    ISOLATION is not None, reason=f"sandbox isolation unavailable: {ISOLATION}"
)
MODES = [pytest.param(True, marks=needs_isolation, id="isolated"), pytest.param(False, id="unisolated")]


def humaneval(completion: str) -> str:
    return checkers.humaneval_program(PROBLEM, completion)


@pytest.mark.parametrize("isolate", MODES)
def test_a_correct_solution_passes_and_a_wrong_one_fails(isolate):
    good = run_python(humaneval("    return a + b\n"), isolate=isolate)
    assert good.passed and good.status == "passed" and good.isolated == isolate
    bad = run_python(humaneval("    return a - b\n"), isolate=isolate)
    assert not bad.passed and bad.status == "failed" and "AssertionError" in bad.detail


@pytest.mark.parametrize("isolate", MODES)
@pytest.mark.parametrize(
    "escape",
    [
        "import sys\n    sys.exit(0)",
        "import os\n    os._exit(0)",
        "raise SystemExit(0)",
        "import signal, posix\n    posix.kill(posix.getpid(), signal.SIGKILL)",
    ],
)
def test_exiting_before_the_asserts_is_a_failure(isolate, escape):
    result = run_python(humaneval(f"    {escape}\n"), isolate=isolate)
    assert not result.passed and result.status == "failed", result


@needs_isolation
@pytest.mark.parametrize(
    "attack",
    [
        "import posix\nposix.unlink({victim!r})",
        "import importlib, os\nimportlib.reload(os)\nos.remove({victim!r})",
        "import ctypes\nassert ctypes.CDLL(None).unlink({victim!r}.encode()) == 0",
        "open({new!r}, 'w').write('x')",
        "import ctypes, os\nfd = ctypes.CDLL(None).open({new!r}.encode(), os.O_CREAT | os.O_WRONLY, 0o644)\nassert fd >= 0",
        "import ctypes\nassert ctypes.CDLL(None).mount(None, b'/', None, 32 | 4096, None) == 0\nopen({new!r}, 'w')",
    ],
)
def test_files_outside_the_sandbox_are_neither_deleted_nor_created(tmp_path, attack):
    victim, new = tmp_path / "victim.txt", tmp_path / "created.txt"
    victim.write_text("keep me")
    result = run_python(attack.format(victim=str(victim), new=str(new)) + "\n")
    assert not result.passed and result.isolated
    assert victim.read_text() == "keep me" and not new.exists()


@needs_isolation
def test_the_network_is_unreachable():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    try:
        result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
        assert not result.passed and "unreachable" in result.detail, result
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def _alive(marker: str) -> list[int]:
    alive = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        alive.append(int(name))
            except OSError:
                pass
    return alive


@pytest.mark.parametrize("isolate", MODES)
@pytest.mark.parametrize("parent", ["hangs", "returns"])
def test_a_setsid_child_ends_with_the_run(isolate, parent):
    marker = f"{random.randint(10**6, 10**7)}.{random.randint(10**5, 10**6)}"
    program = (
        "import posix, time\n"
        "if posix.fork() == 0:\n"
        "    posix.setsid()\n"
        "    if posix.fork() == 0:\n"
        f"        posix.execv('/bin/sleep', ['sleep', {marker!r}])\n"
        "    posix._exit(0)\n"
        "time.sleep(0.5)\n" + ("time.sleep(60)\n" if parent == "hangs" else "")
    )
    start = time.monotonic()
    result = run_python(program, timeout=2.0, isolate=isolate)
    elapsed = time.monotonic() - start
    assert elapsed < 6.0, elapsed
    assert result.status == ("timeout" if parent == "hangs" else "passed"), result
    for _ in range(20):  # SIGKILL is asynchronous
        if not _alive(marker):
            break
        time.sleep(0.05)
    assert _alive(marker) == []


@pytest.mark.parametrize("isolate", MODES)
def test_an_output_flood_keeps_memory_bounded(isolate):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    program = "import os\nwhile True:\n    os.write(2, b'x' * 65536)\n    os.write(1, b'y' * 65536)\n"
    result = run_python(program, timeout=2.0, output_limit=4096, isolate=isolate)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
    assert result.status == "timeout"
    assert result.output_bytes > 64 * 2**20, result.output_bytes  # the flood really happened
    assert len(result.stderr) == len(result.stdout) == 4096
    assert grown < 32 * 1024, grown


@needs_isolation
def test_process_count_is_limited():
    program = (
        "import posix, time\nn = 0\ntry:\n    while n < 1000:\n        if posix.fork() == 0:\n"
        "            time.sleep(5)\n            posix._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print('forks', n, e.errno)\n"
    )
    result = run_python(program, timeout=4.0)
    assert result.passed, result
    forks = int(result.stdout.split()[1])
    assert forks < 64, result.stdout


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="timeout"):
        run_python("pass", timeout=0)
    with pytest.raises(ValueError, match="isolate"):
        run_python("pass", isolate="yes")

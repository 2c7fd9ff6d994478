"""The sandbox's launcher and checker: :mod:`.execute` starts this file by path with ``python -I``
(never imported; stdlib only) as ``python -I launcher.py CONFIG.json``, isolated or not.

It starts two processes and decides the verdict from what only it and the checker see:

- the **candidate** runs :mod:`.runner` on the program (the generated code, without the tests),
  with the limits, the guard and (where the kernel has it) a seccomp filter that refuses AF_UNIX
  sockets and io_uring; it has stdout/stderr and two pipes to the checker, nothing else;
- the **checker** is forked from this process and never runs the program's code: it executes the
  trusted test code (and the trusted ``context``, e.g. a HumanEval prompt's helpers) in its own
  interpreter, where the program's functions are stand-ins that send the arguments to the candidate
  and decode the returned *data* (plain built-in values). It is not dumpable (no ptrace, no
  ``/proc/PID/mem``, ``/proc/PID/fd``) and, isolated, runs as its own user (:data:`CHECKER_UID`),
  so the candidate can neither read nor change its memory, nor signal it.

The verdict is the launcher's exit status: 0 when the checker exited 0 (the tests ran to their end,
the channel to the candidate intact), 1 otherwise, 124 at the timeout, 3 over the disk quota,
125 (with ``sandbox setup failed: ...`` on stderr) when the sandbox could not be set up. No token or
secret exists anywhere; what the checker writes to the report descriptor (``{"passed", "detail"}``)
is only the explanation.

**Isolated** (root; started under ``unshare --net --mount --pid --fork``): a fresh root on a tmpfs
holding only ``/usr`` (and the other system directories), the interpreter's prefix with every
``site-packages`` / ``dist-packages`` and any given directory (the checkout, ``$HOME``, dataset
caches) covered by an empty tmpfs, ``/dev/{null,zero,random,urandom}``, a new ``/proc`` and a
``/tmp`` that is a private tmpfs of ``disk_bytes`` (the disk quota), root's and read-only to the
program but for ``/tmp/work`` (:data:`ISOLATED_WORKDIR`: the program's working, home and temporary
directory; the runner and the program beside it are root's, read-only); every mount read-only,
nosuid, nodev except ``/tmp``. The launcher ``chroot``\\s
into it, then the candidate drops to ``nobody`` (no groups, ``no_new_privs``, no capabilities).
The launcher is PID 1 of the namespace: when it exits, every process left in it is killed.

**Unisolated**: the process started first is a *guard* (:func:`_guard`): a non-dumpable child
subreaper that forks the launcher proper and waits for it, then kills whatever is left of the tree,
so a program that SIGKILLs the launcher leaves no orphan (the candidate and the checker also die
with the launcher: ``PR_SET_PDEATHSIG``). The launcher makes itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``) and non-dumpable too, so every orphan of the candidate (a double-forked ``setsid`` child, whatever its
environment) is re-parented to it and killed with the rest of the tree when the checker is done,
at the timeout or over the quota; the quota is ``RLIMIT_FSIZE`` per file plus the total bytes of
the private directory, checked every 20 ms and at the end.
"""

import ctypes
import json
import os
import platform
import resource
import runpy
import signal
import sys
import time
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = (
    1,
    4,
    22,
    36,
    38,
)
PASSED, FAILED, QUOTA, TIMEOUT, SETUP_FAILED = 0, 1, 3, 124, 125
#: uid/gid the checker runs as, isolated (distinct from the candidate's ``nobody``)
CHECKER_UID = 65533
#: the isolated program's working, home and temporary directory (``TMPDIR``): the one place it writes
ISOLATED_WORKDIR = "/tmp/work"
_POLL = 0.02

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _mount(source, target, fstype, flags, data=None) -> None:
    args = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    if _libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x}): {os.strerror(errno)}")


def _prctl(option, value) -> None:
    if (
        _libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        != 0
    ):
        errno = ctypes.get_errno()
        raise SetupError(f"prctl({option}, {value}): {os.strerror(errno)}")


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the launcher that forked it) ends, even by SIGKILL
    (``PR_SET_PDEATHSIG``; set after any change of user, which clears it); if the launcher is
    already gone, end now."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(FAILED)


# --- the isolated root ------------------------------------------------------------------------------


def _mount_points() -> list[tuple[str, set[str]]]:
    """``(mount point, per-mount options)`` of every mount, from ``/proc/self/mountinfo``."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")
            points.append((point, set(fields[5].split(","))))
    return points


def _inside(path: str, top: str) -> bool:
    return path != top and path.startswith(top.rstrip("/") + "/")


def _setup_root(config: dict, runner_source: str) -> None:
    """Build the fresh root (see the module docstring) and ``chroot`` into it."""
    os.umask(0o022)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = os.path.join(config["base"], "root")
    os.mkdir(root)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    # /tmp first: an interpreter or venv that lives under /tmp (CI clones, pip's temporary venvs) is then
    # bound inside the private tmpfs instead of making the mount point exist before it
    os.makedirs(root + "/tmp")
    uid = config["uid"]
    _mount(
        "tmpfs",
        root + "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={config['disk_bytes']},nr_inodes=8192,mode=0755",  # root's: the program writes only in work/
    )
    for link, target in config["links"]:
        os.symlink(target, root + link)
    for path in config["binds"]:
        dest = root + path
        if os.path.isdir(path):
            os.makedirs(dest, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            open(dest, "w").close()
        _mount(path, dest, None, MS_BIND | MS_REC)
    for path in config["hide"]:
        if any(_inside(path, top) for top in config["binds"]) and os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=0755,size=4k")
    os.makedirs(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=4k")
    for device in config["devices"]:
        open(root + device, "w").close()
        _mount(device, root + device, None, MS_BIND)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name, text in (("runner.py", runner_source), ("program.py", config["program"])):
        with open(os.path.join(root, "tmp", name), "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(os.path.join(root, "tmp", name), 0o444)  # root's, read-only: the program cannot change them
    os.mkdir(root + ISOLATED_WORKDIR, 0o700)  # the program's private working, home and temporary directory
    os.chown(root + ISOLATED_WORKDIR, uid, config["gid"])
    os.chdir(root)
    _mount(root, "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")
    for point, options in _mount_points():
        if point in ("/tmp", "/proc"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        if point not in config["devices"]:
            flags |= MS_NODEV
        if "noexec" in options:
            flags |= MS_NOEXEC
        _mount(None, point, None, flags)


# --- seccomp: no AF_UNIX sockets, no io_uring ---------------------------------------------------------


class _Filter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


_ARCH = {
    "x86_64": (0xC000003E, 41, 425),
    "aarch64": (0xC00000B7, 198, 425),
}  # audit arch, socket, io_uring_setup


def _seccomp() -> None:
    """Refuse ``socket(AF_UNIX, ...)`` (EACCES) and ``io_uring_setup`` (EPERM); kill other ABIs."""
    machine = platform.machine()
    if machine not in _ARCH:
        raise SetupError(f"no seccomp filter for {machine}")
    arch, nr_socket, nr_uring = _ARCH[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    eacces, eperm = 0x00050000 | 13, 0x00050000 | 1
    code = [
        (ld, 0, 0, 4),  # 0: arch
        (jeq, 1, 0, arch),  # 1
        (ret, 0, 0, kill),  # 2
        (ld, 0, 0, 0),  # 3: syscall number
        (jge, 0, 1, 0x40000000),  # 4: x32
        (ret, 0, 0, eperm),  # 5
        (jeq, 0, 1, nr_uring),  # 6
        (ret, 0, 0, eperm),  # 7
        (jeq, 0, 3, nr_socket),  # 8 -> 12
        (ld, 0, 0, 16),  # 9: args[0], low half
        (jeq, 0, 1, 1),  # 10: AF_UNIX
        (ret, 0, 0, eacces),  # 11
        (ret, 0, 0, allow),  # 12
    ]
    filters = (_Filter * len(code))(*[_Filter(*item) for item in code])
    program = _Program(len(code), filters)
    if _libc.prctl(
        PR_SET_SECCOMP, ctypes.c_ulong(2), ctypes.byref(program), ctypes.c_ulong(0), ctypes.c_ulong(0)
    ):
        raise SetupError(f"seccomp filter: {os.strerror(ctypes.get_errno())}")


# --- the two processes ------------------------------------------------------------------------------


def _close_all_but(keep) -> None:
    start = 3
    for fd in sorted(set(keep)):
        if fd >= start:
            os.closerange(start, fd)
            start = fd + 1
    os.closerange(start, 65536)


def _null_stdio(fds) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        os.dup2(null, fd)
    os.close(null)


def _candidate(config: dict, requests: int, replies: int, workdir: str, isolated: bool) -> None:
    """In the forked child: limits, user, filter, then exec the runner (never returns)."""
    try:
        _null_stdio([0])
        _close_all_but([requests, replies])
        os.set_inheritable(requests, True)
        os.set_inheritable(replies, True)
        os.chdir(workdir)
        for name, value in config["limits"].items():
            try:
                resource.setrlimit(getattr(resource, name), (value, value))
            except (ValueError, OSError):
                if isolated:
                    raise
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if isolated:
            os.setgroups([])
            os.setgid(config["gid"])
            os.setuid(config["uid"])  # from root to a non-zero uid: every capability is dropped
            if os.getuid() == 0 or os.geteuid() == 0:
                raise SetupError("still root after setuid")
        _die_with(config["launcher_pid"])
        try:
            _seccomp()
        except SetupError:
            if isolated:
                raise
        env = dict(config["env"], HOME=workdir, TMPDIR=workdir)
        code = "/tmp" if isolated else workdir  # isolated: beside the work directory, read-only
        runner, program = os.path.join(code, "runner.py"), os.path.join(code, "program.py")
        os.execve(
            config["python"],
            [config["python"], "-I", "-B", runner, str(requests), str(replies), program],
            env,
        )
    except BaseException as error:  # noqa: BLE001 - anything here is a set-up failure
        os.write(2, f"sandbox setup failed: {error}\n".encode())
    os._exit(SETUP_FAILED)


class _Broken(BaseException):
    """The channel to the candidate broke (it died, hung up or sent garbage): never a pass."""


def _check(config: dict, codec: dict, requests: int, replies: int, report: int) -> int:
    """The checker (in the forked child): run the tests against the candidate; its exit status."""
    import builtins
    import importlib

    send, receive, encode, decode = codec["send"], codec["receive"], codec["encode"], codec["decode"]
    ProtocolError = codec["ProtocolError"]
    job = config["job"]
    broken: list[str] = []

    def finish(passed: bool, detail: str) -> int:
        try:
            os.write(report, (json.dumps({"passed": passed, "detail": detail[:2000]}) + "\n").encode())
        except OSError:
            pass
        return PASSED if passed else FAILED

    def fetch():
        try:
            message = receive(replies)
        except (ProtocolError, OSError) as error:
            broken.append(f"bad message from the program: {error}")
            raise _Broken(broken[-1]) from None
        if message is None or type(message) is not dict:
            broken.append("the program ended (or hung up) before it answered")
            raise _Broken(broken[-1])
        return message

    class Remote:
        """A stand-in for the program's function ``name``: the call runs in the candidate."""

        def __init__(self, name: str):
            self.__name__ = name

        def __repr__(self) -> str:
            return f"<the program's {self.__name__}>"

        def __call__(self, *args, **kwargs):
            if broken:
                raise _Broken(broken[0])
            message = {"call": self.__name__, "args": encode(list(args)), "kwargs": encode(dict(kwargs))}
            try:
                send(requests, message)
            except OSError:
                broken.append("the program ended before a call")
                raise _Broken(broken[-1]) from None
            reply = fetch()
            if reply.get("kind") == "return":
                try:
                    return decode(reply.get("value"))
                except ProtocolError as error:
                    broken.append(f"bad value from the program: {error}")
                    raise _Broken(broken[-1]) from None
            if reply.get("kind") == "raised":
                name, text = str(reply.get("type")), str(reply.get("message"))[:2000]
                cls = getattr(builtins, name, None)
                if (
                    isinstance(cls, type)
                    and issubclass(cls, Exception)
                    and not issubclass(cls, (StopIteration, StopAsyncIteration))
                ):
                    try:
                        error = cls(text)
                    except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError wants five arguments
                        error = RuntimeError(f"{name}: {text}")
                else:
                    error = RuntimeError(f"{name}: {text}")
                raise error
            broken.append(f"unknown reply kind {reply.get('kind')!r}")
            raise _Broken(broken[-1])

    try:
        first = fetch()
    except _Broken as error:
        return finish(False, str(error))
    if first.get("kind") == "error":
        return finish(False, f"the program raised before it finished: {str(first.get('error'))[:1500]}")
    if first.get("kind") != "ready" or type(first.get("names")) is not dict:
        return finish(False, "the program did not report that it finished")
    if job.get("test") is None:
        return finish(True, "")
    namespace = {"__name__": "__check__", "__builtins__": builtins}
    entry_point = job.get("entry_point")
    for name, entry in first["names"].items():
        # with an entry point, the tests get that function alone from the program (the rest from the
        # trusted context); never a name that would shadow a builtin the tests call (``abs``, ``len``)
        if type(name) is not str or not name.isidentifier() or type(entry) is not dict:
            continue
        if entry_point is not None or hasattr(builtins, name):
            continue
        if "callable" in entry:
            namespace[name] = Remote(name)
        elif "module" in entry:
            module = str(entry["module"])
            if module.split(".")[0] in sys.stdlib_module_names:
                try:
                    namespace[name] = importlib.import_module(module)
                except Exception:  # noqa: BLE001 - the test fails on the missing name
                    pass
        elif "value" in entry:
            try:
                namespace[name] = decode(entry["value"])
            except ProtocolError:
                pass
    try:
        if job.get("context"):
            exec(compile(job["context"], "<context>", "exec"), namespace)
        if entry_point:
            if "callable" not in first["names"].get(entry_point, {}):
                return finish(False, f"the program does not define a function {entry_point!r}")
            namespace[entry_point] = Remote(entry_point)
        exec(compile(job["test"], "<test>", "exec"), namespace)
    except BaseException as error:  # noqa: BLE001 - every way out of the tests but their end fails
        if broken:
            return finish(False, broken[0])
        lines = traceback.format_exception_only(type(error), error)
        return finish(False, "".join(lines).strip()[-1500:] or type(error).__name__)
    if broken:
        return finish(False, broken[0])
    return finish(True, "")


def _checker(config, codec, requests, replies, report, isolated) -> None:
    code = FAILED
    try:
        _null_stdio([0, 1, 2])
        _close_all_but([requests, replies, report])
        for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_CORE"):
            if name in config["limits"]:
                value = config["limits"][name]
                resource.setrlimit(getattr(resource, name), (value, value))
        if isolated:
            os.setgroups([])
            os.setgid(CHECKER_UID)
            os.setuid(CHECKER_UID)
        _die_with(config["launcher_pid"])
        _prctl(PR_SET_DUMPABLE, 0)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        code = _check(config, codec, requests, replies, report)
    except BaseException as error:  # noqa: BLE001
        try:
            os.write(
                report, (json.dumps({"passed": False, "detail": f"checker: {error}"[:2000]}) + "\n").encode()
            )
        except OSError:
            pass
        code = FAILED
    os._exit(code)


# --- the tree -----------------------------------------------------------------------------------------


def _children_of(parent: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                line = f.read()
        except OSError:
            continue
        if int(line[line.rindex(b")") + 2 :].split()[1]) == parent:
            found.append(int(name))
    return found


def _descendants_of(root: int) -> set[int]:
    found, todo = set(), [root]
    while todo:
        for child in _children_of(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_tree() -> None:
    """SIGKILL every descendant until none is left (orphans come back to this subreaper)."""
    me, until = os.getpid(), time.monotonic() + 5.0
    while time.monotonic() < until:
        doomed = _descendants_of(me)
        if not doomed:
            break
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)
        _reap()
    _reap()


def _disk_usage(top: str) -> int:
    total, todo = 0, [top]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += max(info.st_size, info.st_blocks * 512)
            if entry.is_dir(follow_symlinks=False):
                todo.append(entry.path)
    return total


def _guard(report: int) -> None:
    """Unisolated: fork the launcher proper and return in it; this process (a subreaper too) only
    waits for it. However the launcher ends (its verdict, or a SIGKILL from the program), every
    process left of the tree (the candidate and checker die with the launcher by
    ``PR_SET_PDEATHSIG``; their orphans, a double-forked ``setsid`` child with an empty
    environment, are re-parented here) is killed before this process exits with the launcher's
    status (``FAILED`` when a signal ended it)."""
    launcher = os.fork()
    if launcher == 0:
        return
    os.close(report)  # the launcher's; the parent then sees the report end when the launcher ends
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(launcher, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            status = 1 << 8
            break
    _kill_tree()
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else FAILED)


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    os.remove(sys.argv[1])  # it holds the tests: gone before any program runs (its directory is readable)
    isolated = config["mode"] == "isolated"
    report = config["report_fd"]
    try:
        codec = runpy.run_path(config["runner"], run_name="hfkv_sandbox_wire")
        with open(config["runner"], encoding="utf-8") as f:
            runner_source = f.read()
        if isolated:
            _setup_root(config, runner_source)
            workdir = ISOLATED_WORKDIR
        else:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
            _prctl(PR_SET_DUMPABLE, 0)
            _guard(report)  # returns in the launcher proper, a child of the guard
            os.setpgid(0, 0)  # a group of its own: the program's killpg(0, ...) does not reach the guard
            _prctl(PR_SET_CHILD_SUBREAPER, 1)  # not inherited across fork
            _prctl(PR_SET_DUMPABLE, 0)
            workdir = config["workdir"]
    except (OSError, SetupError) as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        os._exit(SETUP_FAILED)
    config["launcher_pid"] = os.getpid()
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    candidate = os.fork()
    if candidate == 0:
        _candidate(config, requests_r, replies_w, workdir, isolated)
    checker = os.fork()
    if checker == 0:
        _checker(config, codec, requests_w, replies_r, report, isolated)
    for fd in (requests_r, requests_w, replies_r, replies_w, report):
        os.close(fd)
    deadline = time.monotonic() + config["timeout"]
    verdict = None
    while verdict is None:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid, status = 0, 0
        if pid == checker:
            verdict = PASSED if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else FAILED
        elif pid == 0:
            if time.monotonic() > deadline:
                verdict = TIMEOUT
            elif not isolated and _disk_usage(workdir) > config["disk_bytes"]:
                verdict = QUOTA
            else:
                time.sleep(_POLL)
    if not isolated:
        _kill_tree()
        if verdict == PASSED and _disk_usage(workdir) > config["disk_bytes"]:
            verdict = QUOTA
    os._exit(verdict)  # isolated: PID 1 of the namespace exits, the kernel kills the rest


if __name__ == "__main__":
    main()

"""The sandbox's namespace launcher: :mod:`.execute` starts this file by path with ``python -I`` (never
imported; stdlib only), as root inside fresh network, mount and PID namespaces (``unshare --net
--mount --pid --fork --mount-proc``).

``python -I launcher.py CONFIG.json`` makes every mount read-only, nosuid and nodev
except the sandbox directory (its own writable bind mount) and ``/dev/{null,zero,random,urandom}``;
where a directory on the way to the interpreter is closed to other users (``/root`` for a pyenv
install) it is covered with an empty tmpfs and only the interpreter's directories are bound back
(the rest of it is hidden). It then forks: the child sets the resource limits, drops to the
unprivileged user (``no_new_privs``, no groups, no capabilities: it cannot undo any of this) and
execs the runner; the parent (PID 1 of the namespace) waits and exits with the child's status,
which ends every process left in the namespace. Exit status 125 with a message on stderr: the
sandbox could not be set up.
"""

import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data=None) -> None:
    args = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    if _libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x}): {os.strerror(errno)}")


def _mount_points() -> list[tuple[str, set[str]]]:
    """``(mount point, per-mount options)`` of every mount, from ``/proc/self/mountinfo``."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")
            points.append((point, set(fields[5].split(","))))
    return points


def _setup(config: dict) -> None:
    os.umask(0o022)
    sandbox = config["sandbox"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    keep = {sandbox}
    _mount(sandbox, sandbox, None, MS_BIND)
    for device in config["devices"]:
        _mount(device, device, None, MS_BIND)
        keep.add(device)
    for i, (top, needed) in enumerate(config["covers"]):
        stages = []
        for j, path in enumerate(needed):
            stage = os.path.join(sandbox, f".stage{i}-{j}")
            os.mkdir(stage)
            _mount(path, stage, None, MS_BIND | MS_REC)
            stages.append(stage)
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        for stage, path in zip(stages, needed):
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(stage, path, None, MS_MOVE)
            os.rmdir(stage)
    for point, options in _mount_points():
        if point in keep:
            flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if point in config["devices"] else MS_NODEV)
        else:
            flags = (
                MS_REMOUNT
                | MS_BIND
                | MS_RDONLY
                | MS_NOSUID
                | MS_NODEV
                | (MS_NOEXEC if "noexec" in options else 0)
            )
        try:
            _mount(None, point, None, flags)
        except OSError as error:
            if not os.path.exists(point):  # hidden under a cover
                continue
            raise error
    os.chdir(sandbox)


def _drop(config: dict) -> None:
    for name, value in config["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.setgroups([])
    os.setgid(config["gid"])
    os.setuid(config["uid"])  # from root to a non-zero uid: every capability is dropped
    if os.getuid() == 0 or os.geteuid() == 0:
        raise OSError("still root after setuid")


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    try:
        _setup(config)
    except OSError as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        os._exit(SETUP_FAILED)
    pid = os.fork()
    if pid == 0:
        try:
            _drop(config)
            os.execve(config["python"], config["argv"], config["env"])
        except OSError as error:
            print(f"sandbox setup failed: {error}", file=sys.stderr)
        os._exit(SETUP_FAILED)
    while True:
        waited, status = os.waitpid(-1, 0)
        if waited == pid:
            break
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()

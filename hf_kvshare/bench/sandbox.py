"""Run untrusted generated Python in a separate process with a timeout and resource limits.

Used for HumanEval pass@1 (opt-in with ``--execute``). The program runs in a fresh interpreter
(``python -I``: no user site, no ``PYTHON*`` variables) in an empty temporary directory, with an
empty environment, in its own process group (killed as a whole on timeout), with address-space,
CPU-time, file-size and open-file limits, and with the destructive ``os`` / ``shutil`` /
``subprocess`` functions disabled before the program starts. This is a guard against accidents
in model-written code, not a security boundary against hostile code: run it on a machine you
do not mind, as the HumanEval authors advise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_GUARD = """\
import builtins, os, shutil, subprocess, sys
for _name in ("kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid",
              "fork", "forkpty", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown",
              "chmod", "chown", "chroot", "lchown", "execv", "execve", "spawnv", "popen"):
    if hasattr(os, _name):
        setattr(os, _name, None)
shutil.rmtree = shutil.move = shutil.chown = None
subprocess.Popen = None
builtins.exit = builtins.quit = None
del _name
"""


@dataclass
class ExecutionResult:
    passed: bool
    status: str  # "passed", "failed", "timeout"
    detail: str = ""  # tail of stderr for failures


def run_python(program: str, timeout: float = 10.0, memory_mb: int = 1024) -> ExecutionResult:
    """Run ``program`` in a sandboxed interpreter; passed = exit status 0 within ``timeout`` seconds."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    with tempfile.TemporaryDirectory(prefix="hfkv-exec-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_GUARD + "\n" + program + "\n")

        def limits() -> None:  # runs in the child before exec
            import resource

            cpu = int(timeout) + 1
            for limit, value in (
                (resource.RLIMIT_AS, memory_mb * 2**20),
                (resource.RLIMIT_CPU, cpu),
                (resource.RLIMIT_FSIZE, 16 * 2**20),
                (resource.RLIMIT_NOFILE, 64),
            ):
                try:
                    resource.setrlimit(limit, (value, value))
                except (ValueError, OSError):
                    pass

        proc = subprocess.Popen(
            [sys.executable, "-I", path],
            cwd=tmp,
            env={"PATH": os.defpath, "PYTHONHASHSEED": "0"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=limits if os.name == "posix" else None,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return ExecutionResult(False, "timeout", f"no result within {timeout:g} s")
        if proc.returncode == 0:
            return ExecutionResult(True, "passed")
        tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
        return ExecutionResult(False, "failed", " | ".join(tail))


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the (still running, not yet reaped) child's process group: its id cannot have been reused."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        pass

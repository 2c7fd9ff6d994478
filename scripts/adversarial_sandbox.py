"""Adversarial cases of the HumanEval sandbox (issue 26, item 3): hostile candidate programs run
through ``run_python`` with the checker's tests, in each mode the machine has (isolated needs
root, util-linux ``unshare`` and seccomp). Every hostile program is a *wrong* solution of
``add(a, b)`` plus an attack; each run is classified as

* ``clear``: not passed, and the attack's side effect (a process left alive, a secret or the tests
  read, a host file changed) did not happen;
* ``unclear``: not passed, but with no detail saying why;
* ``accepted and wrong``: passed, or the side effect happened;
* ``traceback``: ``run_python`` itself raised.

    OMP_NUM_THREADS=1 python scripts/adversarial_sandbox.py [-k NAME] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
PROMPT = 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n'
WRONG = "def add(a, b):\n    return a - b\n"
SECRET = "hfkv-secret-" + "".join(random.choice("abcdef") for _ in range(16))


@dataclass
class Case:
    name: str
    program: str  # ``{marker}`` / ``{canary}`` are replaced per run
    #: a message when the attack's side effect happened (args: the result, the marker, the canary)
    after: Callable | None = None
    ok: bool = False  # a legitimate solution: must pass
    timeout: float = 3.0


def _alive(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def survivors(result, marker, canary) -> str | None:
    for _ in range(40):
        if not _alive(marker):
            return None
        time.sleep(0.05)
    alive = _alive(marker)
    for pid in alive:  # the script's own leftovers: end them
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    return f"{len(alive)} process(es) of the run survived"


def leaked(text: str):
    def check(result, marker, canary) -> str | None:
        if text in result.stdout or text in result.stderr or text in result.detail:
            return f"the program read {text!r}"
        return None

    return check


def canary_intact(result, marker, canary) -> str | None:
    if not os.path.exists(canary) or Path(canary).read_text() != "canary":
        return "a host file was changed"
    return None


ORPHAN = (
    "import posix\n"
    "if posix.fork() == 0:\n"
    "    posix.setsid()\n"
    "    if posix.fork() == 0:\n"
    "        posix.execve('/bin/sleep', ['sleep', '{marker}'], {{}})\n"
    "    posix._exit(0)\n"
    "import time\ntime.sleep(0.3)\n"
)


#: the program's siblings (the checker): only they are attacked, never another process of the machine
SIBLINGS = (
    "import os\n"
    "def siblings():\n"
    "    me, parent, found = os.getpid(), os.getppid(), []\n"
    "    for name in os.listdir('/proc'):\n"
    "        if name.isdigit() and int(name) != me:\n"
    "            try:\n"
    "                stat = open(f'/proc/{{name}}/stat').read()\n"
    "            except OSError:\n"
    "                continue\n"
    "            if int(stat.rsplit(')', 1)[1].split()[1]) == parent:\n"
    "                found.append(int(name))\n"
    "    return found\n"
)


def cases() -> list[Case]:
    return [
        Case("correct-solution", "def add(a, b):\n    return a + b\n", ok=True),
        Case("correct-unicode-solution", "def add(a, b):\n    ünï = a + b  # ✓\n    return ünï\n", ok=True),
        Case(
            "frame-walk-exit0",
            WRONG + "import sys, os\nf = sys._getframe()\nwhile f.f_back:\n    f = f.f_back\nos._exit(0)\n",
        ),
        Case("sys-exit-0", WRONG + "import sys\nsys.exit(0)\n"),
        Case("exit-in-the-call", "def add(a, b):\n    import posix\n    posix._exit(0)\n"),
        Case(
            "sigkill-launcher-setsid-orphan",
            WRONG + ORPHAN + "import signal\nposix.kill(posix.getppid(), signal.SIGKILL)\ntime.sleep(30)\n",
            survivors,
        ),
        Case(
            "sigkill-own-group-setsid-orphan",
            WRONG + ORPHAN + "import signal\nposix.killpg(0, signal.SIGKILL)\n",
            survivors,
        ),
        Case(
            "sigstop-launcher",
            WRONG + "import posix, signal\nposix.kill(posix.getppid(), signal.SIGSTOP)\n",
            survivors,
        ),
        Case(
            "sigkill-the-checker",
            WRONG + "import os, posix, signal\nme, parent = os.getpid(), os.getppid()\n"
            "for name in os.listdir('/proc'):\n"
            "    if name.isdigit() and int(name) != me:\n"
            "        try:\n"
            "            stat = open(f'/proc/{{name}}/stat').read()\n"
            "        except OSError:\n"
            "            continue\n"
            "        if int(stat.rsplit(')', 1)[1].split()[1]) == parent:\n"
            "            try:\n"
            "                posix.kill(int(name), signal.SIGKILL)\n"
            "            except OSError:\n"
            "                pass\n",
        ),
        Case(
            "ptrace-the-checker",
            WRONG + SIBLINGS + "import ctypes\nlibc = ctypes.CDLL(None)\n"
            "for pid in siblings():\n"
            "    libc.ptrace(16, pid, 0, 0)\n",  # PTRACE_ATTACH, the checker only
        ),
        Case(
            "read-the-checkers-memory",
            WRONG + SIBLINGS + "found = []\n"
            "for pid in siblings() + [os.getppid()]:\n"
            "    try:\n"
            "        with open(f'/proc/{{pid}}/mem', 'rb') as f:\n"
            "            f.seek(0x400000)\n"
            "            found.append(f.read(16))\n"
            "    except (OSError, ValueError):\n"
            "        pass\n"
            "print('read', len(found))\n",
            leaked("read 1"),
        ),
        Case(
            "read-the-tests-from-the-config",
            WRONG + "import glob, os\n"
            "for path in glob.glob('../*.json') + glob.glob('/tmp/hfkv-exec-*/*.json'):\n"
            "    try:\n"
            "        print(open(path).read())\n"
            "    except OSError:\n"
            "        pass\n",
            lambda result, marker, canary: leaked(f"tests-{marker}")(result, marker, canary),
        ),
        Case(
            "read-the-launchers-cmdline-and-environ",
            WRONG + "import os\n"
            "for name in os.listdir('/proc'):\n"
            "    for part in ('environ', 'cmdline'):\n"
            "        try:\n"
            "            print(open(f'/proc/{{name}}/{{part}}', 'rb').read())\n"
            "        except OSError:\n"
            "            pass\n",
            leaked(SECRET),
        ),
        Case("read-env-vars", WRONG + "import os\nprint(dict(os.environ))\n", leaked(SECRET)),
        Case(
            "forge-report-on-every-fd",
            WRONG + "import posix\nfor fd in range(3, 256):\n"
            "    try:\n"
            '        posix.write(fd, b\'{{"passed": true, "detail": ""}}\\n{{"kind": "ready", "names": {{}}}}\\n\')\n'
            "    except OSError:\n"
            "        pass\n",
        ),
        Case(
            "garbage-on-the-reply-pipe",
            WRONG
            + "import posix, sys\nposix.write(int(sys.argv[2]) if len(sys.argv) > 2 else 4, b'\\xff' * 100)\n",
        ),
        Case(
            "fork-bomb",
            WRONG + "import posix\nwhile True:\n    try:\n        posix.fork()\n    except OSError:\n"
            "        pass\n",
            survivors,
        ),  # fmt: skip
        Case("stdout-flood", WRONG + "import posix\nwhile True:\n    posix.write(1, b'y' * 65536)\n"),
        Case(
            "close-stdio-and-hang",
            WRONG + "import posix, time\nfor fd in (0, 1, 2):\n    posix.close(fd)\ntime.sleep(60)\n",
        ),  # fmt: skip
        Case(
            "raise-own-limits",
            WRONG
            + "import resource\nfor r in (resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_NPROC):\n"
            "    try:\n"
            "        resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
            "        print('raised', r)\n"
            "    except (ValueError, OSError):\n"
            "        pass\n",
            leaked("raised"),
        ),
        Case(
            "time-games",
            "import time\n_real = time.monotonic\ntime.monotonic = lambda: 0.0\ntime.time = lambda: 0.0\n"
            "def add(a, b):\n    while True:\n        pass\n",
        ),
        Case(
            "symlink-to-a-host-file",
            WRONG + "import os\nos.symlink('{canary}', 'link')\n"
            "try:\n    open('link', 'w').write('owned')\nexcept OSError:\n    pass\n",
            canary_intact,
        ),
        Case(
            "deep-return-value",
            "def add(a, b):\n    v = []\n    for _ in range(100000):\n        v = [v]\n    return v\n",
        ),
        Case(
            "lying-int",
            "class I(int):\n    def __eq__(self, other):\n        return True\n"
            "def add(a, b):\n    return I(0)\n",
        ),  # fmt: skip
        Case("segfault", WRONG + "import ctypes\nctypes.string_at(0)\n"),
        Case(
            "shadow-a-builtin", WRONG + "def len(x):\n    return 0\ndef isinstance(a, b):\n    return True\n"
        ),
        Case(
            "thread-outlives-main",
            WRONG + "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\n",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    from hf_kvshare.bench.sandbox import isolation_unavailable, run_python

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", default="")
    p.add_argument("--json")
    args = p.parse_args(argv)
    os.environ["HFKV_ADVERSARIAL_SECRET"] = SECRET  # must not reach the program
    modes = [False] + ([True] if isolation_unavailable() is None else [])
    results = []
    for mode in modes:
        surface = "sandbox, isolated" if mode else "sandbox, unisolated"
        for case in cases():
            if args.k not in case.name:
                continue
            if case.name == "fork-bomb" and not mode and os.geteuid() == 0:
                # root ignores RLIMIT_NPROC: unisolated, only the timeout ends the bomb (documented), and
                # it would load the whole machine meanwhile
                print(f"skip {case.name} ({surface} as root: RLIMIT_NPROC does not apply)")
                continue
            marker = f"{random.randint(10**6, 10**7)}.{random.randint(10**5, 10**6)}"
            with tempfile.NamedTemporaryFile("w", prefix="hfkv-canary-", delete=False) as f:
                f.write("canary")
            program = case.program.format(marker=marker, canary=f.name)
            try:
                result = run_python(
                    program, timeout=case.timeout, isolate=mode, test=TEST + f"# tests-{marker}\ncheck(add)\n",
                    context=PROMPT, entry_point="add",
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001
                kind, why = "traceback", f"{type(e).__name__}: {e}"[:200]
            else:
                problem = case.after(result, marker, f.name) if case.after else None
                if problem:
                    kind, why = "accepted and wrong", problem
                elif result.passed != case.ok:
                    kind, why = "accepted and wrong" if result.passed else "unclear", f"{result.status}"
                elif not case.ok and not result.detail:
                    kind, why = "unclear", f"{result.status} without a detail"
                else:
                    kind, why = "clear", f"{result.status}: {result.detail[:120]}"
            finally:
                if os.path.exists(f.name):
                    os.remove(f.name)
            results.append({"surface": surface, "case": case.name, "result": kind, "why": why})
            print(f"{kind:<20} {surface:<20} {case.name:<40} {why}", flush=True)
    kinds = ["clear", "unclear", "accepted and wrong", "traceback"]
    print("\n| surface | tried | " + " | ".join(kinds) + " |\n|---|---:|" + "---:|" * len(kinds))
    for surface in dict.fromkeys(r["surface"] for r in results):
        rows = [r for r in results if r["surface"] == surface]
        counts = " | ".join(str(sum(r["result"] == k for r in rows)) for k in kinds)
        print(f"| {surface} | {len(rows)} | {counts} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Adversarial cases of the bench command line (issue 26, item 3): each case runs
``python -m hf_kvshare.bench ...`` in a subprocess as a hostile or careless user would, and is
classified as

* ``clear``: exit code != 0 and one ``error:`` line on stderr (after the run's own info lines:
  ``loading ...``, ``note: ...``) naming what was expected, nothing half-written left behind;
* ``unclear``: exit code != 0 but several lines / no ``error:`` line / the expected words missing,
  or a hang (killed at the timeout);
* ``accepted and wrong``: exit code 0 where the input must be refused, or files left behind that a
  later run would trust (a partial method folder, a temporary file);
* ``traceback``: a Python traceback on stderr.

Cases that are meant to be accepted (``ok=True``) count as ``clear`` when they exit 0.

    OMP_NUM_THREADS=1 python scripts/adversarial_bench.py            # every case, a table at the end
    OMP_NUM_THREADS=1 python scripts/adversarial_bench.py -k out     # cases whose name holds "out"

Some cases need root (a read-only or full tmpfs mounted under the case's directory, unmounted
after it); without root they are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = "random:tiny-llama"
TRACE = ["--workload", "trace", "--shared-tokens", "16", "--agents", "2", "--rounds", "1",
         "--output-tokens", "2", "--requests", "1"]  # fmt: skip
FAST = ["--model", MODEL, "--no-progress", "--no-plots", "--methods", "fullshared"]
INFO_PREFIXES = ("loading ", "note: ", "[", "random weights", "method ", "nonshared ", "fullshared ",
                 "limit ", "/", "sweep plots")  # fmt: skip


#: lines other libraries print on stderr (not the bench's messages): bitsandbytes, when the disk is full
LIBRARY_NOISE = ("Failed to load CPU gemm_4bit_forward from kernels-community",)


@dataclass
class Case:
    surface: str
    name: str
    #: the argv after ``python -m hf_kvshare.bench``; ``{tmp}`` is the case's own directory
    argv: list[str]
    #: words the error line must hold
    expect: tuple[str, ...] = ()
    setup: Callable[[Path], None] | None = None
    ok: bool = False  # the input is legitimate: exit code 0 expected
    #: a shell line run in a private mount namespace before the command (root only)
    mount: str | None = None
    timeout: float = 120
    #: a check of the case's directory after the command: a message when something is wrong
    after: Callable[[Path], str | None] | None = None
    env: dict[str, str] = field(default_factory=dict)


def _file(rel: str, data: bytes | str) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)

    return make


def _fifo(rel: str) -> Callable[[Path], None]:
    return lambda tmp: os.mkfifo(tmp / rel)


def _symlink(rel: str, target: str) -> Callable[[Path], None]:
    return lambda tmp: os.symlink(target.format(tmp=tmp), tmp / rel)


def _all(*steps: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        for step in steps:
            step(tmp)

    return make


def _finished_run(tmp: Path) -> None:
    """A finished configuration under ``tmp/out`` (one fullshared run)."""
    _bench(["run", *TRACE, *FAST, "--out", str(tmp / "out")], tmp, 300)


def _corrupt(rel_glob: str, data: bytes) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        for path in tmp.glob(rel_glob):
            path.write_bytes(data)

    return make


def _no_leftovers(tmp: Path) -> str | None:
    """Nothing half-written under ``tmp/out``: no temporary names, and every method folder with
    records has its summary (a later run trusts a folder by its summary.json)."""
    out = tmp / "out"
    if not out.exists():
        return None
    for path in out.rglob("*"):
        if path.name.endswith(".tmp") or ".partial" in path.name or path.name.startswith(".hfkv"):
            return f"left behind: {path.relative_to(tmp)}"
        if path.is_dir() and (path / "turns.jsonl").exists() and not (path / "summary.json").exists():
            return f"a method folder without its summary: {path.relative_to(tmp)}"
    return None


def _nothing_written(tmp: Path) -> str | None:
    return f"{tmp / 'out'} was created" if (tmp / "out").exists() else None


def cases() -> list[Case]:
    run = ["run", *TRACE, *FAST]
    nested = b"[" * 200000 + b"]" * 200000 + b"\n"
    big_json = b'{"a": ' + b"1" * 5000 + b"}\n"
    return [
        # ------------------------------------------------------------ run: output places
        Case("run: output", "out-is-a-file", [*run, "--out", "{tmp}/f"], ("--out", "not a directory"),
             _file("f", "x")),
        Case("run: output", "out-under-a-file", [*run, "--out", "{tmp}/f/deeper"], ("--out", "not a directory"),
             _file("f", "x")),
        Case("run: output", "out-symlink-to-a-file", [*run, "--out", "{tmp}/link"], ("--out", "not a directory"),
             _all(_file("f", "x"), _symlink("link", "{tmp}/f"))),
        Case("run: output", "out-dangling-symlink", [*run, "--out", "{tmp}/link"], ("--out", "symbolic link"),
             _symlink("link", "{tmp}/nowhere")),
        Case("run: output", "out-symlink-loop", [*run, "--out", "{tmp}/loop/x"], ("--out",),
             _symlink("loop", "{tmp}/loop")),
        Case("run: output", "out-in-proc", [*run, "--out", "/proc/hfkv-out"], ("--out", "not writable")),
        Case("run: output", "out-read-only-fs", [*run, "--out", "{tmp}/ro/out"], ("--out", "not writable"),
             mount="mkdir -p {tmp}/ro && mount -t tmpfs -o size=4m,ro tmpfs {tmp}/ro"),
        Case("run: output", "out-full-fs", [*run, "--out", "{tmp}/full/out"], ("--out", "full"),
             mount="mkdir -p {tmp}/full && mount -t tmpfs -o size=256k tmpfs {tmp}/full"),
        Case("run: output", "out-fills-up-during-the-run", [*run, "--out", "{tmp}/small/out"], ("No space",),
             mount="mkdir -p {tmp}/small && mount -t tmpfs -o size=4m tmpfs {tmp}/small && "
             "( while [ ! -d {tmp}/small/out ]; do sleep 0.02; done; cat /dev/zero > {tmp}/small/pad ) "
             "2>/dev/null &", after=lambda tmp: _no_leftovers(tmp / "small")),
        Case("run: output", "state-out-is-a-file", [*run, "--out", "{tmp}/out", "--state-out", "{tmp}/f"],
             ("--state-out", "not a directory"), _file("f", "x"), after=_nothing_written),
        Case("run: output", "out-and-state-out-the-same", [*run, "--out", "{tmp}/out", "--state-out", "{tmp}/out"],
             ok=True),  # configuration directories and method state directories have distinct names
        # ------------------------------------------------------------ run: inputs
        Case("run: inputs", "state-in-is-a-file", [*run, "--out", "{tmp}/out", "--state-in", "{tmp}/f"],
             ("--state-in", "not a directory"), _file("f", "x"), after=_nothing_written),
        Case("run: inputs", "state-in-is-a-fifo", [*run, "--out", "{tmp}/out", "--state-in", "{tmp}/p"],
             ("--state-in", "not a directory"), _fifo("p"), after=_nothing_written),
        Case("run: inputs", "data-fifo", ["run", "--workload", "file", "--data", "{tmp}/p", *FAST, "--out", "{tmp}/out"],
             ("FIFO",), _fifo("p"), timeout=60, after=_nothing_written),
        Case("run: inputs", "data-dev-zero", ["run", "--workload", "file", "--data", "/dev/zero", *FAST,
             "--out", "{tmp}/out"], ("character device",), timeout=60, after=_nothing_written),
        Case("run: inputs", "data-directory", ["run", "--workload", "file", "--data", "{tmp}", *FAST,
             "--out", "{tmp}/out"], ("directory",), after=_nothing_written),
        Case("run: inputs", "data-non-utf8", ["run", "--workload", "file", "--data", "{tmp}/t.jsonl", *FAST,
             "--out", "{tmp}/out"], ("UTF-8",), _file("t.jsonl", b'{"id": "\xff"}\n'), after=_nothing_written),
        Case("run: inputs", "data-deeply-nested", ["run", "--workload", "file", "--data", "{tmp}/t.jsonl", *FAST,
             "--out", "{tmp}/out"], ("nested",), _file("t.jsonl", nested), after=_nothing_written),
        Case("run: inputs", "data-empty-file", ["run", "--workload", "file", "--data", "{tmp}/t.jsonl", *FAST,
             "--out", "{tmp}/out"], ("t.jsonl",), _file("t.jsonl", b""), after=_nothing_written),
        Case("run: inputs", "data-huge-number", ["run", "--workload", "file", "--data", "{tmp}/t.jsonl", *FAST,
             "--out", "{tmp}/out"], ("t.jsonl",), _file("t.jsonl", big_json), after=_nothing_written),
        Case("run: inputs", "data-unicode-task-id-with-path-parts", ["run", "--workload", "file", "--data",
             "{tmp}/t.jsonl", *FAST, "--out", "{tmp}/out"], ok=True, setup=_file("t.jsonl", json.dumps({
                 "id": "../../é\u202e/x", "agents": [{"name": "ä/../b"}],
                 "slots": [{"name": "q", "text": "hi"}], "schedule": [{"agent": "ä/../b", "reads": ["q"]}],
                 "max_new_tokens": 2}) + "\n"),
             after=lambda tmp: None if not any(tmp.glob("x*")) and not (tmp.parent / "x").exists()
             else "wrote outside --out"),
        Case("run: inputs", "state-in-truncated", [*run, "--out", "{tmp}/out2", "--state-in", "{tmp}/state"],
             ("state.json",), setup=lambda tmp: (
                 _bench([*run, "--methods", "graphflow", "--out", str(tmp / "out"), "--state-out",
                         str(tmp / "state")], tmp, 300),
                 [p.write_bytes(p.read_bytes()[:10]) for p in (tmp / "state").rglob("state.*")]),
             after=lambda tmp: f"{tmp / 'out2'} was created" if (tmp / "out2").exists() else None),
        # ------------------------------------------------------------ run: numbers and flags
        Case("run: options", "limit-negative", ["run", "--workload", "gsm8k", "--limit", "-1", *FAST,
             "--out", "{tmp}/out"], ("--limit",), after=_nothing_written),
        Case("run: options", "limit-huge", [*run[:1], "--workload", "file", "--data", str(ROOT / "examples" /
             "observations.jsonl"), "--limit", str(10**30), *FAST, "--no-fidelity", "--out", "{tmp}/out"],
             ok=True, timeout=600),
        Case("run: options", "offset-negative", ["run", "--workload", "gsm8k", "--offset", "-5", *FAST,
             "--out", "{tmp}/out"], ("--offset",), after=_nothing_written),
        Case("run: options", "requests-zero", ["run", *TRACE[:-2], "--requests", "0", *FAST, "--out", "{tmp}/out"],
             ("requests",), after=_nothing_written),
        Case("run: options", "shared-tokens-negative", ["run", "--workload", "trace", "--shared-tokens", "-4",
             *FAST, "--out", "{tmp}/out"], ("shared",), after=_nothing_written),
        Case("run: options", "max-new-tokens-negative", ["run", "--workload", "gsm8k", "--max-new-tokens", "-3",
             *FAST, "--out", "{tmp}/out"], ("max",), after=_nothing_written),
        Case("run: options", "exec-timeout-negative", [*run, "--execute", "--exec-timeout", "-1", "--out",
             "{tmp}/out"], ("--exec-timeout",), after=_nothing_written),
        Case("run: options", "exec-timeout-nan", [*run, "--exec-timeout", "nan", "--out", "{tmp}/out"],
             ("--exec-timeout",), after=_nothing_written),
        Case("run: options", "seed-huge", [*run, "--seed", str(2**70), "--out", "{tmp}/out"], ("--seed",),
             after=_nothing_written),
        Case("run: options", "threads-huge", [*run, "--threads", str(10**12), "--out", "{tmp}/out"],
             ("--threads",), after=_nothing_written),
        Case("run: options", "num-layers-zero", [*run, "--num-layers", "0", "--out", "{tmp}/out"],
             ("--num-layers",), after=_nothing_written),
        Case("run: options", "4bit-and-8bit", [*run, "--load-in-4bit", "--load-in-8bit", "--out", "{tmp}/out"],
             ("4bit",), after=_nothing_written),
        Case("run: options", "device-map-bad-json", [*run, "--device-map", "{oops", "--out", "{tmp}/out"],
             ("--device-map",), after=_nothing_written),
        Case("run: options", "workload-tau-nan", [*run, "--workload-tau", "trace=nan", "--out", "{tmp}/out"],
             ("tau",), after=_nothing_written),
        Case("run: options", "method-tau-inf", [*run[:-2], "--methods", "kvcmas:tau=inf", "--out", "{tmp}/out"],
             ("tau",), after=_nothing_written),
        Case("run: options", "unicode-method", [*run[:-2], "--methods", "kvcmäs\u202e", "--out", "{tmp}/out"],
             ("unknown method",), after=_nothing_written),
        Case("run: options", "warmup-huge", [*run, "--warmup", str(10**9), "--out", "{tmp}/out"], ("--warmup",),
             after=_nothing_written),
        Case("run: options", "model-fifo", [*TRACE[:0], "run", *TRACE, "--model", "{tmp}/p", "--out", "{tmp}/out"],
             ("{tmp}/p",), _fifo("p"), timeout=60, after=_nothing_written),
        Case("run: options", "model-dir-bad-config", ["run", *TRACE, "--model", "{tmp}/m", "--out", "{tmp}/out"],
             ("config.json",), _file("m/config.json", b"\xff\xfe{"), after=_nothing_written),
        Case("run: options", "adapter-dev-zero", [*run, "--adapter", "a=/dev/zero", "--out", "{tmp}/out"],
             ("--adapter",), after=_nothing_written),
        # ------------------------------------------------------------ run: resume
        Case("run: resume", "summary-json-corrupted", [*run, "--out", "{tmp}/out"], ("summary.json",),
             _all(_finished_run, _corrupt("out/*/fullshared/summary.json", b"{\"config\": ")),
             after=_no_leftovers),
        Case("run: resume", "config-json-is-a-directory", [*run, "--out", "{tmp}/out"], ("config.json",),
             _all(_finished_run, lambda tmp: [(p.unlink(), p.mkdir()) for p in tmp.glob("out/*/config.json")])),
        # ------------------------------------------------------------ report / plot
        Case("report", "report-a-file", ["report", "{tmp}/f"], ("summary.json",), _file("f", "x")),
        Case("report", "report-summary-non-utf8", ["report", "{tmp}/c"], ("summary.json",),
             _file("c/summary.json", b"\xff\xfe")),
        Case("report", "report-summary-nested", ["report", "{tmp}/c"], ("summary.json",),
             _file("c/summary.json", nested)),
        Case("report", "report-summary-fifo", ["report", "{tmp}/c"], ("summary.json",),
             _all(lambda tmp: (tmp / "c").mkdir(), _fifo("c/summary.json")), timeout=60),
        Case("report", "report-summary-not-an-object", ["report", "{tmp}/c"], ("summary.json",),
             _file("c/summary.json", "[1, 2]")),
        Case("report", "report-by-hop-unknown", ["report", "{tmp}/out", "--by-hop", "nope"], ("nope",),
             _finished_run),
        Case("plot", "plot-out-is-a-file", ["plot", "{tmp}/out", "--out", "{tmp}/f"], ("--out", "not a directory"),
             _all(_finished_run, _file("f", "x"))),
        Case("plot", "plot-summary-corrupted", ["plot", "{tmp}/out"], ("summary.json",),
             _all(_finished_run, _corrupt("out/*/summary.json", b"{"))),
        Case("plot", "plot-config-read-only", ["plot", "{tmp}/ro/out"], ("not writable",),
             setup=lambda tmp: _bench(["run", *TRACE, *FAST, "--out", str(tmp / "ro" / "out")], tmp, 300),
             mount="mount --bind -o ro {tmp}/ro {tmp}/ro"),
        # ------------------------------------------------------------ calibrate / validate / study / serve / list
        Case("calibrate", "calibrate-out-is-a-file", ["calibrate", *TRACE, "--method", "kvcmas", "--target-rho",
             "0.5", "--model", MODEL, "--out", "{tmp}/f"], ("--out",), _file("f", "x")),
        Case("calibrate", "calibrate-rho-out-of-range", ["calibrate", *TRACE, "--method", "kvcmas", "--target-rho",
             "2", "--model", MODEL, "--out", "{tmp}/out"], ("--target-rho",), after=_nothing_written),
        Case("calibrate", "calibrate-tau-range-reversed", ["calibrate", *TRACE, "--method", "kvcmas",
             "--target-rho", "0.5", "--tau-min", "0.9", "--tau-max", "0.1", "--model", MODEL, "--out", "{tmp}/out"],
             ("--tau-min",), after=_nothing_written),
        Case("calibrate", "calibrate-iterations-negative", ["calibrate", *TRACE, "--method", "kvcmas",
             "--target-rho", "0.5", "--iterations", "-2", "--model", MODEL, "--out", "{tmp}/out"],
             ("--iterations",), after=_nothing_written),
        Case("validate", "validate-fifo", ["validate", "{tmp}/p"], ("FIFO",), _fifo("p"), timeout=60),
        Case("validate", "validate-missing", ["validate", "{tmp}/nope.jsonl"], ("does not exist",)),
        Case("study", "study-dotted-name", ["study", "os.path"], ("no study",)),
        Case("study", "study-path-parts", ["study", "../../etc"], ("no study",)),
        Case("serve", "serve-out-is-a-file", ["serve", "--out", "{tmp}/f", "--vllm-python", sys.executable],
             ("--out", "not a directory"), _file("f", "x")),
        Case("serve", "serve-port-negative", ["serve", "--port", "-1", "--out", "{tmp}/out"], ("--port",)),
        Case("list", "list-extra-argument", ["list", "extra"], ("unrecognized",)),
        Case("main", "unknown-command", ["nope"], ("unknown command",)),
    ]  # fmt: skip


class _Done:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _bench(argv: list[str], tmp: Path, timeout: float) -> _Done:
    """``python -m hf_kvshare.bench ARGV`` in a forked child of this process (the bench imported
    once, here), in ``tmp``, with stdout/stderr captured. ``subprocess.TimeoutExpired`` when it
    runs past ``timeout``."""
    import signal
    import time
    import traceback

    out, err = tmp / ".stdout", tmp / ".stderr"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            fd_out, fd_err = (
                os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            )
            os.dup2(fd_out, 1)
            os.dup2(fd_err, 2)
            os.chdir(tmp)
            os.setsid()
            from hf_kvshare.bench.__main__ import main

            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what the interpreter would print
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code or 0)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(argv, timeout)
        time.sleep(0.05)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    text = [path.read_text(errors="replace") if path.exists() else "" for path in (out, err)]
    for path in (out, err):
        path.unlink(missing_ok=True)
    return _Done(code, *text)


def classify(case: Case, tmp: Path) -> tuple[str, str]:
    argv = [a.replace("{tmp}", str(tmp)) for a in case.argv]
    try:
        if case.mount:  # in this process's mount namespace (root); unmounted after the case
            subprocess.run(["sh", "-c", case.mount.replace("{tmp}", str(tmp))], check=True)
        try:
            done = _bench(argv, tmp, case.timeout)
        except subprocess.TimeoutExpired:
            return "unclear", f"hung (killed after {case.timeout:g} s)"
        return _judge(case, tmp, done)
    finally:
        if case.mount:
            _unmount_under(tmp)


def _unmount_under(tmp: Path) -> None:
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    for point in reversed(points):
        if point == str(tmp) or point.startswith(f"{tmp}/"):
            subprocess.run(["umount", "-l", point], capture_output=True)


def _judge(case: Case, tmp: Path, done: _Done) -> tuple[str, str]:
    err = done.stderr
    if "Traceback" in err:
        return "traceback", err.strip().splitlines()[-1][:200]
    problem = case.after(tmp) if case.after else None
    if done.returncode == 0:
        if case.ok and problem is None:
            return "clear", "accepted (legitimate)"
        return "accepted and wrong", problem or "exit code 0"
    if case.ok:
        return "unclear", f"refused a legitimate input: {err.strip()[-200:]}"
    if problem is not None:
        return "accepted and wrong", problem
    lines = [line for line in err.strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(INFO_PREFIXES) or "error" in line]
    lines = [line for line in lines if not line.startswith(LIBRARY_NOISE)]
    expect = [e.replace("{tmp}", str(tmp)) for e in case.expect]
    if len(lines) != 1 or "error" not in lines[0] or not all(e in lines[0] for e in expect):
        return "unclear", " | ".join(lines)[:300] or "(no message)"
    return "clear", lines[0][:200]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", default="", help="only cases whose name holds this text")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    root_user = os.geteuid() == 0 and shutil.which("mount") is not None
    import torch  # noqa: F401 - imported once, before the cases fork
    import transformers  # noqa: F401

    import hf_kvshare.bench.__main__  # noqa: F401
    import hf_kvshare.bench.runner  # noqa: F401

    results = []
    for case in cases():
        if args.k not in case.name:
            continue
        if case.mount and not root_user:
            print(f"skip {case.name} (needs root to mount a tmpfs)")
            continue
        with tempfile.TemporaryDirectory(prefix="hfkv-adv-") as tmp:
            if case.setup:
                case.setup(Path(tmp))
            kind, why = classify(case, Path(tmp))
            subprocess.run(["chmod", "-R", "u+w", tmp], capture_output=True)
        results.append({"surface": case.surface, "case": case.name, "result": kind, "why": why})
        print(f"{kind:<20} {case.surface:<14} {case.name:<40} {why}", flush=True)
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

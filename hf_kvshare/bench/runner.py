"""The single-stream benchmark runner: each request of a workload through
:func:`hf_kvshare.evaluation.run_paired`, methods interleaved request by request, each keeping its
two instances for the whole run; records and summaries written per configuration directory.
What a run does, ``--warmup``, the output layout and skip-if-done: ``docs/workloads.md``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .. import reasons
from .._version import __version__
from ..evaluation import MethodPair, RequestRun, request_record, run_paired, summarize_method, turn_records
from ..evaluation.protocol import REFERENCE, SUMMARY_COLUMNS
from ..method import STATE_JSON
from ..models import max_positions
from ..session import Session
from . import checkers
from .limit import LIMIT, limit_records, summarize_limit
from .methods import MethodSpec
from .report import write_csv
from .workloads import TaskSpec, Workload, workload_tau


@dataclass
class RunConfig:
    """What fixes a configuration's results (the directory holds exactly one)."""

    workload: str
    workload_params: dict[str, Any]
    model: str
    dtype: str | None = None
    device: str = "cpu"
    seed: int = 0
    fidelity: bool = True
    erank: bool = True
    execute: bool = False
    exec_timeout: float = 10.0
    adapters: dict[str, str] = field(default_factory=dict)
    warmup: int = 0  # the first requests run through every method unrecorded (pools fill up)
    #: directory of saved method states every method starts from (``<state_in>/<method tag>/``)
    state_in: str | None = None
    quantization: str | None = None  # bitsandbytes: "8bit", "4bit-nf4", "4bit-fp4" (models.quantization_tag)
    device_map: str | None = None  # accelerate placement as given on the command line (--device-map)
    num_layers: int | None = None  # random: models cut to their first layers
    attn_implementation: str = "sdpa"
    #: measure each free turn's peak of torch tensor bytes (profiler: the free pass's times inflate)
    tensor_memory: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(
                f"warmup must be an int >= 0 (requests run before recording); got {self.warmup!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        data = {**asdict(self), "adapters": dict(sorted(self.adapters.items()))}
        for key in ("warmup", "quantization", "device_map", "state_in", "tensor_memory"):
            if not data[key]:
                del data[key]  # runs without one keep their config (and their directory)
        if self.num_layers is None:
            del data["num_layers"]
        if self.attn_implementation == "sdpa":  # the default: earlier runs (sdpa) keep their config
            del data["attn_implementation"]
        return data

    def directory_name(self, workload: Workload) -> str:
        model = self.model.rstrip("/\\")
        model_tag = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(model) or model)
        dtype = self.dtype or "default"
        warmup = f"-W{self.warmup}" if self.warmup else ""
        if self.state_in is not None:  # warm-started: never mixed with a cold run's directory
            digest = hashlib.sha256(os.path.abspath(self.state_in).encode()).hexdigest()[:8]
            warmup += f"-S{digest}"
        quant = f"-{self.quantization}" if self.quantization else ""
        placement = f"-dm_{_device_map_tag(self.device_map)}" if self.device_map else ""
        layers = f"-L{self.num_layers}" if self.num_layers is not None else ""
        attn = "" if self.attn_implementation == "sdpa" else f"-{self.attn_implementation}"
        return (
            f"{workload.tag()}{warmup}__{model_tag}{layers}-{dtype}{quant}-{self.device}{placement}{attn}"
            f"-seed{self.seed}"
        )


def _first_missing(directory: Path) -> Path | None:
    """The topmost directory of ``directory`` and its parents that does not exist yet (``None``: it exists)."""
    if directory.exists():
        return None
    missing = directory
    for parent in directory.parents:
        if parent.exists():
            return missing
        missing = parent
    return missing


def _remove_created(created: Path, directory: Path) -> None:
    """Remove ``directory`` (which this run created) and its parents up to ``created``, the topmost one
    the run created; a parent is removed only when empty (another run may have written into it since)."""
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
    for parent in directory.parents:
        if not parent.is_relative_to(created):
            break
        try:
            parent.rmdir()
        except OSError:
            break


def _read_result(path: Path) -> dict[str, Any]:
    """A summary.json / config.json the run wrote; :class:`BenchInputError` when it cannot be read
    (truncated, edited, not a file): the run does not guess which results to trust."""
    from .inputs import InputFileError, read_json_object

    try:
        return read_json_object(path, "the earlier result")
    except InputFileError as e:
        raise BenchInputError(f"{e}; remove it, or use --redo or another --out") from None


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _device_map_tag(device_map: str) -> str:
    """``auto`` / ``cuda_0`` as they are; a JSON placement by a short hash of its text."""
    if device_map.lstrip().startswith("{"):
        return hashlib.sha1(device_map.encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", device_map)


def environment() -> dict[str, Any]:
    import platform

    import transformers

    return {
        "hf_kvshare": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"
        + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
    }


class BenchInputError(ValueError):
    """The run cannot start as asked (workload data, adapters, methods): the message says why."""


class ConfigMismatch(BenchInputError):
    """The output directory holds a run with another configuration."""


def write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, default=_json_default) + "\n"  # before any file is touched
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the previous file, if any, is kept as it was
        raise


def publish_directory(partial: Path, final: Path) -> None:
    """Rename the complete folder ``partial`` to its sibling ``final``; a folder already there (an
    earlier run's, replaced by ``--redo``, or one an interrupted run of an older version left) is
    moved aside first and removed after, so ``final`` is at every moment the old folder, nothing or
    the new one, never a mix."""
    import shutil

    partial, final = Path(partial), Path(final)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if os.path.lexists(final):
        os.replace(final, old)
    os.replace(partial, final)
    shutil.rmtree(old, ignore_errors=True)


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def _jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON, NaN/inf as None."""
    return _clean(json.loads(json.dumps(value, default=_json_default)))


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class Collector:
    """Extra measurements of a study, taken from each recorded request's :class:`RequestRun` (free and
    teacher-forced turns with their caches) while the runner runs; no run loop of its own."""

    def collect(self, runner: BenchRunner, task: TaskSpec, index: int, run: RequestRun) -> None:
        """Called once per recorded request, after every method ran (caches still held)."""

    def finish(self, runner: BenchRunner) -> None:
        """Called once after the run (e.g. to write the collected rows into ``runner.dir``)."""


class BenchRunner:
    """Runs methods on one workload configuration and writes the output directory."""

    def __init__(
        self,
        model,
        tokenizer,
        workload: Workload,
        config: RunConfig,
        out_root,
        progress=True,
        collectors=(),
        tau: Mapping[str, float] | None = None,
        state_out=None,
        limit: bool = True,
        processor=None,
    ):
        #: a vision-language model's processor, for workloads with image slots (``Workload.visual``)
        self.processor = processor
        #: also measure the ``limit`` row (bench/limit.py) for every reuse turn
        self.limit = limit
        #: the workload's tau default (``tau`` overrides it per workload name; unknown names raise)
        self.tau = workload_tau(workload.name, tau)
        self.model = model
        self.collectors = list(collectors)
        # the method instances of the run in progress (collectors read their state at its end; released
        # when it ends)
        self.pairs: list[MethodPair] = []
        self._specs_pairs: list[tuple[MethodSpec, MethodPair]] = []
        self.tokenizer = tokenizer
        self.workload = workload
        self.config = config
        self.dir = Path(out_root) / config.directory_name(workload)
        self.progress = progress
        #: where each method's state is saved after the run (``<state_out>/<method tag>/``)
        self.state_out = None if state_out is None else Path(state_out)
        self._started = False  # whether the current run reached its first request

    def method_dir(self, spec: MethodSpec) -> Path:
        return self.dir / spec.tag

    def method_defaults(self, spec: MethodSpec) -> dict[str, Any]:
        """Options the workload sets unless the spec does: its tau, for methods with ``workload_tau``."""
        if self.tau is None or "tau" in spec.kwargs or not getattr(spec.cls, "workload_tau", False):
            return {}
        return {"tau": self.tau}

    def method_config(self, spec: MethodSpec) -> dict[str, Any]:
        options = {**self.method_defaults(spec), **spec.kwargs}
        return {**self.config.to_dict(), "method": spec.name, "method_options": options}

    def is_done(self, spec: MethodSpec) -> bool:
        summary = self.method_dir(spec) / "summary.json"
        if not summary.exists():
            return False
        stored = _read_result(summary).get("config")
        if _clean(stored) != _jsonable(self.method_config(spec)):
            raise ConfigMismatch(
                f"{self.method_dir(spec)} holds a finished run with a different configuration; "
                "use another --out directory or --redo to replace it"
            )
        return True

    def _check_config_dir(self) -> None:
        """Raise :class:`ConfigMismatch` when the directory holds a run with another configuration
        (reads only: :meth:`_write_config` writes when the run starts)."""
        path = self.dir / "config.json"
        current = _jsonable(self.config.to_dict())
        if path.exists():
            stored = _read_result(path).get("config")
            if stored != current:
                diff = sorted(
                    k for k in set(stored or {}) | set(current) if (stored or {}).get(k) != current.get(k)
                )
                raise ConfigMismatch(
                    f"{self.dir} holds a run with a different configuration (differs in: {', '.join(diff)}); "
                    "use another --out directory or --redo"
                )

    def _write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json(
            self.dir / "config.json",
            {"config": _jsonable(self.config.to_dict()), "environment": environment()},
        )

    def tasks(self) -> list[TaskSpec]:
        """The workload's requests; bad data or parameters raise :class:`BenchInputError`."""
        if self.workload.visual and self.processor is None:
            raise BenchInputError(
                f"workload {self.workload.tag()} puts images in the prompts: the runner needs the model's "
                "processor (BenchRunner(..., processor=...))"
            )
        try:
            return self.workload.tasks(self.tokenizer, self.config.seed)
        except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
            raise BenchInputError(f"workload {self.workload.tag()}: {e}") from e

    def run(self, methods: Sequence[MethodSpec], redo: bool = False) -> dict[str, dict[str, Any]]:
        """Run the methods not done yet (NonShared always included) and return every summary of the
        configuration, keyed by method tag."""
        specs = list(dict.fromkeys([MethodSpec(REFERENCE), *methods]))
        tasks = self.tasks()
        self._check_tasks(tasks, specs)
        if redo:  # the earlier results are replaced when the run starts, not before
            pending = specs
        else:
            self._check_config_dir()
            pending = [s for s in specs if not self.is_done(s)]
        skipped = [s for s in specs if s not in pending]
        if skipped:
            print(f"[{self.dir.name}] already done, skipped: {', '.join(map(str, skipped))}")
        if pending:
            self._started = False
            created = _first_missing(self.dir)
            try:
                self._run_pending(tasks, pending, redo)
            except BaseException:
                if created is not None and not self._started:  # a run that could not start leaves nothing
                    _remove_created(created, self.dir)
                raise
        else:
            self._write_config()
        return self.write_configuration_summary()

    def _check_tasks(self, tasks: list[TaskSpec], specs: list[MethodSpec]) -> None:
        if not tasks:
            raise BenchInputError(f"workload {self.workload.tag()} produced no requests")
        if self.config.warmup >= len(tasks):
            raise BenchInputError(
                f"--warmup {self.config.warmup} leaves no request to measure: workload {self.workload.tag()} "
                f"has {len(tasks)}; ask for more requests (--limit / --requests) or a smaller warm-up"
            )
        limit = max_positions(self.model.config) if hasattr(self.model, "config") else None
        if limit is not None:
            model = self.config.model
            for task in tasks:
                try:
                    task.check_positions(limit, model)
                except ValueError as e:
                    raise BenchInputError(f"workload {self.workload.tag()}, request {task.id!r}: {e}") from e
        adapters = sorted({a for t in tasks for a in t.adapters})
        for spec in specs:
            if spec.requires_adapters and not adapters:
                raise BenchInputError(
                    f"method {spec.name!r} needs agents that run with LoRA adapters (requires_adapters); "
                    f"workload {self.workload.name!r} names none. Use a workload whose agents name adapters "
                    "(e.g. --workload autoact with --adapter NAME=PATH)"
                )
        if adapters:
            loaded = sorted(getattr(self.model, "peft_config", {}) or {})
            missing = [a for a in adapters if a not in loaded]
            if missing:
                raise BenchInputError(
                    f"the workload's agents use adapter(s) {', '.join(missing)}, which are not loaded "
                    f"(loaded: {', '.join(loaded) or 'none'}); pass --adapter NAME=PATH for each"
                )

    def _warm_up(self) -> None:
        from ..trajectory import PF

        session = Session(self.model, self.tokenizer, REFERENCE)
        # on a PeftModel an agent's name is its adapter's name
        agent = next(iter(getattr(self.model, "peft_config", None) or {}), "warmup")
        session.run_turn(agent, [PF("Warm up the kernels once before timing.")], max_new_tokens=2)

    def _pairs(self, pending: list[MethodSpec]) -> list[MethodPair]:
        """Two instances per method, kept for the whole run: one for the timed pass, one for fidelity."""
        pairs, self._specs_pairs = [], []
        for spec in dict.fromkeys([MethodSpec(REFERENCE), *pending]):
            try:  # bad options or a method that cannot run on this model: an error before any output
                defaults = self.method_defaults(spec)
                pair = MethodPair(
                    str(spec), spec.create(defaults), spec.create(defaults) if self.config.fidelity else None
                )
                with warnings.catch_warnings():  # the sessions attach again and warn then
                    warnings.simplefilter("ignore")
                    for method in filter(None, (pair.free, pair.forced)):
                        method.bind(self.model)
                if self.config.state_in is not None:
                    self._load_state(spec, pair)
            except ValueError as e:
                raise BenchInputError(f"method {spec}: {e}") from e
            pairs.append(pair)
            self._specs_pairs.append((spec, pair))
        return pairs

    def _load_state(self, spec: MethodSpec, pair: MethodPair) -> None:
        """Start ``pair`` from ``<state_in>/<tag>/`` (the fidelity instance from ``forced/`` there)."""
        directory = Path(self.config.state_in) / spec.tag
        if not (directory / STATE_JSON).is_file():
            raise ValueError(
                f"--state-in {self.config.state_in}: no saved state for this method (expected "
                f"{directory / STATE_JSON}, written by a run with --state-out)"
            )
        try:
            pair.free.load_state(directory, model=self.model)
            if pair.forced is not None:
                forced = directory / "forced"
                pair.forced.load_state(
                    forced if (forced / STATE_JSON).is_file() else directory, model=self.model
                )
        except ValueError:
            raise
        except Exception as e:  # a truncated or unreadable file: torch / safetensors / OS errors
            text = " ".join(str(e).split())[:300]
            raise ValueError(
                f"--state-in {self.config.state_in}: the saved state in {directory} cannot be read "
                f"({type(e).__name__}: {text})"
            ) from e

    def save_states(self) -> None:
        """Save every method instance's state to ``<state_out>/<tag>/`` (fidelity instance: ``forced/``).

        Each method's state is saved (``save_state``, atomic per file) into a fresh hidden sibling,
        ``<state_out>/.<tag>.partial-<pid>/``; only when every method's is complete are they renamed
        into place, each replacing the whole earlier folder (a ``forced/`` an earlier run left is not
        kept beside a new state without one). A save that fails removes the hidden folders and leaves
        the earlier states as they were, never some methods' old state beside others' new one."""
        import shutil

        staged: list[tuple[Path, Path]] = []
        try:
            for spec, pair in self._specs_pairs:
                final = self.state_out / spec.tag
                partial = self.state_out / f".{spec.tag}.partial-{os.getpid()}"
                shutil.rmtree(partial, ignore_errors=True)
                staged.append((partial, final))
                pair.free.save_state(partial, model=self.model)
                if pair.forced is not None:
                    pair.forced.save_state(partial / "forced", model=self.model)
        except BaseException:
            for partial, _ in staged:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        for partial, final in staged:
            publish_directory(partial, final)

    def _partial_dir(self, name: str) -> Path:
        """Where method folder ``name`` is written while the run runs: a hidden sibling that no
        reader trusts (``load_summaries`` and skip-if-done ignore dot names), renamed into place by
        :meth:`_publish` once complete."""
        return self.dir / f".{name}.partial-{os.getpid()}"

    def _publish(self, name: str) -> None:
        """Rename the complete partial folder of ``name`` into place (:func:`publish_directory`)."""
        publish_directory(self._partial_dir(name), self.dir / name)

    def _remove_stale_partials(self, names: Sequence[str]) -> None:
        """Partial folders of ``names`` left by runs that were killed (their process is gone)."""
        import shutil

        for name in names:
            for path in self.dir.glob(f".{name}.partial-*") if self.dir.is_dir() else ():
                pid = path.name.rpartition("-")[2]
                if pid.isdigit() and (int(pid) == os.getpid() or not _process_exists(int(pid))):
                    shutil.rmtree(path, ignore_errors=True)

    def _run_pending(self, tasks: list[TaskSpec], pending: list[MethodSpec], redo: bool = False) -> None:
        """Run ``pending`` on ``tasks``. Everything that can fail before the first request (methods'
        options and binding, saved states, the warm-up turn) runs before anything is written. Each
        method's folder is written as a hidden partial folder and renamed into place when complete
        (with ``redo`` the earlier folder is replaced only then); a run that fails or is interrupted
        removes its partial folders, and one that is killed leaves only hidden ones, which no later
        run trusts."""
        self.pairs = pairs = self._pairs(pending)
        self._warm_up()
        self._write_config()
        names = [s.tag for s in pending] + ([LIMIT] if self.limit else [])
        self._remove_stale_partials(names)
        try:
            self._record(tasks, pending, pairs)
        except BaseException:
            import shutil

            for name in names:
                shutil.rmtree(self._partial_dir(name), ignore_errors=True)
            raise
        try:
            for collector in self.collectors:
                collector.finish(self)
            if self.state_out is not None:
                self.save_states()
        finally:
            # the configuration is done: its method instances (anchor pools: KVComm's are GBs at 32K)
            # would otherwise stay alive beside the next configuration's, in every later peak
            self.pairs, self._specs_pairs = [], []

    def _record(self, tasks: list[TaskSpec], pending: list[MethodSpec], pairs: list[MethodPair]) -> None:
        collected: dict[MethodSpec, tuple[list, list]] = {s: ([], []) for s in pending}
        limit_rows: list[dict[str, Any]] = []
        with ExitStack() as files:
            writers = {}
            for spec in pending:
                d = self._partial_dir(spec.tag)
                d.mkdir(parents=True)
                write_json(
                    d / "config.json", {"config": self.method_config(spec), "environment": environment()}
                )
                writers[spec] = [
                    files.enter_context(open(d / f"{n}.jsonl", "w")) for n in ("turns", "requests")
                ]
            bar = tqdm(tasks, desc=self.dir.name[:60], disable=not self.progress, unit="request")
            for index, task in enumerate(bar):
                self._started = (
                    True  # from here on the configuration directory is kept (partial folders are not)
                )
                run = run_paired(
                    self.model,
                    self.tokenizer,
                    task.to_workflow(self.tokenizer),
                    pairs,
                    fidelity=self.config.fidelity,
                    seed=self.config.seed + index,
                    progress=self.progress,
                    tensor_memory=self.config.tensor_memory,
                    processor=self.processor,
                )
                if index < self.config.warmup:  # state built, nothing recorded
                    del run
                    continue
                for collector in self.collectors:
                    collector.collect(self, task, index, run)
                ref_check = self._check(task, run.free[REFERENCE])
                for spec in pending:
                    turns, request = self._records(task, index, spec, run, ref_check)
                    for f, records, kept in zip(writers[spec], (turns, [request]), collected[spec]):
                        f.writelines(json.dumps(_clean(r)) + "\n" for r in records)
                        f.flush()
                        kept.extend(records)
                if self.limit:  # same run, after the methods of this request; NonShared's forced caches
                    rows = limit_records(
                        self.model, run.free[REFERENCE], task.reused_slots(), run.forced.get(REFERENCE)
                    )
                    limit_rows += [{"request": task.id, "request_index": index, **r} for r in rows]
                run.release_caches()  # the kept caches go before the next request runs
                del run
        for spec in pending:  # every summary written before any folder is published
            summary = summarize_method(*collected[spec])
            summary.update(not_shared_columns(collected[spec][0]))
            summary.update({"method": str(spec), "tag": spec.tag, "config": self.method_config(spec)})
            write_json(self._partial_dir(spec.tag) / "summary.json", _clean(summary))
        if limit_rows:
            self._write_limit(limit_rows)
        for spec in pending:
            self._publish(spec.tag)
        if limit_rows:
            self._publish(LIMIT)

    def _write_limit(self, rows: list[dict[str, Any]]) -> None:
        """The ``limit`` pseudo-method's turns and summary, beside the methods' (see bench/limit.py)."""
        d = self._partial_dir(LIMIT)
        d.mkdir(parents=True)
        (d / "turns.jsonl").write_text("".join(json.dumps(_clean(r)) + "\n" for r in rows))
        config = {**self.config.to_dict(), "method": LIMIT, "method_options": {}}
        write_json(d / "summary.json", _clean({**summarize_limit(rows), "config": config}))

    def _check(self, task: TaskSpec, results: list) -> dict[str, Any]:
        return checkers.check_answer(task, results[-1].text, self.config.execute, self.config.exec_timeout)

    def _records(
        self, task: TaskSpec, index: int, spec: MethodSpec, run: RequestRun, ref_check: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The protocol's turn and request records of ``spec``, with the task's ids and answer checks."""
        where = {"request": task.id, "request_index": index}
        agents = [s.agent for s in task.schedule]
        records = turn_records(
            run, str(spec), reusable=task.reused_slots(), agents=agents, erank=self.config.erank
        )
        turns = [{**where, **r} for r in records]
        check = self._check(task, run.free[str(spec)])
        request = {
            **where,
            **request_record(run, str(spec)),
            "correct": check["correct"],
            "check": check,
            "ref_correct": ref_check["correct"],
        }
        return turns, request

    def load_summaries(self) -> dict[str, dict[str, Any]]:
        """Every finished method summary of this configuration (NonShared first)."""
        current = _jsonable(self.config.to_dict())
        found = {}
        for path in sorted(self.dir.glob("*/summary.json")):
            if path.parent.name.startswith("."):  # a partial folder (being written, or left by a kill)
                continue
            data = _read_result(path)
            stored = {
                k: v for k, v in (data.get("config") or {}).items() if k not in ("method", "method_options")
            }
            if _clean(stored) == current:  # a method left from an earlier, different run is not mixed in
                found[path.parent.name] = data
        return dict(sorted(found.items(), key=lambda kv: (kv[0] != REFERENCE, kv[0])))

    def write_configuration_summary(self) -> dict[str, dict[str, Any]]:
        summaries = self.load_summaries()
        rows = [{k: v for k, v in s.items() if k != "config"} for s in summaries.values()]
        write_json(self.dir / "summary.json", {"config": self.config.to_dict(), "methods": rows})
        columns = [*SUMMARY_COLUMNS, NOT_SHARED_TOP]
        write_csv(self.dir / "summary.csv", rows, [k for k in columns if any(k in r for r in rows)])
        return summaries


#: the summary column naming a method's most frequent causes of PH tokens not shared (CSV-friendly)
NOT_SHARED_TOP = "not_shared_top"


def not_shared_columns(turns: Sequence[Mapping[str, Any]], n: int = 3) -> dict[str, Any]:
    """A method summary's causes of the PH tokens computed densely over its turn records
    (:func:`hf_kvshare.reasons.record_causes`): ``not_shared`` (every cause, most tokens first:
    tokens, spans, the first detail) and ``not_shared_top`` (the ``n`` most frequent in one line)."""
    counts = reasons.merge(reasons.record_causes(t) for t in turns)
    return {"not_shared": dict(reasons.top(counts)), NOT_SHARED_TOP: reasons.describe(counts, n)}

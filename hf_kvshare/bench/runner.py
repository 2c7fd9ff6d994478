"""The single-stream benchmark runner.

For every request of a workload it runs NonShared (the reference) and each method twice:

- **free-running**: greedy generation, timed (TTFT, E2E), reuse counted, outputs recorded;
- **teacher-forced** on NonShared's outputs (when ``fidelity`` is on): top-1 agreement, KL,
  relative KV error against NonShared's exact cache by segment and by layer, effective ranks.

Methods run interleaved request by request (NonShared first), so timing ratios come from the
same minutes of the same machine. Each method keeps two instances for the whole run (one per
pass), so state that outlives a request (anchor pools, calibration) builds up over the requests
as in a real deployment and the fidelity pass does not feed the timed pass. With ``warmup = N``
the first N requests run exactly so but are not recorded: the summaries describe the steady
state (filled anchor pools, finished GraphFlow calibration) on the requests after them.

Output layout (``out/<configuration>/``)::

    config.json                    the run configuration
    summary.json, summary.csv      one row per method done in this configuration
    plots/                         PNG + CSV of each figure
    <method-tag>/config.json       configuration + method options
    <method-tag>/turns.jsonl       one record per turn
    <method-tag>/requests.jsonl    one record per request (E2E, throughput, task check)
    <method-tag>/summary.json      written last: its presence marks the method as done
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .. import __version__
from ..fidelity import mean_kl, top1_agreement
from ..methods import Method
from ..session import Session, TurnResult
from ..workflow import Workflow
from . import metrics
from .methods import MethodSpec
from .workloads import TaskSpec, Workload

REFERENCE = "nonshared"


# ---------------------------------------------------------------- requests
def activate_adapter(model: Any, adapter: str) -> None:
    """Make ``adapter`` the active PEFT adapter (methods may still choose adapters themselves)."""
    config = getattr(model, "peft_config", None)
    if config is None:
        raise ValueError(
            f"an agent runs with adapter {adapter!r} but the model is not a PeftModel; load adapters with --adapter NAME=PATH"
        )
    if adapter not in config:
        raise ValueError(f"adapter {adapter!r} is not loaded; loaded adapters: {', '.join(sorted(config))}")
    model.set_adapter(adapter)


def run_request(
    session: Session,
    workflow: Workflow,
    *,
    force_outputs: Sequence[torch.Tensor] | None = None,
    keep_cache: bool = False,
    progress: bool = False,
    desc: str = "",
) -> list[TurnResult]:
    """Run every step of ``workflow`` in ``session`` (explicit output slots, adapters, generate options)."""
    results = []
    steps = tqdm(
        workflow.steps, desc=desc or session.method.name, leave=False, disable=not progress, unit="turn"
    )
    for i, step in enumerate(steps):
        adapter = getattr(step, "adapter", None)
        if adapter:
            activate_adapter(session.model, adapter)
        results.append(
            session.run_turn(
                adapter or step.agent,
                step.segments,
                max_new_tokens=step.max_new_tokens or workflow.max_new_tokens,
                output_slot=getattr(step, "output_slot", None) or None,
                force_output=None if force_outputs is None else force_outputs[i],
                keep_cache=keep_cache,
                **(getattr(step, "generate_kwargs", None) or {}),
            )
        )
    return results


# ------------------------------------------------------------------ config
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

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(
                f"warmup must be an int >= 0 (requests run before recording); got {self.warmup!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "workload_params": self.workload_params,
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "seed": self.seed,
            "fidelity": self.fidelity,
            "erank": self.erank,
            "execute": self.execute,
            "exec_timeout": self.exec_timeout,
            "adapters": dict(sorted(self.adapters.items())),
            **({"warmup": self.warmup} if self.warmup else {}),  # runs without one keep their config
        }

    def directory_name(self, workload: Workload) -> str:
        model = self.model.rstrip("/\\")
        model_tag = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(model) or model)
        dtype = self.dtype or "default"
        warmup = f"-W{self.warmup}" if self.warmup else ""
        return f"{workload.tag()}{warmup}__{model_tag}-{dtype}-{self.device}-seed{self.seed}"


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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# ------------------------------------------------------------------ runner
class BenchRunner:
    """Runs methods on one workload configuration and writes the output directory.

    >>> runner = BenchRunner(model, tok, make_workload("trace", shared_tokens=256), config, "runs")  # doctest: +SKIP
    >>> summaries = runner.run([MethodSpec.parse("fullshared")])  # doctest: +SKIP
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        workload: Workload,
        config: RunConfig,
        out_root: str | os.PathLike,
        progress: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.workload = workload
        self.config = config
        self.dir = Path(out_root) / config.directory_name(workload)
        self.progress = progress

    # -------------------------------------------------------------- state
    def method_dir(self, spec: MethodSpec) -> Path:
        return self.dir / spec.tag

    def method_config(self, spec: MethodSpec) -> dict[str, Any]:
        return {**self.config.to_dict(), "method": spec.name, "method_options": spec.kwargs}

    def is_done(self, spec: MethodSpec) -> bool:
        summary = self.method_dir(spec) / "summary.json"
        if not summary.exists():
            return False
        stored = json.loads(summary.read_text()).get("config")
        if _clean(stored) != _clean(json.loads(json.dumps(self.method_config(spec), default=_json_default))):
            raise ConfigMismatch(
                f"{self.method_dir(spec)} holds a finished run with a different configuration; "
                "use another --out directory or --redo to replace it"
            )
        return True

    def _check_config_dir(self) -> None:
        path = self.dir / "config.json"
        current = json.loads(json.dumps(self.config.to_dict(), default=_json_default))
        if path.exists():
            stored = json.loads(path.read_text()).get("config")
            if stored != current:
                diff = sorted(
                    k for k in set(stored or {}) | set(current) if (stored or {}).get(k) != current.get(k)
                )
                raise ConfigMismatch(
                    f"{self.dir} holds a run with a different configuration (differs in: {', '.join(diff)}); "
                    "use another --out directory or --redo"
                )
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json(path, {"config": current, "environment": environment()})

    # ---------------------------------------------------------------- run
    def tasks(self) -> list[TaskSpec]:
        """The workload's requests; bad data or parameters raise :class:`BenchInputError`."""
        try:
            return self.workload.tasks(self.tokenizer, self.config.seed)
        except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
            raise BenchInputError(f"workload {self.workload.tag()}: {e}") from e

    def run(self, methods: Sequence[MethodSpec], redo: bool = False) -> dict[str, dict[str, Any]]:
        """Run the methods not done yet (NonShared always included) and return every summary of the
        configuration, keyed by method tag."""
        specs = _unique([MethodSpec(REFERENCE), *methods])
        tasks = self.tasks()
        self._check_tasks(tasks, specs)
        if redo and self.dir.exists():
            for spec in specs:
                (self.method_dir(spec) / "summary.json").unlink(missing_ok=True)
            (self.dir / "config.json").unlink(missing_ok=True)
        self._check_config_dir()
        pending = [s for s in specs if not self.is_done(s)]
        skipped = [s for s in specs if s not in pending]
        if skipped:
            print(f"[{self.dir.name}] already done, skipped: {', '.join(map(str, skipped))}")
        if pending:
            self._run_pending(tasks, pending)
        summaries = self.write_configuration_summary()
        return summaries

    def _check_tasks(self, tasks: list[TaskSpec], specs: list[MethodSpec]) -> None:
        if not tasks:
            raise BenchInputError(f"workload {self.workload.tag()} produced no requests")
        if self.config.warmup >= len(tasks):
            raise BenchInputError(
                f"--warmup {self.config.warmup} leaves no request to measure: workload {self.workload.tag()} "
                f"has {len(tasks)}; ask for more requests (--limit / --requests) or a smaller warm-up"
            )
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

    def _run_pending(self, tasks: list[TaskSpec], pending: list[MethodSpec]) -> None:
        ref_spec = MethodSpec(REFERENCE)
        fidelity = self.config.fidelity
        # two instances per method, kept for the whole run: one for the timed pass, one for fidelity
        instances = {}
        for spec in _unique([ref_spec, *pending]):
            try:  # bad options or a method that cannot run on this model: an error before any output
                instances[spec] = (spec.create(), spec.create() if fidelity else None)
                with warnings.catch_warnings():  # the sessions attach again and warn then
                    warnings.simplefilter("ignore")
                    for method in filter(None, instances[spec]):
                        method.attach(self.model)
            except ValueError as e:
                raise BenchInputError(f"method {spec}: {e}") from e
        writers = {}
        for spec in pending:
            d = self.method_dir(spec)
            d.mkdir(parents=True, exist_ok=True)
            write_json(d / "config.json", {"config": self.method_config(spec), "environment": environment()})
            writers[spec] = (open(d / "turns.jsonl", "w"), open(d / "requests.jsonl", "w"))
        collected: dict[MethodSpec, tuple[list, list]] = {s: ([], []) for s in pending}
        self._warm_up()
        try:
            bar = tqdm(tasks, desc=self.dir.name[:60], disable=not self.progress, unit="request")
            for index, task in enumerate(bar):
                free, forced, state = self._run_request(task, index, instances)
                if index < self.config.warmup:  # state built, nothing recorded
                    del free, forced
                    continue
                ref_check = self._check(task, free[ref_spec])
                for spec in pending:
                    turn_records = self._turn_records(
                        task, index, spec, free[spec], free[ref_spec], forced.get(spec), forced.get(ref_spec)
                    )
                    request_record = self._request_record(
                        task, index, spec, free[spec], free[ref_spec], ref_check, state[spec]
                    )
                    turns_f, requests_f = writers[spec]
                    for r in turn_records:
                        turns_f.write(json.dumps(_clean(r)) + "\n")
                    requests_f.write(json.dumps(_clean(request_record)) + "\n")
                    turns_f.flush()
                    requests_f.flush()
                    collected[spec][0].extend(turn_records)
                    collected[spec][1].append(request_record)
                del free, forced  # the kept caches go before the next request runs
        finally:
            for turns_f, requests_f in writers.values():
                turns_f.close()
                requests_f.close()
        for spec in pending:
            turns, requests = collected[spec]
            summary = metrics.summarize_method(turns, requests)
            summary.update({"method": str(spec), "tag": spec.tag, "config": self.method_config(spec)})
            write_json(self.method_dir(spec) / "summary.json", _clean(summary))

    def _run_request(
        self, task: TaskSpec, index: int, instances: dict[MethodSpec, tuple[Method, Method | None]]
    ):
        """One request through every method: free passes (NonShared first), then the teacher-forced
        passes on NonShared's outputs. Returns (free, forced, state) keyed by method spec; state holds
        the bytes a method keeps across requests and those the request's session kept for reuse
        (:meth:`Session.held_bytes`, free pass)."""
        workflow = task.to_workflow(self.tokenizer)
        seed = self.config.seed + index
        state: dict[MethodSpec, dict[str, int]] = {}

        def run(spec: MethodSpec, method: Method, label: str, force=None) -> list[TurnResult]:
            torch.manual_seed(seed)
            session = Session(self.model, self.tokenizer, method)
            results = run_request(
                session,
                workflow,
                force_outputs=force,
                keep_cache=force is not None,
                progress=self.progress,
                desc=f"{label} {task.id}",
            )
            if force is None:
                state[spec] = {
                    "method_state_bytes": method.state_bytes(),
                    "request_state_bytes": session.held_bytes(),
                }
            return results

        free = {spec: run(spec, pair[0], f"{spec} free") for spec, pair in instances.items()}
        forced: dict[MethodSpec, list[TurnResult]] = {}
        if self.config.fidelity:
            outputs = [t.output_ids for t in free[MethodSpec(REFERENCE)]]
            forced = {spec: run(spec, pair[1], f"{spec} forced", outputs) for spec, pair in instances.items()}
        return free, forced, state

    def _check(self, task: TaskSpec, results: list[TurnResult]) -> dict[str, Any]:
        return metrics.check_answer(
            task, results[-1].text, execute=self.config.execute, timeout=self.config.exec_timeout
        )

    # ------------------------------------------------------------ records
    def _turn_records(self, task, index, spec, free, ref_free, forced, ref_forced) -> list[dict[str, Any]]:
        reusable = task.reused_slots()
        records = []
        for k, (f, rf) in enumerate(zip(free, ref_free)):
            slots = reusable[k]
            reusable_ph = sum(s.length for s in f.segments if s.kind == "PH" and s.name in slots)
            rec: dict[str, Any] = {
                "request": task.id,
                "request_index": index,
                "position": k,
                "agent": task.schedule[k].agent,
                "output_slot": f.output_slot,
                "reuse_turn": bool(slots),
                **{key: value for key, value in f.metrics().items() if key != "agent"},
                "method": str(spec),
                "reusable_ph_tokens": reusable_ph,
                "reuse_ratio": metrics.reuse_ratio(min(f.tokens_reused, reusable_ph), reusable_ph)
                if reusable_ph
                else None,
                "reuse_ratio_all_ph": f.reuse_ratio,
                "ref_ttft_s": rf.ttft_s,
                "ref_e2e_s": rf.e2e_s,
                "exact_match": metrics.exact_match(f.output_ids, rf.output_ids),
                "common_prefix_tokens": metrics.common_prefix(f.output_ids, rf.output_ids),
                "output_text": f.text,
                "output_ids": f.output_ids.tolist(),
                "segments": [
                    {
                        "name": s.name,
                        "kind": s.kind,
                        "start": s.start,
                        "end": s.end,
                        "provenance": s.provenance,
                        "source_agent": s.source_agent,
                        "info": s.info,
                    }
                    for s in f.segments
                ],
            }
            if forced is not None:
                rec.update(self._fidelity(forced[k], ref_forced[k], slots))
            records.append(rec)
        return records

    def _fidelity(self, turn: TurnResult, ref: TurnResult, slots: set[str]) -> dict[str, Any]:
        by_segment, ph_terms, reusable_terms = [], [], []
        for seg in turn.segments:
            terms = metrics.kv_error_terms(turn.cache, ref.cache, seg.start, seg.end)
            rel = metrics.relative_from_terms(terms)
            by_segment.append(
                {
                    "name": seg.name,
                    "kind": seg.kind,
                    "provenance": seg.provenance,
                    "source_agent": seg.source_agent,
                    "tokens": seg.length,
                    "kv_error": rel["kv"],
                }
            )
            if seg.kind == "PH":
                ph_terms.append(terms)
                if seg.name in slots:
                    reusable_terms.append(terms)
        out: dict[str, Any] = {
            "agreement": top1_agreement(ref.logits, turn.logits),
            "first_token_agreement": metrics.first_token_agreement(ref.logits, turn.logits),
            "kl": mean_kl(ref.logits, turn.logits),
            "kv_error": metrics.relative_from_terms([t for terms in ph_terms for t in terms])["kv"]
            if ph_terms
            else None,
            "kv_error_by_segment": by_segment,
            "forced_tokens_reused": turn.tokens_reused,
        }
        if reusable_terms:
            layers = len(reusable_terms[0])
            per_layer = [
                metrics.relative_from_terms([terms[i] for terms in reusable_terms]) for i in range(layers)
            ]
            out["kv_error_by_layer"] = [[round(r["key"], 6), round(r["value"], 6)] for r in per_layer]
            if self.config.erank:
                out["erank_by_layer"] = self._erank(turn, ref, slots)
        return out

    def _erank(self, turn: TurnResult, ref: TurnResult, slots: set[str]) -> list[list[float]]:
        rows = None
        segments = [s for s in turn.segments if s.kind == "PH" and s.name in slots and s.length > 1]
        for seg in segments:
            ranks = metrics.erank_by_layer(turn.cache, ref.cache, seg.start, seg.end)
            values = [[r["base_key"], r["base_value"], r["delta_key"], r["delta_value"]] for r in ranks]
            rows = values if rows is None else [[a + b for a, b in zip(x, y)] for x, y in zip(rows, values)]
        if rows is None:
            return []
        return [[v / len(segments) for v in row] for row in rows]

    def _request_record(self, task, index, spec, free, ref_free, ref_check, state) -> dict[str, Any]:
        tokens = sum(t.prompt_ids.numel() + t.output_ids.numel() for t in free)
        ref_tokens = sum(t.prompt_ids.numel() + t.output_ids.numel() for t in ref_free)
        e2e, ref_e2e = sum(t.e2e_s for t in free), sum(t.e2e_s for t in ref_free)
        check = self._check(task, free)
        return {
            "request": task.id,
            "request_index": index,
            "method": str(spec),
            "turns": len(free),
            "trajectory_tokens": tokens,
            "e2e_s": e2e,
            "throughput_tok_s": metrics.throughput(tokens, e2e),
            "ref_trajectory_tokens": ref_tokens,
            "ref_e2e_s": ref_e2e,
            "ref_throughput_tok_s": metrics.throughput(ref_tokens, ref_e2e),
            "peak_memory_bytes": max(t.peak_memory_bytes for t in free),
            "ref_peak_memory_bytes": max(t.peak_memory_bytes for t in ref_free),
            **state,  # method_state_bytes (across requests), request_state_bytes (held by the session)
            "final_exact_match": metrics.exact_match(free[-1].output_ids, ref_free[-1].output_ids),
            "final_output": free[-1].text,
            "correct": check["correct"],
            "check": check,
            "ref_correct": ref_check["correct"],
        }

    # ------------------------------------------------------------ summary
    def load_summaries(self) -> dict[str, dict[str, Any]]:
        """Every finished method summary of this configuration (NonShared first)."""
        current = _clean(json.loads(json.dumps(self.config.to_dict(), default=_json_default)))
        found = {}
        for path in sorted(self.dir.glob("*/summary.json")):
            data = json.loads(path.read_text())
            stored = {
                k: v for k, v in (data.get("config") or {}).items() if k not in ("method", "method_options")
            }
            if _clean(stored) == current:  # a method left from an earlier, different run is not mixed in
                found[path.parent.name] = data
        ordered = dict(sorted(found.items(), key=lambda kv: (kv[0] != REFERENCE, kv[0])))
        return ordered

    def write_configuration_summary(self) -> dict[str, dict[str, Any]]:
        summaries = self.load_summaries()
        rows = [{k: v for k, v in s.items() if k != "config"} for s in summaries.values()]
        write_json(self.dir / "summary.json", {"config": self.config.to_dict(), "methods": rows})
        scalar = [k for k in metrics.SUMMARY_COLUMNS if any(k in r for r in rows)]
        with open(self.dir / "summary.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=scalar, extrasaction="ignore")
            writer.writeheader()
            for r in rows:
                writer.writerow({k: r.get(k) for k in scalar})
        return summaries


def _unique(specs: Sequence[MethodSpec]) -> list[MethodSpec]:
    seen, out = set(), []
    for s in specs:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out

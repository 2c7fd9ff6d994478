"""Calibration: tau for a target reuse ratio, or a method's offline profile.

**tau.** The seeds tune tau by hand per workload to land near rho = 0.8 (LLM) / 0.6 (VLM).
For a method with a ``tau`` option (KVCMAS, KVComm, ...), :func:`calibrate_tau` runs the free-running pass of
the method over a calibration slice for a few values of tau (a fresh method instance each time, so
every value starts from empty pools, as a real run does) and bisects on the realized rho, which
grows with tau.

**Offline profiles.** A method with a ``fit_profile(transitions)`` method (DroidSpeak's
per-layer deviation) is profiled on the calibration slice by :func:`calibrate_profile`; the bench
saves the profile as JSON, which the method takes back as an option (``droidspeak:layer_profile=PATH``).
Profile on other requests than the ones evaluated (``--offset``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..evaluation import calibrate_droidspeak, has_offline_profile, run_workflow
from ..evaluation.metrics import reuse_ratio
from ..session import Session
from .methods import MethodSpec
from .runner import write_json
from .workloads import TaskSpec


@dataclass
class Calibration:
    method: str
    target_rho: float
    tau: float
    rho: float
    evaluations: list[tuple[float, float]] = field(default_factory=list)  # (tau, rho) in the order run
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "evaluations": [{"tau": t, "rho": r} for t, r in self.evaluations]}


def realized_rho(
    model, tokenizer, tasks: list[TaskSpec], spec: MethodSpec, seed: int = 0, progress=False, warmup: int = 0
) -> float:
    """rho (reused / reusable shared tokens) of ``spec`` run free over ``tasks`` with one method instance;
    the first ``warmup`` requests run but are not counted (as ``bench run --warmup``)."""
    if warmup >= len(tasks):
        raise ValueError(f"warmup {warmup} leaves none of the {len(tasks)} calibration request(s) to count")
    method = spec.create()
    reused = reusable = 0
    for index, task in enumerate(tqdm(tasks, desc=f"rho of {spec}", leave=False, disable=not progress)):
        torch.manual_seed(seed + index)
        results = run_workflow(Session(model, tokenizer, method), task.to_workflow(tokenizer))
        if index < warmup:
            continue
        for slots, turn in zip(task.reused_slots(), results):
            n = sum(s.length for s in turn.segments if s.kind == "PH" and s.name in slots)
            reusable += n
            reused += min(turn.tokens_reused, n)
    if reusable == 0:
        raise ValueError("the calibration slice has no reusable shared tokens: use a multi-agent workload")
    return reuse_ratio(reused, reusable)


def calibrate_tau(
    model,
    tokenizer,
    tasks: list[TaskSpec],
    spec: MethodSpec,
    target_rho: float,
    tau_min: float = 0.0,
    tau_max: float = 1.0,
    iterations: int = 6,
    tolerance: float = 0.02,
    seed: int = 0,
    progress: bool = True,
    warmup: int = 0,
) -> Calibration:
    """Bisect tau in ``[tau_min, tau_max]`` until the realized rho is within ``tolerance`` of ``target_rho``
    (or ``iterations`` midpoints were tried); return the tau whose rho came closest. ``warmup``: the
    first requests of each evaluation fill the method's pools and are not counted."""
    if not 0.0 <= target_rho <= 1.0:
        raise ValueError(f"target rho must be within [0, 1], got {target_rho}")
    if not tau_min < tau_max:
        raise ValueError(f"need tau_min < tau_max, got {tau_min} and {tau_max}")
    names = spec.option_names()
    if names is not None and "tau" not in names:
        raise ValueError(
            f"method {spec.name!r} has no `tau` option (its options: {', '.join(names) or 'none'}); "
            "calibration applies to methods with a reliability threshold"
        )
    base = dict(spec.options)
    base.pop("tau", None)
    evaluations: list[tuple[float, float]] = []

    def rho_at(tau: float) -> float:
        options = tuple(sorted({**base, "tau": round(tau, 6)}.items()))
        rho = realized_rho(model, tokenizer, tasks, replace(spec, options=options), seed, progress, warmup)
        evaluations.append((round(tau, 6), rho))
        if progress:
            print(f"  tau={tau:.4f}  rho={rho:.3f}")
        return rho

    lo, hi = tau_min, tau_max
    rho_lo, rho_hi = rho_at(lo), rho_at(hi)
    note = ""
    if rho_lo > rho_hi + 1e-9:
        note = "rho did not grow with tau over the range: the best value tried is reported"
    elif target_rho <= rho_lo or target_rho >= rho_hi:
        note = f"target outside the reachable range [{rho_lo:.3f}, {rho_hi:.3f}]: the nearest end is reported"
    else:
        for _ in range(iterations):
            mid = (lo + hi) / 2
            rho = rho_at(mid)
            if abs(rho - target_rho) <= tolerance:
                break
            if rho < target_rho:
                lo = mid
            else:
                hi = mid
    tau, rho = min(evaluations, key=lambda e: (abs(e[1] - target_rho), e[0]))
    return Calibration(
        method=spec.name, target_rho=target_rho, tau=tau, rho=rho, evaluations=evaluations, note=note
    )


def calibrate_profile(
    model, tokenizer, tasks: list[TaskSpec], spec: MethodSpec, progress: bool = True
) -> dict[str, Any]:
    """Run ``spec``'s offline profiling on ``tasks``; return ``{option name: profile}`` to save."""
    if not has_offline_profile(spec.cls):
        raise ValueError(
            f"method {spec.name!r} has no offline profile (no `fit_profile` method); use --target-rho"
        )
    workflows = [t.to_workflow(tokenizer) for t in tasks]
    profile = calibrate_droidspeak(spec.create(), model, tokenizer, workflows, progress=progress)
    return {"layer_profile": [float(x) for x in profile]}


def save_profile(
    model, tokenizer, tasks: list[TaskSpec], spec: MethodSpec, path: Path, meta: dict, progress: bool = True
) -> dict[str, Any]:
    """:func:`calibrate_profile`, written with ``meta`` to ``path``: the JSON file the method takes back as an option."""
    result = calibrate_profile(model, tokenizer, tasks, spec, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"method": spec.name, **result, **meta})
    return result

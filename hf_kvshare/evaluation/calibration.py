"""Tau calibration: the threshold of a method that reaches a target reuse ratio rho.

The seeds tune tau by hand per workload to land near rho = 0.8 (LLM) / 0.6 (VLM). For a method
with a ``tau`` option (KVCMAS, KVComm, ...), :func:`calibrate_tau` runs the free-running pass of
the method over calibration workflows for a few values of tau (a fresh method instance each time,
so every value starts from empty pools, as a real run does) and bisects on the realized rho, which
grows with tau. (A method profiled offline instead, such as DroidSpeak, is calibrated by
:func:`~hf_kvshare.evaluation.calibrate_droidspeak`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..method import Method, option_names
from ..session import Session
from .metrics import reuse_ratio
from .workflow import Workflow, reusable_slots, run_workflow


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
    model: torch.nn.Module,
    tokenizer: Any,
    workflows: Sequence[Workflow],
    method: Method,
    reusable: Sequence[Sequence[set[str]]] | None = None,
    seed: int = 0,
    progress: bool = False,
    warmup: int = 0,
) -> float:
    """rho (reused / reusable shared tokens) of ``method`` (one instance) run free over ``workflows``.

    ``reusable[i]``: per step of workflow i, the slots that count as reusable (default: those an
    earlier turn read or produced); the first ``warmup`` workflows run but are not counted.
    """
    if warmup >= len(workflows):
        raise ValueError(
            f"warmup {warmup} leaves none of the {len(workflows)} calibration request(s) to count"
        )
    reused = total = 0
    for index, workflow in enumerate(
        tqdm(workflows, desc=f"rho of {method.name}", leave=False, disable=not progress)
    ):
        torch.manual_seed(seed + index)
        results = run_workflow(Session(model, tokenizer, method), workflow)
        if index < warmup:
            continue
        slots_per_turn = reusable[index] if reusable is not None else reusable_slots(results)
        for slots, turn in zip(slots_per_turn, results):
            n = sum(s.length for s in turn.segments if s.kind == "PH" and s.name in slots)
            total += n
            reused += min(turn.tokens_reused, n)
    if total == 0:
        raise ValueError("the calibration slice has no reusable shared tokens: use a multi-agent workload")
    return reuse_ratio(reused, total)


def calibrate_tau(
    model: torch.nn.Module,
    tokenizer: Any,
    workflows: Sequence[Workflow],
    method_cls: type[Method],
    target_rho: float,
    options: dict[str, Any] | None = None,
    reusable: Sequence[Sequence[set[str]]] | None = None,
    tau_min: float = 0.0,
    tau_max: float = 1.0,
    iterations: int = 6,
    tolerance: float = 0.02,
    seed: int = 0,
    progress: bool = True,
    warmup: int = 0,
) -> Calibration:
    """Bisect tau in ``[tau_min, tau_max]`` until the realized rho of ``method_cls(**options, tau=...)``
    is within ``tolerance`` of ``target_rho`` (or ``iterations`` midpoints were tried); return the
    tau whose rho came closest. ``reusable`` and ``warmup`` as in :func:`realized_rho`."""
    if not 0.0 <= target_rho <= 1.0:
        raise ValueError(f"target rho must be within [0, 1], got {target_rho}")
    if not tau_min < tau_max:
        raise ValueError(f"need tau_min < tau_max, got {tau_min} and {tau_max}")
    names = option_names(method_cls)
    if names is not None and "tau" not in names:
        raise ValueError(
            f"method {method_cls.name!r} has no `tau` option (its options: {', '.join(names) or 'none'}); "
            "calibration applies to methods with a reliability threshold"
        )
    base = {k: v for k, v in (options or {}).items() if k != "tau"}
    evaluations: list[tuple[float, float]] = []

    def rho_at(tau: float) -> float:
        try:
            method = method_cls(**base, tau=round(tau, 6))
        except (TypeError, ValueError) as e:
            raise ValueError(f"creating method {method_cls.name} with tau={tau:g}: {e}") from e
        rho = realized_rho(model, tokenizer, workflows, method, reusable, seed, progress, warmup)
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
        method=method_cls.name, target_rho=target_rho, tau=tau, rho=rho, evaluations=evaluations, note=note
    )

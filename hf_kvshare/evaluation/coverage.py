"""Reconstruction coverage of selective recomputation (the KVCMAS paper's Appendix A.1, Table 2).

For every reuse transition of a workload (a PH segment an agent reads after an earlier turn
materialized it, see :mod:`~hf_kvshare.evaluation.transitions`), the reuse error is the difference
between the reused K/V (moved to the agent's positions) and the agent's exact K/V. Following the
paper, each (layer, keys|values) tensor's error is normalized by the norm of the exact tensor, so
an entry ``u = (layer, token)`` carries the error energy

    e[l, t] = sum over K and V of ||C_reused[l][t] - C_exact[l][t]||^2 / ||C_exact[l]||^2.

A selection criterion picks a set ``T`` of entries under a budget of ``(1 - rho)`` of all entries;
recomputing ``T`` exactly (Eq. 3) removes ``sum_{u in T} e[u]``. **Coverage** is that removed
energy over the total, pooled over all transitions; **random coverage** is the same for uniformly
random selections of the same shape and budget (sampled), and **relative coverage** their ratio.
Coverage is a fraction of squared error, so random selection of a fraction ``f`` covers ``f`` in
expectation; in norm terms the remaining relative error is ``sqrt(1 - coverage)`` of FullShared's.

Criteria, each the selection code of the corresponding method (selection only: the recomputation
itself is taken as exact, which isolates the criterion from the execution):

- ``layer``: whole layers with the largest offline-profiled deviation (DroidSpeak's layer groups),
  ``round((1 - rho) * L)`` layers x all tokens;
- ``deviation``: tokens with the largest KV deviation at CacheBlend's check layer(s),
  ``round((1 - rho) * S)`` tokens x all layers;
- ``attention``: tokens receiving the most attention at RelayCaching's check layer, same budget;
- ``relaycaching``: RelayCaching's own set, tokens by deviation x attention inside its layer band.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from tqdm.auto import tqdm

from ..cache import SegmentKV
from ..methods.cacheblend import CacheBlend
from ..methods.droidspeak import DroidSpeak
from ..methods.relaycaching import RelayCaching
from ..recompute.layers import SegmentRecompute
from ..recompute.selection import top_k
from ..recompute.stack import DecoderStack
from .metrics import relative_error
from .transitions import ReuseTransition, calibrate_droidspeak, collect_transitions

CRITERIA = ("layer", "deviation", "attention", "relaycaching")
SELECTS = {
    "layer": "layers x all tokens",
    "deviation": "tokens x all layers",
    "attention": "tokens x all layers",
    "relaycaching": "tokens x band layers",
}


def entry_errors(reused: SegmentKV, exact: SegmentKV) -> torch.Tensor:
    """Normalized squared reuse error per entry ``[L, S]`` (float64).

    ``e[l, t] = sum_{X in K, V} ||X_reused[l][..., t, :] - X_exact[l][..., t, :]||^2 / ||X_exact[l]||^2``.
    """
    if reused.num_layers != exact.num_layers or reused.length != exact.length:
        raise ValueError(
            f"reused ({reused.num_layers} layers x {reused.length} tokens) and exact "
            f"({exact.num_layers} x {exact.length}) K/V must have the same shape"
        )
    rows = []
    for layer in range(exact.num_layers):
        row = torch.zeros(exact.length, dtype=torch.float64)
        for a, b in ((reused.keys[layer], exact.keys[layer]), (reused.values[layer], exact.values[layer])):
            a, b = a.double().cpu(), b.double().cpu()
            denom = b.pow(2).sum()
            per_token = (a - b).pow(2).sum(dim=(0, 1, 3))
            row += per_token / denom if denom > 0 else per_token
        rows.append(row)
    return torch.stack(rows)


@dataclass
class CriterionCoverage:
    """Coverage of one criterion, pooled over transitions (energies are normalized squared errors)."""

    criterion: str
    selects: str
    removed: float = 0.0  # error energy removed by the criterion's selection
    random_removed: float = 0.0  # mean error energy removed by random selections of the same shape
    total: float = 0.0  # total reuse error energy
    entries: int = 0  # entries selected
    all_entries: int = 0  # entries in all transitions

    def add(
        self, removed: float, random_removed: float, total: float, entries: int, all_entries: int
    ) -> None:
        self.removed += removed
        self.random_removed += random_removed
        self.total += total
        self.entries += entries
        self.all_entries += all_entries

    @property
    def coverage(self) -> float:
        return self.removed / self.total if self.total > 0 else float("nan")

    @property
    def random_coverage(self) -> float:
        return self.random_removed / self.total if self.total > 0 else float("nan")

    @property
    def relative(self) -> float:
        return self.coverage / self.random_coverage if self.random_coverage > 0 else float("nan")

    @property
    def budget(self) -> float:
        """Fraction of all entries selected (``1 - rho`` up to rounding)."""
        return self.entries / self.all_entries if self.all_entries else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "coverage": self.coverage,
            "random_coverage": self.random_coverage,
            "relative_coverage": self.relative,
            "budget": self.budget,
        }


@dataclass
class CoverageReport:
    """Result of :func:`reconstruction_coverage`."""

    rho: float
    transitions: int
    rows: dict[str, CriterionCoverage]
    layer_profile: list[float]
    layer_groups: list[tuple[int, int]]
    band: tuple[int, int]
    mean_reuse_error: float  # mean over transitions of FullShared's relative KV error (norm)
    per_transition: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rho": self.rho,
            "transitions": self.transitions,
            "criteria": {name: row.to_dict() for name, row in self.rows.items()},
            "layer_profile": self.layer_profile,
            "layer_groups": self.layer_groups,
            "band": list(self.band),
            "mean_reuse_error": self.mean_reuse_error,
            "per_transition": self.per_transition,
        }

    def to_markdown(self) -> str:
        lines = [
            f"rho = {self.rho} ({self.transitions} transitions; FullShared relative KV error "
            f"{self.mean_reuse_error:.3f} on average)",
            "",
            "| criterion | selects | budget | coverage | random coverage | relative coverage |",
            "|---|---|---|---|---|---|",
        ]
        for row in self.rows.values():
            lines.append(
                f"| {row.criterion} | {row.selects} | {row.budget:.3f} | {row.coverage:.3f} | "
                f"{row.random_coverage:.3f} | {row.relative:.2f}x |"
            )
        return "\n".join(lines)


def reconstruction_coverage(
    model: torch.nn.Module,
    tokenizer: Any,
    workflows: Sequence[Any],
    *,
    rho: float = 0.9,
    calibration: Sequence[Any] = (),
    droidspeak: DroidSpeak | None = None,
    cacheblend: CacheBlend | None = None,
    relaycaching: RelayCaching | None = None,
    transitions: Sequence[ReuseTransition] | None = None,
    random_trials: int = 64,
    seed: int = 0,
    progress: bool = False,
) -> CoverageReport:
    """Measure each criterion's reconstruction coverage on ``workflows`` at reuse ratio ``rho``.

    Args:
        workflows: :class:`~hf_kvshare.evaluation.Workflow` objects, run with dense prefill.
        rho: reuse ratio; each criterion selects ``(1 - rho)`` of the entries.
        calibration: workflows for DroidSpeak's offline layer profile (keep them apart from
            ``workflows``); not needed when ``droidspeak`` already has a profile.
        droidspeak / cacheblend / relaycaching: method instances whose knobs to use (copied, with
            ``rho`` set to ``rho``); defaults use each method's defaults.
        transitions: already collected transitions of ``workflows`` (they must carry the hidden
            states of RelayCaching's band start); collected when ``None``.
        random_trials: random selections sampled per transition and criterion.
        seed: seed of the random selections.

    >>> report = reconstruction_coverage(model, tok, eval_workflows, rho=0.9, calibration=calib)  # doctest: +SKIP
    >>> print(report.to_markdown())  # doctest: +SKIP
    """
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1]; got {rho}")
    if random_trials < 1:
        raise ValueError(f"random_trials must be >= 1; got {random_trials}")
    stack = DecoderStack(model)
    L = stack.num_layers
    droidspeak = _configured(droidspeak, DroidSpeak, rho)
    cacheblend = _configured(cacheblend, CacheBlend, rho)
    relaycaching = _configured(relaycaching, RelayCaching, rho)
    if droidspeak.layer_profile is None and 0 < droidspeak.layers_to_recompute(L) < L:
        if not calibration:
            raise ValueError(
                "the layer criterion needs DroidSpeak's offline profile: pass calibration workflows "
                "(apart from the measured ones) or a calibrated `droidspeak`"
            )
        calibrate_droidspeak(droidspeak, model, tokenizer, calibration, progress=progress)
    for method in (droidspeak, cacheblend, relaycaching):
        method.bind(model)
    groups = droidspeak.layer_groups(L)
    layers = [layer for start, end in groups for layer in range(start, end)]
    band = relaycaching.band_layers(L)
    if transitions is None:
        hidden_layers = [band[0]] if band[0] > 0 else []
        transitions = collect_transitions(model, tokenizer, workflows, hidden_layers, progress=progress)
    if not transitions:
        raise ValueError(
            "the workflows have no reuse transition (no agent reads a PH slot an earlier turn materialized)"
        )

    generator = torch.Generator().manual_seed(seed)
    rows = {name: CriterionCoverage(name, SELECTS[name]) for name in CRITERIA}
    per_transition = []
    errors = []
    for t in tqdm(transitions, desc="transitions", disable=not progress):
        e = entry_errors(t.reused, t.exact)  # [L, S]
        S = t.length
        total = float(e.sum())
        errors.append(_relative_error(t.reused, t.exact))
        record = {"workflow": t.workflow, "turn": t.turn, "slot": t.slot, "tokens": S, "total": total}

        # layer selection (DroidSpeak): layers x all tokens
        removed = float(e[layers].sum()) if layers else 0.0
        rand = _random_layers(e, len(layers), random_trials, generator)
        rows["layer"].add(removed, rand, total, len(layers) * S, L * S)
        record["layer"] = removed

        # deviation selection (CacheBlend): tokens x all layers
        k = cacheblend.tokens_to_recompute(S)
        chosen = _cacheblend_tokens(cacheblend, stack, t) if k else torch.zeros(0, dtype=torch.long)
        removed = float(e[:, chosen].sum())
        rand = _random_tokens(e, k, random_trials, generator)
        rows["deviation"].add(removed, rand, total, k * L, L * S)
        record["deviation"] = removed

        # attention selection (RelayCaching's importance alone): tokens x all layers
        scores = _relaycaching_scores(relaycaching, stack, t, band[0])
        chosen = top_k(scores["attention"], k)
        removed = float(e[:, chosen].sum())
        rows["attention"].add(
            removed, rand, total, k * L, L * S
        )  # same shape as deviation: same random draws
        record["attention"] = removed

        # RelayCaching as configured: deviation x attention, inside its (possibly widened) band
        a, b, k_band = relaycaching.recompute_plan(S, L)
        if k_band:
            if a != band[0]:
                scores = _relaycaching_scores(relaycaching, stack, t, a)
            chosen = top_k(scores["deviation"] * scores["attention"], k_band)
            removed = float(e[a:b][:, chosen].sum())
        else:
            removed = 0.0
        rand = _random_tokens(e[a:b], k_band, random_trials, generator)
        rows["relaycaching"].add(removed, rand, total, k_band * (b - a), L * S)
        record["relaycaching"] = removed
        per_transition.append(record)

    return CoverageReport(
        rho=rho,
        transitions=len(transitions),
        rows=rows,
        layer_profile=list(droidspeak.layer_profile or []),
        layer_groups=groups,
        band=band,
        mean_reuse_error=sum(errors) / len(errors),
        per_transition=per_transition,
    )


def _configured(method, cls, rho: float):
    """A copy of ``method`` (or a default instance) at reuse ratio ``rho``; the caller's instance is untouched."""
    if method is None:
        return cls(rho=rho)
    if not isinstance(method, cls):
        raise TypeError(f"expected a {cls.__name__} instance, got {type(method).__name__}")
    return replace(method, rho=rho)


def _engine(stack: DecoderStack, t: ReuseTransition) -> SegmentRecompute:
    return SegmentRecompute(stack, t.prefix, t.reused, t.token_ids)


def _cacheblend_tokens(method: CacheBlend, stack: DecoderStack, t: ReuseTransition) -> torch.Tensor:
    _, rows, _ = method.select_tokens(_engine(stack, t))
    return rows.cpu()


def _relaycaching_scores(
    method: RelayCaching, stack: DecoderStack, t: ReuseTransition, start: int
) -> dict[str, torch.Tensor]:
    engine = _engine(stack, t)
    if start == 0:
        hidden = engine.embeddings()
    elif start in t.source_hidden:
        hidden = t.source_hidden[start].to(stack.device)
    else:
        raise ValueError(
            f"transition {t.slot!r} (turn {t.turn}) keeps no input hidden state of layer {start}; "
            f"collect transitions with hidden_layers=[{start}]"
        )
    _, _, scores = method.check(engine, hidden, start, keep=None)
    return {name: value.cpu() for name, value in scores.items()}


def _random_tokens(e: torch.Tensor, k: int, trials: int, generator: torch.Generator) -> float:
    if k == 0:
        return 0.0
    per_token = e.sum(dim=0)
    S = per_token.numel()
    return (
        sum(float(per_token[torch.randperm(S, generator=generator)[:k]].sum()) for _ in range(trials))
        / trials
    )


def _random_layers(e: torch.Tensor, n: int, trials: int, generator: torch.Generator) -> float:
    if n == 0:
        return 0.0
    per_layer = e.sum(dim=1)
    L = per_layer.numel()
    return (
        sum(float(per_layer[torch.randperm(L, generator=generator)[:n]].sum()) for _ in range(trials))
        / trials
    )


def _relative_error(reused: SegmentKV, exact: SegmentKV) -> float:
    """Relative error of K and V together over all layers (:func:`~hf_kvshare.evaluation.metrics.relative_error`)."""

    def flat(kv: SegmentKV) -> torch.Tensor:
        return torch.cat([t.flatten() for t in (*kv.keys, *kv.values)])

    return relative_error(flat(reused), flat(exact))

"""The paired evaluation protocol, the one place it is written.

For one request (a :class:`~hf_kvshare.evaluation.workflow.Workflow`) every method runs twice, each
time in a fresh :class:`~hf_kvshare.session.Session`:

- **free-running**: greedy generation, timed (TTFT, E2E), reuse counted, outputs recorded;
- **teacher-forced** on NonShared's free-running outputs (``fidelity=True``), so every method sees
  identical prompts: top-1 agreement, first-token agreement, KL, relative KV error against
  NonShared's exact cache by segment and by layer, effective ranks of exact blocks and residuals.

NonShared (the reference) runs first. A method is a :class:`MethodPair`: one instance for the free
pass and one for the forced pass, so state that outlives a request (anchor pools, calibration)
builds up across requests as in a deployment, and the fidelity pass does not feed the timed pass.
:func:`run_paired` runs one request; :func:`turn_records` / :func:`request_record` turn its results
into flat records and :func:`summarize_method` aggregates them. :func:`compare_methods` (the demo)
and :class:`~hf_kvshare.bench.runner.BenchRunner` (the bench) are both built on these.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..measure import PHASES
from ..method import Method, get_method
from ..session import Session
from ..turn import TurnResult
from . import metrics as M
from .workflow import Workflow, reusable_slots, run_workflow

REFERENCE = "nonshared"


@dataclass
class MethodPair:
    """A method under evaluation: ``free`` runs the timed pass, ``forced`` (when fidelity is
    measured) the teacher-forced pass. ``label`` names it in results (e.g. ``kvcmas:tau=0.2``)."""

    label: str
    free: Method
    forced: Method | None = None

    @classmethod
    def create(cls, method: str | Method, fidelity: bool = True, label: str | None = None) -> MethodPair:
        """A registry name gets a fresh instance per pass; an instance is used for both passes."""
        if isinstance(method, str):
            return cls(label or method, get_method(method), get_method(method) if fidelity else None)
        return cls(label or method.name, method, method if fidelity else None)


@dataclass
class RequestRun:
    """One request through every method: turn results keyed by label, NonShared first."""

    free: dict[str, list[TurnResult]]
    forced: dict[str, list[TurnResult]] = field(default_factory=dict)
    #: per label: bytes the method keeps across requests and bytes the free session held for reuse
    state: dict[str, dict[str, int]] = field(default_factory=dict)
    reference: str = REFERENCE

    def release_caches(self) -> None:
        """Drop the teacher-forced caches (kept only while fidelity is measured)."""
        for results in self.forced.values():
            for turn in results:
                turn.cache = None


def run_paired(
    model: Any,
    tokenizer: Any,
    workflow: Workflow,
    pairs: Sequence[MethodPair],
    *,
    fidelity: bool = True,
    seed: int | None = None,
    progress: bool = False,
    tensor_memory: bool = False,
    processor: Any = None,
) -> RequestRun:
    """Run ``workflow`` with every pair (``pairs[0]`` is the reference, NonShared): all free passes,
    then, with ``fidelity``, all passes teacher-forced on the reference's outputs (caches kept).
    ``processor``: a vision-language model's processor, for image / video segments (the sessions')."""
    if not pairs or pairs[0].free.name != REFERENCE:
        raise ValueError(
            f"the first method pair must be the reference {REFERENCE!r}; got {[p.label for p in pairs]}"
        )
    if len({p.label for p in pairs}) != len(pairs):
        raise ValueError(f"method labels must be unique; got {[p.label for p in pairs]}")
    run = RequestRun(free={}, reference=pairs[0].label)

    def one(pair: MethodPair, method: Method, pass_name: str, force=None) -> list[TurnResult]:
        if seed is not None:
            torch.manual_seed(seed)
        # the tensor peak (a profiler) only on the free pass, whose times it then inflates
        session = Session(
            model, tokenizer, method, tensor_memory=tensor_memory and force is None, processor=processor
        )
        results = run_workflow(
            session,
            workflow,
            force_outputs=force,
            keep_cache=force is not None,
            progress=progress,
            desc=f"{pair.label} {pass_name}",
        )
        if force is None:
            run.state[pair.label] = {
                "method_state_bytes": method.state_bytes(),
                "request_state_bytes": session.held_bytes(),
            }
        return results

    for pair in pairs:
        run.free[pair.label] = one(pair, pair.free, "free")
    if fidelity:
        outputs = [t.output_ids for t in run.free[run.reference]]
        for pair in pairs:
            if pair.forced is None:
                raise ValueError(f"method {pair.label!r} has no instance for the teacher-forced pass")
            run.forced[pair.label] = one(pair, pair.forced, "forced", outputs)
    return run


# ------------------------------------------------------------------ records
def turn_fidelity(
    turn: TurnResult, ref: TurnResult, slots: set[str] | None = None, erank: bool = False
) -> dict[str, Any]:
    """Fidelity of one teacher-forced turn against NonShared's (both run with ``keep_cache=True``).

    ``kv_error`` is the relative error over the union of the turn's PH segments; ``kv_error_by_layer``
    (and ``erank_by_layer`` with ``erank``) cover the reusable segments ``slots`` (all PH when None).
    """
    by_segment, ph_terms, reusable_terms = [], [], []
    for seg in turn.segments:
        terms = M.kv_error_terms(turn.cache, ref.cache, seg.start, seg.end)
        by_segment.append(
            {
                "name": seg.name,
                "kind": seg.kind,
                "provenance": seg.provenance,
                "source_agent": seg.source_agent,
                "tokens": seg.length,
                "kv_error": M.relative_from_terms(terms)["kv"],
            }
        )
        if seg.kind == "PH":
            ph_terms.append(terms)
            if slots is None or seg.name in slots:
                reusable_terms.append(terms)
    out: dict[str, Any] = {
        "agreement": M.top1_agreement(ref.logits, turn.logits),
        "first_token_agreement": M.first_token_agreement(ref.logits, turn.logits),
        "kl": M.mean_kl(ref.logits, turn.logits),
        "kv_error": M.relative_from_terms([t for terms in ph_terms for t in terms])["kv"]
        if ph_terms
        else None,
        "kv_error_by_segment": by_segment,
        "forced_tokens_reused": turn.tokens_reused,
    }
    if reusable_terms:
        layers = len(reusable_terms[0])
        per_layer = [M.relative_from_terms([terms[i] for terms in reusable_terms]) for i in range(layers)]
        out["kv_error_by_layer"] = [[round(r["key"], 6), round(r["value"], 6)] for r in per_layer]
        if erank:
            out["erank_by_layer"] = _erank(turn, ref, slots)
    return out


def _erank(turn: TurnResult, ref: TurnResult, slots: set[str] | None) -> list[list[float]]:
    rows = None
    segments = [
        s for s in turn.segments if s.kind == "PH" and (slots is None or s.name in slots) and s.length > 1
    ]
    for seg in segments:
        ranks = M.erank_by_layer(turn.cache, ref.cache, seg.start, seg.end)
        values = [[r["base_key"], r["base_value"], r["delta_key"], r["delta_value"]] for r in ranks]
        rows = values if rows is None else [[a + b for a, b in zip(x, y)] for x, y in zip(rows, values)]
    if rows is None:
        return []
    return [[v / len(segments) for v in row] for row in rows]


def turn_records(
    run: RequestRun,
    label: str,
    *,
    reusable: list[set[str]] | None = None,
    agents: Sequence[str] | None = None,
    erank: bool = False,
) -> list[dict[str, Any]]:
    """One flat record per turn of ``label`` in ``run``: speed, reuse, provenance, outputs against
    NonShared, and (when the forced pass ran) :func:`turn_fidelity`. ``reusable[k]``: the slots turn
    k reads that an earlier turn read or produced (default: from the reference's turns)."""
    free, ref_free = run.free[label], run.free[run.reference]
    forced, ref_forced = run.forced.get(label), run.forced.get(run.reference)
    reusable = reusable if reusable is not None else reusable_slots(ref_free)
    records = []
    for k, (f, rf) in enumerate(zip(free, ref_free)):
        slots = reusable[k]
        reusable_ph = sum(s.length for s in f.segments if s.kind == "PH" and s.name in slots)
        rec: dict[str, Any] = {
            "position": k,
            "agent": agents[k] if agents is not None else f.agent,
            "output_slot": f.output_slot,
            "reuse_turn": bool(slots),
            **{key: value for key, value in f.metrics().items() if key != "agent"},
            "method": label,
            "reusable_ph_tokens": reusable_ph,
            "reuse_ratio": M.reuse_ratio(min(f.tokens_reused, reusable_ph), reusable_ph)
            if reusable_ph
            else None,
            "reuse_ratio_all_ph": f.reuse_ratio,
            "ref_ttft_s": rf.ttft_s,
            "ref_e2e_s": rf.e2e_s,
            "exact_match": M.exact_match(f.output_ids, rf.output_ids),
            "common_prefix_tokens": M.common_prefix(f.output_ids, rf.output_ids),
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
            rec.update(turn_fidelity(forced[k], ref_forced[k], slots, erank=erank))
        records.append(rec)
    return records


def request_record(run: RequestRun, label: str) -> dict[str, Any]:
    """One flat record of ``label``'s whole request: E2E, throughput, memory, state bytes, final output."""
    free, ref_free = run.free[label], run.free[run.reference]
    tokens = sum(t.prompt_ids.numel() + t.output_ids.numel() for t in free)
    ref_tokens = sum(t.prompt_ids.numel() + t.output_ids.numel() for t in ref_free)
    e2e, ref_e2e = sum(t.e2e_s for t in free), sum(t.e2e_s for t in ref_free)
    return {
        "method": label,
        "turns": len(free),
        "trajectory_tokens": tokens,
        "e2e_s": e2e,
        "throughput_tok_s": M.throughput(tokens, e2e),
        "ref_trajectory_tokens": ref_tokens,
        "ref_e2e_s": ref_e2e,
        "ref_throughput_tok_s": M.throughput(ref_tokens, ref_e2e),
        "peak_memory_bytes": max(t.peak_memory_bytes for t in free),
        "ref_peak_memory_bytes": max(t.peak_memory_bytes for t in ref_free),
        "tensor_peak_bytes": _max_or_none(t.tensor_peak_bytes for t in free),
        "ref_tensor_peak_bytes": _max_or_none(t.tensor_peak_bytes for t in ref_free),
        **run.state.get(label, {}),  # method_state_bytes (across requests), request_state_bytes (session)
        "final_exact_match": M.exact_match(free[-1].output_ids, ref_free[-1].output_ids),
        "final_output": free[-1].text,
    }


def _max_or_none(values: Iterable[Any]) -> Any:
    """The largest value, ``None`` when any is ``None`` (not measured) or there are none."""
    values = list(values)
    return None if not values or any(v is None for v in values) else max(values)


# ------------------------------------------------------------------ summary
#: the scalar columns of a method summary (``summary.csv``), in order
SUMMARY_COLUMNS = [
    "method",
    "requests",
    "turns",
    "reuse_turns",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ref_ttft_mean_s",
    "ttft_ratio",
    "ttft_p50_ratio",
    "ttft_p90_ratio",
    "ttft_all_mean_s",
    "e2e_mean_s",
    "ref_e2e_mean_s",
    "e2e_ratio",
    "throughput_tok_s",
    "ref_throughput_tok_s",
    "throughput_ratio",
    "peak_memory_mb",
    "ref_peak_memory_mb",
    "tensor_peak_mb",
    "ref_tensor_peak_mb",
    "method_state_mb",
    "request_state_mb",
    *(f"{name}_mean_s" for name in PHASES),
    "reuse_ratio",
    "reuse_ratio_all_ph",
    "paper_reuse_ratio",
    "corrected_share",
    "uncorrected_share",
    "recomputed_share",
    "prefilled_share",
    "uncorrected_run",
    "agreement",
    "first_token_agreement",
    "kl",
    "kv_error",
    "exact_match",
    "final_exact_match",
    "accuracy",
    "ref_accuracy",
    "checked",
]


def ttft_summary(turns: Iterable[dict[str, Any]]) -> dict[str, float]:
    """TTFT statistics of ``turns`` (records with ``ttft_s`` and NonShared's ``ref_ttft_s``): the
    method's mean / p50 / p90, NonShared's mean and NonShared / method at each (> 1: faster). The
    summary of a method (over its reuse turns) and the bench's ``limit`` row both use it."""
    turns = list(turns)
    ttft = M.latency_stats(t["ttft_s"] for t in turns)
    ref = M.latency_stats(t["ref_ttft_s"] for t in turns)
    return {
        "ttft_mean_s": ttft["mean"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p90_s": ttft["p90"],
        "ref_ttft_mean_s": ref["mean"],
        "ttft_ratio": M.ratio(ref["mean"], ttft["mean"]),
        "ttft_p50_ratio": M.ratio(ref["p50"], ttft["p50"]),
        "ttft_p90_ratio": M.ratio(ref["p90"], ttft["p90"]),
    }


def summarize_method(turns: Sequence[dict[str, Any]], requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate a method's per-turn and per-request records (as written to ``turns.jsonl`` /
    ``requests.jsonl``) into its summary.

    TTFT statistics and fidelity are over *reuse turns* (turns that read a slot an earlier turn
    read or produced; all turns when a workload has none); ``*_all_turns`` fidelity is over every
    turn, and ``approximated_first_reads`` counts the turns outside the reuse turns a method did
    not compute exactly (corrected or reused shared tokens); ``ttft_ratio`` is NonShared's mean TTFT
    over the same turns, measured in the same run, divided by the method's (> 1: faster).
    rho = reused / reusable shared tokens over all turns.
    """
    if not turns or not requests:
        raise ValueError("no records to summarize")
    reuse = [t for t in turns if t.get("reuse_turn")] or list(turns)
    e2e = M.mean(r["e2e_s"] for r in requests)
    ref_e2e = M.mean(r["ref_e2e_s"] for r in requests)
    tokens = sum(r["trajectory_tokens"] for r in requests)
    tput = M.throughput(tokens, sum(r["e2e_s"] for r in requests))
    ref_tput = M.throughput(
        sum(r["ref_trajectory_tokens"] for r in requests), sum(r["ref_e2e_s"] for r in requests)
    )
    reusable = sum(t.get("reusable_ph_tokens", 0) for t in turns)
    reused = sum(min(t["tokens_reused"], t.get("reusable_ph_tokens", 0)) for t in turns)
    ph = sum(t["ph_tokens"] for t in turns)
    checked = [r for r in requests if r.get("correct") is not None]
    ref_checked = [r for r in requests if r.get("ref_correct") is not None]
    summary: dict[str, Any] = {
        "requests": len(requests),
        "turns": len(turns),
        "reuse_turns": sum(1 for t in turns if t.get("reuse_turn")),
        **ttft_summary(reuse),
        "ttft_all_mean_s": M.mean(t["ttft_s"] for t in turns),
        "e2e_mean_s": e2e,
        "ref_e2e_mean_s": ref_e2e,
        "e2e_ratio": M.ratio(ref_e2e, e2e),
        "throughput_tok_s": tput,
        "ref_throughput_tok_s": ref_tput,
        "throughput_ratio": M.ratio(tput, ref_tput),
        "peak_memory_mb": max(r["peak_memory_bytes"] for r in requests) / 2**20,
        "ref_peak_memory_mb": max(r["ref_peak_memory_bytes"] for r in requests) / 2**20,
        "tensor_peak_mb": _mb(_max_or_none(r.get("tensor_peak_bytes") for r in requests)),
        "ref_tensor_peak_mb": _mb(_max_or_none(r.get("ref_tensor_peak_bytes") for r in requests)),
        **phase_summary(turns),
        "method_state_mb": max(r.get("method_state_bytes") or 0 for r in requests) / 2**20,
        "request_state_mb": (  # None for runs recorded before this field existed
            max(r["request_state_bytes"] for r in requests) / 2**20
            if all("request_state_bytes" in r for r in requests)
            else None
        ),
        "reuse_ratio": M.reuse_ratio(reused, reusable),
        "reuse_ratio_all_ph": M.reuse_ratio(sum(t["tokens_reused"] for t in turns), ph),
        "exact_match": M.mean(float(t["exact_match"]) for t in turns),
        "final_exact_match": M.mean(float(r["final_exact_match"]) for r in requests),
        "accuracy": M.mean(float(r["correct"]) for r in checked) if checked else None,
        "ref_accuracy": M.mean(float(r["ref_correct"]) for r in ref_checked) if ref_checked else None,
        "checked": len(checked),
    }
    if any("agreement" in t for t in turns):
        summary.update(
            {
                "agreement": M.mean(t["agreement"] for t in reuse),
                "first_token_agreement": M.mean(t["first_token_agreement"] for t in reuse),
                "kl": M.mean(t["kl"] for t in reuse),
                "kv_error": M.mean(t["kv_error"] for t in reuse if t.get("kv_error") is not None),
                # every turn: a method may approximate a turn that reads nothing an earlier turn read
                # (KVComm corrects the first reader of an observation from its reference prefill), which
                # the reuse-turn means leave out; over all turns every method is averaged over the same set
                "agreement_all_turns": M.mean(t["agreement"] for t in turns),
                "kl_all_turns": M.mean(t["kl"] for t in turns),
                "kv_error_all_turns": M.mean(t["kv_error"] for t in turns if t.get("kv_error") is not None),
                "approximated_first_reads": sum(
                    1
                    for t in turns
                    if not t.get("reuse_turn")
                    and (t.get("tokens_corrected") or t.get("tokens_reused_uncorrected"))
                ),
            }
        )
    summary.update(reuse_accounting(turns))
    summary["by_position"] = _by_position(turns)
    layered = [t["kv_error_by_layer"] for t in turns if t.get("kv_error_by_layer")]
    if layered:
        summary["kv_error_by_layer"] = [
            {"layer": i, "key": M.mean(x[i][0] for x in layered), "value": M.mean(x[i][1] for x in layered)}
            for i in range(len(layered[0]))
        ]
    ranks = [t["erank_by_layer"] for t in turns if t.get("erank_by_layer")]
    if ranks:
        names = ("base_key", "base_value", "delta_key", "delta_value")
        summary["erank_by_layer"] = [
            {"layer": i, **{n: M.mean(x[i][j] for x in ranks) for j, n in enumerate(names)}}
            for i in range(len(ranks[0]))
        ]
    return summary


def _mb(value: int | None) -> float | None:
    return None if value is None else value / 2**20


def phase_summary(turns: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Where the time after the first token goes: the mean seconds per turn of each phase
    (:data:`~hf_kvshare.measure.PHASES`, over all turns; ``None`` for records written before)."""
    out: dict[str, float | None] = {}
    for name in PHASES:
        values = [t.get(f"{name}_s") for t in turns]
        out[f"{name}_mean_s"] = None if any(v is None for v in values) else M.mean(values)
    return out


#: the shared-token split of a turn record, and the summary column of each (a share of the PH tokens)
SPLIT = {
    "tokens_corrected": "corrected_share",
    "tokens_reused_uncorrected": "uncorrected_share",
    "tokens_recomputed": "recomputed_share",
    "ph_prefilled": "prefilled_share",
}
_WARNED_UNCORRECTED: set[str] = set()


def reuse_accounting(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The shared (PH) tokens of all turns split into corrected / reused uncorrected / recomputed /
    prefilled (shares summing to 1), the paper's rho (:attr:`~hf_kvshare.turn.TurnResult.paper_reuse_ratio`)
    and ``uncorrected_run``: a correction method that reused shared tokens and corrected none (said
    here and warned once per method and process). Empty for records written before the split existed."""
    if not turns or not all(key in t for t in turns for key in SPLIT):
        return {}
    ph = sum(t["ph_tokens"] for t in turns)
    totals = {key: sum(t[key] for t in turns) for key in SPLIT}
    out: dict[str, Any] = {column: M.reuse_ratio(totals[key], ph) for key, column in SPLIT.items()}
    corrects = any(t.get("corrects") for t in turns)
    served = totals["tokens_corrected"] if corrects else sum(t["tokens_reused"] for t in turns)
    out["paper_reuse_ratio"] = M.reuse_ratio(served, ph)
    out["uncorrected_run"] = bool(
        corrects and totals["tokens_reused_uncorrected"] > 0 and not totals["tokens_corrected"]
    )
    method = str(turns[0].get("method", "?"))
    if out["uncorrected_run"] and method not in _WARNED_UNCORRECTED:
        _WARNED_UNCORRECTED.add(method)
        warnings.warn(
            f"{method}: a correction method that served the whole run uncorrected: "
            f"{out['uncorrected_share']:.2f} of the shared tokens reused as their source was, none "
            "corrected (no anchor held a correction for its consumers); its rho is FullShared's reuse, "
            "paper rho (corrected only) 0",
            UserWarning,
            stacklevel=2,
        )
    return out


def _by_position(turns: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    positions: dict[int, list[dict[str, Any]]] = {}
    for t in turns:
        positions.setdefault(t["position"], []).append(t)
    rows = []
    for pos in sorted(positions):
        group = positions[pos]
        agents = [t["agent"] for t in group]
        row = {
            "position": pos,
            "agent": max(set(agents), key=agents.count),
            "n": len(group),
            "ttft_s": M.mean(t["ttft_s"] for t in group),
            "ref_ttft_s": M.mean(t["ref_ttft_s"] for t in group),
            "reuse_ratio": M.mean(t["reuse_ratio"] for t in group if t.get("reuse_ratio") is not None),
            "exact_match": M.mean(float(t["exact_match"]) for t in group),
        }
        if "agreement" in group[0]:
            row.update(
                {
                    "agreement": M.mean(t["agreement"] for t in group),
                    "first_token_agreement": M.mean(t["first_token_agreement"] for t in group),
                    "kl": M.mean(t["kl"] for t in group),
                    "kv_error": M.mean(t["kv_error"] for t in group if t.get("kv_error") is not None),
                }
            )
        rows.append(row)
    return rows


# ------------------------------------------------------------ side by side
@dataclass
class MethodReport:
    method: str
    free: list[TurnResult]
    forced: list[TurnResult]
    per_turn: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, reference: MethodReport | None = None) -> dict[str, Any]:
        reuse_turns = [t for t in self.free if t.ph_tokens]
        out = {
            "method": self.method,
            "ttft_s": statistics.mean(t.ttft_s for t in self.free),
            "e2e_s": statistics.mean(t.e2e_s for t in self.free),
            "reuse_ratio": sum(t.tokens_reused for t in reuse_turns)
            / max(sum(t.ph_tokens for t in reuse_turns), 1),
            "agreement": statistics.mean(r["agreement"] for r in self.per_turn),
            "kl": statistics.mean(r["kl"] for r in self.per_turn),
            "kv_error": statistics.mean(r["kv_error"] for r in self.per_turn),
            "peak_memory_mb": max(t.peak_memory_bytes for t in self.free) / 2**20,
            **reuse_accounting([{"method": self.method, **t.metrics()} for t in self.free]),
        }
        if reference is not None:
            out["ttft_ratio"] = (
                statistics.mean(t.ttft_s for t in reference.free) / out["ttft_s"]
                if out["ttft_s"] > 0
                else float("nan")
            )
            out["exact_match"] = statistics.mean(
                float(M.exact_match(a.output_ids, b.output_ids)) for a, b in zip(self.free, reference.free)
            )
        return out


def compare_methods(
    model,
    tokenizer,
    workflow: Workflow | Callable[[], Workflow],
    methods: Sequence[Any],
    progress: bool = True,
) -> dict[str, MethodReport]:
    """Run ``workflow`` with NonShared and every method in ``methods`` (names, instances or
    :class:`MethodPair`) through the paired protocol (:func:`run_paired`).

    A method given by name gets a fresh instance for each pass, so state that outlives a request
    (KVCMAS's anchor pools, GraphFlow's profiles) starts empty. An instance is used for both passes
    and keeps that state across calls: pass instances to compare methods over several workflows. A
    ``MethodPair`` gives the two instances and the label (e.g. a method with options).

    Returns one :class:`MethodReport` per method, NonShared included as ``"nonshared"``; its
    ``per_turn`` rows hold the teacher-forced agreement, KL and PH KV error (over the union of the
    turn's PH segments) of each turn.
    """
    if callable(workflow):
        workflow = workflow()
    pairs = [MethodPair.create(REFERENCE)]
    for method in methods:
        pair = method if isinstance(method, MethodPair) else MethodPair.create(method)
        if pair.label != REFERENCE:
            pairs.append(pair)
    run = run_paired(model, tokenizer, workflow, pairs, progress=progress)
    reports = {}
    for pair in tqdm(pairs, desc="fidelity", disable=not progress):
        report = MethodReport(method=pair.label, free=run.free[pair.label], forced=run.forced[pair.label])
        for turn, ref in zip(report.forced, run.forced[run.reference]):
            fidelity = turn_fidelity(turn, ref)
            report.per_turn.append(
                {
                    "agent": turn.agent,
                    "agreement": fidelity["agreement"],
                    "kl": fidelity["kl"],
                    "kv_error": fidelity["kv_error"] or 0.0,
                    "reuse_ratio": turn.reuse_ratio,
                }
            )
        reports[pair.label] = report
    run.release_caches()  # keep only the numbers
    return reports

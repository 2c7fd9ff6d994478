"""The tables of ``bench serve``: a run's row from its request records (:func:`summarize_run`, vLLM's
prefix-cache counters, the connector's per-request reports: :func:`connector_columns`,
:func:`compact_report`), exact match and teacher-forced agreement with the reference, ``summary.json``
/ ``summary.csv`` and the TTFT-vs-QPS figure, and reading a summary back."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ... import reasons
from .trace import BASELINES, DOC_FIRST, PLAIN

#: columns of summary.csv, in order
SUMMARY_COLUMNS = (
    "method",
    "qps",
    "repeat",
    "order",
    "requests",
    "completed",
    "failed",
    "not_sent",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_mean_s",
    "reuse_ttft_p50_s",
    "reuse_ttft_p90_s",
    "e2e_p50_s",
    "dependency_wait_mean_s",
    "throughput_tok_s",
    "throughput_req_s",
    "prompt_tokens",
    "output_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "cached_tokens",
    "claimed_requests",
    "supplied_tokens",
    "supplied_ph_tokens",
    "supplied_pf_tokens",
    "ph_tokens",
    "rho",
    "rho_note",
    "plan_mean_s",
    "record_mean_s",
    "admission_wait_p50_s",
    "queued_p50_s",
    "plan_queue_p50_s",
    "not_ready_requests",
    "taken_after_p50_s",
    "after_admission_p50_s",
    "read_back_p50_s",
    "record_wait_p50_s",
    "store_evicted_tasks",
    "store_bytes_max",
    "method_bytes_max",
    "gate_rejected_requests",
    "not_shared_top",
    "exact_match",
    "exact_note",
    "agreement",
    "first_token_agreement",
    "agreement_note",
    "wall_s",
)


def summarize_run(records: Sequence[Mapping[str, Any]], wall_s: float | None = None) -> dict[str, Any]:
    """The row of one (method, QPS) run from its request records: TTFT over all completed requests
    and over reuse requests (position >= 1: a shared document an earlier agent read), throughput
    (output tokens / seconds from the first send to the last finish), cached prompt tokens."""
    from ...evaluation.metrics import latency_stats
    from ...evaluation.metrics import throughput as tok_per_s

    done = [r for r in records if r.get("ok")]
    ttft = latency_stats(r["ttft_s"] for r in done if r.get("ttft_s") is not None)
    reuse = latency_stats(r["ttft_s"] for r in done if r.get("ttft_s") is not None and r["position"] > 0)
    starts = [r["sent_s"] for r in done]
    ends = [r["finished_s"] for r in done]
    span = (max(ends) - min(starts)) if done else float("nan")
    out_tokens = sum(r.get("completion_tokens") or 0 for r in done)
    cached = [r.get("cached_tokens") for r in done]
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": sum(1 for r in records if not r.get("ok") and r.get("sent_s") is not None),
        "not_sent": sum(1 for r in records if r.get("sent_s") is None),
        "ttft_mean_s": ttft["mean"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p90_s": ttft["p90"],
        "reuse_ttft_p50_s": reuse["p50"],
        "reuse_ttft_p90_s": reuse["p90"],
        "e2e_p50_s": latency_stats(r["e2e_s"] for r in done)["p50"],
        "dependency_wait_mean_s": latency_stats(r.get("dependency_wait_s") or 0.0 for r in done)["mean"],
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in done),
        "output_tokens": out_tokens,
        "throughput_tok_s": tok_per_s(out_tokens, span) if done and span > 0 else float("nan"),
        "throughput_req_s": len(done) / span if done and span > 0 else float("nan"),
        "cached_tokens": sum(c for c in cached if c is not None)
        if any(c is not None for c in cached)
        else None,
        "wall_s": wall_s,
    }


def metric_delta(before: Mapping[str, float], after: Mapping[str, float], *names: str) -> float | None:
    """``after - before`` of the first of ``names`` the server reports (``_total`` suffix or not)."""
    for name in names:
        for key in (name, name + "_total"):
            if key in after:
                return after[key] - before.get(key, 0.0)
    return None


#: vLLM's prefix-cache counters (tokens), v1 engine names
PREFIX_QUERIES = ("vllm:prefix_cache_queries",)
PREFIX_HITS = ("vllm:prefix_cache_hits",)


def connector_columns(method: str, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``supplied_tokens`` and ``rho`` from the connector's own report of each request (its
    ``kv_transfer_params["hf_kvshare"]``, in ``record["connector"]``): exact counts, summed over the
    run's completed requests. ``rho`` = supplied PH tokens / PH tokens (``TurnResult.reuse_ratio``
    summed over the run); ``supplied_pf_tokens`` are the agents' own text placed by prefix reuse.
    An empty column carries its reason in ``rho_note``."""
    empty = {
        "claimed_requests": None,
        "supplied_tokens": None,
        "supplied_ph_tokens": None,
        "supplied_pf_tokens": None,
        "ph_tokens": None,
        "rho": None,
        "plan_mean_s": None,
        "record_mean_s": None,
        "admission_wait_p50_s": None,
        "queued_p50_s": None,
        "plan_queue_p50_s": None,
        "not_ready_requests": None,
        "taken_after_p50_s": None,
        "after_admission_p50_s": None,
        "read_back_p50_s": None,
        "record_wait_p50_s": None,
        "store_evicted_tasks": None,
        "store_bytes_max": None,
        "method_bytes_max": None,
        "stores_max": None,
        "gate_rejected_requests": None,
        "not_shared": None,
        "not_shared_top": None,
    }
    if method in BASELINES:
        return {**empty, "rho_note": "plain vLLM: no connector"}
    done = [r for r in records if r.get("ok")]
    reports = [r["connector"] for r in done if r.get("connector")]
    if not reports:
        return {**empty, "rho_note": "the server reported nothing for this run's requests"}

    def total(key: str) -> int:
        return int(sum(rep.get(key) or 0 for rep in reports))

    ph = total("ph_tokens")
    rejected = [r for r in (rep.get("gate_rejected") for rep in reports) if r is not None]
    notes = []
    if len(reports) < len(done):
        notes.append(f"{len(done) - len(reports)} of {len(done)} completed requests without a report")
    errors = sum(1 for rep in reports if rep.get("error"))
    if errors:
        notes.append(f"{errors} requests with a layout error (no claim)")
    unfilled = sum(1 for rep in reports if rep.get("gate_unfilled"))
    if unfilled:
        notes.append(
            f"{unfilled} of {len(reports)} requests dense because a gate had fewer than 2 anchors to compare "
            "(its pool still filling: a longer --warmup-tasks fills it before timing)"
        )
    return {
        "claimed_requests": sum(1 for rep in reports if rep.get("supplied_tokens")),
        "supplied_tokens": total("supplied_tokens"),
        "supplied_ph_tokens": total("supplied_ph_tokens"),
        "supplied_pf_tokens": total("supplied_pf_tokens"),
        "ph_tokens": ph,
        "rho": total("supplied_ph_tokens") / ph if ph else None,
        "rho_note": "; ".join(notes) if notes else ("" if ph else "no PH tokens"),
        # the method's admission work per request, and how long the engine waited for it (queued behind
        # other plans and records on the connector's thread); None from a connector that reports neither
        "plan_mean_s": _stat(reports, "plan_s", "mean"),
        # the method's work after each request (its record, on the same thread as the plans)
        "record_mean_s": _stat(reports, "record_s", "mean"),
        "admission_wait_p50_s": _stat(reports, "admission_wait_s", "p50"),
        # arrival to vLLM's first admission query (vLLM's own queue; the plan runs meanwhile)
        "queued_p50_s": _stat(reports, "queued_s", "p50"),
        # where the admission wait went: the plan's submission to its start on the connector's thread
        # (behind what, per request: ``plan_behind`` in requests.jsonl), the requests vLLM was told "not
        # decided yet" at least once (each such answer costs an engine step), and the decision to the
        # admission query that took it
        "plan_queue_p50_s": _stat(reports, "plan_queue_s", "p50"),
        "not_ready_requests": _count_positive(reports, "not_ready"),
        "taken_after_p50_s": _stat(reports, "taken_after_s", "p50"),
        # the client's TTFT less the connector's queue and admission wait: the engine's step(s) after
        # admission (the claimed K/V sent and written, the forward of what was not claimed) and the API
        # server's way to the client
        "after_admission_p50_s": _stat(_after_admission(done), "after_admission_s", "p50"),
        # a request's end to its record queued (the worker's read-back), and how long a later request of
        # its task waited for that before its plan could start (only requests that waited)
        "read_back_p50_s": _stat(reports, "read_back_s", "p50"),
        "record_wait_p50_s": _stat(reports, "record_wait_s", "p50"),
        # tasks the store's bound evicted since the server started, as of the run's last report (a
        # task evicted while in flight computes what it would have reused)
        "store_evicted_tasks": _max_int(reports, "store_evicted_tasks"),
        # the most the server held beyond vLLM's own KV cache as of any request's report: the slots' K/V
        # in the store (counted by storage), and what the method keeps across requests (anchor pools)
        "store_bytes_max": _max_int(reports, "store_bytes"),
        "method_bytes_max": _max_int(reports, "method_bytes"),
        # each store's most bytes held over the run, its budget and its evictions (or, the read-backs,
        # refusals) as of the run's last report (Sharing.stores; summary.json only)
        "stores_max": stores_max(reports),
        # requests a gate rejection sent dense (their PH spans prefilled, the delta anchored); None when
        # no report carries a gate outcome
        "gate_rejected_requests": sum(rejected) if rejected else None,
        # why the PH tokens the engine computed were not supplied: every cause (tokens, spans, a detail),
        # and the most frequent ones in one line (hf_kvshare.reasons)
        **not_shared_columns(reports),
    }


def not_shared_columns(reports: Sequence[Mapping[str, Any]], n: int = 3) -> dict[str, Any]:
    """``not_shared`` (per cause: PH tokens, spans, a detail; most tokens first) and ``not_shared_top``
    (the ``n`` most frequent, one line) over compact reports (:func:`compact_report`'s ``not_shared``);
    ``None`` where no report carries them (written before)."""
    found = [rep["not_shared"] for rep in reports if isinstance(rep.get("not_shared"), Mapping)]
    if not found:
        return {"not_shared": None, "not_shared_top": None}
    counts = reasons.merge(found)
    return {"not_shared": dict(reasons.top(counts)), "not_shared_top": reasons.describe(counts, n)}


def _after_admission(records: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    out = []
    for r in records:
        rep, ttft = r.get("connector") or {}, r.get("ttft_s")
        wait = rep.get("admission_wait_s")
        if isinstance(ttft, (int, float)) and isinstance(wait, (int, float)):
            out.append({"after_admission_s": float(ttft) - float(rep.get("queued_s") or 0.0) - float(wait)})
    return out


def _count_positive(reports: Sequence[Mapping[str, Any]], key: str) -> int | None:
    values = [r.get(key) for r in reports]
    real = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return sum(1 for v in real if v > 0) if real else None


def stores_max(reports: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """Per store of the reports' ``stores`` (slots, prefixes, anchors, read-backs): ``bytes`` the most
    held, ``max_bytes`` its budget, ``evicted`` / ``refused`` the most counted; ``None`` without any."""
    found = [r["stores"] for r in reports if isinstance(r.get("stores"), Mapping)]
    if not found:
        return None
    out: dict[str, dict[str, Any]] = {}
    for stores in found:
        for name, store in stores.items():
            if not isinstance(store, Mapping):
                continue
            row = out.setdefault(name, {})
            for key, value in store.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    row[key] = value if key == "max_bytes" else max(row.get(key, value), value)
    return out


def _max_int(reports: Sequence[Mapping[str, Any]], key: str) -> int | None:
    values = [r.get(key) for r in reports]
    return max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=None)


def _stat(reports: Sequence[Mapping[str, Any]], key: str, stat: str) -> float | None:
    from ...evaluation.metrics import latency_stats

    values = [r.get(key) for r in reports]
    real = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return latency_stats(real)[stat] if real else None


def compact_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """The per-request fields of a connector report kept in ``requests.jsonl``."""
    keys = (
        "task",
        "agent",
        "prompt_tokens",
        "prefix_cache_hit",
        "claimed",
        "supplied_tokens",
        "ph_tokens",
        "supplied_ph_tokens",
        "supplied_pf_tokens",
        "missing",
        "matched",
        "error",
        "plan_s",
        "admission_wait_s",
        "queued_s",
        "plan_queue_s",
        "plan_behind",
        "not_ready",
        "taken_after_s",
        "claim_s",
        "record_s",
        "record_wait_s",
        "read_back",
        "read_back_s",
    )
    out = {k: report.get(k) for k in keys}
    out["gate_rejected"] = gate_rejected(report)
    out["not_shared"] = reasons.report_causes(report)
    out["gate_unfilled"] = gate_unfilled(report)
    store = report.get("store")
    store = store if isinstance(store, Mapping) else {}
    out["store_evicted_tasks"] = store.get("evicted_tasks")
    out["store_bytes"] = store.get("bytes")
    out["stores"] = store.get("stores")  # each store's bytes, budget, evictions (Sharing.stores)
    # a report file's line carries method_bytes; a reply's report the method's whole state summary
    method_state = store.get("method_state")
    out["method_bytes"] = store.get(
        "method_bytes", method_state.get("bytes") if isinstance(method_state, Mapping) else None
    )
    out["segments"] = [
        [
            seg.get("kind"),
            *seg.get("span", []),
            seg.get("provenance", "dense" if not seg.get("placed") else "?"),
            *([seg["gate"]] if seg.get("gate") else []),  # the method's gate outcome, where it gates
        ]
        for seg in report.get("segments") or []
    ]
    return out


def _fallbacks(report: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The gate outcomes of a connector report's segments that fell back (a gate rejection made the
    request dense), ``None`` when it carries no gate outcome (a method that does not gate, or an older
    server)."""
    gates = [
        seg["gate"] for seg in report.get("segments") or [] if isinstance(seg, Mapping) and seg.get("gate")
    ]
    if not gates:
        return None
    return [g for g in gates if g.get("gate") == "fallback"]


def gate_rejected(report: Mapping[str, Any]) -> bool | None:
    """Whether a gate rejection made the request dense, ``None`` without gate outcomes (:func:`_fallbacks`)."""
    fallbacks = _fallbacks(report)
    return None if fallbacks is None else bool(fallbacks)


def gate_unfilled(report: Mapping[str, Any]) -> bool:
    """Whether a gate sent the request dense for want of anchors (too few, or none as long as the span:
    :mod:`hf_kvshare.reasons`)."""
    wanting = ("no_anchors", "length_rule")
    return any(reasons.cause_of_reason(str(g.get("reason", ""))) in wanting for g in _fallbacks(report) or [])


def exact_match(
    records: Sequence[Mapping[str, Any]], plain: Sequence[Mapping[str, Any]]
) -> tuple[float | None, str]:
    """The fraction of requests whose reply token ids equal plain vLLM's on the same request of the
    same documents (``plain``: the ``plain`` row's records at the same QPS and round), and a note."""
    ref = {r["request"]: r.get("token_ids") for r in plain if r.get("ok")}
    pairs = [(r.get("token_ids"), ref[r["request"]]) for r in records if r.get("ok") and r["request"] in ref]
    if not pairs:
        return None, "no request completed on both servers"
    same = sum(1 for a, b in pairs if a is not None and list(a) == list(b))
    first = next(
        (
            r["request"]
            for r in records
            if r.get("ok")
            and r["request"] in ref
            and list(r.get("token_ids") or []) != list(ref[r["request"]])
        ),
        None,
    )
    note = f"{same}/{len(pairs)} requests identical" + (
        f"; first differing: request {first}" if first is not None else ""
    )
    return same / len(pairs), note


def fill_exact(rows: list[dict[str, Any]], runs: Mapping[tuple[str, int, float], Sequence[Mapping]]) -> None:
    """``exact_match`` of every connector row against the ``plain`` row of its round and QPS (the
    same documents; plain vLLM's replies are the exact ones): the fraction of identical replies."""
    for row in rows:
        if row["method"] in BASELINES:
            row.setdefault("exact_match", None)
            row["exact_note"] = "the reference" if row["method"] == PLAIN else "another prompt"
            continue
        plain = runs.get((PLAIN, row["repeat"], row["qps"]))
        mine = runs.get((row["method"], row["repeat"], row["qps"]))
        if plain is None or mine is None:
            row["exact_match"], row["exact_note"] = None, "no plain run at this QPS"
            continue
        row["exact_match"], row["exact_note"] = exact_match(mine, plain)


def agreement(reference: Sequence[Sequence[int]], method: Sequence[Sequence[int | None]]) -> dict[str, float]:
    """Top-1 agreement of ``method``'s greedy tokens with NonShared's at the same forced positions
    (per request; ``None``: a position not counted), and the same for each reply's first token."""
    pairs = [(a, b) for ref, got in zip(reference, method) for a, b in zip(ref, got) if b is not None]
    firsts = [(ref[0], got[0]) for ref, got in zip(reference, method) if ref and got and got[0] is not None]
    return {
        "agreement": sum(a == b for a, b in pairs) / len(pairs) if pairs else float("nan"),
        "first_token_agreement": sum(a == b for a, b in firsts) / len(firsts) if firsts else float("nan"),
        "forced_positions": len(pairs),
    }


def agreement_columns(method: str, forced: Mapping[str, Any]) -> dict[str, Any]:
    if method in BASELINES:
        note = (
            "the reference"
            if method == PLAIN and forced
            else ("not asked (--agreement)" if not forced else "another prompt")
        )
        return {"agreement": None, "first_token_agreement": None, "agreement_note": note}
    from ..methods import MethodSpec

    mine = forced.get(MethodSpec.parse(method).tag)
    if not mine:
        return {"agreement": None, "first_token_agreement": None, "agreement_note": "not asked (--agreement)"}
    return {
        "agreement": mine.get("agreement"),
        "first_token_agreement": mine.get("first_token_agreement"),
        "agreement_note": mine.get("note", ""),
    }


def write_outputs(
    out: Path,
    config: Mapping[str, Any],
    rows: list[dict[str, Any]],
    plots: bool = True,
    complete: bool = True,
    stopped: str | None = None,
) -> list[Path]:
    """``summary.json`` (config + rows + ``complete``), ``summary.csv`` and, with matplotlib,
    ``ttft_vs_qps.png``. ``complete=False``: the rows of a run still going, interrupted or failed
    (``stopped``: why it stopped), which no reader takes for a finished run (:func:`iter_rows`,
    ``report``, ``plot`` and the skip-if-done check refuse or replace it)."""
    from ..report import write_csv
    from ..runner import write_json

    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"config": dict(config), "rows": json_safe(rows), "complete": complete}
    if not complete and stopped is not None:
        summary["stopped"] = stopped
    write_json(out / "summary.json", summary)
    written = [out / "summary.json", write_csv(out / "summary.csv", rows, list(SUMMARY_COLUMNS))]
    if plots:
        written += ttft_plot(rows, out / "ttft_vs_qps.png", title=_title(config))
    return written


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) as ``None``, nested dicts and lists too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def _title(config: Mapping[str, Any]) -> str:
    w = config.get("workload") or {}
    return (
        f"{Path(str(config.get('model'))).name} on vLLM: {w.get('agents')} agents, {w.get('shared_tokens')} shared tokens, "
        f"{w.get('output_tokens')} output tokens, {w.get('tasks')} tasks per run"
    )


def curves(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float, float]]]:
    """Per method, ``(qps, p50, p90)`` sorted by QPS, the mean over repeats (NaN-free runs)."""
    grouped: dict[str, dict[float, list[tuple[float, float]]]] = {}
    for r in rows:
        p50, p90 = r.get("ttft_p50_s"), r.get("ttft_p90_s")
        if p50 is None or p90 is None or not (math.isfinite(p50) and math.isfinite(p90)):
            continue
        grouped.setdefault(r["method"], {}).setdefault(float(r["qps"]), []).append((p50, p90))
    return {
        m: [
            (q, sum(a for a, _ in v) / len(v), sum(b for _, b in v) / len(v)) for q, v in sorted(by_q.items())
        ]
        for m, by_q in grouped.items()
    }


def ttft_plot(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> list[Path]:
    """Fig. 5 of the seeds: p50 and p90 TTFT vs QPS, one line per method (two panels)."""
    from ..plots import _pyplot, _save

    data = curves(rows)
    plt = _pyplot()
    if plt is None or not data:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {PLAIN: dict(color="black", linestyle="--"), DOC_FIRST: dict(color="gray", linestyle=":")}
    for method, points in data.items():
        for ax, k in zip(axes, (1, 2)):
            ax.plot(
                [p[0] for p in points],
                [p[k] for p in points],
                marker="o",
                label=method,
                **styles.get(method, {}),
            )
    qps = sorted({p[0] for pts in data.values() for p in pts})
    for ax, name in zip(axes, ("p50", "p90")):
        ax.set_title(f"{name} TTFT")
        ax.set_xlabel("QPS (requests / s)")
        ax.set_ylabel(f"{name} TTFT (s)")
        if len(qps) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(qps, [f"{q:g}" for q in qps])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    out = _save(fig, axes[1], path, title)
    plt.close(fig)
    return [out]


def summary_complete(path: Path) -> bool:
    """Whether ``summary.json`` at ``path`` is a finished run's: not marked ``"complete": false``
    (a file that cannot be read counts as finished: it is refused, not silently replaced)."""
    from ..inputs import read_json_object

    try:
        return read_json_object(path, "serve summary").get("complete") is not False
    except (ValueError, OSError):
        return True


def iter_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a finished run's ``summary.json``; ``ValueError`` (one line) for the summary of a
    run that did not finish (``"complete": false``: still running, interrupted or failed)."""
    from ..inputs import read_json_object

    data = read_json_object(path, "serve summary")
    if data.get("complete") is False:
        raise ValueError(
            f"serve summary {str(path)!r} is an incomplete run ({data.get('stopped') or 'not finished'}): "
            "its rows are not a finished run's"
        )
    yield from data["rows"]

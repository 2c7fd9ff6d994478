"""Benchmark metrics: latency statistics, reuse, KV error and effective rank, fidelity, task accuracy.

Speed (TTFT, E2E, throughput) is reported next to NonShared measured in the same run, so the
ratios carry the claims. Fidelity is measured teacher-forced on NonShared's outputs (top-1
agreement, KL: :mod:`hf_kvshare.fidelity`) and as exact match of the free-running greedy outputs.
Task accuracy: GSM8K numeric match, MMLU letter match, HumanEval execution (opt-in, sandboxed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..fidelity import agent_layer_kv
from .sandbox import run_python

# ------------------------------------------------------------------ statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within [0, 100], got {q}")
    xs = sorted(float(v) for v in values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(values: Iterable[float]) -> dict[str, float]:
    """``mean``, ``p50``, ``p90`` and ``n`` of a list of latencies (NaN when empty)."""
    xs = [float(v) for v in values]
    mean = sum(xs) / len(xs) if xs else float("nan")
    return {"mean": mean, "p50": percentile(xs, 50), "p90": percentile(xs, 90), "n": len(xs)}


def throughput(tokens: int, seconds: float) -> float:
    """Tokens per second (NaN for a non-positive time)."""
    return tokens / seconds if seconds > 0 else float("nan")


def reuse_ratio(tokens_reused: int, reusable_tokens: int) -> float:
    """rho: reused / reusable shared tokens (0 when nothing was reusable)."""
    if tokens_reused < 0 or reusable_tokens < 0:
        raise ValueError("token counts must be >= 0")
    return tokens_reused / reusable_tokens if reusable_tokens else 0.0


def mean(values: Iterable[float]) -> float:
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(xs) / len(xs) if xs else float("nan")


def ratio(reference: float, value: float) -> float:
    """``reference / value`` (e.g. NonShared TTFT / method TTFT; > 1 means faster than NonShared)."""
    if value is None or reference is None or value <= 0 or math.isnan(value) or math.isnan(reference):
        return float("nan")
    return reference / value


# --------------------------------------------------------------- KV geometry


def kv_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, seq, head_dim]`` (batch 1) -> ``[seq, kv_heads * head_dim]`` in float64."""
    if tensor.dim() != 4 or tensor.shape[0] != 1:
        raise ValueError(f"expected K/V of shape [1, kv_heads, seq, head_dim], got {tuple(tensor.shape)}")
    return tensor[0].permute(1, 0, 2).reshape(tensor.shape[2], -1).double()


def effective_rank(matrix: torch.Tensor, energy: float = 0.9) -> int:
    """Smallest r whose top-r singular values hold ``energy`` of the squared Frobenius norm (0 for a zero matrix)."""
    if not 0 < energy <= 1:
        raise ValueError(f"energy must be within (0, 1], got {energy}")
    if matrix.dim() != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {tuple(matrix.shape)}")
    s2 = torch.linalg.svdvals(matrix.double()).pow(2)
    total = s2.sum().item()
    if total <= 0:
        return 0
    cumulative = torch.cumsum(s2, 0) / total
    return int((cumulative < energy - 1e-12).sum().item()) + 1


def kv_error_terms(cache, exact, start: int, end: int) -> list[tuple[float, float, float, float]]:
    """Per layer ``(||dK||^2, ||K||^2, ||dV||^2, ||V||^2)`` over positions ``[start, end)`` of two caches.

    Summing the terms of several segments before the square root gives the relative error over
    their union (:func:`relative_from_terms`).
    """
    terms = []
    for layer in range(cache.num_layers):
        k, v = agent_layer_kv(cache, layer)
        ek, ev = agent_layer_kv(exact, layer)
        k, v = k[..., start:end, :].double(), v[..., start:end, :].double()
        ek, ev = ek[..., start:end, :].double(), ev[..., start:end, :].double()
        terms.append(
            (
                (k - ek).pow(2).sum().item(),
                ek.pow(2).sum().item(),
                (v - ev).pow(2).sum().item(),
                ev.pow(2).sum().item(),
            )
        )
    return terms


def relative_from_terms(terms: Sequence[Sequence[float]]) -> dict[str, float]:
    """``{"key", "value", "kv"}`` relative errors from summed :func:`kv_error_terms` rows."""
    dk, k, dv, v = (sum(t[i] for t in terms) for i in range(4))

    def rel(num: float, den: float) -> float:
        return math.sqrt(num / den) if den > 0 else 0.0

    return {"key": rel(dk, k), "value": rel(dv, v), "kv": rel(dk + dv, k + v)}


def erank_by_layer(
    cache, exact, start: int, end: int, energy: float = 0.9, noise: float = 1e-5
) -> list[dict[str, int]]:
    """Per layer: effective rank of the exact K and V of positions ``[start, end)`` (``base_*``) and of the
    residual ``exact - cache`` (``delta_*``: for FullShared, the cross-agent correction a method must supply).

    A residual below ``noise`` times the exact block's norm is floating-point noise (e.g. layer 0, which
    no context changes), which is full rank: it counts as rank 0.
    """
    rows = []
    for layer in range(cache.num_layers):
        k, v = agent_layer_kv(cache, layer)
        ek, ev = agent_layer_kv(exact, layer)
        row: dict[str, int] = {"layer": layer}
        for part, approx, ref in (("key", k, ek), ("value", v, ev)):
            base = kv_matrix(ref[..., start:end, :])
            delta = base - kv_matrix(approx[..., start:end, :])
            row[f"base_{part}"] = effective_rank(base, energy)
            tiny = delta.norm() <= noise * base.norm()
            row[f"delta_{part}"] = 0 if tiny else effective_rank(delta, energy)
        rows.append({k: row[k] for k in ("layer", "base_key", "base_value", "delta_key", "delta_value")})
    return rows


# ----------------------------------------------------------------- fidelity


def first_token_agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """1.0 when both predict the same first token (the one the prompt alone decides), else 0.0."""
    if reference_logits.shape != logits.shape or reference_logits.dim() != 2:
        raise ValueError(
            f"expected two [T, vocab] logits of the same shape, got {tuple(reference_logits.shape)} "
            f"and {tuple(logits.shape)}"
        )
    return float(reference_logits[0].argmax().item() == logits[0].argmax().item())


def exact_match(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two token id sequences are identical."""
    return list(map(int, a)) == list(map(int, b))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two sequences share (where free-running outputs diverge)."""
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n


# ------------------------------------------------------------ task accuracy

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_number(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


def gsm8k_gold(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer (the whole text if there is no marker)."""
    tail = answer.split("####")[-1].strip()
    value = parse_number(tail)
    if value is None:
        raise ValueError(f"no number after '####' in GSM8K answer {answer[-60:]!r}")
    return tail.replace(",", "")


def extract_number(text: str) -> float | None:
    """The predicted number: after the last "answer is", else the last number in the text."""
    matches = list(re.finditer(r"answer is[:\s]*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", text, re.IGNORECASE))
    if matches:
        return parse_number(matches[-1].group(1))
    numbers = _NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def numeric_match(text: str, gold: str, tolerance: float = 1e-6) -> bool:
    predicted, expected = extract_number(text), parse_number(gold)
    if expected is None:
        raise ValueError(f"gold answer {gold!r} is not a number")
    return predicted is not None and abs(predicted - expected) <= tolerance * max(1.0, abs(expected))


def extract_letter(text: str) -> str | None:
    """The chosen option A-D: "answer is X" / "(X)" / a line starting with the letter / the first standalone letter."""
    for pattern in (
        r"answer is[:\s]*\(?([ABCD])\b",  # "The answer is B"
        r"^\s*\(?([ABCD])\)?\s*[.:]?\s*$",  # a line holding only the letter
        r"^\s*([ABCD])[.:)]",  # "B. because ..."
        r"\(([ABCD])\)",  # "(B)"
        r"\b([ABCD])\b",  # any standalone capital A-D
    ):
        m = re.search(pattern, text, re.MULTILINE)
        if m:
            return m.group(1)
    return None


def letter_match(text: str, gold: str) -> bool:
    return extract_letter(text) == gold.strip().upper()


def extract_answer(text: str) -> str | None:
    """The text after the last ``Answer:`` up to the end of its line or sentence, without the
    closing punctuation (AutoAct's final reflection: ``... Answer: Lirose``)."""
    matches = list(re.finditer(r"answer\s*:\s*([^\n]*)", text, re.IGNORECASE))
    if not matches:
        return None
    answer = re.split(r"(?<=[^.\d])\.\s|<\|", matches[-1].group(1))[0]
    return answer.strip().rstrip(".!").strip() or None


def answer_match(text: str, gold: str) -> bool:
    """``extract_answer(text)`` equals ``gold``, case and surrounding space ignored."""
    answer = extract_answer(text)
    return answer is not None and answer.casefold() == gold.strip().casefold()


def extract_code(text: str) -> str:
    """The first fenced code block (```python ... ``` or ``` ... ```), else the text itself."""
    m = re.search(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|$)", text, re.DOTALL)
    return (m.group(1) if m else text).strip("\n")


def humaneval_program(problem: dict[str, Any], completion_text: str) -> str:
    """The test program: the model's function (or the prompt + a body continuation), the tests, the check call."""
    code = extract_code(completion_text)
    entry = problem["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        imports = "\n".join(
            line for line in problem["prompt"].splitlines() if line.startswith(("import ", "from "))
        )
        body = f"{imports}\n{code}"
    else:
        body = problem["prompt"] + code
    return f"{body}\n\n{problem['test']}\n\ncheck({entry})\n"


#: checker -> (what it reads from the output, whether that is the gold answer)
TEXT_CHECKERS = {
    "exact": (str.strip, lambda text, gold: text.strip() == gold.strip()),
    "numeric": (extract_number, numeric_match),
    "letter": (extract_letter, letter_match),
    "answer": (extract_answer, answer_match),
}


def check_answer(task, text: str, execute: bool = False, timeout: float = 10.0) -> dict[str, Any]:
    """Score the final output of a task: ``{"correct": bool | None, "extracted": ..., "status": ...}``.

    ``correct`` is ``None`` when the task has no checker, or for HumanEval without ``execute``.
    """
    checker = task.checker
    if checker is None:
        return {"correct": None, "extracted": None, "status": "no checker"}
    if checker in TEXT_CHECKERS:
        extract, match = TEXT_CHECKERS[checker]
        return {"correct": match(text, task.answer), "extracted": extract(text), "status": "checked"}
    if checker == "humaneval":
        if not execute:
            return {"correct": None, "extracted": None, "status": "not executed (pass --execute)"}
        result = run_python(humaneval_program(task.meta, text), timeout=timeout)
        return {"correct": result.passed, "extracted": None, "status": result.status, "detail": result.detail}
    raise ValueError(f"unknown checker {checker!r}")


# -------------------------------------------------------------------- Pareto


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: lower x (time) and higher y (fidelity), sorted by x."""
    front = []
    for i, (x, y) in enumerate(points):
        if any(math.isnan(v) for v in (x, y)):
            continue
        dominated = any(
            (x2 <= x and y2 >= y) and (x2 < x or y2 > y)
            for j, (x2, y2) in enumerate(points)
            if j != i and not any(math.isnan(v) for v in (x2, y2))
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


# ------------------------------------------------------------------- summary

#: the scalar columns of ``summary.csv``, in order
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
    "method_state_mb",
    "request_state_mb",
    "reuse_ratio",
    "reuse_ratio_all_ph",
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


def summarize_method(turns: Sequence[dict[str, Any]], requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate a method's per-turn and per-request records (as written to ``turns.jsonl`` /
    ``requests.jsonl``) into its summary.

    TTFT statistics and fidelity are over *reuse turns* (turns that read a slot an earlier turn
    read or produced; all turns when a workload has none); ``ttft_ratio`` is NonShared's mean TTFT
    over the same turns, measured in the same run, divided by the method's (> 1: faster).
    rho = reused / reusable shared tokens over all turns.
    """
    if not turns or not requests:
        raise ValueError("no records to summarize")
    reuse = [t for t in turns if t.get("reuse_turn")] or list(turns)
    ttft = latency_stats(t["ttft_s"] for t in reuse)
    ref_ttft = latency_stats(t["ref_ttft_s"] for t in reuse)
    e2e = mean(r["e2e_s"] for r in requests)
    ref_e2e = mean(r["ref_e2e_s"] for r in requests)
    tokens = sum(r["trajectory_tokens"] for r in requests)
    tput = throughput(tokens, sum(r["e2e_s"] for r in requests))
    ref_tput = throughput(
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
        "ttft_mean_s": ttft["mean"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p90_s": ttft["p90"],
        "ref_ttft_mean_s": ref_ttft["mean"],
        "ttft_ratio": ratio(ref_ttft["mean"], ttft["mean"]),
        "ttft_p50_ratio": ratio(ref_ttft["p50"], ttft["p50"]),
        "ttft_p90_ratio": ratio(ref_ttft["p90"], ttft["p90"]),
        "ttft_all_mean_s": mean(t["ttft_s"] for t in turns),
        "e2e_mean_s": e2e,
        "ref_e2e_mean_s": ref_e2e,
        "e2e_ratio": ratio(ref_e2e, e2e),
        "throughput_tok_s": tput,
        "ref_throughput_tok_s": ref_tput,
        "throughput_ratio": ratio(tput, ref_tput),
        "peak_memory_mb": max(r["peak_memory_bytes"] for r in requests) / 2**20,
        "ref_peak_memory_mb": max(r["ref_peak_memory_bytes"] for r in requests) / 2**20,
        "method_state_mb": max(r.get("method_state_bytes") or 0 for r in requests) / 2**20,
        "request_state_mb": (  # None for runs recorded before this field existed
            max(r["request_state_bytes"] for r in requests) / 2**20
            if all("request_state_bytes" in r for r in requests)
            else None
        ),
        "reuse_ratio": reuse_ratio(reused, reusable),
        "reuse_ratio_all_ph": reuse_ratio(sum(t["tokens_reused"] for t in turns), ph),
        "exact_match": mean(float(t["exact_match"]) for t in turns),
        "final_exact_match": mean(float(r["final_exact_match"]) for r in requests),
        "accuracy": mean(float(r["correct"]) for r in checked) if checked else None,
        "ref_accuracy": mean(float(r["ref_correct"]) for r in ref_checked) if ref_checked else None,
        "checked": len(checked),
    }
    if any("agreement" in t for t in turns):
        summary.update(
            {
                "agreement": mean(t["agreement"] for t in reuse),
                "first_token_agreement": mean(t["first_token_agreement"] for t in reuse),
                "kl": mean(t["kl"] for t in reuse),
                "kv_error": mean(t["kv_error"] for t in reuse if t.get("kv_error") is not None),
            }
        )
    summary["by_position"] = _by_position(turns)
    layered = [t["kv_error_by_layer"] for t in turns if t.get("kv_error_by_layer")]
    if layered:
        summary["kv_error_by_layer"] = [
            {"layer": i, "key": mean(x[i][0] for x in layered), "value": mean(x[i][1] for x in layered)}
            for i in range(len(layered[0]))
        ]
    ranks = [t["erank_by_layer"] for t in turns if t.get("erank_by_layer")]
    if ranks:
        names = ("base_key", "base_value", "delta_key", "delta_value")
        summary["erank_by_layer"] = [
            {"layer": i, **{n: mean(x[i][j] for x in ranks) for j, n in enumerate(names)}}
            for i in range(len(ranks[0]))
        ]
    return summary


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
            "ttft_s": mean(t["ttft_s"] for t in group),
            "ref_ttft_s": mean(t["ref_ttft_s"] for t in group),
            "reuse_ratio": mean(t["reuse_ratio"] for t in group if t.get("reuse_ratio") is not None),
            "exact_match": mean(float(t["exact_match"]) for t in group),
        }
        if "agreement" in group[0]:
            row.update(
                {
                    "agreement": mean(t["agreement"] for t in group),
                    "first_token_agreement": mean(t["first_token_agreement"] for t in group),
                    "kl": mean(t["kl"] for t in group),
                    "kv_error": mean(t["kv_error"] for t in group if t.get("kv_error") is not None),
                }
            )
        rows.append(row)
    return rows

"""The one copy of every evaluation metric.

- speed: latency statistics, throughput and ratios against NonShared measured in the same run;
- fidelity to NonShared, teacher-forced on NonShared's own output tokens: top-1 agreement (all
  tokens, first token), mean KL, exact match of free-running outputs;
- KV geometry against the exactly computed cache: relative error ``||C_hat - C|| / ||C||`` (per
  layer, per segment, over a union of segments) and the effective rank of exact blocks and residuals;
- summaries of per-turn / per-request records (what the bench writes to ``turns.jsonl``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..anchors.lowrank import effective_rank, to_matrix

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


# ----------------------------------------------------------------- fidelity


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(
            f"expected two [T, vocab] logits of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def top1_agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Fraction of positions where both ``[T, vocab]`` logits pick the same top-1 token."""
    _check_pair(reference_logits, logits)
    return (reference_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()


def first_token_agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """1.0 when both predict the same first token (the one the prompt alone decides), else 0.0."""
    _check_pair(reference_logits, logits)
    return float(reference_logits[0].argmax().item() == logits[0].argmax().item())


def mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference || method) in nats."""
    _check_pair(reference_logits, logits)
    ref = torch.log_softmax(reference_logits.double(), -1)
    new = torch.log_softmax(logits.double(), -1)
    return (ref.exp() * (ref - new)).sum(-1).mean().item()


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


# --------------------------------------------------------------- KV geometry


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact||_F / ||exact||_F``."""
    if approx.shape != exact.shape:
        raise ValueError(f"shape mismatch: {tuple(approx.shape)} vs {tuple(exact.shape)}")
    denom = exact.double().norm()
    return ((approx.double() - exact.double()).norm() / denom).item() if denom > 0 else 0.0


def agent_layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values ``[1, kv_heads, seq, head_dim]`` of the agent's row of ``cache`` at ``layer``.

    Row 0 is the agent's: double batching (``rebaseshared-db``) appends an adapter-free row 1.
    """
    k, v = cache.layer_kv(layer)
    return k[:1], v[:1]


def kv_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """``[1, kv_heads, seq, head_dim]`` -> ``[seq, kv_heads * head_dim]`` in float64."""
    if tensor.dim() != 4 or tensor.shape[0] != 1:
        raise ValueError(f"expected K/V of shape [1, kv_heads, seq, head_dim], got {tuple(tensor.shape)}")
    return to_matrix(tensor).double()


def kv_error_terms(cache: Any, exact: Any, start: int, end: int) -> list[tuple[float, float, float, float]]:
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


def kv_error(cache: Any, exact: Any, start: int, end: int) -> float:
    """One number: relative error of K and V together over all layers for positions ``[start, end)``."""
    return relative_from_terms(kv_error_terms(cache, exact, start, end))["kv"]


def kv_error_by_layer(cache: Any, exact: Any, start: int, end: int) -> list[dict[str, float]]:
    """Relative K and V error of positions ``[start, end)`` of ``cache`` against ``exact``, per layer."""
    return [
        {"layer": layer, "key": rel["key"], "value": rel["value"]}
        for layer, rel in enumerate(
            relative_from_terms([t]) for t in kv_error_terms(cache, exact, start, end)
        )
    ]


def erank_by_layer(
    cache: Any, exact: Any, start: int, end: int, energy: float = 0.9, noise: float = 1e-5
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

"""The reliability gate (paper Appendix A.3, following KVComm).

Over the compatible anchors ``A_k`` (stored length ``>= k``) with distances ``d_v`` between the
source cache and each anchor's reconstructed base (values, prefix ``k``, all layers)::

    g_v = softmax(-d_v / T)                     (T = 1)
    H   = -sum_v g_v log2 g_v / log2 |A_k|      (normalized entropy, in [0, 1])
    accept  iff  |A_k| >= 2  and  H <= tau

A peaked ``g`` (one anchor clearly closest) has low entropy and is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def gate_weights(distances: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``softmax(-distances / temperature)`` in float64, ``[n]``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.softmax(-torch.as_tensor(distances, dtype=torch.float64) / temperature, dim=0)


def normalized_entropy(weights: torch.Tensor) -> float:
    """``-sum g log2 g / log2 n`` of a distribution over ``n >= 2`` anchors (``0 log 0 = 0``)."""
    weights = torch.as_tensor(weights, dtype=torch.float64)
    n = weights.numel()
    if n < 2:
        raise ValueError(f"normalized entropy needs at least two weights, got {n}")
    return _normalized(_entropy_nats(weights).item(), n)


def _entropy_nats(weights: torch.Tensor) -> torch.Tensor:
    """``-sum g ln g`` as a 0-dim tensor on the weights' device (no host sync)."""
    return -torch.special.xlogy(weights, weights).sum()


def _normalized(entropy_nats: float, n: int) -> float:
    return max(entropy_nats / math.log(2) / math.log2(n), 0.0)


@dataclass
class GateDecision:
    """Outcome of the gate for one workflow edge."""

    accepted: bool
    reason: str  # "accepted", "entropy > tau", "fewer than 2 anchors", ...
    entropy: float | None = None
    weights: list[float] = field(default_factory=list)
    #: the gate distances the decision was taken on (host floats; empty when none were computed)
    distances: list[float] = field(default_factory=list)


def reliability_gate(distances: torch.Tensor, tau: float, temperature: float = 1.0) -> GateDecision:
    """Gate weights, normalized entropy and the accept/fallback decision for ``distances`` ``[n]``
    (any device). The decision is taken on the host: this is the one device-to-host copy of a gated
    segment (entropy, weights and distances in one transfer).

    ``tau = 0`` accepts nothing: for finite distances the softmax is never one-hot, so the
    entropy is strictly positive (even where float rounding makes a weight exactly 1).

    >>> reliability_gate(torch.tensor([0.0, math.log(3)]), tau=0.9).entropy  # weights 3/4, 1/4
    0.8112781244591328
    """
    distances = torch.as_tensor(distances, dtype=torch.float64).flatten()
    n = distances.numel()
    if n < 2:
        return GateDecision(False, f"fewer than 2 compatible anchors ({n})", distances=distances.tolist())
    weights = gate_weights(distances, temperature)
    # the gate's one host synchronisation: entropy, weights and distances come back together
    host = torch.cat((_entropy_nats(weights).reshape(1), weights, distances)).tolist()
    entropy = _normalized(host[0], n)
    accepted = tau > 0 and entropy <= tau
    return GateDecision(
        accepted=accepted,
        reason="accepted" if accepted else f"entropy {entropy:.3g} > tau {tau:g}",
        entropy=entropy,
        weights=host[1 : n + 1],
        distances=host[n + 1 :],
    )


def usage_reference(weights: list[float], mass: float = 0.9) -> list[int]:
    """Indices of the anchors an accepted gate counts as used, as the reference code does
    (``predict_as_anchor``): sorted by weight, those whose cumulative weight stays below ``mass``
    (the anchor crossing ``mass`` is not counted); if the top weight alone reaches ``mass``, every
    anchor is counted.

    >>> usage_reference([0.2, 0.5, 0.3]), usage_reference([0.95, 0.05])
    ([1, 2], [0, 1])
    """
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    if not order:
        return []
    if weights[order[0]] >= mass:
        return order
    used, total = [], 0.0
    for i in order:
        total += weights[i]
        if total >= mass:
            break
        used.append(i)
    return used


def usage_crossing(weights: list[float], mass: float = 0.9) -> list[int]:
    """Indices counted by the per-edge gate: by weight, up to and including the anchor whose
    cumulative weight reaches ``mass``."""
    used, total = [], 0.0
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        used.append(i)
        total += weights[i]
        if total >= mass:
            break
    return used

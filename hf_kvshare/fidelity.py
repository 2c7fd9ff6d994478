"""Fidelity of a sharing method to NonShared.

- teacher-forced top-1 agreement and mean KL between a method's logits and NonShared's over
  NonShared's own output tokens;
- relative KV error ``||C_hat - C|| / ||C||`` per layer against the exactly computed cache.
"""

from __future__ import annotations

import torch

from .cache import SegmentedCache


def top1_agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Fraction of positions where both ``[T, vocab]`` logits pick the same top-1 token."""
    _check_pair(reference_logits, logits)
    return (reference_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()


def mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference || method) in nats."""
    _check_pair(reference_logits, logits)
    ref = torch.log_softmax(reference_logits.double(), -1)
    new = torch.log_softmax(logits.double(), -1)
    return (ref.exp() * (ref - new)).sum(-1).mean().item()


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(
            f"expected two [T, vocab] logits of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact||_F / ||exact||_F``."""
    if approx.shape != exact.shape:
        raise ValueError(f"shape mismatch: {tuple(approx.shape)} vs {tuple(exact.shape)}")
    denom = exact.double().norm()
    return ((approx.double() - exact.double()).norm() / denom).item() if denom > 0 else 0.0


def agent_layer_kv(cache: SegmentedCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values ``[1, kv_heads, seq, head_dim]`` of the agent's row of ``cache`` at ``layer``.

    Row 0 is the agent's: double batching (``rebaseshared-db``) appends an adapter-free row 1.
    """
    k, v = cache.layer_kv(layer)
    return k[:1], v[:1]


def kv_error_by_layer(
    cache: SegmentedCache, exact: SegmentedCache, start: int, end: int
) -> list[dict[str, float]]:
    """Relative K and V error of positions ``[start, end)`` of ``cache`` against ``exact``, per layer."""
    rows = []
    for layer in range(cache.num_layers):
        k, v = agent_layer_kv(cache, layer)
        ek, ev = agent_layer_kv(exact, layer)
        rows.append(
            {
                "layer": layer,
                "key": relative_error(k[..., start:end, :], ek[..., start:end, :]),
                "value": relative_error(v[..., start:end, :], ev[..., start:end, :]),
            }
        )
    return rows


def kv_error(cache: SegmentedCache, exact: SegmentedCache, start: int, end: int) -> float:
    """One number: relative error of K and V together over all layers for positions ``[start, end)``."""
    num = den = 0.0
    for layer in range(cache.num_layers):
        for a, b in zip(agent_layer_kv(cache, layer), agent_layer_kv(exact, layer)):
            a, b = a[..., start:end, :].double(), b[..., start:end, :].double()
            num += (a - b).pow(2).sum().item()
            den += b.pow(2).sum().item()
    return (num / den) ** 0.5 if den > 0 else 0.0

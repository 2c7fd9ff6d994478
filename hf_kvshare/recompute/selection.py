"""Selection criteria of selective recomputation, as plain tensor functions.

- :func:`kv_deviation`: how far each token's reused K/V is from its recomputed K/V (CacheBlend).
- :func:`received_attention`: how much attention each token receives (RelayCaching's importance).
- :func:`top_k`: the ``k`` highest-scoring tokens.
- :func:`select_layer_groups`: the layers with the largest profiled deviation, in at most a few
  contiguous groups (DroidSpeak).
- :func:`gradual_keep_counts`: how many candidates each of several check layers keeps (CacheBlend's
  gradual filtering).
- :func:`layer_deviation_profile`: per-layer KV deviation of reuse transitions (DroidSpeak profiling).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def kv_deviation(
    fresh_keys: torch.Tensor,
    fresh_values: torch.Tensor,
    reused_keys: torch.Tensor,
    reused_values: torch.Tensor,
) -> torch.Tensor:
    """Per-token KV deviation ``[q]`` between recomputed and reused K/V ``[batch, kv_heads, q, head_dim]``.

    ``||dK_t||^2 / mean_t ||K_t||^2 + ||dV_t||^2 / mean_t ||V_t||^2`` (squared L2 over heads and head
    dims; each term normalized by the mean squared norm of the recomputed rows so that keys and
    values weigh alike). Summed over the batch.
    """
    if fresh_keys.shape != reused_keys.shape or fresh_values.shape != reused_values.shape:
        raise ValueError(
            f"fresh and reused K/V must have the same shape; got keys {tuple(fresh_keys.shape)} vs "
            f"{tuple(reused_keys.shape)} and values {tuple(fresh_values.shape)} vs {tuple(reused_values.shape)}"
        )
    total = torch.zeros(fresh_keys.shape[-2], dtype=torch.float64, device=fresh_keys.device)
    for fresh, reused in ((fresh_keys, reused_keys), (fresh_values, reused_values)):
        fresh, reused = fresh.double(), reused.double()
        diff = (fresh - reused).pow(2).sum(dim=(0, 1, 3))
        scale = fresh.pow(2).sum(dim=(0, 1, 3)).mean()
        total += diff / scale if scale > 0 else diff
    return total


def received_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    prefix_length: int = 0,
) -> torch.Tensor:
    """Attention mass each segment key receives, summed over the queries and averaged over heads.

    Args:
        queries: post-RoPE queries ``[1, heads, q, head_dim]``.
        keys: post-RoPE keys ``[1, kv_heads, prefix_length + S, head_dim]`` (GQA: heads are repeated).
        mask: additive mask ``[1, 1, q, prefix_length + S]`` or ``None`` (all visible).
        scaling: the attention's softmax scale.
        prefix_length: keys before the segment; their attention is not returned.

    Returns:
        ``[S]`` float64: ``sum_q mean_h softmax(q k^T * scaling + mask)[h, q, t]`` over segment keys
        ``t`` (the accumulated attention score of heavy-hitter selection).
    """
    heads, kv_heads = queries.shape[1], keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key heads")
    if queries.shape[-1] != keys.shape[-1]:
        raise ValueError(f"queries have head dim {queries.shape[-1]}, keys {keys.shape[-1]}")
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1)  # [1, heads, q, prefix + S]
    return probs[..., prefix_length:].double().mean(dim=1).sum(dim=(0, 1))


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[k]`` (ascending) of the ``k`` largest ``scores`` ``[n]``; ties go to the earlier index."""
    n = scores.numel()
    if not 0 <= k <= n:
        raise ValueError(f"cannot select {k} of {n} items")
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    # stable descending sort: equal scores keep their order, so earlier indices win ties
    order = torch.sort(scores.flatten().double(), descending=True, stable=True).indices
    return torch.sort(order[:k]).values


def gradual_keep_counts(candidates: int, k: int, checks: int) -> list[int]:
    """How many tokens each of ``checks`` check layers keeps, from ``candidates`` down to ``k``.

    The last check keeps ``k``; earlier ones keep geometrically more (``k * (candidates / k) ** ((checks - 1 - i) / checks)``),
    so that each check narrows the candidates of the previous one (CacheBlend's gradual filtering).
    """
    if checks < 1:
        raise ValueError(f"need at least one check layer, got {checks}")
    if not 0 <= k <= candidates:
        raise ValueError(f"cannot keep {k} of {candidates} tokens")
    if k == 0:
        return [0] * checks
    counts = []
    for i in range(checks):
        share = (checks - 1 - i) / checks
        counts.append(min(candidates, max(k, math.ceil(k * (candidates / k) ** share - 1e-9))))
    return counts


def select_layer_groups(profile: Sequence[float], n_layers: int, max_groups: int) -> list[tuple[int, int]]:
    """The ``n_layers`` layers with the largest total ``profile``, in at most ``max_groups`` contiguous groups.

    Args:
        profile: a deviation score per layer ``[L]``.
        n_layers: how many layers to select (``0 <= n_layers <= L``).
        max_groups: how many contiguous groups (transitions between reused and recomputed layers)
            are allowed.

    Returns:
        ``[(start, end), ...]`` half-open layer ranges in increasing order. Exact dynamic program;
        among equal totals the earliest layers win.
    """
    scores = [float(x) for x in profile]
    L = len(scores)
    if not 0 <= n_layers <= L:
        raise ValueError(f"cannot select {n_layers} of {L} layers")
    if max_groups < 1:
        raise ValueError(f"max_groups must be >= 1, got {max_groups}")
    if any(math.isnan(x) for x in scores):
        raise ValueError("the layer profile contains NaN")
    if n_layers == 0:
        return []
    neg = -math.inf
    # best[i][c][g][s]: best total over layers i.. with c layers still to pick and g groups still
    # allowed to open, s = 1 when layer i-1 was picked (picking layer i continues its group)
    best = [[[[neg] * 2 for _ in range(max_groups + 1)] for _ in range(n_layers + 1)] for _ in range(L + 1)]
    for g in range(max_groups + 1):
        for s in range(2):
            best[L][0][g][s] = 0.0

    def take_value(i: int, c: int, g: int, s: int) -> float:
        """Best score when layer i is picked (continuing a group if s == 1, else opening one)."""
        if c == 0:
            return neg
        if s == 1:
            rest = best[i + 1][c - 1][g][1]
        elif g > 0:
            rest = best[i + 1][c - 1][g - 1][1]
        else:
            return neg
        return rest + scores[i] if rest > neg else neg

    for i in range(L - 1, -1, -1):
        for c in range(n_layers + 1):
            for g in range(max_groups + 1):
                for s in range(2):
                    skip = best[i + 1][c][g][0]
                    take = take_value(i, c, g, s)
                    best[i][c][g][s] = take if take >= skip else skip
    if best[0][n_layers][max_groups][0] == neg:
        raise ValueError(f"no way to pick {n_layers} layers in {max_groups} groups")
    picked, c, g, s = [], n_layers, max_groups, 0
    for i in range(L):
        take = take_value(i, c, g, s)
        if c > 0 and take > neg and take >= best[i + 1][c][g][0]:
            picked.append(i)
            if s == 0:
                g -= 1
            c, s = c - 1, 1
        else:
            s = 0
    groups: list[tuple[int, int]] = []
    for i in picked:
        if groups and groups[-1][1] == i:
            groups[-1] = (groups[-1][0], i + 1)
        else:
            groups.append((i, i + 1))
    return groups


def layer_deviation_profile(pairs: Sequence[tuple[Sequence[torch.Tensor], ...]]) -> list[float]:
    """Mean per-layer relative squared KV deviation over reuse transitions.

    Args:
        pairs: ``(reused_keys, reused_values, exact_keys, exact_values)`` per transition, each a
            list over layers of ``[batch, kv_heads, S, head_dim]``.

    Returns:
        ``[L]``: for each layer, the mean over transitions of
        ``(||dK||^2 / ||K||^2 + ||dV||^2 / ||V||^2) / 2``.
    """
    if not pairs:
        raise ValueError("profiling needs at least one reuse transition")
    num_layers = len(pairs[0][0])
    totals = [0.0] * num_layers
    for reused_k, reused_v, exact_k, exact_v in pairs:
        if len(reused_k) != num_layers:
            raise ValueError(f"transitions disagree on the number of layers: {len(reused_k)} vs {num_layers}")
        for layer in range(num_layers):
            for reused, exact in ((reused_k[layer], exact_k[layer]), (reused_v[layer], exact_v[layer])):
                exact64 = exact.double()
                denom = exact64.pow(2).sum().item()
                diff = (reused.double() - exact64).pow(2).sum().item()
                totals[layer] += 0.5 * (diff / denom if denom > 0 else diff)
    return [t / len(pairs) for t in totals]

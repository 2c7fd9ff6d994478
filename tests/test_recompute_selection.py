"""The selection criteria on hand-built inputs: they pick what they should."""

from __future__ import annotations

import pytest
import torch

from hf_kvshare.recompute.selection import (
    gradual_keep_counts,
    kv_deviation,
    layer_deviation_profile,
    received_attention,
    select_layer_groups,
    top_k,
)


def kv(seed: int, tokens: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, tokens, 4, generator=g), torch.randn(1, 2, tokens, 4, generator=g)


def test_kv_deviation_ranks_the_deviating_tokens():
    k, v = kv(0)
    k2, v2 = k.clone(), v.clone()
    k2[..., 5, :] += 3.0  # key deviation
    v2[..., 1, :] += 1.0  # smaller value deviation
    dev = kv_deviation(k2, v2, k, v)
    assert dev.shape == (8,)
    assert dev[5] > dev[1] > 0
    assert torch.all(dev[[0, 2, 3, 4, 6, 7]] == 0)
    assert top_k(dev, 2).tolist() == [1, 5]


def test_kv_deviation_is_scale_free_per_keys_and_values():
    k, v = kv(1)
    # keys 100x larger than values: a 10% key change still weighs like a 10% value change
    by_keys = kv_deviation(k * 100 * 1.1, v, k * 100, v)
    by_values = kv_deviation(k * 100, v * 1.1, k * 100, v)
    assert torch.allclose(by_keys, kv_deviation(k * 1.1, v, k, v), rtol=1e-6)
    assert 0.5 < by_keys.sum() / by_values.sum() < 2.0


def test_kv_deviation_shape_mismatch():
    k, v = kv(0)
    with pytest.raises(ValueError, match="same shape"):
        kv_deviation(k[..., :3, :], v, k, v)


def test_received_attention_finds_the_attended_token():
    torch.manual_seed(0)
    keys = torch.randn(1, 1, 6, 8) * 0.1
    keys[..., 2, :] = torch.ones(8)  # a key aligned with every query
    queries = torch.ones(1, 2, 6, 8)  # 2 heads share the key head (GQA)
    causal = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    att = received_attention(queries, keys, causal, scaling=1.0)
    assert att.shape == (6,)
    assert int(att.argmax()) == 2
    assert att.sum().item() == pytest.approx(6.0)  # each query distributes mass 1


def test_received_attention_excludes_the_prefix():
    queries = torch.ones(1, 1, 3, 4)
    keys = torch.zeros(1, 1, 5, 4)  # uniform attention over 2 prefix + 3 segment keys
    att = received_attention(queries, keys, None, scaling=1.0, prefix_length=2)
    assert att.shape == (3,)
    assert torch.allclose(att, torch.full((3,), 3 / 5, dtype=torch.float64))


def test_deviation_times_attention_prefers_the_attended_one():
    dev = torch.tensor([1.0, 1.0, 0.2, 0.0], dtype=torch.float64)
    att = torch.tensor([0.1, 0.9, 0.9, 5.0], dtype=torch.float64)
    assert top_k(dev * att, 1).tolist() == [1]  # equal deviation: the attended token wins
    assert top_k(dev * att, 2).tolist() == [1, 2]  # no deviation: never selected while others deviate


def test_top_k_order_and_ties():
    scores = torch.tensor([0.5, 2.0, 0.5, 2.0, 1.0])
    assert top_k(scores, 3).tolist() == [1, 3, 4]
    assert top_k(scores, 4).tolist() == [0, 1, 3, 4]  # the earlier of two equal scores
    assert top_k(scores, 0).tolist() == []
    with pytest.raises(ValueError, match="cannot select 6 of 5"):
        top_k(scores, 6)


def test_gradual_keep_counts():
    assert gradual_keep_counts(100, 15, 1) == [15]
    first, last = gradual_keep_counts(100, 16, 2)
    assert last == 16 and first == 40  # 16 * (100 / 16) ** 0.5
    counts = gradual_keep_counts(100, 10, 3)
    assert counts == sorted(counts, reverse=True) and counts[-1] == 10 and counts[0] <= 100
    assert gradual_keep_counts(10, 10, 2) == [10, 10]
    assert gradual_keep_counts(10, 0, 2) == [0, 0]
    with pytest.raises(ValueError):
        gradual_keep_counts(10, 11, 1)


@pytest.mark.parametrize(
    "profile, n, groups, expected",
    [
        ([0, 1, 5, 4, 0, 0, 3, 0], 2, 1, [(2, 4)]),
        ([0, 1, 5, 4, 0, 0, 3, 0], 3, 1, [(1, 4)]),  # one group: the best window of 3
        ([0, 1, 5, 4, 0, 0, 3, 0], 3, 2, [(2, 4), (6, 7)]),  # two groups: the peak at 6 joins
        ([9, 0, 0, 0, 0, 0, 0, 9], 2, 1, [(0, 2)]),  # tie: the earliest window
        ([9, 0, 0, 0, 0, 0, 0, 9], 2, 2, [(0, 1), (7, 8)]),
        ([1, 1, 1], 3, 1, [(0, 3)]),
        ([1, 2, 3], 0, 1, []),
    ],
)
def test_select_layer_groups(profile, n, groups, expected):
    assert select_layer_groups(profile, n, groups) == expected


def test_select_layer_groups_brute_force():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(40):
        L = rng.randint(3, 9)
        profile = [rng.random() for _ in range(L)]
        n, g = rng.randint(1, L), rng.randint(1, 3)
        got = select_layer_groups(profile, n, g)
        picked = [i for a, b in got for i in range(a, b)]
        assert len(picked) == n and len(got) <= g
        best = max(
            sum(profile[i] for i in combo)
            for combo in itertools.combinations(range(L), n)
            if sum(1 for j, i in enumerate(combo) if j == 0 or combo[j - 1] != i - 1) <= g
        )
        assert sum(profile[i] for i in picked) == pytest.approx(best)


def test_select_layer_groups_errors():
    with pytest.raises(ValueError, match="cannot select 4 of 3"):
        select_layer_groups([1, 2, 3], 4, 1)
    with pytest.raises(ValueError, match="max_groups"):
        select_layer_groups([1, 2, 3], 1, 0)
    with pytest.raises(ValueError, match="NaN"):
        select_layer_groups([1, float("nan"), 3], 1, 1)


def test_layer_deviation_profile():
    exact_k, exact_v = [torch.ones(1, 1, 2, 2)] * 3, [torch.ones(1, 1, 2, 2)] * 3
    reused_k = [torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2) * 2, torch.ones(1, 1, 2, 2)]
    reused_v = [torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2) * 3]
    profile = layer_deviation_profile([(reused_k, reused_v, exact_k, exact_v)])
    assert profile == pytest.approx([0.0, 0.5, 2.0])  # (||dK||^2/||K||^2 + ||dV||^2/||V||^2) / 2
    with pytest.raises(ValueError, match="at least one"):
        layer_deviation_profile([])

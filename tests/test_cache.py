"""SegmentedCache / SharedCache: segment table, K/V insertion and extraction, generate's cache calls."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from hf_kvshare import RopeShifter, Segment, SegmentedCache, SharedCache, cache_kwargs


def dense(model, ids, start=0):
    cache = SegmentedCache(model.config)
    if start:
        cache.append_dense(model, torch.zeros(1, start, dtype=torch.long))
    cache.append_dense(model, ids[None], [Segment("x", "PH", start, start + ids.numel())])
    return cache


def test_append_dense_matches_one_forward(tiny):
    ids = torch.randint(3, 1000, (20,))
    one = SegmentedCache(tiny.config)
    one.append_dense(tiny, ids[None], [Segment("all", "PF", 0, 20)])
    two = SegmentedCache(tiny.config)
    two.append_dense(tiny, ids[None, :8], [Segment("a", "PF", 0, 8)])
    two.append_dense(tiny, ids[None, 8:], [Segment("b", "PH", 8, 20)])
    assert [s.name for s in two.segments] == ["a", "b"]
    for layer in range(tiny.config.num_hidden_layers):
        for x, y in zip(one.layer_kv(layer), two.layer_kv(layer)):
            assert torch.allclose(x, y, atol=1e-5)


def test_extract_reposition_append_roundtrip(tiny):
    """Re-positioning a segment computed at offset 0 reproduces it computed at offset d (all layers)."""
    shifter = RopeShifter.from_model(tiny)
    ids = torch.randint(3, 1000, (12,))
    d = 29
    at0 = SegmentedCache(tiny.config)
    at0.append_dense(tiny, ids[None], [Segment("s", "PH", 0, 12)])
    # same tokens at positions d..d+11 with nothing before them (explicit position ids)
    atd = SegmentedCache(tiny.config)
    with torch.no_grad():
        tiny(
            input_ids=ids[None],
            position_ids=torch.arange(d, d + 12)[None],
            use_cache=True,
            **cache_kwargs(atd),
        )
    moved = at0.extract_segment("s").repositioned(shifter, d)
    for layer in range(tiny.config.num_hidden_layers):
        k, v = atd.layer_kv(layer)
        assert (moved.keys[layer] - k).abs().max() <= 1e-5
        assert (moved.values[layer] - v).abs().max() <= 1e-5


def test_append_kv_checks_and_positions(tiny):
    shifter = RopeShifter.from_model(tiny)
    src = dense(tiny, torch.randint(3, 1000, (6,)), start=4)
    kv = src.extract(4, 10, agent="a")
    target = SegmentedCache(tiny.config)
    target.append_dense(tiny, torch.randint(3, 1000, (1, 9)), [Segment("sys", "PF", 0, 9)])
    with pytest.raises(ValueError, match="RopeShifter"):
        target.append_kv(kv, Segment("x", "PH", 9, 15, "reused"))
    with pytest.raises(ValueError, match="cache ends at 9"):
        target.append_kv(kv, Segment("x", "PH", 8, 14, "reused"), shifter)
    assert target.get_seq_length() == 9 and len(target.segments) == 1  # nothing mutated
    target.append_kv(kv, Segment("x", "PH", 9, 15, "reused", source_agent="a"), shifter)
    assert target.get_seq_length() == 15
    assert target.segment("x").source_agent == "a"


def test_crop_copy_reset_keep_table_consistent(tiny):
    cache = SegmentedCache(tiny.config)
    cache.append_dense(
        tiny, torch.randint(3, 1000, (1, 10)), [Segment("a", "PF", 0, 4), Segment("b", "PH", 4, 10)]
    )
    copy = cache.copy()
    cache.crop(-3)
    assert cache.get_seq_length() == 7 and cache.segments[-1].end == 7
    cache.crop_to(3)
    assert [s.name for s in cache.segments] == ["a"] and cache.segments[0].end == 3
    assert copy.get_seq_length() == 10 and copy.segments[-1].end == 10  # the copy is independent
    copy.reset()
    assert copy.get_seq_length() == 0 and copy.segments == []


def test_batch_operations(tiny):
    cache = SegmentedCache(tiny.config)
    cache.append_dense(tiny, torch.randint(3, 1000, (1, 5)), [Segment("a", "PF", 0, 5)])
    cache.batch_repeat_interleave(3)
    assert cache.layer_kv(0)[0].shape[0] == 3
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.layer_kv(0)[0].shape[0] == 2
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.get_seq_length() == 5 and cache.segments[0].end == 5


def test_shape_mismatch_is_refused(tiny_llama):
    other = tiny_model("llama", num_key_value_heads=4)
    cache = SegmentedCache(other.config)
    with pytest.raises(ValueError, match="kv heads"):
        cache.append_dense(tiny_llama, torch.randint(3, 1000, (1, 4)))
    deeper = tiny_model("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match="layers"):
        SegmentedCache(tiny_llama.config).append_dense(deeper, torch.randint(3, 1000, (1, 4)))
    with pytest.raises(ValueError, match="mismatch"):
        cache.check_model(tiny_llama)


def test_shared_cache_keeps_last_prompt_token_out(tiny_llama):
    cache = SharedCache(tiny_llama.config)
    cache.append_dense(tiny_llama, torch.randint(3, 1000, (1, 6)))
    with pytest.raises(ValueError, match="last prompt token"):
        cache.seal(6)
    cache.seal(7)


def test_report_names_segments(tiny_llama):
    cache = SegmentedCache(tiny_llama.config)
    cache.append_dense(
        tiny_llama, torch.randint(3, 1000, (1, 6)), [Segment("query", "PH", 0, 6, info={"H": 0.25})]
    )
    text = cache.report()
    assert "query" in text and "dense" in text and "H=0.25" in text

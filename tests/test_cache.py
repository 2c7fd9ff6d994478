"""SegmentedCache / SharedCache: segment table, K/V insertion and extraction, generate's cache calls."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny import tiny_model
from transformers import DynamicCache

from hf_kvshare import RopeShifter, Segment, SegmentedCache, SharedCache, cache_kwargs
from hf_kvshare._compat import output_cache
from hf_kvshare.cache import LayerIndexError, PositionMismatchError, SegmentKV, check_finite
from hf_kvshare.prefill import prefill_dense


def dense(model, ids, start=0):
    cache = SegmentedCache(model.config)
    if start:
        prefill_dense(cache, model, torch.zeros(1, start, dtype=torch.long))
    prefill_dense(cache, model, ids[None], [Segment("x", "PH", start, start + ids.numel())])
    return cache


def test_prefill_dense_matches_one_forward(tiny):
    ids = torch.randint(3, 1000, (20,))
    one = SegmentedCache(tiny.config)
    prefill_dense(one, tiny, ids[None], [Segment("all", "PF", 0, 20)])
    two = SegmentedCache(tiny.config)
    prefill_dense(two, tiny, ids[None, :8], [Segment("a", "PF", 0, 8)])
    prefill_dense(two, tiny, ids[None, 8:], [Segment("b", "PH", 8, 20)])
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
    prefill_dense(at0, tiny, ids[None], [Segment("s", "PH", 0, 12)])
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
    prefill_dense(target, tiny, torch.randint(3, 1000, (1, 9)), [Segment("sys", "PF", 0, 9)])
    with pytest.raises(ValueError, match="RopeShifter"):
        target.append_kv(kv, Segment("x", "PH", 9, 15, "reused"))
    with pytest.raises(ValueError, match="cache ends at 9"):
        target.append_kv(kv, Segment("x", "PH", 8, 14, "reused"), shifter)
    assert target.get_seq_length() == 9 and len(target.segments) == 1  # nothing mutated
    target.append_kv(kv, Segment("x", "PH", 9, 15, "reused", source_agent="a"), shifter)
    assert target.get_seq_length() == 15
    assert target.segment("x").source_agent == "a"


def test_append_placed_stores_what_appending_part_by_part_stores_each_layer_once(tiny):
    from hf_kvshare.cache import CachePart
    from hf_kvshare.prefill import prefill_parts

    shifter = RopeShifter.from_model(tiny)
    src = dense(tiny, torch.randint(3, 1000, (14,)), start=3)
    kvs = [src.extract(3, 7, agent="a"), src.extract(7, 12), src.extract(12, 17, agent="b")]
    # the first and last parts land elsewhere (re-positioned), the middle one where it was computed
    table = [
        Segment("sys", "PF", 0, 4, "reused"),
        Segment("doc", "PH", 4, 9, "reused", "a"),
        Segment("t", "PF", 9, 14, "reused"),
    ]
    kvs[1] = src.extract(4, 9)
    parts = [CachePart(seg, kv=kv) for seg, kv in zip(table, kvs)]
    one, each = SegmentedCache(tiny.config), SegmentedCache(tiny.config)
    updates = []  # each layer stored once (a layer's K/V assembled in one tensor), not once per part
    inner = one._store_new
    one._store_new = lambda k, v, i: updates.append(i) or inner(k, v, i)
    one.append_placed(parts, shifter)
    for part in parts:
        each.append_kv(part.kv, part.segment, shifter)
    assert updates == list(range(tiny.config.num_hidden_layers))
    assert one.segments == each.segments == table and one.get_seq_length() == 14
    for layer in range(tiny.config.num_hidden_layers):
        for x, y in zip(one.layer_kv(layer), each.layer_kv(layer)):
            assert torch.equal(x, y)
    # prefill_parts places a run of placed parts the same way (a turn with nothing dense)
    via = SegmentedCache(tiny.config)
    inner_via = via._store_new
    counted = []
    via._store_new = lambda k, v, i: counted.append(i) or inner_via(k, v, i)
    prefill_parts(via, tiny, parts, shifter)
    assert counted == updates and via.segments == table
    assert all(
        torch.equal(via.layer_kv(i)[0], one.layer_kv(i)[0]) for i in range(tiny.config.num_hidden_layers)
    )
    # refused before anything is stored
    empty = SegmentedCache(tiny.config)
    with pytest.raises(ValueError, match="RopeShifter"):
        empty.append_placed(parts)
    with pytest.raises(ValueError, match="tile"):
        empty.append_placed([parts[0], parts[2]], shifter)
    with pytest.raises(ValueError, match="has 5 tokens"):
        empty.append_placed([CachePart(Segment("sys", "PF", 0, 4), kv=kvs[2])], shifter)
    with pytest.raises(ValueError, match="no K/V"):
        empty.append_placed(
            [CachePart(Segment("sys", "PF", 0, 4), token_ids=torch.zeros(1, 4, dtype=torch.long))]
        )
    assert empty.get_seq_length() == 0 and empty.segments == []


def test_reserve_refuses_a_placed_part_that_does_not_fit_before_storing_anything(tiny):
    from hf_kvshare.cache import CachePart

    shifter = RopeShifter.from_model(tiny)
    src = dense(tiny, torch.randint(3, 1000, (12,)))
    ids = torch.zeros(1, 3, dtype=torch.long)
    sys_ = CachePart(Segment("sys", "PF", 0, 3), token_ids=ids)
    doc = Segment("doc", "PH", 3, 8, "reused", "a")
    cache = SegmentedCache(tiny.config)
    with pytest.raises(ValueError, match="has 6 tokens"):
        cache.reserve([sys_, CachePart(doc, kv=src.extract(2, 8))], torch.arange(3), shifter)
    with pytest.raises(ValueError, match="RopeShifter"):
        cache.reserve([sys_, CachePart(doc, kv=src.extract(0, 5))], torch.arange(3))
    assert cache.get_seq_length() == 0 and all(not layer.is_initialized for layer in cache.layers)
    writer = cache.reserve([sys_, CachePart(doc, kv=src.extract(0, 5))], torch.arange(3), shifter)
    assert writer is not None and cache.get_seq_length() == 8


def test_append_tiled_stores_what_appending_segment_by_segment_stores(tiny):
    src = dense(tiny, torch.randint(3, 1000, (10,)))
    kv = src.extract(0, 10, agent="a")
    table = [Segment("a", "PF", 0, 3), Segment("x", "PH", 3, 8, "reused", "b"), Segment("t", "PF", 8, 10)]
    one, each = SegmentedCache(tiny.config), SegmentedCache(tiny.config)
    one.append_tiled(kv, table)
    for seg in table:
        each.append_kv(src.extract(seg.start, seg.end), seg)
    assert one.segments == each.segments and one.get_seq_length() == 10
    for layer in range(tiny.config.num_hidden_layers):
        for x, y in zip(one.layer_kv(layer), each.layer_kv(layer)):
            assert torch.equal(x, y)
    # the cache holds a copy: writing the source leaves it alone
    kv.keys[0].zero_()
    assert torch.equal(one.layer_kv(0)[0], each.layer_kv(0)[0])
    empty = SegmentedCache(tiny.config)
    with pytest.raises(ValueError, match="tile"):
        empty.append_tiled(src.extract(0, 10), [Segment("a", "PF", 0, 3), Segment("b", "PF", 4, 10)])
    with pytest.raises(ValueError, match="10 tokens were given"):
        empty.append_tiled(src.extract(0, 10), [Segment("a", "PF", 0, 9)])
    with pytest.raises(ValueError, match="no segments"):
        empty.append_tiled(src.extract(0, 10), [])
    with pytest.raises(ValueError, match="cache ends at 0"):
        empty.append_tiled(src.extract(2, 10), [Segment("a", "PF", 2, 10)])
    assert empty.get_seq_length() == 0 and empty.segments == []  # nothing stored


def test_an_adopted_read_back_is_held_without_a_copy_and_its_extracts_are_known_finite(tiny):
    src = dense(tiny, torch.randint(3, 1000, (10,)))
    # an engine's read-back: one [layers, n, heads, dim] tensor per K and V, given as per-layer views
    keys = torch.stack([src.layer_kv(i)[0][0].transpose(0, 1) for i in range(tiny.config.num_hidden_layers)])
    values = torch.stack(
        [src.layer_kv(i)[1][0].transpose(0, 1) for i in range(tiny.config.num_hidden_layers)]
    )
    used = SegmentKV(
        keys=[k.transpose(0, 1)[None] for k in keys],
        values=[v.transpose(0, 1)[None] for v in values],
        start=0,
    )
    table = [Segment("a", "PF", 0, 4), Segment("x", "PH", 4, 10)]
    unchecked = SegmentedCache(tiny.config)
    unchecked.append_tiled(used, table, adopt=True)
    assert not unchecked.known_finite and not unchecked.extract(4, 10).finite  # never checked
    used.check_finite("the read-back")
    assert not used.finite  # passing does not mark (a session's K/V is checked at every use)
    used.finite = True  # what the serving record states of the read-back it checked and holds
    cache = SegmentedCache(tiny.config)
    cache.append_tiled(used, table, adopt=True)
    assert cache.known_finite and cache.segments == table
    assert cache.layer_kv(0)[0].untyped_storage().data_ptr() == keys.untyped_storage().data_ptr()  # no copy
    for layer in range(tiny.config.num_hidden_layers):
        for x, y in zip(cache.layer_kv(layer), src.layer_kv(layer)):
            assert torch.equal(x, y)
    with cache.sharing_storage():
        view = cache.extract(4, 10)
    assert view.finite and cache.extract(4, 10).finite
    # a K/V made from a checked one is not marked: re-positioned, it is checked on its own
    assert not replace(view, start=4).finite
    # marked K/V is not read again (here: spoiled behind the mark's back, as nothing in the library does)
    view.keys[1][0, 0, 0, 0] = float("nan")
    check_finite([("the view", view)])
    fresh = cache.extract(4, 10)
    fresh.finite = False
    with pytest.raises(ValueError, match="the slot: non-finite K/V .* layer 1 \\(keys\\)"):
        fresh.check_finite("the slot")
    # anything written afterwards is unchecked: the mark goes
    more = dense(tiny, torch.randint(3, 1000, (12,))).extract(10, 12)
    cache.append_kv(more, Segment("t", "PF", 10, 12))
    assert not cache.known_finite and not cache.extract(10, 12).finite
    # a cache that held something already copies, and is not marked
    copy = SegmentedCache(tiny.config)
    copy.append_tiled(src.extract(0, 4), [Segment("a", "PF", 0, 4)])
    copy.append_tiled(src.extract(4, 10), [Segment("x", "PH", 4, 10)], adopt=True)
    assert not copy.known_finite


def test_crop_copy_reset_keep_table_consistent(tiny):
    cache = SegmentedCache(tiny.config)
    prefill_dense(
        cache, tiny, torch.randint(3, 1000, (1, 10)), [Segment("a", "PF", 0, 4), Segment("b", "PH", 4, 10)]
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
    prefill_dense(cache, tiny, torch.randint(3, 1000, (1, 5)), [Segment("a", "PF", 0, 5)])
    cache.batch_repeat_interleave(3)
    assert cache.layer_kv(0)[0].shape[0] == 3
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.layer_kv(0)[0].shape[0] == 2
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.get_seq_length() == 5 and cache.segments[0].end == 5


def test_shape_mismatch_is_refused(tiny_llama):
    other = tiny_model("llama", num_key_value_heads=4)
    cache = SegmentedCache(other.config)
    with pytest.raises(ValueError, match="kv.heads"):
        prefill_dense(cache, tiny_llama, torch.randint(3, 1000, (1, 4)))
    deeper = tiny_model("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match="layers"):
        prefill_dense(SegmentedCache(tiny_llama.config), deeper, torch.randint(3, 1000, (1, 4)))
    with pytest.raises(ValueError, match="mismatch"):
        cache.check_model(tiny_llama)


def test_shared_cache_keeps_last_prompt_token_out(tiny_llama):
    cache = SharedCache(tiny_llama.config)
    prefill_dense(cache, tiny_llama, torch.randint(3, 1000, (1, 6)))
    with pytest.raises(ValueError, match="last prompt token"):
        cache.seal(6)
    cache.seal(7)


def test_report_names_segments(tiny_llama):
    cache = SegmentedCache(tiny_llama.config)
    prefill_dense(
        cache, tiny_llama, torch.randint(3, 1000, (1, 6)), [Segment("query", "PH", 0, 6, info={"H": 0.25})]
    )
    text = cache.report()
    assert "query" in text and "dense" in text and "H=0.25" in text


# ------------------------------------------------------------- DynamicCache contract (issue 17)
def _kv(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_constructor_without_config_builds_layers_lazily(tiny):
    ids = torch.randint(3, 1000, (1, 7))
    plain, ours = DynamicCache(), SegmentedCache()
    assert len(ours.layers) == 0 and ours.num_layers == 0
    with torch.no_grad():
        tiny(input_ids=ids, use_cache=True, **cache_kwargs(plain))
        tiny(input_ids=ids, use_cache=True, **cache_kwargs(ours))
    assert ours.num_layers == tiny.config.num_hidden_layers and ours.get_seq_length() == 7
    for (k1, v1), (k2, v2) in zip(_kv(plain), _kv(ours)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    ours.check_model(tiny)  # the first update fixed kv heads / head dim
    with pytest.raises(ValueError, match="kv heads"):
        ours.update(torch.zeros(1, 7, 1, 16), torch.zeros(1, 7, 1, 16), 0)
    copy = ours.copy()
    assert copy.get_seq_length() == 7 and copy.layer_kv(2)[0] is not ours.layer_kv(2)[0]


def test_every_layer_is_a_segment_layer_that_keeps_every_position(tiny_llama):
    """The cache is a table over its layers and the layers store (``cache_layer.SegmentLayer``, a
    ``DynamicLayer``): built from a config with sliding-window layers (kept whole), lazily, from
    DataParallel pairs and copied; a layout that stops part way cuts every
    layer back (``SegmentLayer.keep``)."""
    from transformers.cache_utils import DynamicLayer

    from hf_kvshare.cache_layer import SegmentLayer

    config = tiny_llama.config.__class__(**{**tiny_llama.config.to_dict(), "layer_types": None})
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    config.sliding_window = 4
    built = SegmentedCache(config)
    assert [type(layer) for layer in built.layers] == [SegmentLayer] * 3 and built.can_reserve
    assert isinstance(built.layers[0], DynamicLayer) and not built.layers[0].is_sliding
    lazy = SegmentedCache()
    lazy.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 1)
    assert [type(layer) for layer in lazy.layers] == [SegmentLayer] * 2
    src = SegmentedCache(tiny_llama.config)
    prefill_dense(src, tiny_llama, torch.randint(3, 1000, (1, 9)), [Segment("a", "PF", 0, 9)])
    pairs = SegmentedCache([(k, v) for k, v, _ in src])
    assert all(type(layer) is SegmentLayer for layer in pairs.layers)
    assert torch.equal(pairs.layer_kv(2)[0], src.layer_kv(2)[0])
    copy = src.copy()
    assert all(type(layer) is SegmentLayer for layer in copy.layers)
    assert (
        torch.equal(copy.layer_kv(1)[1], src.layer_kv(1)[1]) and copy.layer_kv(1)[1] is not src.layer_kv(1)[1]
    )
    for layer in copy.layers[:2]:
        layer.keep(4)
    assert [layer.get_seq_length() for layer in copy.layers] == [4, 4, 9]


def test_rebuild_from_pairs_like_dataparallel(tiny_llama):
    """DataParallel's gather (and pytree unflattening) call ``type(cache)(iterable of per-layer tuples)``."""
    from hf_kvshare.anchors.cache import CorrectedCache

    src = SharedCache(tiny_llama.config)
    prefill_dense(src, tiny_llama, torch.randint(3, 1000, (1, 5)), [Segment("a", "PF", 0, 5)])
    for cls in (SegmentedCache, SharedCache, CorrectedCache):
        rebuilt = cls(map(lambda kv: kv, iter(src)))  # (keys, values, sliding window tensor) per layer
        assert type(rebuilt) is cls and rebuilt.get_seq_length() == 5 and rebuilt.num_layers == 3
        assert rebuilt.segments == [] and "+5 positions appended" in rebuilt.report()
        assert torch.equal(rebuilt.layer_kv(1)[1], src.layer_kv(1)[1])
    keyword = SegmentedCache(ddp_cache_data=[(k, v) for k, v, _ in src], config=tiny_llama.config)
    assert keyword.signature == (3, 2, 16) and keyword.get_seq_length() == 5


def test_offloading_option_is_accepted(tiny_llama):
    try:  # on a CUDA build of torch without a usable GPU, DynamicCache itself cannot make its stream
        DynamicCache(offloading=True)
    except Exception as error:
        with pytest.raises(type(error)):  # parity: ours fails the same way
            SegmentedCache(tiny_llama.config, offloading=True)
        return
    cache = SegmentedCache(tiny_llama.config, offloading=True)
    assert cache.offloading and not cache.only_non_sliding
    assert SharedCache(offloading=True, offload_only_non_sliding=True).only_non_sliding


@pytest.mark.gpu
def test_offloading_generates_like_dynamic_cache(tokenizer):
    from hf_kvshare import PF, PH, Session

    model = tiny_model("llama").cuda()
    cache, ids = Session(model, tokenizer).build_cache("a", [PF("You are a.\n"), PH("query", "Say hi.")])
    offloaded = SharedCache(model.config, offloading=True)
    for layer in range(3):
        offloaded.update(*cache.layer_kv(layer), layer)
    offloaded.segments = list(cache.segments)
    offloaded.seal(ids.shape[1])
    with torch.no_grad():
        a = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, **cache_kwargs(cache))
        b = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, **cache_kwargs(offloaded))
    assert torch.equal(a, b)


def test_layer_index_past_the_end_is_an_index_error(tiny_llama):
    cache = SegmentedCache(tiny_llama.config)
    k = torch.zeros(1, 2, 3, 16)
    with pytest.raises(IndexError, match="3 layers"):
        cache.update(k, k, 3)
    with pytest.raises(LayerIndexError):  # also a ValueError, as before
        cache.update(k, k, 7)
    assert isinstance(LayerIndexError("x"), ValueError)


def test_tokens_at_other_positions_than_their_slots_are_refused(tiny_llama):
    cache = SegmentedCache(tiny_llama.config)
    prefill_dense(cache, tiny_llama, torch.randint(3, 1000, (1, 6)), [Segment("a", "PF", 0, 6)])
    with pytest.raises(PositionMismatchError, match="positions 0..3 would fill slots 6..9"):
        with torch.no_grad():
            tiny_llama(
                input_ids=torch.randint(3, 1000, (1, 4)),
                position_ids=torch.arange(4)[None],
                **cache_kwargs(cache),
            )
    assert cache.get_seq_length() == 6  # refused before anything was written
    prefill_dense(cache, tiny_llama, torch.randint(3, 1000, (1, 3)))  # at its slots: fine
    assert cache.table()[-1] == Segment("appended", "PF", 6, 9)


def test_appended_rows_follow_generate_and_crop(tiny_llama):
    cache = SharedCache(tiny_llama.config)
    prefill_dense(cache, tiny_llama, torch.randint(3, 1000, (1, 6)), [Segment("a", "PF", 0, 6)])
    cache.seal(8)
    ids = torch.randint(3, 1000, (1, 8))
    with torch.no_grad():
        tiny_llama.generate(input_ids=ids, max_new_tokens=5, do_sample=False, **cache_kwargs(cache))
    assert [(s.name, s.start, s.end) for s in cache.table()] == [
        ("a", 0, 6),
        ("prompt_tail", 6, 8),
        ("generated", 8, 12),
    ]
    assert cache.segments == [Segment("a", "PF", 0, 6)]  # the built table is untouched
    cache.crop(-4)  # e.g. an assistant's rejected draft
    assert [s.name for s in cache.table()] == ["a", "prompt_tail"]
    assert "generated" not in cache.report() and "prompt_tail [6,8)" in cache.report()


def test_pytree_round_trip_and_torch_export(tiny_llama):
    import torch.utils._pytree as pytree

    from hf_kvshare.anchors.cache import CorrectedCache
    from hf_kvshare.export import register_export_support

    register_export_support()
    register_export_support()  # twice is fine
    ids = torch.randint(3, 1000, (1, 6))
    cache = CorrectedCache(tiny_llama.config, method="kvcmas")
    prefill_dense(cache, tiny_llama, ids[:, :5], [Segment("q", "PH", 0, 5, "corrected", "planner")])
    cache.seal(6)
    leaves, spec = pytree.tree_flatten(cache)
    assert len(leaves) == 6  # keys and values of 3 layers, as for a DynamicCache
    back = pytree.tree_unflatten(leaves, spec)
    assert type(back) is CorrectedCache and back.method == "kvcmas" and back.prompt_length == 6
    assert [(s.name, s.provenance, s.source_agent) for s in back.segments] == [("q", "corrected", "planner")]
    with torch.no_grad():
        program = torch.export.export(
            tiny_llama,
            (),
            {"input_ids": ids[:, 5:], **cache_kwargs(cache.copy()), "use_cache": True},
            strict=False,
        )
        got = program.module()(input_ids=ids[:, 5:], **cache_kwargs(cache.copy()), use_cache=True)
        want = tiny_llama(input_ids=ids[:, 5:], **cache_kwargs(cache.copy()), use_cache=True)
    assert torch.allclose(got.logits, want.logits, atol=1e-6)
    got_cache = output_cache(got)
    assert type(got_cache) is CorrectedCache and got_cache.get_seq_length() == 6


def test_an_empty_layer_adopts_the_tensors_it_is_given_and_a_full_one_refuses():
    from transformers.cache_utils import DynamicLayer

    from hf_kvshare._compat import adopt_layer_states

    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer = DynamicLayer()
    assert adopt_layer_states(layer, keys, values)
    assert layer.keys is keys and layer.values is values and layer.get_seq_length() == 5
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))  # appends as it would have
    assert layer.get_seq_length() == 6 and torch.equal(layer.keys[..., :5, :], keys)
    assert not adopt_layer_states(layer, keys, values)  # initialized: update it instead

    class Other(DynamicLayer):  # a sliding, quantized or offloaded layer keeps its own update
        pass

    assert not adopt_layer_states(Other(), keys, values)


def _corrected(tiny, source, start, rows, nan_layer=None):
    """A CorrectedKV of ``source`` at ``start`` with seeded random deltas (layer 0 uncorrected), and the
    layers its delta was asked for."""
    from hf_kvshare.anchors.corrected import CorrectedKV

    heads, dim = source.keys[0].shape[1], source.keys[0].shape[3]
    g = torch.Generator().manual_seed(7)
    deltas = [None] + [
        (torch.randn(1, heads, rows, dim, generator=g), torch.randn(1, heads, rows, dim, generator=g))
        for _ in range(1, source.num_layers)
    ]
    if nan_layer is not None:
        deltas[nan_layer][1][0, 0, 1, 0] = float("nan")
    asked = []

    def delta(layer):
        asked.append(layer)
        return deltas[layer]

    shifter = RopeShifter.from_model(tiny)
    return CorrectedKV(source=source, start=start, rows=rows, delta=delta, shifter=shifter), asked


@pytest.mark.parametrize("batch", [1, 2])
def test_a_corrected_part_is_computed_in_its_slots_as_reading_it_computes_it(tiny, batch):
    """A CorrectedKV laid out by append_placed / reserve is written layer by layer into the cache's
    slots (its delta asked once per layer, the corrected segment never held whole): the same K/V bit
    for bit as its materialized keys / values placed as plain K/V."""
    from hf_kvshare.cache import CachePart, check_finite

    layers = tiny.config.num_hidden_layers
    shifter = RopeShifter.from_model(tiny)
    src = dense(tiny, torch.randint(3, 1000, (14,)), start=3)
    table = [
        Segment("sys", "PF", 0, 4, "reused"),
        Segment("doc", "PH", 4, 10, "corrected", "a"),
        Segment("q", "PF", 10, 13, "reused"),
    ]
    source = src.extract(7, 13, agent="a")  # lands at 4: re-positioned as it is written

    def parts(doc_kv, dense_q=False):
        q = (
            CachePart(table[2], token_ids=torch.randint(3, 1000, (batch, 3)))
            if dense_q
            else CachePart(table[2], kv=src.extract(12, 15))
        )
        return [CachePart(table[0], kv=src.extract(3, 7)), CachePart(table[1], kv=doc_kv), q]

    lazy, asked = _corrected(tiny, source, 4, 4)
    check_finite([("doc", lazy)])  # checks the source; computes nothing
    assert asked == [] and not lazy.materialized and lazy.length == 6 and lazy.num_layers == layers
    plain, _ = _corrected(tiny, source, 4, 4)
    plain = plain.materialize()
    assert type(plain).__name__ == "SegmentKV" and plain.start == 4
    if batch == 1:
        one, other = SegmentedCache(tiny.config), SegmentedCache(tiny.config)
        one.append_placed(parts(lazy), shifter)
        other.append_placed(parts(plain), shifter)
    else:  # reserve: dense rows of batch 2, the corrected part broadcast to both
        one, other = SegmentedCache(tiny.config), SegmentedCache(tiny.config)
        dense_parts = parts(lazy, dense_q=True)
        one.reserve(dense_parts, torch.arange(10, 13), shifter)
        other.reserve([*parts(plain, dense_q=True)[:2], dense_parts[2]], torch.arange(10, 13), shifter)
    assert asked == list(range(layers)) and not lazy.materialized  # written in place, once a layer
    for layer in range(layers):
        for x, y in zip(one.layer_kv(layer), other.layer_kv(layer)):
            assert x.shape[0] == batch and torch.equal(x, y)
    # a lone corrected part is laid out in place too
    alone, asked_alone = _corrected(tiny, source, 4, 4)
    single = dense(tiny, torch.randint(3, 1000, (4,)))
    single.append_placed([CachePart(table[1], kv=alone)], shifter)
    assert not alone.materialized and asked_alone == list(range(layers))
    assert torch.equal(single.layer_kv(2)[1][..., 4:, :], other.layer_kv(2)[1][:1, :, 4:10])
    # reading it, or replacing a field, gives the same values as plain K/V
    assert all(torch.equal(a, b) for a, b in zip(lazy.values, plain.values)) and lazy.materialized
    fresh, _ = _corrected(tiny, source, 4, 4)
    moved = replace(fresh, start=9)
    assert moved.start == 9 and torch.equal(moved.keys[-1], plain.keys[-1]) and moved.source is None


@pytest.mark.parametrize("how", ["append_placed", "reserve", "read"])
def test_a_non_finite_correction_stores_nothing(tiny, how):
    """A correction whose delta holds NaN in layer 2: laid out, the cache is left as it was (every
    layer, the table) with a ValueError naming the segment and the layer; read, it raises too."""
    from hf_kvshare.cache import CachePart

    layers = tiny.config.num_hidden_layers
    shifter = RopeShifter.from_model(tiny)
    src = dense(tiny, torch.randint(3, 1000, (10,)), start=3)
    kv, _ = _corrected(tiny, src.extract(6, 12, agent="a"), 4, 4, nan_layer=2)
    if how == "read":
        # on a later pipeline stage (its layer 0 the model's 3) the model's layer is named
        with pytest.raises(ValueError, match="non-finite K/V .* layer 5 \\(values\\)"):
            kv.materialize(first_layer=3)
        assert not kv.materialized
        with pytest.raises(ValueError, match="non-finite K/V .* layer 2 \\(values\\)"):
            kv.values  # noqa: B018
        return
    cache = dense(tiny, torch.randint(3, 1000, (4,)))
    before = [tuple(t.clone() for t in cache.layer_kv(i)) for i in range(layers)]
    table = list(cache.segments)
    doc = CachePart(Segment("doc", "PH", 4, 10, "corrected", "a"), kv=kv)
    with pytest.raises(ValueError, match="'doc' \\(corrected\\): non-finite K/V .* layer 2 \\(values\\)"):
        if how == "append_placed":
            cache.append_placed([doc, CachePart(Segment("q", "PF", 10, 12), kv=src.extract(3, 5))], shifter)
        else:
            q = CachePart(Segment("q", "PF", 10, 12), token_ids=torch.zeros(1, 2, dtype=torch.long))
            cache.reserve([doc, q], torch.arange(10, 12), shifter)
    assert cache.get_seq_length() == 4 and cache.segments == table
    for layer in range(layers):
        assert all(torch.equal(x, y) for x, y in zip(cache.layer_kv(layer), before[layer]))

"""Memory of a turn (issue 25): what the session and the methods copy, hold and free.

Measured with :class:`~hf_kvshare.measure.TensorPeak` (torch tensor bytes alive at once), on a tiny
random Llama with enough K/V per token that the cache, not the logits, dominates a turn."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch
from tiny import tiny_model

from hf_kvshare import PF, PH, Session
from hf_kvshare.cache import Segment, SegmentedCache, SegmentKV, compact, storage_bytes
from hf_kvshare.measure import TensorPeak
from hf_kvshare.methods.kvcmas import KVCMAS
from hf_kvshare.prefill import prefill_dense
from hf_kvshare.rope import RopeShifter

AGENTS = ("planner", "critic")


@pytest.fixture(scope="module")
def wide():
    """8 layers x 4 kv heads x 32: 4 KiB of K/V per token (the cache outweighs a turn's activations)."""
    return tiny_model(
        "llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=8,
        max_position_embeddings=2048,
    )


@pytest.fixture(scope="module")
def context(tokenizer):
    text = " ".join(f"Note {i}: the council reviewed the bridge before winter." for i in range(60))
    assert len(tokenizer(text).input_ids) > 600
    return text


def segments(agent: str, context: str, earlier: list[str]) -> list:
    out = [PF(f"You are the {agent}.\n"), PH("context", context)]
    for name in earlier:
        out += [PF(f"\n{name} wrote: "), PH(name)]
    return out + [PF("\nContinue:")]


def run_agents(session, context, **kwargs):
    results, held = [], []
    for i, agent in enumerate(AGENTS):
        held.append(session.held_bytes() + session.method.state_bytes())
        results.append(
            session.run_turn(agent, segments(agent, context, list(AGENTS[:i])), max_new_tokens=4, **kwargs)
        )
    return results, held


def test_recorded_slot_kv_are_views_of_the_turn_cache(wide, tokenizer, context):
    """The session's record keeps each slot's K/V as a view of the turn's cache (before: a copy of every
    segment beside the cache), with the same values."""
    session = Session(wide, tokenizer, "fullshared")
    (_, second), _ = run_agents(session, context, keep_cache=True)
    cache = second.cache
    for name in ("context", AGENTS[0]):
        kv = session.slots[name].latest
        row = cache.segment(name)
        for layer in range(cache.num_layers):
            keys, values = cache.layer_kv(layer)
            shared = kv.keys[layer].untyped_storage().data_ptr() == keys.untyped_storage().data_ptr()
            assert shared, f"layer {layer}: the slot's keys are a copy, not a view of the cache"
            assert torch.equal(kv.keys[layer], keys[..., row.start : row.end, :])
            assert torch.equal(kv.values[layer], values[..., row.start : row.end, :])
    # what the session holds is counted whole, each storage once (the views keep the layers alive)
    assert session.held_bytes() == storage_bytes(
        t for layer in range(cache.num_layers) for t in cache.layer_kv(layer)
    )


def test_a_reuse_turn_holds_one_copy_of_its_segments(wide, tokenizer, context):
    """FullShared's reuse turn: above what the session held when it started, the turn's tensors peak at
    its own cache plus a layer's worth (before: a whole rotated copy of the placed keys while the cache
    was assembled, then a copy of every segment when the turn was recorded: more than twice the cache)."""
    session = Session(wide, tokenizer, "fullshared", tensor_memory=True)
    (_, reuse), held = run_agents(session, context, keep_cache=True)
    assert reuse.tokens_reused > 600
    cache_bytes = reuse.cache.nbytes
    above = reuse.tensor_peak_bytes - held[1]
    assert cache_bytes < above < 1.3 * cache_bytes, (above, cache_bytes)


@pytest.mark.parametrize("turn_fallback", ["turn", "span"])
def test_a_corrected_reuse_turn_holds_one_copy_of_its_segments(wide, tokenizer, context, turn_fallback):
    """KVCMAS's corrected reuse turn: each corrected layer is written straight into the turn's cache
    (``anchors.corrected.CorrectedKV``), so above what the session held its tensors peak at the cache plus a
    layer's worth and the gate's work, as FullShared's (before: the corrected segment computed whole
    beside the cache being built, 1.97x / 2.0x the cache here)."""
    method = KVCMAS(tau=1.0, turn_fallback=turn_fallback)
    for _ in range(3):  # the third request's consumer is corrected (the earlier ones gave the anchors)
        session = Session(wide, tokenizer, method, tensor_memory=True)
        (_, reuse), held = run_agents(session, context, keep_cache=True)
    assert reuse.cache.segment("context").provenance == "corrected" and reuse.tokens_reused > 600
    cache_bytes = reuse.cache.nbytes
    above = reuse.tensor_peak_bytes - held[1]
    assert cache_bytes < above < 1.3 * cache_bytes, (above, cache_bytes)


def test_append_kv_repositions_one_layer_at_a_time(wide):
    """Appending K/V that sits elsewhere rotates each layer as it is copied in: the peak above the final
    cache is a fraction of the keys (before: every layer's rotated keys at once, then the cache), and
    the K/V equal re-positioning first."""
    ids = torch.arange(5, 605)[None]
    source = SegmentedCache(wide.config)
    prefill_dense(source, wide, ids)
    kv = source.extract(0, 600)
    del source
    shifter = RopeShifter.from_model(wide)
    cache = SegmentedCache(wide.config)
    prefill_dense(cache, wide, ids[:, :7])
    with TensorPeak() as peak:
        cache.append_kv(kv, Segment("context", "PH", 7, 607), shifter)
    added = cache.nbytes
    keys_bytes = sum(k.numel() * k.element_size() for k in kv.keys)
    # a layer's rotation (its keys, in and out of the rotation's few temporaries) beside the cache: about
    # 3.5 of the 8 layers' keys here; before, all 8 rotated layers were alive as the cache was filled
    assert peak.peak_bytes < added + 0.6 * keys_bytes, (peak.peak_bytes, added, keys_bytes)
    expected = kv.repositioned(shifter, 7)
    for layer in range(cache.num_layers):
        keys, values = cache.layer_kv(layer)
        assert torch.equal(keys[..., 7:, :], expected.keys[layer])
        assert torch.equal(values[..., 7:, :], kv.values[layer])


def test_kvcmas_record_copies_no_segment(wide, tokenizer, context):
    """KVCMAS's record of a consumer that stores deltas and bases: its tensors above what was alive and
    what it stores (the factors) peak below a third of the context's K/V (before: the span copied out of the cache, the source's keys
    re-positioned and every layer's difference alive at once: more than twice the segment), and it
    factorizes what it stores (a key and a value matrix per layer per delta and per new base)."""
    from hf_kvshare.anchors.lowrank import FACTORIZATIONS

    method = KVCMAS(tau=1.0)
    session = Session(wide, tokenizer, method)
    peaks, counts = [], []
    original = method.record

    def record(turn, cache):
        before, stored = FACTORIZATIONS.snapshot(), method.state_bytes()
        with TensorPeak() as peak:
            original(turn, cache)
        peaks.append(peak.peak_bytes - (method.state_bytes() - stored))  # above what it stores
        counts.append(FACTORIZATIONS.since(before)["matrices"])

    with mock.patch.object(method, "record", record):
        run_agents(session, context)
    segment = session.slots["context"].latest
    segment_bytes = segment.nbytes
    assert segment.length > 600
    assert peaks[1] < segment_bytes / 3, (peaks, segment_bytes)
    per_kv = 2 * wide.config.num_hidden_layers
    assert counts == [0, (2 + 2) * per_kv]  # critic: deltas of context + planner, a new base for each


def test_a_short_view_does_not_keep_its_cache_alive(wide, tokenizer, context):
    """KVCMAS keeps the producer's output (a view of the producer's turn cache) for the request; once no
    longer held view covers half of that cache, the output is copied out and the cache is freed."""
    method = KVCMAS(tau=1.0)
    session = Session(wide, tokenizer, method)
    first = session.run_turn(AGENTS[0], segments(AGENTS[0], context, []), max_new_tokens=4, keep_cache=True)
    layer = weakref.ref(first.cache.layers[0].keys)
    first.cache = None
    gc.collect()
    assert layer() is not None  # the context's latest and the output are views of it
    session.run_turn(AGENTS[1], segments(AGENTS[1], context, [AGENTS[0]]), max_new_tokens=4)
    gc.collect()
    assert layer() is None  # the context's latest moved on; the planner's output was copied out
    output = method._requests.get(session).produced[AGENTS[0]]
    assert output.keys[0].untyped_storage().nbytes() == output.keys[0].numel() * output.keys[0].element_size()


def test_compact_copies_only_views_that_hold_little():
    base = [torch.randn(1, 2, 100, 4)]
    views = [SegmentKV(keys=[base[0][..., :10, :]], values=[base[0][..., :10, :]], start=0)]
    assert not compact(views, storage_tokens=15)  # 10 of 15 positions: kept as views
    assert views[0].keys[0]._base is base[0]
    assert compact(views, storage_tokens=100)  # 10 of 100: copied, same values
    assert views[0].keys[0]._base is None and torch.equal(views[0].keys[0], base[0][..., :10, :])


def test_cacheblend_recomputes_into_one_copy_of_its_segments(wide, tokenizer, context):
    """CacheBlend's reuse turn: the source stays where it sits (each layer re-positioned when the engine
    reads it) and the blended K/V are assembled layer by layer as the cache copies them in, so above
    what the session held its tensors peak at the cache plus the recomputation's per-layer work (before:
    a whole re-positioned copy of the keys, then a blended copy of every layer, then the cache: 2.0x)."""
    session = Session(wide, tokenizer, "cacheblend", tensor_memory=True)
    (_, reuse), held = run_agents(session, context, keep_cache=True)
    assert reuse.tokens_reused > 600
    cache_bytes = reuse.cache.nbytes
    above = reuse.tensor_peak_bytes - held[1]
    assert cache_bytes < above < 1.6 * cache_bytes, (above, cache_bytes)


@pytest.mark.parametrize("name", ["cacheblend", "droidspeak", "relaycaching"])
def test_selective_recomputation_placed_layer_by_layer_is_unchanged(tiny, tokenizer, name):
    """The selective methods with the source re-positioned per layer and the result assembled per layer
    give the tokens and, in every layer, the cache of re-positioning the whole source first (the way
    before), bit for bit."""
    from kvcmas_workflow import AGENTS as ROLES
    from kvcmas_workflow import QUERIES, turn_segments

    from hf_kvshare.methods import selective
    from hf_kvshare.recompute.layers import SegmentRecompute

    options = {
        "cacheblend": {},
        "droidspeak": {"rho": 0.5, "layer_profile": [0.0, 1.0, 2.0]},  # the tiny models' 3 layers
        "relaycaching": {"band": (0.0, 1.0)},
    }[name]

    class Whole(SegmentRecompute):  # the source re-positioned as a whole before the engine sees it
        def __init__(self, stack, cache, kv, token_ids, embeds=None, start=None, shifter=None):
            super().__init__(stack, cache, kv.repositioned(shifter, start), token_ids, embeds)

    def run():
        session = Session(tiny, tokenizer, name, **options)
        return [
            session.run_turn(agent, turn_segments(i, QUERIES[0]), max_new_tokens=6, keep_cache=True)
            for i, agent in enumerate(ROLES)
        ]

    layered = run()
    with mock.patch.object(selective, "SegmentRecompute", Whole):
        whole = run()
    assert any(t.tokens_recomputed for t in layered)
    for a, b in zip(layered, whole):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        assert a.tokens_recomputed == b.tokens_recomputed
        for layer in range(a.cache.num_layers):
            for x, y in zip(a.cache.layer_kv(layer), b.cache.layer_kv(layer)):
                assert torch.equal(x, y)


def test_cuda_peak_is_the_baseline_plus_the_bodys_own_peak_not_the_process_allocation():
    """``PeakMemory`` on CUDA with a baseline: what the owner holds + the body's peak above what was
    allocated when it started (the allocator's counters stand in for a device here)."""
    from hf_kvshare.measure import PeakMemory

    allocated = {"now": 10_000, "peak": 10_000}  # 10,000 bytes held by other code when the body starts

    def alloc(n):
        allocated["now"] += n
        allocated["peak"] = max(allocated["peak"], allocated["now"])

    with (
        mock.patch("torch.cuda.reset_peak_memory_stats", lambda *_: allocated.update(peak=allocated["now"])),
        mock.patch("torch.cuda.memory_allocated", lambda *_: allocated["now"]),
        mock.patch("torch.cuda.max_memory_allocated", lambda *_: allocated["peak"]),
    ):
        with PeakMemory("cuda", baseline_bytes=300) as own:
            alloc(500)
            alloc(-400)
        with PeakMemory("cuda") as whole:
            alloc(50)
    assert own.peak_bytes == 300 + 500
    assert whole.peak_bytes == 10_000 + 100 + 50  # without a baseline: the device's whole peak


def test_module_bytes_counts_tied_weights_once():
    from hf_kvshare.measure import module_bytes

    emb = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = emb.weight  # tied, as most small LMs' input and output embeddings
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "norm": torch.nn.BatchNorm1d(8)})
    # 100 x 8 floats once, the norm's weight and bias, and its three buffers (two float, one int64)
    assert module_bytes(model, "cpu") == 4 * (800 + 8 + 8 + 8 + 8) + 8
    assert module_bytes(model, "cuda") == 0

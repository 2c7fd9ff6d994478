"""K/V kept in vLLM's worker (hf_kvshare.serving.worker_store): the worker's device store within its
bytes, the scheduler's mirror deciding keep / drop (least recently used, never a pinned entry), a
placement's provenance among the kept read-backs, the worker writing references re-positioned on its
device exactly as the scheduler's placements, and a step's metadata with FullShared and KVCMAS claims
small and tensor-free. No vLLM needed (the connector's messages stand alone without it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import pickle
from types import SimpleNamespace

import pytest
import torch
from serving_stand_ins import Delivered, announce_worker, bytes_per_position, stand_in_worker

from hf_kvshare.rope import RopeShifter
from hf_kvshare.segment_kv import SegmentKV
from hf_kvshare.serving import channel
from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.connector_common import HFKVShareMetadata, Load, Source
from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler
from hf_kvshare.serving.host import Sharing
from hf_kvshare.serving.standin import engine
from hf_kvshare.serving.worker_store import DeviceStore, Origin, Sources, StoreMirror

#: the issue's bound of one step's connector metadata
METADATA_MAX_BYTES = 64 << 10
#: the worker names its layers by vLLM's own layer-index parser
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="the worker side imports vLLM (.ci/run's serving venv)"
)


def kv(layers=2, n=10, heads=2, dim=4, seed=0):
    torch.manual_seed(seed)
    return torch.randn(layers, n, heads, dim), torch.randn(layers, n, heads, dim)


def test_the_device_store_keeps_within_its_bytes_and_never_keeps_a_dropped_request():
    keys, values = kv()  # 2 * 2 * 10 * 2 * 4 * 4 bytes = 1280
    store = DeviceStore(3000)
    assert store.keep("a", keys, values) and store.keep("b", keys, values) and store.bytes == 2560
    assert not store.keep("c", keys, values) and store.refused == 1 and "c" not in store  # over: refused
    store.drop(["a"])
    assert store.bytes == 1280 and store.get("a") is None and store.get("b")[0] is keys
    assert not store.keep("a", keys, values)  # its keep taken after its drop: refused, never held again
    assert store.keep("c", keys, values) and store.bytes == 2560 and len(store) == 2
    with pytest.raises(ValueError, match="device_store_bytes"):
        DeviceStore(-1)


def test_the_mirror_evicts_least_recently_used_by_bytes_and_never_a_pinned_entry():
    mirror = StoreMirror(1000)
    assert mirror.admit("a", 30) == (False, [])  # the worker has not said its bytes per token yet
    mirror.bytes_per_token = 10
    assert mirror.admit("a", 30) == (True, []) and mirror.admit("b", 30) == (True, [])
    assert mirror.admit("c", 30) == (True, []) and mirror.bytes == 900
    assert mirror.pin("x", ["a"])  # a claim in flight references a: it is used again, and pinned
    keep, drops = mirror.admit("d", 30)
    assert keep and drops == ["b"] and mirror.bytes == 900  # b, the least recently used unpinned one
    assert not mirror.pin("y", ["b"])  # gone: a claim cannot reference it (its rows travel instead)
    assert mirror.pin("y", ["c", "d"])
    assert mirror.admit("e", 30) == (False, []) and mirror.refused == 1  # everything pinned: not kept
    assert mirror.admit("f", 200) == (False, [])  # larger than the whole budget
    mirror.unpin("x")
    keep, drops = mirror.admit("e", 30)
    assert keep and drops == ["a"]
    assert mirror.forget("e") and not mirror.forget("e") and "e" not in mirror
    summary = mirror.summary()
    assert summary["device_evicted"] == 2 and summary["device_bytes"] == mirror.bytes == 600
    assert summary["device_bytes"] <= summary["device_max_bytes"]


def _views(keys, values, a, b, start):
    """A slot's K/V as the serving record holds them: views of the read-back's rows ``[a, b)``."""
    n = keys.shape[1]
    return SegmentKV(
        keys=[k[:n].transpose(0, 1)[None][..., a:b, :] for k in keys],
        values=[v[:n].transpose(0, 1)[None][..., a:b, :] for v in values],
        start=start,
    )


def test_a_placement_is_a_reference_only_when_it_shows_rows_of_a_kept_read_back():
    mirror = StoreMirror(1 << 20)
    mirror.bytes_per_token = 1
    sources = Sources(mirror)
    keys, values = kv(n=12)
    assert mirror.admit("r1", 12)[0]
    sources.register("r1", keys, values)
    assert sources.find(_views(keys, values, 3, 9, start=3)) == Origin("r1", 3, 6, 3)
    copy = _views(keys, values, 3, 9, start=3)
    assert sources.find(SegmentKV([k.clone() for k in copy.keys], copy.values, 3)) is None  # a copy
    mixed = SegmentKV(_views(keys, values, 3, 9, 3).keys, _views(keys, values, 4, 10, 4).values, 3)
    assert sources.find(mixed) is None  # keys and values of other rows
    other_keys, other_values = kv(n=12, seed=1)
    assert sources.find(_views(other_keys, other_values, 0, 5, 0)) is None  # not registered
    mirror.forget("r1")
    assert sources.find(_views(keys, values, 3, 9, start=3)) is None  # not kept by the worker any more


def _worker(layers, heads, dim, device_store_bytes=1 << 20):
    return stand_in_worker(layers, heads, dim, extra={"device_store_bytes": device_store_bytes})


@needs_vllm
def test_the_worker_writes_kept_rows_re_positioned_on_its_device_as_the_scheduler_places_them(tiny_llama):
    config = tiny_llama.config
    layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    worker, names = _worker(layers, heads, dim)
    worker._shifter = shifter = RopeShifter.from_model(tiny_llama)
    try:
        keys, values = kv(layers, 40, heads, dim)
        assert worker.store.keep("src", keys, values)
        # rows 10..30 of src (computed at positions 10..30) claimed at positions 3..23 of a new request
        load = Load("new", [4, 2], 3, 20, sources=[Source("src", 10, 20, 0, 10, 3)])
        worker.start_load_kv(HFKVShareMetadata(loads=[load]))
        assert not worker.get_block_ids_with_load_errors()
        placed = _views(keys, values, 10, 30, start=10).repositioned(shifter, 3)  # the scheduler's placement
        for i, name in enumerate(names):
            k, v = worker._io[name].read([4, 2], 3, 23)
            assert torch.equal(k, placed.keys[i][0].transpose(0, 1))  # bit for bit
            assert torch.equal(v, values[i, 10:30])
        # rows the worker does not keep: nothing written from anything else, the claim's blocks failed
        worker.store.drop(["src"])
        worker.start_load_kv(
            HFKVShareMetadata(loads=[Load("b", [5, 6, 7], 20, 20, [Source("src", 0, 20, 0, 0, 20)])])
        )
        assert worker.get_block_ids_with_load_errors() == {6, 7}  # positions 20..39: blocks 1 and 2
        assert not worker.get_block_ids_with_load_errors()  # reported once
    finally:
        worker.shutdown()


@needs_vllm
def test_a_kept_capture_stays_in_the_workers_store_after_the_drops_it_carries():
    from hf_kvshare.serving.connector_common import Capture

    worker, names = _worker(2, 2, 4, device_store_bytes=4096)
    try:
        worker.store.keep("old", *kv(2, 8, 2, 4))
        worker.wait_for_save(HFKVShareMetadata(captures=[Capture("a", [3, 0], 20, keep=True, drop=["old"])]))
        assert (
            "a" in worker.store and "old" not in worker.store and worker.store.bytes == 20 * 2 * 2 * 2 * 4 * 4
        )
        k, v = worker.store.get("a")
        out = worker.build_connector_worker_meta()
        assert torch.equal(out.kv["a"][0], k) and torch.equal(out.kv["a"][1], v)  # the scheduler's record too
        worker.start_load_kv(HFKVShareMetadata(drops=["a"]))
        assert "a" not in worker.store and worker.store.bytes == 0
    finally:
        worker.shutdown()


class _NoTensors(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            raise AssertionError(f"a tensor in the step's metadata: {tuple(obj.shape)}")
        return NotImplemented


def _pickled_size(meta) -> int:
    buffer = io.BytesIO()
    _NoTensors(buffer).dump(meta)
    return len(buffer.getvalue())


def _document_steps(scheduler, sharing, tokenizer):
    """Three tasks of two agents reading one document through the connector's scheduler side: each
    request's ``(id, plan, step metadata)`` once vLLM took its claim and scheduled it (metadata <= 64 KB)."""
    doc = tokenizer(
        "The river Lune reaches the sea at Plover Scar near Glasson. " * 4, add_special_tokens=False
    )["input_ids"]
    for task in range(3):
        for agent, question in (("a1", " Where?"), ("a2", " Why?")):
            rid = f"{task}{agent}"
            prompt = doc + tokenizer(question, add_special_tokens=False)["input_ids"]
            segments = [{"slot": "doc", "start": 0, "end": len(doc)}]
            params = {lay.KEY: {"task": f"t{task}", "agent": agent, "segments": segments}}
            plan = sharing.plan(rid, prompt, params, 0)
            assert plan.error is None
            scheduler._plans[rid] = plan
            scheduler.update_state_after_alloc(SimpleNamespace(request_id=rid), None, plan.claimed)
            scheduled = SimpleNamespace(req_id=rid, block_ids=(list(range(8)),))
            meta = scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[scheduled]))
            assert _pickled_size(meta) <= METADATA_MAX_BYTES
            yield rid, plan, meta


@pytest.mark.parametrize("method", ["fullshared", "kvcmas"])
def test_a_steps_metadata_with_fullshared_and_kvcmas_claims_is_small_and_holds_no_tensor(
    tiny_llama, tokenizer, method
):
    """Agents of several tasks reading a document through the connector's scheduler side: each claim's
    metadata is references and ranges (FullShared: references only), <= 64 KB pickled, no tensor; what
    is not a reference went on the order channel under the request id."""
    options = {"tau": 0.9} if method == "kvcmas" else {}
    sharing = Sharing(tiny_llama, tokenizer, method, min_segment_tokens=4, **options)
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"background": False}),
        cache_config=SimpleNamespace(block_size=16),
    )
    scheduler = HFKVShareScheduler(config, sharing)
    delivered = Delivered()
    payloads = delivered.kv
    worker_orders = announce_worker(scheduler, bytes_per_position(tiny_llama.config), deliver=delivered)
    claimed = sources = 0
    try:
        for rid, plan, meta in _document_steps(scheduler, sharing, tokenizer):
            if plan.claimed:
                (load,) = meta.loads
                claimed += 1
                sources += len(load.sources)
                covered = sorted([(s.offset, s.offset + s.n) for s in load.sources] + list(load.payload))
                assert covered[0][0] == 0 and covered[-1][1] == plan.claimed  # the whole claim, once
                assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
                if method == "fullshared":
                    assert not load.payload  # every placement is rows the worker keeps
                if load.payload:  # the rest came on the order channel, exactly the plan's rows
                    assert delivered.wait(rid)
                    index = torch.cat([torch.arange(lo, hi) for lo, hi in load.payload])
                    assert torch.equal(payloads[rid][0], plan.keys.index_select(1, index))
            # the request ends: the worker keeps its K/V (the mirror decides), the record sees them
            out, keys, values = engine(tiny_llama, plan, max_new_tokens=2)
            scheduler.device_store.unpin(rid)
            assert scheduler.device_store.admit(rid, keys.shape[1])[0]
            sharing.sources.register(rid, keys, values)
            sharing.record(plan, keys, values, out, set())
        if method == "fullshared":  # every later agent's document: a reference to the first one's rows
            assert claimed == sources == 3 and not payloads
        else:  # KVCMAS's corrected documents: on the order channel
            assert claimed >= 2 and len(payloads) >= 2
        assert scheduler.metadata_bytes["max"] <= METADATA_MAX_BYTES
        device = sharing.state_summary()["device_store"]  # the store's summary counts what the worker keeps
        assert device["device_kept"] == 6 and device["device_evicted"] == 0 and device["device_bytes"] > 0
    finally:
        scheduler.shutdown()
        worker_orders.close()


def test_the_device_store_bound_is_an_option_of_the_server(tmp_path):
    """``hf-kvshare serve --device-store-bytes`` / ``Server(device_store_bytes=...)``: the connector's
    ``device_store_bytes``, checked before vLLM starts; a claim the worker cannot write is recomputed."""
    from hf_kvshare.serving.server import Server, kv_transfer_config

    config = kv_transfer_config("fullshared", {}, 1 << 20, 8, device_store_bytes=4096)
    assert config["kv_connector_extra_config"]["device_store_bytes"] == 4096
    assert config["kv_load_failure_policy"] == "recompute"
    assert (
        "device_store_bytes"
        not in kv_transfer_config("fullshared", {}, 1 << 20, 8)["kv_connector_extra_config"]
    )
    assert Server(tmp_path, "fullshared", port=1, device_store_bytes=0).device_store_bytes == 0
    with pytest.raises(ValueError, match="device_store_bytes"):
        Server(tmp_path, "fullshared", port=1, device_store_bytes=-1)


def _fullshared_scheduler(sharing, layers, heads, dim, device_store_bytes=1 << 30):
    """The connector's scheduler side over ``sharing``, its worker's bytes per token announced."""
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"background": False, "device_store_bytes": device_store_bytes}
        ),
        cache_config=SimpleNamespace(block_size=16),
    )
    scheduler = HFKVShareScheduler(config, sharing)
    scheduler.device_store.bytes_per_token = layers * 2 * heads * dim * 4
    return scheduler


def _document_turns(tokenizer, tasks=2):
    doc = tokenizer(
        "The river Lune reaches the sea at Plover Scar near Glasson. " * 4, add_special_tokens=False
    )["input_ids"]
    for task in range(tasks):
        for agent, question in (("a1", " Where?"), ("a2", " Why?")):
            prompt = tokenizer("You are " + agent + ".", add_special_tokens=False)["input_ids"] + doc
            prompt += tokenizer(question, add_special_tokens=False)["input_ids"]
            start = len(prompt) - len(doc) - len(tokenizer(question, add_special_tokens=False)["input_ids"])
            params = {
                lay.KEY: {
                    "task": f"t{task}",
                    "agent": agent,
                    "segments": [{"slot": "doc", "start": start, "end": start + len(doc)}],
                }
            }
            yield f"{task}{agent}", prompt, params


def test_fullshared_records_stand_ins_the_scheduler_holds_no_kv_and_every_claim_is_a_reference(
    tiny_llama, tokenizer
):
    """A value-free method (FullShared, prefix reuse on) recorded from stand-ins of what the worker
    keeps (no read-back shipped): the scheduler's stores hold 0 bytes of K/V, every later claim (the
    document and the agent's own kept text) is rows the worker keeps, nothing is sent, and a record
    whose rows the worker evicted is computed, its cause ``evicted``."""
    from hf_kvshare.reasons import cause_of_reason
    from hf_kvshare.segment_kv import is_stand_in
    from hf_kvshare.serving.host import DEVICE_EVICTED, VALUE_FREE
    from hf_kvshare.serving.worker_store import stand_ins

    assert VALUE_FREE == ("nonshared", "fullshared")
    c = tiny_llama.config
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", min_segment_tokens=4, prefix_reuse=True)
    assert sharing.value_free
    scheduler = _fullshared_scheduler(sharing, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
    referenced = 0
    try:
        for rid, prompt, params in [*_document_turns(tokenizer), *_document_turns(tokenizer)]:
            plan = sharing.plan(rid, prompt, params, 0)
            assert plan.error is None
            scheduler._plans[rid] = plan
            scheduler._pin(plan)
            if plan.claimed:
                load = scheduler._load(plan)
                assert not load.payload and plan.keys == [] and plan.values == []  # nothing sent
                referenced += sum(s.n for s in load.sources)
            out, keys, values = engine(tiny_llama, SimpleNamespace(**{**vars(plan), "claim_end": 0}), 2)
            scheduler.device_store.unpin(rid)
            assert scheduler.device_store.admit(rid, keys.shape[1])[0]
            k, v = stand_ins(keys, values)  # what the worker sends back: shapes, no bytes
            sharing.sources.register(rid, k, v)
            sharing.record(plan, k, v, out, set())
            assert plan.error is None
        stores = sharing.state_summary()["stores"]
        assert stores["slots"]["bytes"] == 0 and stores["prefixes"]["bytes"] == 0
        assert stores["read_backs"]["bytes"] == 0
        assert referenced > 0 and scheduler.load_tokens == {"referenced": referenced, "sent": 0}
        host = sharing.hosts["t0"]
        assert is_stand_in(host.slots["doc"].latest) and host.held_bytes() == 0
        kept = sharing.method._agent_prefixes()
        assert kept and all(is_stand_in(kv) and kv.nbytes == 0 for kv in kept.values())
        # the worker evicted every kept request: the stand-ins stand for nothing, the spans are computed
        for rid in list(scheduler.device_store._held):
            scheduler.device_store.forget(rid)
            sharing.sources.forget(rid)
        rid, prompt, params = next(_document_turns(tokenizer))
        plan = sharing.plan("again", prompt, params, 0)
        assert plan.error is None and plan.claimed == 0
        assert plan.unplaced["doc"] == DEVICE_EVICTED and cause_of_reason(DEVICE_EVICTED) == "evicted"
    finally:
        scheduler.shutdown()


def test_a_stand_in_read_back_crosses_the_channel_as_its_shape_only():
    keys, values = kv(layers=3, n=7, heads=2, dim=4)
    from hf_kvshare.serving.worker_store import stand_ins

    k, v = stand_ins(keys.to(torch.bfloat16), values.to(torch.bfloat16))
    frames = channel.encode("r", k, v, "at finish", rank=1)
    assert [len(bytes(f)) for f in frames[1:]] == [0, 0]  # no K/V bytes
    rid, k2, v2, via, rank = channel.decode(frames)
    assert (rid, via, rank) == ("r", "at finish", 1)
    assert k2.is_meta and v2.is_meta and k2.shape == keys.shape and k2.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="stand-ins"):
        channel.encode("r", k, values.to(torch.bfloat16))


@needs_vllm
def test_a_capture_not_shipped_is_kept_in_the_worker_and_only_its_stand_ins_go_back():
    """A value-free method's capture (``ship=False``): the worker keeps the K/V and returns stand-ins
    (shapes and dtypes, no bytes); K/V it could not keep, or holding NaN, go back whole (the scheduler's
    record then works, or refuses them, as before)."""
    from hf_kvshare.serving.connector_common import Capture

    worker, names = _worker(2, 2, 4, device_store_bytes=20 * 2 * 2 * 2 * 4 * 4)
    try:
        worker.wait_for_save(HFKVShareMetadata(captures=[Capture("a", [3, 0], 20, keep=True, ship=False)]))
        k, v = worker.build_connector_worker_meta().kv["a"]
        assert k.is_meta and v.is_meta and k.shape == worker.store.get("a")[0].shape == (2, 20, 2, 4)
        # not kept (the store is full): the K/V themselves
        worker.wait_for_save(HFKVShareMetadata(captures=[Capture("b", [1], 10, keep=True, ship=False)]))
        k, v = worker.build_connector_worker_meta().kv["b"]
        assert not k.is_meta and "b" not in worker.store and k.shape == (2, 10, 2, 4)
        # a NaN in the cache: the K/V themselves, so the record refuses them as it did
        worker._io[names[0]].kv_cache[5].fill_(float("nan"))
        worker.start_load_kv(HFKVShareMetadata(drops=["a"]))
        worker.wait_for_save(HFKVShareMetadata(captures=[Capture("c", [5], 4, keep=False, ship=False)]))
        k, _ = worker.build_connector_worker_meta().kv["c"]
        assert not k.is_meta and torch.isnan(k).any()
    finally:
        worker.shutdown()


def test_a_kept_prefix_at_another_position_is_a_reference_the_worker_moves(tiny_llama, tokenizer):
    """FullShared places its kept text where it was computed (``PREFIX_PLACED_UNMOVED``): from stand-ins,
    an agent's own text after a longer document is a reference to its earlier rows, moved by the worker
    (source and destination positions differ), nothing sent."""
    from hf_kvshare.serving.worker_store import stand_ins

    c = tiny_llama.config
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", min_segment_tokens=4, prefix_reuse=True)
    scheduler = _fullshared_scheduler(sharing, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    sys_ids, q = ids("You are a careful planner."), ids(" Where does it go? Tell me now.")
    short, long = (
        ids("The river Lune reaches the sea."),
        ids("Alpha beta gamma delta epsilon zeta eta theta."),
    )
    turns = [("w", "w", long, "long"), ("a1", "a", short, "short"), ("a2", "a", long, "long")]
    try:
        for rid, agent, doc, slot in turns:
            prompt = sys_ids + doc + q
            segment = {"slot": slot, "start": len(sys_ids), "end": len(sys_ids) + len(doc)}
            params = {lay.KEY: {"task": "t", "agent": agent, "segments": [segment]}}
            plan = sharing.plan(rid, prompt, params, 0)
            assert plan.error is None
            scheduler._pin(plan)
            load = scheduler._load(plan) if plan.claimed else None
            out, keys, values = engine(tiny_llama, SimpleNamespace(**{**vars(plan), "claim_end": 0}), 2)
            scheduler.device_store.unpin(rid)
            assert scheduler.device_store.admit(rid, keys.shape[1])[0]
            k, v = stand_ins(keys, values)
            sharing.sources.register(rid, k, v)
            sharing.record(plan, k, v, out, set())
        assert plan.claimed == len(prompt) - 1 and not load.payload, plan.report()
        tail = [s for s in load.sources if s.request_id == "a1" and s.dst_start > len(sys_ids)]
        moved = len(long) - len(short)
        assert tail and all(s.dst_start - s.src_start == moved for s in tail), load.sources
    finally:
        scheduler.shutdown()


@needs_vllm
@pytest.mark.parametrize("method, keep, ship", [("fullshared", True, False), ("kvcmas", True, True)])
def test_a_finished_request_is_read_back_to_the_scheduler_only_for_a_method_reading_values(
    tiny_llama, tokenizer, method, keep, ship
):
    """The capture of a finished request: kept by the worker; shipped back (its K/V held against the
    read-back budget) only for a method that reads K/V values on the scheduler (KVCMAS), not FullShared."""
    from vllm.v1.request import RequestStatus

    c = tiny_llama.config
    sharing = Sharing(tiny_llama, tokenizer, method, min_segment_tokens=4)
    scheduler = _fullshared_scheduler(sharing, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
    scheduler._read_back_token_bytes = scheduler.device_store.bytes_per_token
    try:
        rid, prompt, params = next(_document_turns(tokenizer))
        scheduler._plans[rid] = sharing.plan(rid, prompt, params, 0)
        request = SimpleNamespace(
            request_id=rid,
            status=RequestStatus.FINISHED_STOPPED,
            num_computed_tokens=len(prompt) + 1,
            prompt_token_ids=prompt,
            output_token_ids=[5, 6],
            sampling_params=None,
        )
        assert scheduler.request_finished(request, [0, 1, 2, 3, 4])[0]
        (capture,) = scheduler._to_capture
        assert (capture.keep, capture.ship) == (keep, ship)
        assert (sharing.read_backs.held > 0) == ship  # a stand-in's read-back holds no bytes here
    finally:
        scheduler.shutdown()


# ------------------------------------------------------------------ corrections computed in the worker
def _corrected_claim(tiny_llama, how, rank=2):
    """A kept read-back ``src`` (40 rows, computed at positions 0 ..), registered with the scheduler's
    :class:`Sources`, and KVCMAS's correction of its rows 10..30 placed at position 3 (``how``:
    ``apply_correction`` / ``apply_piecewise``; ``rank=None``: dense deltas), 15 rows corrected."""
    from hf_kvshare.anchors import apply_correction, apply_piecewise
    from hf_kvshare.anchors.lowrank import FactoredKV
    from hf_kvshare.anchors.pool import Anchor

    config = tiny_llama.config
    layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    shifter = RopeShifter.from_model(tiny_llama)
    mirror = StoreMirror(1 << 30)
    mirror.bytes_per_token = 1
    sources = Sources(mirror)
    keys, values = kv(layers, 40, heads, dim, seed=3)
    assert mirror.admit("src", 40)[0]
    sources.register("src", keys, values)
    g = torch.Generator().manual_seed(4)

    def rand(n):
        return [torch.randn(1, heads, n, dim, generator=g) for _ in range(layers)]

    anchors = []
    for i, length in enumerate((24, 30)):
        anchor = Anchor(base=FactoredKV.from_kv(rand(length), rand(length), rank), source="a", origin=i)
        anchor.deltas["b"] = FactoredKV.from_kv(rand(length), rand(length), rank)
        anchors.append(anchor)
    weights = torch.softmax(torch.randn(2, 15, generator=g), dim=0)
    source = _views(keys, values, 10, 30, start=10)
    correct = apply_correction if how == "correction" else apply_piecewise
    corrected = correct(source, anchors, "b", weights, weights.flip(0), 3, shifter, skip_layer0=True)
    return corrected, sources, shifter, keys, values


@pytest.mark.parametrize("how", ["correction", "piecewise"])
def test_a_corrected_span_of_kept_rows_travels_as_factors_and_the_worker_computes_the_hosts_rows(
    tiny_llama, how
):
    from hf_kvshare.serving.connector_scheduler import _correction
    from hf_kvshare.serving.worker_store import CorrectedOrigin, add_delta, corrected_origin

    corrected, sources, shifter, keys, values = _corrected_claim(tiny_llama, how)
    origin = corrected_origin(corrected, sources.find)
    assert isinstance(origin, CorrectedOrigin) and (origin.request_id, origin.row, origin.n) == (
        "src",
        10,
        20,
    )
    assert origin.rows == 15 and origin.factors[0] is None  # layer 0 keeps the re-positioned source
    host_keys, host_values = corrected.keys, corrected.values  # the host's rows (as sent before)
    for skip, n in ((0, 20), (2, 16)):  # the whole span, and a claim starting inside it
        factors = []
        correction = _correction(origin, skip, n, factors)
        assert correction.rows == 15 - skip and correction.delta_from == skip
        sent = sum(t.numel() * t.element_size() for t in factors)
        rows_bytes = 2 * keys[:, :n].numel() * keys.element_size()
        assert 0 < sent < rows_bytes / 2  # the factors, not the rows
        _, kind, factors = channel.decode_tensors(channel.encode_tensors("new", "factors", factors))
        dst = 3 + skip
        rotation = shifter.rotation(origin.start + skip, dst, n)
        delta_rotation = shifter.rotation(correction.delta_from, dst, correction.rows)
        for layer in range(len(keys)):
            key = shifter.apply(
                keys[layer, 10 + skip : 10 + skip + n].transpose(0, 1)[None], rotation, layer=layer
            )
            key, value = key[0].transpose(0, 1), values[layer, 10 + skip : 10 + skip + n]
            a_k, b_k, a_v, b_v = factors[4 * layer : 4 * layer + 4]
            if a_k.numel():
                key, value = add_delta(key, value, ((a_k, b_k), (a_v, b_v)), delta_rotation, shifter, layer)
            want_k = host_keys[layer][0, :, skip : skip + n].transpose(0, 1)
            want_v = host_values[layer][0, :, skip : skip + n].transpose(0, 1)
            torch.testing.assert_close(key, want_k, rtol=1e-5, atol=1e-5)  # up to float rounding
            torch.testing.assert_close(value, want_v, rtol=1e-5, atol=1e-5)
            assert torch.equal(value[correction.rows :], want_v[correction.rows :])  # past the delta: as kept


def test_a_corrected_span_with_a_dense_or_larger_delta_or_of_rows_not_kept_is_sent_whole(tiny_llama):
    from hf_kvshare.serving.worker_store import corrected_origin

    corrected, sources, *_ = _corrected_claim(tiny_llama, "correction", rank=None)
    assert corrected.low_rank is None and corrected_origin(corrected, sources.find) is None  # dense: rows
    corrected, sources, *_ = _corrected_claim(tiny_llama, "correction", rank=12)
    assert corrected.low_rank is not None  # low rank, but its factors outweigh the span's 20 rows: rows
    assert corrected_origin(corrected, sources.find) is None
    corrected, sources, *_ = _corrected_claim(tiny_llama, "correction")
    nan = ((torch.full((15, 2), float("nan")), torch.ones(2, 8)),) * 2
    good = corrected.low_rank
    corrected.low_rank = dataclasses.replace(good, factors=lambda layer: nan)
    assert corrected_origin(corrected, sources.find) is None  # non-finite: the host refuses it as before
    corrected.low_rank = good
    assert corrected_origin(corrected, sources.find) is not None
    sources.forget("src")
    assert corrected_origin(corrected, sources.find) is None  # not kept: the host's rows are sent


@needs_vllm
def test_the_worker_adds_a_corrected_claims_delta_to_its_kept_rows_as_the_host_computes_them(
    tiny_llama, monkeypatch
):
    from hf_kvshare.serving import connector_worker
    from hf_kvshare.serving.connector_scheduler import _correction
    from hf_kvshare.serving.worker_store import corrected_origin

    corrected, sources, shifter, keys, values = _corrected_claim(tiny_llama, "correction")
    origin = corrected_origin(corrected, sources.find)
    layers, _, heads, dim = keys.shape
    worker, names = _worker(layers, heads, dim)
    worker._shifter = shifter
    try:
        assert worker.store.keep("src", keys, values)
        factors = []
        source = Source("src", 10, 20, 0, 10, 3, _correction(origin, 0, 20, factors))
        worker._on_tensors(*channel.decode_tensors(channel.encode_tensors("new", "factors", factors)))
        worker.start_load_kv(HFKVShareMetadata(loads=[Load("new", [4, 2], 3, 20, sources=[source])]))
        assert not worker.get_block_ids_with_load_errors()
        for i, name in enumerate(names):
            k, v = worker._io[name].read([4, 2], 3, 23)
            torch.testing.assert_close(k, corrected.keys[i][0].transpose(0, 1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, corrected.values[i][0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        assert torch.equal(worker.store.get("src")[0], keys)  # the kept rows are not changed
        # its factors never came: nothing written, the claim's blocks failed
        monkeypatch.setattr(connector_worker, "PAYLOAD_WAIT_S", 0.1)
        worker.start_load_kv(HFKVShareMetadata(loads=[Load("late", [5, 6], 3, 20, sources=[source])]))
        assert worker.get_block_ids_with_load_errors() == {5, 6}
    finally:
        worker.shutdown()


@needs_vllm
def test_kvcmas_claims_of_kept_rows_send_factors_and_the_worker_writes_the_schedulers_corrected_rows(
    tiny_llama, tokenizer
):
    """Agents of several tasks reading a document through both connector sides (KVCMAS with low-rank
    deltas): a corrected document of rows the worker keeps is a reference plus its factors on the order
    channel, and the worker writes what the scheduler's placement computes, up to float rounding."""
    sharing = Sharing(tiny_llama, tokenizer, "kvcmas", min_segment_tokens=4, tau=0.9, delta_rank=4)
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"background": False}),
        cache_config=SimpleNamespace(block_size=16),
    )
    scheduler = HFKVShareScheduler(config, sharing)
    c = tiny_llama.config
    worker, names = _worker(
        c.num_hidden_layers, c.num_key_value_heads, c.head_dim, device_store_bytes=1 << 30
    )
    worker._shifter = RopeShifter.from_model(tiny_llama)
    worker._listen()
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    announce_worker(scheduler, per_token, address=worker._orders.address)
    corrected = 0
    try:
        for rid, plan, meta in _document_steps(scheduler, sharing, tokenizer):
            if plan.claimed:
                worker.start_load_kv(meta)
                assert not worker.get_block_ids_with_load_errors()
                (load,) = meta.loads
                for source in load.sources:
                    corrected += source.correction is not None
                    lo = source.dst_start
                    (kv,) = [p.kv for s, p in zip(plan.turn.spans, plan.placements) if s.start <= lo < s.end]
                    for i, name in enumerate(names):
                        k, v = worker._io[name].read(load.block_ids, lo, lo + source.n)
                        want_k = kv.keys[i][0, :, lo - kv.start : lo - kv.start + source.n].transpose(0, 1)
                        want_v = kv.values[i][0, :, lo - kv.start : lo - kv.start + source.n]
                        torch.testing.assert_close(k, want_k, rtol=1e-4, atol=1e-5)
                        torch.testing.assert_close(v, want_v.transpose(0, 1), rtol=1e-4, atol=1e-5)
            out, keys, values = engine(tiny_llama, plan, max_new_tokens=2)
            scheduler.device_store.unpin(rid)
            assert scheduler.device_store.admit(rid, keys.shape[1])[0]
            assert worker.store.keep(rid, keys, values)
            sharing.sources.register(rid, keys, values)
            sharing.record(plan, keys, values, out, set())
        assert corrected >= 2 and scheduler.load_bytes["factors"] > 0
        assert scheduler.load_bytes["corrected"] > 0
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_a_tensor_parallel_rank_adds_its_own_heads_of_the_delta():
    from hf_kvshare.serving.worker_store import add_delta

    g = torch.Generator().manual_seed(5)
    key, value = torch.randn(6, 4, 8, generator=g), torch.randn(6, 4, 8, generator=g)
    delta = tuple((torch.randn(5, 3, generator=g), torch.randn(3, 32, generator=g)) for _ in range(2))
    whole = add_delta(key, value, delta, None, None, 0)
    mine = add_delta(key[:, 2:], value[:, 2:], delta, None, None, 0, heads=(2, 4))
    assert all(torch.equal(w[:, 2:], m) for w, m in zip(whole, mine))
    assert torch.equal(whole[0][5:], key[5:]) and not torch.equal(whole[0][:5], key[:5])


def test_a_corrected_spans_factors_are_checked_finite_in_one_host_read(tiny_llama):
    """Every layer's factors (keys and values) checked in one read: one device sync per corrected span."""
    from host_reads import counting_host_reads

    from hf_kvshare.serving.worker_store import corrected_origin

    corrected, sources, *_ = _corrected_claim(tiny_llama, "correction")
    assert tiny_llama.config.num_hidden_layers > 2  # several layers with factors, each side two tensors
    with counting_host_reads() as counts:
        origin = corrected_origin(corrected, sources.find)
    assert origin is not None and sum(counts.values()) == 1, counts
    good = corrected.low_rank
    nan = ((torch.full((15, 2), float("nan")), torch.ones(2, 8)),) * 2
    corrected.low_rank = dataclasses.replace(
        good, factors=lambda layer: nan if layer == 2 else good.factors(layer)
    )
    with counting_host_reads() as counts:
        assert corrected_origin(corrected, sources.find) is None  # one layer non-finite: the rows are sent
    assert sum(counts.values()) == 1, counts

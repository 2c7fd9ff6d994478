"""K/V kept in vLLM's worker (hf_kvshare.serving.worker_store): the worker's device store within its
bytes, the scheduler's mirror deciding keep / drop (least recently used, never a pinned entry), a
placement's provenance among the kept read-backs, the worker writing references re-positioned on its
device exactly as the scheduler's placements, and a step's metadata with FullShared and KVCMAS claims
small and tensor-free. No vLLM needed (the connector's messages stand alone without it)."""

from __future__ import annotations

import importlib.util
import io
import pickle
from types import SimpleNamespace

import pytest
import torch
from serving_stand_ins import Delivered, announce_worker, bytes_per_position, stand_in_worker

from hf_kvshare.rope import RopeShifter
from hf_kvshare.segment_kv import SegmentKV
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
    doc = tokenizer(
        "The river Lune reaches the sea at Plover Scar near Glasson. " * 4, add_special_tokens=False
    )["input_ids"]
    claimed = sources = 0
    try:
        for task in range(3):
            for agent, question in (("a1", " Where?"), ("a2", " Why?")):
                rid = f"{task}{agent}"
                prompt = doc + tokenizer(question, add_special_tokens=False)["input_ids"]
                params = {
                    lay.KEY: {
                        "task": f"t{task}",
                        "agent": agent,
                        "segments": [{"slot": "doc", "start": 0, "end": len(doc)}],
                    }
                }
                plan = sharing.plan(rid, prompt, params, 0)
                assert plan.error is None
                scheduler._plans[rid] = plan
                scheduler.update_state_after_alloc(SimpleNamespace(request_id=rid), None, plan.claimed)
                meta = scheduler.build_connector_meta(
                    SimpleNamespace(
                        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(range(8)),))]
                    )
                )
                assert _pickled_size(meta) <= METADATA_MAX_BYTES
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

"""Every store is bounded by bytes (issue 51, item 4): the serving store's slots, the agents' kept PF
text, the anchor pools (a Session's method and a server's) and the read-backs waiting for their record.
Each store filled past its budget evicts (least recently used first) and reports it, and its measured
bytes never pass the budget after any step; a bad budget is refused before anything changes."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
from tiny import tiny_model

from hf_kvshare import PF, PH, Session
from hf_kvshare.anchors import AnchorPool, LRUDict
from hf_kvshare.anchors.pool import Anchor
from hf_kvshare.method import get_method
from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.host import BUDGETS, ByteBudget, Sharing
from hf_kvshare.serving.standin import engine

HAS_VLLM = importlib.util.find_spec("vllm") is not None
DOC = "The river Lune reaches the sea at Plover Scar near Glasson, past the old port. "
BAD_BUDGETS = [-1, 1.5, True, "1000"]


class Blob:
    """An entry of ``nbytes`` bytes (what an LRUDict bounds)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def anchor(i: int, nbytes: int) -> Anchor:
    return Anchor(base=SimpleNamespace(nbytes=nbytes, length=4), source="writer", origin=("r", i))


def tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- the engine's LRU store and pools
def test_an_lru_dict_with_a_byte_budget_never_holds_more_and_counts_its_evictions():
    entries = LRUDict(100, max_bytes=1000)
    for i in range(30):
        entries[f"e{i}"] = Blob(150 + 10 * (i % 4))
        entries.touch("e0")  # used by every request: the last one evicted
        entries.trim()
        assert entries.nbytes <= 1000 and entries.max_bytes == 1000
    assert entries.evicted_for_bytes == entries.evicted == 30 - len(entries) > 0
    assert "e0" in entries and list(entries)[-1] == "e0"
    entries["huge"] = Blob(5000)  # one entry alone over the budget: it goes too
    entries.trim()
    assert "huge" not in entries and entries.nbytes <= 1000


def test_the_last_pool_over_the_budget_sheds_its_own_anchors():
    pools = LRUDict(8, max_bytes=250)
    pool = pools["doc"] = AnchorPool("doc", capacity=10)
    for i in range(5):
        pool.insert(anchor(i, 100))
        pools.trim()
        assert pools.nbytes <= 250
        assert len(pools) == 1 and len(pool) == min(i + 1, 2)
    assert pool.evicted == 3 and pools.evicted_for_bytes == 3 and pools.evicted == 0


@pytest.mark.parametrize("bad", BAD_BUDGETS)
def test_a_bad_byte_budget_of_an_lru_dict_is_refused(bad):
    with pytest.raises(ValueError, match="max_bytes of an LRUDict must be an int >= 0"):
        LRUDict(4, max_bytes=bad)


def test_a_read_back_past_its_budget_is_refused_and_the_budget_never_held_more():
    budget = ByteBudget(1000)
    assert budget.reserve(600) and not budget.reserve(600) and budget.reserve(400)
    assert budget.held == budget.peak == 1000 and budget.refused == 1
    budget.release(600)
    assert budget.reserve(500) and budget.held == 900 and budget.peak == 1000


# ---------------------------------------------------------------- the Python API: a method's pools
def run_requests(method, tokenizer, n=8, check=None, model=None):
    model = model if model is not None else tiny_model("llama", seed=3, num_hidden_layers=2)
    for i in range(n):  # a new document and writer per request
        session = Session(model, tokenizer, method)
        session.run_turn(
            f"w{i}", [PF("Write.\n"), PH(f"doc{i}", f"text number {i} " * 3), PF(":")], max_new_tokens=2
        )
        session.run_turn("reader", [PF("Read.\n"), PH(f"w{i}"), PF(" and "), PH(f"doc{i}")], max_new_tokens=1)
        if check is not None:
            check(method.state_summary())


@pytest.mark.parametrize("name", ["kvcmas", "kvcomm"])
def test_a_methods_anchor_pools_stay_within_max_pool_bytes(name, tokenizer):
    options = {"tau": 1.0} if name == "kvcmas" else {}
    peak = []
    run_requests(get_method(name, **options), tokenizer, check=lambda s: peak.append(s["pools_bytes"]))
    budget = max(peak) // 2
    assert budget > 0
    method = get_method(name, **options, max_pool_bytes=budget)

    def within(summary):
        assert summary["pools_bytes"] <= budget == summary["max_pools_bytes"]
        assert summary["pools_bytes"] == sum(p.nbytes for p in method.pools.values())

    run_requests(method, tokenizer, check=within)
    assert method.state_summary()["pools_evicted_for_bytes"] > 0


@pytest.mark.parametrize("bad", BAD_BUDGETS)
def test_a_bad_max_pool_bytes_is_refused_and_changes_nothing(bad):
    with pytest.raises(ValueError, match="max_pool_bytes must be an int >= 0"):
        get_method("kvcmas", max_pool_bytes=bad)
    method = get_method("kvcmas", max_pool_bytes=1000)
    with pytest.raises(ValueError, match="max_pool_bytes"):
        method.max_pool_bytes = bad
    with pytest.raises(ValueError, match="max_pool_bytes"):
        method.bound_pools(bad)
    assert method.max_pool_bytes == 1000 and method.state_summary()["max_pools_bytes"] == 1000


def test_max_pool_bytes_is_not_a_state_option(tokenizer, tmp_path):
    """A state saved without a byte bound loads into an instance with one (and is trimmed to it)."""
    method, model = get_method("kvcmas", tau=1.0), tiny_model("llama", seed=3, num_hidden_layers=2)
    run_requests(method, tokenizer, n=3, model=model)
    method.save_state(tmp_path / "state", model)
    held = method.state_summary()["pools_bytes"]
    assert held > 0
    bounded = get_method("kvcmas", tau=1.0, max_pool_bytes=held // 2)
    bounded.load_state(tmp_path / "state", model)
    assert 0 < bounded.state_summary()["pools_bytes"] <= held // 2


# ---------------------------------------------------------------- the server's stores
def serve(sharing, tokenizer, requests):
    """Each request (task, agent, system text) planned, run by the stand-in engine and recorded; the
    store summary after each record."""
    doc = tokens(tokenizer, DOC * 2)
    for i, (task, agent, system) in enumerate(requests):
        own = tokens(tokenizer, system)
        prompt = own + doc + tokens(tokenizer, f"\nQuestion {i}?")
        segments = [{"slot": "doc", "start": len(own), "end": len(own) + len(doc)}]
        params = {lay.KEY: {"task": task, "agent": agent, "segments": segments}}
        plan = sharing.plan(f"r{i}", prompt, params, 0)
        assert plan.error is None
        out, keys, values = engine(sharing.model, plan, max_new_tokens=3)
        sharing.record(plan, keys, values, out, set())
        assert plan.error is None
        yield sharing.state_summary()


def test_the_servers_kept_text_and_anchors_stay_within_their_budgets_and_are_reported(tiny_llama, tokenizer):
    # three tasks of three agents each, one after the other: the store holds two of them
    requests = [(f"t{i // 3}", f"a{i}", f"You are agent number {i}, careful.\n") for i in range(9)]
    options = {"tau": 1.0, "min_segment_tokens": 4}
    free = list(serve(Sharing(tiny_llama, tokenizer, "kvcmas", **options), tokenizer, requests))
    peak = {store: max(s["stores"][store]["bytes"] for s in free) for store in ("prefixes", "anchors")}
    budgets = {"max_prefix_bytes": peak["prefixes"] // 2, "max_anchor_bytes": peak["anchors"] // 2}
    assert all(budgets.values())
    one_task = free[0]["stores"]["slots"]["bytes"]
    sharing = Sharing(tiny_llama, tokenizer, "kvcmas", max_bytes=one_task * 5 // 2, **budgets, **options)
    held = {store: 0 for store in ("slots", "prefixes", "anchors")}
    for summary in serve(sharing, tokenizer, requests):
        stores = summary["stores"]
        held = {store: max(held[store], stores[store]["bytes"]) for store in held}
        assert set(stores) == {"slots", "prefixes", "anchors", "read_backs"}
        for store in stores.values():
            assert store["bytes"] <= store["max_bytes"]
        assert stores["prefixes"]["max_bytes"] == budgets["max_prefix_bytes"]
        assert stores["anchors"]["max_bytes"] == budgets["max_anchor_bytes"]
        assert stores["prefixes"]["bytes"] == sharing.method.prefix_state_bytes()
        assert stores["anchors"]["bytes"] == sum(p.nbytes for p in sharing.method.pools.values())
    assert all(stores[store]["evicted"] > 0 and held[store] > 0 for store in held)


@pytest.mark.parametrize("name", [b for b in BUDGETS if b != "max_bytes"])
@pytest.mark.parametrize("bad", BAD_BUDGETS)
def test_a_bad_store_budget_is_refused_before_the_method_changes(tiny_llama, tokenizer, name, bad):
    method = get_method("kvcmas", max_pool_bytes=12345)
    with pytest.raises(ValueError, match=f"{name} must be an int >= 0"):
        Sharing(tiny_llama, tokenizer, method, **{name: bad})
    assert method.binding.model is None and method.max_pool_bytes == 12345
    assert method.prefix_summary()["max_prefix_bytes"] == method.PREFIX_MAX_BYTES


def test_the_methods_own_smaller_pool_bound_is_kept_unless_the_server_names_one(tiny_llama, tokenizer):
    assert Sharing(tiny_llama, tokenizer, "kvcmas", max_pool_bytes=5000).method.max_pool_bytes == 5000
    named = Sharing(tiny_llama, tokenizer, "kvcmas", max_pool_bytes=5000, max_anchor_bytes=9000)
    assert named.method.max_pool_bytes == 9000
    assert Sharing(tiny_llama, tokenizer, "fullshared").state_summary()["stores"].keys() == {
        "slots",
        "prefixes",
        "read_backs",
    }


def test_the_budgets_reach_the_connector_through_the_server_and_the_cli(capsys):
    from hf_kvshare.cli import main
    from hf_kvshare.serving.server import Server

    server = Server(".", method=None, port=1, max_anchor_bytes=7, max_read_back_bytes=0)
    extra = json.loads(
        Server(".", "fullshared", port=1, max_prefix_bytes=5, max_read_back_bytes=0).command()[-3]
    )["kv_connector_extra_config"]
    assert extra["max_prefix_bytes"] == 5 and extra["max_read_back_bytes"] == 0
    assert "max_anchor_bytes" not in extra  # unset: the connector's default
    assert server.budgets["max_anchor_bytes"] == 7
    with pytest.raises(ValueError, match="max_read_back_bytes must be an int >= 0"):
        Server(".", method=None, port=1, max_read_back_bytes=-1)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--max-anchor-bytes", "-1"])
    assert exit_info.value.code == 2 and "--max-anchor-bytes must be 0 or more" in capsys.readouterr().err


@pytest.mark.skipif(
    not HAS_VLLM, reason="the connector's scheduler side imports vLLM (.ci/run's serving venv)"
)
def test_a_read_back_past_its_budget_is_not_recorded_and_is_reported(tiny_llama, tokenizer, tmp_path):
    """The connector's scheduler holds each read-back against ``max_read_back_bytes`` until its record
    has run: one that would pass it is not recorded (the report's error says why, the store counts it,
    the task's store holds nothing of it); once a first read-back taught the bytes per position, a
    finished request past the budget is not even read back (no capture ordered, its blocks freed)."""
    from vllm.v1.request import RequestStatus

    from hf_kvshare.serving.connector_common import Captured
    from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler

    reports = tmp_path / "reports.jsonl"
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"report_path": str(reports), "read_back_channel": False}
        ),
        cache_config=SimpleNamespace(block_size=16),
    )
    doc = tokens(tokenizer, DOC * 2)
    prompt = doc + tokens(tokenizer, "\nWhere?")

    def finish(scheduler, sharing, rid):
        """Plan ``rid`` (task ``rid``), run it, end it; its K/V come with the step's output if ordered."""
        params = {
            lay.KEY: {"task": rid, "agent": "a", "segments": [{"slot": "doc", "start": 0, "end": len(doc)}]}
        }
        request = SimpleNamespace(
            request_id=rid, external_req_id=None, prompt_token_ids=prompt, kv_transfer_params=params,
            cache_salt=sharing.salt, status=RequestStatus.FINISHED_STOPPED, output_token_ids=[],
            sampling_params=SimpleNamespace(all_stop_token_ids=[], eos_token_id=None), num_computed_tokens=0,
        )  # fmt: skip
        scheduler.on_new_request(request)
        claimed = None
        while claimed is None:
            claimed, _ = scheduler.get_num_new_matched_tokens(request, 0)
        out, keys, values = engine(tiny_llama, scheduler._plans[rid], max_new_tokens=2)
        request.output_token_ids, request.num_computed_tokens = list(out), len(prompt) + len(out) - 1
        held, report = scheduler.request_finished(request, list(range(8)))
        ordered = [
            c.request_id
            for c in scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[])).captures
        ]
        captured = Captured(kv={rid: (keys, values)} if held else {})
        scheduler.update_connector_output(
            SimpleNamespace(kv_connector_worker_meta=captured, finished_sending={rid} if held else set())
        )
        scheduler._background.drain()
        slot = sharing.hosts[rid].slots.get("doc") if rid in sharing.hosts else None
        return held, ordered, report, slot is not None and slot.latest is not None

    for budget in (1 << 30, 1000):
        sharing = Sharing(tiny_llama, tokenizer, "fullshared", max_read_back_bytes=budget)
        scheduler = HFKVShareScheduler(config, sharing)
        try:
            first, second = (finish(scheduler, sharing, f"r{i}b{budget}") for i in range(2))
            read_backs = sharing.state_summary()["stores"]["read_backs"]
        finally:
            scheduler.shutdown()
        assert read_backs["bytes"] == 0 and read_backs["max_bytes"] == budget  # released once recorded
        if budget > 1000:
            assert first[0] and first[3] and second[0] and second[3]  # read back and recorded
            assert read_backs["refused"] == 0 and read_backs["peak"] > 1000
            continue
        # the first: read back (the bytes per position unknown yet), refused as it came
        assert first[0] and first[1] == [f"r0b{budget}"] and not first[3]
        # the second: refused at its end, no read-back ordered
        assert not second[0] and second[1] == [] and not second[3]
        assert "read-back budget" in second[2]["hf_kvshare"]["error"]
        assert read_backs["refused"] == 2 and read_backs["peak"] == 0
    lines = {x["request_id"]: x for x in map(json.loads, reports.read_text().splitlines())}
    assert all("read-back budget" in lines[f"r{i}b1000"]["error"] for i in range(2))
    assert lines["r0b1000"]["store"]["stores"]["read_backs"]["max_bytes"] == 1000
    assert all(lines[f"r{i}b{1 << 30}"]["error"] is None for i in range(2))


def test_bench_serves_summary_reports_each_stores_most_bytes_budget_and_evictions():
    from hf_kvshare.bench import serve as sb

    def report(slots, anchors, refused):
        stores = {
            "slots": {"bytes": slots, "max_bytes": 1000, "evicted": slots // 100},
            "anchors": {"bytes": anchors, "max_bytes": 500, "evicted": 1},
            "read_backs": {"bytes": 0, "max_bytes": 4000, "refused": refused, "peak": 3000},
        }
        base = {"claimed": None, "supplied_tokens": 0, "ph_tokens": 10, "supplied_ph_tokens": 0}
        return sb.compact_report({**base, "segments": [], "store": {"stores": stores}})

    records = [
        {"request": i, "ok": True, "connector": report(*values)}
        for i, values in enumerate([(900, 100, 0), (400, 500, 2), (700, 300, 1)])
    ]
    stores = sb.connector_columns("kvcmas", records)["stores_max"]
    assert stores["slots"] == {"bytes": 900, "max_bytes": 1000, "evicted": 9}
    assert stores["anchors"] == {"bytes": 500, "max_bytes": 500, "evicted": 1}
    assert stores["read_backs"]["refused"] == 2 and stores["read_backs"]["peak"] == 3000
    assert (
        sb.connector_columns(
            "kvcmas", [{"request": 0, "ok": True, "connector": report(1, 1, 0) | {"stores": None}}]
        )["stores_max"]
        is None
    )


def test_the_workers_sent_claims_stay_within_their_bytes_and_a_dropped_one_fails_at_once():
    """The worker's buffer of claims' K/V that came on the order channel is bounded by bytes
    (``payload_bytes``): past it the oldest is dropped, K/V larger than the budget are not kept, each
    drop counted and returned; the dropped claim's take finds none at once, with the reason."""
    import time

    import torch

    from hf_kvshare.serving.worker_store import DEFAULT_PAYLOAD_BYTES, PayloadBuffer

    def kv(n):  # n positions of 1 layer, 1 head of size 4, float32: 32 bytes a position (keys and values)
        return torch.zeros(1, n, 1, 4), torch.zeros(1, n, 1, 4)

    buffer = PayloadBuffer(700)
    assert buffer.put("a", *kv(10)) == [] and buffer.put("b", *kv(10)) == [] and buffer.bytes == 640
    assert buffer.put("c", *kv(10)) == ["a"] and buffer.bytes == 640 and buffer.dropped == 1
    assert buffer.put("huge", *kv(40)) == ["huge"] and buffer.bytes == 640 and buffer.dropped == 2
    t0 = time.monotonic()
    for gone in ("a", "huge"):
        got, why = buffer.take(gone, timeout=10)
        assert got is None and "payload budget (700 bytes)" in why
    assert time.monotonic() - t0 < 5  # at once, not after the wait
    got, why = buffer.take("b", timeout=10)
    assert got is not None and why == "" and buffer.bytes == 320 and len(buffer) == 1
    got, why = buffer.take("never", timeout=0.01)
    assert got is None and "never came on the order channel" in why
    assert PayloadBuffer(DEFAULT_PAYLOAD_BYTES).max_bytes == 1 << 30
    for bad in BAD_BUDGETS:
        with pytest.raises(ValueError, match="payload_bytes must be an int >= 0"):
            PayloadBuffer(bad)


@pytest.mark.skipif(not HAS_VLLM, reason="the worker side imports vLLM (.ci/run's serving venv)")
def test_a_claim_whose_sent_kv_the_worker_dropped_is_reported_failed_never_written(caplog):
    """The worker's payload budget from the connector's extra config: a claim whose K/V it dropped
    is logged and its blocks reported failed (vLLM recomputes them); a kept one is written."""
    import logging

    import torch
    from serving_stand_ins import stand_in_worker

    from hf_kvshare.serving.connector_common import HFKVShareMetadata, Load

    per_request = 2 * 20 * 2 * 4 * 4 * 2  # keys and values of 20 positions, 2 layers, 2 heads of 4
    worker, names = stand_in_worker(2, 2, 4, extra={"payload_bytes": per_request})
    try:
        assert worker.payloads.max_bytes == per_request
        keys, values = torch.randn(2, 20, 2, 4), torch.randn(2, 20, 2, 4)
        with caplog.at_level(logging.ERROR, logger="hf_kvshare.serving"):
            worker._on_payload("a", keys, values, "load")
            worker._on_payload("b", keys, values, "load")  # a is dropped to keep b
        assert "request a's claimed K/V dropped past the worker's payload budget" in caplog.text
        worker.start_load_kv(HFKVShareMetadata(loads=[Load("a", [1, 2], 0, 20, payload=[(0, 20)])]))
        assert worker.get_block_ids_with_load_errors() == {1, 2}
        worker.start_load_kv(HFKVShareMetadata(loads=[Load("b", [3, 4], 0, 20, payload=[(0, 20)])]))
        assert not worker.get_block_ids_with_load_errors()
        k, v = worker._io[names[0]].read([3, 4], 0, 20)
        assert torch.equal(k, keys[0]) and torch.equal(v, values[0])
    finally:
        worker.shutdown()


class _Planner:
    """A stand-in Sharing whose plans hold ``plan_bytes`` bytes of claimed K/V; logs what runs."""

    def __init__(self, plan_bytes: int):
        self.plan_bytes, self.log = plan_bytes, []

    def state_summary(self):
        return {}

    def plan(self, request_id, prompt, params, local_hit):
        import torch

        from hf_kvshare.serving.host import Plan

        self.log.append(f"plan {request_id}")
        kv = torch.zeros(self.plan_bytes // 8)  # keys and values: plan_bytes in all
        return Plan(request_id=request_id, prompt=prompt, local_hit=local_hit, keys=kv, values=kv.clone())

    def claim(self, plan, local_hit):
        plan.local_hit = local_hit

    def release(self, plan):
        self.log.append(f"release {plan.request_id}")


def test_plans_decided_ahead_hold_their_kv_within_a_byte_budget_and_the_rest_plan_at_admission(caplog):
    """The admission queue's plans decided ahead (on arrival) hold their K/V until vLLM asks: within
    ``max_planned_bytes``; past it a plan is dropped (released, counted, logged) and its request is
    planned at its admission query, not ahead again; handing a plan out frees its bytes."""
    import logging

    from hf_kvshare.serving.admission import DEFAULT_MAX_PLANNED_BYTES, Background, held_bytes

    sharing = _Planner(400)
    background = Background(sharing, wait_s=0.0, max_planned_bytes=1000)
    params = {lay.KEY: {"task": "t", "agent": "a", "segments": []}}
    try:
        with caplog.at_level(logging.WARNING, logger="hf_kvshare.serving"):
            for rid in ("r1", "r2", "r3"):
                background.prepare(rid, [1, 2], params)
            background.drain()
        assert sharing.log == ["plan r1", "plan r2", "plan r3", "release r3"]  # 800 held, 1200 would pass
        assert "request r3's plan, decided ahead, dropped" in caplog.text
        summary = background.summary()
        assert summary["planned_bytes"] == 800 and summary["max_planned_bytes"] == 1000
        assert summary["plans_dropped_for_bytes"] == 1
        background.prepare("r3", [1, 2], params)  # a late prepare: not ahead again
        background.drain()
        assert sharing.log[-1] == "release r3"
        first = background.plan("r1", [1, 2], params, 0)
        assert first is not None and held_bytes(first) == 400 and background.planned_bytes == 400
        third = None
        for _ in range(100):  # planned at its admission query now
            third = third or background.plan("r3", [1, 2], params, 0)
            background.drain()
        assert third is not None and third.local_hit == 0 and sharing.log[-1] == "plan r3"
        assert background.planned_bytes == 400  # r2's, until vLLM asks for it
        background.forget("r2")
        background.drain()
        assert background.planned_bytes == 0
    finally:
        background.close()
    assert Background(_Planner(8), enabled=False).max_planned_bytes == DEFAULT_MAX_PLANNED_BYTES == 1 << 30
    for bad in BAD_BUDGETS:
        with pytest.raises(ValueError, match="planned_bytes must be an int >= 0"):
            Background(_Planner(8), enabled=False, max_planned_bytes=bad)


def test_anchors_deferred_on_one_storage_count_it_once():
    """Deferred anchors keep their source's storages alive until factorized: two anchors (and two
    pools) recorded from views of one request's cache count that storage once, in the anchor, the pool,
    the pools' LRUDict and its byte bound; factorized, each counts its own factors."""
    import torch

    from hf_kvshare.anchors import AnchorPool, LRUDict
    from hf_kvshare.anchors.lowrank import DeferredFactoredKV

    torch.manual_seed(0)
    cache = [torch.randn(1, 2, 24, 4) for _ in range(2)]  # one request's layers: 2 x 768 bytes
    whole = sum(t.untyped_storage().nbytes() for t in cache)

    def deferred(a, b):  # a span's keys and values: views of the cache's layers
        views = [t[:, :, a:b] for t in cache]
        return DeferredFactoredKV(
            lambda: [(v, v) for v in views], lambda: views, 2, "exact", length=b - a, kv_heads=2, num_layers=2
        )

    first = Anchor(base=deferred(0, 12), source="a", origin=("r", 0), deltas={"b": deferred(12, 24)})
    second = Anchor(base=deferred(12, 24), source="a", origin=("r", 1))
    assert first.nbytes == second.nbytes == whole  # the base and the delta share the cache: once
    pool, other = AnchorPool("doc", capacity=4), AnchorPool("note", capacity=4)
    pool.insert(first)
    pool.insert(second)
    other.insert(Anchor(base=deferred(0, 24), source="a", origin=("r", 2)))
    assert pool.nbytes == whole  # not 2 x whole
    pools = LRUDict(8, max_bytes=whole)
    pools["doc"], pools["note"] = pool, other
    assert pools.nbytes == whole  # not 3 x whole
    pools.trim()  # within the budget: nothing evicted
    assert list(pools) == ["doc", "note"] and pools.evicted_for_bytes == 0
    factors = second.base.nbytes  # read: factorized, its own factors now; the storage kept by the others
    assert 0 < factors and second.nbytes == factors and pool.nbytes == whole + factors


def test_a_record_walks_its_tasks_slots_for_the_evicted_only_when_some_slot_was_evicted(
    tiny_llama, tokenizer
):
    """A slot recorded again is no longer remembered as evicted: the record walks the task's slots for
    that only when the host remembers an evicted slot (``host.evicted``), not at every record."""

    class Walked(dict):  # the task's slots, counting the walks over them
        walks = 0

        def items(self):
            Walked.walks += 1
            return super().items()

    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    doc = tokens(tokenizer, DOC * 2)
    for i, evicted in enumerate((False, True)):
        own = tokens(tokenizer, f"Agent {i} here.\n")
        segments = [{"slot": "doc", "start": len(own), "end": len(own) + len(doc)}]
        params = {lay.KEY: {"task": "t", "agent": f"a{i}", "segments": segments}}
        plan = sharing.plan(f"r{i}", own + doc + tokens(tokenizer, f" Question {i}?"), params, 0)
        out, keys, values = engine(tiny_llama, plan, max_new_tokens=2)
        host = plan.host
        host.slots = Walked(host.slots)
        if evicted:
            host.evicted["doc"] = None  # as the store's bound leaves it; doc is recorded again now
        Walked.walks = 0
        sharing.record(plan, keys, values, out, set())
        assert Walked.walks == int(evicted), (evicted, Walked.walks)
        assert "doc" not in host.evicted

"""The read-back side channel (hf_kvshare.serving.channel): the worker's K/V reach the scheduler's
thread as they were read, bounded and without blocking the sender. No vLLM (pyzmq only: one of vLLM's
dependencies; skipped where it is absent); the connector's worker side on them (with vLLM only)."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("zmq")

from serving_stand_ins import (  # noqa: E402
    Delivered,
    admitted,
    announce_worker,
    bytes_per_position,
    stand_in_worker,
    vllm_request,
)

from hf_kvshare.serving import channel  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_message_decodes_to_the_tensors_it_was_made_of(dtype):
    keys = torch.randn(3, 5, 2, 4).to(dtype)
    values = torch.randn(3, 5, 2, 4).to(dtype)
    before = keys.clone()
    request_id, k, v, via, rank = channel.decode(channel.encode("req-1", keys, values, "at finish", rank=1))
    assert request_id == "req-1" and via == "at finish" and rank == 1
    assert k.dtype == v.dtype == dtype and k.shape == v.shape == keys.shape
    assert torch.equal(k, keys) and torch.equal(v, values)
    k.add_(1)  # writable memory of its own: the sender's tensors are not touched
    assert torch.equal(keys, before) and not torch.equal(k, keys)


def test_bad_messages_are_refused_with_what_was_expected():
    keys = torch.zeros(2, 3, 1, 4)
    with pytest.raises(ValueError, match="one shape and dtype"):
        channel.encode("r", keys, torch.zeros(2, 4, 1, 4))
    with pytest.raises(ValueError, match="dtype must be one of"):
        channel.encode("r", keys.to(torch.int32), keys.to(torch.int32))
    with pytest.raises(ValueError, match="3 frames"):
        channel.decode([b"{}"])
    with pytest.raises(ValueError, match="known dtype"):
        channel.decode([b'{"request_id": "r", "dtype": "torch.int8", "shape": [1]}', b"\0", b"\0"])


def test_the_receiver_delivers_each_read_back_on_its_thread_and_cleans_up():
    got = Delivered()
    receiver = channel.Receiver(got)
    folder = Path(receiver.address.removeprefix("ipc://")).parent
    sender = channel.Sender(receiver.address)
    kv = [(torch.randn(2, 7, 3, 4), torch.randn(2, 7, 3, 4)) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        sent = 0
        while sent < 2 and time.monotonic() < deadline:  # the connection completes asynchronously
            if sender.send(f"r{sent}", *kv[sent], "next step"):
                sent += 1
            else:
                time.sleep(0.01)
        assert sent == 2, "the sender never connected to the receiver"
        assert got.wait(count=2), f"delivered {len(got.order)} of 2"
    finally:
        sender.close()
        receiver.close()
    assert got.order == ["r0", "r1"]
    for request_id, (keys, values) in zip(got.order, kv):
        k, v = got.kv[request_id]
        assert torch.equal(k, keys) and torch.equal(v, values)
        assert got.via[request_id] == "next step"
        assert got.threads[request_id] == "hf_kvshare-read-back"
    assert receiver.received == 2
    assert not folder.exists()  # its socket's folder is removed on close


def test_a_sender_without_a_receiver_refuses_at_once_and_a_full_one_never_blocks(tmp_path):
    sender = channel.Sender(f"ipc://{tmp_path / 'nobody'}", max_queued=1)
    try:
        t0 = time.monotonic()
        assert not sender.send("r", torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
        assert time.monotonic() - t0 < 1.0
    finally:
        sender.close()
    with pytest.raises(ValueError, match="max_queued must be an int >= 1"):
        channel.Sender(f"ipc://{tmp_path / 'x'}", max_queued=0)


def test_one_undeliverable_message_does_not_stop_the_channel():
    got = []
    done = threading.Event()

    def deliver(request_id, keys, values, via, rank):
        if request_id == "bad":
            raise RuntimeError("the scheduler refused it")
        got.append(request_id)
        done.set()

    receiver = channel.Receiver(deliver)
    sender = channel.Sender(receiver.address)
    try:
        deadline = time.monotonic() + 10
        pending = ["bad", "good"]
        while pending and time.monotonic() < deadline:
            if sender.send(pending[0], torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)):
                pending.pop(0)
            else:
                time.sleep(0.01)
        assert done.wait(10)
    finally:
        sender.close()
        receiver.close()
    assert got == ["good"]


def test_orders_reach_the_workers_thread_and_a_bad_one_is_skipped():
    """The order channel (scheduler -> worker): each JSON order reaches ``take`` on the listener's
    thread, in order; a frame that is not a JSON object is logged and skipped."""
    got, done = [], threading.Event()

    def take(order):
        got.append((order, threading.current_thread().name))
        if order.get("request_id") == "r2":
            done.set()

    orders = channel.Orders(take)
    sender = channel.Sender(orders.address)
    try:
        queue = [{"request_id": "r1", "block_ids": [3, 4], "tokens": 20}, None, {"request_id": "r2"}]
        deadline = time.monotonic() + 10
        while queue and time.monotonic() < deadline:
            item = queue[0]
            ok = sender._send([b"[1, 2]"]) if item is None else sender.order(item)
            if ok:
                queue.pop(0)
            else:
                time.sleep(0.01)
        assert done.wait(10), got
    finally:
        sender.close()
        orders.close()
    assert [o for o, _ in got] == [
        {"request_id": "r1", "block_ids": [3, 4], "tokens": 20},
        {"request_id": "r2"},
    ]
    assert {name for _, name in got} == {"hf_kvshare-orders"}
    assert orders.received == 3  # the bad one was received, then skipped


def test_a_closed_sender_refuses_instead_of_raising(tmp_path):
    """The worker's step sends from inside vLLM's forward path: a channel that broke (closed socket,
    terminated context) must hand the read-back to the step's output, not raise into the engine."""
    receiver = channel.Receiver(lambda *args: None)
    sender = channel.Sender(receiver.address)
    try:
        sender._socket.close(0)
        assert not sender.send("r", torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
        assert not sender.order({"request_id": "r"})
    finally:
        sender._context.term()
        receiver.close()


# ------------------------------------------------ the in-process handoff (one process: vLLM's "uni" executor)
def _send_until(send, timeout=10.0):
    """``send()`` until it takes the message (the connection completes asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if send():
            return True
        time.sleep(0.01)
    return False


def test_an_in_process_send_hands_over_the_very_tensors():
    """A sender to a listener of this process parks the tensors by reference: the receiver gets the same
    objects (same storage), no bytes serialized; orders and factors keep their order with them."""
    got = Delivered()
    receiver = channel.Receiver(got)
    sender = channel.Sender(receiver.address)
    keys, values = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)
    try:
        assert sender.in_process
        assert _send_until(lambda: sender.send("r", keys, values, "at finish", rank=0))
        assert got.wait(count=1)
    finally:
        sender.close()
        receiver.close()
    k, v = got.kv["r"]
    assert k is keys and v is values and got.via["r"] == "at finish"
    assert got.threads["r"] == "hf_kvshare-read-back"
    assert sender.counts == {"in_process": 1, "serialized": 0, "serialized_bytes": 0}
    assert receiver.counts == {"in_process": 1, "serialized": 0, "serialized_bytes": 0}
    assert channel._HANDOFF.parked(receiver.address) == 0

    taken, tensors, orders_got, done = [], [], [], threading.Event()
    factors = [torch.randn(3, 2), torch.randn(2, 8)]

    def deliver(request_id, k, v, via, rank=0):
        taken.append((request_id, k, v))

    def deliver_tensors(request_id, kind, ts):
        tensors.append((request_id, kind, ts))

    def take(order):
        orders_got.append(order)
        done.set()

    orders = channel.Orders(take, deliver, deliver_tensors)
    sender = channel.Sender(orders.address)
    try:
        assert _send_until(lambda: sender.send("c", keys, values, "load"))
        assert _send_until(lambda: sender.send_tensors("c", "factors", factors))
        assert _send_until(lambda: sender.order({"request_id": "last"}))
        assert done.wait(10)
    finally:
        sender.close()
        orders.close()
    assert taken[0][1] is keys and taken[0][2] is values
    assert tensors[0][:2] == ("c", "factors") and all(a is b for a, b in zip(tensors[0][2], factors))
    assert orders_got == [{"request_id": "last"}]
    assert orders.counts["in_process"] == 2 and orders.counts["serialized_bytes"] == 0


def test_a_full_in_process_channel_refuses_without_parking_and_close_drops_what_waits():
    """At most ``max_queued`` entries wait per sender; a refused send parks nothing; a listener's close
    drops what was parked for it (never taken: its thread is held here)."""
    release, started = threading.Event(), threading.Event()

    def deliver(*args):
        started.set()
        release.wait(10)

    receiver = channel.Receiver(deliver)
    sender = channel.Sender(receiver.address, max_queued=2)
    kv = (torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    try:
        assert _send_until(lambda: sender.send("first", *kv))
        assert started.wait(10)  # taken from the table; its delivery holds the listener's thread
        assert sender.send("a", *kv) and sender.send("b", *kv)
        assert channel._HANDOFF.parked(receiver.address) == 2
        t0 = time.monotonic()
        assert not sender.send("c", *kv)  # full: refused at once, nothing parked
        assert time.monotonic() - t0 < 1.0
        assert channel._HANDOFF.parked(receiver.address) == 2
        assert sender.counts["in_process"] == 3
        receiver.close(timeout=0.1)  # its thread still delivering "first": "a" and "b" never taken
        assert channel._HANDOFF.parked(receiver.address) == 0
    finally:
        release.set()
        receiver.close()
        sender.close()
    assert not channel._HANDOFF.is_local(receiver.address)
    late = channel.Sender(receiver.address)  # a closed listener's address: not in-process any more
    try:
        assert not late.in_process
    finally:
        late.close()


def test_a_sender_to_another_process_or_turned_off_serializes():
    """A listener not registered in this process (another process's) and ``in_process=False`` (the
    escape hatch): the bytes travel as before, the receiver gets tensors of its own."""
    got = Delivered()
    receiver = channel.Receiver(got)
    keys, values = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    off = channel.Sender(receiver.address, in_process=False)
    try:
        assert not off.in_process
        assert _send_until(lambda: off.send("off", keys, values))
        assert got.wait(count=1)
        channel._HANDOFF.unregister(receiver.address)  # as another process's listener looks from here
        other = channel.Sender(receiver.address)
        try:
            assert not other.in_process
            assert _send_until(lambda: other.send("other", keys, values))
            assert got.wait(count=2)
        finally:
            other.close()
    finally:
        off.close()
        receiver.close()
    for request_id in ("off", "other"):
        k, v = got.kv[request_id]
        assert k is not keys and torch.equal(k, keys) and torch.equal(v, values)
        assert k.untyped_storage().data_ptr() != keys.untyped_storage().data_ptr()
    nbytes = 2 * keys.numel() * keys.element_size()
    assert off.counts == {"in_process": 0, "serialized": 1, "serialized_bytes": nbytes}
    assert receiver.counts == {"in_process": 0, "serialized": 2, "serialized_bytes": 2 * nbytes}
    with pytest.raises(ValueError, match="in_process must be true or false"):
        channel.Sender(receiver.address, in_process="no")


# ------------------------------------------------ the connector's worker side: one path, one fallback
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not HAS_VLLM, reason="the connector's sides import vLLM (.ci/run's serving venv)")
def test_the_worker_reads_back_on_the_order_path_or_else_with_the_steps_output():
    """A finished request ordered at its end is read on the order channel's thread and sent on the
    read-back channel (``"at finish"``), once; a capture no order took is read in ``wait_for_save`` and
    returned with the step's output (the one fallback), never sent on the channel."""
    from dataclasses import asdict

    from hf_kvshare.serving.connector_common import Capture, Captured, HFKVShareMetadata, Load

    heads, dim, layers = 2, 8, 3
    worker, _ = stand_in_worker(layers, heads, dim, blocks=6)
    got = Delivered()
    receiver = channel.Receiver(got)
    orders = None
    try:
        torch.manual_seed(0)
        keys, values = torch.randn(layers, 40, heads, dim), torch.randn(layers, 40, heads, dim)
        # the first step's metadata names the scheduler's read-back channel; the worker announces its
        # order channel and what one position of K/V takes in its store
        worker.start_load_kv(HFKVShareMetadata(read_back=receiver.address))
        announced = worker.build_connector_worker_meta()
        assert isinstance(announced, Captured) and announced.orders and not announced.kv
        assert announced.bytes_per_token == layers * 2 * heads * dim * 4
        orders = channel.Sender(announced.orders)
        # a claim written before the forward: its K/V on the order channel, the metadata names them
        deadline = time.monotonic() + 10
        while not orders.send("a", keys, values, "load") and time.monotonic() < deadline:
            time.sleep(0.01)  # the connection completes asynchronously
        worker.start_load_kv(HFKVShareMetadata(loads=[Load("a", [3, 0, 5], 0, 40, payload=[(0, 40)])]))
        assert not worker.get_block_ids_with_load_errors()
        # the path: ordered at its end, read on the order thread, sent on the read-back channel
        capture = Capture("a", [3, 0, 5], 40)
        deadline = time.monotonic() + 10
        while not orders.order(asdict(capture)) and time.monotonic() < deadline:
            time.sleep(0.01)  # the connection completes asynchronously
        assert got.wait("a"), "the order's read-back never arrived"
        (k, v), via = got.kv["a"], got.via["a"]
        assert torch.equal(k, keys) and torch.equal(v, values) and via == "at finish"
        # the same capture in the next step's metadata is not read again
        worker.wait_for_save(HFKVShareMetadata(captures=[capture]))
        step, deadline = None, time.monotonic() + 10
        while step is None and time.monotonic() < deadline:  # the order thread notes the send after it
            step = worker.build_connector_worker_meta()
            time.sleep(0.01)
        assert step is not None and step.sent == {"a"} and not step.kv
        # the fallback: a capture no order took goes with the step's output, not on the channel
        worker.wait_for_save(HFKVShareMetadata(captures=[Capture("b", [3, 0], 20)]))
        step = worker.build_connector_worker_meta()
        assert set(step.kv) == {"b"} and not step.sent and set(got.kv) == {"a"}
        assert torch.equal(step.kv["b"][0], keys[:, :20]) and torch.equal(step.kv["b"][1], values[:, :20])
        assert worker.get_finished() == ({"a", "b"}, None)  # both requests' blocks may be freed
    finally:
        if orders is not None:
            orders.close()
        worker.shutdown()
        receiver.close()


def _reports(path, n, timeout=30.0):
    import json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if len(lines) >= n:
            return {line["request_id"]: line for line in lines}
        time.sleep(0.02)
    raise AssertionError(f"{n} report lines never written")


@pytest.mark.skipif(not HAS_VLLM, reason="the connector's sides import vLLM (.ci/run's serving venv)")
def test_the_scheduler_records_from_the_channel_or_the_step_output_and_plans_the_waiting(
    tiny_llama, tokenizer, tmp_path
):
    """The scheduler side, given its Sharing (no module registry): a finished request's K/V arriving on
    the read-back channel are recorded at once (``"at finish"``) and the task's next request, waiting
    for that record, is planned then and reads the document; K/V with the step's output (the fallback)
    are recorded at the step's end (``"step output"``)."""
    from hf_kvshare.serving import layout as lay
    from hf_kvshare.serving.connector_common import Captured
    from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler
    from hf_kvshare.serving.host import Sharing
    from hf_kvshare.serving.standin import engine

    reports = tmp_path / "reports.jsonl"
    extra = {"report_path": str(reports)}
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=16),
    )
    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    scheduler = HFKVShareScheduler(config, sharing)
    assert scheduler.sharing is sharing

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # a request without the method's salt (another endpoint, not through the layout check): exact
    stray = vllm_request("r0", ids("Some text. " * 20), None)
    scheduler.on_new_request(stray)  # not planned ahead either
    assert scheduler.get_num_new_matched_tokens(stray, 0) == (0, False) and "r0" not in scheduler._plans
    scheduler._background.drain()  # whatever was queued for it has run
    assert sharing.requests == 0  # the method never saw it

    doc, q1, q2 = (
        ids("The river Lune reaches the sea at Plover Scar near Glasson."),
        ids(" Where?"),
        ids(" Why?"),
    )

    def params(agent, start):
        return {
            lay.KEY: {
                "task": "t",
                "agent": agent,
                "segments": [{"slot": "doc", "start": start, "end": start + len(doc)}],
            }
        }

    sender = None
    # the worker's first step output: its order channel (claims' K/V come through it) and what one
    # position of K/V takes in its device store (the scheduler's mirror keeps requests from then on)
    payloads = Delivered()
    worker_orders = announce_worker(scheduler, bytes_per_position(tiny_llama.config), deliver=payloads)
    try:
        first = vllm_request("r1", q1 + doc, params("a1", len(q1)), cache_salt=sharing.salt)
        scheduler.on_new_request(first)
        assert admitted(scheduler, first) == 0  # the first agent computes the document
        plan = scheduler._plans["r1"]
        out, keys, values = engine(tiny_llama, plan, max_new_tokens=4)
        finished = vllm_request(
            "r1", first.prompt_token_ids, first.kv_transfer_params, out, cache_salt=sharing.salt
        )
        assert scheduler.request_finished(finished, [0, 1, 2, 3])[0]  # blocks kept until read back
        meta = scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))
        assert [c.request_id for c in meta.captures] == ["r1"] and meta.read_back
        # the task's next agent arrives before the record: it waits for it
        second = vllm_request("r2", doc + q2, params("a2", 0), cache_salt=sharing.salt)
        scheduler.on_new_request(second)
        assert scheduler.get_num_new_matched_tokens(second, 0) == (None, False)
        # the path: the K/V on the read-back channel, recorded on the channel's thread, r2 planned behind
        sender = channel.Sender(meta.read_back)
        deadline = time.monotonic() + 10
        while not sender.send("r1", keys, values, "at finish") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert admitted(scheduler, second) == len(doc)  # reads the document r1's record stored
        assert _reports(reports, 1)["r1"]["read_back"] == "at finish"
        # r1 is kept by the worker: r2's claim is a reference to its rows (moved from position len(q1)
        # to 0 there), no K/V in the step's metadata nor on the order channel
        assert meta.captures[0].keep and "r1" in scheduler.device_store
        scheduler.update_state_after_alloc(second, None, len(doc))
        step = scheduler.build_connector_meta(
            SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r2", block_ids=([6, 7],))])
        )
        (load,) = step.loads
        assert load.block_ids == [6, 7] and not load.payload and not payloads.kv
        assert [(s.request_id, s.row, s.n, s.offset, s.src_start, s.dst_start) for s in load.sources] == [
            ("r1", len(q1), len(doc), 0, len(q1), 0)
        ]
        assert 0 < scheduler.metadata_bytes["max"] < 4096
        assert not scheduler.has_pending_push_work()
        # the worker's step output saying r1 went on the channel: already recorded, nothing waits
        scheduler.update_connector_output(
            SimpleNamespace(kv_connector_worker_meta=Captured(sent={"r1"}), finished_sending={"r1"})
        )
        # the fallback: r2's K/V with the step's output
        out2, keys2, values2 = engine(tiny_llama, scheduler._plans["r2"], max_new_tokens=4)
        scheduler.request_finished(
            vllm_request(
                "r2", second.prompt_token_ids, second.kv_transfer_params, out2, cache_salt=sharing.salt
            ),
            [4, 5],
        )
        scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))
        scheduler.update_connector_output(
            SimpleNamespace(
                kv_connector_worker_meta=Captured(kv={"r2": (keys2, values2)}), finished_sending={"r2"}
            )
        )
        assert _reports(reports, 2)["r2"]["read_back"] == "step output"
        assert not scheduler.has_pending_push_work()
    finally:
        if sender is not None:
            sender.close()
        scheduler.shutdown()
        worker_orders.close()


@pytest.mark.parametrize("producer_wait_s", [30.0, 0.2])
@pytest.mark.skipif(not HAS_VLLM, reason="the connector's sides import vLLM (.ci/run's serving venv)")
def test_an_agent_waits_for_the_request_computing_its_document_and_a_cold_one_does_not(
    tiny_llama, tokenizer, producer_wait_s
):
    """Agents of a task reading one fresh document: one arriving while the first still computes it
    waits (the hook answers ``None``) and claims it once the first is recorded (``producer_wait``:
    ``recorded``); a cold agent (its own leading text new: the claim stops before the document) gains
    nothing by waiting and is planned at once; past ``producer_wait_s`` the wait ends ``timed out``."""
    from hf_kvshare.serving import layout as lay
    from hf_kvshare.serving.connector_common import Captured
    from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler
    from hf_kvshare.serving.host import NOT_RECORDED_YET, OWN_TEXT_NEW, Sharing
    from hf_kvshare.serving.standin import engine

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    doc = ids("The river Lune reaches the sea at Plover Scar near Glasson. " * 3)
    own = {a: ids(f"You are agent {a}, careful and brief.\n") for a in ("a1", "a2", "a3")}

    def request(rid, agent, task, cache_salt):
        prompt = own[agent] + doc + ids(" Where?")
        params = {
            lay.KEY: {
                "task": task,
                "agent": agent,
                "segments": [{"slot": "doc", "start": len(own[agent]), "end": len(own[agent]) + len(doc)}],
            }
        }
        return vllm_request(rid, prompt, params, cache_salt=cache_salt)

    extra = {"read_back_channel": False, "producer_wait_s": producer_wait_s}
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=16),
    )
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", prefix_reuse=True)
    scheduler = HFKVShareScheduler(config, sharing)

    def finish(req, plan, blocks):
        out, keys, values = engine(tiny_llama, plan, max_new_tokens=2)
        done = vllm_request(
            req.request_id, req.prompt_token_ids, req.kv_transfer_params, out, cache_salt=sharing.salt
        )
        scheduler.request_finished(done, blocks)
        scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))
        scheduler.update_connector_output(
            SimpleNamespace(
                kv_connector_worker_meta=Captured(kv={req.request_id: (keys, values)}),
                finished_sending={req.request_id},
            )
        )

    worker_orders = announce_worker(scheduler)  # claims' K/V go on its order channel
    try:
        # a warm-up task: a1's and a2's own text kept (a3 stays cold)
        for rid, agent in (("w1", "a1"), ("w2", "a2")):
            warm = request(rid, agent, "warm", sharing.salt)
            admitted(scheduler, warm)
            finish(warm, scheduler._plans[rid], [0, 1, 2, 3, 4])
        scheduler._background.drain()
        # the cost estimate as on a slow engine (1 s per token): waiting is cheaper than computing
        scheduler._seconds_per_token = 1.0
        # the task: a1 computes the fresh document; a2 and a3 arrive while it is in flight
        r1 = request("r1", "a1", "t", sharing.salt)
        scheduler.on_new_request(r1)
        assert admitted(scheduler, r1) == len(own["a1"])  # its own text kept, the document new
        r2, r3 = request("r2", "a2", "t", sharing.salt), request("r3", "a3", "t", sharing.salt)
        scheduler.on_new_request(r2)
        scheduler.on_new_request(r3)
        assert admitted(scheduler, r3) == 0  # cold: nothing to gain by waiting, planned at once
        stop = scheduler._plans["r3"].claim_stop
        assert stop["span"] == "pf0" and stop["reason"] == OWN_TEXT_NEW
        assert scheduler._plans["r3"].producer_wait is None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "r2" not in scheduler._producer_waits:
            assert scheduler.get_num_new_matched_tokens(r2, 0) == (None, False)
            time.sleep(0.01)
        assert "r2" in scheduler._producer_waits  # waits for r1's record of the document
        if producer_wait_s > 1:
            finish(r1, scheduler._plans["r1"], [5, 6, 7, 8, 9])
            assert admitted(scheduler, r2) == len(r2.prompt_token_ids) - 1  # the document claimed
            wait = scheduler._plans["r2"].report()["producer_wait"]
            assert wait["span"] == "doc" and wait["outcome"] == "recorded" and wait["seconds"] >= 0
            # a3 again (another task) as its cold request r3 ends, before its read-back: its own text is
            # kept by r3's record, so it waits for that instead of computing its own text again
            out3, keys3, values3 = engine(tiny_llama, scheduler._plans["r3"], max_new_tokens=2)
            done3 = vllm_request(
                "r3", r3.prompt_token_ids, r3.kv_transfer_params, out3, cache_salt=sharing.salt
            )
            scheduler.request_finished(done3, [10, 11, 12, 13, 14])
            r4 = request("r4", "a3", "t2", sharing.salt)
            scheduler.on_new_request(r4)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "r4" not in scheduler._producer_waits:
                assert scheduler.get_num_new_matched_tokens(r4, 0) == (None, False)
                time.sleep(0.01)
            assert scheduler._producer_waits["r4"].producers == {"r3"}
            scheduler.update_connector_output(
                SimpleNamespace(
                    kv_connector_worker_meta=Captured(kv={"r3": (keys3, values3)}), finished_sending={"r3"}
                )
            )
            assert admitted(scheduler, r4) == len(own["a3"])  # its own text claimed; t2's document is new
            assert scheduler._plans["r4"].producer_wait["outcome"] == "recorded"
        else:
            assert admitted(scheduler, r2) == len(own["a2"])  # the bound passed: it computes the document
            plan = scheduler._plans["r2"]
            assert plan.producer_wait["outcome"] == "timed out"
            assert plan.claim_stop["reason"] == NOT_RECORDED_YET
    finally:
        scheduler.shutdown()
        worker_orders.close()


def _rank_captured(request_id, rank, kv=None, sent=False):
    from hf_kvshare.serving.connector_common import Captured

    return Captured(
        kv={request_id: kv} if kv is not None else {}, sent={request_id} if sent else set(), rank=rank
    )


@pytest.mark.skipif(not HAS_VLLM, reason="the connector's sides import vLLM (.ci/run's serving venv)")
def test_two_ranks_outputs_merge_without_overwriting_each_other():
    """vLLM merges its workers' outputs with ``Captured.aggregate``: each rank's K/V of one request, its
    sent requests and its order channel stay apart (``by_rank``)."""
    keys = torch.randn(3, 4, 2, 8)
    merged = _rank_captured("r", 0, (keys[:, :, :1], keys[:, :, :1]))
    merged.orders = "ipc://zero"
    one = _rank_captured("r", 1, (keys[:, :, 1:], keys[:, :, 1:]), sent=False)
    one.orders = "ipc://one"
    merged = merged.aggregate(one).aggregate(_rank_captured("s", 1, sent=True))
    parts = merged.by_rank()
    assert set(parts) == {0, 1}
    assert torch.equal(parts[0].kv["r"][0], keys[:, :, :1]) and torch.equal(
        parts[1].kv["r"][0], keys[:, :, 1:]
    )
    assert parts[1].sent == {"s"} and not parts[0].sent
    assert (parts[0].orders, parts[1].orders) == ("ipc://zero", "ipc://one")


@pytest.mark.skipif(not HAS_VLLM, reason="the connector's sides import vLLM (.ci/run's serving venv)")
def test_at_two_ranks_the_scheduler_records_all_heads_once_both_ranks_read_back(tiny_llama, tokenizer):
    """Tensor parallel 2 (tiny_llama: 2 KV heads, one per rank): the first agent's K/V come back half on
    the read-back channel (rank 1) and half with the step's output (rank 0); the record waits for both
    and keeps all heads, so the next agent's claim is the one a single-rank server gives, head for head."""
    from hf_kvshare.serving import layout as lay
    from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler
    from hf_kvshare.serving.host import Sharing
    from hf_kvshare.serving.standin import engine

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    doc, q1, q2 = (
        ids("The river Lune reaches the sea at Plover Scar near Glasson."),
        ids(" Where?"),
        ids(" Why?"),
    )

    def params(agent, start):
        segments = [{"slot": "doc", "start": start, "end": start + len(doc)}]
        return {lay.KEY: {"task": "t", "agent": agent, "segments": segments}}

    def claim_of_second_agent(tp):
        config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
            cache_config=SimpleNamespace(block_size=16),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
            model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2),
        )
        sharing = Sharing(tiny_llama, tokenizer, "fullshared")
        scheduler = HFKVShareScheduler(config, sharing)
        sender = None
        # each rank's first step output announces its order channel (a claim's K/V that the workers do
        # not keep go there); no bytes per position: the workers keep nothing, every claim is sent
        listeners = [announce_worker(scheduler, rank=rank) for rank in range(tp)]

        try:
            first = vllm_request("r1", q1 + doc, params("a1", len(q1)), cache_salt=sharing.salt)
            scheduler.on_new_request(first)
            assert admitted(scheduler, first) == 0
            out, keys, values = engine(tiny_llama, scheduler._plans["r1"], max_new_tokens=4)
            done = vllm_request(
                "r1", first.prompt_token_ids, first.kv_transfer_params, out, cache_salt=sharing.salt
            )
            assert scheduler.request_finished(done, [0, 1, 2, 3])[0]
            meta = scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))
            if tp == 1:
                step = _rank_captured("r1", 0, (keys, values))
            else:
                sender = channel.Sender(meta.read_back)
                deadline = time.monotonic() + 10
                while not sender.send("r1", keys[:, :, 1:], values[:, :, 1:], "at finish", rank=1):
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                step = _rank_captured("r1", 0, (keys[:, :, :1], values[:, :, :1])).aggregate(
                    _rank_captured("r1", 1, sent=True)
                )
            scheduler.update_connector_output(
                SimpleNamespace(kv_connector_worker_meta=step, finished_sending={"r1"})
            )
            assert not scheduler.has_pending_push_work()  # recorded: both ranks' heads came
            second = vllm_request("r2", doc + q2, params("a2", 0), cache_salt=sharing.salt)
            scheduler.on_new_request(second)
            assert admitted(scheduler, second) == len(doc)
            plan = scheduler._plans["r2"]
            return plan.keys.clone(), plan.values.clone()
        finally:
            if sender is not None:
                sender.close()
            scheduler.shutdown()
            for listener in listeners:
                listener.close()

    one_rank, two_ranks = claim_of_second_agent(1), claim_of_second_agent(2)
    assert two_ranks[0].shape[2] == 2  # all heads
    assert torch.equal(two_ranks[0], one_rank[0]) and torch.equal(two_ranks[1], one_rank[1])

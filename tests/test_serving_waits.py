"""Waiting for a record at concurrency (issue 51): a request of a task waits for an in-flight request's
record only when that record can give it the K/V of the span its claim stopped at. KVCMAS keeps an
output's source (its producer's cache) and a ``text_source="first"`` document's in the request's state,
not in the slot (it frees the slot's latest K/V after each record): such a slot is never "not recorded
yet" once its source exists, however many other turns reading it are open, so a reader is planned at
once with what exists instead of waiting for another reader's record, which adds nothing it reads
(:meth:`~hf_kvshare.method.Method.has_source`)."""

from __future__ import annotations

import importlib.util
import time
from types import SimpleNamespace

import pytest

from hf_kvshare import reasons
from hf_kvshare.serving import host as host_mod
from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.host import Sharing
from hf_kvshare.serving.standin import engine

HAS_VLLM = importlib.util.find_spec("vllm") is not None

DOC = "The river Lune reaches the sea at Plover Scar near Glasson. " * 3


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def layout(task, agent, segments):
    return {lay.KEY: {"task": task, "agent": agent, "segments": segments}}


def run(sharing, model, plan, tokens=4):
    """The engine runs ``plan`` and its K/V are recorded."""
    out, keys, values = engine(model, plan, max_new_tokens=tokens, min_new_tokens=tokens)
    sharing.record(plan, keys, values, out, set())
    assert plan.error is None
    return out


def producer_then_readers(model, tokenizer, read, **options):
    """Agent A reads a fresh document and answers (recorded); returns the sharing, A's plan and what a
    reader's prompt and segments are for ``read``: ``"output"`` (A's answer) or ``"doc"`` (the document)."""
    sharing = Sharing(model, tokenizer, "kvcmas", min_segment_tokens=4, **options)
    doc = [{"slot": "doc", "text": DOC}]
    pa = sharing.plan("a", ids_of(tokenizer, DOC) + ids_of(tokenizer, " Where?"), layout("t", "A", doc), 0)
    run(sharing, model, pa, tokens=12)
    host = pa.host
    if read == "output":
        body = host.slots["A"].token_ids.tolist()
        segments = [{"slot": "A", "start": 0, "end": len(body)}]
    else:
        body = ids_of(tokenizer, DOC)
        segments = [{"slot": "doc", "start": 0, "end": len(body)}]
    return sharing, host, body, segments


@pytest.mark.parametrize(
    ("read", "options"),
    [("output", {}), ("doc", {"text_source": "first"})],
    ids=["output-producer-source", "document-first-source"],
)
def test_kvcmas_reader_beside_an_open_reader_is_planned_with_its_source_not_told_to_wait(
    tiny_llama, tokenizer, read, options
):
    """A's output (its source: A's cache, kept in the request's state) or a ``text_source="first"``
    document (its first reader's): the slot's latest K/V are freed after the record, the source is not.
    C reads it (open, not recorded) and B reads it: B's plan says the method's own reason (its gate's),
    not "not recorded yet", the slot counts as recorded (nothing to wait for), and after C's record
    B's plan is the same: C's record adds nothing B reads (only C's own delta)."""
    sharing, host, body, segments = producer_then_readers(tiny_llama, tokenizer, read, **options)
    name = segments[0]["slot"]
    assert host.slots[name].latest is None  # freed after the record: the source lives elsewhere
    pc = sharing.plan("c", body + ids_of(tokenizer, " Why?"), layout("t", "C", segments), 0)
    b_prompt = body + ids_of(tokenizer, " How?")
    pb = sharing.plan("b", b_prompt, layout("t", "B", segments), 0)
    assert pb.error is None
    before = (pb.claimed, pb.unplaced.get(name), pb.claim_stop, [p is None for p in pb.placements])
    assert pb.unplaced.get(name) != host_mod.NOT_RECORDED_YET
    # C's open turn reads it, and nothing is pending: the source is there
    assert sharing.has_kv(host, name) and sharing.recorded(host, name)
    if pb.placements[0] is None:  # the gate refused: its reason, as the reply's report says it
        assert (
            pb.claim_stop["reason"]
            == pb.unplaced[name]
            == sharing.method.why_not_placed(pb.turn, pb.turn.spans[0])
        )
    sharing.release(pb)
    run(sharing, tiny_llama, pc)
    again = sharing.plan("b2", b_prompt, layout("t", "B", segments), 0)
    after = (again.claimed, again.unplaced.get(name), again.claim_stop, [p is None for p in again.placements])
    assert after == before


def test_kvcmas_reader_of_a_slot_an_open_turn_computes_first_still_waits_for_it(tiny_llama, tokenizer):
    """The wait that is worth it stays: C is the first to read a fresh document (open, not recorded; a
    chained source is its latest K/V, which C's record makes); B reading it meanwhile is told "not
    recorded yet", and after C's record B's plan has the document's source (placed or gated)."""
    sharing = Sharing(tiny_llama, tokenizer, "kvcmas", min_segment_tokens=4)
    body = ids_of(tokenizer, DOC)
    segments = [{"slot": "doc", "start": 0, "end": len(body)}]
    pc = sharing.plan("c", body + ids_of(tokenizer, " Why?"), layout("t", "C", segments), 0)
    assert pc.unplaced["doc"] == host_mod.NO_KV_KEPT
    b_prompt = body + ids_of(tokenizer, " How?")
    pb = sharing.plan("b", b_prompt, layout("t", "B", segments), 0)
    assert pb.unplaced["doc"] == host_mod.NOT_RECORDED_YET
    assert pb.claim_stop["reason"] == host_mod.NOT_RECORDED_YET and not sharing.recorded(pb.host, "doc")
    sharing.release(pb)
    run(sharing, tiny_llama, pc)
    assert sharing.has_kv(pc.host, "doc")
    again = sharing.plan("b2", b_prompt, layout("t", "B", segments), 0)
    assert again.unplaced.get("doc") not in (host_mod.NOT_RECORDED_YET, host_mod.NO_KV_KEPT)


def test_kvcmas_reader_of_an_output_whose_producer_cache_was_never_kept_does_not_wait(tiny_llama, tokenizer):
    """An output's producer cache is kept by its producer's record alone (``Method.readers_add_source``):
    where it was not kept (dropped here, as a record that could not keep it leaves it), no reader's
    record will add it, so B beside an open reader C is not told "not recorded yet" (a wait that ends
    only at its timeout) and the slot counts as recorded; the reason is that nothing is kept."""
    sharing, host, body, segments = producer_then_readers(tiny_llama, tokenizer, "output")
    sharing.method._requests.find(host).produced.pop("A")
    assert not sharing.has_kv(host, "A")
    pc = sharing.plan("c", body + ids_of(tokenizer, " Why?"), layout("t", "C", segments), 0)
    pb = sharing.plan("b", body + ids_of(tokenizer, " How?"), layout("t", "B", segments), 0)
    assert pb.error is None and pc.error is None
    assert pb.unplaced["A"] == host_mod.NO_KV_KEPT and sharing.recorded(host, "A")
    assert not sharing.method.readers_add_source(host, "A") and sharing.method.readers_add_source(host, "doc")


@pytest.mark.parametrize("method", ["fullshared", "nonshared"])
def test_a_method_that_reads_the_slots_latest_has_kv_as_before(tiny_llama, tokenizer, method):
    """The default hook: a slot has a source when it holds its latest K/V (FullShared's reads them;
    NonShared keeps none), as before."""
    sharing = Sharing(tiny_llama, tokenizer, method, min_segment_tokens=4)
    body = ids_of(tokenizer, DOC)
    segments = [{"slot": "doc", "start": 0, "end": len(body)}]
    pa = sharing.plan("a", body + ids_of(tokenizer, " Where?"), layout("t", "A", segments), 0)
    assert not sharing.has_kv(pa.host, "doc")
    run(sharing, tiny_llama, pa)
    held = pa.host.slots["doc"].latest is not None
    assert held is (method == "fullshared")
    assert sharing.has_kv(pa.host, "doc") is held
    assert not sharing.has_kv(pa.host, "no such slot") and not sharing.has_kv(None, "doc")


@pytest.mark.skipif(not HAS_VLLM, reason="the connector's sides import vLLM (.ci/run's serving venv)")
def test_the_connector_plans_a_kvcmas_reader_at_once_beside_another_reader_in_flight(tiny_llama, tokenizer):
    """The connector's scheduler side (no vLLM process): A's output recorded, C admitted reading it (in
    flight, not recorded), then B reading it is planned at once (no producer wait: C's record adds
    nothing B reads), its claim stopped by KVCMAS's gate with the gate's reason; on a slow engine (1 s
    a token) where waiting for a producer would otherwise look cheaper than computing."""
    from serving_stand_ins import admitted, announce_worker, vllm_request

    from hf_kvshare.serving.connector_common import Captured
    from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler

    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"read_back_channel": False, "producer_wait_s": 30.0}
        ),
        cache_config=SimpleNamespace(block_size=16),
    )
    sharing = Sharing(tiny_llama, tokenizer, "kvcmas", min_segment_tokens=4)
    scheduler = HFKVShareScheduler(config, sharing)

    def request(rid, agent, prompt, segments):
        return vllm_request(rid, prompt, layout("t", agent, segments), cache_salt=sharing.salt)

    def finish(req, blocks, tokens=2):
        out, keys, values = engine(tiny_llama, scheduler._plans[req.request_id], tokens, tokens)
        params = req.kv_transfer_params
        done = vllm_request(req.request_id, req.prompt_token_ids, params, out, cache_salt=sharing.salt)
        scheduler.request_finished(done, blocks)
        scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))
        scheduler.update_connector_output(
            SimpleNamespace(
                kv_connector_worker_meta=Captured(kv={req.request_id: (keys, values)}),
                finished_sending={req.request_id},
            )
        )

    worker_orders = announce_worker(scheduler)
    try:
        doc = ids_of(tokenizer, DOC)
        ra = request("ra", "A", doc + ids_of(tokenizer, " Where?"), [{"slot": "doc", "text": DOC}])
        scheduler.on_new_request(ra)
        admitted(scheduler, ra)
        finish(ra, [0, 1, 2, 3], tokens=12)
        scheduler._background.drain()
        body = sharing.hosts["t"].slots["A"].token_ids.tolist()
        reads = [{"slot": "A", "start": 0, "end": len(body)}]
        scheduler._seconds_per_token = 1.0  # a slow engine: waiting looks cheaper than computing
        rc = request("rc", "C", body + ids_of(tokenizer, " Why?"), reads)
        scheduler.on_new_request(rc)
        admitted(scheduler, rc)  # in flight from here: admitted, not finished
        rb = request("rb", "B", body + ids_of(tokenizer, " How?"), reads)
        scheduler.on_new_request(rb)
        deadline = time.monotonic() + 10
        claimed = None
        while claimed is None and time.monotonic() < deadline:
            claimed, _ = scheduler.get_num_new_matched_tokens(rb, 0)
            assert "rb" not in scheduler._producer_waits, (
                "B waits for C's record, which adds nothing it reads"
            )
            time.sleep(0.01)
        plan = scheduler._plans["rb"]
        assert claimed == plan.claimed and plan.producer_wait is None
        if plan.claim_stop is not None:  # stopped at A's output: the gate's reason, not "not recorded yet"
            assert plan.claim_stop["span"] == "A"
            assert plan.claim_stop["reason"] == plan.unplaced["A"] != host_mod.NOT_RECORDED_YET
            assert plan.report()["claim_stop"]["reason"] == plan.unplaced["A"]  # what the reply says
    finally:
        scheduler.shutdown()
        worker_orders.close()


def test_a_nonshared_reader_beside_an_open_reader_is_not_told_to_wait(tiny_llama, tokenizer):
    """NonShared places nothing (it reads no source): a reader of a slot another open turn reads is
    never "not recorded yet" (no record can give it anything), so the connector never holds it."""
    sharing = Sharing(tiny_llama, tokenizer, "nonshared", min_segment_tokens=4)
    body = ids_of(tokenizer, DOC)
    segments = [{"slot": "doc", "start": 0, "end": len(body)}]
    sharing.plan("c", body + ids_of(tokenizer, " Why?"), layout("t", "C", segments), 0)
    pb = sharing.plan("b", body + ids_of(tokenizer, " How?"), layout("t", "B", segments), 0)
    assert pb.error is None and pb.claimed == 0
    assert pb.unplaced.get("doc") == host_mod.METHOD_SHARES_NOTHING
    assert reasons.cause({"reason": pb.unplaced["doc"]})[0] == "method_off"
    assert pb.claim_stop is None or pb.claim_stop["reason"] != host_mod.NOT_RECORDED_YET

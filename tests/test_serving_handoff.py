"""The in-process handoff through both connector sides (one worker rank: vLLM's "uni" executor runs the
worker in the scheduler's process): a KVCMAS read-back reaches the scheduler's record by reference, the
record and the corrected claims behind it never write the worker's kept tensors, the summary counts
the slots' bytes shared with the worker's store and no read-back byte serialized; ``in_process: false``
serializes as before. The worker side needs vLLM's layer-name parser (the serving venv)."""

from __future__ import annotations

import importlib.util
import json
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("zmq")

from serving_stand_ins import admitted, stand_in_worker, vllm_request  # noqa: E402

from hf_kvshare.rope import RopeShifter  # noqa: E402
from hf_kvshare.serving import layout as lay  # noqa: E402

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="the worker side imports vLLM (.ci/run's serving venv)"
)
BLOCK = 16


def _report(path, request_id, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        for line in lines:
            if line["request_id"] == request_id:
                return line
        time.sleep(0.02)
    raise AssertionError(f"{request_id}'s report line never written")


def _turns(tokenizer, tasks=3):
    doc = tokenizer(
        "The river Lune reaches the sea at Plover Scar near Glasson. " * 4, add_special_tokens=False
    )["input_ids"]
    for task in range(tasks):
        for agent, question in (("a1", " Where?"), ("a2", " Why?")):
            head = tokenizer("You are " + agent + ".", add_special_tokens=False)["input_ids"]
            prompt = head + doc + tokenizer(question, add_special_tokens=False)["input_ids"]
            segments = [{"slot": "doc", "start": len(head), "end": len(head) + len(doc)}]
            yield (
                f"{task}{agent}",
                prompt,
                {lay.KEY: {"task": f"t{task}", "agent": agent, "segments": segments}},
            )


class _Sides:
    """The connector's scheduler and worker sides of one server in this process (KVCMAS on the tiny
    model; ``in_process``: the handoff's switch), past the worker's first step; :meth:`serve` runs one
    request through both as vLLM would (admission, the claim's load, the forward, the read-back and
    the record)."""

    def __init__(self, model, tokenizer, tmp_path, in_process: bool, **budgets):
        from hf_kvshare.serving.connector_common import Captured
        from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler
        from hf_kvshare.serving.host import Sharing

        self.model = model
        self.reports = tmp_path / "reports.jsonl"
        extra = {"report_path": str(self.reports), "device_store_bytes": 1 << 30, "in_process": in_process}
        config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
            cache_config=SimpleNamespace(block_size=BLOCK),
        )
        self.sharing = Sharing(
            model, tokenizer, "kvcmas", min_segment_tokens=4, tau=0.9, delta_rank=4, **budgets
        )
        self.scheduler = HFKVShareScheduler(config, self.sharing)
        c = model.config
        self.worker, self.names = stand_in_worker(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block=BLOCK, blocks=64, extra=extra
        )
        self.worker._shifter = RopeShifter.from_model(model)
        self.claims, self._next_block = 0, 0
        # the worker's first step: it connects the read-back channel and announces its order channel
        self.worker.start_load_kv(self.scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[])))
        first = self.worker.build_connector_worker_meta()
        self.scheduler.update_connector_output(
            SimpleNamespace(kv_connector_worker_meta=first, finished_sending=None)
        )
        assert isinstance(first, Captured) and self.worker.in_process is in_process
        assert self.scheduler.colocated is in_process

    def serve(self, rid, prompt, params, max_tokens=2):
        """One request through both sides; returns its output ids and the K/V the forward left."""
        from hf_kvshare.serving.standin import engine

        scheduler, worker, salt = self.scheduler, self.worker, self.sharing.salt
        request = vllm_request(rid, prompt, params, cache_salt=salt, max_tokens=max_tokens)
        scheduler.on_new_request(request)
        claimed = admitted(scheduler, request)
        plan = scheduler._plans[rid]
        blocks = list(range(self._next_block, self._next_block + -(-(len(prompt) + max_tokens) // BLOCK)))
        self._next_block += len(blocks)
        scheduler.update_state_after_alloc(request, None, claimed)
        scheduled = [SimpleNamespace(req_id=rid, block_ids=(blocks,))]
        meta = scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=scheduled))
        worker.start_load_kv(meta)  # the claim: kept rows re-positioned, corrected by the factors
        assert not worker.get_block_ids_with_load_errors()
        self.claims += bool(meta.loads)
        out, keys, values = engine(self.model, plan, max_new_tokens=max_tokens)
        for i, name in enumerate(self.names):  # what vLLM's forward leaves in the request's blocks
            worker._io[name].write(blocks, 0, keys[i], values[i])
        finished = vllm_request(rid, prompt, params, out, cache_salt=salt, max_tokens=max_tokens)
        assert scheduler.request_finished(finished, blocks)[0]
        assert _report(self.reports, rid)["read_back"] == "at finish"  # the order path: read, recorded
        scheduler._background.drain()  # and what its record left for later (anchors' factors)
        return out, keys, values

    def close(self):
        self.scheduler.shutdown()
        self.worker.shutdown()


@needs_vllm
@pytest.mark.parametrize("in_process", [True, False])
def test_kvcmas_records_and_corrected_claims_never_write_the_workers_handed_over_tensors(
    tiny_llama, tokenizer, tmp_path, in_process
):
    """KVCMAS agents through both connector sides in one process: each finished request is read back by
    the worker's order thread and recorded by the scheduler; with the handoff the record holds the very
    tensors the worker's store keeps (its slots' bytes ``shared_bytes``, 0 read-back bytes serialized),
    and no record or corrected claim changes a bit of them. Turned off, the same requests serialize."""
    sides = _Sides(tiny_llama, tokenizer, tmp_path, in_process)
    scheduler, worker = sides.scheduler, sides.worker
    snapshots: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        for rid, prompt, params in _turns(tokenizer):
            _, keys, values = sides.serve(rid, prompt, params)
            kept = worker.store.get(rid)  # read back exactly as written: the engine's K/V, before the record
            assert kept is not None and torch.equal(kept[0], keys) and torch.equal(kept[1], values)
            snapshots[rid] = (keys, values)
        assert sides.claims >= 2 and scheduler.load_bytes["factors"] > 0
        assert scheduler.load_bytes["corrected"] > 0
        scheduler._background.drain()  # every record and what it left for later has run
        for rid, (keys, values) in snapshots.items():  # not a bit of the kept tensors changed
            kept = worker.store.get(rid)
            assert torch.equal(kept[0], keys) and torch.equal(kept[1], values), rid
        summary = scheduler._summary()
        handoff, slots = summary["handoff"], summary["stores"]["slots"]
        assert handoff["enabled"] is in_process and handoff["colocated"] is in_process
        read_back = handoff["read_back"]
        assert read_back["in_process"] + read_back["serialized"] == len(snapshots)
        if in_process:
            assert read_back == {"in_process": len(snapshots), "serialized": 0, "serialized_bytes": 0}
            assert handoff["orders"]["serialized_bytes"] == 0 and handoff["orders"]["in_process"] > 0
            assert 0 < slots["shared_bytes"] <= slots["bytes"]
        else:
            assert read_back["in_process"] == 0 and read_back["serialized_bytes"] > 0
            assert handoff["orders"]["in_process"] == 0 and handoff["orders"]["serialized_bytes"] > 0
            assert slots["shared_bytes"] == 0
    finally:
        sides.close()


def test_the_handoff_switch_reaches_both_connector_sides(tmp_path, capsys):
    """``hf-kvshare serve --no-in-process`` / ``Server(in_process=False)`` writes ``in_process: false`` in
    the connector's ``kv_connector_extra_config`` (both sides read it); on by default."""
    from hf_kvshare.cli import serve
    from hf_kvshare.serving.server import Server

    def extra(server):
        command = server.command()
        return json.loads(command[command.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]

    assert extra(Server(tmp_path, "kvcmas", port=1))["in_process"] is True
    assert extra(Server(tmp_path, "kvcmas", port=1, in_process=False))["in_process"] is False
    with pytest.raises(TypeError, match="in_process must be True or False"):
        Server(tmp_path, "kvcmas", port=1, in_process="no")
    with pytest.raises(SystemExit):
        serve(["--help"])
    assert "--no-in-process" in capsys.readouterr().out


@needs_vllm
def test_a_record_keeps_views_of_what_the_worker_keeps_not_copies(tiny_llama, tokenizer, tmp_path):
    """KVCMAS agents that read the document and the earlier agents' outputs (examples/serve_agents.py's
    loop) after a long prompt of their own, handed over in-process: the document's K/V hold less than half
    of each read-back, which a record copies out (``Request.compact_views``), but not while the worker's
    store keeps that read-back (one copy: every byte of the slots is the worker's own; before: 0 of them);
    once the worker drops it the next compaction copies them out (the scheduler holds them alone)."""
    sides = _Sides(tiny_llama, tokenizer, tmp_path, in_process=True)
    sharing, mirror = sides.sharing, sides.scheduler.device_store

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    doc = encode("The river Lune reaches the sea at Plover Scar near Glasson. " * 3)
    try:
        outputs: list[tuple[str, list[int]]] = []
        for agent in ("a1", "a2", "a3"):
            prompt = encode(f"You are {agent}, one of three agents who write a guide together. " * 4)
            segments = [{"slot": "doc", "start": len(prompt), "end": len(prompt) + len(doc)}]
            prompt += doc
            for name, out in outputs:
                segments.append({"slot": name, "start": len(prompt), "end": len(prompt) + len(out)})
                prompt += out
            prompt += encode(" Go on.")
            params = {lay.KEY: {"task": "t", "agent": agent, "segments": segments, "output": agent}}
            sides.serve(agent, prompt, params, max_tokens=6)
            outputs.append((agent, sharing.hosts["t"].slots[agent].token_ids.tolist()))  # as recorded
        host = sharing.hosts["t"]
        held = [s for s in host.slots.values() if s.latest is not None]
        assert held, "the task's slots keep no K/V"
        slots = sides.scheduler._summary()["stores"]["slots"]
        assert slots["bytes"] > 0 and slots["shared_bytes"] == slots["bytes"]  # no second copy
        # the worker drops them all (the mirror evicted them): the next record copies the views out
        for rid in ("a1", "a2", "a3"):
            assert mirror.forget(rid)
            sharing.sources.forget(rid)
        host.compact_views()
        host.held = host.held_bytes()
        assert host.held < slots["bytes"]
        assert not any(sharing.sources.kept(t) for s in held for t in (*s.latest.keys, *s.latest.values))
    finally:
        sides.close()


@needs_vllm
def test_the_slots_budget_counts_what_the_worker_does_not_keep(tiny_llama, tokenizer, tmp_path):
    """Each byte under one budget: the slots' ``max_bytes`` bounds what they keep alive but the read-backs
    the worker's store keeps itself (``shared_bytes``, within ``device_store_bytes``). A budget smaller
    than one task's read-back views keeps every task while the worker holds them; once it drops them
    they count, and the next record's bound evicts the older tasks."""
    sides = _Sides(tiny_llama, tokenizer, tmp_path, in_process=True, max_bytes=30_000)
    sharing, mirror = sides.sharing, sides.scheduler.device_store
    try:
        served = []
        for rid, prompt, params in _turns(tokenizer, tasks=2):
            sides.serve(rid, prompt, params)
            served.append(rid)
        slots = sides.scheduler._summary()["stores"]["slots"]
        assert slots["bytes"] > slots["max_bytes"] and slots["shared_bytes"] == slots["bytes"]
        assert sharing.own_bytes() == 0 and len(sharing.hosts) == 2 and slots["evicted"] == 0
        for rid in served:  # the worker drops them (the mirror evicted them)
            assert mirror.forget(rid)
            sharing.sources.forget(rid)
        assert sharing.own_bytes() == slots["bytes"] > sharing.max_bytes  # counted now
        for rid, prompt, params in _turns(tokenizer, tasks=3):
            if rid.startswith("2"):  # a third task's record: the bound evicts the others
                sides.serve(rid, prompt, params)
        assert list(sharing.hosts) == ["t2"] and sharing.own_bytes() <= sharing.max_bytes
        assert sides.scheduler._summary()["stores"]["slots"]["evicted"] == 2
    finally:
        sides.close()

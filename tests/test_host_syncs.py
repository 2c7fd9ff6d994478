"""Host synchronisations on the hot path, counted on CPU.

``torch.cuda.set_sync_debug_mode`` only exists on CUDA; here every way a tensor's value reaches the
host (``.item()``, ``.tolist()``, ``int()``, ``float()``, ``bool()``) is counted while KVCMAS plans a
turn (matching + gate) and places its PH segments (token weights + correction), and while a cache is
re-positioned. On a GPU each of those calls is a device synchronisation. The budget: the gate's
decision is taken on the host, once per gated segment, and a recorded turn checks everything it
would store for NaN/inf in one read; nothing else syncs. Integer tensors are not counted: the ones
read here are token ids, which the tokenizer leaves on the host.
"""

from __future__ import annotations

from unittest import mock

import torch
from host_reads import HOST_READS, counting_host_reads
from kvcmas_workflow import QUERIES, run_forced, run_request

from hf_kvshare.cache import SegmentKV
from hf_kvshare.methods.kvcmas import KVCMAS
from hf_kvshare.rope import RopeShifter


def test_counting_sees_host_reads():
    """The counter is not vacuous: each kind of read is seen."""
    t = torch.tensor([1.5, 2.0])
    with counting_host_reads() as counts:
        t[0].item(), t.tolist(), int(t[1]), float(t[0]), bool(t[1])
        torch.tensor([3, 4]).tolist()  # integer tensors (token ids, on the host) are not counted
    assert counts == dict.fromkeys(HOST_READS, 1)


def test_kvcmas_matching_and_correction_sync_at_most_once_per_segment(tiny_llama, tokenizer):
    method = KVCMAS(tau=1.0)  # identical anchors: every gate accepts
    ref = run_request(tiny_llama, tokenizer, "nonshared", QUERIES[0])
    for _ in range(2):  # two requests fill the pools
        run_forced(tiny_llama, tokenizer, method, QUERIES[0], ref)

    per_turn, gated_slots = [], set()
    original_plan, original_place = method.scope.plan, method.scope.place

    def plan(turn):
        with counting_host_reads() as counts:
            original_plan(turn)
        # one decision per key: (slot, request), or per edge for a gated chained question (gate_chained)
        edges = turn.scratch[method.name].values()
        gated = {method.scope.decision_key(turn, e.slot) for e in edges if e.decision is not None}
        gated_slots.update(gated)
        per_turn.append({"plan": sum(counts.values()), "gated": len(gated), "place": 0, "corrected": 0})

    def place(turn, span, cache=None):
        _ = turn.shifter  # built once per session (reads the rotary layout), not per segment
        with counting_host_reads() as counts:
            placement = original_place(turn, span, cache)
        per_turn[-1]["place"] += sum(counts.values())
        per_turn[-1]["corrected"] += placement is not None and placement.provenance == "corrected"
        return placement

    original_record = method.record
    recorded = []

    def record(turn, cache):
        with counting_host_reads() as counts:
            original_record(turn, cache)
        recorded.append(sum(counts.values()))

    with (
        mock.patch.object(method.scope, "plan", plan),
        mock.patch.object(method.scope, "place", place),
        mock.patch.object(method, "record", record),
    ):
        run_forced(tiny_llama, tokenizer, method, QUERIES[0], ref)
    assert sum(t["corrected"] for t in per_turn) >= 3, per_turn  # the path under test ran
    assert len(gated_slots) >= 2, per_turn
    # a slot's gate runs once per request (when its producer's turn is recorded, or when planning):
    # one transfer per gate decision, whichever of the two takes it, plus one finiteness check of
    # everything a recorded turn would store (issue 13)
    budget = len(gated_slots) + len(recorded)
    assert sum(recorded) + sum(t["plan"] for t in per_turn) <= budget, (recorded, per_turn)
    for t in per_turn:
        assert t["place"] == 0, per_turn  # token weights and correction stay on the device


def test_repositioning_a_cache_does_not_read_device_values(tiny_llama):
    shifter = RopeShifter.from_model(tiny_llama)
    cfg = tiny_llama.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = SegmentKV(
        keys=[torch.randn(1, cfg.num_key_value_heads, 7, head_dim) for _ in range(cfg.num_hidden_layers)],
        values=[torch.randn(1, cfg.num_key_value_heads, 7, head_dim) for _ in range(cfg.num_hidden_layers)],
        start=3,
    )
    with counting_host_reads() as counts:
        moved = kv.repositioned(shifter, 11)
    # integer positions are checked as Python ints; the keys are never read back
    assert sum(counts.values()) == 0, counts
    assert torch.allclose(moved.repositioned(shifter, 3).keys[1], kv.keys[1], atol=1e-5)

"""KVCMAS's verification probe (``verify_tokens``): a correction is placed only when the exact K/V of
the span's last tokens, computed over the agent's prefix and the corrected span, say it is close.

- the probe is exact: where the context is the dense one, its tokens' K/V are the dense K/V;
- a constructed good correction is accepted, a constructed bad one rejected;
- in a workflow: a rejected probe prefills its span (cause ``verify_failed``, the probe's tokens
  counted as prefilled, its exact delta learned); an accepted one places the span with the probe's
  tokens recomputed; a span the gate rejected may be placed when its probe accepts;
- off under both profiles (the reference's decisions unchanged: ``test_kvcmas_gate.py``), refused
  where it cannot run (edge scope, whole-turn fallback, the server).
"""

from __future__ import annotations

import pytest
import torch
from documents_workflow import AGENTS, run_workflow
from tiny import roles

from hf_kvshare import Session, reasons
from hf_kvshare.anchors.verify import (
    NEGLIGIBLE,
    covers_span,
    probe_rows,
    verify_correction,
    whole_span_reason,
)
from hf_kvshare.cache import SegmentKV
from hf_kvshare.methods.kvcmas import KVCMAS, PROFILES
from hf_kvshare.methods.kvcomm import KVComm
from hf_kvshare.recompute import DecoderStack
from hf_kvshare.serving.host import ServingError, check_serving_method


def _dense_segment(model, tokenizer):
    """A NonShared cache of a prompt, its ``query`` segment's exact K/V and ids."""
    cache, ids = Session(model, tokenizer, "nonshared").build_cache("a", roles("a"))
    seg = cache.segment("query")
    return cache, cache.extract(seg.start, seg.end), ids[0, seg.start : seg.end]


def _moved(exact: SegmentKV, noise: SegmentKV, scale: float) -> SegmentKV:
    """``exact + scale * noise`` (layer 0 too: the probe compares layers 1 on)."""
    return SegmentKV(
        keys=[k + scale * n for k, n in zip(exact.keys, noise.keys)],
        values=[v + scale * n for v, n in zip(exact.values, noise.values)],
        start=exact.start,
    )


def _noise(exact: SegmentKV, seed: int = 0) -> SegmentKV:
    gen = torch.Generator().manual_seed(seed)

    def like(t):
        return torch.randn(t.shape, generator=gen, dtype=t.dtype) * t.std()

    return SegmentKV(
        keys=[like(k) for k in exact.keys], values=[like(v) for v in exact.values], start=exact.start
    )


@pytest.mark.parametrize("place", ["last", "spread"])
def test_probe_tokens_equal_the_dense_kv_when_the_context_is_dense(tiny, tokenizer, place):
    cache, exact, ids = _dense_segment(tiny, tokenizer)
    stack = DecoderStack(tiny)
    source = _moved(exact, _noise(exact), 0.5)  # an uncorrected source with an error of its own
    probe = verify_correction(
        stack, cache, exact, source, ids, exact.start, stack.shifter, tokens=4, place=place
    )
    assert probe.tokens == 4 and probe.error < 1e-5 and probe.uncorrected > 0.1
    assert probe.accepts(0.7) and probe.ratio < 1e-4
    rows = probe_rows(exact.length, 4, place=place)
    assert list(probe.rows) == rows.tolist()
    for layer in range(stack.num_layers):  # the probe's rows hold its exact K/V: the dense ones
        assert torch.allclose(probe.kv.keys[layer][..., rows, :], exact.keys[layer][..., rows, :], atol=1e-5)
        assert torch.allclose(
            probe.kv.values[layer][..., rows, :], exact.values[layer][..., rows, :], atol=1e-5
        )
    assert probe_rows(3, 8).tolist() == [0, 1, 2] and probe_rows(5, 0).numel() == 0
    assert probe_rows(10, 4, place="spread").tolist() == [0, 3, 6, 9]
    assert probe_rows(10, 3).tolist() == [7, 8, 9] and probe_rows(10, 1, place="spread").tolist() == [9]


def test_a_good_correction_is_accepted_and_a_bad_one_rejected(tiny_llama, tokenizer):
    cache, exact, ids = _dense_segment(tiny_llama, tokenizer)
    stack = DecoderStack(tiny_llama)
    noise = _noise(exact, seed=1)
    source = _moved(exact, noise, 1.0)  # the uncorrected source
    good = _moved(exact, noise, 0.1)  # removes 90 % of the source's error
    bad = _moved(exact, _noise(exact, seed=2), 2.0)  # twice the source's error, elsewhere

    def probe(corrected):
        return verify_correction(stack, cache, corrected, source, ids, exact.start, stack.shifter, tokens=4)

    accepted, rejected = probe(good), probe(bad)
    assert accepted.ratio < 0.3 and accepted.accepts(0.7), accepted.report(0.7)
    assert rejected.ratio > 1.0 and not rejected.accepts(0.7), rejected.report(0.7)
    assert accepted.error > NEGLIGIBLE  # accepted by the ratio, not as negligible
    assert "verification probe rejected" in rejected.reason(0.7)
    assert reasons.cause_of_reason(rejected.reason(0.7)) == "verify_failed"


def _verified(results):
    return [(r, s) for r in results for s in r.cache.segments if s.kind == "PH" and "verify" in s.info]


def test_a_rejected_probe_prefills_its_span_and_counts_its_tokens(tiny_llama, tokenizer):
    # 3 probe tokens: fewer than every span's (a probe as long as its span is not run: verify_whole)
    method = KVCMAS(verify_tokens=3, verify_threshold=1e-9)  # every probe above NEGLIGIBLE rejects
    results = run_workflow(tiny_llama, tokenizer, method, requests=3)
    probed = _verified(results)
    assert probed, "no span was probed"
    for _, seg in probed:
        assert seg.provenance == "dense" and seg.info["gate"] == "fallback"
        assert seg.info["verify"]["accepted"] is False and seg.info["verify"]["tokens"] == 3
        assert reasons.cause(seg.info)[0] == "verify_failed"
    # the probe's tokens count as prefilled: with 1 probe token every decision is the same (every
    # probe rejects, the same spans prefill, the same deltas are learned), 2 tokens fewer per probe
    shorter = run_workflow(tiny_llama, tokenizer, KVCMAS(verify_tokens=1, verify_threshold=1e-9), requests=3)
    for got, ref in zip(results, shorter):
        spans = sum(1 for s in got.cache.segments if s.kind == "PH" and "verify" in s.info)
        assert [s.provenance for s in got.cache.segments] == [s.provenance for s in ref.cache.segments]
        assert got.tokens_prefilled == ref.tokens_prefilled + 2 * spans
    # a rejected probe's exact delta feeds the pool (the slot's anchor of the request holds this agent's)
    assert any(AGENTS[1] in a.deltas for a in method.pools["note0"].anchors)


def test_an_accepted_probe_places_the_span_with_its_tokens_recomputed(tiny_llama, tokenizer):
    method = KVCMAS(verify_tokens=4, verify_threshold=100.0)  # every probe accepts
    results = run_workflow(tiny_llama, tokenizer, method, requests=3)
    probed = _verified(results)
    assert probed and all(s.provenance == "corrected" and s.info["verify"]["accepted"] for _, s in probed)
    for r in results:
        spans = [s for s in r.cache.segments if s.kind == "PH" and "verify" in s.info]
        assert r.tokens_recomputed == pytest.approx(sum(s.info["verify"]["tokens"] for s in spans))
    # spans the gate rejected (one anchor, entropy, ...) are placed when their probe accepts
    overturned = [s for _, s in probed if "the gate rejected" in s.info.get("reason", "")]
    assert overturned and all(s.info["gate"] == "accepted" for s in overturned)
    without = run_workflow(tiny_llama, tokenizer, KVCMAS(), requests=3)
    assert sum(r.tokens_corrected for r in results) > sum(r.tokens_corrected for r in without)


def test_verify_is_off_in_both_profiles_and_checked():
    assert PROFILES["reuse"]["verify_tokens"] == 0 and PROFILES["reference"]["verify_tokens"] == 0
    assert KVCMAS().verify_tokens == 0 and KVCMAS(profile="reference").verify_tokens == 0
    assert KVComm().verify_tokens == 0
    assert not KVCMAS().reads_prefix and KVCMAS(verify_tokens=8).reads_prefix
    assert not KVCMAS(verify_tokens=8).supports_batch
    with pytest.raises(ValueError, match="verify_tokens must be an int >= 0"):
        KVCMAS(verify_tokens=-1)
    with pytest.raises(ValueError, match="verify_tokens must be an int >= 0"):
        KVCMAS(verify_tokens=True)
    with pytest.raises(ValueError, match="verify_threshold must be a finite real number > 0"):
        KVCMAS(verify_tokens=8, verify_threshold=0)
    with pytest.raises(ValueError, match="turn_fallback='span'"):
        KVCMAS(profile="reference", verify_tokens=8)
    with pytest.raises(ValueError, match="gate_scope='slot'"):
        KVCMAS(gate_scope="edge", verify_tokens=8)
    assert KVCMAS(profile="reference", turn_fallback="span", verify_tokens=8).verify_tokens == 8


def test_the_server_refuses_a_probe_with_its_reason():
    method = KVCMAS(verify_tokens=8, observation_source="question")
    with pytest.raises(ServingError, match="verify_tokens=8 .* the scheduler cannot run the model"):
        check_serving_method(method)
    check_serving_method(KVCMAS(observation_source="question"))  # off: served as before


def test_tau_zero_with_a_probe_stays_nonshared(tiny_llama, tokenizer):
    """Nothing placed, nothing probed: the same tokens as NonShared (the dense text is computed span by
    span before each PH span, ``reads_prefix``, which leaves the outputs as they were)."""
    got = run_workflow(tiny_llama, tokenizer, KVCMAS(verify_tokens=4, tau=0.0), requests=2)
    ref = run_workflow(tiny_llama, tokenizer, "nonshared", requests=2)
    assert [r.output_ids.tolist() for r in got] == [r.output_ids.tolist() for r in ref]
    assert not _verified(got) and all(r.tokens_reused == 0 for r in got)


def test_the_probe_error_is_measured_against_the_source_or_the_exact_kv():
    """``verify_scale="source"``: the correction must remove enough of the uncorrected source's error;
    ``"exact"``: it must be close to the exact K/V, however close the source already was."""
    from hf_kvshare.anchors.verify import Probe

    close = Probe(kv=None, tokens=4, error=0.045, uncorrected=0.040)  # the source nearly exact: no gain
    far = Probe(kv=None, tokens=4, error=0.20, uncorrected=0.60)  # a third of a large error left
    assert not close.accepts(0.7) and close.accepts(0.1, "exact")
    assert far.accepts(0.7) and not far.accepts(0.1, "exact")
    assert "of the exact K/V's size" in close.reason(0.1, "exact")
    assert reasons.cause_of_reason(close.reason(0.1, "exact")) == "verify_failed"
    assert close.report(0.1, "exact")["scale"] == "exact"
    with pytest.raises(ValueError, match="verify_scale must be one of 'source', 'exact'"):
        KVCMAS(verify_tokens=8, verify_scale="size")


def test_a_spread_probe_counts_its_tokens_out_of_the_corrected_rows(tiny_llama, tokenizer):
    method = KVCMAS(verify_tokens=3, verify_threshold=100.0, verify_rows="spread")
    results = run_workflow(tiny_llama, tokenizer, method, requests=3)
    probed = [s for r in results for s in r.cache.segments if s.kind == "PH" and "verify" in s.info]
    assert probed and all(s.provenance == "corrected" for s in probed)
    for r in results:
        spans = [s for s in r.cache.segments if s.kind == "PH" and "verify" in s.info]
        assert r.tokens_recomputed == pytest.approx(sum(s.info["verify"]["tokens"] for s in spans))
        assert r.tokens_corrected + r.tokens_recomputed <= r.ph_tokens
    with pytest.raises(ValueError, match="verify_rows must be one of 'last', 'spread'"):
        KVCMAS(verify_tokens=8, verify_rows="first")


def test_a_probe_as_long_as_its_span_prefills_the_span_instead_of_reporting_it_corrected(
    tiny_llama, tokenizer
):
    """A probe of ``verify_tokens >=`` the span's length would compute every row of it, a prefill: the
    span is prefilled (cause ``verify_whole``), its tokens counted as prefilled, none shared, recomputed
    or corrected, and nothing probed; a span the gate rejected keeps the gate's cause."""
    results = run_workflow(tiny_llama, tokenizer, KVCMAS(verify_tokens=10_000, verify_threshold=100.0), 3)
    assert not _verified(results)  # before: every such span probed whole, then reported as corrected
    whole, gated = 0, set()
    for r in results:
        spans = [s for s in r.cache.segments if s.kind == "PH" and s.provenance == "dense"]
        causes = [reasons.cause(s.info)[0] for s in spans]
        gated |= set(causes)
        assert all(s.info["gate"] == "fallback" for s, c in zip(spans, causes) if c == "verify_whole")
        assert r.tokens_corrected == 0 and r.tokens_recomputed == 0 and r.tokens_reused == 0
        tokens = sum(s.length for s, c in zip(spans, causes) if c == "verify_whole")
        assert r.not_shared().get("verify_whole", {}).get("tokens", 0) == tokens
        assert r.ph_prefilled == r.ph_tokens  # counted as prefilled, not shared
        whole += tokens
    assert whole > 0 and {"length_rule", "no_anchors"} & gated  # the gate's rejections keep their cause
    assert reasons.cause_of_reason(whole_span_reason(10_000, 12)) == "verify_whole"
    assert covers_span(12, 12) and not covers_span(11, 12)

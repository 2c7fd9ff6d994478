"""Selective recomputation (CacheBlend, DroidSpeak, RelayCaching) on tiny random models.

- rho = 0 reproduces NonShared token for token (and its K/V), rho = 1 equals FullShared;
- recomputing from an exact reused cache gives the dense cache (the layer-by-layer machinery is exact);
- the criteria pick the entries carrying hand-made deviations;
- recomputed entries equal the dense cache where the paper's Eq. 3 says they should.
"""

from __future__ import annotations

import pytest
import torch
from tiny import STEPS, roles, tiny_model

from hf_kvshare import METHODS, PF, SegmentKV, Session
from hf_kvshare.evaluation.metrics import kv_error
from hf_kvshare.methods import CacheBlend, DroidSpeak, RelayCaching
from hf_kvshare.recompute import DecoderStack, SegmentRecompute

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


_REFERENCES: dict = {}


def run(model, tokenizer, method, steps=STEPS, forced=None, n=6):
    """Run ``steps`` in a new session; NonShared/FullShared runs of the default steps are memoized
    (they are only read)."""
    key = None
    if isinstance(method, str) and steps is STEPS:
        key = (id(model), method, None if forced is None else tuple(tuple(f.tolist()) for f in forced), n)
        if key in _REFERENCES:
            return _REFERENCES[key][1]
    result = _run(model, tokenizer, method, steps, forced, n)
    if key is not None:
        _REFERENCES[key] = (model, result)  # holding the model keeps its id from being reused
    return result


def _run(model, tokenizer, method, steps, forced, n):
    session = Session(model, tokenizer, method)
    out = []
    for i, (agent, segments) in enumerate(steps):
        force = None if forced is None else forced[i]
        out.append(session.run_turn(agent, segments, max_new_tokens=n, force_output=force, keep_cache=True))
    return session, out


def ph_segments(turn):
    return [s for s in turn.cache.segments if s.kind == "PH"]


def all_methods(rho: float, num_layers: int):
    """One instance of each method at ``rho`` for a model with ``num_layers`` layers (band from layer 1)."""
    profile = [float(i % 3) for i in range(num_layers)]
    return [
        CacheBlend(rho=rho),
        DroidSpeak(rho=rho, layer_profile=profile),
        RelayCaching(rho=rho, band=(1 / num_layers, 1.0)),
    ]


def test_registered():
    assert {"cacheblend", "droidspeak", "relaycaching"} <= set(METHODS)
    assert METHODS["cacheblend"] is CacheBlend


# ------------------------------------------------------------------ rho extremes
@pytest.mark.parametrize("index", [0, 1, 2], ids=["cacheblend", "droidspeak", "relaycaching"])
def test_rho_zero_reproduces_nonshared(tiny, tokenizer, index):
    method = all_methods(0.0, tiny.config.num_hidden_layers)[index]
    _, ref = run(tiny, tokenizer, "nonshared")
    _, got = run(tiny, tokenizer, method)
    for r, g in zip(ref, got):
        assert g.output_ids.tolist() == r.output_ids.tolist()
        assert g.reuse_ratio == 0.0
        for seg in ph_segments(g):
            assert kv_error(g.cache, r.cache, seg.start, seg.end) < 1e-5
    placed = [s for t in got for s in ph_segments(t) if s.provenance == "recomputed"]
    assert len(placed) == 5  # every PH read after its first materialization went through the machinery


@pytest.mark.parametrize("index", [0, 1, 2], ids=["cacheblend", "droidspeak", "relaycaching"])
def test_rho_one_equals_fullshared(tiny, tokenizer, index):
    method = all_methods(1.0, tiny.config.num_hidden_layers)[index]
    _, ref = run(tiny, tokenizer, "fullshared")
    _, got = run(tiny, tokenizer, method)
    for r, g in zip(ref, got):
        assert g.output_ids.tolist() == r.output_ids.tolist()
        assert g.reuse_ratio == r.reuse_ratio
        assert [s.provenance for s in g.cache.segments] == [s.provenance for s in r.cache.segments]
        P = g.prompt_ids.numel() - 1
        for layer in range(g.cache.num_layers):
            for a, b in zip(g.cache.layer_kv(layer), r.cache.layer_kv(layer)):
                # equal up to fp32 rounding: dense prefixes are prefilled in differently sized chunks
                assert torch.allclose(a[..., :P, :], b[..., :P, :], atol=1e-5)


def test_llama3_rope_scaling_rho_zero_exact(tokenizer):
    model = tiny_model("llama", rope_parameters=LLAMA3)
    _, ref = run(model, tokenizer, "nonshared")
    for method in all_methods(0.0, model.config.num_hidden_layers):
        _, got = run(model, tokenizer, method)
        for r, g in zip(ref, got):
            assert g.output_ids.tolist() == r.output_ids.tolist()
            for seg in ph_segments(g):
                assert kv_error(g.cache, r.cache, seg.start, seg.end) < 1e-5


def test_eager_attention_rho_zero_exact(tokenizer):
    model = tiny_model("qwen2", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    _, ref = run(model, tokenizer, "nonshared")
    _, got = run(model, tokenizer, CacheBlend(rho=0.0))
    for r, g in zip(ref, got):
        assert g.output_ids.tolist() == r.output_ids.tolist()


# ------------------------------------------------------------------ intermediate rho
@pytest.mark.parametrize("index", [0, 1, 2], ids=["cacheblend", "droidspeak", "relaycaching"])
def test_partial_recompute_reports_rho_and_lies_between(tiny, tokenizer, index):
    L = tiny.config.num_hidden_layers
    method = all_methods(0.5, L)[index]
    _, exact = run(tiny, tokenizer, "nonshared")
    forced = [t.output_ids for t in exact]
    _, full = run(tiny, tokenizer, "fullshared", forced=forced)
    _, got = run(tiny, tokenizer, method, forced=forced)
    for seg in ph_segments(got[2]):
        assert seg.provenance == "recomputed" and 0.0 < seg.info["rho"] < 1.0
    assert 0.0 < got[2].reuse_ratio < 1.0
    err = [kv_error(got[2].cache, exact[2].cache, s.start, s.end) for s in ph_segments(got[2])]
    base = [kv_error(full[2].cache, exact[2].cache, s.start, s.end) for s in ph_segments(full[2])]
    assert sum(err) < sum(base)  # recomputing half the entries removes part of the reuse error


def test_reuse_ratio_counts_entries(tiny_llama, tokenizer):
    L = tiny_llama.config.num_hidden_layers  # 3
    _, got = run(tiny_llama, tokenizer, DroidSpeak(rho=0.7, layer_profile=[0.0, 2.0, 1.0]))
    # round(0.3 * 3) = 1 layer recomputed of 3: 2/3 of every reused segment's entries are reused
    third = got[2]
    for seg in ph_segments(third):
        assert seg.info["layer_groups"] == "1-1"
        assert seg.info["rho"] == pytest.approx(2 / 3)
    assert third.tokens_reused == pytest.approx(third.ph_tokens * 2 / 3)
    assert third.reuse_ratio == pytest.approx(2 / 3)
    assert L == 3


# ------------------------------------------------------------------ exactness of the machinery
def exact_source_session(model, tokenizer, method):
    """A session where the query's reused cache is exact: the same agent reads it again with the same prefix."""
    session = Session(model, tokenizer, method)
    session.run_turn("a", roles("a"), max_new_tokens=3)
    return session


def dense_reference(model, tokenizer, n=3):
    session = Session(model, tokenizer, "nonshared")
    session.run_turn("a", roles("a"), max_new_tokens=n)
    return session


def second_turn(session, forced):
    return session.run_turn("a", roles("a") + [PF("\nAgain.")], force_output=forced, keep_cache=True)


def perturb(session, slot, layer, rows, scale, which="keys"):
    kv = session.slots[slot].latest
    tensors = kv.keys if which == "keys" else kv.values
    tensors[layer] = tensors[layer].clone()
    noise = torch.randn(tensors[layer][..., rows, :].shape, generator=torch.Generator().manual_seed(1))
    tensors[layer][..., rows, :] += scale * noise


def reference_second(model, tokenizer, forced):
    return dense_reference(model, tokenizer).run_turn(
        "a", roles("a") + [PF("\nAgain.")], force_output=forced, keep_cache=True
    )


def segment_kv(turn, name, layer):
    seg = turn.cache.segment(name)
    k, v = turn.cache.layer_kv(layer)
    return k[..., seg.start : seg.end, :], v[..., seg.start : seg.end, :]


def test_cacheblend_repairs_the_tokens_it_selects(tiny, tokenizer):
    forced = torch.tensor([11, 12, 13])
    ref = reference_second(tiny, tokenizer, forced)
    S = ref.cache.segment("query").length
    # two tokens perturbed at the check layer, one strongly, one weakly; budget: one token
    method = CacheBlend(rho=1 - 1 / S)
    session = exact_source_session(tiny, tokenizer, method)
    perturb(session, "query", 1, [3], 5.0)
    perturb(session, "query", 1, [7], 0.5)
    got = second_turn(session, forced)
    assert got.cache.segment("query").info["recomputed_tokens"] == 1
    for layer in range(tiny.config.num_hidden_layers):
        (k, v), (ek, ev) = segment_kv(got, "query", layer), segment_kv(ref, "query", layer)
        rows = [r for r in range(S) if not (layer == 1 and r == 7)]
        assert torch.allclose(k[..., rows, :], ek[..., rows, :], atol=1e-5)  # token 3 repaired
        assert torch.allclose(v, ev, atol=1e-5)
    k, _ = segment_kv(got, "query", 1)
    ek, _ = segment_kv(ref, "query", 1)
    assert (k[..., 7, :] - ek[..., 7, :]).abs().max() > 0.1  # token 7 was not selected: still perturbed


def test_cacheblend_two_check_layers_narrow_candidates(tiny, tokenizer):
    forced = torch.tensor([11, 12, 13])
    ref = reference_second(tiny, tokenizer, forced)
    S = ref.cache.segment("query").length
    method = CacheBlend(rho=1 - 2 / S, check_layers=(1, 2))
    session = exact_source_session(tiny, tokenizer, method)
    perturb(session, "query", 1, [2, 5, 9], 3.0, which="values")  # first check: keeps >= 3 candidates
    perturb(session, "query", 2, [5, 9], 3.0, which="values")  # second check: keeps these two
    got = second_turn(session, forced)
    assert got.cache.segment("query").info["recomputed_tokens"] == 2
    _, v1 = segment_kv(got, "query", 1)
    _, e1 = segment_kv(ref, "query", 1)
    assert torch.allclose(v1[..., [5, 9], :], e1[..., [5, 9], :], atol=1e-5)
    assert (v1[..., 2, :] - e1[..., 2, :]).abs().max() > 0.1  # dropped at the second check: reused
    for layer in (0, 2):
        _, v = segment_kv(got, "query", layer)
        _, e = segment_kv(ref, "query", layer)
        assert torch.allclose(v, e, atol=1e-5)


def test_droidspeak_recomputes_profiled_layers_from_kept_hidden_states(tiny, tokenizer):
    forced = torch.tensor([11, 12, 13])
    ref = reference_second(tiny, tokenizer, forced)
    method = DroidSpeak(rho=0.7, layer_profile=[0.0, 0.1, 1.0])  # one layer: layer 2
    session = exact_source_session(tiny, tokenizer, method)
    perturb(session, "query", 2, slice(None), 2.0)
    perturb(session, "query", 1, slice(None), 2.0, which="values")
    got = second_turn(session, forced)
    assert got.cache.segment("query").info["layer_groups"] == "2-2"
    k2, v2 = segment_kv(got, "query", 2)
    e2k, e2v = segment_kv(ref, "query", 2)
    # layer 2 restarted from the hidden state kept with the (exact) source: exact again
    assert torch.allclose(k2, e2k, atol=1e-5) and torch.allclose(v2, e2v, atol=1e-5)
    _, v1 = segment_kv(got, "query", 1)
    _, e1 = segment_kv(ref, "query", 1)
    assert (v1 - e1).abs().max() > 0.1  # layer 1 reused as is


def test_relaycaching_selects_deviating_tokens_in_its_band(tiny, tokenizer):
    forced = torch.tensor([11, 12, 13])
    ref = reference_second(tiny, tokenizer, forced)
    S = ref.cache.segment("query").length
    L = tiny.config.num_hidden_layers
    method = RelayCaching(rho=1 - 2 * 2 / (S * L), band=(1 / 3, 1.0))  # band [1, 3): 2 tokens
    assert method.recompute_plan(S, L) == (1, 3, 2)
    session = exact_source_session(tiny, tokenizer, method)
    perturb(session, "query", 2, [4, 10], 3.0)  # check layer = band start + 1 = 2
    perturb(session, "query", 0, [6], 3.0)  # below the band: never repaired
    got = second_turn(session, forced)
    info = got.cache.segment("query").info
    assert info["band"] == "1-2" and info["recomputed_tokens"] == 2
    for layer in (1, 2):
        k, v = segment_kv(got, "query", layer)
        ek, ev = segment_kv(ref, "query", layer)
        assert torch.allclose(k, ek, atol=1e-5) and torch.allclose(v, ev, atol=1e-5)
    k0, _ = segment_kv(got, "query", 0)
    e0, _ = segment_kv(ref, "query", 0)
    assert (k0[..., 6, :] - e0[..., 6, :]).abs().max() > 0.1


# ------------------------------------------------------------------ Eq. 3 with real deviations
def reused_from(session, previous, name, turn):
    """What ``turn`` reused for slot ``name``: ``previous`` turn's K/V of it, moved to ``turn``'s positions,
    cut to the rows ``turn``'s cache holds (a PH segment ending the prompt leaves its last token to generate)."""
    start = (
        previous.prompt_ids.numel() if name == previous.output_slot else previous.cache.segment(name).start
    )
    kv = previous.cache.extract(start, start + session.slots[name].token_ids.numel())
    segment = turn.cache.segment(name)
    return kv.repositioned(session.shifter, segment.start).prefix(segment.length)


def test_cacheblend_selected_tokens_equal_dense_up_to_the_check_layer(tiny, tokenizer):
    _, exact = run(tiny, tokenizer, "nonshared")
    forced = [t.output_ids for t in exact]
    session, got = run(tiny, tokenizer, CacheBlend(rho=0.5), forced=forced)
    L = tiny.config.num_hidden_layers
    turn = got[1]  # reads "query" and "first", both materialized by the first turn
    for name in ("query", "first"):
        source = reused_from(session, got[0], name, turn)
        k_last, _ = segment_kv(turn, name, L - 1)
        changed = ((k_last - source.keys[L - 1]).abs().amax(dim=(0, 1, 3)) > 0).nonzero().flatten()
        S = source.length
        recomputed = turn.cache.segment(name).info["recomputed_tokens"]
        assert recomputed == round(0.5 * session.slots[name].token_ids.numel())
        # a segment ending the prompt may have had its last (generate-fed) token selected
        assert changed.numel() in (recomputed, recomputed - 1)
        untouched = [t for t in range(S) if t not in changed.tolist()]
        for layer in range(L):
            k, v = segment_kv(turn, name, layer)
            assert torch.equal(k[..., untouched, :], source.keys[layer][..., untouched, :])  # reused as is
            assert torch.equal(v[..., untouched, :], source.values[layer][..., untouched, :])
            if layer <= 1:
                # layer-0 K/V do not depend on the context, so the inputs of layers 0 and 1 are exact:
                # the selected tokens' K/V equal the dense cache's up to the check layer
                ek, ev = segment_kv(exact[1], name, layer)
                assert torch.allclose(k[..., changed, :], ek[..., changed, :], atol=1e-5)
                assert torch.allclose(v[..., changed, :], ev[..., changed, :], atol=1e-5)


def test_droidspeak_group_from_layer_zero_equals_dense(tiny, tokenizer):
    _, exact = run(tiny, tokenizer, "nonshared")
    forced = [t.output_ids for t in exact]
    method = DroidSpeak(rho=0.4, layer_profile=[3.0, 2.0, 0.0])  # 2 layers: 0-1, from the embeddings
    session, got = run(tiny, tokenizer, method, forced=forced)
    for name in ("query", "first", "second"):
        assert got[2].cache.segment(name).info["layer_groups"] == "0-1"
        for layer in (0, 1):
            for a, b in zip(segment_kv(got[2], name, layer), segment_kv(exact[2], name, layer)):
                assert torch.allclose(a, b, atol=1e-5)
        source = reused_from(session, got[1], name, got[2])
        k, v = segment_kv(got[2], name, 2)
        assert torch.equal(k, source.keys[2]) and torch.equal(v, source.values[2])


# ------------------------------------------------------------------ engine
def test_engine_recomputes_any_subset_exactly(tiny, tokenizer):
    cache, ids = Session(tiny, tokenizer, "nonshared").build_cache("a", roles("a"))
    seg = cache.segment("query")
    exact = cache.extract(seg.start, seg.end)
    rows = torch.tensor([0, 3, 4, 9])
    # the reused K/V: exact, except garbage in the rows to recompute (every layer)
    keys, values = [k.clone() for k in exact.keys], [v.clone() for v in exact.values]
    for k, v in zip(keys, values):
        k[..., rows, :] = torch.randn_like(k[..., rows, :])
        v[..., rows, :] = torch.randn_like(v[..., rows, :])
    reused = SegmentKV(keys=keys, values=values, start=exact.start)
    stack = DecoderStack(tiny)
    engine = SegmentRecompute(stack, cache, reused, ids[0, seg.start : seg.end])
    hidden = engine.embeddings()[:, rows]
    for layer in range(stack.num_layers):
        hidden, rows = engine.run_layer(layer, hidden, rows)
    new, entries = engine.result()
    assert entries == 4 * stack.num_layers
    for layer in range(stack.num_layers):
        assert torch.allclose(new.keys[layer], exact.keys[layer], atol=1e-5)
        assert torch.allclose(new.values[layer], exact.values[layer], atol=1e-5)
    assert not torch.allclose(reused.keys[1], exact.keys[1])  # the input K/V were left untouched


def test_engine_input_errors(tiny_llama, tokenizer):
    cache, ids = Session(tiny_llama, tokenizer).build_cache("a", roles("a"))
    seg = cache.segment("query")
    kv = cache.extract(seg.start, seg.end)
    stack = DecoderStack(tiny_llama)
    with pytest.raises(ValueError, match="token ids"):
        SegmentRecompute(stack, cache, kv, ids[0, seg.start : seg.end - 1])
    engine = SegmentRecompute(stack, cache, kv, ids[0, seg.start : seg.end])
    with pytest.raises(ValueError, match="hidden states"):
        engine.run_layer(0, engine.embeddings(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="layer index"):
        engine.run_layer(7, engine.embeddings(), engine.all_rows())
    with pytest.raises(ValueError, match="must index"):
        engine.run_layer(0, engine.embeddings(), engine.all_rows(), choose=lambda probe: torch.tensor([99]))
    assert not engine.fresh


# ------------------------------------------------------------------ configuration errors
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: CacheBlend(rho=1.5), "rho"),
        (lambda: CacheBlend(rho="0.9"), "rho"),
        (lambda: CacheBlend(check_layers=(0,)), "layer 0"),
        (lambda: CacheBlend(check_layers=(2, 1)), "increasing"),
        (lambda: CacheBlend(check_layers=()), "at least one"),
        (lambda: DroidSpeak(max_groups=0), "max_groups"),
        (lambda: DroidSpeak(layer_profile=["x"]), "numbers"),
        (lambda: RelayCaching(band=(0.7, 0.2)), "band"),
    ],
)
def test_bad_knobs(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_knobs_checked_against_the_model(tiny_llama, tokenizer):
    with pytest.raises(ValueError, match="below the model's 3 layers"):
        Session(tiny_llama, tokenizer, "cacheblend", check_layers=(3,))
    with pytest.raises(ValueError, match="at least two layers"):
        Session(tiny_llama, tokenizer, "relaycaching", band=(0.5, 0.7))
    with pytest.raises(ValueError, match="4 entries but the model has 3"):
        Session(tiny_llama, tokenizer, DroidSpeak(layer_profile=[1, 2, 3, 4]))


def test_droidspeak_without_profile_says_what_to_do(tiny_llama, tokenizer):
    with pytest.raises(ValueError, match="calibrate"):
        Session(tiny_llama, tokenizer, "droidspeak", rho=0.5)  # refused before any turn runs
    # rho = 0 and 1 need no profile
    Session(tiny_llama, tokenizer, "droidspeak", rho=1.0).run_turn("a", roles("a"), max_new_tokens=2)
    # a profile removed mid-session is refused when the turn is built
    method = DroidSpeak(rho=0.5, layer_profile=[0.0, 1.0, 2.0])
    session = Session(tiny_llama, tokenizer, method)
    method.layer_profile = None
    with pytest.raises(ValueError, match="calibrate"):
        session.run_turn("a", roles("a"), max_new_tokens=2)


def test_droidspeak_calibrate_profiles_layers(tiny_llama, tokenizer):
    from hf_kvshare.evaluation import Step, Workflow, calibrate_droidspeak

    workflow = Workflow([Step(agent, segments) for agent, segments in STEPS[:2]], max_new_tokens=4)
    method = DroidSpeak(rho=0.7)
    profile = calibrate_droidspeak(method, tiny_llama, tokenizer, [workflow])
    assert len(profile) == 3 and method.layer_profile == profile
    assert profile[0] < 1e-8 < profile[1]  # layer 0's K/V do not depend on the prefix
    _, got = run(tiny_llama, tokenizer, method)
    layer = max(range(3), key=lambda i: profile[i])
    assert got[2].cache.segment("query").info["layer_groups"] == f"{layer}-{layer}"


def test_unsupported_models_refused(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=49152)).eval()
    with pytest.raises(ValueError, match="decoder layers one by one"):
        DecoderStack(gpt2)
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa"):
        DecoderStack(model)


def test_batch_refused(tiny_llama, tokenizer):
    with pytest.raises(ValueError, match="batch size 1"):
        Session(tiny_llama, tokenizer, "cacheblend").build_cache("a", roles("a"), batch_size=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_probe_attention_matches_the_models_attention_weights(arch, tokenizer):
    model = tiny_model(arch, attn_implementation="eager")
    cache, ids = Session(model, tokenizer).build_cache("a", roles("a"))
    seg = cache.segment("query")
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    engine = SegmentRecompute(
        DecoderStack(model), cache, cache.extract(seg.start, seg.end), ids[0, seg.start : seg.end]
    )
    seen = {}

    def record(probe):
        seen["attention"], seen["deviation"] = probe.attention(), probe.deviation()
        return torch.arange(probe.rows.numel())

    hidden, rows = engine.embeddings(), engine.all_rows()
    hidden, rows = engine.run_layer(0, hidden, rows)
    engine.run_layer(1, hidden, rows, record, attention=True)
    weights = out.attentions[1][0]  # [heads, P, P]
    expected = weights[:, seg.start : seg.end, seg.start : seg.end].double().mean(0).sum(0)
    assert torch.allclose(seen["attention"], expected, atol=1e-5)
    assert seen["deviation"].abs().max() < 1e-8  # the reused cache is exact here


def test_missing_boundary_hidden_state_is_explained(tiny_llama, tokenizer):
    method = DroidSpeak(rho=0.7, layer_profile=[0.0, 1.0, 0.0])  # restarts at layer 1
    session = Session(tiny_llama, tokenizer, method)
    session.run_turn("a", roles("a"), max_new_tokens=2)
    assert set(session.slots["query"].extras) and 1 in next(iter(session.slots["query"].extras.values()))
    method.layer_profile = [0.0, 0.0, 1.0]  # now it would restart at layer 2, which was not kept
    with pytest.raises(ValueError, match="keeps no input hidden state of layer 2"):
        session.run_turn("b", roles("b"), max_new_tokens=2)

"""One dense forward per turn: every token a method leaves dense is computed in a single forward over
the placed (reused / corrected) K/V, with a mask built from positions (hf_kvshare.prefill.prefill_parts)."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from families import family_model
from tiny import QUERY, STEPS, roles, tiny_model

from hf_kvshare import METHODS, PF, PH, SegmentedCache, Session, cache_kwargs
from hf_kvshare.cache import CachePart, Segment
from hf_kvshare.prefill import prefill_dense, prefill_parts


@contextlib.contextmanager
def count_forwards(model):
    """Count the calls of ``model``'s own forward (a pre-hook, removed on exit)."""
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def plain_generate(model, ids, n):
    with torch.no_grad():
        out = model.generate(
            input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=n, do_sample=False
        )
    return out[0, ids.numel() :]


def plain_kv(model, ids):
    """Per-layer (keys, values) of a plain prefill of ``ids`` ``[n]``."""
    with torch.no_grad():
        out = model(input_ids=ids[None], use_cache=True, **cache_kwargs(SegmentedCache(model.config)))
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return [cache.layer_kv(i) for i in range(len(cache.layers))]


def reuse_session(model, tokenizer, method="fullshared"):
    session = Session(model, tokenizer, method)
    for agent, segments in STEPS[:2]:
        session.run_turn(agent, segments, max_new_tokens=6)
    return session


@pytest.fixture
def per_segment(monkeypatch):
    """Force the per-segment path (what a model that cannot take an explicit mask runs)."""
    monkeypatch.setattr("hf_kvshare._compat.explicit_attention_mask", lambda *args, **kwargs: None)


def test_reuse_turn_runs_one_dense_forward(tiny, tokenizer):
    agent, segments = STEPS[2]  # PF, PH second, PF, PH first, PF, PH query: three dense PF runs
    session = reuse_session(tiny, tokenizer)
    with count_forwards(tiny) as calls:
        cache, _ = session.build_cache(agent, segments)
    assert len(calls) == 1
    dense = [s for s in cache.segments if s.provenance == "dense"]
    assert [s.kind for s in dense] == ["PF", "PF", "PF"]
    assert [s.provenance for s in cache.segments if s.kind == "PH"] == ["reused"] * 3
    assert [s.start for s in cache.segments] == sorted(s.start for s in cache.segments)


def test_per_segment_path_runs_a_forward_per_dense_run(tiny, tokenizer, per_segment):
    agent, segments = STEPS[2]
    session = reuse_session(tiny, tokenizer)
    with count_forwards(tiny) as calls:
        session.build_cache(agent, segments)
    assert len(calls) == 3  # the behaviour before the one dense forward (and the fallback)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_forward_equals_per_segment_kv(tokenizer, attention, monkeypatch):
    model = tiny_model("qwen2", attn_implementation=attention)
    agent, segments = STEPS[2]
    one, ids = reuse_session(model, tokenizer).build_cache(agent, segments)
    monkeypatch.setattr("hf_kvshare._compat.explicit_attention_mask", lambda *args, **kwargs: None)
    per, _ = reuse_session(model, tokenizer).build_cache(agent, segments)
    assert one.get_seq_length() == per.get_seq_length() == ids.shape[1] - 1
    for layer in range(len(one.layers)):
        for a, b in zip(one.layer_kv(layer), per.layer_kv(layer)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gemma3_text"])
def test_exact_reuse_in_one_forward_equals_plain_prefill(family, tokenizer):
    """FullShared re-reading behind the same prefix is exact: the one forward (sliding-window layers
    included) gives the plain prefill's K/V and tokens."""
    model = family_model(family)
    session = Session(model, tokenizer, "fullshared")
    session.run_turn("a", roles("a"), max_new_tokens=6)
    segments = roles("a") + [PH("a"), PF("\nGo on:")]
    with count_forwards(model) as calls:
        cache, ids = session.build_cache("a", segments)
    assert len(calls) == 1
    assert [s.provenance for s in cache.segments if s.kind == "PH"] == ["reused", "reused"]
    for layer, (k, v) in enumerate(plain_kv(model, ids[0, :-1])):
        torch.testing.assert_close(cache.layer_kv(layer)[0], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.layer_kv(layer)[1], v, atol=1e-5, rtol=1e-5)
    r = session.run_turn("a", segments, max_new_tokens=6)
    assert r.output_ids.tolist() == session._strip_eos(plain_generate(model, r.prompt_ids, 6)).tolist()


def test_mask_is_built_from_positions_not_order(tiny_llama):
    """A placed segment of garbage K/V after a dense one cannot leak into it: the dense tokens before
    it get exactly their plain prefill's K/V; those after it see it."""
    model = tiny_llama
    ids = torch.arange(100, 130)
    exact = plain_kv(model, ids)
    layers = len(exact)
    torch.manual_seed(0)
    garbage = [torch.randn_like(k[..., 10:20, :]) * 50 for k, _ in exact]
    from hf_kvshare.cache import SegmentKV

    kv = SegmentKV(keys=garbage, values=[g.clone() for g in garbage], start=10)
    parts = [
        CachePart(Segment("a", "PF", 0, 10), token_ids=ids[None, :10]),
        CachePart(Segment("x", "PH", 10, 20, "reused"), kv=kv),
        CachePart(Segment("b", "PF", 20, 30), token_ids=ids[None, 20:]),
    ]
    cache = SegmentedCache(model.config)
    with count_forwards(model) as calls:
        prefill_parts(cache, model, parts)
    assert len(calls) == 1 and cache.get_seq_length() == 30
    for layer in range(layers):
        k, v = cache.layer_kv(layer)
        torch.testing.assert_close(k[..., :10, :], exact[layer][0][..., :10, :], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[..., :10, :], exact[layer][1][..., :10, :], atol=1e-5, rtol=1e-5)
        assert torch.equal(k[..., 10:20, :], garbage[layer])
    assert not torch.allclose(
        cache.layer_kv(layers - 1)[1][..., 20:, :], exact[-1][1][..., 20:, :], atol=1e-3
    )
    assert [s.name for s in cache.segments] == ["a", "x", "b"]


def test_prefill_parts_refuses_bad_parts_and_changes_nothing(tiny_llama):
    model = tiny_llama
    cache = SegmentedCache(model.config)
    prefill_dense(cache, model, torch.arange(100, 105)[None], [Segment("a", "PF", 0, 5)])
    before = [t.clone() for t in cache.layer_kv(0)]
    ids = torch.arange(200, 205)[None]
    with pytest.raises(ValueError, match="tile"):
        prefill_parts(cache, model, [CachePart(Segment("b", "PF", 4, 9), token_ids=ids)])
    with pytest.raises(ValueError, match="holds 5 tokens"):
        prefill_parts(cache, model, [CachePart(Segment("b", "PF", 5, 8), token_ids=ids)])
    with pytest.raises(ValueError, match="exactly one of"):
        prefill_parts(cache, model, [CachePart(Segment("b", "PF", 5, 10))])
    kv = cache.extract(0, 5)
    with pytest.raises(ValueError, match="RopeShifter"):
        prefill_parts(
            cache,
            model,
            [
                CachePart(Segment("x", "PH", 5, 10), kv=kv),
                CachePart(Segment("b", "PF", 10, 15), token_ids=ids),
            ],
        )
    assert cache.get_seq_length() == 5 and [s.name for s in cache.segments] == ["a"]
    assert all(torch.equal(a, b) for a, b in zip(before, cache.layer_kv(0)))


GLUE = [PF(" "), PF("\n"), PF("\n\n"), PF("\t"), PF(" \n ")]


@pytest.mark.parametrize("seed", range(4))
def test_shuffled_segments_and_empty_looking_glue_keep_nonshared_exact(tiny, tokenizer, seed):
    """Bad input: whatever the order of the segments and whatever whitespace-only glue sits between
    them, NonShared's tokens are plain generate's on the same prompt, and FullShared (exact when every
    reused slot sits behind the same prefix as where it was computed) runs one dense forward."""
    rng = torch.Generator().manual_seed(seed)
    base = [
        PF("System: be brief.\n"),
        PH("query", QUERY),
        PF("\nNotes: "),
        PH("fact", "Seven is prime."),
        PF("\nA:"),
    ]
    order = torch.randperm(len(base), generator=rng).tolist()
    segments = []
    for i in order:
        glue = GLUE[int(torch.randint(len(GLUE), (1,), generator=rng))]
        segments += [glue, base[i]] if int(torch.randint(2, (1,), generator=rng)) else [base[i]]
    session = Session(tiny, tokenizer, "nonshared")
    r = session.run_turn("a", segments, max_new_tokens=8)
    assert r.output_ids.tolist() == session._strip_eos(plain_generate(tiny, r.prompt_ids, 8)).tolist()


def test_glue_between_reused_segments_stays_exact_behind_the_same_prefix(tiny, tokenizer):
    """FullShared re-reading a turn's own prompt and output behind the identical prefix, whitespace
    glue in any order after it: exact, and one dense forward."""
    first = [PF("Sys.\n"), PH("query", QUERY), PF("\n"), PH("fact", "Seven is prime."), PF(" A:")]
    for glue in itertools.permutations([PF(" "), PF("\n\n"), PF("\t")], 3):
        session = Session(tiny, tokenizer, "fullshared")
        session.run_turn("a", first, max_new_tokens=5)
        segments = first + [PH("a"), *glue, PF("\nB:")]
        with count_forwards(tiny) as calls:
            session.build_cache("a", segments)
        assert len(calls) == 1
        r = session.run_turn("a", segments, max_new_tokens=5)
        assert r.output_ids.tolist() == session._strip_eos(plain_generate(tiny, r.prompt_ids, 5)).tolist()


# ----------------------------------------------------------------------- per-agent prefix reuse
SAME_PREFIX = [("a", roles("a")), ("a", roles("a") + [PH("a"), PF("\nGo on:")])]


def test_prefix_reuse_behind_the_same_prefix_is_exact_and_reported(tiny, tokenizer):
    """FullShared with prefix_reuse: the agent's own PF text of its first turn is placed on its second
    (behind the identical prefix, so exactly), only new text is computed, rho stays over PH tokens."""
    session = Session(tiny, tokenizer, "fullshared", prefix_reuse=True, prefix_scope="request")
    first = session.run_turn(*SAME_PREFIX[0], max_new_tokens=6)
    assert first.prefix_reused == 0
    second = session.run_turn(*SAME_PREFIX[1], max_new_tokens=6)
    assert (
        second.output_ids.tolist() == session._strip_eos(plain_generate(tiny, second.prompt_ids, 6)).tolist()
    )
    rows = {s.name: s for s in second.segments}
    assert rows["pf0"].provenance == rows["pf1"].provenance == "reused"
    assert rows["pf0"].info["prefix_reuse"] == 0 and rows["pf0"].source_agent == "a"
    assert rows["pf2"].provenance == "dense"  # "\nGo on:" is new text
    pf_reused = rows["pf0"].length + rows["pf1"].length
    assert second.prefix_reused == pf_reused
    assert second.tokens_prefilled == second.prompt_ids.numel() - pf_reused - second.ph_tokens
    assert second.reuse_ratio == 1.0  # PH tokens only
    kept = session.method_state["fullshared:prefixes"]
    assert session.held_bytes() >= sum(kv.nbytes for kv in kept.values()) > 0


def test_prefix_reuse_repositions_on_another_agents_turn_order(tiny, tokenizer):
    """The kept text moves with the agent's later prompt (other positions): rotated, not recomputed,
    and one dense forward computes the rest."""
    session = Session(tiny, tokenizer, "fullshared", prefix_reuse=True)
    session.run_turn("a", roles("a"), max_new_tokens=4)
    session.run_turn("b", roles("b"), max_new_tokens=4)
    later = [PF("Recap.\n"), PH("b")] + roles("a")
    with count_forwards(tiny) as calls:
        cache, _ = session.build_cache("a", later)
    assert len(calls) == 1
    rows = {s.name: s for s in cache.segments}
    assert rows["pf1"].provenance == "reused" and rows["pf1"].info["prefix_reuse"] == 0
    assert rows["pf1"].start > 0 and rows["pf0"].provenance == "dense"


def test_prefix_reuse_is_off_by_default_for_fullshared_and_on_for_kvcmas(tiny_llama, tokenizer):
    assert Session(tiny_llama, tokenizer, "fullshared").method.prefix_reuse is False
    assert Session(tiny_llama, tokenizer, "kvcmas").method.prefix_reuse is True
    assert Session(tiny_llama, tokenizer, "kvcomm").method.prefix_reuse is True
    session = Session(tiny_llama, tokenizer, "fullshared")
    for agent, segments in SAME_PREFIX:
        r = session.run_turn(agent, segments, max_new_tokens=4)
    assert r.prefix_reused == 0 and "fullshared:prefixes" not in session.method_state
    assert session.method.state_bytes() == 0


def test_agent_scope_keeps_an_agents_prefix_across_requests(tiny, tokenizer):
    """prefix_scope="agent" (the reference keeps an agent's template K/V across requests): the next
    request's first turn of the agent already places its kept PF text; "request" scope does not."""
    agent_scope = METHODS["fullshared"](prefix_reuse=True)
    request_scope = METHODS["fullshared"](prefix_reuse=True, prefix_scope="request")
    for method in (agent_scope, request_scope):
        Session(tiny, tokenizer, method).run_turn(*SAME_PREFIX[0], max_new_tokens=4)
    kept = agent_scope.state_bytes()
    assert kept > 0 and request_scope.state_bytes() == 0 and agent_scope.state_summary()["bytes"] == kept
    r = Session(tiny, tokenizer, agent_scope).run_turn(*SAME_PREFIX[0], max_new_tokens=4)
    assert r.prefix_reused > 0 and {s.provenance for s in r.segments if s.name == "pf0"} == {"reused"}
    r = Session(tiny, tokenizer, request_scope).run_turn(*SAME_PREFIX[0], max_new_tokens=4)
    assert r.prefix_reused == 0


def test_agent_scope_is_bounded_and_saved(tiny, tokenizer, tmp_path):
    method = METHODS["fullshared"](prefix_reuse=True)
    method.PREFIX_LIMIT = 3
    for i in range(6):  # a new agent (and system prompt) per request
        Session(tiny, tokenizer, method).run_turn(f"agent{i}", roles(f"agent{i}"), max_new_tokens=2)
    kept = method.__dict__["_kept_prefixes"]
    assert len(kept) == 3 and {agent for agent, _ in kept} <= {"agent4", "agent5"}
    method.save_state(tmp_path / "state")
    loaded = METHODS["fullshared"](prefix_reuse=True)
    loaded.load_state(tmp_path / "state", model=tiny)
    assert loaded.state_bytes() == method.state_bytes() > 0
    a = Session(tiny, tokenizer, method).run_turn("agent5", roles("agent5"), max_new_tokens=4)
    b = Session(tiny, tokenizer, loaded).run_turn("agent5", roles("agent5"), max_new_tokens=4)
    assert a.output_ids.tolist() == b.output_ids.tolist() and a.prefix_reused == b.prefix_reused > 0


def test_agent_scope_is_bounded_by_bytes(tiny, tokenizer):
    """Kept PF text is bounded by bytes as well as by count: a one-message prompt makes an agent's
    prefix its whole prompt (788 MB after 16 such requests on the 135M model, within the count)."""
    method = METHODS["fullshared"](prefix_reuse=True)
    Session(tiny, tokenizer, method).run_turn("agent0", roles("agent0"), max_new_tokens=2)
    one = method.state_bytes()
    assert one > 0
    method.bound_prefixes(2 * one + one // 2)  # room for two agents' text
    for i in range(1, 6):
        Session(tiny, tokenizer, method).run_turn(f"agent{i}", roles(f"agent{i}"), max_new_tokens=2)
        assert method.state_bytes() <= 2 * one + one // 2
    agents = {agent for agent, _ in method.__dict__["_kept_prefixes"]}
    assert "agent5" in agents and not agents & {"agent0", "agent1"}  # the least recently used went
    method.bound_prefixes(0)
    assert method.state_bytes() == 0
    for bad in (-1, 1.5, True):  # one byte-budget check (budgets.check_byte_budget), naming the bound
        with pytest.raises(ValueError, match=r"kept prefixes' max_bytes must be an int >= 0"):
            method.bound_prefixes(bad)


@pytest.mark.parametrize("method", ["kvcmas", "kvcomm"])
def test_prefix_reuse_keeps_kvcmas_exact_at_tau_zero(tiny, tokenizer, method):
    session = Session(tiny, tokenizer, method, tau=0.0, prefix_reuse=True)
    for agent, segments in STEPS + [("first", roles("first") + [PH("first"), PF("\nGo on:")])]:
        r = session.run_turn(agent, segments, max_new_tokens=5)
        assert r.prefix_reused == 0
        assert r.output_ids.tolist() == session._strip_eos(plain_generate(tiny, r.prompt_ids, 5)).tolist()


def test_kvcmas_reuse_turn_places_the_agents_prefix(tiny_llama, tokenizer):
    """A reuse turn (edge scope: no slot-level rejection makes the turn dense): the agent's PF text of
    its first turn is placed on its second (rotate-only); a dense turn (slot scope, the gate refusing
    for want of anchors) places none."""
    session = Session(tiny_llama, tokenizer, "kvcmas", tau=1.0, gate_scope="edge")
    for agent, segments in STEPS[:2]:
        session.run_turn(agent, segments, max_new_tokens=4)
    r = session.run_turn("first", roles("first") + [PF("\nPrevious: "), PH("second")], max_new_tokens=4)
    rows = [s for s in r.segments if s.kind == "PF" and s.provenance == "reused"]
    assert [s.name for s in rows] == ["pf0", "pf1"] and r.prefix_reused == sum(s.length for s in rows)
    # the reference profile: a rejection makes the whole turn dense (profile="reuse" falls back per span)
    for options in ({"gate_scope": "edge", "prefix_reuse": False}, {"profile": "reference"}):
        off = Session(tiny_llama, tokenizer, "kvcmas", tau=1.0, **options)
        for agent, segments in STEPS[:2]:
            off.run_turn(agent, segments, max_new_tokens=4)
        r = off.run_turn("first", roles("first") + [PF("\nPrevious: "), PH("second")], max_new_tokens=4)
        assert r.prefix_reused == 0


def test_prefix_scope_option_is_checked(tiny_llama, tokenizer):
    for method in ("fullshared", "kvcmas"):
        with pytest.raises(ValueError, match="prefix_scope must be one of"):
            Session(tiny_llama, tokenizer, method, prefix_scope="session")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_prefix_reuse_option_is_checked(tiny_llama, tokenizer, value):
    for method in ("fullshared", "kvcmas"):
        with pytest.raises(ValueError, match="prefix_reuse must be True or False"):
            Session(tiny_llama, tokenizer, method, prefix_reuse=value)


def test_unknown_option_lists_the_valid_ones(tiny_llama, tokenizer):
    with pytest.raises(ValueError, match="no option 'prefix_reus'.*its options: prefix_reuse"):
        Session(tiny_llama, tokenizer, "fullshared", prefix_reus=True)
    with pytest.raises(ValueError, match="no option 'foo'.*prefix_reuse"):
        Session(tiny_llama, tokenizer, "kvcmas", foo=1)


# ------------------------------------------------------- the trailing agent text in generate's forward
class _PrefillsTail(METHODS["fullshared"]):
    """FullShared with the trailing agent text prefilled in build (the behaviour before it was left to
    generate's first forward): a method with its own ``forward_kwargs`` (the same, none) is one whose
    generation may differ from its prefill, for which the HF executor prefills the text
    (``HFExecutor.tail_for_generate``)."""

    name = "fullshared-prefills-tail"

    def forward_kwargs(self, turn):
        return {}


def _turn_forwards(session, agent, segments, n=4, **kwargs):
    """The turn's result and the number of tokens each model forward fed, in order."""
    fed: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        fed.append((ids if ids is not None else kwargs["inputs_embeds"]).shape[1])

    handle = session.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        result = session.run_turn(agent, segments, **(kwargs or {"max_new_tokens": n}))
    finally:
        handle.remove()
    return result, fed


@pytest.mark.parametrize("prefix_reuse", [False, True])
def test_trailing_agent_text_is_computed_by_generates_first_forward(tiny, tokenizer, prefix_reuse):
    """The run of computed PF text after the last placed span is left to generate's first forward when
    everything before it is placed (prefix reuse): the reuse turn runs no forward but generate's, with
    the same tokens and the same segment table as prefilling it in build; where build computes the
    agent's template anyway, the text stays in that forward."""
    kwargs = {"prefix_reuse": prefix_reuse, "prefix_scope": "request"}
    agent, segments = STEPS[1][0], STEPS[1][1] + [PF("\nNow answer:")]
    runs = []
    for method in (METHODS["fullshared"](**kwargs), _PrefillsTail(**kwargs)):
        session = Session(tiny, tokenizer, method)
        session.run_turn(*STEPS[0], max_new_tokens=4)
        session.run_turn(agent, STEPS[1][1], max_new_tokens=4)  # the agent's prefix, kept when asked
        runs.append(_turn_forwards(session, agent, segments))
    (folded, fed), (before, fed_before) = runs
    tail = folded.segments[-1].length + 1  # "\nNow answer:" and the prompt's last token
    assert fed[-3:] == fed_before[-3:] == [1, 1, 1]  # the same decode
    if prefix_reuse:  # everything before the text is placed: generate's forward is the only one
        assert fed_before[:2] == [tail - 1, 1] and fed[:1] == [tail] and len(fed) == len(fed_before) - 1
    else:  # the agent's template is computed in build: the text after the placed span goes with it
        assert fed == fed_before and fed[1] == 1
    assert folded.output_ids.tolist() == before.output_ids.tolist()
    assert [(s.name, s.kind, s.start, s.end, s.provenance) for s in folded.segments] == [
        (s.name, s.kind, s.start, s.end, s.provenance) for s in before.segments
    ]
    assert folded.tokens_prefilled == before.tokens_prefilled
    assert (
        folded.segments[-1].provenance == "dense" and folded.segments[-1].end == folded.prompt_ids.numel() - 1
    )


def _folding_session(tiny, tokenizer, method):
    """A session whose next turn of ``STEPS[1]``'s agent with text after its last PH span places
    everything before that text (the agent's prefix kept from its earlier turn)."""
    session = Session(tiny, tokenizer, method)
    session.run_turn(*STEPS[0], max_new_tokens=4)
    session.run_turn(STEPS[1][0], STEPS[1][1], max_new_tokens=4)
    return session, STEPS[1][0], STEPS[1][1] + [PF("\nNow answer:")]


REUSE = {"prefix_reuse": True, "prefix_scope": "request"}


def test_trailing_agent_text_in_generate_keeps_the_cache(tiny, tokenizer):
    """The turn cache after generate holds the same K/V either way (to float tolerance: one forward
    over the text instead of two), so what a method records from it is unchanged."""
    caches, fed = [], []
    for method in (METHODS["fullshared"](**REUSE), _PrefillsTail(**REUSE)):
        session, agent, segments = _folding_session(tiny, tokenizer, method)
        result, calls = _turn_forwards(session, agent, segments)
        fed.append(calls[0])
        caches.append(session.run_turn(agent, segments, max_new_tokens=4, keep_cache=True).cache)
    assert fed[0] == fed[1] + 1 > 2  # generate's first forward fed the text and the last token
    a, b = caches
    assert a.get_seq_length() == b.get_seq_length()
    for i in range(len(a.layers)):
        ka, va = a.layer_kv(i)
        kb, vb = b.layer_kv(i)
        torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)


def test_build_cache_still_ends_at_the_prompts_last_token(tiny, tokenizer):
    """``build_cache`` (a caller's own generate) is unchanged: its cache holds every prompt token but the last."""
    session = reuse_session(tiny, tokenizer)
    agent, segments = STEPS[1][0], STEPS[1][1] + [PF("\nNow answer:")]
    cache, ids = session.build_cache(agent, segments)
    assert cache.get_seq_length() == ids.shape[-1] - 1
    assert cache.segments[-1].end == ids.shape[-1] - 1


def test_teacher_forcing_feeds_the_trailing_text_and_keeps_the_logits(tiny, tokenizer):
    """A teacher-forced turn feeds the trailing text with the forced tokens; its logits are the forced
    tokens' only, equal to prefilling the text in build."""
    logits, fed = [], []
    forced = torch.tensor([5, 6, 7])
    for method in (METHODS["fullshared"](**REUSE), _PrefillsTail(**REUSE)):
        session, agent, segments = _folding_session(tiny, tokenizer, method)
        r, calls = _turn_forwards(session, agent, segments, force_output=forced)
        assert r.logits.shape[0] == 3
        logits.append(r.logits)
        fed.append(calls)
    tail = fed[1][0] + 1  # the text prefilled in build, and the last token
    assert fed == [
        [tail + 2, 1],
        [tail - 1, 3, 1],
    ]  # text, last token, 2 forced in one forward (or two); the record
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)

"""Sessions: exactness against plain generate, reuse, slot rules and clear errors."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny import QUERY, plain_generate, roles, tiny_model

from hf_kvshare import METHODS, PF, PH, Method, Session, SharedCache, cache_kwargs, chat
from hf_kvshare._compat import CACHE_KWARG
from hf_kvshare.evaluation.metrics import kv_error


def test_registry_has_foundation_methods():
    assert {"nonshared", "fullshared"} <= set(METHODS)
    assert issubclass(METHODS["nonshared"], Method)


def test_nonshared_equals_plain_generate(tiny, tokenizer):
    session = Session(tiny, tokenizer, "nonshared")
    r = session.run_turn("solver", roles("solver"), max_new_tokens=12)
    expected = plain_generate(tiny, r.prompt_ids, 12)
    assert r.output_ids.tolist() == session._strip_eos(expected).tolist()
    assert r.reuse_ratio == 0.0 and r.tokens_prefilled == r.prompt_ids.numel()


def test_build_cache_works_with_both_cache_keywords(tiny, tokenizer):
    session = Session(tiny, tokenizer, "nonshared")
    cache, ids = session.build_cache("a", roles("a"))
    assert isinstance(cache, SharedCache) and cache.get_seq_length() == ids.shape[1] - 1
    expected = plain_generate(tiny, ids[0], 8)
    if CACHE_KWARG == "cache":  # transformers >= 5.24; before, `past_key_values=` is the only keyword
        with torch.no_grad():
            new = tiny.generate(input_ids=ids, max_new_tokens=8, do_sample=False, cache=cache.copy())
        assert new[0, ids.shape[1] :].tolist() == expected.tolist()
        deprecated = pytest.warns(FutureWarning, match="past_key_values")  # deprecated there, still works
    else:
        deprecated = warnings.catch_warnings()
    with deprecated:
        with torch.no_grad():
            old = tiny.generate(input_ids=ids, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert old[0, ids.shape[1] :].tolist() == expected.tolist()


def test_shared_cache_refuses_second_generate(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer, "nonshared")
    cache, ids = session.build_cache("a", roles("a"))
    spare = cache.copy()
    with torch.no_grad():
        tiny_llama.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
        with pytest.raises(RuntimeError, match="already used"):
            tiny_llama.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
        tiny_llama.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **cache_kwargs(spare))


def test_fullshared_reuses_and_has_measurable_error(tiny, tokenizer):
    exact = Session(tiny, tokenizer, "nonshared")
    shared = Session(tiny, tokenizer, "fullshared")
    for s in (exact, shared):
        s.run_turn("first", roles("first"), max_new_tokens=6)
    forced = exact.turns[0].output_ids
    ref = exact.run_turn(
        "second", roles("second") + [PF("\nPrevious: "), PH("first")], force_output=forced, keep_cache=True
    )
    got = shared.run_turn(
        "second", roles("second") + [PF("\nPrevious: "), PH("first")], force_output=forced, keep_cache=True
    )
    assert got.reuse_ratio == 1.0 and ref.reuse_ratio == 0.0
    assert got.tokens_prefilled < ref.tokens_prefilled
    q = got.cache.segment("query")
    assert q.provenance == "reused" and q.source_agent == "first"
    error = kv_error(got.cache, ref.cache, q.start, q.end)
    assert 1e-4 < error < 1.0, error  # different prefix => nonzero deviation
    # it still generates
    out = shared.run_turn("third", roles("third") + [PH("second")], max_new_tokens=5)
    assert out.output_ids.numel() >= 1


def test_teacher_forcing_matches_generation_logits(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer, "nonshared")
    free = session.run_turn("a", roles("a"), max_new_tokens=6)
    forced = Session(tiny_llama, tokenizer, "nonshared").run_turn(
        "a", roles("a"), force_output=free.output_ids
    )
    assert forced.logits.argmax(-1).tolist() == free.output_ids.tolist()


def test_chat_template_segments_are_exact(tokenizer):
    segs = chat(
        tokenizer,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [PH("query", QUERY), "\nGo."]},
        ],
    )
    kinds = [type(s).__name__ for s in segs]
    assert kinds == ["PF", "PH", "PF"]
    assert segs[0].text.startswith("<|im_start|>system\nBe brief.")
    assert segs[-1].text.endswith("<|im_start|>assistant\n")


def test_output_slots_and_loops(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer, "fullshared")
    session.run_turn("a", roles("a"), max_new_tokens=3)
    session.run_turn("b", roles("b") + [PH("a")], max_new_tokens=3)
    r = session.run_turn("a", roles("a") + [PH("b")], max_new_tokens=3)
    assert r.output_slot == "a#2" and {"a", "b", "a#2"} <= set(session.slots)
    assert session.slots["a#2"].producer == "a"


# ------------------------------------------------------------------ bad input
def test_unknown_method(tiny_llama, tokenizer):
    with pytest.raises(ValueError, match="unknown method 'nope'.*fullshared"):
        Session(tiny_llama, tokenizer, "nope")


def test_unrecorded_slot_and_conflicting_text_mutate_nothing(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer, "fullshared")
    with pytest.raises(ValueError, match="never recorded"):
        session.run_turn("a", [PF("x"), PH("query", QUERY), PH("ghost")], max_new_tokens=2)
    assert session.slots == {}  # the query slot of the failed turn was not kept
    session.run_turn("a", roles("a"), max_new_tokens=2)
    before = dict(session.slots)
    with pytest.raises(ValueError, match="already holds"):
        session.run_turn("b", [PF("x"), PH("query", "another query"), PH("new", "fresh")], max_new_tokens=2)
    assert session.slots == before


def test_empty_segment(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer)
    with pytest.raises(ValueError, match="zero tokens"):
        session.run_turn("a", [PF("hello"), PF("")], max_new_tokens=2)
    with pytest.raises(ValueError, match="zero tokens"):
        session.run_turn("a", [PF("hello"), PH("q", "")], max_new_tokens=2)


def test_batch_size_refused_where_unsupported(tiny_llama, tokenizer):
    class SingleStream(Method):
        name = "single-stream-test"
        supports_batch = False

    with pytest.raises(ValueError, match="batch size 1 only"):
        Session(tiny_llama, tokenizer, SingleStream()).build_cache("a", roles("a"), batch_size=2)
    cache, ids = Session(tiny_llama, tokenizer, "nonshared").build_cache("a", roles("a"), batch_size=2)
    assert ids.shape[0] == 2 and cache.layer_kv(0)[0].shape[0] == 2


def test_cache_for_other_model_refused_in_generate(tiny_llama, tokenizer):
    other = tiny_model("llama", num_key_value_heads=4)
    cache, ids = Session(other, tokenizer).build_cache("a", roles("a"))
    with pytest.raises(ValueError, match="kv heads"):
        with torch.no_grad():
            tiny_llama.generate(input_ids=ids, max_new_tokens=2, **cache_kwargs(cache))


def test_trajectory_longer_than_max_positions(tokenizer):
    model = tiny_model("llama", max_position_embeddings=32)
    session = Session(model, tokenizer)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        session.run_turn("a", roles("a"), max_new_tokens=8)
    assert session.slots == {}


def test_dynamic_ntk_model_refused_for_reuse(tokenizer):
    model = tiny_model(
        "llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    )
    for method in ("fullshared", "kvcmas", "graphflow", "cacheblend"):
        with pytest.raises(ValueError, match="dynamic"):  # refused when the session is created
            Session(model, tokenizer, method)
    Session(model, tokenizer, "nonshared").run_turn("a", roles("a"), max_new_tokens=2)  # no reuse: fine


def test_method_instance_with_options_refused(tiny_llama, tokenizer):
    with pytest.raises(ValueError, match="instance"):
        Session(tiny_llama, tokenizer, METHODS["fullshared"](), foo=1)


def test_no_deprecation_warnings_from_our_calls(tiny_llama, tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session = Session(tiny_llama, tokenizer, "fullshared")
        session.run_turn("a", roles("a"), max_new_tokens=3)
        session.run_turn("b", roles("b") + [PH("a")], max_new_tokens=3)


def test_beam_search_through_shared_cache(tiny_llama, tokenizer):
    """generate expands input_ids for beams but not a given cache: SharedCache follows it."""
    cache, ids = Session(tiny_llama, tokenizer, "nonshared").build_cache("a", roles("a"))
    with torch.no_grad():
        plain = tiny_llama.generate(
            input_ids=ids, max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False
        )
        shared = tiny_llama.generate(
            input_ids=ids,
            max_new_tokens=6,
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
            **cache_kwargs(cache),
        )
    assert shared.tolist() == plain.tolist()


def test_failed_turn_leaves_session_unchanged(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer, "fullshared")
    session.run_turn("a", roles("a"), max_new_tokens=2)
    before = {k: (v.token_ids.tolist(), v.latest) for k, v in session.slots.items()}
    with pytest.raises(ValueError, match="not_a_generate_kwarg"):  # raised by generate, after the build
        session.run_turn(
            "b", roles("b") + [PH("extra", "more text")], max_new_tokens=2, not_a_generate_kwarg=1
        )
    assert {k: (v.token_ids.tolist(), v.latest) for k, v in session.slots.items()} == before


def test_held_bytes_count_the_reuse_sources_exactly(tiny_llama, tokenizer):
    """FullShared keeps each slot's latest K/V (layers x 2 x kv_heads x head_dim fp32 per token), as views
    of the last turn's cache, which is what stays alive; NonShared keeps nothing for later turns."""
    cfg = tiny_llama.config
    per_token = (
        cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )
    for method, expected_tokens in (("fullshared", None), ("nonshared", 0)):
        session = Session(tiny_llama, tokenizer, method)
        assert session.held_bytes() == 0
        session.run_turn("a", [PF("You plan."), PH("query", "Reverse a list.")], max_new_tokens=3)
        b = session.run_turn("b", [PF("You code."), PH("query"), PH("a")], max_new_tokens=3)
        # the slots' K/V are views of b's turn cache (prompt + output): held whole, once
        tokens = b.prompt_ids.numel() + b.output_ids.numel()
        assert tokens > sum(slot.token_ids.numel() for slot in session.slots.values()) > 0
        assert session.held_bytes() == (tokens if expected_tokens is None else expected_tokens) * per_token


# ------------------------------------------------------------ one request, one walk, the HF executor
def test_the_session_is_a_request_and_the_walk_calls_the_hooks_in_order(tiny_llama, tokenizer):
    """A Session is a :class:`~hf_kvshare.request.Request`; its turns walk the method's hooks in the
    contract's order (plan, then placeholder / prefix per span, finish; record after the output)."""
    from hf_kvshare.request import Request

    calls: list[str] = []

    class Tracing(METHODS["fullshared"]):
        name = "fullshared-tracing"

        def plan(self, turn):
            calls.append("plan")

        def placeholder(self, turn, span, cache):
            calls.append(f"placeholder:{span.name}")
            return super().placeholder(turn, span, cache)

        def prefix(self, turn, span, cache):
            calls.append(f"prefix:{span.name}")
            return super().prefix(turn, span, cache)

        def finish(self, turn, cache):
            calls.append("finish")

        def record(self, turn, cache):
            calls.append("record")

    session = Session(tiny_llama, tokenizer, Tracing())
    assert isinstance(session, Request)
    session.run_turn("a", [PF("You are a."), PH("query", QUERY), PF("\nGo:")], max_new_tokens=2)
    assert calls == ["plan", "prefix:pf0", "placeholder:query", "prefix:pf1", "finish", "record"]
    assert session.reserved == set()  # the output slot was recorded


def test_build_cache_reserves_no_output_slot(tiny_llama, tokenizer):
    session = Session(tiny_llama, tokenizer, "fullshared")
    session.build_cache("a", roles("a"))
    assert session.reserved == set() and session.next_output_slot("a") == "a"


def test_an_output_slot_named_like_an_alias_is_refused(tiny_llama, tokenizer):
    """A PH name read as an output (an alias) cannot also name a new output: the request's one rule
    (the serving host's too)."""
    session = Session(tiny_llama, tokenizer, "fullshared")
    text = " First sort the numbers, then return them."
    session.run_turn("a", roles("a"), force_output=tokenizer(text, add_special_tokens=False)["input_ids"])
    session.run_turn("b", roles("b") + [PH("notes", text), PF("\nGo:")], max_new_tokens=2)
    assert session.aliases == {"notes": "a"}
    with pytest.raises(ValueError, match="output slot 'notes' already exists in this session"):
        session.run_turn("c", roles("c"), output_slot="notes", max_new_tokens=2)


def test_method_build_needs_the_hf_executor(tiny_llama, tokenizer):
    """``Method.build`` builds with the executor that runs the turn; a turn without one (a served turn)
    is refused with the reason."""
    session = Session(tiny_llama, tokenizer, "fullshared")
    turn = session.prepare_turn("a", roles("a"))
    with pytest.raises(TypeError, match="HF executor"):
        session.method.build(turn)


def test_the_executor_flags_left_the_turn_with_deprecation_shims(tiny_llama, tokenizer):
    """``Turn.generate_tail`` / ``Turn.tail_segments`` and ``Method.tail_for_generate`` still answer,
    with a DeprecationWarning naming the HF executor; a method that still overrides
    ``tail_for_generate`` decides in the executor's place."""
    from hf_kvshare.executor import HFExecutor

    session = Session(tiny_llama, tokenizer, "fullshared")
    turn = session.prepare_turn("a", roles("a"))
    turn.executor = HFExecutor(leave_tail=True)
    with pytest.warns(DeprecationWarning, match="HFExecutor"):
        assert turn.generate_tail is True
    with pytest.warns(DeprecationWarning, match="HFExecutor"):
        assert turn.tail_segments == []
    with pytest.warns(DeprecationWarning, match="HFExecutor.tail_for_generate"):
        assert session.method.tail_for_generate(turn, []) == []

    asked = []

    class OwnTail(METHODS["fullshared"]):
        name = "fullshared-own-tail"

        def tail_for_generate(self, turn, parts):
            asked.append(len(parts))
            return []

    Session(tiny_llama, tokenizer, OwnTail()).run_turn("a", roles("a"), max_new_tokens=2)
    assert asked and asked[0] > 0

"""Hardening (issue 13, items 1-7): threads, one model per method instance, caches bound to their
model, finite K/V, failed turns that mutate nothing, bounded cross-request state, clear errors."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny import STEPS, tiny_model

from hf_kvshare import METHODS, PF, Session
from hf_kvshare._compat import cache_kwargs
from hf_kvshare.prefill import prefill_dense

# ---------------------------------------------------------------- 1. threads

THREAD_METHODS = {
    "nonshared": {},
    "cacheblend": {"rho": 0.5},
    "droidspeak": {"rho": 0.4, "layer_profile": [0.0, 2.0, 0.5, 1.0]},
    "relaycaching": {"rho": 0.5},
    "fullshared": {},
    "kvcmas": {},
    "kvcomm": {},
    "graphflow": {},
}


def _workflow(model, tokenizer, method, request: int) -> list[list[int]]:
    session = Session(model, tokenizer, METHODS[method](**THREAD_METHODS[method]))
    out = []
    for agent, segments in STEPS:
        segments = [s for s in segments]
        result = session.run_turn(agent, segments, max_new_tokens=4 + request % 3)
        out.append(result.output_ids.tolist())
    return out


def test_sessions_on_one_model_in_threads_equal_a_sequential_run(tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    jobs = [(method, r) for r in range(2) for method in THREAD_METHODS]
    expected = {job: _workflow(model, tokenizer, *job) for job in jobs}
    got: dict = {}
    errors: list = []
    barrier = threading.Barrier(2)

    def worker(my_jobs):
        barrier.wait()
        try:
            for _ in range(2):
                for job in my_jobs:
                    got.setdefault(job, []).append(_workflow(model, tokenizer, *job))
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(jobs[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    wrong = [job for job, runs in got.items() if any(run != expected[job] for run in runs)]
    assert not wrong, f"{len(wrong)} of {len(got)} requests differ from the sequential run: {wrong}"


# ---------------------------------------------------------------- 2. one model per method instance


@pytest.mark.parametrize("name", [n for n, c in METHODS.items() if not c.requires_adapters])
def test_a_method_instance_refuses_a_second_model(name, tokenizer):
    first, second = (
        tiny_model("llama", seed=3, num_hidden_layers=4),
        tiny_model("llama", seed=4, num_hidden_layers=4),
    )
    method = METHODS[name](**THREAD_METHODS.get(name, {}))
    Session(first, tokenizer, method).run_turn(*STEPS[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="bound to .* cannot be used with"):
        Session(second, tokenizer, method)
    Session(first, tokenizer, method).run_turn(*STEPS[0], max_new_tokens=2)  # the first model still works


def test_an_unhashable_user_method_runs_a_turn(tokenizer):
    """A user's method may be a plain ``@dataclass`` (``eq=True``: unhashable); the per-thread turn guard
    must not need to hash it (it raised TypeError in a WeakKeyDictionary)."""
    from dataclasses import dataclass

    base = METHODS["fullshared"]

    @dataclass
    class Plain(base):
        name = "plain-dataclass-test"

    method = Plain()
    with pytest.raises(TypeError):
        hash(method)
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    session = Session(model, tokenizer, method)
    for step in STEPS[:2]:
        session.run_turn(*step, max_new_tokens=2)


# ---------------------------------------------------------------- 3. caches bound to their model


def test_a_cache_refuses_another_model_in_generate(tokenizer):
    four = tiny_model("llama", seed=3, num_hidden_layers=4)
    three = tiny_model("llama", seed=3, num_hidden_layers=3)  # same head shape, one layer less
    other = tiny_model("llama", seed=5, num_hidden_layers=4)  # same shape, other weights
    cache, prompt = Session(four, tokenizer, "fullshared").build_cache(*STEPS[0])
    for model in (three, other):
        with pytest.raises(ValueError, match="cache/model mismatch"):
            model.generate(input_ids=prompt, **cache_kwargs(cache.copy()), max_new_tokens=2, do_sample=False)
    assert cache.get_seq_length() == prompt.shape[1] - 1  # refused before anything was written
    with pytest.raises(ValueError, match="cache/model mismatch"):
        prefill_dense(cache.copy(), other, prompt[0, -1:])
    # the same weights in another object are the same model
    twin = tiny_model("llama", seed=3, num_hidden_layers=4)
    out = twin.generate(input_ids=prompt, **cache_kwargs(cache.copy()), max_new_tokens=3, do_sample=False)
    plain = four.generate(input_ids=prompt, max_new_tokens=3, do_sample=False)
    assert out.tolist() == plain.tolist()


# ---------------------------------------------------------------- 4./5. non-finite K/V, failed turns


def _state(session, method) -> tuple:
    """Everything a failed turn must leave as it was: slots, their K/V, turns, pools and counters."""
    slots = tuple(
        (name, slot.token_ids.tolist(), None if slot.latest is None else id(slot.latest))
        for name, slot in sorted(session.slots.items())
    )
    pools = getattr(method, "pools", {})
    anchors = tuple(
        (key, tuple((a.serial, a.uses, tuple(sorted(a.deltas))) for a in pool))
        for key, pool in sorted(pools.items())
    )
    profiles = tuple(sorted((k, tuple(p.requests)) for k, p in getattr(method, "profiles", {}).items()))
    requests = getattr(method, "_requests", None)
    decisions = None
    if requests is not None:
        state = requests.get(session)
        decisions = (tuple(sorted(state.decisions)), tuple(sorted(state.gate_reports)))
    return slots, len(session.turns), method.state_bytes(), anchors, profiles, decisions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_names_the_first_bad_tensor_in_every_dtype(dtype, bad):
    from hf_kvshare.cache import SegmentKV, check_finite

    def kv(n):
        return SegmentKV(
            keys=[torch.randn(1, 2, n, 4, dtype=dtype) * 1e3 for _ in range(3)],
            values=[torch.randn(1, 2, n, 4, dtype=dtype) for _ in range(3)],
            start=0,
        )

    good, empty, broken = kv(5), kv(0), kv(5)
    check_finite([("good", good), ("empty", empty)])  # large finite values and empty tensors pass
    broken.values[1][0, 1, 3, 2] = bad
    broken.keys[2][0, 0, 0, 0] = bad
    with pytest.raises(ValueError, match=r"^broken: non-finite K/V \(NaN or inf\) in layer 1 \(values\)"):
        check_finite([("good", good), ("empty", empty), ("broken", broken)])


@pytest.mark.parametrize("name", ["fullshared", "kvcmas", "kvcomm"])
def test_non_finite_kv_is_never_reused_or_pooled(name, tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    method = METHODS[name](**THREAD_METHODS.get(name, {}))
    for _ in range(2):  # earlier requests: pools hold anchors
        session = Session(model, tokenizer, method)
        for agent, segments in STEPS:
            session.run_turn(agent, segments, max_new_tokens=3)
    session = Session(model, tokenizer, method)
    session.run_turn(*STEPS[0], max_new_tokens=3)
    output = session.slots["first"].latest  # the output's K/V: every method reuses it
    if output is None:  # freed by the session: the method holds the producer's cache (kvcmas, kvcomm)
        output = method._requests.get(session).produced["first"]
    output.keys[2][..., 1, 0] = float("nan")
    before = _state(session, method)
    with pytest.raises(ValueError, match=r"PH slot 'first'.*non-finite K/V .* layer 2 \(keys\)"):
        session.run_turn(*STEPS[1], max_new_tokens=3)
    assert _state(session, method) == before


def test_non_finite_output_never_becomes_a_source_or_an_anchor(tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    with torch.no_grad():  # a model that yields inf K/V at layer 1 for every token
        model.model.layers[1].self_attn.v_proj.bias = torch.nn.Parameter(torch.full((32,), float("inf")))
    for name in ("kvcmas", "kvcomm", "graphflow"):
        method = METHODS[name]()
        session = Session(model, tokenizer, method)
        before = _state(session, method)
        with pytest.raises(ValueError, match=r"non-finite K/V .* layer 1 \(values\)"):
            for agent, segments in STEPS[:2]:
                session.run_turn(agent, segments, max_new_tokens=2)
        assert (
            method.state_bytes() == 0
            and not getattr(method, "pools", {})
            and not getattr(method, "profiles", {})
        )
        del before


class _Boom(Exception):
    pass


def _boom(input_ids, scores):
    raise _Boom("failed inside generate")


@pytest.mark.parametrize(
    "name, options, failing",
    [
        ("kvcomm", {"tau": 1.0}, 0),  # the query's first consumer gates it while building
        ("kvcmas", {"tau": 1.0, "gate_scope": "edge"}, 1),  # every edge gated while building
        ("kvcmas", {"tau": 1.0}, 1),
        ("graphflow", {"calibration_requests": 1}, 1),
    ],
)
def test_a_turn_failing_inside_generate_changes_nothing(name, options, failing, tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    method = METHODS[name](**options)
    for _ in range(3):  # pools fill up; the gate (tau = 1) then accepts
        session = Session(model, tokenizer, method)
        for agent, segments in STEPS:
            session.run_turn(agent, segments, max_new_tokens=3)
    session = Session(model, tokenizer, method)
    for agent, segments in STEPS[:failing]:
        session.run_turn(agent, segments, max_new_tokens=3)
    before = _state(session, method)
    with pytest.raises(_Boom):
        session.run_turn(*STEPS[failing], max_new_tokens=3, logits_processor=[_boom])
    assert _state(session, method) == before
    result = session.run_turn(*STEPS[failing], max_new_tokens=3)  # the same turn then runs normally
    assert any(seg.provenance == "corrected" for seg in result.segments)


# ---------------------------------------------------------------- 6. bounded state


def test_lru_dict_keeps_the_most_recently_used_entries():
    from hf_kvshare.anchors import LRUDict

    pools = LRUDict(8)
    for i in range(500):
        pools[f"doc{i}"] = i
        pools.touch("doc0")  # used on every request: never evicted
        assert len(pools) <= 8
    assert "doc0" in pools and list(pools)[-7:] == [f"doc{i}" for i in range(493, 500)][-6:] + ["doc0"]
    assert pools.evicted == 500 - 8
    _ = pools["doc495"]  # reading does not reorder
    assert list(pools)[-1] == "doc0"
    with pytest.raises(ValueError, match="int >= 1"):
        LRUDict(0)


@pytest.mark.parametrize(
    "name, options, key",
    [("kvcmas", {"max_pools": 3}, "pools"), ("graphflow", {"max_profiles": 4}, "profiles")],
)
def test_pools_and_profiles_per_instance_are_bounded(name, options, key, tokenizer):
    from hf_kvshare import PF, PH

    model = tiny_model("llama", seed=3, num_hidden_layers=2)
    method = METHODS[name](**options)
    for i in range(12):  # a new slot and agent name per request
        session = Session(model, tokenizer, method)
        session.run_turn(
            f"writer{i}", [PF("Write.\n"), PH(f"doc{i}", f"text number {i}"), PF(":")], max_new_tokens=1
        )
        session.run_turn(
            "reader", [PF("Read.\n"), PH(f"writer{i}"), PF(" and "), PH(f"doc{i}")], max_new_tokens=1
        )
    summary = method.state_summary()
    bound = next(iter(options.values()))
    assert summary[key] == len(getattr(method, key)) <= bound
    assert summary[f"max_{key}"] == bound and summary[f"evicted_{key}"] > 0
    assert summary["bytes"] == method.state_bytes()


# ---------------------------------------------------------------- 7. clear errors


def test_bad_segments_and_arguments_say_what_was_expected(tokenizer):
    from hf_kvshare import PF, PH

    with pytest.raises(TypeError, match=r"PF text must be a string; got 5 \(int\)"):
        PF(5)
    with pytest.raises(TypeError, match=r"PH slot must be a non-empty string .* got 3 \(int\)"):
        PH(3, "text")
    with pytest.raises(TypeError, match="PH text must be a string or None"):
        PH("query", 7)
    model = tiny_model("llama", seed=3)
    session = Session(model, tokenizer, "fullshared")
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got 2.5 \(float\)"):
        session.build_cache(*STEPS[0], batch_size=2.5)
    for bad in ("8", 1.5, 0, True):  # None: the generation_config's, else 64
        with pytest.raises(ValueError, match=rf"max_new_tokens must be an int >= 1, got {bad!r}"):
            session.run_turn(*STEPS[0], max_new_tokens=bad)
    with pytest.raises(ValueError, match=r"force_output ids must be in \[0, 49152\).*\[49152, -1\]"):
        session.run_turn(*STEPS[0], force_output=[5, 49152, -1])
    with pytest.raises(ValueError, match="integer token ids"):
        session.run_turn(*STEPS[0], force_output=[1.5])
    assert session.slots == {} and session.turns == []


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("kvcmas", {"tau": "0.3"}, r"tau must be a real number in \[0, 1\], got '0.3' \(str\)"),
        ("kvcmas", {"tau": True}, r"tau must be a real number in \[0, 1\], got True \(bool\)"),
        ("kvcmas", {"temperature": float("nan")}, r"temperature must be a finite real number > 0, got nan"),
        (
            "kvcomm",
            {"token_temperature": float("inf")},
            r"token_temperature must be a finite real number > 0",
        ),
        ("graphflow", {"rank": True}, r"rank must be a positive int or None \(dense\), got True"),
        ("graphflow", {"calibration_requests": True}, r"calibration_requests must be an int >= 1, got True"),
        ("droidspeak", {"layer_profile": [1.0, float("inf"), 0.0]}, r"finite numbers \(no NaN or inf\)"),
        ("kvcmas", {"max_pools": 0}, r"max_pools must be an int >= 1, got 0"),
        (
            "cacheblend",
            {"rhoo": 0.5},
            r"method 'cacheblend' has no option 'rhoo'; its options: rho, check_layers",
        ),
    ],
)
def test_bad_method_options_say_what_was_expected(name, options, message):
    from hf_kvshare.method import get_method

    with pytest.raises(ValueError, match=message):
        get_method(name, **options)


def test_generate_on_a_consumed_cache_with_a_one_token_prompt_is_refused(tokenizer):
    from hf_kvshare import PF
    from hf_kvshare.cache import PositionMismatchError

    model = tiny_model("llama", seed=3)
    cache, prompt = Session(model, tokenizer, "fullshared").build_cache("a", [PF("Hi")])
    assert prompt.shape == (1, 1)
    model.generate(input_ids=prompt, **cache_kwargs(cache), max_new_tokens=2, do_sample=False)
    with pytest.raises(PositionMismatchError, match="no token to feed.*already used by a generate call"):
        model.generate(input_ids=prompt, **cache_kwargs(cache), max_new_tokens=2, do_sample=False)


# ---------------------------------------------------------------- issue 26, item 3: generate options
def _no_build(session):
    """Make building the cache fail loudly: a refusal that comes after any work shows as this error."""

    def build(turn):
        raise AssertionError("the cache was built before the refusal")

    session.method.build = build
    return session


def test_a_generation_config_that_samples_samples(tokenizer):
    """``generation_config=GenerationConfig(do_sample=True, ...)`` samples (it decoded greedily): with
    a seed, the turn gives the tokens plain ``generate`` samples with that seed; another seed others."""
    from transformers import GenerationConfig

    model = tiny_model("llama", seed=3)
    config = GenerationConfig(do_sample=True, temperature=2.0, top_k=0, max_new_tokens=8)
    greedy = Session(model, tokenizer, "nonshared").run_turn(*STEPS[0], max_new_tokens=8).output_ids.tolist()
    sampled = []
    for seed in (0, 1, 2):
        session = Session(model, tokenizer, "nonshared")
        _, prompt = session.build_cache(*STEPS[0])
        torch.manual_seed(seed)
        plain = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=config
        )
        torch.manual_seed(seed)
        got = session.run_turn(*STEPS[0], generation_config=config).output_ids.tolist()
        assert got == plain[0, prompt.shape[1] :].tolist()
        sampled.append(got)
    assert any(s != greedy for s in sampled) and len({tuple(s) for s in sampled}) > 1
    limited = Session(model, tokenizer, "nonshared").run_turn(
        *STEPS[0], generation_config=GenerationConfig(max_new_tokens=3)
    )
    assert limited.output_ids.tolist() == greedy[:3]  # its max_new_tokens, the session's greedy default


def test_an_all_ones_attention_mask_reaches_generate_as_meant(tokenizer):
    model = tiny_model("llama", seed=3)
    session = Session(model, tokenizer, "fullshared")
    _, prompt = session.build_cache(*STEPS[0])
    expected = Session(model, tokenizer, "fullshared").run_turn(*STEPS[0], max_new_tokens=4).output_ids
    for mask in (torch.ones_like(prompt), torch.ones(prompt.shape[1], dtype=torch.long)):
        got = Session(model, tokenizer, "fullshared").run_turn(
            *STEPS[0], max_new_tokens=4, attention_mask=mask
        )
        assert torch.equal(got.output_ids, expected)


def _refusals(prompt_length):
    from transformers import GenerationConfig

    return [
        (
            dict(generation_config=GenerationConfig(num_beams=3)),
            r"one sequence.*num_beams=3 \(in the generation_config\)",
        ),
        (dict(num_beams=2), "one sequence.*num_beams=2"),
        (dict(num_return_sequences=2, do_sample=True), "one sequence.*num_return_sequences=2"),
        (dict(return_dict_in_generate=True), "not generate's dict outputs.*return_dict_in_generate=True"),
        (dict(generation_config=GenerationConfig(output_scores=True)), "dict outputs.*output_scores=True"),
        (dict(attention_mask=torch.tensor([[0] + [1] * (prompt_length - 1)])), r"all ones.*with 1 zeros"),
        (
            dict(attention_mask=torch.ones(1, prompt_length + 2)),
            rf"shape \[1, {prompt_length}\]; got shape \[1, {prompt_length + 2}\]",
        ),
        (dict(generation_config={"do_sample": True}), "must be a transformers.GenerationConfig, got dict"),
        (dict(input_ids=torch.ones(1, 3, dtype=torch.long)), "run_turn sets input_ids itself"),
        (dict(past_key_values=None), "run_turn sets past_key_values itself"),
        (dict(max_length=10), "max_new_tokens=, not max_length=10"),
        (dict(temprature=0.5), "'temprature' is neither a GenerationConfig field"),
        (dict(force_output=[5, 6], do_sample=True), r"force_output= teacher-forces.*\['do_sample'\]"),
    ]


def test_generate_options_run_turn_cannot_honour_are_refused_before_any_work(tokenizer):
    model = tiny_model("llama", seed=3)
    _, prompt = Session(model, tokenizer, "fullshared").build_cache(*STEPS[0])
    for options, message in _refusals(prompt.shape[1]):
        session = _no_build(Session(model, tokenizer, "fullshared"))
        with pytest.raises(ValueError, match=message):
            session.run_turn(*STEPS[0], **options)
        assert session.slots == {} and session.turns == []


@pytest.mark.parametrize("name", ["nonshared", "fullshared"])
def test_teacher_forcing_more_tokens_than_the_prompt_holds(name, tokenizer):
    """The teacher-forced pass is a direct forward over the built cache, no generate call: its inputs
    are not a prompt to check against the cache's digest. Forcing more tokens than the prompt has
    (a short prompt, a long output) was refused as "another prompt" (found by a text-only task on a
    vision-language model: a 40-token prompt, 48 forced tokens). The forced logits are the plain
    forward's over prompt + forced tokens."""
    model = tiny_model("llama", seed=3)
    forced = torch.arange(40, 40 + 30) % 300
    turn = Session(model, tokenizer, name).run_turn("a", [PF("Hi:")], force_output=forced)
    prompt = turn.prompt_ids.reshape(1, -1)
    assert forced.numel() > prompt.shape[1] + 1  # the case: more forced tokens than the prompt holds
    assert turn.output_ids.tolist() == forced.tolist()
    with torch.no_grad():
        plain = model(input_ids=torch.cat([prompt, forced[None, :-1]], dim=1)).logits[
            0, prompt.shape[1] - 1 :
        ]
    torch.testing.assert_close(turn.logits, plain.float(), rtol=1e-4, atol=1e-4)


def test_a_cache_refuses_a_prompt_it_was_not_built_for(tokenizer):
    """A cache records a digest of the token ids it holds: generate over another prompt of the same
    length, or a batch of two prompts for a batch-1 cache, is refused on the first forward (before it
    writes anything); generate's own copies of the prompt (beams, several samples) pass."""
    model = tiny_model("llama", seed=3)
    session = Session(model, tokenizer, "fullshared")
    cache, prompt = session.build_cache(*STEPS[0])
    other = prompt.clone()
    other[0, 2] = (other[0, 2] + 1) % 49152  # same length, one early token different, same tail
    held = cache.get_seq_length()
    for ids, message in (
        (other, "another prompt than row 0"),
        (torch.cat([prompt, other]), "another prompt than row 1"),
    ):
        used = cache.copy()
        with pytest.raises(ValueError, match=message):
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=2,
                do_sample=False,
                **cache_kwargs(used),
            )
        assert used.get_seq_length() == held  # refused before the forward wrote anything
    twice = torch.cat([prompt, prompt])  # copies of the prompt it was built for
    out = model.generate(
        input_ids=twice,
        attention_mask=torch.ones_like(twice),
        max_new_tokens=2,
        do_sample=False,
        **cache_kwargs(cache.copy()),
    )
    beams = model.generate(
        input_ids=prompt, max_new_tokens=3, num_beams=3, do_sample=False, **cache_kwargs(cache.copy())
    )
    plain = model.generate(input_ids=prompt, max_new_tokens=3, num_beams=3, do_sample=False)
    assert out.shape == (2, prompt.shape[1] + 2) and torch.equal(beams, plain)


# ---------------------------------------------------------------- issue 26, item 5: smaller items
def test_chat_content_and_roles_are_checked(tokenizer):
    from hf_kvshare import PF, PH, chat

    with pytest.raises(TypeError, match="content must be a str, PF, PH or a list of them; got a dict"):
        chat(tokenizer, [{"role": "user", "content": {"text": "hello", "extra": 1}}])
    with pytest.raises(ValueError, match="role must be a string without the segment marker"):
        chat(tokenizer, [{"role": "user\u27e6hfkv:0\u27e7", "content": [PH("q", "What?"), PF(" ok")]}])
    segments = chat(tokenizer, [{"role": "user", "content": [PH("q", "What?"), " ok"]}])
    assert [s.slot for s in segments if isinstance(s, PH)] == ["q"]


def test_an_output_slot_is_a_non_empty_string(tokenizer):
    session = Session(tiny_model("llama", seed=3), tokenizer, "fullshared")
    for bad in (7, "", b"x"):
        with pytest.raises(ValueError, match=f"output_slot must be a non-empty string.*got {bad!r}"):
            session.run_turn(*STEPS[0], max_new_tokens=2, output_slot=bad)
    assert session.slots == {}
    assert session.run_turn(*STEPS[0], max_new_tokens=2, output_slot="first-out").output_slot == "first-out"


@pytest.mark.parametrize("name, option", [("kvcmas", "eviction_window"), ("kvcomm", "eviction_window")])
def test_a_bool_is_not_an_int_option(name, option):
    with pytest.raises(ValueError, match=f"{option} must be an int.*got True"):
        METHODS[name](**{option: True})


def test_a_prompt_agent_on_the_inner_model_of_a_peft_model_is_refused(tokenizer):
    """The inner model of a PeftModel runs its active adapter: refused, unless the adapters are
    disabled through PEFT (then it is the base model, token for token)."""
    from lora_helpers import lora_model

    model, plain = lora_model(keep_base=True)
    inner = model.get_base_model()
    with pytest.raises(ValueError, match=r"adapter\(s\) \['plan'\] acting.*disable_adapter"):
        Session(inner, tokenizer, "nonshared").run_turn(*STEPS[0], max_new_tokens=3)
    with model.disable_adapter():
        got = Session(inner, tokenizer, "nonshared").run_turn(*STEPS[0], max_new_tokens=3).output_ids
    expected = Session(plain, tokenizer, "nonshared").run_turn(*STEPS[0], max_new_tokens=3).output_ids
    assert torch.equal(got, expected)


def test_peft_agents_from_two_threads_at_once_are_refused(tokenizer):
    """One PeftModel's active adapter is model-wide: a second thread's turn while one runs is refused
    loudly (it silently ran with the other thread's adapter); one after another they run."""
    from lora_helpers import lora_model

    from hf_kvshare.agents import agent_adapter

    model = lora_model()
    segments = STEPS[0][1]
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold():
        with agent_adapter(model, "act"):
            inside.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(60)
    try:
        with pytest.raises(RuntimeError, match="another thread.*cannot run concurrently"):
            Session(model, tokenizer, "nonshared").run_turn("plan", segments, max_new_tokens=2)
    finally:
        release.set()
        holder.join()
    expected = Session(model, tokenizer, "nonshared").run_turn("plan", segments, max_new_tokens=2).output_ids

    def later():
        try:
            errors.append(Session(model, tokenizer, "nonshared").run_turn("plan", segments, max_new_tokens=2))
        except BaseException as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=later)
    thread.start()
    thread.join()
    assert torch.equal(errors[0].output_ids, expected)


def test_a_repeated_method_option_is_refused():
    from hf_kvshare.bench.methods import MethodSpec

    with pytest.raises(ValueError, match="method option 'tau' is given twice in 'kvcmas:tau=0.3,tau=0.9'"):
        MethodSpec.parse("kvcmas:tau=0.3,tau=0.9")
    assert MethodSpec.parse("kvcmas:tau=0.3,capacity=4").kwargs == {"tau": 0.3, "capacity": 4}


# ---------------------------------------------------------------- issue 26: the adversarial re-run
# Fresh cases (not the examples), classified by tests/adversarial.py; the table of a run:
#   OMP_NUM_THREADS=1 PYTHONPATH=.:tests python tests/adversarial.py
import functools  # noqa: E402

from adversarial import Case, assert_holds  # noqa: E402

_GEN = "generate / run_turn options"


@functools.cache
def _tok():
    from tiny import embedded_tokenizer

    return embedded_tokenizer()


@functools.cache
def _model(seed: int = 3, layers: int = 3):
    return tiny_model("llama", seed=seed, num_hidden_layers=layers)


@functools.cache
def _prompt():
    return Session(_model(), _tok(), "nonshared").build_cache(*STEPS[0])[1]


def _plain(options: dict, seed: int = 0) -> list[int]:
    """What plain ``generate`` gives for the first step's prompt with ``options`` (the session's
    default of greedy decoding where they set nothing), trailing EOS dropped as the session does."""
    prompt, model = _prompt(), _model()
    options = dict(options)
    if "generation_config" not in options:
        options.setdefault("do_sample", False)
    options.setdefault("max_new_tokens", 6)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **options)
    session = Session(_model(), _tok(), "nonshared")
    return session._strip_eos(out[0, prompt.shape[1] :]).tolist()


class _Untouched:
    """A session whose method's build fails loudly (a refusal must come before any work)."""

    def __init__(self, method="nonshared"):
        self.session = _no_build(Session(_model(), _tok(), method))

    def __call__(self):
        return self.session.slots == {} and self.session.turns == []


def _gen_refused(label, options, match, method="nonshared"):
    box = {}

    def run():
        from adversarial import Late

        box["s"] = _Untouched(method)
        given = options() if callable(options) else options
        try:
            return box["s"].session.run_turn(*STEPS[0], **given)
        except AssertionError as error:  # not refused before the cache was built: what does it do then?
            if "built before the refusal" not in str(error):
                raise
        del box["s"]
        try:
            return Session(_model(), _tok(), method).run_turn(*STEPS[0], **given)
        except Exception as error:
            raise Late(error) from error

    return Case(_GEN, label, run, match, None, lambda: "s" not in box or box["s"]())


def _gen_honoured(label, options, seed=0, reference=None):
    """``run_turn(**options)`` gives what plain generate gives with them (same seed)."""

    given = {}

    def run():
        given.update(options() if callable(options) else options)
        session = Session(_model(), _tok(), "nonshared")
        torch.manual_seed(seed)
        return session.run_turn(*STEPS[0], **given).output_ids.tolist()

    return Case(_GEN, label, run, None, lambda got: got == (reference or _plain)(given, seed))


class _StopAfter:
    def __init__(self, n):
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full(
            (input_ids.shape[0],), input_ids.shape[1] - _prompt().shape[1] >= self.n, dtype=torch.bool
        )


class _Streamer:
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def _streamed():
    streamer = _Streamer()
    got = Session(_model(), _tok(), "nonshared").run_turn(*STEPS[0], max_new_tokens=5, streamer=streamer)
    return got.output_ids.tolist(), streamer


def _ban_first(input_ids, scores):
    scores[:, _plain({})[0]] = -float("inf")
    return scores


def _config(**fields):
    """A GenerationConfig with fields set past its own validation (as a user may assign them)."""
    from transformers import GenerationConfig

    config = GenerationConfig()
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def _gen_cases():
    from transformers import GenerationConfig, StoppingCriteriaList

    return [
        _gen_honoured(
            "sampling with temperature and top_k",
            dict(do_sample=True, temperature=0.7, top_k=50, max_new_tokens=6),
            seed=1,
        ),
        _gen_honoured("sampling with top_p", dict(do_sample=True, top_p=0.8, max_new_tokens=6), seed=2),
        _gen_honoured(
            "sampling with typical_p", dict(do_sample=True, typical_p=0.9, max_new_tokens=6), seed=3
        ),
        _gen_honoured(
            "a sampling generation_config",
            dict(generation_config=GenerationConfig(do_sample=True, top_k=5, max_new_tokens=6)),
            seed=4,
        ),
        _gen_honoured(
            "a config's do_sample overridden by a keyword",
            dict(generation_config=GenerationConfig(do_sample=True, max_new_tokens=6), do_sample=False),
        ),
        _gen_honoured("repetition_penalty", dict(repetition_penalty=1.5, max_new_tokens=6)),
        _gen_honoured("no_repeat_ngram_size", dict(no_repeat_ngram_size=1, max_new_tokens=6)),
        _gen_honoured("bad_words_ids", lambda: dict(bad_words_ids=[[_plain({})[0]]], max_new_tokens=6)),
        _gen_honoured("suppress_tokens", lambda: dict(suppress_tokens=[_plain({})[0]], max_new_tokens=6)),
        _gen_honoured("min_new_tokens with an EOS-free model", dict(min_new_tokens=4, max_new_tokens=6)),
        _gen_honoured("eos_token_id as a list", lambda: dict(eos_token_id=[_plain({})[2]], max_new_tokens=6)),
        _gen_honoured("num_beams=1 stated", dict(num_beams=1, max_new_tokens=6)),
        _gen_honoured(
            "num_return_sequences=1 with sampling",
            dict(num_return_sequences=1, do_sample=True, max_new_tokens=6),
            seed=5,
        ),
        _gen_honoured(
            "a stopping criterion",
            dict(stopping_criteria=StoppingCriteriaList([_StopAfter(2)]), max_new_tokens=6),
        ),
        _gen_honoured("a logits processor", dict(logits_processor=[_ban_first], max_new_tokens=6)),
        _gen_refused(
            "prompt lookup decoding",
            dict(prompt_lookup_num_tokens=2),
            r"cannot honour prompt_lookup_num_tokens=.*re-feeds",
        ),
        _gen_honoured(
            "stop_strings (the session's tokenizer)",
            lambda: dict(stop_strings=[_tok().decode(_plain({})[1:2])], max_new_tokens=6),
            reference=lambda o, s: _plain({**o, "tokenizer": _tok()}, s),
        ),
        Case(
            _GEN,
            "a streamer",
            _streamed,
            None,
            lambda got: got[1].ended and sum(got[1].tokens[1:], []) == got[0],
        ),
        _gen_honoured(
            "max_new_tokens from the generation_config",
            dict(generation_config=GenerationConfig(max_new_tokens=2)),
            reference=lambda o, s: _plain({"max_new_tokens": 2}),
        ),
        _gen_refused(
            "max_new_tokens=0 in the generation_config",
            lambda: dict(generation_config=_config(max_new_tokens=0)),
            r"max_new_tokens must be an int >= 1, got 0",
        ),
        _gen_refused(
            "max_length in the generation_config",
            dict(generation_config=GenerationConfig(max_length=5)),
            r"max_new_tokens=, not max_length=5",
        ),
        _gen_refused(
            "max_new_tokens=-3", dict(max_new_tokens=-3), r"max_new_tokens must be an int >= 1, got -3"
        ),
        _gen_refused(
            "max_new_tokens past the positions", dict(max_new_tokens=10**6), r"max_position_embeddings"
        ),
        _gen_refused(
            "temperature=0 with sampling", dict(do_sample=True, temperature=0.0), r"temperature.*0\.0"
        ),
        _gen_refused(
            "temperature=-1 with sampling", dict(do_sample=True, temperature=-1.0), r"temperature.*-1\.0"
        ),
        _gen_refused("top_p=1.5", dict(do_sample=True, top_p=1.5), r"top_p.*1\.5"),
        _gen_refused("do_sample='yes'", dict(do_sample="yes"), r"do_sample.*'yes'"),
        _gen_refused(
            "num_beams=4 with length_penalty",
            dict(num_beams=4, length_penalty=0.5),
            r"one sequence.*num_beams=4",
        ),
        _gen_refused(
            "force_words_ids (constrained beam search)",
            dict(force_words_ids=[[5]]),
            r"force_words_ids|constrain|beam",
        ),
        _gen_refused(
            "num_return_sequences=3 in the config",
            dict(generation_config=GenerationConfig(num_return_sequences=3, do_sample=True)),
            r"num_return_sequences=3",
        ),
        _gen_refused(
            "output_attentions", dict(output_attentions=True), r"dict outputs.*output_attentions=True"
        ),
        _gen_refused(
            "output_hidden_states in the config",
            dict(generation_config=GenerationConfig(output_hidden_states=True)),
            r"output_hidden_states=True",
        ),
        _gen_refused("output_logits", dict(output_logits=True), r"output_logits=True"),
        _gen_refused("cache= given", dict(cache=None), r"run_turn sets cache itself"),
        _gen_refused(
            "position_ids given", dict(position_ids=torch.arange(3)[None]), r"run_turn sets position_ids"
        ),
        _gen_refused(
            "inputs_embeds given", dict(inputs_embeds=torch.zeros(1, 3, 64)), r"run_turn sets inputs_embeds"
        ),
        _gen_refused("use_cache=False", dict(use_cache=False), r"run_turn sets use_cache"),
        _gen_refused(
            "an attention mask for two rows",
            lambda: dict(attention_mask=torch.ones(2, _prompt().shape[1])),
            r"shape \[1, \d+\]; got shape \[2, \d+\]",
        ),
        _gen_refused(
            "a left-padded attention mask",
            lambda: dict(attention_mask=torch.tensor([[0, 0] + [1] * (_prompt().shape[1] - 2)])),
            r"all ones.*2 zeros",
        ),
        _gen_refused(
            "an attention mask that is a string",
            dict(attention_mask="ones"),
            r"attention_mask must be a tensor of ones, got 'ones'",
        ),
        _gen_refused(
            "a logits processor that is not a list",
            dict(logits_processor=_ban_first),
            r"logits_processor must be a list.*function",
        ),
        _gen_refused(
            "stopping_criteria that is not a list",
            dict(stopping_criteria=_StopAfter(2)),
            r"stopping_criteria must be a list.*_StopAfter",
        ),
        _gen_refused("a streamer without put/end", dict(streamer=object()), r"streamer.*put.*end.*object"),
        _gen_refused(
            "assistant_model (assisted decoding)", lambda: dict(assistant_model=_model()), r"assistant_model"
        ),
        _gen_refused(
            "negative_prompt_ids",
            dict(negative_prompt_ids=torch.ones(1, 2, dtype=torch.long)),
            r"negative_prompt_ids",
        ),
        _gen_refused(
            "a generation_config that is a GenerationConfig class",
            dict(generation_config=GenerationConfig),
            r"GenerationConfig, got type",
        ),
        _gen_refused(
            "force_output for two rows",
            dict(force_output=[[5, 6], [7, 8]]),
            r"force_output.*one sequence|shape",
        ),
        _gen_refused(
            "force_output with a keyword",
            dict(force_output=[5], streamer=_Streamer()),
            r"force_output= teacher-forces",
        ),
    ]


ADVERSARIAL_GENERATE = _gen_cases()


@pytest.mark.parametrize("case", ADVERSARIAL_GENERATE, ids=lambda c: c.name)
def test_adversarial_generate_options(case):
    assert_holds(case)


ADVERSARIAL = [*ADVERSARIAL_GENERATE]


# ---- session inputs
_INPUTS = "session inputs"


def _greedy_of(ids: torch.Tensor, n: int, model=None) -> list[int]:
    model = model or _model()
    prompt = ids[None]
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False
        )
    return Session(model, _tok(), "nonshared")._strip_eos(out[0, prompt.shape[1] :]).tolist()


def _input_ok(label, turns, method="nonshared", tokenizer=None):
    """Legitimate inputs: every turn runs, its prompt is the segments tokenized one by one, and (NonShared)
    its output is plain greedy generate's over that prompt."""

    def run():
        session = Session(_model(), tokenizer or _tok(), method)
        return [
            session.run_turn(agent, segments() if callable(segments) else segments, max_new_tokens=3)
            for agent, segments in turns
        ]

    def check(results):
        return all(r.output_ids.tolist() == _greedy_of(r.prompt_ids, 3) for r in results)

    return Case(_INPUTS, label, run, None, check)


def _input_refused(label, turns, match, tokenizer=None, model=None):
    """The last turn is refused; the turns before it ran; the session is as they left it."""
    box = {}

    def run():
        session = box["s"] = Session(model() if model else _model(), tokenizer or _tok(), "fullshared")
        for agent, segments in turns[:-1]:
            session.run_turn(agent, segments, max_new_tokens=2)
        box["before"] = (dict(session.slots), dict(session.aliases), len(session.turns))
        agent, segments = turns[-1]
        return session.run_turn(agent, segments() if callable(segments) else segments, max_new_tokens=2)

    def after():
        s = box.get("s")
        return (
            s is None
            or "before" not in box
            or (dict(s.slots), dict(s.aliases), len(s.turns)) == box["before"]
        )

    return Case(_INPUTS, label, run, match, None, after)


@functools.cache
def _plain_tokenizer():
    """The embedded tokenizer without a chat template."""
    import copy

    tok = copy.deepcopy(_tok())
    tok.chat_template = None
    return tok


def _input_cases():
    from hf_kvshare import PF, PH

    q = [PF("Task: "), PH("query", "Add two and two."), PF("\nAnswer:")]
    msgs = lambda content, role="user": [{"role": role, "content": content}]  # noqa: E731
    return [
        _input_refused("agent ''", [("", q)], r"agent must be a non-empty string, got ''"),
        _input_refused("agent None", [(None, q)], r"agent must be a non-empty string, got None"),
        _input_refused("agent 5", [(5, q)], r"agent must be a non-empty string, got 5"),
        _input_refused("agent b'x'", [(b"x", q)], r"agent must be a non-empty string, got b'x'"),
        _input_ok(
            "a unicode agent name and text",
            [("планировщик", [PF("Задача: "), PH("query", "сложить 2 и 2 ✓"), PF("\n→")])],
        ),
        _input_ok("an agent name with newlines and spaces", [("a b\nc", q)]),
        _input_ok("an agent name of 10000 characters", [("a" * 10000, q)]),
        _input_ok("one agent twice (a#2)", [("a", q), ("a", q + [PF(" "), PH("a")])]),
        _input_ok(
            "agent 'a#2' after two turns of 'a' (its output: 'a#2#2')",
            [("a", q), ("a", q), ("a#2", q + [PF(" "), PH("a#2")])],
        ),
        Case(
            _INPUTS,
            "output_slot naming a given slot",
            lambda: Session(_model(), _tok(), "fullshared").run_turn("a", q, output_slot="query"),
            r"output slot 'query' already exists",
        ),
        Case(
            _INPUTS,
            "output_slot naming an output",
            lambda: (lambda s: (s.run_turn("a", q, max_new_tokens=2), s.run_turn("b", q, output_slot="a")))(
                Session(_model(), _tok(), "fullshared")
            ),
            r"output slot 'a' already exists",
        ),
        _input_refused(
            "one slot, two texts in one turn",
            [("a", [PH("x", "one"), PF(" "), PH("x", "two")])],
            r"PH slot 'x' already holds 'one'.*'two'",
        ),
        _input_refused(
            "a slot never recorded",
            [("a", [PF("Read "), PH("nobody")])],
            r"PH slot 'nobody' was never recorded.*recorded slots: none",
        ),
        _input_refused(
            "PH text ''", [("a", [PF("x"), PH("q", "")])], r"PH slot 'q': text '' tokenizes to zero tokens"
        ),
        _input_refused(
            "PF text ''", [("a", [PF(""), PH("q", "hi")])], r"segment 0 \(PF ''\) tokenizes to zero tokens"
        ),
        _input_ok("PF text ' '", [("a", [PF(" "), PH("q", "hi there")])]),
        _input_ok(
            "a NUL and control characters in text", [("a", [PF("x\x00\x01\t"), PH("q", "\x7f\x00 y")])]
        ),
        _input_refused(
            "20000 words",
            [("a", [PF("go "), PH("q", "word " * 20000)])],
            r"needs \d+ prompt \+ 2 new tokens.*supports 512",
        ),
        _input_refused(
            "segments a str", [("a", "hello")], r"segments must be a list of PF/PH.*not a single segment"
        ),
        _input_refused("segments a PF", [("a", PF("hello"))], r"not a single segment"),
        _input_refused("segments []", [("a", [])], r"a turn needs at least one segment"),
        _input_refused(
            "a None segment", [("a", [PF("x"), None])], r"segment 1 is a NoneType; expected PF, PH or str"
        ),
        _input_refused(
            "an int segment", [("a", [PF("x"), 3])], r"segment 1 is a int; expected PF, PH or str"
        ),
        _input_refused(
            "a dict among segments",
            [("a", [PF("x"), {"role": "user", "content": "y"}])],
            r"segment 1 is a dict",
        ),
        _input_ok("segments a generator", [("a", lambda: (s for s in q))]),
        _input_ok("segments a tuple", [("a", tuple(q))]),
        _input_refused(
            "chat without a template",
            [("a", msgs("hello"))],
            r"no chat template",
            tokenizer=_plain_tokenizer(),
        ),
        _input_ok("PF/PH without a template", [("a", q)], tokenizer=_plain_tokenizer()),
        _input_refused(
            "a message without content",
            [("a", [{"role": "user"}])],
            r"needs 'role' and 'content'; got keys \['role'\]",
        ),
        _input_refused(
            "message content None",
            [("a", msgs(None))],
            r"content must be a str, PF, PH or a list of them; got a NoneType",
        ),
        _input_refused(
            "message role None", [("a", [{"role": None, "content": "x"}])], r"role must be a string.*got None"
        ),
        _input_refused(
            "message content [1]", [("a", msgs([1]))], r"content items must be str, PF or PH; got int"
        ),
        _input_ok(
            "the segment marker in message text (kept as text)", [("a", msgs(["a \u27e6hfkv:0\u27e7 b"]))]
        ),
        _input_ok(
            "a PH in a system message",
            [
                (
                    "a",
                    lambda: _chat(
                        [
                            {"role": "system", "content": [PH("query", "Add.")]},
                            {"role": "user", "content": "go"},
                        ]
                    ),
                )
            ],
        ),
        _input_refused(
            "PH kind 'answer'",
            [("a", lambda: [PH("q", "x", kind="answer")])],
            r"kind must be one of 'question', 'observation' or None.*'answer'",
        ),
        _input_refused(
            "two questions in one request",
            [("a", [PH("q1", "one", kind="question"), PF(" "), PH("q2", "two", kind="question")])],
            r"question",
        ),
        _input_refused(
            "a slot restated with another kind",
            [
                ("a", [PH("q", "one", kind="observation"), PF(" ")]),
                ("b", [PH("q", kind="question"), PF(" ")]),
            ],
            r"stated as kind='question'.*observation",
        ),
        _input_refused(
            "an output restated as a question",
            [("a", q), ("b", [PH("a", kind="question"), PF(" ")])],
            r"stated as kind='question'.*output of 'a'",
        ),
        _input_refused(
            "PH slot b'q'", [("a", lambda: [PH(b"q", "x")])], r"PH slot must be a non-empty string.*b'q'"
        ),
        _input_refused(
            "PF label 3", [("a", lambda: [PF("x", label=3)])], r"PF label must be a string or None; got 3"
        ),
        _input_refused(
            "text past a small model's vocabulary",
            [("a", [PF("Task: "), PH("query", "Add two and two.")])],
            r"token ids \[\d+.*outside the model's vocabulary of 1000",
            model=lambda: _model_vocab(1000),
        ),
        _input_ok(
            "one text under two names", [("a", [PH("x", "same text"), PF(" and "), PH("y", "same text")])]
        ),
        _input_ok("a prompt ending in an output", [("a", q), ("b", [PF("Read: "), PH("a")])]),
        _input_ok("a one-token prompt", [("a", [PF("Hi")])]),
    ]


def _chat(messages):
    from hf_kvshare import chat

    return chat(_tok(), messages)


@functools.cache
def _model_vocab(vocab):
    return tiny_model("llama", seed=3, vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=2)


ADVERSARIAL_INPUTS = _input_cases()


@pytest.mark.parametrize("case", ADVERSARIAL_INPUTS, ids=lambda c: c.name)
def test_adversarial_session_inputs(case):
    assert_holds(case)


ADVERSARIAL += ADVERSARIAL_INPUTS


# ---- method options
_OPTIONS = "method options"


def _runs(name, options, layers=4):
    """A method built from ``options`` runs a two-turn workflow on a tiny model of ``layers`` layers."""
    model = _model(layers=layers)
    session = Session(model, _tok(), METHODS[name](**options))
    return [
        session.run_turn(agent, segments, max_new_tokens=2).output_ids.tolist()
        for agent, segments in STEPS[:2]
    ]


def _option_refused(name, options, match, layers=4):
    """Refused when constructed, or when the session binds it to the model, or at the latest before a
    turn does any work; the model-free part first."""
    label = f"{name}:" + ",".join(f"{k}={v!r}" for k, v in options.items())
    return Case(_OPTIONS, label, lambda: _runs(name, options, layers), match)


def _option_runs(name, options, layers=4):
    label = f"{name}:" + ",".join(f"{k}={v!r}" for k, v in options.items()) + " (runs)"
    return Case(_OPTIONS, label, lambda: _runs(name, options, layers), None, lambda got: len(got) == 2)


def _spec(text, match=None, kwargs=None):
    """A ``name:opt=val`` string as the command line takes it: parsed, then the method constructed."""
    from hf_kvshare.bench.methods import MethodSpec

    def run():
        spec = MethodSpec.parse(text)
        spec.cls(**spec.kwargs)
        return spec.kwargs

    return Case(
        _OPTIONS,
        f"parse {text!r}",
        run,
        match,
        None if kwargs is None else (lambda got: got == kwargs),
    )


def _options_cases():
    nan = float("nan")
    return [
        _option_refused("kvcmas", {"tau": -0.1}, r"tau .*in \[0, 1\], got -0.1"),
        _option_refused("kvcmas", {"tau": 1.5}, r"tau .*in \[0, 1\], got 1.5"),
        _option_refused("kvcmas", {"tau": nan}, r"tau must be a real number in \[0, 1\], got nan"),
        _option_refused("kvcmas", {"tau": None}, r"tau must be a real number in \[0, 1\], got None"),
        _option_refused("kvcmas", {"capacity": 0}, r"capacity must be an int >= 2 .*got 0"),
        _option_refused("kvcmas", {"capacity": 2.5}, r"capacity must be an int >= 2 .*got 2.5"),
        _option_refused("kvcmas", {"capacity": True}, r"capacity must be an int >= 2 .*got True"),
        _option_refused(
            "kvcmas", {"base_rank": 0}, r"base_rank must be a positive int or None \(dense\), got 0"
        ),
        _option_refused(
            "kvcmas", {"delta_rank": "32"}, r"delta_rank must be a positive int or None \(dense\), got '32'"
        ),
        _option_refused("kvcmas", {"temperature": 0}, r"temperature must be a finite real number > 0, got 0"),
        _option_refused(
            "kvcmas",
            {"token_temperature": -1.0},
            r"token_temperature must be a finite real number > 0, got -1.0",
        ),
        _option_refused("kvcmas", {"eviction_window": 0}, r"eviction_window must be an int >= 1, got 0"),
        _option_refused("kvcmas", {"gate_scope": "bogus"}, r"gate_scope.*'bogus'"),
        _option_refused("kvcmas", {"output_source": "bogus"}, r"output_source.*'bogus'"),
        _option_refused("kvcmas", {"text_source": 3}, r"text_source.*3"),
        _option_refused("kvcmas", {"gating": "bogus"}, r"gating.*'bogus'"),
        _option_refused("kvcmas", {"match": "bogus"}, r"match.*'bogus'"),
        _option_refused("kvcmas", {"svd": "bogus"}, r"svd.*'bogus'"),
        _option_refused("kvcmas", {"pool_peak": "bogus"}, r"pool_peak.*'bogus'"),
        _option_refused("kvcmas", {"delta_frame": "bogus"}, r"delta_frame.*'bogus'"),
        _option_refused("kvcmas", {"key_frame": None}, r"key_frame.*None"),
        _option_refused("kvcmas", {"prefix_scope": "bogus"}, r"prefix_scope.*'bogus'"),
        _option_refused("kvcmas", {"prefix_reuse": "yes"}, r"prefix_reuse.*'yes'"),
        _option_refused("kvcmas", {"partial_coverage": 1}, r"partial_coverage.*1"),
        _option_refused("kvcmas", {"guard": "no"}, r"guard.*'no'"),
        _option_refused("kvcmas", {"skip_layer0": None}, r"skip_layer0.*None"),
        _option_refused("kvcmas", {"weights_cache": 0}, r"weights_cache.*0"),
        _option_refused("kvcmas", {"lead_in": -1}, r"lead_in.*-1"),
        _option_refused("kvcmas", {"max_pools": 2.0}, r"max_pools must be an int >= 1, got 2.0"),
        _option_refused("kvcmas", {"turn_fallback": "bogus"}, r"turn_fallback.*'bogus'"),
        _option_refused("kvcmas", {"observation_source": "bogus"}, r"observation_source.*'bogus'"),
        _option_runs("kvcmas", {"base_rank": 4, "delta_rank": 2, "capacity": 2, "tau": 1.0}),
        _option_runs("kvcmas", {"gate_scope": "edge", "tau": 0.0}),
        _option_runs("kvcomm", {"base_rank": 10**6}),
        _option_refused("cacheblend", {"rho": 1.5}, r"rho.*\[0, 1\].*1.5"),
        _option_refused("cacheblend", {"rho": nan}, r"rho.*nan"),
        _option_refused("cacheblend", {"check_layers": ()}, r"check_layers must name at least one layer"),
        _option_refused("cacheblend", {"check_layers": (99,)}, r"check_layers.*99.*4 layers|layer 99"),
        _option_refused("cacheblend", {"check_layers": "1"}, r"check_layers.*'1'"),
        _option_refused("cacheblend", {"check_layers": (1.5,)}, r"check_layers.*1.5"),
        _option_refused("droidspeak", {"max_groups": 0}, r"max_groups must be an int >= 1; got 0"),
        _option_refused(
            "droidspeak",
            {"layer_profile": [0.1, 0.2]},
            r"layer profile has 2 entries but the model has 4 layers",
        ),
        _option_refused("droidspeak", {"layer_profile": []}, r"layer_profile.*\[\]|at least one"),
        _option_refused("droidspeak", {"layer_profile": "0.1,0.2"}, r"layer_profile.*'0.1,0.2'|path|file"),
        _option_refused("droidspeak", {"rho": -0.5}, r"rho.*-0.5"),
        _option_refused("relaycaching", {"band": (0.8, 0.2)}, r"band.*\(0.8, 0.2\)"),
        _option_refused("relaycaching", {"band": (0.0, 2.0)}, r"band.*2.0"),
        _option_refused("relaycaching", {"band": "x"}, r"band.*'x'"),
        _option_refused(
            "relaycaching",
            {"band": (0.25, 0.75)},
            r"band \(0.25, 0.75\) covers layers \[1, 2\) of 3.*at least two layers",
            layers=3,
        ),
        _option_refused(
            "graphflow", {"calibration_requests": 0}, r"calibration_requests must be an int >= 1, got 0"
        ),
        _option_refused("graphflow", {"rank": 0}, r"rank must be a positive int or None \(dense\), got 0"),
        _option_refused("graphflow", {"max_profiles": -1}, r"max_profiles must be an int >= 1, got -1"),
        _option_refused("fullshared", {"prefix_scope": "bogus"}, r"prefix_scope.*'bogus'"),
        _option_refused("fullshared", {"prefix_reuse": 1}, r"prefix_reuse.*1"),
        _option_runs("fullshared", {"prefix_reuse": True, "prefix_scope": "request"}),
        Case(
            _OPTIONS,
            "get_method('KVCMAS')",
            lambda: METHODS.get("KVCMAS") or __import__("hf_kvshare").get_method("KVCMAS"),
            r"unknown method 'KVCMAS'; registered methods: .*kvcmas",
        ),
        Case(
            _OPTIONS,
            "get_method(None)",
            lambda: __import__("hf_kvshare").get_method(None),
            r"registry name or a Method instance, got NoneType",
        ),
        Case(
            _OPTIONS,
            "an instance with options",
            lambda: __import__("hf_kvshare").get_method(METHODS["kvcmas"](), tau=0.5),
            r"options \['tau'\] were given with a KVCMAS instance",
        ),
        Case(
            _OPTIONS,
            "Session(method=..., unknown option)",
            lambda: Session(_model(), _tok(), "kvcmas", colour=1),
            r"method 'kvcmas' has no option 'colour'",
        ),
        Case(
            _OPTIONS,
            "a positional option is its field",
            lambda: METHODS["kvcmas"](4),
            None,
            lambda m: m.base_rank == 4,
        ),
        _spec("kvcmas:tau=abc", r"tau must be a real number in \[0, 1\], got 'abc'"),
        _spec("kvcmas:", kwargs={}),
        _spec("kvcmas:tau", r"'tau' in 'kvcmas:tau' is not of the form key=value"),
        _spec("kvcmas:=3", r"'=3' in 'kvcmas:=3' is not of the form key=value"),
        _spec(":tau=1", r"unknown method ''"),
        _spec("kvcmas:tau=0.3,", kwargs={"tau": 0.3}),
        _spec("kvcmas:bogus=1", r"method 'kvcmas' has no option bogus; its options: base_rank"),
        _spec("kvcmas:tau=nan", r"tau must be a real number in \[0, 1\], got 'nan' \(str\)"),
        _spec("kvcmas:tau=inf", r"tau must be a real number in \[0, 1\], got 'inf' \(str\)"),
        _spec("kvcmas:capacity=1e3", r"capacity must be an int >= 2 .*got 1000.0"),
        _spec("kvcmas:base_rank=none", kwargs={"base_rank": None}),
        _spec("cacheblend:check_layers=0", r"check_layers.*0|layer"),
        _spec("KVCMAS:tau=0.3", r"unknown method 'KVCMAS'"),
        _spec(" kvcmas : tau = 0.4 ", kwargs={"tau": 0.4}),
    ]


ADVERSARIAL_OPTIONS = _options_cases()


@pytest.mark.parametrize("case", ADVERSARIAL_OPTIONS, ids=lambda c: c.name)
def test_adversarial_method_options(case):
    assert_holds(case)


ADVERSARIAL += ADVERSARIAL_OPTIONS


# ---- concurrency
_THREADS = "concurrency"


class _Held:
    """A turn held inside generate in another thread (its logits processor waits), so that a second
    call is certain to overlap it; ``result`` is that turn's output (or its error)."""

    def __init__(self, session, agent, segments):
        self.inside, self.release, self.result = threading.Event(), threading.Event(), None

        def hold(input_ids, scores):
            self.inside.set()
            self.release.wait(60)
            return scores

        def run():
            try:
                self.result = session.run_turn(
                    agent, segments, max_new_tokens=3, logits_processor=[hold]
                ).output_ids.tolist()
            except BaseException as error:  # reported by the case
                self.result = error

        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.inside.wait(60)

    def finish(self):
        self.release.set()
        self.thread.join(60)
        return self.result


def _sequential(method, options, steps):
    session = Session(_model(layers=4), _tok(), METHODS[method](**options))
    return [session.run_turn(a, s, max_new_tokens=3).output_ids.tolist() for a, s in steps]


def _overlap(label, method, options, shared):
    """A turn of thread A is inside generate; the calling thread B runs a turn on the same Session
    (``shared="session"``) or on its own Session with the same method instance (``"method"``). B
    refused loudly or both correct (as a sequential run); A's turn is unharmed either way."""
    box = {}

    def run():
        instance = METHODS[method](**options)
        first = Session(_model(layers=4), _tok(), instance)
        held = box["held"] = _Held(first, *STEPS[0])
        try:
            if shared == "session":
                return first.run_turn("other", STEPS[0][1], max_new_tokens=3).output_ids.tolist()
            return (
                Session(_model(layers=4), _tok(), instance)
                .run_turn(*STEPS[0], max_new_tokens=3)
                .output_ids.tolist()
            )
        finally:
            box["a"] = held.finish()

    def a_unharmed():
        return box.get("a") == _sequential(method, options, STEPS[:1])[0]

    def check(b):
        return a_unharmed() and b == _sequential(method, options, STEPS[:1])[0]

    return Case(
        _THREADS,
        label,
        run,
        r"in use by a turn in another thread.*cannot run concurrently",
        check,
        a_unharmed,
    )


def _threads_ok(label, method, options, jobs=2):
    """Each thread its own Session and instance: every thread equals a sequential run."""

    def run():
        got, errors = [None] * jobs, []
        barrier = threading.Barrier(jobs)

        def work(i):
            barrier.wait()
            try:
                got[i] = _sequential(method, options, STEPS)
            except BaseException as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return got

    return Case(
        _THREADS, label, run, None, lambda got: all(g == _sequential(method, options, STEPS) for g in got)
    )


def _one_after_another(label, method, options):
    """One Session used by two threads one after the other (never at once): a sequential run."""

    def run():
        session = Session(_model(layers=4), _tok(), METHODS[method](**options))
        out = []
        for agent, segments in STEPS:
            thread = threading.Thread(
                target=lambda a=agent, s=segments: out.append(
                    session.run_turn(a, s, max_new_tokens=3).output_ids.tolist()
                )
            )
            thread.start()
            thread.join()
        return out

    return Case(_THREADS, label, run, None, lambda got: got == _sequential(method, options, STEPS))


def _build_during_turn():
    session = Session(_model(layers=4), _tok(), "fullshared")
    held = _Held(session, *STEPS[0])
    try:
        return session.build_cache("other", STEPS[0][1])
    finally:
        held.finish()


def _rollback_across_threads():
    """A's turn fails after B's turn (same Session, another thread) recorded its output: B's output
    must survive A's rollback (or B be refused)."""

    class Fail(Exception):
        pass

    session = Session(_model(layers=4), _tok(), "fullshared")
    inside, release = threading.Event(), threading.Event()

    def hold_then_fail(input_ids, scores):
        inside.set()
        release.wait(60)
        raise Fail("A fails after B ran")

    thread = threading.Thread(
        target=lambda: _swallow(
            lambda: session.run_turn(*STEPS[0], max_new_tokens=2, logits_processor=[hold_then_fail]), Fail
        )
    )
    thread.start()
    assert inside.wait(60)
    try:
        b = session.run_turn("b", STEPS[0][1], max_new_tokens=2)
    finally:
        release.set()
        thread.join(60)
    return b.output_slot in session.slots


def _swallow(fn, kind):
    try:
        fn()
    except kind:
        pass


def _concurrency_cases():
    methods = {
        "nonshared": {},
        "fullshared": {},
        "kvcmas": {},
        "kvcomm": {},
        "graphflow": {},
        "cacheblend": {"rho": 0.5},
        "droidspeak": {"rho": 0.5, "layer_profile": [0.0, 2.0, 0.5, 1.0]},
        "relaycaching": {"rho": 0.5},
    }
    return [
        *[_overlap(f"one Session, two threads at once: {m}", m, o, "session") for m, o in methods.items()],
        *[
            _overlap(f"one {m} instance, two Sessions in two threads at once", m, o, "method")
            for m, o in methods.items()
        ],
        Case(
            _THREADS,
            "build_cache on a Session running a turn in another thread",
            _build_during_turn,
            r"in use by a turn in another thread",
        ),
        Case(
            _THREADS,
            "a failed turn's rollback and another thread's turn",
            _rollback_across_threads,
            r"in use by a turn in another thread",
            lambda kept: kept,
        ),
        _threads_ok("kvcmas: a Session and an instance per thread", "kvcmas", {}, jobs=3),
        _threads_ok(
            "graphflow: a Session and an instance per thread", "graphflow", {"calibration_requests": 1}
        ),
        _one_after_another("kvcmas: one Session, turns from two threads one after another", "kvcmas", {}),
    ]


ADVERSARIAL_THREADS = _concurrency_cases()


@pytest.mark.parametrize("case", ADVERSARIAL_THREADS, ids=lambda c: c.name)
def test_adversarial_concurrency(case):
    assert_holds(case)


ADVERSARIAL += ADVERSARIAL_THREADS

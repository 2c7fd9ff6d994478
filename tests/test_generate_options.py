"""generate's options through ``run_turn``: those it honours give what plain ``generate`` gives with
them (sampling with a seed, penalties, stopping criteria, streamers, attention masks of ones,
teacher forcing); those it cannot honour (beams, several sequences, dict outputs, inputs it sets
itself, ...) are refused before any work, naming the option."""

from __future__ import annotations

import functools

import pytest
import torch
from adversarial import Case, assert_holds, cached_model, cached_tokenizer
from tiny import STEPS, tiny_model

from hf_kvshare import PF, Session


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


# ---------------------------------------------------------------- the adversarial re-run (tests/adversarial.py)
_GEN = "generate / run_turn options"


@functools.cache
def _prompt():
    return Session(cached_model(), cached_tokenizer(), "nonshared").build_cache(*STEPS[0])[1]


def _plain(options: dict, seed: int = 0) -> list[int]:
    """What plain ``generate`` gives for the first step's prompt with ``options`` (the session's
    default of greedy decoding where they set nothing), trailing EOS dropped as the session does."""
    prompt, model = _prompt(), cached_model()
    options = dict(options)
    if "generation_config" not in options:
        options.setdefault("do_sample", False)
    options.setdefault("max_new_tokens", 6)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **options)
    session = Session(cached_model(), cached_tokenizer(), "nonshared")
    return session._strip_eos(out[0, prompt.shape[1] :]).tolist()


class _Untouched:
    """A session whose method's build fails loudly (a refusal must come before any work)."""

    def __init__(self, method="nonshared"):
        self.session = _no_build(Session(cached_model(), cached_tokenizer(), method))

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
            return Session(cached_model(), cached_tokenizer(), method).run_turn(*STEPS[0], **given)
        except Exception as error:
            raise Late(error) from error

    return Case(_GEN, label, run, match, None, lambda: "s" not in box or box["s"]())


def _gen_honoured(label, options, seed=0, reference=None):
    """``run_turn(**options)`` gives what plain generate gives with them (same seed)."""

    given = {}

    def run():
        given.update(options() if callable(options) else options)
        session = Session(cached_model(), cached_tokenizer(), "nonshared")
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
    got = Session(cached_model(), cached_tokenizer(), "nonshared").run_turn(
        *STEPS[0], max_new_tokens=5, streamer=streamer
    )
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
            lambda: dict(stop_strings=[cached_tokenizer().decode(_plain({})[1:2])], max_new_tokens=6),
            reference=lambda o, s: _plain({**o, "tokenizer": cached_tokenizer()}, s),
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
            "assistant_model (assisted decoding)",
            lambda: dict(assistant_model=cached_model()),
            r"assistant_model",
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


ADVERSARIAL = ADVERSARIAL_GENERATE

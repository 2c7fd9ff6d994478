"""A method instance and a cache are bound to their model (and a cache to the prompt it was built
for): another model, another prompt, a consumed cache or the inner model of a PeftModel with its adapter
acting are refused before anything is written; the same weights in another object are the same model."""

from __future__ import annotations

import pytest
import torch
from tiny import METHOD_OPTIONS, STEPS, tiny_model

from hf_kvshare import METHODS, PF, Session
from hf_kvshare._compat import cache_kwargs
from hf_kvshare.prefill import prefill_dense

# ---------------------------------------------------------------- one model per method instance


@pytest.mark.parametrize("name", [n for n, c in METHODS.items() if not c.requires_adapters])
def test_a_method_instance_refuses_a_second_model(name, tokenizer):
    first, second = (
        tiny_model("llama", seed=3, num_hidden_layers=4),
        tiny_model("llama", seed=4, num_hidden_layers=4),
    )
    method = METHODS[name](**METHOD_OPTIONS.get(name, {}))
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


# ---------------------------------------------------------------- caches bound to their model and prompt


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


def test_generate_on_a_consumed_cache_with_a_one_token_prompt_is_refused(tokenizer):
    from hf_kvshare.cache import PositionMismatchError

    model = tiny_model("llama", seed=3)
    cache, prompt = Session(model, tokenizer, "fullshared").build_cache("a", [PF("Hi")])
    assert prompt.shape == (1, 1)
    model.generate(input_ids=prompt, **cache_kwargs(cache), max_new_tokens=2, do_sample=False)
    with pytest.raises(PositionMismatchError, match="no token to feed.*already used by a generate call"):
        model.generate(input_ids=prompt, **cache_kwargs(cache), max_new_tokens=2, do_sample=False)


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

"""Every decoding mode of ``generate`` that works with a user-supplied ``DynamicCache``, through our caches.

Each cache a method builds (``Session.build_cache``) is compared with a ``DynamicCache`` holding the
same K/V: the same mode on both must give the same tokens, or be refused by ours before anything is
generated, with an error naming the mode and the reason. ``nonshared`` is also pinned to ``generate``
without any cache. Facts from transformers 5.24 (``generation/utils.py``): a user cache is not expanded
for beams / several return sequences (``SharedCache`` follows the expansion itself; the reference is
expanded by hand); assisted decoding and prompt lookup feed the whole ``input_ids`` on their first step
(``_assisted_decoding``: ``next_sequence_length=None`` on the first iteration), so with a prefilled cache
they work when ``input_ids`` holds only the new tokens and ``attention_mask`` the full length, and are
silently wrong otherwise (the strict-xfail test below fails when transformers fixes that);
contrastive search moved to a Hub repository (``transformers-community/contrastive-search``).
"""

from __future__ import annotations

import pytest
import torch
from lora_helpers import QV, lora_model
from tiny import tiny_model
from transformers import DynamicCache

from hf_kvshare import PF, PH, PositionMismatchError, SegmentedCache, Session, SharedCache, cache_kwargs
from hf_kvshare._compat import (
    ASSISTED_DECODING_EXACT_WITH_NEW_TOKENS,
    ASSISTED_DECODING_REFEEDS_CACHED_PROMPT,
    PREFILL_CHUNKS_REFEED_CACHED_PROMPT,
    TRANSFORMERS_VERSION,
    set_active_adapter,
)
from hf_kvshare.prefill import prefill_dense

NEW = 6  # new tokens per generate
QUERY = "Sort the list [3, 1, 2] and explain each step of the sort in a short sentence."


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def assistant():
    """A smaller random model with the same vocabulary (the draft model of assisted decoding)."""
    return tiny_model("llama", seed=5, num_hidden_layers=1)


@pytest.fixture(scope="module")
def peft():
    return lora_model("llama", targets=QV)


def _segments(agent: str, producer: str | None = None):
    segments = [PF(f"You are the {agent}.\n"), PH("query", QUERY)]
    if producer:
        segments += [PF(f"\n{producer} said: "), PH(producer)]
    return [*segments, PF("\nAnswer:")]


def _build(model, tokenizer, method: str, **options):
    """The second agent's cache: its prompt holds the first agent's output, so sharing methods reuse
    (PReCache's layout: the trajectory so far, then the new instruction)."""
    session = Session(model, tokenizer, method, **options)
    session.run_turn("plan", _segments("plan"), max_new_tokens=4)
    if method in ("prelrshared", "baseshared"):
        return session.build_cache("act", [*_segments("plan"), PH("plan"), PF("\n[act] go on:")])
    return session.build_cache("act", _segments("act", "plan"))


#: caches under test: name -> (model fixture, builder)
CACHES = {
    "SegmentedCache": "model",
    "nonshared": "model",
    "fullshared": "model",
    "kvcmas": "model",
    "prelrshared": "peft",
}


@pytest.fixture(scope="module", params=list(CACHES))
def built(request, tokenizer):
    """(model, our cache, prompt ids [1, P]); the cache holds the prompt minus its last token."""
    name = request.param
    model = request.getfixturevalue(CACHES[name])
    if name == "SegmentedCache":  # a user-built one: no seal, no batch expansion of its own
        ids = tokenizer(f"You are the act.\n{QUERY}\nAnswer:", return_tensors="pt").input_ids
        cache = SegmentedCache(model.config)
        prefill_dense(cache, model, ids[:, :-1])
        return model, cache, ids
    if name == "prelrshared":
        cache, ids = _build(model, tokenizer, name)
        set_active_adapter(model, "act")  # the agent's adapter for its generate calls
        return model, cache, ids
    cache, ids = _build(model, tokenizer, name)
    return model, cache, ids


def _reference(cache) -> DynamicCache:
    """A DynamicCache holding the same K/V as ``cache`` (cloned)."""
    pairs = [tuple(t.clone() for t in cache.layer_kv(layer)) for layer in range(cache.num_layers)]
    return DynamicCache(pairs)


def _generate(model, ids, cache, seed=0, mask_length=None, **kwargs):
    torch.manual_seed(seed)
    mask = torch.ones(ids.shape[0], mask_length or ids.shape[1], dtype=torch.long)
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **kwargs, **cache_kwargs(cache)
        )


# mode -> generate kwargs; "expand": generate feeds this many rows per prompt
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20),
    "sample_n": dict(do_sample=True, num_return_sequences=2, expand=2),
    "beam_search": dict(do_sample=False, num_beams=3, num_return_sequences=2, expand=3),
    "beam_sample": dict(do_sample=True, num_beams=2, expand=2),
    "prefill_chunk": dict(do_sample=False, prefill_chunk_size=2),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_gives_the_same_tokens(built, mode):
    model, ours, ids = built
    kwargs = dict(MODES[mode])
    expand = kwargs.pop("expand", 1)
    ref = _reference(ours)
    ours = ours.copy()
    if expand > 1:
        ref.batch_repeat_interleave(expand)  # generate does not expand a user cache
        if not isinstance(ours, SharedCache):
            ours.batch_repeat_interleave(expand)
    if mode == "prefill_chunk" and PREFILL_CHUNKS_REFEED_CACHED_PROMPT:
        length = ours.get_seq_length()  # transformers < 5.24 re-feeds the cached prompt: refused
        with pytest.raises(PositionMismatchError, match="already holds it"):
            _generate(model, ids, ours, **kwargs)
        assert ours.get_seq_length() == length
        return
    want = _generate(model, ids, ref, **kwargs)
    got = _generate(model, ids, ours, **kwargs)
    assert torch.equal(got, want), mode


@pytest.mark.parametrize("chunk", [None, 2])
def test_continuing_generation_with_several_new_tokens(built, chunk):
    """Second generate on the same cache: prompt + output + 3 new tokens (4 tokens fed at once / in chunks)."""
    model, ours, ids = built
    if chunk and PREFILL_CHUNKS_REFEED_CACHED_PROMPT:
        pytest.skip(
            f"transformers {TRANSFORMERS_VERSION} re-feeds a prefilled cache's prompt in chunked prefill"
        )
    ref, ours = _reference(ours), ours.copy()
    extra = torch.tensor([[11, 12, 13]])
    outs = []
    for cache in (ref, ours):
        first = _generate(model, ids, cache, do_sample=False)
        outs.append(
            _generate(model, torch.cat([first, extra], 1), cache, do_sample=False, prefill_chunk_size=chunk)
        )
    assert torch.equal(outs[0], outs[1])
    assert ours.get_seq_length() == ref.get_seq_length() == outs[1].shape[1] - 1
    if isinstance(ours, SharedCache):
        assert [s.name for s in ours.appended] == ["prompt_tail", "generated"]
        assert ours.appended[-1].end == outs[1].shape[1] - 1


@pytest.mark.parametrize("mode", ["assisted", "prompt_lookup"])
def test_assisted_modes_fed_only_the_new_tokens(built, assistant, mode):
    """Assisted decoding / prompt lookup on a prefilled cache: ``input_ids`` = the tokens the cache lacks,
    ``attention_mask`` over the whole prompt (as for continuing from a cache in transformers)."""
    if not ASSISTED_DECODING_EXACT_WITH_NEW_TOKENS:
        pytest.skip(
            f"transformers {TRANSFORMERS_VERSION}: assisted decoding over a prefilled cache differs from greedy "
            "however it is fed, on a DynamicCache too (_compat.ASSISTED_DECODING_EXACT_WITH_NEW_TOKENS)"
        )
    model, ours, ids = built
    kwargs = {"assistant_model": assistant} if mode == "assisted" else {"prompt_lookup_num_tokens": 3}
    ref, ours = _reference(ours), ours.copy()
    tail = ids[:, ours.get_seq_length() :]
    want = _generate(model, tail, ref, mask_length=ids.shape[1], do_sample=False, **kwargs)
    got = _generate(model, tail, ours, mask_length=ids.shape[1], do_sample=False, **kwargs)
    assert torch.equal(got, want)
    greedy = _generate(model, ids, _reference(built[1]), do_sample=False)
    assert torch.equal(
        got[:, tail.shape[1] :], greedy[:, ids.shape[1] :]
    )  # assisted = greedy, token for token
    assert ours.get_seq_length() == got.shape[1] - 1 + ids.shape[1] - tail.shape[1]  # rejected drafts cropped


@pytest.mark.parametrize("mode", ["assisted", "prompt_lookup"])
def test_assisted_modes_fed_the_whole_prompt_are_refused(built, assistant, mode):
    """transformers 5.24 re-feeds the cached prompt on the first assisted step: refused, nothing written."""
    model, ours, ids = built
    kwargs = {"assistant_model": assistant} if mode == "assisted" else {"prompt_lookup_num_tokens": 3}
    ours = ours.copy()
    length = ours.get_seq_length()
    with pytest.raises(PositionMismatchError, match="assisted decoding.*silently wrong"):
        _generate(model, ids, ours, do_sample=False, **kwargs)
    assert ours.get_seq_length() == length


def test_second_generate_with_the_same_prompt_is_refused(built):
    model, ours, ids = built
    ours = ours.copy()
    _generate(model, ids, ours, do_sample=False)
    length = ours.get_seq_length()
    with pytest.raises(PositionMismatchError, match="already holds it"):
        _generate(model, ids, ours, do_sample=False)
    assert ours.get_seq_length() == length


def test_nonshared_equals_generate_without_a_cache(model, tokenizer):
    ours, ids = _build(model, tokenizer, "nonshared")
    for kwargs in (dict(do_sample=False), dict(do_sample=True), dict(num_beams=3, do_sample=False)):
        assert torch.equal(
            _generate(model, ids, ours.copy(), **kwargs), _generate(model, ids, None, **kwargs)
        )


def test_contrastive_search_needs_the_hub():
    pytest.skip(
        "contrastive search (penalty_alpha=) moved to the Hub repo transformers-community/contrastive-search "
        "(custom_generate, trust_remote_code): not runnable offline"
    )


@pytest.mark.xfail(
    ASSISTED_DECODING_REFEEDS_CACHED_PROMPT,
    strict=True,
    reason="transformers re-feeds a prefilled cache's prompt on the first assisted step (issue 17, item 4); "
    "an XPASS means upstream fixed it: update _compat.ASSISTED_DECODING_REFEEDS_CACHED_PROMPT",
)
@pytest.mark.parametrize("mode", ["assisted", "prompt_lookup"])
def test_upstream_assisted_decoding_with_prefilled_cache(model, assistant, mode):
    kwargs = {"assistant_model": assistant} if mode == "assisted" else {"prompt_lookup_num_tokens": 3}
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (1, 12))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], use_cache=True, **cache_kwargs(cache))
    greedy = _generate(model, ids, None, do_sample=False)
    assert torch.equal(_generate(model, ids, cache, do_sample=False, **kwargs), greedy)

"""`load_model("random:NAME")`: the shipped configs carry the model cards' numbers; depth shrinks with
the layer-type pattern kept; models build on the meta device (no memory) and, test-size, run."""

from __future__ import annotations

import pytest
import torch

from hf_kvshare import PF, PH, Session, load_model
from hf_kvshare.random_models import byte_tokenizer, parameter_count, random_config, random_model_names

CARDS = {  # the published config.json numbers (layers, hidden, intermediate, heads, kv heads, head dim, ...)
    "llama-3.1-8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    "qwen2.5-7b": dict(
        num_hidden_layers=28,
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    "qwen3-8b": dict(
        num_hidden_layers=36,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    "gemma-3-4b": dict(
        num_hidden_layers=34,
        hidden_size=2560,
        intermediate_size=10240,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=262208,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=1024,
        query_pre_attn_scalar=256,
        max_position_embeddings=131072,
    ),
}
ROPE = {
    "llama-3.1-8b": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "qwen2.5-7b": {"rope_type": "default", "rope_theta": 1000000.0},
    "qwen3-8b": {"rope_type": "default", "rope_theta": 1000000.0},
}
#: parameters of the full models (the cards: 8.03B, 7.62B, 8.19B; Gemma 3 4B's language model 3.88B)
PARAMETERS_B = {"llama-3.1-8b": 8.03, "qwen2.5-7b": 7.62, "qwen3-8b": 8.19, "gemma-3-4b": 3.88}


def test_the_four_published_shapes_ship():
    assert set(CARDS) <= set(random_model_names())


@pytest.mark.parametrize("name", sorted(CARDS))
def test_config_numbers_are_the_cards(name):
    config = random_config(name)
    for key, value in CARDS[name].items():
        assert getattr(config, key) == value, (name, key)
    if name in ROPE:
        params = config.rope_parameters
        assert {k: params.get(k) for k in ROPE[name]} == ROPE[name]
    assert parameter_count(config) / 1e9 == pytest.approx(PARAMETERS_B[name], abs=0.01)


def test_gemma3_rope_and_layer_pattern_kept_when_shrunk():
    full = random_config("gemma-3-4b")
    assert full.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert full.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert [i for i, t in enumerate(full.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29]
    cut = random_config("gemma-3-4b", 7)
    assert cut.num_hidden_layers == 7 and cut.layer_types == full.layer_types[:7]
    assert cut.hidden_size == full.hidden_size and cut.vocab_size == full.vocab_size  # real widths


def test_meta_build_has_real_shapes_and_no_memory():
    model, tok = load_model("random:qwen2.5-7b", num_layers=1, device_map="meta")
    assert model.device.type == "meta" and len(model.model.layers) == 1
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (4 * 128, 3584)
    assert model.model.layers[0].self_attn.k_proj.bias is not None  # Qwen2: q/k/v bias
    assert model.config._attn_implementation == "sdpa"


def test_bad_names_and_options_are_refused():
    with pytest.raises(ValueError, match="unknown random model 'llama-9b'.*llama-3.1-8b"):
        load_model("random:llama-9b")
    with pytest.raises(ValueError, match=r"num_layers must be an int in \[1, 32\]"):
        load_model("random:llama-3.1-8b", num_layers=0, device_map="meta")
    with pytest.raises(ValueError, match="num_layers shrinks the random: models only"):
        load_model("/some/dir", num_layers=2)
    with pytest.raises(ValueError, match="unsupported options"):
        load_model("random:tiny-llama", revision="main")


def test_tiny_random_model_runs_a_shared_turn_and_is_seeded():
    model, tok = load_model("random:tiny-llama", seed=3)
    again, _ = load_model("random:tiny-llama", seed=3)
    other, _ = load_model("random:tiny-llama", seed=4)
    w = model.model.layers[1].mlp.up_proj.weight
    assert model.dtype == torch.float32 and torch.equal(w, again.model.layers[1].mlp.up_proj.weight)
    assert not torch.equal(w, other.model.layers[1].mlp.up_proj.weight)
    assert float(w.detach().std()) == pytest.approx(0.02, rel=0.1)
    s = Session(model, tok, "fullshared")
    s.run_turn(
        "a", [PF("You plan.\n"), PH("q", "Shared notes about the bridge."), PF("\nA:")], max_new_tokens=3
    )
    r = s.run_turn("b", [PF("You check.\n"), PH("q"), PF("\nB:")], max_new_tokens=3)
    assert r.reuse_ratio == 1.0


def test_byte_tokenizer_ids_fit_every_model_and_chat_works():
    tok = byte_tokenizer()
    ids = tok("Grüße, world")["input_ids"]
    assert tok.decode(ids) == "Grüße, world" and max(ids) < 256
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    h = tok("h")["input_ids"]
    assert len(tok) == 259 and tok.decode([100000, *h], skip_special_tokens=True) == "h"  # beyond: dropped

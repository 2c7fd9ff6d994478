"""load_model: hub ids / local directories through from_pretrained; the embedded model's errors; the tests'
embedded tokenizer (tests/tiny.py), read once per process, handed out as copies."""

from __future__ import annotations

import pytest
import torch
from tiny import _read_embedded_tokenizer, embedded_tokenizer, tiny_model

from hf_kvshare import PH, Session, load_model
from hf_kvshare.models import DEFAULT_MODEL


def test_local_directory_with_dtype(tmp_path, tokenizer):
    tiny_model("qwen2").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training
    assert tok("hello")["input_ids"] == tokenizer("hello")["input_ids"]
    r = Session(model, tok, "fullshared").run_turn("a", [PH("q", "Say hi."), "\nOK"], max_new_tokens=2)
    assert r.output_ids.numel() >= 1


def test_the_tests_embedded_tokenizer_is_a_copy_of_one_read():
    """Each call gets its own tokenizer, equal to one read from disk: tokens a test adds (the tiny VLMs'
    ``<image>``) stay in that test's copy."""
    first = embedded_tokenizer()
    assert embedded_tokenizer() is not first
    first.add_special_tokens({"additional_special_tokens": ["<image>"]})
    fresh, again = _read_embedded_tokenizer(DEFAULT_MODEL), embedded_tokenizer()
    assert len(first) == len(fresh) + 1 and len(again) == len(fresh) == 49152
    text = "Say <image> hi."
    messages = [{"role": "user", "content": text}]
    assert again(text)["input_ids"] == fresh(text)["input_ids"] != first(text)["input_ids"]
    assert again.apply_chat_template(messages, tokenize=False) == fresh.apply_chat_template(
        messages, tokenize=False
    )


def test_bad_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("smollm2-135m", dtype="float7")


@pytest.mark.real_model
def test_embedded_model_quantized_on_load():
    """``load_model("smollm2-135m", load_in_4bit=True)`` quantizes the embedded fp32 copy's linear layers."""
    bnb = pytest.importorskip("bitsandbytes")
    model, tok = load_model("smollm2-135m", load_in_4bit=True)
    assert isinstance(model.model.layers[0].self_attn.k_proj, bnb.nn.Linear4bit)
    assert model.config.quantization_config.load_in_4bit and not model.training
    assert model.get_memory_footprint() < 0.5 * 4 * model.num_parameters()  # fp32: 4 bytes a parameter
    s = Session(model, tok, "fullshared")
    s.run_turn("a", [PH("q", "Name three colors."), "\nA:"], max_new_tokens=3)
    r = s.run_turn("b", ["You are terse.\n", PH("q"), "\nB:"], max_new_tokens=3)
    assert r.reuse_ratio == 1.0


def test_missing_local_path():
    with pytest.raises(OSError):
        load_model("/nonexistent/model/dir")


@pytest.mark.gpu
@pytest.mark.real_model
def test_shared_cache_on_cuda_bf16(real):
    model, tok = real
    model = model.to("cuda", torch.bfloat16)
    try:
        s = Session(model, tok, "fullshared")
        s.run_turn("a", [PH("q", "Name three colors."), "\nA:"], max_new_tokens=4)
        r = s.run_turn("b", ["You are terse.\n", PH("q"), "\nB:"], max_new_tokens=4)
        assert r.reuse_ratio == 1.0 and r.peak_memory_bytes > 0
    finally:
        model.to("cpu", torch.float32)

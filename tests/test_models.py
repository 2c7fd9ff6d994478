"""load_model: hub ids / local directories through from_pretrained; the embedded model's errors."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from hf_kvshare import PH, Session, load_model


def test_local_directory_with_dtype(tmp_path, tokenizer):
    tiny_model("qwen2").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training
    assert tok("hello")["input_ids"] == tokenizer("hello")["input_ids"]
    r = Session(model, tok, "fullshared").run_turn("a", [PH("q", "Say hi."), "\nOK"], max_new_tokens=2)
    assert r.output_ids.numel() >= 1


def test_bad_dtype_and_embedded_options():
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("smollm2-135m", dtype="float7")
    with pytest.raises(ValueError, match="without extra options"):
        load_model("smollm2-135m", device_map="auto")


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

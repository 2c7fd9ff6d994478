"""Shared fixtures: tiny random Llama / Qwen2 models (seconds) and the embedded real model (marked)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hf_kvshare.models import load_model

torch.set_num_threads(2)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=49152,  # the embedded tokenizer's vocabulary
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def tiny_config(arch: str = "llama", **overrides):
    kwargs = {**TINY, **overrides}
    if arch == "llama":
        return LlamaConfig(**kwargs)
    if arch == "qwen2":
        return Qwen2Config(**kwargs)  # q/k/v projections carry a bias
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    cls = LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM
    model = cls(config).eval()
    if arch == "qwen2":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct (fp32, CPU)."""
    return load_model()


@pytest.fixture(scope="session")
def tokenizer(real):
    return real[1]


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_model("llama")


def pytest_collection_modifyitems(config, items):
    """GPU-only tests are skipped where CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

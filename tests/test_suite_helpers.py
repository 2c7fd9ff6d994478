"""The suite's helpers keep their promises: ``tiny.tiny_model`` builds each model once per process and
hands out copies that behave as a fresh build (the same weights, storage of their own, the global
generator where a build leaves it)."""

from __future__ import annotations

import torch
from tiny import tiny_model


def test_a_tiny_model_asked_again_is_a_copy_of_the_same_build():
    first = tiny_model("qwen2", seed=5, num_hidden_layers=2)
    after_first = torch.randn(4)
    again = tiny_model("qwen2", seed=5, num_hidden_layers=2)
    after_again = torch.randn(4)
    assert torch.equal(after_first, after_again)  # the generator left where the build left it,
    torch.manual_seed(5)
    assert not torch.equal(after_first, torch.randn(4))  # past the seed: the build drew the weights
    weights, copied = first.state_dict(), again.state_dict()
    assert list(weights) == list(copied) and all(torch.equal(weights[k], copied[k]) for k in weights)
    bias = again.model.layers[0].self_attn.q_proj.bias
    assert bias.abs().sum() > 0  # the Qwen2 biases drawn, as a build draws them
    with torch.no_grad():
        bias.add_(1.0)  # a caller's change stays in its copy
    assert not torch.equal(first.model.layers[0].self_attn.q_proj.bias, bias)
    assert torch.equal(
        tiny_model("qwen2", seed=5, num_hidden_layers=2).state_dict()[next(iter(weights))],
        weights[next(iter(weights))],
    )
    other = tiny_model("qwen2", seed=6, num_hidden_layers=2)
    assert other.config.num_hidden_layers == 2 and not torch.equal(
        other.model.embed_tokens.weight, first.model.embed_tokens.weight
    )
    assert tiny_model("llama", num_hidden_layers=1).config.num_hidden_layers == 1

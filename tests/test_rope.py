"""RoPE re-positioning: moved keys equal keys computed directly at the target positions."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from hf_kvshare import RopeShifter
from hf_kvshare.rope import find_rotary_module, rotate_half

ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.3 * i for i in range(8)],
        "original_max_position_embeddings": 128,
    },
}


def keys_at(model, pre_rope: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys exactly as the model's attention computes them at ``positions``."""
    rotary = find_rotary_module(model)
    cos, sin = rotary(pre_rope, positions[None])
    return pre_rope * cos[:, None] + rotate_half(pre_rope) * sin[:, None]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rope", sorted(ROPE_TYPES))
@pytest.mark.parametrize("old,new", [(0, 37), (200, 3), (90, 90 + 301), (150, 300)])
def test_shift_equals_direct(arch, rope, old, new):
    model = tiny_model(arch, rope_parameters=dict(ROPE_TYPES[rope]), max_position_embeddings=512)
    if rope == "longrope" and (old < 128) != (new + 16 <= 128):
        pytest.skip("longrope keys cannot cross the short/long boundary (tested separately)")
    shifter = RopeShifter.from_model(model)
    torch.manual_seed(1)
    pre = torch.randn(1, 2, 16, 16)
    k_old = keys_at(model, pre, torch.arange(old, old + 16))
    k_new = keys_at(model, pre, torch.arange(new, new + 16))
    moved = shifter.reposition(k_old, old, new)
    assert (moved - k_new).abs().max().item() <= 1e-5


def test_attention_scaling_applied_once():
    model = tiny_model("llama", rope_parameters=dict(ROPE_TYPES["yarn"]))
    assert find_rotary_module(model).attention_scaling != 1.0
    shifter = RopeShifter.from_model(model)
    pre = torch.randn(1, 2, 8, 16)
    k0 = keys_at(model, pre, torch.arange(0, 8))
    # a shift by 0 and a round trip leave the norm (which carries the scaling) unchanged
    back = shifter.reposition(shifter.reposition(k0, 0, 50), 50, 0)
    assert torch.allclose(back, k0, atol=1e-5)
    assert torch.allclose(shifter.reposition(k0, 0, 50).norm(), k0.norm(), rtol=1e-5)


def test_per_token_positions():
    model = tiny_model("llama")
    shifter = RopeShifter.from_model(model)
    pre = torch.randn(1, 2, 5, 16)
    old = torch.tensor([0, 1, 2, 3, 4])
    new = torch.tensor([10, 3, 50, 7, 100])
    moved = shifter.reposition(keys_at(model, pre, old), old, new)
    for i in range(5):
        direct = keys_at(model, pre[:, :, i : i + 1], new[i : i + 1])
        assert (moved[:, :, i : i + 1] - direct).abs().max() <= 1e-5


def test_longrope_refuses_crossing_the_boundary():
    model = tiny_model("llama", rope_parameters=dict(ROPE_TYPES["longrope"]))
    shifter = RopeShifter.from_model(model)
    with pytest.raises(ValueError, match="boundary"):
        shifter.reposition(torch.randn(1, 2, 4, 16), 0, 300)


def test_dynamic_ntk_is_refused():
    model = tiny_model(
        "llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    )
    with pytest.raises(ValueError, match="dynamic"):
        RopeShifter.from_model(model)


def test_bad_shapes_are_refused():
    shifter = RopeShifter.from_model(tiny_model("llama"))
    with pytest.raises(ValueError, match="head_dim"):
        shifter.reposition(torch.randn(1, 2, 4, 8), 0, 3)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, seq, head_dim\]"):
        shifter.reposition(torch.randn(2, 4, 16), 0, 3)
    with pytest.raises(ValueError, match="positions"):
        shifter.reposition(torch.randn(1, 2, 4, 16), torch.arange(3), 0)


@pytest.mark.parametrize(
    "shifter",
    [
        RopeShifter(inv_freq=1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))),  # Llama halves
        RopeShifter(inv_freq=1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), head_dim=16),  # partial
        RopeShifter(inv_freq=1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), interleaved=True),
    ],
    ids=["halves", "partial", "interleaved"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_into_writes_what_apply_returns_bit_for_bit(shifter, dtype):
    torch.manual_seed(2)
    keys = torch.randn(2, 3, 11, 16).to(dtype)
    rotation = shifter.rotation(5, 40, 11)
    slots = torch.full((2, 3, 20, 16), 7.0, dtype=dtype)  # the keys land in rows 4..14 of a layer
    out = shifter.apply_into(keys, rotation, slots[..., 4:15, :])
    assert out.data_ptr() == slots[..., 4:15, :].data_ptr()  # written in place
    assert torch.equal(slots[..., 4:15, :], shifter.apply(keys, rotation))
    assert (slots[..., :4, :] == 7).all() and (slots[..., 15:, :] == 7).all()  # nothing else touched
    assert torch.equal(shifter.apply_into(keys, None, torch.empty_like(keys)), keys)  # no move: a copy

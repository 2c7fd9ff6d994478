"""hf_kvshare.serving.paged on the CUDA backends' paged caches, checked on CPU tensors.

vLLM 0.32 gives every standard backend one logical per-layer cache ``[blocks, heads, block, 2 * dim]``,
a view of the group's ``[L, B, H, N, C]`` buffer in one of six stride orders (``KVCacheLayout``,
vllm/v1/kv_cache_layout.py; the views: ``create_kv_cache_views`` in vllm/v1/kv_cache_interface.py).
FlashAttention, FlashInfer (not FP4) and Triton write it with the same code: the view transposed to
``[blocks, block, heads, 2 * dim]``, split into key and value halves, written by
``reshape_and_cache_flash``. Before 0.32 the caches split K and V on an axis of their own:
FlashAttention's ``[2, blocks, block, heads, dim]`` (``kv_cache.unbind(0)``), FlashInfer's ``[blocks, 2,
block, heads, dim]`` (``kv_cache[:, 0]``, ``kv_cache[:, 1]``), in NHD or HND stride order.

Here :func:`reshape_and_cache_flash` is the CUDA kernel in torch (each token's heads and features at
``key_cache[slot // block, slot % block]``, through the caches' strides; slots < 0 skipped), the impls
below are the backends' ``do_kv_cache_update`` around it, and the caches are laid out as vLLM lays them
out: the probe and the read/write round trip run in each layout. The ``serving`` tests run vLLM's own
FlashAttention / Triton impls (their kernel replaced by the stand-in: no CUDA here) and the worker's
start-up refusal (skipped without vLLM); ``scripts/device_check.sh --serving`` runs them for real.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from hf_kvshare.serving import paged

HAS_VLLM = importlib.util.find_spec("vllm") is not None

#: vLLM's KVCacheLayout: the physical order of the logical [L, B, H, N, C] axes
LAYOUTS = {
    "LBNHC": (0, 1, 3, 2, 4),  # NHD, vLLM's default
    "LBHNC": (0, 1, 2, 3, 4),  # HND
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
#: the stride orders of the K/V-split caches before vLLM 0.32 (logical [.., block, heads, dim])
LEGACY_ORDERS = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, *_dtype_and_scales):
    """vLLM's CUDA kernel (and Triton's) in torch: token ``i`` (``i < len(slot_mapping)``: the rest is
    padding) goes to ``key_cache[s // block, s % block]`` / ``value_cache[...]`` at its slot ``s``, every
    head and feature, through the caches' strides; a slot < 0 is skipped."""
    block = key_cache.shape[1]
    keep = slot_mapping >= 0
    where = slot_mapping[keep]
    n = slot_mapping.shape[0]
    key_cache[where // block, where % block] = key[:n][keep]
    value_cache[where // block, where % block] = value[:n][keep]


class FlashAttentionImpl:
    """vLLM 0.32's FlashAttentionImpl.do_kv_cache_update (FlashInferImpl's and TritonAttentionImpl's are
    the same code) around the kernel's stand-in."""

    forward_includes_kv_cache_update = False

    def __init__(self, head_size):
        self.head_size = head_size

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        # (B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D))
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping)


class SplitFlashAttentionImpl(FlashAttentionImpl):
    """FlashAttention before vLLM 0.32: ``[2, blocks, block, heads, dim]``."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping)


class SplitFlashInferImpl(FlashAttentionImpl):
    """FlashInfer before vLLM 0.32: ``[blocks, 2, block, heads, dim]``."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        reshape_and_cache_flash(key, value, kv_cache[:, 0], kv_cache[:, 1], slot_mapping)


def attention_layer(impl, backend="FLASH_ATTN", heads=2, head_size=8, **extra):
    """The attributes of vLLM's Attention layer that the connector reads."""
    named = SimpleNamespace(get_name=lambda: backend)
    return SimpleNamespace(impl=impl, attn_backend=named, num_kv_heads=heads, head_size=head_size, **extra)


def laid_out(logical_shape, order, dtype):
    """A zero tensor of ``logical_shape`` whose memory follows ``order`` (physical axis i is logical axis
    ``order[i]``), as vLLM's strided views of its buffer."""
    physical = torch.zeros([logical_shape[d] for d in order], dtype=dtype)
    return physical.permute([order.index(d) for d in range(len(order))])


def layer_caches(layout, layers=2, blocks=10, heads=2, block=16, dim=8, dtype=torch.float32):
    """vLLM 0.32's per-layer ``[B, H, N, 2 * dim]`` views of one buffer in ``layout``."""
    group = laid_out((layers, blocks, heads, block, 2 * dim), LAYOUTS[layout], dtype)
    return [group[i] for i in range(layers)]


def kernel_read(kv_cache, slot_mapping, dim):
    """What vLLM's attention kernels read at these slots (the writer's own views of the cache)."""
    if kv_cache.dim() == 4:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(dim, dim=-1)
    elif kv_cache.shape[0] == 2:
        key_cache, value_cache = kv_cache.unbind(0)
    else:
        key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
    block = key_cache.shape[1]
    return key_cache[slot_mapping // block, slot_mapping % block], value_cache[
        slot_mapping // block, slot_mapping % block
    ]


def round_trip(io, cache, scheduler_block, dim, dtype, block_ids=(7, 2, 9, 4)):
    """Writes at odd starts, reads back (fresh and into slices of one buffer), and checks that the K/V
    sit where the kernels read them."""
    torch.manual_seed(0)
    block_ids = list(block_ids)
    for start, n in ((0, scheduler_block), (5, 30), (17, 1), (3, 2 * scheduler_block + 3)):
        key = torch.randn(n, io.heads, dim).to(dtype)
        value = torch.randn(n, io.heads, dim).to(dtype)
        io.write(block_ids, start, key, value)
        k, v = io.read(block_ids, start, start + n)
        assert torch.equal(k, key) and torch.equal(v, value)
        into = torch.full((2, n, io.heads, dim), -1.0, dtype=dtype)
        io.read(block_ids, start, start + n, out=(into[0], into[1]))
        assert torch.equal(into[0], key) and torch.equal(into[1], value)
        rk, rv = kernel_read(cache, paged.slots(block_ids, scheduler_block, start, n), dim)
        assert torch.equal(rk, key) and torch.equal(rv, value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_cuda_backends_cache_round_trips_in_every_vllm_layout(layout, dtype):
    caches = layer_caches(layout, dtype=dtype)
    layer = attention_layer(FlashAttentionImpl(8))
    io = paged.open_layer("model.layers.1.self_attn.attn", caches[1], layer, block_size=16)
    assert io.layout.block_axis == 0
    round_trip(io, caches[1], 16, 8, dtype)
    assert not caches[0].any(), "a write reached another layer's cache"


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_a_scheduler_block_split_into_kernel_blocks_in_the_cuda_layouts(layout):
    # a 32-token scheduler block as two 16-token kernel blocks: the view has twice the blocks
    caches = layer_caches(layout, blocks=2 * 10, block=16, dtype=torch.bfloat16)
    io = paged.open_layer("l", caches[0], attention_layer(FlashAttentionImpl(8)), block_size=32)
    round_trip(io, caches[0], 32, 8, torch.bfloat16, block_ids=(3, 8, 0, 5))


@pytest.mark.parametrize("order", sorted(LEGACY_ORDERS))
@pytest.mark.parametrize(
    "impl, shape, axis",
    [
        (SplitFlashAttentionImpl(8), (2, 10, 16, 2, 8), 1),  # [2, blocks, block, heads, dim]
        (SplitFlashInferImpl(8), (10, 2, 16, 2, 8), 0),  # [blocks, 2, block, heads, dim]
    ],
)
def test_caches_with_k_and_v_on_their_own_axis_round_trip(impl, shape, axis, order):
    cache = laid_out(shape, LEGACY_ORDERS[order], torch.bfloat16)
    io = paged.open_layer("model.layers.0.self_attn.attn", cache, attention_layer(impl), block_size=16)
    assert io.layout.block_axis == axis
    round_trip(io, cache, 16, 8, torch.bfloat16)


def test_the_probe_of_a_cuda_layout_allocates_about_one_block():
    sizes = []

    class Recording(FlashAttentionImpl):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            if kv_cache.shape[0] == 1:
                sizes.append(kv_cache.untyped_storage().nbytes())
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    block_bytes = 2 * 16 * 2 * 8 * 2
    for layout in LAYOUTS:  # LHBNC's heads lie outside the blocks: its scratch is a contiguous block
        sizes.clear()
        cache = layer_caches(layout, blocks=512, dtype=torch.bfloat16)[0]
        paged.open_layer("l", cache, attention_layer(Recording(8)), block_size=16)
        assert sizes and max(sizes) <= 4 * block_bytes, (layout, sizes)


def refusal(layer, cache, block_size=16):
    with pytest.raises(ValueError) as error:
        paged.open_layer("model.layers.0.self_attn.attn", cache, layer, block_size)
    message = str(error.value)
    assert paged.WHAT_WORKS in message and "--attention-backend FLASH_ATTN" in message
    return message


def test_an_mla_layer_is_refused_with_what_works():
    class FlashMLAImpl:  # vLLM's MLA impls derive from MLAAttentionImpl; their cache is [B, 1, N, 576]
        forward_includes_kv_cache_update = False

        def do_kv_cache_update(self, *args):  # pragma: no cover - never called
            raise AssertionError

    class MLAAttention:
        impl = FlashMLAImpl()
        num_kv_heads, head_size = 1, 288

    message = refusal(MLAAttention(), torch.zeros(4, 1, 16, 576, dtype=torch.bfloat16))
    assert "(MLA)" in message and "FlashMLAImpl" in message


def test_a_layout_the_probe_cannot_identify_is_refused_with_the_backend_and_what_works():
    class KeysOnly(FlashAttentionImpl):  # leaves the values' half of each slot unwritten
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            key_cache, _ = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            reshape_and_cache_flash(key, key, key_cache, key_cache, slot_mapping)

    cache = layer_caches("LBNHC", dtype=torch.bfloat16)[0]
    message = refusal(attention_layer(KeysOnly(8), backend="SOME_NEW_BACKEND"), cache)
    assert "every element" in message and "SOME_NEW_BACKEND" in message


def test_caches_whose_shape_is_not_the_layers_kv_are_refused():
    cache = layer_caches("LBNHC", dtype=torch.bfloat16)[0]  # 2 heads of 8
    assert "4 heads of 8" in refusal(attention_layer(FlashAttentionImpl(8), heads=4), cache)
    # keys and values of different head sizes (FlashAttention's diff-KV variant): C = 8 + 4
    odd = torch.zeros(10, 2, 16, 12, dtype=torch.bfloat16)
    message = refusal(attention_layer(FlashAttentionImpl(8), head_size_v=4), odd)
    assert "one head size" in message
    quantized = torch.zeros(10, 2, 16, 16, dtype=torch.uint8)  # an fp8 cache
    assert "--kv-cache-dtype auto" in refusal(attention_layer(FlashAttentionImpl(8)), quantized)


def test_a_backend_writing_inside_its_forward_is_refused_with_what_works():
    class Fused(FlashAttentionImpl):
        forward_includes_kv_cache_update = True

    cache = layer_caches("LBNHC")[0]
    assert "inside its forward" in refusal(attention_layer(Fused(8), backend="FUSED"), cache)


@pytest.mark.serving
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (.ci/run's serving venv)")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", ["flash_attn", "triton_attn"])
def test_vllms_own_cuda_impls_round_trip_with_the_kernel_in_torch(backend, layout, monkeypatch):
    """vLLM's own FlashAttentionImpl / TritonAttentionImpl ``do_kv_cache_update`` (their views of the
    cache), their CUDA / Triton kernel replaced by the stand-in (built without ``__init__``, which wants
    a GPU config; the fields the method reads set)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends import flash_attn, triton_attn

    if backend == "flash_attn":
        monkeypatch.setattr(flash_attn, "reshape_and_cache_flash", reshape_and_cache_flash, raising=False)
        impl = object.__new__(flash_attn.FlashAttentionImpl)
    else:
        monkeypatch.setattr(triton_attn, "triton_reshape_and_cache_flash", reshape_and_cache_flash)
        impl = object.__new__(triton_attn.TritonAttentionImpl)
        impl._is_per_token_head_quant = False
    impl.attn_type, impl.head_size, impl.kv_cache_dtype = AttentionType.DECODER, 8, "auto"
    layer = attention_layer(impl, backend=backend.upper(), _k_scale=None, _v_scale=None)
    cache = layer_caches(layout, dtype=torch.bfloat16)[0]
    io = paged.open_layer("model.layers.0.self_attn.attn", cache, layer, block_size=16)
    round_trip(io, cache, 16, 8, torch.bfloat16)


@pytest.mark.serving
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (.ci/run's serving venv)")
def test_the_worker_refuses_an_mla_model_at_start_up():
    from hf_kvshare.serving.connector_worker import HFKVShareWorker
    from hf_kvshare.serving.host import ServingError

    class MLAAttention:
        impl = FlashAttentionImpl(288)
        num_kv_heads, head_size = 1, 288

    name = "model.layers.0.self_attn.attn"
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        compilation_config=SimpleNamespace(static_forward_context={name: MLAAttention()}),
    )
    worker = HFKVShareWorker(config)
    with pytest.raises(ServingError, match=r"\(MLA\).*--attention-backend FLASH_ATTN"):
        worker.register_kv_caches({name: torch.zeros(4, 1, 16, 576, dtype=torch.bfloat16)})

"""hf_kvshare.serving.paged: K/V written and read back through vLLM's paged cache, whatever the block
interior, the strides, the kernel block or the dtype.

The torch-only tests use a writer with the semantics of vLLM's CUDA backends
(``FlashAttentionImpl.do_kv_cache_update``: the logical ``[blocks, heads, block, 2 * dim]`` cache
transposed to ``[blocks, block, heads, 2 * dim]`` and split into keys and values; slot ``s`` is
``(s // block, s % block)``), on tensors laid out as vLLM allocates them; the ``serving`` tests use
vLLM's own CPU backend writer (skipped without vLLM)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from hf_kvshare.serving import paged

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def flash_writer(key, value, kv_cache, slot_mapping):
    """vLLM's CUDA backends' write, in torch (``reshape_and_cache_flash`` on the split views)."""
    dim = kv_cache.shape[3] // 2
    key_cache, value_cache = kv_cache.transpose(1, 2).split(dim, dim=-1)
    block = kv_cache.shape[2]
    key_cache[slot_mapping // block, slot_mapping % block] = key
    value_cache[slot_mapping // block, slot_mapping % block] = value


def logical_cache(blocks, heads, block, dim, dtype=torch.float32, physical="contiguous"):
    """A layer cache as vLLM hands it to the connector: the logical [B, H, N, 2D] view of a buffer
    whose physical order may differ (a backend's stride order)."""
    if physical == "contiguous":
        return torch.zeros(blocks, heads, block, 2 * dim, dtype=dtype)
    if physical == "NHD":  # tokens outer, heads inner inside a block (FlashAttention's NHD stride order)
        return torch.zeros(blocks, block, heads, 2 * dim, dtype=dtype).permute(0, 2, 1, 3)
    if physical == "blocks-inner":  # the block axis innermost: one block's elements span the whole buffer
        return torch.zeros(2 * dim, block, heads, blocks, dtype=dtype).permute(3, 2, 1, 0)
    raise ValueError(physical)


def reference_read(kv_cache, slot_mapping):
    dim = kv_cache.shape[3] // 2
    key_cache, value_cache = kv_cache.transpose(1, 2).split(dim, dim=-1)
    block = kv_cache.shape[2]
    return key_cache[slot_mapping // block, slot_mapping % block], value_cache[
        slot_mapping // block, slot_mapping % block
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("physical", ["contiguous", "NHD", "blocks-inner"])
def test_written_kv_reads_back_exactly_at_odd_starts(dtype, physical):
    torch.manual_seed(0)
    cache = logical_cache(12, 2, 16, 8, dtype, physical)
    io = paged.LayerIO("layers.0.attn", cache, flash_writer, block_size=16)
    block_ids = [7, 2, 9, 4]  # not in order: the block table decides
    for start, n in ((0, 16), (5, 30), (17, 1), (3, 61)):
        key = torch.randn(n, 2, 8).to(dtype)
        value = torch.randn(n, 2, 8).to(dtype)
        io.write(block_ids, start, key, value)
        k, v = io.read(block_ids, start, start + n)
        assert torch.equal(k, key) and torch.equal(v, value)
        into = torch.full((2, n, 2, 8), -1.0, dtype=dtype)  # read into slices of one buffer, as the connector
        io.read(block_ids, start, start + n, out=(into[0], into[1]))
        assert torch.equal(into[0], key) and torch.equal(into[1], value)
        # and they sit where vLLM's own kernels read them
        rk, rv = reference_read(cache, paged.slots(block_ids, 16, start, n))
        assert torch.equal(rk, key) and torch.equal(rv, value)


def test_the_probe_allocates_about_one_block_whatever_the_strides():
    # a cache whose block axis is innermost: one block's elements lie across the whole buffer, so a
    # scratch block with the layer's strides would be as large as the layer's cache
    scratch_bytes = []

    def recording_writer(key, value, kv_cache, slot_mapping):
        if kv_cache.shape[0] == 1:
            scratch_bytes.append(kv_cache.untyped_storage().nbytes())
        flash_writer(key, value, kv_cache, slot_mapping)

    block_bytes = 2 * 16 * 2 * 8 * 4
    for physical in ("contiguous", "NHD", "blocks-inner"):
        scratch_bytes.clear()
        paged.LayerIO("l", logical_cache(256, 2, 16, 8, physical=physical), recording_writer, block_size=16)
        assert scratch_bytes and max(scratch_bytes) <= 4 * block_bytes, (physical, scratch_bytes)


def test_a_scheduler_block_split_into_kernel_blocks_is_addressed_by_flat_slots():
    # vLLM may split a 32-token scheduler block into two 16-token kernel blocks (the cache's axis 0
    # then has twice the blocks): scheduler block b is kernel blocks 2b and 2b + 1
    torch.manual_seed(1)
    cache = logical_cache(2 * 6, 3, 16, 4)
    io = paged.LayerIO("layers.3.attn", cache, flash_writer, block_size=32)
    key, value = torch.randn(40, 3, 4), torch.randn(40, 3, 4)
    io.write([5, 1], 10, key, value)
    k, v = io.read([5, 1], 10, 50)
    assert torch.equal(k, key) and torch.equal(v, value)
    # position 10 of scheduler block 5 is kernel block 10, offset 10; position 32 is kernel block 2
    dim = 4
    assert torch.equal(cache[10, :, 10, :dim], key[0])
    assert torch.equal(cache[2, :, 0, :dim], key[22])
    with pytest.raises(ValueError, match="does not divide"):
        paged.LayerIO("x", cache, flash_writer, block_size=24)


def test_reading_touches_no_other_request_and_writes_nothing_outside_the_range():
    cache = logical_cache(8, 2, 4, 4)
    io = paged.LayerIO("l", cache, flash_writer, block_size=4)
    before = cache.clone()
    io.write([3, 6], 2, torch.ones(5, 2, 4), torch.full((5, 2, 4), 2.0))
    changed = (cache != before).any(dim=(1, 3))  # [blocks, positions]
    expected = torch.zeros(8, 4, dtype=torch.bool)
    expected[3, 2:] = True
    expected[6, :3] = True
    assert torch.equal(changed, expected)


def test_the_probe_follows_the_writer_not_an_assumed_layout():
    # a writer storing keys transposed inside each block (as vLLM's CPU `vec` layout does) is read right
    def transposed_writer(key, value, kv_cache, slot_mapping):
        blocks, heads, block, width = kv_cache.shape
        dim = width // 2
        view = kv_cache.view(blocks, heads, 2 * block, dim)
        key_cache, value_cache = view.chunk(2, dim=2)  # [blocks, heads, block, dim] each
        kt = key_cache.view(blocks, heads, dim, block)  # keys stored feature-major
        for i, s in enumerate(slot_mapping.tolist()):
            kt[s // block, :, :, s % block] = key[i]
            value_cache[s // block, :, s % block] = value[i]

    torch.manual_seed(2)
    cache = logical_cache(5, 2, 8, 4)
    io = paged.LayerIO("l", cache, transposed_writer, block_size=8)
    key, value = torch.randn(13, 2, 4), torch.randn(13, 2, 4)
    io.write([4, 0], 3, key, value)
    k, v = io.read([4, 0], 3, 16)
    assert torch.equal(k, key) and torch.equal(v, value)
    # the flash reading of the same bytes is wrong: the layout really differs
    rk, _ = reference_read(cache, paged.slots([4, 0], 8, 3, 13))
    assert not torch.equal(rk, key)


@pytest.mark.parametrize(
    "cache, match",
    [
        (torch.zeros(4, 3, 16, 2, 8), "standard attention cache"),  # 5-D without a K/V axis of 2
        (torch.zeros(4, 16, 576), "standard attention cache"),  # MLA's latent cache
        (torch.zeros(4, 2, 16, 7), "standard attention cache"),  # no K/V halves
        (torch.zeros(4, 2, 16, 16, dtype=torch.uint8), "quantized"),  # fp8 stored as uint8
    ],
)
def test_caches_it_cannot_read_are_refused_at_start_up(cache, match):
    with pytest.raises(ValueError, match=match):
        paged.LayerIO("layers.0.attn", cache, flash_writer, block_size=16)


def test_a_writer_that_pads_or_collides_is_refused_with_the_reason():
    def padding_writer(key, value, kv_cache, slot_mapping):  # leaves the last feature unwritten
        flash_writer(key, value, kv_cache, slot_mapping)
        kv_cache[..., -1] = -1

    def colliding_writer(key, value, kv_cache, slot_mapping):  # values over the keys
        flash_writer(key, value, kv_cache, slot_mapping)
        flash_writer(value, value, kv_cache, slot_mapping)

    for writer, match in ((padding_writer, "every element"), (colliding_writer, "one to one")):
        with pytest.raises(ValueError, match=match):  # when the connector registers the caches
            paged.LayerIO("l", logical_cache(3, 2, 4, 4), writer, block_size=4)


def test_bad_kv_to_write_is_refused_and_the_cache_untouched():
    cache = logical_cache(3, 2, 4, 4)
    io = paged.LayerIO("layers.1.attn", cache, flash_writer, block_size=4)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"\[n, 2, 4\]"):
        io.write([0, 1], 0, torch.zeros(3, 4, 2), torch.zeros(3, 4, 2))
    with pytest.raises(ValueError, match=r"\[n, 2, 4\]"):
        io.write([0, 1], 0, torch.zeros(3, 2, 4), torch.zeros(2, 2, 4))
    assert torch.equal(cache, before)


def test_backends_without_a_separate_writer_are_refused():
    with pytest.raises(ValueError, match="do_kv_cache_update"):
        paged.backend_writer(SimpleNamespace(impl=SimpleNamespace()))

    class Fused:
        forward_includes_kv_cache_update = True

        def do_kv_cache_update(self, *args):  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(ValueError, match="inside its forward"):
        paged.backend_writer(SimpleNamespace(impl=Fused()))


@pytest.mark.serving
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (.ci/run's serving venv)")
@pytest.mark.parametrize("dtype, dim", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 48)])
def test_vllms_cpu_backend_writer_round_trips(dtype, dim):
    """The CPU backend's own impl (its ISA-dependent block interior: vec, vec16, amx where the CPU has
    it) through :func:`paged.backend_writer`, as the connector calls it."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    block = 32
    # vLLM's own impl class and its own do_kv_cache_update; built without __init__ (which wants a whole
    # engine config), with the two fields that method reads
    impl = object.__new__(CPUAttentionBackendImpl)
    impl.attn_type, impl.kv_cache_dtype = AttentionType.DECODER, "auto"
    # the attributes vLLM's Attention layer carries for this writer (its metadata builder sets isa)
    layer = SimpleNamespace(
        impl=impl, isa=_get_attn_isa(dtype, block, dim, "auto"), _k_scale_float=1.0, _v_scale_float=1.0
    )
    cache = torch.zeros(6, 2, block, 2 * dim, dtype=dtype)
    io = paged.LayerIO("layers.0.self_attn.attn", cache, paged.backend_writer(layer), block_size=block)
    torch.manual_seed(3)
    key, value = torch.randn(45, 2, dim).to(dtype), torch.randn(45, 2, dim).to(dtype)
    io.write([4, 1, 3], 7, key, value)
    k, v = io.read([4, 1, 3], 7, 52)
    assert torch.equal(k, key) and torch.equal(v, value)

"""Reading and writing K/V in vLLM's paged cache, whatever its block interior looks like.

vLLM's CPU attention backend writes K/V with ``ops.cpu_attn_reshape_and_cache`` into a per-layer
tensor ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` whose block interior depends on the ISA
(fp32 ``vec`` stores keys transposed per block and values plain; bf16 on an AMX CPU packs them). We
write with vLLM's own op (so every layout it knows is written right) and read back through a
permutation *probed from that op*: :class:`BlockLayout` writes token/head/feature codes into a
one-block scratch cache once per (isa, dtype, shape) and inverts where they landed. A layout the op
does not fill bijectively (quantized caches, padding) is refused with the reason.

Only the CPU backend is supported; a CUDA cache (flash layout ``[2, blocks, block_size, heads, dim]``)
is refused with a clear error (see the package docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

#: digits of a probe code: exact in bf16 / fp16 / fp32 (integers up to 256 are exact in bf16)
_BASE = 64


def _write(key, value, key_cache, value_cache, slots, isa: str) -> None:
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[blocks, heads, block_size, 2 * dim]`` -> (key_cache, value_cache) views, as the CPU backend
    splits it (``CPUAttentionBackendImpl.do_kv_cache_update``)."""
    if kv_cache.device.type != "cpu" or kv_cache.dim() != 4:
        raise ValueError(
            "hf_kvshare's serving connector reads and writes vLLM's CPU attention cache only "
            f"([blocks, kv_heads, block_size, 2 * head_dim] on cpu); got {tuple(kv_cache.shape)} on "
            f"{kv_cache.device}"
        )
    blocks, heads, block_size, _ = kv_cache.shape
    view = kv_cache.view(blocks, heads, block_size * 2, -1)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache


@dataclass(frozen=True)
class BlockLayout:
    """Where (token in block, head, feature) lands inside one block, for keys and for values: flat
    indices into ``cache[block].reshape(-1)`` ordered as ``[block_size, heads, dim]``."""

    block_size: int
    heads: int
    dim: int
    key_index: torch.Tensor  # [block_size * heads * dim] long
    value_index: torch.Tensor

    def read(self, kv_cache: torch.Tensor, block_ids: list[int], start: int, end: int):
        """K/V of token positions ``[start, end)`` of a request whose blocks are ``block_ids``, as
        ``[end - start, heads, dim]`` each."""
        key_cache, value_cache = split_kv_cache(kv_cache)
        first, last = start // self.block_size, (end - 1) // self.block_size + 1
        ids = torch.tensor(block_ids[first:last], dtype=torch.long)
        out = []
        for cache, index in ((key_cache, self.key_index), (value_cache, self.value_index)):
            blocks = cache.index_select(0, ids).reshape(len(ids), -1)
            tokens = blocks[:, index].reshape(len(ids) * self.block_size, self.heads, self.dim)
            offset = start - first * self.block_size
            out.append(tokens[offset : offset + end - start])
        return out[0], out[1]


def write(
    kv_cache: torch.Tensor, isa: str, block_ids: list[int], start: int, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[n, heads, dim]`` at token positions ``[start, start + n)`` of a
    request whose blocks are ``block_ids`` (vLLM's own op, so any block layout it writes is right)."""
    key_cache, value_cache = split_kv_cache(kv_cache)
    block_size = key_cache.shape[2]
    positions = torch.arange(start, start + key.shape[0])
    table = torch.tensor(block_ids, dtype=torch.long)
    slots = table[positions // block_size] * block_size + positions % block_size
    dtype = kv_cache.dtype
    _write(key.to(dtype).contiguous(), value.to(dtype).contiguous(), key_cache, value_cache, slots, isa)


@lru_cache(maxsize=16)
def probe_layout(isa: str, dtype: torch.dtype, heads: int, block_size: int, dim: int) -> BlockLayout:
    """The block interior vLLM's writer uses for this (isa, dtype, shape), found by writing codes
    into a one-block scratch cache and reading where they landed."""
    n = block_size * heads * dim
    digits = 1
    while _BASE**digits < n:
        digits += 1
    codes = torch.arange(n, dtype=torch.long).reshape(block_size, heads, dim)
    scratch = torch.empty(1, heads, block_size, 2 * dim, dtype=dtype)
    key_cache, value_cache = split_kv_cache(scratch)
    slots = torch.arange(block_size, dtype=torch.long)
    found = [torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)]
    for d in range(digits):
        scratch.fill_(-1)
        digit = (codes // _BASE**d) % _BASE
        _write(digit.to(dtype), digit.to(dtype), key_cache, value_cache, slots, isa)
        for i, cache in enumerate((key_cache, value_cache)):
            flat = cache[0].reshape(-1).to(torch.float64)
            if bool((flat < 0).any()) or bool((flat != flat.round()).any()) or bool((flat >= _BASE).any()):
                raise ValueError(
                    f"vLLM's CPU K/V writer (isa={isa!r}, dtype={dtype}) does not store every element of a "
                    "block as written (padding or a quantized cache); hf_kvshare cannot read it back"
                )
            found[i] += flat.long() * _BASE**d
    indices = []
    for landed in found:
        if not torch.equal(torch.sort(landed).values, torch.arange(n)):
            raise ValueError(
                f"vLLM's CPU K/V writer (isa={isa!r}, dtype={dtype}) does not place a block's elements "
                "one to one; hf_kvshare cannot read it back"
            )
        index = torch.empty(n, dtype=torch.long)
        index[landed] = torch.arange(n)  # code c (token, head, feature) sits at flat position index[c]
        indices.append(index)
    return BlockLayout(block_size, heads, dim, indices[0], indices[1])

"""Reading and writing K/V in vLLM's paged cache, whatever its block interior looks like, on any device.

Every standard attention backend of vLLM (>= 0.32: CPU, FlashAttention, FlashInfer, Triton, Flex)
registers a layer's cache as the logical tensor ``[num_blocks, kv_heads, block_size, 2 * head_dim]``
(a view of the group's ``[L, B, H, N, C]`` buffer in one of vLLM's ``KVCacheLayout`` stride orders:
``LBNHC`` (NHD, the default), ``LBHNC`` (HND), ``BLNHC``, ``BLHNC``, ``BHLNC``, ``LHBNC``) and writes it
with its own ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``. What a block holds
where differs: the CPU backend reinterprets the block per ISA (fp32 ``vec`` stores keys transposed per
block and values plain; bf16 on an AMX CPU packs them), the CUDA backends (FlashAttention, FlashInfer,
Triton) view the cache as ``[blocks, block_size, heads, 2 * head_dim]`` and write keys into the first
half of each slot's row, values into the second (``reshape_and_cache_flash``). Caches that split K and V
on an axis of their own (vLLM before 0.32: FlashAttention's ``[2, blocks, block_size, heads, dim]``,
FlashInfer's ``[blocks, 2, block_size, heads, dim]`` in NHD or HND stride order) are read the same way,
their block axis found from the shape (:func:`cache_geometry`).

So nothing here assumes a layout. :class:`LayerIO` writes with the layer's own backend writer (vLLM's
code, so every layout it knows is written right) and reads back through a permutation *probed from
that writer*: :func:`probe_layout` writes token/head/feature codes into a one-block scratch cache of
the layer's shape, dtype and device once, and inverts where they landed in the block's logical
elements. A writer that does not fill a block one to one (a quantized cache, padding) is refused
with the reason, as is a cache that is not a standard one (MLA, Mamba state) and a layer whose K/V
shape is not the cache's (:func:`open_layer`, at start-up; every refusal says what works:
:data:`WHAT_WORKS`).

Positions are addressed by vLLM's flat slots (``block_id * block_size + offset`` with the scheduler's
block size): a backend that splits a scheduler block into smaller kernel blocks (its cache's block axis
then has ``block_size / kernel_block`` times the blocks) reads the same flat slot as
``(slot // kernel_block, slot % kernel_block)``, as its writer does.

The connector asks vLLM for no layout (``get_required_kvcache_layout`` stays ``None``): the probe reads
whichever layout vLLM resolves for the backend's kernels, and a required one would override the
kernels' preference (or be dropped with a warning where the backend cannot use it) for no gain here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: digits of a probe code: exact in bf16 / fp16 / fp32 (integers up to 256 are exact in bf16)
_BASE = 64

#: a backend writer: (key [n, heads, dim], value [n, heads, dim], kv_cache, slot_mapping [n] long)
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_EXACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: what the connector reads, named in every refusal at start-up
WHAT_WORKS = (
    "hf_kvshare reads vLLM's standard attention caches written by the backend's own cache writer, with "
    "--kv-cache-dtype auto: CPU_ATTN on CPU; FLASH_ATTN, FLASHINFER or TRITON_ATTN on CUDA (e.g. "
    "--attention-backend FLASH_ATTN); not MLA models' latent caches"
)


@dataclass(frozen=True)
class CacheGeometry:
    """Where the blocks are in a layer's cache and what one block holds."""

    block_axis: int  # 0, or 1 for a cache with K/V split on axis 0 ([2, blocks, ...])
    blocks: int  # kernel blocks
    heads: int
    kernel_block: int  # tokens per kernel block
    dim: int


def cache_geometry(
    name: str, kv_cache: Any, heads: int | None = None, head_dim: int | None = None
) -> CacheGeometry:
    """The geometry of a layer's cache: vLLM's standard ``[blocks, heads, block, 2 * dim]`` view, or a
    K/V-split ``[2, blocks, block, heads, dim]`` / ``[blocks, 2, block, heads, dim]`` cache; a clear
    error for any other cache, for a cache not of a float dtype whose probe codes are exact, and for a
    cache whose heads or head size are not the layer's (``heads`` / ``head_dim``, when known)."""
    shape = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else None
    if shape is not None and len(shape) == 4 and shape[3] % 2 == 0:
        geometry = CacheGeometry(0, shape[0], shape[1], shape[2], shape[3] // 2)
    elif shape is not None and len(shape) == 5 and 2 in shape[:2]:
        axis = 1 if shape[0] == 2 else 0
        geometry = CacheGeometry(axis, shape[axis], shape[3], shape[2], shape[4])
    else:
        raise ValueError(
            f"hf_kvshare's serving connector reads and writes vLLM's standard attention cache "
            f"[num_blocks, kv_heads, block_size, 2 * head_dim] (or one with K and V on an axis of their "
            f"own); layer {name!r} has {shape or type(kv_cache).__name__} (an MLA, Mamba or other state "
            "cache is not supported)"
        )
    if kv_cache.dtype not in _EXACT_DTYPES:
        raise ValueError(
            f"layer {name!r}: a {kv_cache.dtype} KV cache (a quantized --kv-cache-dtype) is not supported: "
            "the connector writes and reads K/V as they are; serve with --kv-cache-dtype auto"
        )
    if (heads is not None and heads != geometry.heads) or (head_dim is not None and head_dim != geometry.dim):
        raise ValueError(
            f"layer {name!r}: its cache {shape} holds {geometry.heads} heads of {geometry.dim} features for "
            f"keys and as many for values, but the layer's K/V are {heads} heads of {head_dim} (keys and "
            "values of different sizes, or a layout hf_kvshare does not know)"
        )
    return geometry


def check_kv_cache(name: str, kv_cache: Any) -> tuple[int, int, int, int]:
    """``(blocks, heads, kernel_block, head_dim)`` of a layer's cache (:func:`cache_geometry`)."""
    g = cache_geometry(name, kv_cache)
    return g.blocks, g.heads, g.kernel_block, g.dim


def slots(block_ids: list[int], block_size: int, start: int, n: int) -> torch.Tensor:
    """vLLM's flat slots of token positions ``[start, start + n)`` of a request whose (scheduler)
    blocks are ``block_ids``."""
    positions = torch.arange(start, start + n)
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class BlockLayout:
    """Where (token in block, head, feature) lands among one block's logical elements
    (``kv_cache.select(block_axis, block).reshape(-1)``): flat indices ordered as
    ``[block_size, heads, dim]``."""

    block_size: int
    heads: int
    dim: int
    key_index: torch.Tensor  # [block_size * heads * dim] long, on the probed cache's device
    value_index: torch.Tensor
    block_axis: int = 0

    def read(
        self,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at ``slot_mapping`` (flat slots), as ``[n, heads, dim]`` each, on the cache's device
        (into ``out``, two contiguous ``[n, heads, dim]`` tensors there, when given).

        Whole blocks are gathered and un-permuted with one 1-D ``index_select`` each (a request's slots
        run through its blocks in order, so the runs of equal blocks are few), then the slots' rows are
        picked: no ``[n, heads * dim]`` index is built (per-element gathers took 0.058-0.166 s for a
        1,100-token request over 30 layers on one CPU thread, on the worker's step: 2.2-4.3x this;
        measured at commit 7d9ce6b)."""
        device = kv_cache.device
        slot_mapping = slot_mapping.to(device)
        kernel_blocks = torch.div(slot_mapping, self.block_size, rounding_mode="floor")
        offsets = slot_mapping % self.block_size
        runs, counts = torch.unique_consecutive(kernel_blocks, return_counts=True)  # in slot order
        run_of = torch.repeat_interleave(torch.arange(runs.numel(), device=device), counts)
        rows = run_of * self.block_size + offsets  # each slot's row among the gathered blocks' tokens
        blocks = kv_cache.index_select(self.block_axis, runs)  # only the blocks read
        flat = blocks.movedim(self.block_axis, 0).reshape(runs.numel(), -1)
        read = []
        for i, index in enumerate((self.key_index, self.value_index)):
            tokens = flat.index_select(1, index.to(device)).view(-1, self.heads, self.dim)
            read.append(
                tokens.index_select(0, rows)
                if out is None
                else torch.index_select(tokens, 0, rows, out=out[i])
            )
        return read[0], read[1]


def probe_layout(writer: Writer, like: torch.Tensor) -> BlockLayout:
    """The block interior ``writer`` uses for caches like ``like`` (its shape but one block, dtype,
    device), found by writing codes into a one-block scratch cache and reading where they landed."""
    geometry = cache_geometry("probe", like)
    axis, heads, block, dim = geometry.block_axis, geometry.heads, geometry.kernel_block, geometry.dim
    n = block * heads * dim
    digits = 1
    while _BASE**digits < 2 * n:
        digits += 1
    codes = torch.arange(2 * n, dtype=torch.long, device=like.device).view(2, block, heads, dim)
    # one block with the layer's own strides (a backend writer may depend on the physical order), unless
    # a block's elements are spread over much more than its size (a block axis inside the others)
    shape = tuple(1 if i == axis else size for i, size in enumerate(like.shape))
    span = 1 + sum((size - 1) * stride for size, stride in zip(shape, like.stride()))
    if span <= 4 * 2 * n:
        scratch = torch.empty_strided(shape, like.stride(), dtype=like.dtype, device=like.device)
    else:
        scratch = torch.empty(shape, dtype=like.dtype, device=like.device)
    slot_mapping = torch.arange(block, dtype=torch.long, device=like.device)
    found = torch.zeros(2 * n, dtype=torch.long, device=like.device)
    for d in range(digits):
        scratch.fill_(-1)
        digit = ((codes // _BASE**d) % _BASE).to(like.dtype)
        writer(digit[0], digit[1], scratch, slot_mapping)
        flat = scratch.select(axis, 0).reshape(-1).to(torch.float64)
        if bool((flat < 0).any()) or bool((flat != flat.round()).any()) or bool((flat >= _BASE).any()):
            raise ValueError(
                f"vLLM's K/V writer for this cache ({like.dtype}, {tuple(like.shape)}, "
                f"{like.device}) does not store every element of a block as written (padding or a "
                "quantized cache); hf_kvshare cannot read it back"
            )
        found += flat.long() * _BASE**d
    if not torch.equal(torch.sort(found).values, torch.arange(2 * n, device=like.device)):
        raise ValueError(
            f"vLLM's K/V writer for this cache ({like.dtype}, {like.device}) does not place a block's "
            "elements one to one; hf_kvshare cannot read it back"
        )
    index = torch.empty(2 * n, dtype=torch.long, device=like.device)
    index[found] = torch.arange(2 * n, device=like.device)  # code c sits at logical position index[c]
    return BlockLayout(block, heads, dim, index[:n].clone(), index[n:].clone(), axis)


def backend_writer(layer: torch.nn.Module) -> Writer:
    """The attention layer's own cache writer (``layer.impl.do_kv_cache_update``)."""
    impl = getattr(layer, "impl", None)
    update = getattr(impl, "do_kv_cache_update", None)
    if update is None:
        raise ValueError(
            f"{type(impl).__name__ if impl is not None else type(layer).__name__}: the attention backend "
            "has no do_kv_cache_update (it writes K/V inside its forward); hf_kvshare's connector needs "
            "vLLM's separate cache writer (vLLM >= 0.32 standard backends)"
        )
    if getattr(type(impl), "forward_includes_kv_cache_update", False):
        raise ValueError(
            f"{type(impl).__name__}: this attention backend writes K/V inside its forward "
            "(forward_includes_kv_cache_update); hf_kvshare's connector supports backends with a separate writer"
        )

    def write(
        key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        update(layer, key, value, kv_cache, slot_mapping)

    return write


def backend_name(layer: torch.nn.Module) -> str:
    """The layer's attention backend as vLLM names it (``FLASH_ATTN``, ``CPU_ATTN``, ...), else its
    impl's class name."""
    get_name = getattr(getattr(layer, "attn_backend", None), "get_name", None)
    if callable(get_name):
        return str(get_name())
    impl = getattr(layer, "impl", None)
    return type(impl if impl is not None else layer).__name__


def open_layer(name: str, kv_cache: torch.Tensor, layer: torch.nn.Module, block_size: int) -> LayerIO:
    """The :class:`LayerIO` of an attention layer of vLLM at start-up (its own writer, its K/V shape
    checked against its cache), or a ``ValueError`` that names the backend, the reason and what works
    (:data:`WHAT_WORKS`): an MLA layer, a backend writing inside its forward, a cache of another shape or
    dtype, a layout the probe cannot identify."""
    impl = getattr(layer, "impl", None)
    try:
        if any("MLA" in cls.__name__ for cls in (*type(layer).__mro__, *type(impl).__mro__)):
            raise ValueError(
                f"layer {name!r} is multi-head latent attention (MLA): its cache holds one compressed latent "
                "per token, not per-head keys and values, and its writer takes other inputs"
            )
        head_dim = getattr(layer, "head_size", None)
        if getattr(layer, "head_size_v", head_dim) != head_dim:
            raise ValueError(
                f"layer {name!r}: keys of {head_dim} features and values of {layer.head_size_v}; "
                "hf_kvshare reads K/V of one head size"
            )
        heads = getattr(layer, "num_kv_heads", None)
        return LayerIO(name, kv_cache, backend_writer(layer), block_size, heads=heads, head_dim=head_dim)
    except ValueError as error:
        raise ValueError(f"{error} (attention backend {backend_name(layer)}). {WHAT_WORKS}") from error


class LayerIO:
    """Reads and writes one layer's paged cache: vLLM's writer, and a reader probed from it when built
    (so a cache the writer does not fill one to one is refused at start-up, not at the first read)."""

    def __init__(
        self,
        name: str,
        kv_cache: torch.Tensor,
        writer: Writer,
        block_size: int,
        heads: int | None = None,
        head_dim: int | None = None,
    ):
        self.name = name
        geometry = cache_geometry(name, kv_cache, heads, head_dim)
        self.heads, self.kernel_block, self.dim = geometry.heads, geometry.kernel_block, geometry.dim
        if block_size % self.kernel_block:
            raise ValueError(
                f"layer {name!r}: kernel block {self.kernel_block} does not divide the scheduler's block "
                f"size {block_size}"
            )
        self.kv_cache = kv_cache
        self.block_size = block_size
        self._writer = writer
        try:
            self.layout = probe_layout(writer, kv_cache)
        except ValueError as error:
            raise ValueError(f"layer {name!r}: {error}") from error

    def write(self, block_ids: list[int], start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[n, heads, dim]`` at token positions ``[start, start + n)`` of a
        request whose blocks are ``block_ids``."""
        if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (self.heads, self.dim):
            raise ValueError(
                f"layer {self.name!r}: K/V to write must be [n, {self.heads}, {self.dim}] each; "
                f"got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        cache = self.kv_cache
        slot_mapping = slots(block_ids, self.block_size, start, key.shape[0]).to(cache.device)
        self._writer(
            key.to(device=cache.device, dtype=cache.dtype).contiguous(),
            value.to(device=cache.device, dtype=cache.dtype).contiguous(),
            cache,
            slot_mapping,
        )

    def read(
        self, block_ids: list[int], start: int, end: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of token positions ``[start, end)`` as ``[end - start, heads, dim]`` each (fresh tensors
        on the cache's device, or written into ``out``: :meth:`BlockLayout.read`)."""
        return self.layout.read(self.kv_cache, slots(block_ids, self.block_size, start, end - start), out)

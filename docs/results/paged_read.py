"""The serving connector's read-back of one request from vLLM's paged cache, timed two ways.

    OMP_NUM_THREADS=1 python docs/results/paged_read.py [TOKENS]   # default 1100

A layer cache of SmolLM2-135M's shape (3 KV heads x 64, fp32) in 128-token blocks, a block interior
given by a random permutation (as `paged.probe_layout` finds for any backend), 30 layers read per
request. ``per element``: the gather ``paged.BlockLayout.read`` did until 2026-12-03 (a
``[n, heads * dim]`` index of every element); ``whole blocks``: what it does now (each touched block
un-permuted by one 1-D ``index_select``, then the rows picked). Both give the same tensors (checked).
Not a benchmark: run it alone on the machine.
"""

from __future__ import annotations

import sys
import time

import torch

from hf_kvshare.serving import paged

torch.set_num_threads(1)
TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 1100
BLOCKS, HEADS, BLOCK, DIM, LAYERS = 200, 3, 128, 64, 30
torch.manual_seed(0)
n = BLOCK * HEADS * DIM
perm = torch.randperm(2 * n)
layout = paged.BlockLayout(BLOCK, HEADS, DIM, perm[:n].clone(), perm[n:].clone())
caches = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
block_ids = torch.randperm(BLOCKS)[: (TOKENS + BLOCK - 1) // BLOCK].tolist()
slot_mapping = paged.slots(block_ids, BLOCK, 0, TOKENS)


def per_element(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.div(slots, BLOCK, rounding_mode="floor")
    offsets = slots % BLOCK
    unique, rows = torch.unique(blocks, return_inverse=True)
    flat = kv_cache.index_select(0, unique).reshape(unique.numel(), -1)
    out = []
    for index in (layout.key_index, layout.value_index):
        columns = index.view(BLOCK, HEADS * DIM)[offsets]
        out.append(flat[rows[:, None], columns].view(slots.numel(), HEADS, DIM))
    return out[0], out[1]


for cache in caches[:2]:
    a, b = per_element(cache, slot_mapping), layout.read(cache, slot_mapping)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
for name, read in (("per element", per_element), ("whole blocks", layout.read)):
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for cache in caches:
            read(cache, slot_mapping)
        best = min(best, time.perf_counter() - start)
    print(f"{name:>12}: {best:.4f} s for {TOKENS} tokens x {LAYERS} layers (best of 5)")

"""Test helper: random K/V of the tiny models' layout and anchors made from it (``test_anchors.py``,
``test_kvcmas.py``, ``test_kvcmas_gate.py``)."""

from __future__ import annotations

import torch

from hf_kvshare.anchors.lowrank import FactoredKV
from hf_kvshare.anchors.pool import Anchor
from hf_kvshare.cache import SegmentKV

HEADS, HEAD_DIM, LAYERS = 2, 16, 3  # the tiny models' K/V layout: D = 32


def random_kv(length, start=0, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, HEADS, length, HEAD_DIM, generator=g) * scale for _ in range(LAYERS)]
    values = [torch.randn(1, HEADS, length, HEAD_DIM, generator=g) * scale for _ in range(LAYERS)]
    return SegmentKV(keys=keys, values=values, start=start, agent="src")


def make_anchor(origin, length=4):
    kv = random_kv(length, seed=origin)
    return Anchor(base=FactoredKV.from_kv(kv.keys, kv.values, 2), source="a", origin=origin)

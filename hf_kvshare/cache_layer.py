"""The storage of one layer of a :class:`~hf_kvshare.cache.SegmentedCache`, the transformers way: the
cache is a table over its layers (``Cache.layers``) and each layer stores.

:class:`SegmentLayer` is a ``DynamicLayer`` (the model's ``update`` appends by concatenation, as
there) that also stores the ways a segment table needs: a tensor built for it held as it is
(:meth:`~SegmentLayer.hold`), new K/V written into reserved slots (:meth:`~SegmentLayer.write_slots`),
a layer cut back to a length (:meth:`~SegmentLayer.keep`), an independent copy. It never slides: a
sliding-window layer keeps every position (the model's sliding-window mask hides what plain generation
would have evicted), so any segment stays extractable. :func:`laid_out` lays one layer's placed parts
out end to end in one new tensor (keys re-positioned straight into their slots, a
:class:`~hf_kvshare.segment_kv.DeferredKV` computed there, dense slots zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer

from . import _compat
from .rope import RopeShifter
from .segment_kv import value_bounds

if TYPE_CHECKING:
    from .cache import CachePart


class SegmentLayer(DynamicLayer):
    """One layer of a segmented cache: a ``DynamicLayer`` that keeps every position and stores as a
    segment table needs (see the module)."""

    @classmethod
    def holding(cls, layer: DynamicLayer) -> SegmentLayer:
        """A segment layer holding what ``layer`` (a ``DynamicLayer``, sliding or not) holds, no copy."""
        new = cls()
        if layer.is_initialized and layer.keys is not None:
            new.hold(layer.keys, layer.values)
        return new

    def hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store tensors just built for this layer and read by no one else: an empty layer holds them
        as they are (``DynamicLayer.update`` would copy them once more); a layer holding K/V appends
        them."""
        if self.is_initialized:
            self.update(keys, values)
        else:
            _compat.hold_layer_states(self, keys, values)

    def write_slots(
        self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``keys`` / ``values`` into the reserved ``slots`` (in place) and return the whole layer."""
        slots = slots.to(self.keys.device)
        self.keys.index_copy_(-2, slots, keys.to(self.keys.dtype))
        self.values.index_copy_(-2, slots, values.to(self.values.dtype))
        return self.keys, self.values

    def keep(self, length: int) -> None:
        """Cut the layer back to its first ``length`` positions if it holds more (any version)."""
        held = self.get_seq_length()
        if held > length:
            self.crop(_compat.crop_argument(held, length))

    def copy(self) -> SegmentLayer:
        """An independent copy (tensors cloned)."""
        new = type(self)()
        if self.is_initialized and self.keys is not None:
            new.hold(self.keys.clone(), self.values.clone())
        return new


def own_layers(cache: Any) -> None:
    """Make ``cache``'s ``DynamicLayer`` s (the plain and the sliding-window ones ``DynamicCache``
    builds) :class:`SegmentLayer` s holding the same tensors, and the layers it creates lazily too.

    A sliding layer evicts all but its last ``W - 1`` keys, but a segment table must be able to hand
    out any segment's K/V (reuse sources, recomputation prefixes). So every layer keeps all its
    positions, and the model's own sliding-window mask (built from absolute positions, the cache
    reporting ``kv_offset = 0``) hides from each sliding layer exactly the keys plain generation would
    have evicted: attention sees what it sees in plain generation. The cost is memory: a sliding
    layer holds the whole sequence instead of ``W - 1`` positions. Other layer types are kept."""
    for layer_idx, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer or getattr(layer, "is_sliding", False):
            cache.layers[layer_idx] = SegmentLayer.holding(layer)
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = SegmentLayer


def rotations(parts: Sequence[CachePart], shifter: RopeShifter | None) -> dict[int, Any]:
    """Each placed part's re-positioning to where it lands (``None``: it sits there), computed once
    for every layer; the parts are checked (``SegmentedCache.check_placeable``) first."""
    return {
        id(p): None
        if p.kv.start == p.segment.start
        else shifter.rotation(p.kv.start, p.segment.start, p.kv.length)
        for p in parts
        if not p.dense
    }


def laid_out(
    parts: Sequence[CachePart],
    layer_idx: int,
    shifter: RopeShifter | None,
    rotations: dict[int, Any],
    batch: int,
    bounds: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer_idx``'s keys and values of ``parts`` end to end, each in ONE new tensor of
    ``batch`` rows: a placed part's keys re-positioned straight into its slots
    (:meth:`RopeShifter.apply_into`: the values of ``SegmentKV.keys_at``) and its values copied there,
    a :class:`~hf_kvshare.segment_kv.DeferredKV` computed there (its ``write_layer``; the ``[min, max]``
    of the rows it computes appended to ``bounds`` as ``(what, layer, kind, bounds)``), a dense part's
    slots zero (its K/V still to come). One layer alive at a time; no concatenation."""
    reference = next(p.kv for p in parts if not p.dense).stored
    like_k, like_v = reference.keys[layer_idx], reference.values[layer_idx]
    total = sum(p.segment.length for p in parts)
    keys = like_k.new_empty((batch, like_k.shape[1], total, like_k.shape[3]))
    values = like_v.new_empty((batch, like_v.shape[1], total, like_v.shape[3]))
    at = 0
    for p in parts:
        n = p.segment.length
        k_out, v_out = keys[..., at : at + n, :], values[..., at : at + n, :]
        if p.dense:
            k_out.zero_()
            v_out.zero_()
        elif p.kv.deferred and rotations[id(p)] is None:
            p.kv.write_layer(layer_idx, k_out, v_out)
            rows = p.kv.checked_rows
            if bounds is not None and rows:
                what = f"{p.segment.kind} segment {p.segment.name!r} ({p.segment.provenance})"
                bounds.append((what, layer_idx, "keys", value_bounds(k_out[:1, :, :rows])))
                bounds.append((what, layer_idx, "values", value_bounds(v_out[:1, :, :rows])))
        else:
            k = p.kv.keys[layer_idx].expand(batch, -1, -1, -1)
            rotation = rotations[id(p)]
            if rotation is None:
                k_out.copy_(k)
            else:
                shifter.apply_into(k, rotation, k_out, layer=layer_idx)
            v_out.copy_(p.kv.values[layer_idx].expand(batch, -1, -1, -1))
        at += n
    return keys, values

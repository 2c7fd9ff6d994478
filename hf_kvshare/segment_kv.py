"""K/V detached from any cache: :class:`SegmentKV` (one segment's per-layer keys and values) and
:class:`DeferredKV` (K/V computed layer by layer where a cache writes it), the finiteness check every
reused K/V passes (:func:`check_finite`), and what a holder of views of a cache's storage needs
(:func:`compact`, :func:`storage_bytes`). Shapes follow transformers: ``[batch, kv_heads, seq,
head_dim]``, keys after RoPE. The caches (:mod:`hf_kvshare.cache`) store and hand out these."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .rope import RopeShifter

#: where a refusal names the K/V another rank found non-finite (the ranks of a tensor- or pipeline-parallel
#: engine refuse together: ``anchors.lowrank.any_rank``)
OTHER_RANK = "another tensor- or pipeline-parallel rank's K/V"


def check_finite(items: Sequence[tuple[str, SegmentKV]], first_layer: int = 0) -> None:
    """Raise ``ValueError`` for the first ``(what, kv)`` of ``items`` whose K/V hold NaN or inf, naming
    ``what``, the layer (the model's: ``first_layer`` is the index of the K/V's first, on a later
    pipeline stage) and keys/values. One reduction per tensor and one host read in all, whatever
    the number of segments (per-layer tensors may sit on several devices).

    The reduction is ``torch.aminmax`` (NaN propagates into both, +inf is the max, -inf the min): one
    pass without the tensor-sized boolean mask of ``isfinite(t).all()``, which was ~18x slower on a
    CPU (a 700-token SmolLM2 layer: 1.1 ms vs 62 us) and most of a serving record's time.

    A :class:`SegmentKV` marked :attr:`SegmentKV.finite` (taken from a checked engine read-back that
    nothing writes: the serving record's) is not read again. Passing does not mark: K/V a session holds
    is checked again at every use, so a tensor written in place after a check is still caught."""
    bounds, where = [], []
    # K/V not computed yet (DeferredKV): what it is computed from now, its own rows where they are computed
    items = [(what, kv.stored) for what, kv in items]
    items = [(what, kv) for what, kv in items if not kv.finite]  # checked already (SegmentKV.finite)
    for what, kv in items:
        for layer, pair in enumerate(zip(kv.keys, kv.values)):
            for kind, tensor in zip(("keys", "values"), pair):
                if tensor.numel() == 0 or tensor.is_meta:  # a stand-in: checked where its values are
                    continue
                bounds.append(value_bounds(tensor))
                where.append((what, layer, kind))
    bad = first_non_finite(bounds)
    if bad is not None:
        what, layer, kind = where[bad]
        raise non_finite(what, first_layer + layer, kind)


def non_finite(what: str, layer: int, kind: str) -> ValueError:
    """The error for K/V holding NaN or inf where it was to be reused or stored."""
    return ValueError(
        f"{what}: non-finite K/V (NaN or inf) in layer {layer} ({kind}); such K/V is never reused "
        "or stored (the turn changed nothing). Check the model's dtype / weights or what wrote this K/V"
    )


def value_bounds(tensor: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of ``tensor`` (float32): NaN propagates into both, +inf is the max, -inf the min."""
    return torch.stack(torch.aminmax(tensor)).float()


def first_non_finite(bounds: list[torch.Tensor]) -> int | None:
    """The index of the first ``bounds`` (:func:`value_bounds`) holding NaN or inf, one host read in all."""
    if not bounds:
        return None
    ok = torch.isfinite(torch.stack([b.to(bounds[0].device) for b in bounds])).all(dim=1).cpu()
    return None if bool(ok.all()) else int((~ok).nonzero()[0, 0])


@dataclass
class SegmentKV:
    """The per-layer K/V of one segment, detached from any cache.

    ``keys[l]`` / ``values[l]`` are ``[batch, kv_heads, seq, head_dim]``; keys are post-RoPE at
    positions ``start .. start + seq - 1``.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    start: int
    agent: str | None = None
    #: an image / video segment's rope layout on a multimodal-RoPE model (``mrope.VisualRope``); keys
    #: are kept in the slot frame there (:mod:`hf_kvshare.mrope`)
    rope: Any = None
    #: known to hold no NaN / inf: extracted from a cache that holds exactly a checked K/V
    #: (:attr:`SegmentedCache.known_finite`: the serving record's read-back, which the store holds and
    #: nothing writes), or set so by whoever checked it and keeps it unwritten. :func:`check_finite` skips
    #: it. Never set by construction or ``replace`` (``init=False``): a K/V derived from this one
    #: (re-positioned, corrected) is checked on its own.
    finite: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes held (a ``meta`` stand-in holds none: :func:`is_stand_in`)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if not t.is_meta)

    def check_finite(self, what: str, first_layer: int = 0) -> None:
        """Raise ``ValueError`` naming ``what`` and the first layer whose K/V hold NaN or inf
        (one reduction per tensor, one device sync in all): :func:`check_finite`."""
        check_finite([(what, self)], first_layer)

    def materialize(self, first_layer: int = 0) -> SegmentKV:
        """K/V held in tensors: itself (a :class:`DeferredKV` computes its own; ``first_layer``, the
        model's index of its layer 0 on a later pipeline stage, is added to the layer a non-finite
        error names)."""
        return self

    @property
    def stored(self) -> SegmentKV:
        """The K/V this one's shapes, dtypes and devices can be read from without computing anything:
        itself (a :class:`DeferredKV` not computed yet: what it is computed from)."""
        return self

    @property
    def deferred(self) -> bool:
        """Whether this K/V is computed where it is written (a :class:`DeferredKV` not read yet)."""
        return False

    def repositioned(self, shifter: RopeShifter, new_start: int) -> SegmentKV:
        """A copy whose keys sit at ``new_start .. new_start + length - 1`` (values need no rotation)."""
        if new_start == self.start:
            return self
        return replace(self, keys=list(self.keys_at(shifter, new_start)), start=new_start)

    def keys_at(self, shifter: RopeShifter | None, new_start: int) -> Iterator[torch.Tensor]:
        """Each layer's keys as they sit at ``new_start``, one layer at a time (a generator: a caller that
        copies each layer into a cache holds one layer's rotated keys at once, not every layer's, as
        :meth:`repositioned` does). The same values as :meth:`repositioned`'s keys."""
        if new_start == self.start:
            yield from self.keys
            return
        if shifter is None:
            raise ValueError(
                f"K/V sits at position {self.start}, not {new_start}: pass a RopeShifter to move it"
            )
        rotation = shifter.rotation(self.start, new_start, self.length)
        for i, k in enumerate(self.keys):
            yield shifter.apply(k, rotation, layer=i)

    def prefix(self, length: int) -> SegmentKV:
        return replace(
            self,
            keys=[k[..., :length, :] for k in self.keys],
            values=[v[..., :length, :] for v in self.values],
        )


class DeferredKV(SegmentKV):
    """K/V computed layer by layer where it is written, not held until it is read: the interface a
    cache that lays K/V out (:meth:`SegmentedCache.append_placed`, :meth:`SegmentedCache.reserve`)
    writes through, so such K/V is never held whole beside the cache being built.

    While :attr:`deferred`, a cache calls :meth:`write_layer` into the slots of each layer and checks
    the first :attr:`checked_rows` rows it wrote (the rows computed there; the others are copies of
    :attr:`stored`, checked by :func:`check_finite` before). Anything that reads :attr:`keys` /
    :attr:`values` gets them computed once, the same values bit for bit (the same :meth:`write_layer`,
    into new tensors), checked finite; what computed them is then dropped (:meth:`release`).

    An engine implements :attr:`stored`, :meth:`write_layer`, :attr:`checked_rows` and :meth:`release`
    (``hf_kvshare.anchors.corrected.CorrectedKV``, a correction). The constructor of a subclass must
    also take plain ``keys`` / ``values`` (what ``dataclasses.replace`` passes, reading :attr:`keys`):
    K/V held in tensors, never deferred."""

    _keys: list[torch.Tensor] | None = None
    _values: list[torch.Tensor] | None = None

    @property
    def keys(self) -> list[torch.Tensor]:
        if self._keys is None:
            self._materialize()
        return self._keys

    @keys.setter
    def keys(self, keys: list[torch.Tensor]) -> None:
        self._keys = keys

    @property
    def values(self) -> list[torch.Tensor]:
        if self._values is None:
            self._materialize()
        return self._values

    @values.setter
    def values(self, values: list[torch.Tensor]) -> None:
        self._values = values

    @property
    def materialized(self) -> bool:
        """Whether :attr:`keys` / :attr:`values` are held (read once, or given)."""
        return self._keys is not None

    @property
    def deferred(self) -> bool:
        return not self.materialized

    @property
    def checked_rows(self) -> int:
        """How many leading rows :meth:`write_layer` computes (checked finite where they are written)."""
        raise NotImplementedError

    def write_layer(self, layer: int, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Write layer ``layer``'s keys and values into ``keys_out`` / ``values_out``
        (``[batch, kv_heads, length, head_dim]``, batch >= 1: every row the same). Only while
        :attr:`deferred`."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop what computes the K/V (called once :attr:`keys` / :attr:`values` are held)."""

    @property
    def length(self) -> int:
        return self.stored.keys[0].shape[-2]

    @property
    def num_layers(self) -> int:
        return len(self.stored.keys)

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes  # computed K/V has the stored one's shapes and dtypes

    def _materialize(self, first_layer: int = 0) -> None:
        stored = self.stored
        keys, values = [], []
        for layer in range(self.num_layers):
            k_src, v_src = stored.keys[layer], stored.values[layer]
            key = k_src.new_empty((1, *k_src.shape[1:]))
            value = v_src.new_empty((1, *v_src.shape[1:]))
            self.write_layer(layer, key, value)
            keys.append(key)
            values.append(value)
        check_finite([(self.describe(), _plain(keys, values, self))], first_layer)
        self._keys, self._values = keys, values
        self.release()

    def describe(self) -> str:
        """What this K/V is, for an error message."""
        return f"{type(self).__name__} at position {self.start}"

    def materialize(self, first_layer: int = 0) -> SegmentKV:
        """Plain K/V of the same values (computed now if they were not: :meth:`SegmentKV.materialize`)."""
        if self._keys is None:
            self._materialize(first_layer)
        return _plain(self.keys, self.values, self)

    def repositioned(self, shifter: RopeShifter, new_start: int) -> SegmentKV:
        return self.materialize().repositioned(shifter, new_start)

    def keys_at(self, shifter: RopeShifter | None, new_start: int) -> Iterator[torch.Tensor]:
        return self.materialize().keys_at(shifter, new_start)

    def prefix(self, length: int) -> SegmentKV:
        return self.materialize().prefix(length)


def _plain(keys: list[torch.Tensor], values: list[torch.Tensor], like: SegmentKV) -> SegmentKV:
    return SegmentKV(keys=keys, values=values, start=like.start, agent=like.agent, rope=like.rope)


def is_stand_in(kv: SegmentKV) -> bool:
    """Whether ``kv`` is a stand-in: ``meta`` tensors with the K/V's shapes and dtypes and no values, whose
    views keep their storage and offsets (the serving scheduler's record of K/V that stay in vLLM's
    worker: :mod:`hf_kvshare.serving.worker_store`). Nothing can read its values; it holds no bytes."""
    kv = kv.stored
    return bool(kv.keys) and kv.keys[0].is_meta


def compact(kvs: Iterable[SegmentKV], storage_tokens: int, share: float = 0.5) -> bool:
    """Copy ``kvs`` (views of one cache's storage, :meth:`SegmentedCache.sharing_storage`, of disjoint
    spans) into storage of their own, in place (every holder of a :class:`SegmentKV` sees the copy),
    when together they hold less than ``share`` of the ``storage_tokens`` positions the views keep
    alive: a short span (an agent's output) then stops holding a whole cache. Returns whether it
    copied."""
    kvs = list(kvs)
    if not kvs or sum(kv.length for kv in kvs) >= share * storage_tokens or is_stand_in(kvs[0]):
        return False  # stand-ins hold no memory, and a copy would lose the rows they stand for
    for kv in kvs:
        kv.keys[:] = [k.clone() for k in kv.keys]
        kv.values[:] = [v.clone() for v in kv.values]
    return True


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages ``tensors`` keep alive, each counted once and whole (views of one cache's
    layers count that layer's tensor, not the span they show)."""
    seen: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        if t.is_meta:  # a stand-in (:func:`is_stand_in`): no memory
            continue
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())

"""KV caches that ``model.generate`` accepts unchanged.

``SegmentedCache`` is a :class:`transformers.DynamicCache` plus a *segment table*: which prompt
positions hold which PF/PH segment and where their K/V came from (dense / reused / corrected /
recomputed, and from which agent). As in transformers, the cache is a table that dispatches to its
layers and the layers store: each is a :class:`~hf_kvshare.cache_layer.SegmentLayer` (a
``DynamicLayer`` that keeps every position); detached K/V are :mod:`hf_kvshare.segment_kv`'s.
``SharedCache`` is the user-facing cache a method builds for one agent turn: a
``SegmentedCache`` that holds the prompt minus its last token and refuses to be silently reused
for a second ``generate``.

Storage only, as transformers' caches are: the model is run over a cache by
:mod:`hf_kvshare.prefill` (and by ``generate``), and the caches are registered for ``torch.export`` by
:mod:`hf_kvshare.export`. Tensor shapes follow transformers: keys and values are
``[batch, kv_heads, seq, head_dim]``, keys after RoPE.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from transformers import DynamicCache

from . import _compat
from ._compat import crop_argument, crop_target_length, update_position_ids
from .cache_layer import SegmentLayer, laid_out, own_layers, rotations
from .identity import ModelIdentity, config_signature, model_identity
from .rope import RopeShifter
from .segment_kv import (
    DeferredKV,
    SegmentKV,
    check_finite,
    compact,
    first_non_finite,
    non_finite,
    storage_bytes,
)

__all__ = [
    "PROVENANCES",
    "CachePart",
    "DeferredKV",
    "LayerIndexError",
    "PositionMismatchError",
    "Segment",
    "SegmentKV",
    "SegmentedCache",
    "SharedCache",
    "SlotWriter",
    "check_finite",
    "check_tiling",
    "compact",
    "config_signature",
    "non_finite",
    "storage_bytes",
    "token_digest",
]

Kind = Literal["PF", "PH"]
Provenance = Literal["dense", "reused", "corrected", "recomputed"]
PROVENANCES = ("dense", "reused", "corrected", "recomputed")


@dataclass
class Segment:
    """One row of the segment table: positions ``[start, end)`` of the cached prompt."""

    name: str  # PH slot name, or a label for a PF segment ("pf0", "pf1", ...)
    kind: Kind
    start: int
    end: int
    provenance: Provenance = "dense"
    source_agent: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # method-specific report (gate entropy, ...)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class CachePart:
    """One segment for :func:`hf_kvshare.prefill.prefill_parts`: K/V already obtained (``kv``, e.g. reused or
    corrected; re-positioned to ``segment.start`` if it sits elsewhere) or token ids to compute
    (``token_ids`` ``[batch, n]``, dense), with their input embeddings ``embeds`` ``[batch, n, hidden]``
    where the ids alone do not give them (an image's projected features: :mod:`hf_kvshare.vision`)."""

    segment: Segment
    kv: SegmentKV | None = None
    token_ids: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    #: an image / video segment's rope layout on a multimodal-RoPE model (``mrope.VisualRope``)
    rope: Any = None

    @property
    def dense(self) -> bool:
        return self.kv is None


class LayerIndexError(IndexError, ValueError):
    """An update for a layer the cache does not have: an ``IndexError`` like a list's (what callers of
    ``DynamicCache`` catch) and, for earlier callers of hf_kvshare, a ``ValueError``."""


class PositionMismatchError(RuntimeError):
    """An update whose tokens sit at other positions than the cache slots they would fill."""


def _is_config(value: Any) -> bool:
    return hasattr(value, "get_text_config") or hasattr(value, "num_hidden_layers")


class SegmentedCache(DynamicCache):
    """A ``DynamicCache`` with a segment table.

    Built like ``DynamicCache`` (same arguments; the first positional one may be a config or the
    list of ``(keys, values)`` pairs that ``DataParallel`` / pytree unflattening pass):

    Args:
        config: the model config: builds the layers up front and fixes the expected
            (layers, kv heads, head dim). ``None``: layers are created lazily by ``update`` (as in
            ``DynamicCache()``) and kv heads / head dim are fixed by the first update.
        ddp_cache_data: per-layer ``(keys, values[, sliding window])`` to fill the cache with; the
            table stays empty (plain tensors carry no segments), so :meth:`report` shows them as
            appended positions.
        offloading, offload_only_non_sliding: as in ``DynamicCache`` (layers offloaded to CPU between
            forwards; CUDA only, as there). :meth:`layer_kv` / :meth:`extract` then read the offloaded
            copy, wherever it lives.

    Where it differs from ``DynamicCache`` (each a clear error, never a silent difference):

    - sliding-window layers keep every position (a plain ``DynamicLayer``; the model's sliding-window
      mask hides what plain generation would have evicted): segments stay extractable, at the memory
      cost of a full layer;
    - an update whose shape differs from the first one (kv heads, head dim) raises ``ValueError``,
      one for a layer past the model's last raises :class:`LayerIndexError` (an ``IndexError``);
    - an update to a non-empty cache whose ``position_ids`` are not the cache slots it fills raises
      :class:`PositionMismatchError`: the table maps positions to slots, and K/V written at other
      positions (a prompt re-fed over a used cache; assisted / prompt-lookup decoding, which in
      transformers 5.24 re-feed the cached prompt on their first step) would make it false and the
      output silently wrong.

    It stores; it never runs the model: :mod:`hf_kvshare.prefill` runs it over token ids on top of a
    cache (:func:`~hf_kvshare.prefill.prefill_dense`, :func:`~hf_kvshare.prefill.prefill_parts`), and
    :mod:`hf_kvshare.export` registers the caches for ``torch.export``.

    >>> cache = SegmentedCache(model.config)  # doctest: +SKIP
    >>> prefill_dense(cache, model, ids_of_system_prompt, [Segment("sys", "PF", 0, n)])  # doctest: +SKIP
    >>> cache.append_kv(other_agents_query_kv, Segment("query", "PH", n, n + m, "reused"),
    ...                 shifter=RopeShifter.from_model(model))  # doctest: +SKIP
    >>> cache.segments  # doctest: +SKIP
    """

    #: plain attributes a pytree round trip (``torch.export``) keeps besides K/V and the table
    _PYTREE_STATE: tuple[str, ...] = ()
    #: whether :func:`hf_kvshare.export.register_export_support` registers the class (it must rebuild
    #: from K/V pairs)
    _PYTREE_NODE = True

    def __init__(
        self,
        config: Any = None,
        ddp_cache_data: Iterable[tuple[torch.Tensor | None, ...]] | None = None,
        offloading: bool = False,
        offload_only_non_sliding: bool = False,
    ):
        if config is not None and not _is_config(config):
            if ddp_cache_data is not None:
                raise TypeError("pass either a config or cache data first, not both")
            config, ddp_cache_data = None, config  # DynamicCache's first positional: the DDP data
        super().__init__(
            ddp_cache_data=ddp_cache_data,
            config=config,
            offloading=offloading,
            offload_only_non_sliding=offload_only_non_sliding,
        )
        own_layers(self)  # every layer a SegmentLayer: it stores (cache_layer.py), the cache is the table
        self.config = config
        #: (layers, kv heads, head dim); ``None`` entries are fixed by the first update (no config)
        self.signature: tuple[int | None, int | None, int | None] = (
            config_signature(config) if config is not None else (None, None, None)
        )
        if config is None:
            first = next((layer for layer in self.layers if layer.keys is not None), None)
            if first is not None:
                self.signature = (None, first.keys.shape[1], first.keys.shape[3])
        self.segments: list[Segment] = []
        self._recording_at: int | None = None
        #: the model the cache was built with (set by :meth:`bind_model`, e.g. on its first prefill)
        self.model_identity: ModelIdentity | None = None
        #: multimodal RoPE: the slots' rope layout (``mrope.RopeTrack``, kept by prefill); ``None``: 1D
        self.rope_track: Any = None

    # ------------------------------------------------------------------ views
    @property
    def num_layers(self) -> int:
        """Layers of the model (without a config: the layers created so far)."""
        return self.signature[0] if self.signature[0] is not None else len(self.layers)

    @property
    def appended(self) -> list[Segment]:
        """Rows for the positions past the table (fed by ``generate``): one ``appended`` row. They
        follow the cache: a ``crop`` (e.g. an assistant's rejected draft) removes them."""
        start, end = self.segmented_length, self.get_seq_length()
        return [Segment("appended", "PF", start, end)] if end > start else []

    def table(self) -> list[Segment]:
        """The segment table followed by the rows of what ``generate`` appended (:attr:`appended`)."""
        return [*self.segments, *self.appended]

    @property
    def segmented_length(self) -> int:
        """Positions covered by the segment table (the rest, if any, was appended by generate)."""
        return self.segments[-1].end if self.segments else 0

    def segment(self, name: str) -> Segment:
        for seg in reversed(self.segments):
            if seg.name == name:
                return seg
        raise KeyError(f"no segment named {name!r}; segments: {[s.name for s in self.segments]}")

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if not layer.is_initialized or layer.keys is None:
            raise ValueError(f"layer {layer_idx} of the cache is empty")
        return layer.keys, layer.values

    def extract(self, start: int, end: int, agent: str | None = None) -> SegmentKV:
        """Copy positions ``[start, end)`` of every layer into a detached :class:`SegmentKV` (inside
        :meth:`sharing_storage`: views of the cache's storage instead, no copy)."""
        if not 0 <= start < end <= self.get_seq_length():
            raise ValueError(
                f"cannot extract [{start}, {end}) from a cache of length {self.get_seq_length()}"
            )
        views = self.__dict__.get("_extract_views", False)
        keys, values = [], []
        for layer_idx in range(self.num_layers):
            k, v = self.layer_kv(layer_idx)
            k, v = k[..., start:end, :], v[..., start:end, :]
            keys.append(k if views else k.clone())
            values.append(v if views else v.clone())
        if self.rope_track is None:
            kv = SegmentKV(keys=keys, values=values, start=start, agent=agent)
            kv.finite = self.known_finite
            return kv
        keys, rope = self.rope_track.slot_frame(keys, start)  # multimodal RoPE: kept in the slot frame
        return SegmentKV(keys=keys, values=values, start=start, agent=agent, rope=rope)

    @property
    def known_finite(self) -> bool:
        """Whether every layer's K/V is known to hold no NaN / inf: the cache holds exactly a checked
        :class:`SegmentKV` given whole to :meth:`append_tiled` (``adopt=True``) and nothing was written
        since. Extracts are then marked (:attr:`SegmentKV.finite`) and not checked again."""
        return self.__dict__.get("_known_finite", False)

    @contextmanager
    def sharing_storage(self) -> Iterator[SegmentedCache]:
        """A block in which :meth:`extract` returns views of this cache's per-layer K/V rather than
        copies: the session's record of a turn's slots (their K/V stay the cache's, no second copy is
        made while the cache is alive). Safe because the cache never writes into stored positions: an
        update appends by concatenation (new storage), ``crop`` / ``reset`` drop references, and only a
        :class:`SlotWriter` writes in place, into slots it reserved in the same prefill. A view keeps
        the whole layer tensor alive: :func:`compact` copies views that hold little of it."""
        previous = self.__dict__.get("_extract_views", False)
        self._extract_views = True
        try:
            yield self
        finally:
            self._extract_views = previous

    def extract_segment(self, name: str, agent: str | None = None) -> SegmentKV:
        seg = self.segment(name)
        return self.extract(seg.start, seg.end, agent=agent)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V this cache object holds itself (for a BaseLRCache: the materialized prefix and
        appended positions; the shared store is counted by the method)."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized and layer.keys is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    # --------------------------------------------------------------- building
    def _check_shapes(self, key_states: torch.Tensor, layer_idx: int) -> None:
        layers, kv_heads, head_dim = self.signature
        if layers is not None and not 0 <= layer_idx < layers:
            raise LayerIndexError(
                f"this cache was built for a model with {layers} layers; got an update for layer {layer_idx}"
            )
        if kv_heads is None and key_states.dim() == 4:  # no config: the first update fixes the shape
            self.signature = (layers, key_states.shape[1], key_states.shape[3])
            kv_heads, head_dim = self.signature[1:]
        if key_states.dim() != 4 or key_states.shape[1] != kv_heads or key_states.shape[3] != head_dim:
            raise ValueError(
                f"this cache was built for a model with {kv_heads} kv heads of dim {head_dim} "
                f"([batch, {kv_heads}, seq, {head_dim}]); got key states of shape {tuple(key_states.shape)}"
            )

    def _check_positions(self, key_states: torch.Tensor, layer_idx: int, args: tuple, kwargs: dict) -> None:
        """Refuse tokens whose positions are not the slots they would fill (the table would lie)."""
        n = key_states.shape[-2]
        if layer_idx != 0 or n == 1 or _compat.is_tracing():
            return  # one token: reading its position would cost a device sync per decoding step
        length = self.get_seq_length()
        positions = update_position_ids(args, kwargs)
        if length == 0 or positions is None or positions.numel() == 0:
            return  # an empty cache may start anywhere; without position ids the model counts slots
        last = int(positions[..., -1].max())  # left-padded rows sit lower; an unpadded row is exact
        if last != length + n - 1:
            first = last - n + 1
            raise PositionMismatchError(self._position_message(length, n, first, last))

    def _position_message(self, length: int, n: int, first: int, last: int) -> str:
        what = (
            f"an update of {n} tokens at positions {first}..{last} would fill slots {length}..{length + n - 1} "
            f"of this {type(self).__name__} (it holds {length} tokens)"
        )
        if self._recording_at == length:
            return (
                f"{what}: assisted decoding (assistant_model= / prompt_lookup_num_tokens=) on a cache that already "
                "holds part of the input re-feeds the whole input on its first step in transformers "
                f"{_compat.TRANSFORMERS_VERSION}, so its output would be silently wrong. Pass only the new tokens "
                "as input_ids with the full attention_mask, or generate without assisted decoding"
            )
        return (
            f"{what}: the input was fed over a cache that already holds it (e.g. the same prompt to a second "
            "generate); pass the prompt plus what was generated (continuing), or a fresh cache / `cache.copy()`"
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._before_update(key_states, layer_idx, args, kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _before_update(self, key_states: torch.Tensor, layer_idx: int, args: tuple, kwargs: dict) -> None:
        self._check_shapes(key_states, layer_idx)
        self._check_positions(key_states, layer_idx, args, kwargs)
        self._known_finite = False  # new K/V, unchecked

    def _store_new(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> None:
        """``update`` with tensors just built for this layer and read by no one else: a segment layer
        holds them (:meth:`SegmentLayer.hold`: as they are if it is empty, where ``DynamicLayer.update``
        would copy them once more), behind the guards of ``update``; any other layer is updated."""
        if (
            type(self).update is SegmentedCache.update
            and layer_idx < len(self.layers)
            and isinstance(self.layers[layer_idx], SegmentLayer)
            and not self.offloading
        ):
            self._before_update(keys, layer_idx, (), {})  # the guards of update, then store
            self.layers[layer_idx].hold(keys, values)
            return
        self.update(keys, values, layer_idx)

    def activate_past_recording(self, **kwargs: Any) -> None:
        """``generate`` calls this before assisted decoding (and, on CUDA, after a prefill): remember
        where, so that a refused first step can name the mode. Whatever ``generate`` passes (since
        transformers 5.25: ``recurrent_states_to_keep``) goes on to the cache's own method."""
        self._recording_at = self.get_seq_length()
        super().activate_past_recording(**kwargs)

    def check_model(self, model_or_config: Any) -> None:
        """Raise if this cache was built for another model: another shape (layers, kv heads, head dim)
        or, given a model and a cache that knows its model (:attr:`model_identity`), other weights."""
        config = getattr(model_or_config, "config", model_or_config)
        other = config_signature(config)
        if any(ours is not None and ours != theirs for ours, theirs in zip(self.signature, other)):
            raise ValueError(
                "cache/model mismatch: the cache was built for (layers, kv_heads, head_dim) = "
                f"{self.signature}, the model has {other}"
            )
        if isinstance(model_or_config, torch.nn.Module) and self.model_identity is not None:
            identity = model_identity(model_or_config)
            if identity != self.model_identity:
                raise ValueError(
                    f"cache/model mismatch: this {type(self).__name__} was built with the model "
                    f"{self.model_identity}; it is used with the model {identity}. K/V of one model are "
                    "meaningless for another: build the cache with the model that uses it"
                )

    def bind_model(self, model: torch.nn.Module) -> None:
        """Record the model this cache is built with (a cache that knows one refuses another)."""
        if self.model_identity is None:
            self.check_model(model)
            self.model_identity = model_identity(model)
        else:
            self.check_model(model)

    def append_kv(
        self, kv: SegmentKV, segment: Segment, shifter: RopeShifter | None = None, rope: Any = None
    ) -> None:
        """Append an external segment's K/V, re-positioned to where it lands (the current end).
        ``rope``: an image segment's layout on a multimodal-RoPE cache (else ``kv.rope``)."""
        start = self.get_seq_length()
        if segment.start != start:
            raise ValueError(
                f"segment {segment.name!r} says [{segment.start}, {segment.end}) but the cache ends at {start}"
            )
        self.check_placeable(kv, segment, shifter)
        if self.rope_track is not None:  # multimodal RoPE: from the slot frame to its rope positions
            moved = self.rope_track.place(kv, start, shifter, rope)
            for layer_idx in range(self.num_layers):
                self.update(moved[layer_idx], kv.values[layer_idx], layer_idx)
        else:
            # re-positioned layer by layer: one layer's rotated keys alive at a time, not a whole copy
            for layer_idx, keys in enumerate(kv.keys_at(shifter, start)):
                self.update(keys, kv.values[layer_idx], layer_idx)
        self.segments.append(segment)

    def check_placeable(
        self, kv: SegmentKV, segment: Segment, shifter: RopeShifter | None, *, layers: bool = True
    ) -> None:
        """Raise ``ValueError`` unless ``kv`` can be stored at ``segment``: as many tokens, this
        cache's layer count (``layers``), and a shifter where it sits elsewhere."""
        if segment.length != kv.length:
            raise ValueError(
                f"segment {segment.name!r} says [{segment.start}, {segment.end}) but the K/V has "
                f"{kv.length} tokens"
            )
        if layers and kv.num_layers != self.num_layers:
            raise ValueError(f"K/V has {kv.num_layers} layers, the cache {self.num_layers}")
        if kv.start != segment.start and shifter is None:
            raise ValueError(
                f"K/V sits at position {kv.start}, not {segment.start}: pass a RopeShifter to move it"
            )

    def append_placed(self, parts: Sequence[CachePart], shifter: RopeShifter | None = None) -> None:
        """Append placed parts (``kv=``, in positional order from the cache's end), each re-positioned
        to where it lands as :meth:`append_kv` does, each layer written once: ``DynamicLayer`` appends
        by concatenation, so appending part by part copies the whole layer once per part (a turn
        placing its kept prefix, a document and the text after it copied the document's K/V once for
        each part after it). Here each layer's K/V are laid out in one new tensor (keys rotated
        straight into their slots), which an empty layer holds as it is. The same K/V and table as
        :meth:`append_kv` per part, bit for bit; a :class:`DeferredKV` (a correction) is computed in its
        slots (:meth:`DeferredKV.write_layer`), never whole beside them. A lone plain part, a multimodal-RoPE
        cache (the parts' rope layouts) and a cache that cannot reserve (offloaded, other layer types)
        append part by part. Every part is checked against where it lands before anything is stored;
        a non-finite correction stores nothing."""
        parts = list(parts)
        if not parts:
            return
        start = self.get_seq_length()
        check_tiling([p.segment for p in parts], start, parts[-1].segment.end)
        for p in parts:
            if p.kv is None:
                raise ValueError(
                    f"part {p.segment.name!r} has no K/V to place (token_ids are computed, not placed)"
                )
            self.check_placeable(p.kv, p.segment, shifter)
        one = len(parts) == 1 and not parts[0].kv.deferred  # a lone K/V held as it is (no copy)
        if one or self.rope_track is not None or not self.can_reserve:
            for p in parts:
                self.append_kv(p.kv, p.segment, shifter, rope=p.rope)
            return
        batch = max(p.kv.stored.keys[0].shape[0] for p in parts)
        self._lay_out(parts, shifter, batch, self.num_layers)
        self.segments.extend(p.segment for p in parts)

    def append_tiled(self, kv: SegmentKV, segments: Sequence[Segment], adopt: bool = False) -> None:
        """Append K/V already at the positions it lands at (``kv.start`` = the cache's end) whose
        rows ``segments`` tile in order: one update per layer, where :meth:`append_kv` per segment
        would copy the layer once per segment (``DynamicLayer`` appends by concatenation). What the
        serving host records: the K/V an engine computed for a whole request, its table already
        known. Nothing is stored when the arguments disagree.

        ``adopt=True``: ``kv``'s tensors are the caller's to give (read by no one else afterwards: the
        engine's read-back of one request). An empty cache of plain layers then holds them as they
        are, no copy (views of the caller's storage; :func:`storage_bytes` counts it whole), and when
        ``kv`` is :attr:`~SegmentKV.finite` the cache is :attr:`known_finite`."""
        start = self.get_seq_length()
        if kv.start != start:
            raise ValueError(f"K/V sits at position {kv.start}, the cache ends at {start}")
        if kv.num_layers != self.num_layers:
            raise ValueError(f"K/V has {kv.num_layers} layers, the cache {self.num_layers}")
        if self.rope_track is not None:
            raise ValueError("append_tiled does not place multimodal-RoPE K/V: use append_kv")
        if not segments:
            raise ValueError(f"no segments for the {kv.length} tokens of K/V")
        check_tiling(segments, start, start + kv.length)
        held = adopt and start == 0
        for layer_idx in range(self.num_layers):
            if held:
                self._store_new(kv.keys[layer_idx], kv.values[layer_idx], layer_idx)
            else:
                self.update(kv.keys[layer_idx], kv.values[layer_idx], layer_idx)
        self.segments.extend(segments)
        self._known_finite = held and kv.finite

    @property
    def can_reserve(self) -> bool:
        """Whether :meth:`reserve` can write into this cache's layers in place: :class:`SegmentLayer`
        layers, not offloaded."""
        return not self.offloading and all(type(layer) is SegmentLayer for layer in self.layers)

    def reserve(
        self, parts: Sequence[CachePart], slots: torch.Tensor, shifter: RopeShifter | None = None
    ) -> SlotWriter:
        """Store ``parts`` (in positional order, tiling the positions after the end, at least one placed
        and one dense) with the dense parts' K/V still to come: each placed part's K/V in its slots
        (re-positioned there by ``shifter`` layer by layer where it sits elsewhere, rotated straight
        into the layer's new tensor: one layer alive at a time, no concatenation), zeros in the dense
        parts' slots ``slots`` (their positions, in order).
        Returns the :class:`SlotWriter` a forward of the dense tokens writes through to fill them
        (:func:`hf_kvshare.prefill.prefill_parts`). The table is left to the caller; ``crop_to`` the
        old length undoes it. Placed parts that do not fit their segments are refused
        (:meth:`check_placeable`) before anything is stored."""
        for p in parts:
            if not p.dense:  # a cache without a config learns its layers from the first update
                self.check_placeable(p.kv, p.segment, shifter, layers=self.signature[0] is not None)
        batch = max(p.token_ids.shape[0] for p in parts if p.dense)
        reference = next(p.kv for p in parts if not p.dense)
        self._lay_out(parts, shifter, batch, reference.num_layers)
        return SlotWriter(self, slots)

    def _lay_out(
        self, parts: Sequence[CachePart], shifter: RopeShifter | None, batch: int, layers: int
    ) -> None:
        """Store ``parts`` end to end, each layer laid out in one new tensor (:func:`cache_layer.laid_out`);
        the rows a :class:`DeferredKV` computes as it is written are checked finite, once for all
        layers, and a failure leaves the cache as it was (``ValueError``; every layer cut back to where
        it started: a layout that stopped part way extended only some)."""
        start = self.get_seq_length()
        moves = rotations(parts, shifter)
        bounds: list[tuple[str, int, str, torch.Tensor]] = []
        try:
            for layer_idx in range(layers):
                self._store_new(*laid_out(parts, layer_idx, shifter, moves, batch, bounds), layer_idx)
            bad = first_non_finite([b for *_, b in bounds])
        except BaseException:
            for layer in self.layers:
                layer.keep(start)
            raise
        if bad is not None:
            for layer in self.layers:
                layer.keep(start)
            raise non_finite(*bounds[bad][:3])

    # ------------------------------------------- what generate may call on us
    def crop(self, tokens_to_remove: int) -> None:
        keep = crop_target_length(self.get_seq_length(), tokens_to_remove)
        super().crop(crop_argument(self.get_seq_length(), keep))
        self.segments = cropped_table(self.segments, keep)
        if self.rope_track is not None:
            self.rope_track.crop(keep)

    def crop_to(self, length: int) -> None:
        """Keep the first ``length`` positions (any transformers version)."""
        self.crop(crop_argument(self.get_seq_length(), length))

    def reset(self) -> None:
        _compat.drop_layer_states(self.layers)
        super().reset()
        self.segments = []
        self.rope_track = None
        self._known_finite = False

    def copy(self) -> SegmentedCache:
        """An independent copy (tensors cloned) with the same segment table."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        offload = (
            {"offloading": True, "offload_only_non_sliding": self.only_non_sliding} if self.offloading else {}
        )
        DynamicCache.__init__(new, config=self.config, **offload)
        own_layers(new)
        new.layers = [
            layer.copy() if isinstance(layer, SegmentLayer) else deepcopy(layer) for layer in self.layers
        ]
        new.segments = [replace(s, info=dict(s.info)) for s in self.segments]
        new.rope_track = None if self.rope_track is None else self.rope_track.copy()
        return new

    # ----------------------------------------------------------------- report
    def report(self) -> str:
        """A readable table of the segments and their provenance."""
        rows = [
            f"{type(self).__name__}: {self.get_seq_length()} cached tokens, {self.nbytes / 2**20:.2f} MiB"
        ]
        rows.append(f"  {'segment':<16}{'kind':<5}{'span':<14}{'provenance':<12}{'source':<12}info")
        for seg in self.segments:
            info = ", ".join(f"{k}={_fmt(v)}" for k, v in seg.info.items())
            rows.append(
                f"  {seg.name:<16}{seg.kind:<5}{f'[{seg.start},{seg.end})':<14}{seg.provenance:<12}"
                f"{seg.source_agent or '-':<12}{info}"
            )
        for seg in self.appended:
            rows.append(
                f"  (+{seg.length} positions appended by generate: {seg.name} [{seg.start},{seg.end}))"
            )
        return "\n".join(rows)

    def __repr__(self) -> str:
        return self.report()


class SharedCache(SegmentedCache):
    """The cache a method builds for one agent turn; pass it to ``generate`` unchanged.

    It holds the prompt minus (at least) its last token, so ``generate`` feeds the rest; on that
    first forward it follows ``generate``'s batch expansion (beams, ``num_return_sequences``). Every
    decoding mode that keeps tokens at their positions works on it as on a ``DynamicCache`` holding
    the same K/V: greedy, sampling, beam search, ``prefill_chunk_size``, continuing generation
    (``input_ids`` = prompt + output + new tokens), assisted / prompt-lookup decoding fed only the new
    tokens. What ``generate`` appends is listed by :attr:`appended` (``prompt_tail``, ``generated``)
    and a ``crop`` removes it.

    Refused (:class:`PositionMismatchError`, before the forward writes anything): re-feeding the
    prompt over a used cache (a second ``generate`` with the same ``input_ids``: call :meth:`copy`
    before each ``generate`` instead) and assisted decoding given the full ``input_ids`` (transformers
    5.24 re-feeds the cached prompt on its first step; see ``SegmentedCache``).

    >>> cache, prompt_ids = session.build_cache("critic", segments)  # doctest: +SKIP
    >>> out = model.generate(input_ids=prompt_ids, cache=cache, max_new_tokens=32)  # doctest: +SKIP
    >>> print(cache.report())  # doctest: +SKIP
    """

    _PYTREE_STATE = ("prompt_length", "_sealed_length", "_generating")

    def __init__(self, config: Any = None, ddp_cache_data: Any = None, **options: Any):
        super().__init__(config, ddp_cache_data, **options)
        self.prompt_length: int | None = None  # full prompt length the cache was built for
        self._sealed_length: int | None = None
        self._generating = False
        #: sha256 of the token ids the cache holds (``seal(token_ids=)``): checked on the first forward
        self.token_digest: str | None = None

    def seal(self, prompt_length: int, token_ids: torch.Tensor | None = None) -> None:
        """Mark the cache as built for a prompt of ``prompt_length`` tokens; with ``token_ids`` (the
        prompt, ``[P]``, on the host) it records a digest of the ids it holds, and ``generate`` over
        other ids (another prompt of the same length, a batch of prompts it was not built for) is
        refused on its first forward."""
        if self.get_seq_length() >= prompt_length:
            raise ValueError(
                f"the cache holds {self.get_seq_length()} tokens of a {prompt_length}-token prompt; generate needs "
                "at least the last prompt token left out (it would otherwise re-feed the whole prompt)"
            )
        held = self.get_seq_length()
        if token_ids is not None:
            token_ids = token_ids.reshape(-1)
            if token_ids.numel() != prompt_length:
                raise ValueError(f"seal: {token_ids.numel()} token ids for a {prompt_length}-token prompt")
        self.token_digest = None if token_ids is None else token_digest(token_ids[:held])
        self.prompt_length = prompt_length
        self._sealed_length = held
        self._generating = False

    @property
    def appended(self) -> list[Segment]:
        """``prompt_tail`` (the prompt tokens ``generate`` fed) and ``generated`` (its output tokens but the
        last, which ``generate`` never feeds; plus any continuation) rows past the table."""
        start, end = self.segmented_length, self.get_seq_length()
        if self.prompt_length is None or end <= start:
            return super().appended
        rows = []
        split = min(max(self.prompt_length, start), end)
        if split > start:
            rows.append(Segment("prompt_tail", "PF", start, split))
        if end > split:
            rows.append(Segment("generated", "PF", split, end))
        return rows

    def _before_update(self, key_states: torch.Tensor, layer_idx: int, args: tuple, kwargs: dict) -> None:
        super()._before_update(key_states, layer_idx, args, kwargs)  # checks first: a refusal changes nothing
        if self._sealed_length is not None and layer_idx == 0:
            if not self._generating:
                self._check_caller()
                self._check_tokens(key_states.shape[0])
                self._expand_for(key_states.shape[0])
            self._generating = True

    def get_mask_sizes(self, *args: Any, **kwargs: Any):
        if self._sealed_length is not None and not _compat.is_tracing():
            if _compat.mask_query_length(args, kwargs) == 0:
                used = (
                    f"; it was already used by a generate call (built for {self._sealed_length} tokens of a "
                    f"{self.prompt_length}-token prompt)"
                    if self._generating
                    else ""
                )
                raise PositionMismatchError(
                    f"generate has no token to feed: this {type(self).__name__} holds {self.get_seq_length()} "
                    f"tokens and the input_ids are not longer{used}. Pass the prompt plus what was generated "
                    "(continuing), or a fresh cache / `cache.copy()` made before the first generate"
                )
        return super().get_mask_sizes(*args, **kwargs)

    def _check_caller(self) -> None:
        """On the first forward over the built cache (``generate``'s first step): refuse a model other
        than the one the cache was built with (found on the call stack; no hook is involved)."""
        if self.model_identity is None or _compat.is_tracing():
            return
        decoder = _compat.calling_decoder()
        if decoder is not None:
            self.check_model(decoder)

    def _check_tokens(self, batch: int) -> None:
        """On the first forward over the built cache: refuse ``generate`` over token ids other than the
        ones the cache holds (every row of its ``input_ids``, found on the call stack, must begin with
        them: a batch of other prompts is refused, ``generate``'s copies of the prompt for beams /
        ``num_return_sequences`` pass). Without a recorded digest nothing is checked; a cache used
        with a batch it cannot verify is refused rather than silently copied."""
        if self.token_digest is None or _compat.is_tracing():
            return
        held = self._sealed_length or 0
        ours = self._stored_batch()
        ids = _compat.generating_input_ids(held + 1) if held else None
        if ids is None:
            if ours is not None and batch != ours:
                raise ValueError(
                    f"this {type(self).__name__} was built for batch size {ours} (one prompt) and is fed a batch "
                    f"of {batch} whose token ids cannot be checked; pass the prompt it was built for as input_ids"
                )
            return
        rows = ids[:, :held].to("cpu")
        for row in range(rows.shape[0]):
            if token_digest(rows[row]) != self.token_digest:
                raise ValueError(
                    f"this {type(self).__name__} holds the K/V of {held} tokens of another prompt than row {row} of "
                    f"the input_ids ({rows.shape[0]} rows of {ids.shape[-1]} tokens) generate is given: its first "
                    f"{held} token ids differ from the ones the cache was built for (digest {self.token_digest[:12]}). "
                    "A cache is built for one prompt: build one per prompt (Session.build_cache)"
                )

    def _stored_batch(self) -> int | None:
        keys = getattr(self.layers[0], "keys", None) if self.layers else None
        return keys.shape[0] if isinstance(keys, torch.Tensor) and keys.numel() else None

    def _position_message(self, length: int, n: int, first: int, last: int) -> str:
        message = super()._position_message(length, n, first, last)
        if self._generating and self._recording_at != length:
            return (
                f"this SharedCache was already used by a generate call (it now holds {length} tokens, built for "
                f"{self._sealed_length}): {message}"
            )
        return message

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self._sealed_length is not None:
            self._sealed_length = min(self._sealed_length, self.get_seq_length())

    def _expand_for(self, batch: int) -> None:
        """``generate`` expands ``input_ids`` for beams / ``num_return_sequences`` (repeat-interleave)
        but not a user-given cache: follow it on the first forward."""
        keys = getattr(self.layers[0], "keys", None)  # stored keys only: never materialize a lazy layer here
        if not isinstance(keys, torch.Tensor) or keys.numel() == 0 or keys.shape[0] == batch:
            return
        ours = keys.shape[0]
        if batch % ours:
            raise ValueError(f"the cache was built for batch size {ours}; generate feeds batch size {batch}")
        self.batch_repeat_interleave(batch // ours)

    @contextmanager
    def unsealed(self):
        """Let the library extend a used cache (e.g. to complete an output segment)."""
        sealed, self._sealed_length = self._sealed_length, None
        try:
            yield self
        finally:
            self._sealed_length = sealed

    def reset(self) -> None:
        super().reset()
        self._sealed_length = None
        self._generating = False


def token_digest(token_ids: torch.Tensor) -> str:
    """sha256 of token ids (as int64, in order): what a :class:`SharedCache` records of its prompt."""
    ids = token_ids.detach().reshape(-1).to("cpu", torch.int64).contiguous()
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()


class SlotWriter(DynamicCache):
    """What a forward writes through when its tokens fill slots a :class:`SegmentedCache` reserved
    (:meth:`SegmentedCache.reserve`) rather than its end: a ``DynamicCache`` over the cache's own layer
    objects whose ``update`` copies each layer's new K/V into ``slots`` (in place, before that layer
    attends) and returns the layer's whole K/V. The prefill passes it to the model in place of the cache,
    so the cache's own ``update`` (what ``generate`` calls) always appends."""

    def __init__(self, cache: SegmentedCache, slots: torch.Tensor):
        super().__init__()
        self.layers = cache.layers
        self.cache = cache
        self.slots = slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.cache._check_shapes(key_states, layer_idx)
        self.cache._known_finite = False  # written in place, unchecked
        return self.layers[layer_idx].write_slots(self.slots, key_states, value_states)


def cropped_table(segments: Sequence[Segment], keep: int) -> list[Segment]:
    """The rows of ``segments`` within the first ``keep`` positions (a row across ``keep`` cut there)."""
    kept = []
    for seg in segments:
        if seg.start >= keep:
            break
        kept.append(replace(seg, end=min(seg.end, keep)) if seg.end > keep else seg)
    return kept


def check_tiling(segments: Sequence[Segment], start: int, end: int) -> None:
    """Raise ``ValueError`` unless ``segments`` tile positions ``[start, end)`` in order (none: no rows)."""
    pos = start
    for seg in segments:
        if seg.start != pos or seg.end < seg.start:
            raise ValueError(
                f"segments must tile [{start}, {end}); {seg.name!r} starts at {seg.start}, not {pos}"
            )
        pos = seg.end
    if segments and pos != end:
        raise ValueError(f"segments cover [{start}, {pos}) but {end - start} tokens were given")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], float):
        return "[" + ", ".join(f"{v:.2f}" for v in value) + "]"
    return str(value)

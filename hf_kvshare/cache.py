"""KV caches that ``model.generate`` accepts unchanged.

``SegmentedCache`` is a :class:`transformers.DynamicCache` (per-layer storage stays in
transformers' ``DynamicLayer`` objects) plus a *segment table*: which prompt positions hold which
PF/PH segment and where their K/V came from (dense / reused / corrected / recomputed, and from
which agent). ``SharedCache`` is the user-facing cache a method builds for one agent turn: a
``SegmentedCache`` that holds the prompt minus its last token and refuses to be silently reused
for a second ``generate``.

Tensor shapes follow transformers: keys and values are ``[batch, kv_heads, seq, head_dim]``,
keys after RoPE.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import zip_longest
from typing import Any, Literal

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import _compat
from ._compat import cache_kwargs, crop_argument, crop_target_length, update_position_ids
from .identity import ModelIdentity, config_signature, model_identity
from .rope import RopeShifter

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


def check_finite(items: Sequence[tuple[str, SegmentKV]]) -> None:
    """Raise ``ValueError`` for the first ``(what, kv)`` of ``items`` whose K/V hold NaN or inf, naming
    ``what``, the layer and keys/values. One reduction per tensor and one host read in all, whatever
    the number of segments (per-layer tensors may sit on several devices)."""
    flags, where = [], []
    for what, kv in items:
        for layer, pair in enumerate(zip(kv.keys, kv.values)):
            for kind, tensor in zip(("keys", "values"), pair):
                flags.append(torch.isfinite(tensor).all())
                where.append((what, layer, kind))
    if not flags:
        return
    ok = torch.stack([f.to(flags[0].device) for f in flags]).cpu()
    if bool(ok.all()):
        return
    what, layer, kind = where[int((~ok).nonzero()[0, 0])]
    raise ValueError(
        f"{what}: non-finite K/V (NaN or inf) in layer {layer} ({kind}); such K/V is never reused "
        "or stored (the turn changed nothing). Check the model's dtype / weights or what wrote this K/V"
    )


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

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def check_finite(self, what: str) -> None:
        """Raise ``ValueError`` naming ``what`` and the first layer whose K/V hold NaN or inf
        (one reduction per tensor, one device sync in all): :func:`check_finite`."""
        check_finite([(what, self)])

    def repositioned(self, shifter: RopeShifter, new_start: int) -> SegmentKV:
        """A copy whose keys sit at ``new_start .. new_start + length - 1`` (values need no rotation)."""
        if new_start == self.start:
            return self
        rotation = shifter.rotation(self.start, new_start, self.length)
        keys = [shifter.apply(k, rotation, layer=i) for i, k in enumerate(self.keys)]
        return replace(self, keys=keys, start=new_start)

    def prefix(self, length: int) -> SegmentKV:
        return replace(
            self,
            keys=[k[..., :length, :] for k in self.keys],
            values=[v[..., :length, :] for v in self.values],
        )


@dataclass
class CachePart:
    """One segment for :meth:`SegmentedCache.append_parts`: K/V already obtained (``kv``, e.g. reused or
    corrected; re-positioned to ``segment.start`` if it sits elsewhere) or token ids to compute
    (``token_ids`` ``[batch, n]``, dense)."""

    segment: Segment
    kv: SegmentKV | None = None
    token_ids: torch.Tensor | None = None

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

    >>> cache = SegmentedCache(model.config)  # doctest: +SKIP
    >>> cache.append_dense(model, ids_of_system_prompt, name="sys", kind="PF")  # doctest: +SKIP
    >>> cache.append_kv(other_agents_query_kv, name="query", kind="PH", provenance="reused",
    ...                 shifter=RopeShifter.from_model(model))  # doctest: +SKIP
    >>> cache.segments  # doctest: +SKIP
    """

    #: plain attributes a pytree round trip (``torch.export``) keeps besides K/V and the table
    _PYTREE_STATE: tuple[str, ...] = ()
    #: whether :func:`register_export_support` registers the class (it must rebuild from K/V pairs)
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
        _keep_sliding_layers_whole(self)
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
        #: during :meth:`append_parts`' one forward: the slots its tokens fill (positional order)
        self._dense_slots: torch.Tensor | None = None
        #: the model the cache was built with (set by its first dense prefill or :meth:`bind_model`)
        self.model_identity: ModelIdentity | None = None

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
        """Copy positions ``[start, end)`` of every layer into a detached :class:`SegmentKV`."""
        if not 0 <= start < end <= self.get_seq_length():
            raise ValueError(
                f"cannot extract [{start}, {end}) from a cache of length {self.get_seq_length()}"
            )
        keys, values = [], []
        for layer_idx in range(self.num_layers):
            k, v = self.layer_kv(layer_idx)
            keys.append(k[..., start:end, :].clone())
            values.append(v[..., start:end, :].clone())
        return SegmentKV(keys=keys, values=values, start=start, agent=agent)

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
        if self._dense_slots is not None:  # append_parts' forward: write into the reserved slots
            self._check_shapes(key_states, layer_idx)
            layer = self.layers[layer_idx]
            slots = self._dense_slots.to(layer.keys.device)
            layer.keys.index_copy_(-2, slots, key_states.to(layer.keys.dtype))
            layer.values.index_copy_(-2, slots, value_states.to(layer.values.dtype))
            return layer.keys, layer.values
        self._before_update(key_states, layer_idx, args, kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _before_update(self, key_states: torch.Tensor, layer_idx: int, args: tuple, kwargs: dict) -> None:
        self._check_shapes(key_states, layer_idx)
        self._check_positions(key_states, layer_idx, args, kwargs)

    def activate_past_recording(self) -> None:
        """``generate`` calls this before assisted decoding (and, on CUDA, after a prefill): remember
        where, so that a refused first step can name the mode."""
        self._recording_at = self.get_seq_length()
        super().activate_past_recording()

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
            self._check_identity(model_identity(model_or_config))

    def _check_identity(self, identity: ModelIdentity) -> None:
        if identity != self.model_identity:
            raise ValueError(
                f"cache/model mismatch: this {type(self).__name__} was built with the model {self.model_identity}; "
                f"it is used with the model {identity}. K/V of one model are meaningless for another: build "
                "the cache with the model that uses it"
            )

    def bind_model(self, model: torch.nn.Module) -> None:
        """Record the model this cache is built with (a cache that knows one refuses another)."""
        if self.model_identity is None:
            self.check_model(model)
            self.model_identity = model_identity(model)
        else:
            self.check_model(model)

    def append_dense(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        segments: Iterable[Segment] = (),
        **model_kwargs: Any,
    ) -> torch.Tensor:
        """Run ``model`` over ``input_ids`` ``[batch, n]`` on top of this cache (positions continue).

        ``segments`` (positions relative to the whole cache) are appended to the table; they must
        tile the new positions. ``model_kwargs`` go to the model call (e.g. PEFT's ``adapter_names``).
        Returns the logits of the last token ``[batch, vocab]``.
        """
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        start = self.get_seq_length()
        n = input_ids.shape[-1]
        segments = list(segments)
        self._check_tiling(segments, start, start + n)
        self.bind_model(model)
        if n == 0:
            return None
        device = model_input_device(model)
        positions = torch.arange(start, start + n, device=device)[None].expand(input_ids.shape[0], -1)
        with torch.no_grad():
            out = model(
                input_ids=input_ids.to(device),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(self),
                **model_kwargs,
            )
        self.segments.extend(segments)
        return out.logits[:, -1]

    def append_kv(self, kv: SegmentKV, segment: Segment, shifter: RopeShifter | None = None) -> None:
        """Append an external segment's K/V, re-positioned to where it lands (the current end)."""
        start = self.get_seq_length()
        if segment.start != start or segment.length != kv.length:
            raise ValueError(
                f"segment {segment.name!r} says [{segment.start}, {segment.end}) but the cache ends at {start} "
                f"and the K/V has {kv.length} tokens"
            )
        if kv.num_layers != self.num_layers:
            raise ValueError(f"K/V has {kv.num_layers} layers, the cache {self.num_layers}")
        if kv.start != start:
            if shifter is None:
                raise ValueError(
                    f"K/V sits at position {kv.start}, not {start}: pass a RopeShifter to move it"
                )
            kv = kv.repositioned(shifter, start)
        for layer_idx in range(self.num_layers):
            self.update(kv.keys[layer_idx], kv.values[layer_idx], layer_idx)
        self.segments.append(segment)

    def append_parts(
        self,
        model: torch.nn.Module,
        parts: Iterable[CachePart],
        shifter: RopeShifter | None = None,
        **model_kwargs: Any,
    ) -> None:
        """Append ``parts`` (in positional order, tiling the positions after the cache's end): placed K/V
        as they are, and every dense part's tokens in **one** model forward.

        That forward feeds the dense tokens at their true ``position_ids`` with an explicit 4D mask built
        from positions alone: the query at position ``q`` sees the cache slot holding position ``k`` iff
        ``k <= q`` (and ``q - k < W`` on a sliding-window layer), so no token can see a later position,
        whatever order the parts were computed or placed in. The placed K/V are written into their slots
        first and the dense slots reserved; the model's cache updates write each layer's new K/V into the
        reserved slots (in place, before that layer attends), so the cache ends in positional order.

        Fallbacks, same K/V: only dense parts, or dense parts all before the placed ones, need no mask
        (one ordinary forward); a model that cannot take an explicit mask (flash / flex attention, a
        mixture of layer types its forward cannot take as a mapping; see
        ``_compat.explicit_attention_mask``) or an offloaded cache runs each run of consecutive dense
        parts as its own forward over the cache built so far (the per-segment path).

        ``model_kwargs`` go to every model call (e.g. PEFT's ``adapter_names``). On error nothing is
        appended.
        """
        parts = list(parts)
        if not parts:
            return
        start = self.get_seq_length()
        self._check_tiling([p.segment for p in parts], start, parts[-1].segment.end)
        for p in parts:
            if (p.kv is None) == (p.token_ids is None):
                raise ValueError(f"part {p.segment.name!r} needs exactly one of kv= or token_ids=")
            if p.token_ids is not None and p.token_ids.dim() != 2:
                raise ValueError(
                    f"part {p.segment.name!r}: token_ids must be [batch, n]; got shape {tuple(p.token_ids.shape)}"
                )
            have = p.kv.length if p.kv is not None else p.token_ids.shape[-1]
            if have != p.segment.length:
                raise ValueError(
                    f"part {p.segment.name!r} says [{p.segment.start}, {p.segment.end}) but holds {have} tokens"
                )
            if p.kv is not None and p.kv.start != p.segment.start and shifter is None:
                raise ValueError(
                    f"K/V of {p.segment.name!r} sits at position {p.kv.start}, not {p.segment.start}: "
                    "pass a RopeShifter to move it"
                )
        self.bind_model(model)
        dense = [p for p in parts if p.dense]
        first_placed = next((i for i, p in enumerate(parts) if not p.dense), len(parts))
        if len(dense) == first_placed:  # no dense token follows a placed one: no mask needed
            if dense:
                ids = torch.cat([p.token_ids for p in dense], dim=-1)
                self.append_dense(model, ids, [p.segment for p in dense], **model_kwargs)
            for p in parts[first_placed:]:
                self.append_kv(p.kv, p.segment, shifter)
            return
        if not self._one_dense_forward(model, parts, shifter, model_kwargs):
            self._per_segment(model, parts, shifter, model_kwargs)

    def _per_segment(self, model, parts: list[CachePart], shifter, model_kwargs) -> None:
        """Each run of consecutive dense parts as one forward over the cache built so far."""
        start = self.get_seq_length()
        try:
            i = 0
            while i < len(parts):
                if not parts[i].dense:
                    self.append_kv(parts[i].kv, parts[i].segment, shifter)
                    i += 1
                    continue
                j = i
                while j < len(parts) and parts[j].dense:
                    j += 1
                ids = torch.cat([p.token_ids for p in parts[i:j]], dim=-1)
                self.append_dense(model, ids, [p.segment for p in parts[i:j]], **model_kwargs)
                i = j
        except BaseException:
            self.crop_to(start)
            raise

    def _one_dense_forward(self, model, parts: list[CachePart], shifter, model_kwargs) -> bool:
        """The one-forward path of :meth:`append_parts`; ``False`` (nothing done) when it cannot run."""
        if self.offloading or any(type(layer) is not DynamicLayer for layer in self.layers):
            return False
        start = self.get_seq_length()
        end = parts[-1].segment.end
        device = model_input_device(model)
        batch = max(p.token_ids.shape[0] for p in parts if p.dense)
        placed = [p.kv if p.dense else p.kv.repositioned(shifter, p.segment.start) for p in parts]
        reference = next(kv for kv, p in zip(placed, parts) if not p.dense)
        if reference.num_layers != self.num_layers and self.signature[0] is not None:
            raise ValueError(f"K/V has {reference.num_layers} layers, the cache {self.num_layers}")
        dtype = reference.keys[0].dtype
        queries = torch.cat([torch.arange(p.segment.start, p.segment.end) for p in parts if p.dense]).to(
            device
        )
        keys = torch.arange(end, device=device)
        causal = keys[None, :] <= queries[:, None]  # [q, kv]: position k seen from position q
        allowed = {"full_attention": causal}
        window = _compat.sliding_window(model.config)
        if window is not None:
            allowed["sliding_attention"] = causal & (keys[None, :] > queries[:, None] - window)
        mask = _compat.explicit_attention_mask(
            model, {t: m[None, None].expand(batch, 1, -1, -1) for t, m in allowed.items()}, dtype
        )
        if mask is None:
            return False
        for layer_idx in range(reference.num_layers):  # placed K/V in their slots, dense slots reserved
            ks, vs = [], []
            for p, kv in zip(parts, placed):
                if p.dense:
                    for out, like in ((ks, reference.keys[layer_idx]), (vs, reference.values[layer_idx])):
                        shape = (batch, like.shape[1], p.segment.length, like.shape[3])
                        out.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
                else:
                    ks.append(kv.keys[layer_idx].expand(batch, -1, -1, -1))
                    vs.append(kv.values[layer_idx].expand(batch, -1, -1, -1))
            self.update(torch.cat(ks, dim=-2), torch.cat(vs, dim=-2), layer_idx)
        ids = torch.cat([p.token_ids.expand(batch, -1) for p in parts if p.dense], dim=-1).to(device)
        self._dense_slots = queries
        try:
            with torch.no_grad():
                model(
                    input_ids=ids,
                    position_ids=queries[None].expand(batch, -1),
                    attention_mask=mask,
                    use_cache=True,
                    logits_to_keep=1,
                    **cache_kwargs(self),
                    **model_kwargs,
                )
        except BaseException:
            self._dense_slots = None
            self.crop_to(start)
            raise
        self._dense_slots = None
        self.segments.extend(p.segment for p in parts)
        return True

    @staticmethod
    def _check_tiling(segments: list[Segment], start: int, end: int) -> None:
        pos = start
        for seg in segments:
            if seg.start != pos or seg.end < seg.start:
                raise ValueError(
                    f"segments must tile [{start}, {end}); {seg.name!r} starts at {seg.start}, not {pos}"
                )
            pos = seg.end
        if segments and pos != end:
            raise ValueError(f"segments cover [{start}, {pos}) but {end - start} tokens were given")

    # ------------------------------------------- what generate may call on us
    def crop(self, tokens_to_remove: int) -> None:
        keep = crop_target_length(self.get_seq_length(), tokens_to_remove)
        super().crop(crop_argument(self.get_seq_length(), keep))
        self._trim_table(keep)

    def crop_to(self, length: int) -> None:
        """Keep the first ``length`` positions (any transformers version)."""
        self.crop(crop_argument(self.get_seq_length(), length))

    def _trim_table(self, keep: int) -> None:
        kept = []
        for seg in self.segments:
            if seg.start >= keep:
                break
            kept.append(replace(seg, end=min(seg.end, keep)) if seg.end > keep else seg)
        self.segments = kept

    def reset(self) -> None:
        _compat.drop_layer_states(self.layers)
        super().reset()
        self.segments = []

    def copy(self) -> SegmentedCache:
        """An independent copy (tensors cloned) with the same segment table."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        DynamicCache.__init__(new, config=self.config, **self._offload_options())
        _keep_sliding_layers_whole(new)
        for layer_idx, layer in enumerate(self.layers):
            if layer_idx >= len(new.layers):  # no config: layers are created lazily
                new.layers.append(type(layer)())
            if layer.is_initialized and layer.keys is not None:
                new.layers[layer_idx].update(layer.keys.clone(), layer.values.clone())
        new.segments = [replace(s, info=dict(s.info)) for s in self.segments]
        return new

    def _offload_options(self) -> dict[str, bool]:
        if not self.offloading:
            return {}
        return {"offloading": True, "offload_only_non_sliding": self.only_non_sliding}

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

    def seal(self, prompt_length: int) -> None:
        """Mark the cache as built for a prompt of ``prompt_length`` tokens."""
        if self.get_seq_length() >= prompt_length:
            raise ValueError(
                f"the cache holds {self.get_seq_length()} tokens of a {prompt_length}-token prompt; generate needs "
                "at least the last prompt token left out (it would otherwise re-feed the whole prompt)"
            )
        self.prompt_length = prompt_length
        self._sealed_length = self.get_seq_length()
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


def _keep_sliding_layers_whole(cache: DynamicCache) -> None:
    """Replace the sliding-window layers ``DynamicCache(config=...)`` builds by plain ``DynamicLayer`` s.

    A sliding layer evicts all but its last ``W - 1`` keys, but a segment table must be able to hand
    out any segment's K/V (reuse sources, recomputation prefixes). So every layer keeps all its
    positions, and the model's own sliding-window mask (built from absolute positions, the cache
    reporting ``kv_offset = 0``) hides from each sliding layer exactly the keys plain generation would
    have evicted: attention sees what it sees in plain generation. The cost is memory: a sliding
    layer holds the whole sequence instead of ``W - 1`` positions.
    """
    for layer_idx, layer in enumerate(cache.layers):
        if not getattr(layer, "is_sliding", False):
            continue
        whole = DynamicLayer()
        if layer.is_initialized and layer.keys is not None:
            whole.update(layer.keys, layer.values)
        cache.layers[layer_idx] = whole


def register_export_support() -> None:
    """Register our caches as pytree nodes, as ``transformers.integrations.executorch.
    register_dynamic_cache_export_support()`` registers ``DynamicCache``, so that ``torch.export``
    (and other pytree users) accept them where they accept a ``DynamicCache``.

    Flattening gives the per-layer keys and values (the leaves, as for ``DynamicCache``); the segment
    table (without the ``info`` reports) and the sealing state travel in the tree spec, so a round
    trip gives back the same class with the same table. Call it once, after importing hf_kvshare (it
    registers :class:`SegmentedCache` and every subclass defined by then). Like transformers, it is
    not done on import: a registered cache is rebuilt by any pytree ``tree_map`` it passes through.

    Not registered: caches whose layers are not plain ``DynamicLayer`` (a lazily materialized
    ``BaseLRCache`` reads its prefix from a shared store that no tensor list carries; flattening one
    raises ``RuntimeError`` with that reason).

    >>> register_export_support()  # doctest: +SKIP
    >>> torch.export.export(model, (), {"input_ids": ids, "cache": cache, "use_cache": True}, strict=False)  # doctest: +SKIP
    """
    classes, todo = [], [SegmentedCache]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in classes:
        if not cls.__dict__.get("_PYTREE_NODE", True):
            continue
        _compat.register_pytree_node(
            cls,
            lambda cache: _pytree_flatten(cache, with_keys=False),
            partial(_pytree_unflatten, cls),
            lambda cache: _pytree_flatten(cache, with_keys=True),
            lambda cache, spec: [_pytree_dict(cache)[key] for key in spec.context[0]],
        )


def _pytree_dict(cache: SegmentedCache) -> dict[str, list[torch.Tensor]]:
    odd = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if odd:
        raise RuntimeError(
            f"{type(cache).__name__} holds {sorted(odd)} layers; only plain DynamicLayer K/V can be flattened "
            "(a lazily materialized BaseLRCache reads its prefix from a shared store: use materialize='turn')"
        )
    return {
        "key_cache": [layer.keys for layer in cache.layers if layer.keys is not None],
        "value_cache": [layer.values for layer in cache.layers if layer.values is not None],
    }


def _pytree_flatten(cache: SegmentedCache, with_keys: bool):
    values, keys = _compat.pytree_dict_flatten(_pytree_dict(cache), with_keys=with_keys)
    table = tuple((s.name, s.kind, s.start, s.end, s.provenance, s.source_agent) for s in cache.segments)
    state = tuple(getattr(cache, name) for name in cache._PYTREE_STATE)
    return values, [keys, len(cache.layers), table, state]


def _pytree_unflatten(cls: type[SegmentedCache], values: list, context: Any) -> SegmentedCache:
    keys, num_layers, table, state = context
    tensors = _compat.pytree_dict_unflatten(values, keys)
    pairs = list(zip_longest(tensors["key_cache"], tensors["value_cache"]))
    pairs += [(None, None)] * (num_layers - len(pairs))
    cache = cls(pairs)
    cache.segments = [Segment(*row) for row in table]
    for name, value in zip(cls._PYTREE_STATE, state):
        setattr(cache, name, value)
    return cache


def model_input_device(model: torch.nn.Module) -> torch.device:
    """Where a model's ``input_ids`` go: the device of its input embeddings (with an accelerate
    ``device_map`` the layers may sit on other devices, or on ``meta`` when offloaded to disk; per-layer
    tensors stay on their layer's device). Falls back to ``model.device`` / the first parameter."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    try:
        device = model.device
    except AttributeError:
        device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], float):
        return "[" + ", ".join(f"{v:.2f}" for v in value) + "]"
    return str(value)

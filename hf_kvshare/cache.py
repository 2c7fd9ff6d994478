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

from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from transformers import DynamicCache

from ._compat import cache_kwargs, crop_argument, crop_target_length
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

    def repositioned(self, shifter: RopeShifter, new_start: int) -> SegmentKV:
        """A copy whose keys sit at ``new_start .. new_start + length - 1`` (values need no rotation)."""
        if new_start == self.start:
            return self
        rotation = shifter.rotation(self.start, new_start, self.length)
        keys = [shifter.apply(k, rotation) for k in self.keys]
        return replace(self, keys=keys, start=new_start)

    def prefix(self, length: int) -> SegmentKV:
        return replace(
            self,
            keys=[k[..., :length, :] for k in self.keys],
            values=[v[..., :length, :] for v in self.values],
        )


def config_signature(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a model config: what a cache must match to be used with it."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return (text.num_hidden_layers, kv_heads, head_dim)


class SegmentedCache(DynamicCache):
    """A ``DynamicCache`` with a segment table.

    Args:
        config: the model config (builds the right layer types, fixes the expected shapes).

    >>> cache = SegmentedCache(model.config)  # doctest: +SKIP
    >>> cache.append_dense(model, ids_of_system_prompt, name="sys", kind="PF")  # doctest: +SKIP
    >>> cache.append_kv(other_agents_query_kv, name="query", kind="PH", provenance="reused",
    ...                 shifter=RopeShifter.from_model(model))  # doctest: +SKIP
    >>> cache.segments  # doctest: +SKIP
    """

    def __init__(self, config: Any):
        super().__init__(config=config)
        if any(self.is_sliding):
            raise ValueError(
                "sliding-window attention layers drop old keys, so segments cannot be kept or re-positioned; "
                "hf_kvshare supports full-attention models (Llama, Qwen2 without sliding window, ...)"
            )
        self.config = config
        self.signature = config_signature(config)
        self.segments: list[Segment] = []

    # ------------------------------------------------------------------ views
    @property
    def num_layers(self) -> int:
        return self.signature[0]

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
        if layer_idx >= layers:
            raise ValueError(
                f"this cache was built for a model with {layers} layers; got an update for layer {layer_idx}"
            )
        if key_states.dim() != 4 or key_states.shape[1] != kv_heads or key_states.shape[3] != head_dim:
            raise ValueError(
                f"this cache was built for a model with {kv_heads} kv heads of dim {head_dim} "
                f"([batch, {kv_heads}, seq, {head_dim}]); got key states of shape {tuple(key_states.shape)}"
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._check_shapes(key_states, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def check_model(self, model_or_config: Any) -> None:
        """Raise if this cache was built for a model of another shape (layers, kv heads, head dim)."""
        config = getattr(model_or_config, "config", model_or_config)
        other = config_signature(config)
        if other != self.signature:
            raise ValueError(
                "cache/model mismatch: the cache was built for (layers, kv_heads, head_dim) = "
                f"{self.signature}, the model has {other}"
            )

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
        if n == 0:
            return None
        device = _model_device(model)
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
        super().reset()
        self.segments = []

    def copy(self) -> SegmentedCache:
        """An independent copy (tensors cloned) with the same segment table."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        DynamicCache.__init__(new, config=self.config)
        for layer_idx, layer in enumerate(self.layers):
            if layer.is_initialized and layer.keys is not None:
                new.layers[layer_idx].update(layer.keys.clone(), layer.values.clone())
        new.segments = [replace(s, info=dict(s.info)) for s in self.segments]
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
        extra = self.get_seq_length() - self.segmented_length
        if extra > 0:
            rows.append(f"  (+{extra} positions appended by generate)")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return self.report()


class SharedCache(SegmentedCache):
    """The cache a method builds for one agent turn; pass it to ``generate`` unchanged.

    It holds the prompt minus (at least) its last token, so ``generate`` feeds the rest. After one
    ``generate`` it holds that turn's tokens: a second ``generate`` on the same object would
    re-feed the prompt at wrong positions, so it is refused — call :meth:`copy` first (or build a
    new one).

    >>> cache, prompt_ids = session.build_cache("critic", segments)  # doctest: +SKIP
    >>> out = model.generate(input_ids=prompt_ids, past_key_values=cache, max_new_tokens=32)  # doctest: +SKIP
    >>> print(cache.report())  # doctest: +SKIP
    """

    def __init__(self, config: Any):
        super().__init__(config)
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

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._sealed_length is not None and layer_idx == 0:
            if not self._generating:
                self._expand_for(key_states.shape[0])
            elif key_states.shape[-2] > 1:
                raise RuntimeError(
                    "this SharedCache was already used by a generate call (it now holds "
                    f"{self.get_seq_length()} tokens, built for {self._sealed_length}); pass `cache.copy()` "
                    "to each generate, or build a new cache"
                )
            self._generating = True
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

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


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return model.device
    except AttributeError:
        return next(model.parameters()).device


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], float):
        return "[" + ", ".join(f"{v:.2f}" for v in value) + "]"
    return str(value)

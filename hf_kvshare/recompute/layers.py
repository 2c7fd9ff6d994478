"""Run decoder layers one at a time over some tokens of a PH segment.

Selective recomputation needs what one ``model(...)`` call cannot give: push a *subset* of a
segment's tokens through *some* layers, their queries attending over the cache built so far plus
the segment's K/V (reused rows and freshly recomputed rows mixed), and pick the subset in the
middle of a layer from the fresh K/V. :class:`SegmentRecompute` does this with the model's own
decoder layers: each call passes a stand-in cache whose ``update`` splices the layer's fresh K/V
rows into the segment, and a float attention mask that is causal by absolute position. So the
arithmetic (projections, biases, RoPE and its scaling, GQA, attention kernel) stays the model's.

:class:`~hf_kvshare.recompute.stack.DecoderStack` is the one place that knows the model's structure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from .. import mrope
from .._compat import decoder_layer_cache_kwarg
from ..cache import SegmentedCache, SegmentKV
from ..hooks import thread_hook
from ..rope import RopeShifter
from .selection import kv_deviation, received_attention
from .stack import DecoderStack


class LayerProbe:
    """What a selection callback sees in the middle of a decoder layer, before attention.

    ``rows`` ``[q]`` are the segment rows (0-based token indices within the segment) run through
    this layer; ``fresh_keys`` / ``fresh_values`` ``[1, kv_heads, q, head_dim]`` their newly
    computed K/V; ``reused_keys`` / ``reused_values`` the segment's reused K/V at those rows.
    """

    def __init__(self, engine: SegmentRecompute, layer_idx: int, rows, fresh_k, fresh_v, prefix_k, query):
        self.engine = engine
        self.layer_idx = layer_idx
        self.rows = rows
        self.fresh_keys = fresh_k
        self.fresh_values = fresh_v
        reused_k, reused_v = engine.reused(layer_idx)
        self.reused_keys = reused_k[..., rows, :]
        self.reused_values = reused_v[..., rows, :]
        self._prefix_k = prefix_k
        self._query = query  # pre-RoPE queries, from the hook on DecoderStack.query_source

    def deviation(self) -> torch.Tensor:
        """KV deviation of each row ``[q]`` (see :func:`~hf_kvshare.recompute.selection.kv_deviation`)."""
        return kv_deviation(self.fresh_keys, self.fresh_values, self.reused_keys, self.reused_values)

    def attention(self) -> torch.Tensor:
        """Attention each row receives from the rows' own queries at this layer ``[q]``.

        Keys are the fresh ones for all rows run here; see
        :func:`~hf_kvshare.recompute.selection.received_attention`.
        """
        if self._query is None:
            raise RuntimeError("attention was not requested for this layer (run_layer(..., attention=True))")
        engine, stack = self.engine, self.engine.stack
        seg_k = engine.reused(self.layer_idx)[0].clone()
        seg_k[..., self.rows, :] = self.fresh_keys.to(seg_k.dtype)
        keys = seg_k if self._prefix_k is None else torch.cat([self._prefix_k, seg_k], dim=-2)
        # multimodal RoPE: at the segment's rope shift (exact for text; an image's rows take that 1D
        # position, an approximation for selection only, never for the recomputed K/V)
        q = stack.rotated_queries(self._query, engine.start + engine._shift + self.rows, self.layer_idx)
        return received_attention(
            q,
            keys,
            engine.mask(self.rows, self.layer_idx),
            stack.attention_scaling(self.layer_idx),
            prefix_length=engine.start,
        )[self.rows]


Choose = Callable[[LayerProbe], torch.Tensor]


class _SpliceCache:
    """Stands in for the cache during one decoder-layer call: ``update`` receives the layer's fresh
    K/V for the query rows, lets ``choose`` keep some of them, and returns prefix + segment K/V
    (kept rows fresh, the rest reused) for attention. Duck-types ``Cache.update``."""

    def __init__(self, engine: SegmentRecompute, layer_idx: int, rows, choose, query_box):
        self.engine = engine
        self.layer_idx = layer_idx
        self.rows = rows
        self.choose = choose
        self.query_box = query_box
        self.keep: torch.Tensor | None = None
        self.fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx != self.layer_idx:
            raise RuntimeError(f"expected an update for layer {self.layer_idx}, got layer {layer_idx}")
        engine = self.engine
        prefix_k, prefix_v = engine.prefix(layer_idx)
        keep = torch.arange(self.rows.numel(), device=self.rows.device)
        if self.choose is not None:
            probe = LayerProbe(
                engine, layer_idx, self.rows, key_states, value_states, prefix_k, self.query_box.get("q")
            )
            keep = _as_sorted_indices(self.choose(probe), self.rows.numel()).to(self.rows.device)
        kept_rows = self.rows[keep]
        reused_k, reused_v = engine.reused(layer_idx)
        seg_k, seg_v = reused_k.clone(), reused_v.clone()
        fresh_k = key_states[..., keep, :]
        fresh_v = value_states[..., keep, :]
        seg_k[..., kept_rows, :] = fresh_k.to(seg_k.dtype)
        seg_v[..., kept_rows, :] = fresh_v.to(seg_v.dtype)
        self.keep, self.fresh = keep, (fresh_k, fresh_v)
        if prefix_k is None:
            return seg_k, seg_v
        return torch.cat([prefix_k, seg_k], dim=-2), torch.cat([prefix_v, seg_v], dim=-2)


def _as_sorted_indices(keep: torch.Tensor, n: int) -> torch.Tensor:
    keep = torch.as_tensor(keep, dtype=torch.long).flatten()
    if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= n):
        raise ValueError(f"a selection must index the {n} rows run through the layer; got {keep.tolist()}")
    keep = torch.unique(keep)  # sorted, no duplicates
    return keep


class SegmentRecompute:
    """One PH segment being partially recomputed on top of the cache built so far.

    Args:
        stack: the model's :class:`DecoderStack`.
        cache: a cache holding at least positions ``[0, kv.start)`` (the agent's prefix); later
            positions are ignored.
        kv: the segment's reused K/V, at its target positions (``kv.start`` ..) or, with ``start``,
            where its source sat; never modified.
        token_ids: the segment's token ids ``[S]``.
        embeds: the segment's own input embeddings ``[1, S, hidden]`` where its ids do not give them
            (an image's features, ``Span.visual``), else ``None``.
        start: where the segment lands (default ``kv.start``); ``kv`` elsewhere is re-positioned
            there by ``shifter`` (default the stack's) one layer at a time, when a layer reads it,
            never as a whole copy (a multimodal-RoPE cache moves the whole segment first, as before).

    Run layers with :meth:`run_layer` (hidden states ``[1, q, hidden]`` of segment ``rows``), then
    :meth:`result` gives the segment K/V with the recomputed rows written in.

    >>> engine = SegmentRecompute(stack, cache, source, ids, start=start)  # doctest: +SKIP
    >>> h, rows = engine.embeddings(), engine.all_rows()  # doctest: +SKIP
    >>> for layer in range(stack.num_layers):  # doctest: +SKIP
    ...     h, rows = engine.run_layer(layer, h, rows)
    >>> kv, entries = engine.result()  # equals a dense prefill of the segment  # doctest: +SKIP
    """

    def __init__(
        self,
        stack: DecoderStack,
        cache: SegmentedCache,
        kv: SegmentKV,
        token_ids: torch.Tensor,
        embeds: torch.Tensor | None = None,
        start: int | None = None,
        shifter: RopeShifter | None = None,
    ):
        if kv.num_layers != stack.num_layers:
            raise ValueError(f"the segment K/V has {kv.num_layers} layers, the model {stack.num_layers}")
        if kv.keys[0].shape[0] != 1:
            raise ValueError(
                f"selective recomputation runs batch size 1; got K/V of batch {kv.keys[0].shape[0]}"
            )
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if token_ids.numel() != kv.length:
            raise ValueError(f"{token_ids.numel()} token ids for a segment K/V of {kv.length} tokens")
        start = kv.start if start is None else start
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be a position (an int >= 0); got {start!r}")
        if cache.get_seq_length() < start:
            raise ValueError(
                f"the segment starts at {start} but the cache holds only {cache.get_seq_length()} positions"
            )
        self.stack = stack
        self.cache = cache
        shifter = stack.shifter if shifter is None else shifter
        #: multimodal RoPE: the segment's rope positions where it lands, and its shift from its slots; the
        #: engine works on the cache's frame (the reused K/V moved there, the result moved back)
        self._rope, self._shift = mrope.segment_layout(cache, replace(kv, start=start)) or (None, 0)
        if self._shift:  # the whole segment moved first (its slots, then its rope shift), as before
            kv = kv.repositioned(shifter, start)
            kv = replace(kv, keys=mrope.shift_keys(stack.shifter, kv.keys, kv.start, self._shift))
        #: the reused K/V where they sit (keys rotated to ``start`` per layer when read: :meth:`reused`)
        self.source = kv
        self._rotation = None if kv.start == start else shifter.rotation(kv.start, start, kv.length)
        self._shifter = shifter
        self._reused: tuple[int, torch.Tensor] | None = None  # the last layer's re-positioned keys
        if embeds is not None and tuple(embeds.shape[:2]) != (1, token_ids.numel()):
            raise ValueError(
                f"embeds must be [1, {token_ids.numel()}, hidden] for the segment; got {tuple(embeds.shape)}"
            )
        self.token_ids = token_ids
        self.embeds = embeds
        self.start = start
        self.length = kv.length
        self.fresh: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ reused K/V
    def reused(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The segment's reused keys and values of ``layer_idx`` at ``start .. start + S - 1``: the
        source's keys rotated there for this layer only (the last layer's kept for the next read),
        never modified by the engine."""
        source = self.source
        if self._rotation is None:
            return source.keys[layer_idx], source.values[layer_idx]
        if self._reused is None or self._reused[0] != layer_idx:
            keys = self._shifter.apply(source.keys[layer_idx], self._rotation, layer=layer_idx)
            self._reused = (layer_idx, keys)
        return self._reused[1], source.values[layer_idx]

    @property
    def kv(self) -> SegmentKV:
        """The reused K/V at ``start`` (every layer re-positioned: a copy of the keys when the source
        sits elsewhere; the engine itself reads one layer at a time, :meth:`reused`)."""
        if self._rotation is None:
            return self.source
        return replace(
            self.source, keys=[self.reused(i)[0] for i in range(self.source.num_layers)], start=self.start
        )

    # ------------------------------------------------------------------ inputs
    def all_rows(self) -> torch.Tensor:
        return torch.arange(self.length, device=self.stack.device)

    def embeddings(self) -> torch.Tensor:
        """Layer-0 input of every segment token ``[1, S, hidden]``."""
        return self.stack.embed(self.token_ids, self.embeds)

    def prefix(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The cache's K/V ``[1, kv_heads, start, head_dim]`` at ``layer_idx`` (``None`` when empty)."""
        if self.start == 0:
            return None, None
        k, v = self.cache.layer_kv(layer_idx)
        return k[..., : self.start, :], v[..., : self.start, :]

    def mask(self, rows: torch.Tensor, layer_idx: int | None = None) -> torch.Tensor:
        """Additive float mask ``[1, 1, q, start + S]``: row ``i`` sees keys at positions ``<= start + rows[i]``
        (on a sliding-window layer, only the last ``W`` of them, as the model's own mask)."""
        dtype = self.source.keys[0].dtype
        key_pos = torch.arange(self.start + self.length, device=rows.device)
        query_pos = (self.start + rows)[:, None]
        allowed = key_pos[None, :] <= query_pos
        if layer_idx is not None and self.stack.is_sliding(layer_idx):
            allowed &= key_pos[None, :] > query_pos - self.stack.sliding_window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=rows.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    # ------------------------------------------------------------------ running
    def run_layer(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        choose: Choose | None = None,
        attention: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run decoder layer ``layer_idx`` for segment ``rows`` ``[q]`` with inputs ``hidden`` ``[1, q, hidden]``.

        Their queries attend over the prefix and the segment (rows run here: fresh K/V; other
        rows: reused K/V), causally by position. ``choose(probe)`` may keep a subset of the rows
        (indices into ``rows``) from their fresh K/V before attention; the other rows see their
        reused K/V restored and are dropped from the output. ``attention=True`` makes
        ``probe.attention()`` available. Returns the layer outputs ``[1, q', hidden]`` of the kept
        rows and the kept rows ``[q']``; their fresh K/V are remembered for :meth:`result`.
        """
        self.stack.check_layer(layer_idx)
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.stack.device).flatten()
        if hidden.dim() != 3 or hidden.shape[:2] != (1, rows.numel()):
            raise ValueError(
                f"expected hidden states [1, {rows.numel()}, hidden] for {rows.numel()} rows; got {tuple(hidden.shape)}"
            )
        if rows.numel() == 0:
            return hidden, rows
        positions = (self.start + rows)[None]
        rope = positions if self._rope is None else self._rope.to(rows.device)[:, rows][:, None]
        position_embeddings = self.stack.rope(hidden, rope, layer_idx)
        query_box: dict[str, torch.Tensor] = {}
        splice = _SpliceCache(self, layer_idx, rows, choose, query_box)
        layer = self.stack.layers[layer_idx]
        handle = None
        if attention:
            handle = self.stack.query_source(layer_idx).register_forward_hook(
                thread_hook(lambda module, args, output: query_box.__setitem__("q", output))
            )
        try:
            with torch.no_grad():
                out = layer(
                    hidden,
                    attention_mask=self.mask(rows, layer_idx),
                    position_ids=positions,
                    position_embeddings=position_embeddings,
                    use_cache=True,
                    **{decoder_layer_cache_kwarg(layer): splice},
                )
        finally:
            if handle is not None:
                handle.remove()
        keep = splice.keep
        kept_rows = rows[keep]
        self.fresh[layer_idx] = (kept_rows, *splice.fresh)
        return out[:, keep], kept_rows

    # ------------------------------------------------------------------ result
    def result(self, rows: torch.Tensor | None = None) -> tuple[SegmentKV, int]:
        """The segment K/V at ``start`` with recomputed rows written in, and the number of (token, layer)
        entries written.

        ``rows``: write only these rows' fresh K/V (e.g. the final selection of a method that
        narrowed its candidates over layers); default: every row run through each layer.

        Each layer of the result is assembled when it is read (:class:`LayerSequence`: the reused
        layer, re-positioned, with its fresh rows written in), so a caller that copies the layers into
        a cache one by one (:meth:`~hf_kvshare.cache.SegmentedCache.append_kv`) holds one layer's
        copy at a time, not a whole segment's; the same values on every read.
        """
        writes: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        entries = 0
        for layer_idx, (layer_rows, k, v) in sorted(self.fresh.items()):
            select = torch.ones_like(layer_rows, dtype=torch.bool)
            if rows is not None:
                select = torch.isin(layer_rows, torch.as_tensor(rows, device=layer_rows.device))
            if not bool(select.any()):
                continue
            target = layer_rows[select]
            writes[layer_idx] = (target, k[..., select, :], v[..., select, :])
            entries += int(target.numel())
        if (
            self._shift
        ):  # multimodal RoPE: written out whole, back to the slot frame every SegmentKV is kept in
            keys = [self._written(i, writes, 0) for i in range(self.stack.num_layers)]
            values = [self._written(i, writes, 1) for i in range(self.stack.num_layers)]
            keys = mrope.shift_keys(self.stack.shifter, keys, self.start + self._shift, -self._shift)
            return replace(self.source, keys=keys, values=values), entries
        n = self.stack.num_layers
        keys = LayerSequence(n, lambda i: self._written(i, writes, 0))
        values = LayerSequence(n, lambda i: self._written(i, writes, 1))
        return replace(self.source, keys=keys, values=values, start=self.start), entries

    def _written(self, layer_idx: int, writes: dict, side: int) -> torch.Tensor:
        """Layer ``layer_idx``'s reused keys (``side`` 0) or values (1) at ``start`` with its fresh rows
        in ``writes`` written in (a copy where any are; else the reused tensor itself)."""
        reused = self.reused(layer_idx)[side]
        if layer_idx not in writes:
            return reused
        target, fresh = writes[layer_idx][0], writes[layer_idx][1 + side]
        out = reused.clone()
        out[..., target, :] = fresh.to(out.dtype)
        return out


class LayerSequence(Sequence):
    """A read-only list of per-layer tensors, each computed by ``layer(i)`` when read (the last one read
    kept, so that a reader asking twice for the same layer computes it once): a
    :class:`~hf_kvshare.cache.SegmentKV` whose layers are assembled one at a time."""

    def __init__(self, length: int, layer: Callable[[int], torch.Tensor]):
        self._length, self._layer = length, layer
        self._last: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        i = index + self._length if index < 0 else index
        if not 0 <= i < self._length:
            raise IndexError(f"layer {index} of {self._length}")
        if self._last is None or self._last[0] != i:
            self._last = (i, self._layer(i))
        return self._last[1]

    def __repr__(self) -> str:
        return f"LayerSequence({self._length} layers, assembled when read)"

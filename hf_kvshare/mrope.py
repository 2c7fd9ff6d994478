"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): three position components ``(t, h, w)`` per token.

A text token at rope position ``r`` has all three components ``r``; an image's tokens take the
model's grid positions offset by the rope position where the image starts, and the text after it
continues from the model's own rule (Qwen2-VL: ``start + max(h, w) / merge``, not ``start + n``).
Both come from the model's ``get_rope_index`` (:func:`visual_rope`: run once per image on its own
tokens followed by one text token), never a re-implementation.

The cache keeps slots in sequence order (slot ``k`` is the ``k``-th token; masks and the segment table
use slots), so a token's rope position differs from its slot by a **shift** that is constant over a
segment: ``0`` until the first image, then ``shift + advance - n`` after each image. A
:class:`RopeTrack` (``SegmentedCache.rope_track``, kept by :mod:`hf_kvshare.prefill`) records the
cache's pieces ``(start, end, shift, VisualRope | None)``; it gives every forward its position ids
``[4, batch, n]`` (row 0 the slots: the model's mask and the cache's position guard; rows 1-3 the
three rope components) and converts keys between the cache's frame (rope positions, where the model
attends) and the **slot frame** every :class:`~hf_kvshare.cache.SegmentKV` is kept in (as a 1D-RoPE
model's keys at their slots): :meth:`SegmentedCache.extract` rotates by ``-shift``, placing by
``+shift``. Moving a segment therefore stays a 1D :class:`~hf_kvshare.rope.RopeShifter` rotation: a
uniform shift ``d`` of all three components rotates each frequency pair by ``d * inv_freq``
whichever component the pair reads (``mrope_section``), i.e. exactly a 1D shift by ``d``
(``tests/test_vision_mrope.py`` checks it against the model's own rotary module). Every method,
correction and reference prefill then works on these keys as on a 1D model's.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import _compat
from .rope import RopeShifter


@dataclass(frozen=True, eq=False)
class VisualRope:
    """One image's / video's rope positions by the model's rule: ``positions`` ``[3, n]`` (long, the
    image starting at rope position 0) and ``advance``, the rope position of the text token after it."""

    positions: torch.Tensor
    advance: int

    @property
    def length(self) -> int:
        return self.positions.shape[-1]


_IS_MROPE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_mrope(model: torch.nn.Module) -> bool:
    """Whether ``model`` rotates by three position components per token (``mrope_section``); found
    once per model (every prefill asks)."""
    try:
        return _IS_MROPE[model]
    except (KeyError, TypeError):
        pass
    found = _compat.mrope_section(model) is not None
    try:
        _IS_MROPE[model] = found
    except TypeError:
        pass
    return found


def visual_layout(
    model: torch.nn.Module,
    kind: str,
    token_ids: torch.Tensor,
    grid_thw: torch.Tensor,
    inputs: Mapping[str, Any],
) -> VisualRope | None:
    """An image's / video's rope layout on a multimodal-RoPE model (``None`` on any other) from its
    placeholders, its grid and the processor's output ``inputs`` (Qwen2.5-VL: a video's
    ``second_per_grid_ts``): :func:`visual_rope`."""
    if not is_mrope(model):
        return None
    extra = {}
    if kind == "video" and inputs.get("second_per_grid_ts") is not None:  # Qwen2.5-VL
        extra["second_per_grid_ts"] = torch.as_tensor(inputs["second_per_grid_ts"]).reshape(-1)[:1]
    return visual_rope(model, kind, token_ids, grid_thw, **extra)


def visual_rope(
    model: torch.nn.Module, kind: str, token_ids: torch.Tensor, grid_thw: torch.Tensor, **extra: Any
) -> VisualRope:
    """The rope positions of one image / video (its placeholder ``token_ids`` ``[n]``, its grid
    ``[1, 3]``) from the model's own ``get_rope_index`` over the placeholders and one text token
    after them (index arithmetic, no model forward)."""
    positions = _compat.mrope_index(model, kind, token_ids, grid_thw, **extra)  # [3, n + 1]
    after = positions[:, -1]
    if not bool((after == after[0]).all()):
        raise ValueError(f"the model's rope index gives the text after the {kind} positions {after.tolist()}")
    return VisualRope(positions[:, :-1].clone(), int(after[0]))


class RopeTrack:
    """A cache's rope layout: pieces ``(start, end, shift, VisualRope | None)`` in slot order; slots past
    the last piece (what ``generate`` appended) are text at :attr:`next_shift`."""

    def __init__(self, shifter: RopeShifter):
        self.shifter = shifter
        self.pieces: list[tuple[int, int, int, VisualRope | None]] = []
        self.next_shift = 0

    @property
    def end(self) -> int:
        return self.pieces[-1][1] if self.pieces else 0

    def copy(self) -> RopeTrack:
        new = RopeTrack(self.shifter)
        new.pieces = list(self.pieces)
        new.next_shift = self.next_shift
        return new

    # ------------------------------------------------------------------ layout
    def _add_text(self, start: int, end: int) -> None:
        if end <= start:
            return
        if self.pieces:
            s, e, shift, rope = self.pieces[-1]
            if rope is None and e == start and shift == self.next_shift:
                self.pieces[-1] = (s, end, shift, None)
                return
        self.pieces.append((start, end, self.next_shift, None))

    def extend(self, start: int, items: Sequence[tuple[int, VisualRope | None]]) -> torch.Tensor:
        """Lay out ``items`` ``(length, VisualRope or None for text)`` from slot ``start`` (the cache's
        end) and return their rope positions ``[3, total]``."""
        if start < self.end:
            raise ValueError(f"rope layout ends at slot {self.end}; cannot lay out from {start}")
        self._add_text(self.end, start)  # positions generate appended: text
        columns, at = [], start
        for n, rope in items:
            if rope is None:
                columns.append((torch.arange(at, at + n) + self.next_shift)[None].expand(3, -1))
                self._add_text(at, at + n)
            else:
                if rope.length != n:
                    raise ValueError(f"an image of {rope.length} rope positions laid out over {n} slots")
                shift = self.next_shift
                columns.append(rope.positions + (at + shift))
                self.pieces.append((at, at + n, shift, rope))
                self.next_shift = shift + rope.advance - n
            at += n
        if not columns:
            return torch.zeros(3, 0, dtype=torch.long)
        return torch.cat(columns, dim=1)

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Rope positions ``[3, end - start]`` of slots ``[start, end)``."""
        columns = []
        for s, e, shift, rope in self.pieces:
            a, b = max(s, start), min(e, end)
            if a >= b:
                continue
            if rope is None:
                columns.append((torch.arange(a, b) + shift)[None].expand(3, -1))
            else:
                columns.append(rope.positions[:, a - s : b - s] + (s + shift))
        a = max(self.end, start)
        if a < end:
            columns.append((torch.arange(a, end) + self.next_shift)[None].expand(3, -1))
        return torch.cat(columns, dim=1) if columns else torch.zeros(3, 0, dtype=torch.long)

    def runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(a, b, shift)`` runs covering slots ``[start, end)``."""
        out = []
        for s, e, shift, _ in self.pieces:
            a, b = max(s, start), min(e, end)
            if a < b:
                out.append((a, b, shift))
        a = max(self.end, start)
        if a < end:
            out.append((a, end, self.next_shift))
        return out

    def visual(self, start: int, end: int) -> VisualRope | None:
        """The image laid out at exactly ``[start, end)``, if one is."""
        for s, e, _, rope in self.pieces:
            if s == start and e == end:
                return rope
        return None

    def crop(self, length: int) -> None:
        kept = []
        for s, e, shift, rope in self.pieces:
            if s >= length:
                break
            if e > length:  # a cut image is no longer an image's layout: its slots keep their shift
                kept.append((s, length, shift, None))
                break
            kept.append((s, e, shift, rope))
        self.pieces = kept
        if not kept:
            self.next_shift = 0
        else:
            s, e, shift, rope = kept[-1]
            self.next_shift = shift if rope is None else shift + rope.advance - (e - s)

    # ------------------------------------------------------------------ keys
    def place(self, kv: Any, start: int, shifter: RopeShifter | None, rope: VisualRope | None = None) -> list:
        """Lay ``kv`` (a ``SegmentKV`` in the slot frame) out from slot ``start`` (the cache's end; ``rope``:
        its image layout, else ``kv.rope``) and return its per-layer keys at their rope positions."""
        self.extend(start, [(kv.length, rope if rope is not None else kv.rope)])
        return self.rotate(list(kv.keys_at(shifter, start)), start, +1)

    def slot_frame(
        self, keys: list[torch.Tensor], start: int
    ) -> tuple[list[torch.Tensor], VisualRope | None]:
        """Per-layer ``keys`` of slots ``start ..`` read from the cache, moved to the slot frame, and the
        image laid out at exactly those slots (``None`` for text)."""
        end = start + keys[0].shape[-2]
        return self.rotate(keys, start, -1), self.visual(start, end)

    def rotate(self, keys: list[torch.Tensor], start: int, sign: int) -> list[torch.Tensor]:
        """``keys`` (per layer, slots ``start ..``) moved by ``sign * shift`` per run: ``-1`` from the
        cache's (rope) frame to the slot frame, ``+1`` back. Runs with shift 0 are left as they are."""
        n = keys[0].shape[-2]
        runs = [(a, b, shift) for a, b, shift in self.runs(start, start + n)]
        if all(shift == 0 for *_, shift in runs):
            return keys
        rotations = []
        for a, b, shift in runs:
            frm, to = (a + shift, a) if sign < 0 else (a, a + shift)
            rotations.append((a - start, b - start, self.shifter.rotation(frm, to, b - a)))
        out = []
        for layer, k in enumerate(keys):
            pieces = [
                k[..., i:j, :] if rot is None else self.shifter.apply(k[..., i:j, :], rot, layer=layer)
                for i, j, rot in rotations
            ]
            out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2))
        return out


def track(cache: Any, model: torch.nn.Module) -> RopeTrack | None:
    """``cache``'s rope track for ``model`` (created on the first forward; ``None``: 1D RoPE). A cache
    that already holds tokens without a track holds text (every image forward makes one)."""
    if not is_mrope(model):
        return None
    if cache.rope_track is None:
        cache.rope_track = RopeTrack(RopeShifter.from_model(model))
        cache.rope_track._add_text(0, cache.get_seq_length())
    return cache.rope_track


def position_ids(slots: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``[4, batch, n]`` position ids: row 0 the slots ``[batch, n]`` (mask, cache guard), rows 1-3 the
    rope components ``[3, n]``."""
    rope = rope.to(slots.device)[:, None].expand(-1, slots.shape[0], -1)
    return torch.cat([slots[None], rope], dim=0)


def forward_positions(cache: Any, slots: torch.Tensor) -> torch.Tensor:
    """Position ids for a forward over slots ``slots`` ``[batch, n]`` of text on ``cache`` (the slots
    themselves for a 1D model): generate's prompt, teacher forcing."""
    track = getattr(cache, "rope_track", None)
    if track is None:
        return slots
    first, n = int(slots[0, 0]), slots.shape[-1]
    return position_ids(slots, track.positions(first, first + n))


def generate_kwargs(cache: Any, prompt_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What ``generate`` needs besides the prompt ``[batch, P]`` and ``cache`` on a multimodal-RoPE
    model: ``{"position_ids": [4, batch, P]}`` (the prompt's slots and rope positions; ``generate``
    steps them for each new token). ``{}`` on a 1D model. ``Session`` passes it itself; a caller of
    ``generate`` over :meth:`Session.build_cache`'s cache adds ``**generate_kwargs(cache, ids)``."""
    if getattr(cache, "rope_track", None) is None:
        return {}
    batch, P = prompt_ids.shape
    slots = torch.arange(P, device=prompt_ids.device)[None].expand(batch, -1)
    return {"position_ids": forward_positions(cache, slots)}


def part_ropes(parts: Sequence[Any]) -> list[tuple[int, VisualRope]] | None:
    """``(offset, VisualRope)`` of the image parts among consecutive cache ``parts`` (what
    :func:`lay_out_ids` takes, through ``prefill_dense``'s ``rope``); ``None`` when none is one."""
    out, at = [], 0
    for p in parts:
        if p.rope is not None:
            out.append((at, p.rope))
        at += p.segment.length
    return out or None


def lay_out_ids(
    model: torch.nn.Module,
    track: RopeTrack,
    start: int,
    input_ids: torch.Tensor,
    rope: Sequence[tuple[int, VisualRope]] | None,
) -> torch.Tensor:
    """Lay out a forward's ``input_ids`` ``[batch, n]`` (text, and the images ``rope`` names by offset)
    on the cache's ``track`` from slot ``start``; their rope positions ``[3, n]``. Every placeholder
    must be an image's (:func:`check_placeholders`)."""
    n = input_ids.shape[-1]
    covered = torch.zeros(n, dtype=torch.bool)
    items, at = [], 0
    for offset, visual in sorted(rope or [], key=lambda r: r[0]):
        if offset < at or offset + visual.length > n:
            raise ValueError(f"an image laid out at [{offset}, {offset + visual.length}) of {n} input ids")
        items += [(offset - at, None), (visual.length, visual)]
        covered[offset : offset + visual.length] = True
        at = offset + visual.length
    items.append((n - at, None))
    check_placeholders(model, input_ids, covered)
    return track.extend(start, [(k, v) for k, v in items if k or v is not None])


def lay_out_parts(
    model: torch.nn.Module,
    track: RopeTrack,
    start: int,
    parts: list[Any],
    slots: torch.Tensor,
    shifter: RopeShifter | None,
) -> tuple[list[Any], torch.Tensor]:
    """The one forward over cache ``parts`` on a multimodal-RoPE cache: the parts laid out on ``track``
    from ``start``, the placed parts' K/V re-positioned to their slots (slot frame, by ``shifter``) then
    rotated to their rope positions, and the dense tokens' ``[4, batch, q]`` position ids (``slots``
    ``[batch, q]`` their slots). On error the track is as it was."""
    parts = [p if p.dense else replace(p, kv=p.kv.repositioned(shifter, p.segment.start)) for p in parts]
    rope = track.extend(start, [(p.segment.length, p.rope) for p in parts])
    try:
        dense = torch.cat([torch.arange(p.segment.start, p.segment.end) for p in parts if p.dense]) - start
        ids = torch.cat([p.token_ids[:1] for p in parts if p.dense], dim=-1)
        covered = torch.cat([torch.full((p.segment.length,), p.rope is not None) for p in parts if p.dense])
        check_placeholders(model, ids, covered)
        moved = [
            p if p.dense else replace(p, kv=replace(p.kv, keys=track.rotate(p.kv.keys, p.segment.start, +1)))
            for p in parts
        ]
    except BaseException:
        track.crop(start)
        raise
    return moved, position_ids(slots, rope[:, dense])


def check_placeholders(model: torch.nn.Module, ids: torch.Tensor, covered: torch.Tensor) -> None:
    """On a multimodal-RoPE model every image / video placeholder in a forward's ``ids`` ``[batch, n]``
    must be laid out as an image (``covered`` ``[n]`` bool): its rope positions are not text's."""
    marks = _compat.visual_token_ids(model)
    if not marks:
        return
    found = torch.isin(ids[0].cpu(), torch.tensor(marks)) & ~covered
    if bool(found.any()):
        raise ValueError(
            f"{int(found.sum())} image / video placeholder token(s) fed to a multimodal-RoPE model without "
            "their image's layout (rope=): their positions would be text's"
        )


def segment_layout(cache: Any, kv: Any) -> tuple[torch.Tensor, int] | None:
    """For recomputing ``kv`` (slot frame, at slots ``kv.start ..``) on top of ``cache``: the segment's
    rope positions ``[3, n]`` where it lands (after what the cache holds) and its shift; ``None`` on a
    1D model."""
    track = getattr(cache, "rope_track", None)
    if track is None:
        return None
    start, n = kv.start, kv.length
    runs = track.runs(start, start + 1)
    shift = runs[0][2]
    if kv.rope is None:
        return (torch.arange(start, start + n) + shift)[None].expand(3, -1), shift
    return kv.rope.positions + (start + shift), shift


def shift_keys(shifter: RopeShifter, keys: list[torch.Tensor], start: int, shift: int) -> list[torch.Tensor]:
    """Per-layer ``keys`` of slots ``start ..`` moved by a uniform rope ``shift`` (``start + shift`` is a
    rope position, never negative): a 1D rotation."""
    if shift == 0:
        return keys
    rotation = shifter.rotation(start, start + shift, keys[0].shape[-2])
    return [shifter.apply(k, rotation, layer=i) for i, k in enumerate(keys)]

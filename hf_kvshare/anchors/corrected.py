"""A corrected segment, computed where it is written: ``Align(source) + delta`` (what
:func:`~hf_kvshare.anchors.correction.corrected_kv` returns).

It is a :class:`~hf_kvshare.cache.DeferredKV`: a cache laying it out writes each layer straight into
its slots (:meth:`CorrectedKV.write_layer`), so the corrected segment is never held whole beside the
cache being built; reading ``keys`` / ``values`` computes them once, the same values bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..rope import RopeShifter
from ..segment_kv import DeferredKV, SegmentKV


@dataclass(frozen=True)
class LowRankDelta:
    """A corrected segment's delta as weighted low-rank factors, so that it can be computed elsewhere
    (a serving worker, on its device, from the source rows it keeps): ``factors(layer)`` returns
    ``((a_k, b_k), (a_v, b_v))`` with the layer's key and value corrections of the first ``rows`` tokens
    ``a @ b`` (``[rows, D]`` float32, as :class:`CorrectedKV` computes them), keys in the canonical frame
    (rotated from positions ``0 ..`` to the target) or, with ``frame="writer"``, added as they are; with
    ``skip_layer0`` layer 0 keeps the re-positioned source."""

    rows: int
    frame: str
    skip_layer0: bool
    factors: Callable[[int], Any]


class CorrectedKV(DeferredKV):
    """``source`` re-positioned to ``start`` plus an additive correction of its first ``rows`` tokens,
    computed layer by layer where it is written: a corrected segment (``Align(source) + delta``).

    ``delta(layer)`` returns that layer's key and value corrections ``[1, kv_heads, rows, head_dim]``
    at the target positions (any float dtype; added in the K/V's own), or ``None`` where the layer
    keeps the re-positioned source. :func:`~hf_kvshare.cache.check_finite` checks the source before the
    correction is computed; the corrected rows are checked where they are written or computed (a
    non-finite correction raises ``ValueError`` there, and the cache is left as it was).

    A ``dataclasses.replace`` of it (which reads ``keys``) gives plain K/V of this class."""

    def __init__(
        self,
        keys: list[torch.Tensor] | None = None,
        values: list[torch.Tensor] | None = None,
        start: int = 0,
        agent: str | None = None,
        rope: Any = None,
        *,
        source: SegmentKV | None = None,
        rows: int = 0,
        delta: Any = None,
        shifter: RopeShifter | None = None,
    ):
        self.start, self.agent, self.rope, self.finite = start, agent, rope, False
        self.source, self.rows, self.delta, self.shifter = source, rows, delta, shifter
        self.rotation = None
        #: the delta as low-rank factors (:class:`LowRankDelta`) when its maker exposes them, else ``None``
        self.low_rank: LowRankDelta | None = None
        if source is None:  # dataclasses.replace: plain K/V
            if keys is None or values is None:
                raise ValueError("CorrectedKV needs a source to correct, or keys and values")
            self.keys, self.values = keys, values
            return
        if keys is not None or values is not None:
            raise ValueError("CorrectedKV takes a source to correct or keys and values, not both")
        if not 0 <= rows <= source.length:
            raise ValueError(f"cannot correct {rows} rows of a {source.length}-token source")
        if source.start != start and shifter is None:
            raise ValueError(
                f"K/V sits at position {source.start}, not {start}: pass a RopeShifter to move it"
            )
        if agent is None:
            self.agent = source.agent
        if source.start != start:
            self.rotation = shifter.rotation(source.start, start, source.length)

    def __repr__(self) -> str:  # without computing it
        state = "computed" if self.materialized else f"from the source at {self.source.start}, not computed"
        return f"CorrectedKV(start={self.start}, length={self.length}, rows={self.rows}, {state})"

    @property
    def stored(self) -> SegmentKV:
        """What this K/V is read from while it is not materialized: the source (shapes, dtypes,
        devices; the corrected K/V has the source's); itself once it is."""
        return self if self.materialized else self.source

    @property
    def checked_rows(self) -> int:
        return self.rows

    def describe(self) -> str:
        return f"a correction of {self.rows} rows at position {self.start}"

    def write_layer(self, layer: int, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Write layer ``layer``'s corrected keys and values into ``keys_out`` / ``values_out``
        (``[batch, kv_heads, length, head_dim]``, batch >= 1: batch row 0 of the source, broadcast):
        the source's keys re-positioned straight into ``keys_out``, its values copied, then the
        correction added to the first :attr:`rows` tokens. Only while not :attr:`materialized`."""
        k_src, v_src = self.source.keys[layer][:1], self.source.values[layer][:1]
        if self.rotation is None:
            keys_out.copy_(k_src.expand_as(keys_out))
        else:
            self.shifter.apply_into(k_src.expand_as(keys_out), self.rotation, keys_out, layer=layer)
        change = self.delta(layer) if self.rows else None
        if change is None:
            values_out.copy_(v_src.expand_as(values_out))
            return
        delta_k, delta_v = change
        rows = self.rows
        keys_out[..., :rows, :] += delta_k.to(keys_out.dtype)
        head = values_out[..., :rows, :]
        torch.add(v_src[..., :rows, :].expand_as(head), delta_v.to(values_out.dtype), out=head)
        values_out[..., rows:, :] = v_src[..., rows:, :]

    def release(self) -> None:
        self.source = self.delta = self.rotation = self.low_rank = (
            None  # what computed them is not held any longer
        )

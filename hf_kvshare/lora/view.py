"""An agent's K/V rebuilt from the shared base and its LR cache.

For batch row ``i`` with agent ``a_i`` (``None`` for an adapter-free row) and positions ``p < length``::

    K[i, :, p] = K_base[p]                                    V[i, :, p] = V_base[p] + s_a B_a (A_a x_p)

(value-only LR caches, as the PReCache / LRAgent reference code). With ``LoraBank(lr_keys=True)``
(beyond the reference) adapters may have a LoRA on ``k_proj`` too, and
``K[i, :, p] = K_base[p] + rope_p(s_a B_a (A_a x_p))``: keys are cached after RoPE and RoPE at a
fixed position is linear, so the LR part is rotated at its own absolute position with the model's
rotary module (the same ``cos``/``sin`` attention uses, ``attention_scaling`` included) and added
to the stored rotated base key.

The LR cache a row reads is its agent's own, or with ``shared_lr`` one cache every agent reads
(LRAgent's BaseLRShared: the adapters share ``lora_A``; each row applies its own ``s_a B_a``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..rope import RopeShifter, find_rotary_module, rotate_half
from .adapters import LoraBank
from .capture import KVCapture
from .store import LowRankStore


class AbsoluteRope:
    """The model's rotary ``cos``/``sin`` at absolute positions, applied as Llama/Qwen2 attention does.

    Refuses rope types whose keys depend on the sequence length (dynamic NTK), like
    :class:`~hf_kvshare.rope.RopeShifter`.
    """

    def __init__(self, model: nn.Module):
        shifter = RopeShifter.from_model(model)  # validates the rope type with a clear error
        if (
            shifter.interleaved
            or shifter.rotary_dim != shifter.head_dim
            or shifter.layer_shifters is not None
        ):
            raise ValueError(
                "LoRA cache reconstruction applies Llama's RoPE (every head dimension, halves, the same on every "
                f"layer); {type(model).__name__} rotates "
                + (
                    "interleaved pairs"
                    if shifter.interleaved
                    else f"{shifter.rotary_dim} of {shifter.head_dim} dims"
                )
                + ("" if shifter.layer_shifters is None else " and differs per layer")
            )
        self.rotary = find_rotary_module(model)

    def cos_sin(
        self, start: int, end: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[1, 1, end - start, head_dim]`` for positions ``start .. end - 1``."""
        positions = torch.arange(start, end, device=device)[None]
        probe = torch.zeros(1, dtype=dtype, device=device)
        with torch.no_grad():
            cos, sin = self.rotary(probe, positions)
        return cos[:, None], sin[:, None]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[batch, kv_heads, seq, head_dim]`` (the formula of ``apply_rotary_pos_emb``)."""
        return (x * cos) + (rotate_half(x) * sin)


def split_heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[batch, seq, kv_heads * head_dim]`` -> ``[batch, kv_heads, seq, head_dim]`` (as attention reshapes a
    projection output; :func:`hf_kvshare.anchors.lowrank.to_heads` inverts ``to_matrix`` instead)."""
    return t.view(*t.shape[:2], -1, head_dim).transpose(1, 2)


class LowRankView:
    """What a :class:`~hf_kvshare.lora.cache.BaseLRCache` presents over positions ``[0, length)``.

    Args:
        store: the request's :class:`LowRankStore`.
        bank: the model's :class:`LoraBank` (up-projections ``s_a B_a``).
        rope: :class:`AbsoluteRope` of the model.
        rows: one agent per batch row; ``None`` is an adapter-free row (the base alone).
        length: positions read from the store; every row's agent must have LR coverage there.
        rewrite_end: positions ``[length, rewrite_end)`` are re-processed by the turn's model call
            (the agent has no LR cache there yet): their keys/values are replaced by the stored
            base plus the LR part of the hidden states captured in that same forward.
        capture: the turn's :class:`KVCapture` (needed when ``rewrite_end > length``).
        shared_lr: read every row's LR cache from this store entry instead of the row agent's own
            (one LR cache shared by all agents; each row applies its own up-projection).
    """

    def __init__(
        self,
        store: LowRankStore,
        bank: LoraBank,
        rope: AbsoluteRope,
        rows: Sequence[str | None],
        length: int,
        rewrite_end: int | None = None,
        capture: KVCapture | None = None,
        shared_lr: str | None = None,
    ):
        self.store, self.bank, self.rope = store, bank, rope
        self.shared_lr = shared_lr
        self.rows = list(rows)
        self.length = length
        self.rewrite_end = length if rewrite_end is None else rewrite_end
        self.capture = capture
        if not 0 <= length <= self.rewrite_end <= store.length:
            raise ValueError(
                f"view [0, {length}) + rewrite [{length}, {self.rewrite_end}) must lie in the stored [0, {store.length})"
            )
        for agent in self.rows:
            if agent is None or bank.lr_width(agent) == 0:
                continue
            owner = self.lr_owner(agent)
            if store.coverage(owner) < length:
                raise ValueError(
                    f"{owner!r}'s LR cache covers [0, {store.coverage(owner)}), the view needs {length}"
                )
        if self.rewrite_end > length and capture is None:
            raise ValueError("re-processed positions need the turn's KVCapture")
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def lr_owner(self, agent: str) -> str:
        """The store entry whose LR cache ``agent`` reads."""
        return agent if self.shared_lr is None else self.shared_lr

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def _rope(self, start: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None:
            self._cos_sin = self.rope.cos_sin(0, self.rewrite_end, like.dtype, like.device)
        cos, sin = self._cos_sin
        return cos[..., start:end, :], sin[..., start:end, :]

    def _add_lr(
        self,
        layer: int,
        agent: str,
        base_k: torch.Tensor,
        base_v: torch.Tensor,
        ak: torch.Tensor | None,
        av: torch.Tensor | None,
        start: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = base_k, base_v
        head_dim = self.bank.head_dim
        if ak is not None:
            lr_k = split_heads(self.bank.keys[layer].up(agent, ak), head_dim).to(base_k.dtype)
            cos, sin = self._rope(start, start + ak.shape[1], lr_k)
            k = base_k + AbsoluteRope.apply(lr_k, cos, sin)
        if av is not None:
            v = base_v + split_heads(self.bank.values[layer].up(agent, av), head_dim).to(base_v.dtype)
        return k, v

    def layer(self, layer: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``[0, length)`` ``[rows, kv_heads, length, head_dim]``."""
        n = self.length if length is None else length
        base_k, base_v = self.store.base(layer, 0, n)
        keys, values = [], []
        with torch.no_grad():
            for agent in self.rows:
                if agent is None or n == 0 or self.bank.lr_width(agent) == 0:
                    keys.append(base_k)
                    values.append(base_v)
                    continue
                ak, av = self.store.agent_lr(self.lr_owner(agent), layer, 0, n)
                k, v = self._add_lr(layer, agent, base_k, base_v, ak, av, 0)
                keys.append(k)
                values.append(v)
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=0), torch.cat(values, dim=0)

    def rewrite(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the model's K/V ``[rows, kv_heads, T, head_dim]`` at positions ``start .. start + T - 1``
        that fall in ``[length, rewrite_end)`` by base + the LR part of this forward's hidden states."""
        stop = min(start + keys.shape[-2], self.rewrite_end)
        if stop <= start:
            return keys, values
        m = stop - start
        base_k, base_v = self.store.base(layer, start, stop)
        ax_k = self.capture.latest(layer, "key")
        ax_v = self.capture.latest(layer, "value")
        new_k, new_v = [], []
        with torch.no_grad():
            for row, agent in enumerate(self.rows):
                if agent is None:
                    new_k.append(base_k)
                    new_v.append(base_v)
                    continue
                kp, vp = self.bank.keys[layer], self.bank.values[layer]
                ak = ax_k[row : row + 1, :m, kp.slices[agent]] if agent in kp.slices else None
                av = ax_v[row : row + 1, :m, vp.slices[agent]] if agent in vp.slices else None
                k, v = self._add_lr(layer, agent, base_k, base_v, ak, av, start)
                new_k.append(k)
                new_v.append(v)
        keys = torch.cat([torch.cat(new_k, dim=0).to(keys.dtype), keys[..., m:, :]], dim=-2)
        values = torch.cat([torch.cat(new_v, dim=0).to(values.dtype), values[..., m:, :]], dim=-2)
        return keys, values

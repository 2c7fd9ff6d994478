"""Re-position post-RoPE key blocks.

Llama/Qwen2-style models cache keys *after* rotary embedding: ``k_p = R(p * inv_freq) k``.
A rotation at a fixed angle is linear, so a key block computed at positions ``p`` moves to
``q`` by one more rotation with angle ``a(q) - a(p)``. We take ``inv_freq`` straight from the
model's rotary module (never its forward, which multiplies cos/sin by ``attention_scaling``: the
stored keys already carry that factor once) and rotate by the difference of the float32 angles
the model itself computed, in float64, so a moved key matches a directly computed one to fp32
rounding.

Supported rope types: default, linear, llama3, yarn, longrope. Dynamic NTK recomputes its
frequencies from the sequence length, so a moved key is not the key at the new position: refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._compat import longrope_inverse_frequencies, rope_parameters

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's half-rotation convention: ``[-x2, x1]`` for ``x = [x1, x2]``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    """The rotary-embedding module of ``model`` (the first submodule holding ``inv_freq``)."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            return module
    raise ValueError(
        f"{type(model).__name__} has no rotary embedding module with `inv_freq`; "
        "re-positioning needs a RoPE model (Llama, Qwen2, Mistral, ...)"
    )


def _as_positions(positions: int | torch.Tensor, length: int) -> torch.Tensor:
    if isinstance(positions, int):
        return torch.arange(positions, positions + length, dtype=torch.long)
    positions = torch.as_tensor(positions, dtype=torch.long).flatten().cpu()
    if positions.numel() != length:
        raise ValueError(f"expected {length} positions (one per key), got {positions.numel()}")
    return positions


@dataclass
class RopeShifter:
    """Moves post-RoPE keys ``[batch, kv_heads, seq, head_dim]`` between positions.

    >>> shifter = RopeShifter.from_model(model)  # doctest: +SKIP
    >>> moved = shifter.reposition(keys, old_positions=0, new_positions=17)  # doctest: +SKIP
    """

    inv_freq: torch.Tensor  # [head_dim // 2] float32, as used for positions below the threshold
    rope_type: str = "default"
    long_inv_freq: torch.Tensor | None = None  # longrope: frequencies past the original context
    original_max_positions: int | None = None  # longrope: where the long frequencies start

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> RopeShifter:
        rotary = find_rotary_module(model)
        rope_type = rotary.rope_type
        if not isinstance(rope_type, str):
            raise ValueError(
                f"per-layer-type rotary embeddings ({rope_type}) are not supported for re-positioning"
            )
        if "dynamic" in rope_type:
            raise ValueError(
                f"rope type {rope_type!r} (dynamic NTK) rescales its frequencies with the sequence length, "
                "so a key cannot be moved by rotation alone; supported rope types: "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported for re-positioning; expected one of "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        original = getattr(rotary, "original_inv_freq", rotary.inv_freq)
        inv_freq = original.detach().float().cpu().clone()
        if rope_type != "longrope":
            return cls(inv_freq=inv_freq, rope_type=rope_type)
        params = rope_parameters(rotary.config)
        original_max = int(params["original_max_position_embeddings"])
        long_inv_freq = longrope_inverse_frequencies(rotary.config, seq_len=original_max + 1)
        return cls(
            inv_freq=inv_freq,
            rope_type=rope_type,
            long_inv_freq=long_inv_freq.float().cpu(),
            original_max_positions=original_max,
        )

    def _frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        if self.long_inv_freq is None:
            return self.inv_freq
        # longrope picks one frequency set per forward: the long one once the sequence passes the
        # original context. Keys computed under one set cannot be moved into the other.
        if int(positions.max()) + 1 > self.original_max_positions:
            return self.long_inv_freq
        return self.inv_freq

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """The float32 angles ``positions * inv_freq`` exactly as the model computes them, ``[S, D/2]``."""
        return positions.float()[:, None] * self._frequencies(positions)[None, :]

    def rotation(
        self, old_positions: int | torch.Tensor, new_positions: int | torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(cos, sin)`` ``[seq, head_dim]`` (float32) of the rotation moving keys from old to new
        positions, or ``None`` when they are equal. Compute once, apply to every layer."""
        old = _as_positions(old_positions, length)
        new = _as_positions(new_positions, length)
        if int(old.min()) < 0 or int(new.min()) < 0:
            raise ValueError("positions must be non-negative")
        if torch.equal(old, new):
            return None
        if self.long_inv_freq is not None and (self._frequencies(old) is not self._frequencies(new)):
            raise ValueError(
                "longrope uses different frequencies below and above "
                f"{self.original_max_positions} positions; keys cannot be moved across that boundary"
            )
        # difference of the angles the model computed (float32), taken in float64
        delta = self.angles(new).double() - self.angles(old).double()  # [S, D/2]
        emb = torch.cat((delta, delta), dim=-1)
        return emb.cos().float(), emb.sin().float()

    def apply(self, keys: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Rotate post-RoPE ``keys`` ``[batch, kv_heads, seq, head_dim]`` by a :meth:`rotation`."""
        if rotation is None:
            return keys
        cos, sin = (t.to(keys.device) for t in rotation)
        k = keys.float()
        return (k * cos + rotate_half(k) * sin).to(keys.dtype)

    def reposition(
        self,
        keys: torch.Tensor,
        old_positions: int | torch.Tensor,
        new_positions: int | torch.Tensor,
    ) -> torch.Tensor:
        """Return ``keys`` (computed at ``old_positions``) as they would be at ``new_positions``.

        Args:
            keys: post-RoPE keys ``[batch, kv_heads, seq, head_dim]``.
            old_positions / new_positions: a start position (int) or one position per key ``[seq]``.
        """
        if keys.dim() != 4:
            raise ValueError(f"expected keys [batch, kv_heads, seq, head_dim], got shape {tuple(keys.shape)}")
        if keys.shape[-1] != 2 * self.inv_freq.numel():
            raise ValueError(
                f"keys have head_dim {keys.shape[-1]} but the rotary module has {self.inv_freq.numel()} "
                f"frequencies (head_dim {2 * self.inv_freq.numel()})"
            )
        return self.apply(keys, self.rotation(old_positions, new_positions, keys.shape[-2]))

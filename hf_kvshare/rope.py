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

Layouts (read from the model, see :meth:`RopeShifter.from_model`): RoPE may rotate only the leading
``rotary_dim`` dimensions of each head (``partial_rotary_factor`` / ``rotary_pct``: Phi, StableLM,
GPT-NeoX, GLM), pair dimensions as halves ``(i, i + d/2)`` (Llama) or as neighbours ``(2i, 2i + 1)``
(Cohere, GLM), and differ per layer: Gemma 3 uses other frequencies on its local (sliding) layers,
SmolLM3 has layers without RoPE (their keys carry no position and are never rotated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._compat import (
    layers_without_rope,
    longrope_inverse_frequencies,
    per_layer_type_rotary,
    rope_parameters,
    rotary_pairs_interleaved,
    text_config,
    vision_tower,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's half-rotation convention: ``[-x2, x1]`` for ``x = [x1, x2]``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved convention (Cohere, GLM, GPT-J): ``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    """The rotary-embedding module of ``model`` (the first submodule with a ``rope_type`` and
    ``inv_freq``, or per-layer-type frequencies as Gemma 3's)."""
    tower = vision_tower(model)  # a vision-language model's tower has its own (2D) rotary module
    skip = set() if tower is None else {id(m) for m in tower.modules()}
    for module in model.modules():
        if id(module) in skip:
            continue
        if hasattr(module, "rope_type") and (
            hasattr(module, "inv_freq") or isinstance(module.rope_type, dict)
        ):
            return module
    raise ValueError(
        f"{type(model).__name__} has no rotary embedding module with `inv_freq`; "
        "re-positioning needs a RoPE model (Llama, Qwen2, Mistral, ...)"
    )


def _as_positions(positions: int | torch.Tensor, length: int) -> torch.Tensor:
    if isinstance(positions, int):
        return torch.arange(positions, positions + length, dtype=torch.long)
    positions = torch.as_tensor(positions, dtype=torch.long).flatten()  # stays on its device
    if positions.numel() != length:
        raise ValueError(f"expected {length} positions (one per key), got {positions.numel()}")
    return positions


def _check_rope_type(rope_type: str) -> None:
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


class LayerRotations(list):
    """One rotation (or ``None``) per layer, for models whose layers rotate differently."""


class Rotation(tuple):
    """``(cos, sin)`` ``[seq, rotary_dim]`` float32 of one re-positioning, computed once (on the host,
    from integer positions) and copied to each device it is applied on once, not once per layer:
    applying it to every layer's keys on a GPU costs one host-to-device copy per segment."""

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self
        if cos.device == device:
            return cos, sin
        copies = self.__dict__.setdefault("_copies", {})
        if device not in copies:
            copies[device] = (cos.to(device), sin.to(device))
        return copies[device]


@dataclass
class RopeShifter:
    """Moves post-RoPE keys ``[batch, kv_heads, seq, head_dim]`` between positions.

    >>> shifter = RopeShifter.from_model(model)  # doctest: +SKIP
    >>> moved = shifter.reposition(keys, old_positions=0, new_positions=17)  # doctest: +SKIP
    >>> moved_layer = shifter.apply(keys, shifter.rotation(0, 17, keys.shape[-2]), layer=3)  # doctest: +SKIP
    """

    inv_freq: torch.Tensor  # [rotary_dim // 2] float32, as used for positions below the threshold
    rope_type: str = "default"
    long_inv_freq: torch.Tensor | None = None  # longrope: frequencies past the original context
    original_max_positions: int | None = None  # longrope: where the long frequencies start
    #: leading dimensions of each head that RoPE rotates (``None``: ``2 * len(inv_freq)``); the rest pass through
    rotary_dim: int | None = None
    #: pairs ``(2i, 2i + 1)`` (Cohere, GLM) instead of Llama's halves ``(i, i + rotary_dim / 2)``
    interleaved: bool = False
    head_dim: int | None = None
    #: per layer, when layers rotate differently: a shifter, or ``None`` for a layer without RoPE
    layer_shifters: tuple[RopeShifter | None, ...] | None = None
    _device_frequencies: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rotary_dim is None:
            self.rotary_dim = 2 * self.inv_freq.numel()
        if self.head_dim is None:
            self.head_dim = self.rotary_dim

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> RopeShifter:
        rotary = find_rotary_module(model)
        config = text_config(model.config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        interleaved = rotary_pairs_interleaved(rotary)
        per_type = per_layer_type_rotary(rotary)
        if per_type is not None:  # Gemma 3: {layer type: (rope type, inv_freq)}
            layer_types = list(config.layer_types)
            by_type = {}
            for layer_type, (rope_type, inv_freq) in per_type.items():
                _check_rope_type(rope_type)
                if rope_type == "longrope":
                    raise ValueError("per-layer-type longrope is not supported for re-positioning")
                by_type[layer_type] = cls(
                    inv_freq=inv_freq.detach().float().cpu().clone(),
                    rope_type=rope_type,
                    interleaved=interleaved,
                    head_dim=head_dim,
                )
            first = by_type[layer_types[0]]
            layers = tuple(by_type[t] for t in layer_types)
            return cls(
                inv_freq=first.inv_freq,
                rope_type=first.rope_type,
                interleaved=interleaved,
                head_dim=head_dim,
                layer_shifters=layers,
            )
        rope_type = rotary.rope_type
        if not isinstance(rope_type, str):
            raise ValueError(
                f"per-layer-type rotary embeddings ({rope_type}) are not supported for re-positioning"
            )
        _check_rope_type(rope_type)
        original = getattr(rotary, "original_inv_freq", rotary.inv_freq)
        inv_freq = original.detach().float().cpu().clone()
        kwargs = dict(inv_freq=inv_freq, rope_type=rope_type, interleaved=interleaved, head_dim=head_dim)
        if rope_type == "longrope":
            params = rope_parameters(rotary.config)
            original_max = int(params["original_max_position_embeddings"])
            long_inv_freq = longrope_inverse_frequencies(rotary.config, seq_len=original_max + 1)
            kwargs.update(long_inv_freq=long_inv_freq.float().cpu(), original_max_positions=original_max)
        shifter = cls(**kwargs)
        without = layers_without_rope(config)
        if without is not None and any(without):  # SmolLM3: these layers' keys carry no position
            inner = cls(**kwargs)
            shifter.layer_shifters = tuple(None if skip else inner for skip in without)
        return shifter

    def _frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        if self.long_inv_freq is None:
            return self.inv_freq
        # longrope picks one frequency set per forward: the long one once the sequence passes the
        # original context. Keys computed under one set cannot be moved into the other.
        if int(positions.max()) + 1 > self.original_max_positions:
            return self.long_inv_freq
        return self.inv_freq

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """The float32 angles ``positions * inv_freq`` exactly as the model computes them, ``[S, D/2]``
        (on the positions' device)."""
        freq = self._frequencies(positions)
        if freq.device != positions.device:  # one copy per device, kept
            key = (id(freq), positions.device)
            if key not in self._device_frequencies:
                self._device_frequencies[key] = freq.to(positions.device)
            freq = self._device_frequencies[key]
        return positions.float()[:, None] * freq[None, :]

    def rotation(
        self, old_positions: int | torch.Tensor, new_positions: int | torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor] | LayerRotations | None:
        """``(cos, sin)`` ``[seq, rotary_dim]`` (float32) of the rotation moving keys from old to new
        positions, or ``None`` when they are equal; a :class:`LayerRotations` when layers rotate
        differently (pass ``layer=`` to :meth:`apply`). Compute once, apply to every layer."""
        if isinstance(old_positions, int) and isinstance(new_positions, int):  # checked without tensors
            if old_positions < 0 or new_positions < 0:
                raise ValueError("positions must be non-negative")
            if old_positions == new_positions:
                return None
        old = _as_positions(old_positions, length)
        new = _as_positions(new_positions, length)
        tensors = not (isinstance(old_positions, int) and isinstance(new_positions, int))
        if tensors and old.device.type == "cpu" and new.device.type == "cpu":  # device positions: no sync
            if int(old.min()) < 0 or int(new.min()) < 0:
                raise ValueError("positions must be non-negative")
            if torch.equal(old, new):
                return None
        if self.layer_shifters is not None:
            done: dict[int, tuple | None] = {}
            rotations = LayerRotations()
            for shifter in self.layer_shifters:
                if shifter is None:
                    rotations.append(None)
                    continue
                if id(shifter) not in done:
                    done[id(shifter)] = shifter._rotation(old, new)
                rotations.append(done[id(shifter)])
            return rotations
        return self._rotation(old, new)

    def _rotation(self, old: torch.Tensor, new: torch.Tensor) -> Rotation:
        if self.long_inv_freq is not None and (self._frequencies(old) is not self._frequencies(new)):
            raise ValueError(
                "longrope uses different frequencies below and above "
                f"{self.original_max_positions} positions; keys cannot be moved across that boundary"
            )
        # difference of the angles the model computed (float32), taken in float64
        delta = self.angles(new).double() - self.angles(old).double()  # [S, D/2]
        if self.interleaved:
            emb = delta.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((delta, delta), dim=-1)
        return Rotation((emb.cos().float(), emb.sin().float()))

    def apply(
        self,
        keys: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor] | LayerRotations | None,
        layer: int | None = None,
    ) -> torch.Tensor:
        """Rotate post-RoPE ``keys`` ``[batch, kv_heads, seq, head_dim]`` of ``layer`` by a :meth:`rotation`."""
        if isinstance(rotation, LayerRotations):
            if layer is None:
                raise ValueError("this model's layers rotate differently: pass the layer index to apply(...)")
            rotation = rotation[layer]
        if rotation is None:
            return keys
        if isinstance(rotation, Rotation):
            cos, sin = rotation.on(keys.device)
        else:
            cos, sin = (t.to(keys.device) for t in rotation)
        rd = cos.shape[-1]
        k = keys.float()
        rot, rest = k[..., :rd], k[..., rd:]
        turned = rotate_pairs(rot) if self.interleaved else rotate_half(rot)
        moved = rot * cos + turned * sin
        if rest.shape[-1]:
            moved = torch.cat((moved, rest), dim=-1)
        return moved.to(keys.dtype)

    def apply_into(
        self,
        keys: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor] | LayerRotations | None,
        out: torch.Tensor,
        layer: int | None = None,
    ) -> torch.Tensor:
        """:meth:`apply` written into ``out`` (a tensor of ``keys``' shape: e.g. a cache layer's slots),
        the same values bit for bit: the products and their sum are the same float32 operations, with
        one scratch tensor where :meth:`apply` allocates four (the half-rotation, its two products, the
        sum), and no copy into ``out`` afterwards. Keys of another dtype, interleaved pairs: ``out``
        gets :meth:`apply`'s result."""
        if isinstance(rotation, LayerRotations):
            if layer is None:
                raise ValueError(
                    "this model's layers rotate differently: pass the layer index to apply_into(...)"
                )
            rotation = rotation[layer]
        if rotation is None:
            return out.copy_(keys)
        if self.interleaved or keys.dtype != torch.float32 or out.dtype != torch.float32:
            return out.copy_(self.apply(keys, rotation))
        if isinstance(rotation, Rotation):
            cos, sin = rotation.on(keys.device)
        else:
            cos, sin = (t.to(keys.device) for t in rotation)
        rd = cos.shape[-1]
        half = rd // 2
        rot, moved = keys[..., :rd], out[..., :rd]
        turned = torch.empty_like(rot)  # rotate_half(rot): [-x2, x1]
        torch.neg(rot[..., half:], out=turned[..., :half])
        turned[..., half:].copy_(rot[..., :half])
        turned.mul_(sin)
        torch.mul(rot, cos, out=moved)
        moved.add_(turned)  # rot * cos + rotate_half(rot) * sin, as apply computes it
        if rd < keys.shape[-1]:
            out[..., rd:].copy_(keys[..., rd:])
        return out

    def reposition(
        self,
        keys: torch.Tensor,
        old_positions: int | torch.Tensor,
        new_positions: int | torch.Tensor,
        layer: int | None = None,
    ) -> torch.Tensor:
        """Return ``keys`` (computed at ``old_positions``) as they would be at ``new_positions``.

        Args:
            keys: post-RoPE keys ``[batch, kv_heads, seq, head_dim]``.
            old_positions / new_positions: a start position (int) or one position per key ``[seq]``.
            layer: the layer index, needed when layers rotate differently (Gemma 3, SmolLM3).
        """
        if keys.dim() != 4:
            raise ValueError(f"expected keys [batch, kv_heads, seq, head_dim], got shape {tuple(keys.shape)}")
        if keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"keys have head_dim {keys.shape[-1]} but the model has head_dim {self.head_dim} "
                f"({self.rotary_dim} of them rotated by {self.inv_freq.numel()} frequencies)"
            )
        return self.apply(keys, self.rotation(old_positions, new_positions, keys.shape[-2]), layer=layer)

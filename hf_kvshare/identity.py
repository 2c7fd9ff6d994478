"""A model's identity: what K/V computed by one model must match before another may use it.

:func:`model_fingerprint` gives the layer count, K/V heads, head dimension, parameter dtype and a
cheap hash of the weights (every parameter's name, shape and dtype, plus a strided sample of at
most 65,536 elements from each of a few parameters spread over the model). It is computed once per
model object and cached (weakly: the cache does not keep the model alive); weights changed in place
after the first call are not noticed. Saved method state (:meth:`hf_kvshare.method.Method.save_state`)
records it and refuses to load onto a model with another one.

>>> fp = model_fingerprint(model)  # doctest: +SKIP
>>> fp.layers, fp.kv_heads, fp.head_dim, fp.dtype  # doctest: +SKIP
(30, 3, 64, 'float32')
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from .cache import config_signature

#: parameters sampled for the weight hash, and elements sampled from each
SAMPLED_PARAMETERS = 4
SAMPLE_ELEMENTS = 65536

_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, ModelFingerprint] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ModelFingerprint:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    weights: str  # hex digest

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ModelFingerprint:
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names):
            raise ValueError(f"a model fingerprint needs exactly the keys {names}, got {data!r}")
        return cls(**data)

    def differences(self, other: ModelFingerprint) -> list[str]:
        """``"field: mine vs other"`` for every field that differs (empty: the same model)."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def __str__(self) -> str:
        return (
            f"{self.layers} layers, {self.kv_heads} kv heads x {self.head_dim}, {self.dtype}, "
            f"weights {self.weights[:12]}"
        )


def model_fingerprint(model: torch.nn.Module) -> ModelFingerprint:
    """The (cached) :class:`ModelFingerprint` of ``model``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model_fingerprint needs a torch.nn.Module, got {type(model).__name__}")
    cached = _CACHE.get(model)
    if cached is None:
        cached = _CACHE[model] = _compute(model)
    return cached


def _compute(model: torch.nn.Module) -> ModelFingerprint:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"model_fingerprint needs a model with a .config, got {type(model).__name__}")
    layers, kv_heads, head_dim = config_signature(config)
    params = list(model.named_parameters())
    digest = hashlib.sha256()
    for name, p in params:
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    if params:
        picks = sorted(
            {round(i * (len(params) - 1) / max(1, SAMPLED_PARAMETERS - 1)) for i in range(SAMPLED_PARAMETERS)}
        )
        for index in picks:
            p = params[index][1].detach()
            if p.device.type == "meta" or p.numel() == 0:
                continue
            flat = p.reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLE_ELEMENTS)][:SAMPLE_ELEMENTS]
            digest.update(sample.to("cpu", copy=True).contiguous().view(torch.uint8).numpy().tobytes())
    dtype = str(params[0][1].dtype).removeprefix("torch.") if params else "none"
    return ModelFingerprint(layers, kv_heads, head_dim, dtype, digest.hexdigest())

"""Which model a piece of state belongs to: a method instance's binding, and a cache's model identity.

K/V, anchor pools and recomputation engines of one model are meaningless for another, even one of
the same shape. :class:`ModelBinding` ties a method instance to the first model object it is used
with; :func:`model_identity` describes a model by its shape (layers, kv heads, head dim) and a cheap
weight fingerprint, so a cache built on one model is refused by another (see
:meth:`~hf_kvshare.cache.SegmentedCache.check_model`).
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from ._compat import config_name_or_path


def config_signature(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a model config: what a cache must match to be used with it."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return (text.num_hidden_layers, kv_heads, head_dim)


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
    decoder = decoder_of(model)  # a causal LM, its PEFT wrapper and its decoder share one fingerprint
    cached = _CACHE.get(decoder)
    if cached is None:
        cached = _CACHE[decoder] = _compute(decoder, model)
    return cached


def _compute(model: torch.nn.Module, outer: torch.nn.Module) -> ModelFingerprint:
    config = getattr(model, "config", None) or getattr(outer, "config", None)
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


#: a cache records the identity of the model it was built with (see cache.SegmentedCache.check_model)
ModelIdentity = ModelFingerprint
model_identity = model_fingerprint


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder (the module holding the embeddings and the layers) of a causal LM, a PEFT wrapper
    of one, or the decoder itself: ``model.get_decoder()`` where it exists."""
    get_decoder = getattr(model, "get_decoder", None)
    if get_decoder is None:
        return model
    try:
        decoder = get_decoder()
    except (AttributeError, NotImplementedError, TypeError):
        return model
    return decoder if isinstance(decoder, torch.nn.Module) else model


class ModelBinding:
    """Ties a method instance (its engines, anchor pools, profiles) to the one model it is used with.

    :meth:`check` raises for another model object; :meth:`bind` records the first one. K/V pools or
    a recomputation engine of one model are meaningless for another (even one of the same shape).
    After loading saved state, ``expected`` holds the fingerprint of the model it was built on: the
    first model bound must have it.
    """

    def __init__(self, owner: str):
        self.owner = owner
        self._model: weakref.ReferenceType | None = None
        self.description = ""
        self.expected: ModelFingerprint | None = None

    @staticmethod
    def describe(model: torch.nn.Module) -> str:
        config = getattr(model, "config", None)
        name = config_name_or_path(config) or type(model).__name__
        shape = config_signature(config) if config is not None else "?"
        return f"{name} (object id {id(model):#x}, layers/kv_heads/head_dim {shape})"

    @property
    def model(self) -> torch.nn.Module | None:
        return None if self._model is None else self._model()

    def check(self, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` if bound to another model object, or (after loading state) if the
        first model does not have the saved fingerprint."""
        bound = self.model
        if self._model is None:
            if self.expected is not None:
                differences = self.expected.differences(model_fingerprint(model))
                if differences:
                    raise ValueError(
                        f"this {self.owner} instance holds loaded state built on another model "
                        f"({'; '.join(differences)}; saved: {self.expected}); it cannot be used with "
                        f"{self.describe(model)}"
                    )
            return
        if bound is model:
            return
        was = self.description + ("" if bound is not None else " [since garbage-collected]")
        raise ValueError(
            f"this {self.owner} instance is bound to {was}; it cannot be used with "
            f"{self.describe(model)}. A method instance keeps engines and state built on the first model "
            "it is used with: create one method instance per model (correction methods: or call .clear() "
            "to drop the state)"
        )

    def bind(self, model: torch.nn.Module) -> bool:
        """Bind ``model`` (``True``: newly bound, ``False``: it already was); raise for another."""
        self.check(model)
        if self._model is not None:
            return False
        self._model = weakref.ref(model)
        self.description = self.describe(model)
        self.expected = None
        return True

    def clear(self) -> None:
        self._model = None
        self.description = ""
        self.expected = None

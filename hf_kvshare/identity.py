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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ModelIdentity:
    """A model's shape and weight fingerprint (computed once per model object)."""

    layers: int
    kv_heads: int
    head_dim: int
    fingerprint: str

    def __str__(self) -> str:
        return (
            f"(layers, kv_heads, head_dim) = ({self.layers}, {self.kv_heads}, {self.head_dim}), "
            f"weights {self.fingerprint}"
        )


_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: elements sampled per parameter tensor for the fingerprint
_SAMPLES = 16


def weight_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of every parameter's name, shape, dtype and ``_SAMPLES`` evenly strided values.

    Cheap (a few hundred tiny reductions, whatever the model's size) and computed once per model
    object by :func:`model_identity`: weights changed in place afterwards are not noticed.
    """
    digest = hashlib.sha256()
    sums = []
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        if param.is_meta or param.numel() == 0:
            continue
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES)
        sums.append(flat[::step][:_SAMPLES].double().sum().reshape(1).cpu())
    if sums:
        digest.update(torch.cat(sums).numpy().tobytes())
    return digest.hexdigest()[:16]


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


def model_identity(model: torch.nn.Module) -> ModelIdentity:
    """The :class:`ModelIdentity` of ``model``'s decoder (computed once per decoder object, so a
    causal LM, its PEFT wrapper and its decoder share one identity)."""
    decoder = decoder_of(model)
    identity = _IDENTITIES.get(decoder)
    if identity is None:
        config = getattr(decoder, "config", None) or model.config
        identity = ModelIdentity(*config_signature(config), weight_fingerprint(decoder))
        _IDENTITIES[decoder] = identity
    return identity


class ModelBinding:
    """Ties a method instance (its engines, anchor pools, profiles) to the one model it is used with.

    :meth:`check` raises for another model object; :meth:`bind` records the first one. K/V pools or
    a recomputation engine of one model are meaningless for another (even one of the same shape).
    """

    def __init__(self, owner: str):
        self.owner = owner
        self._model: weakref.ReferenceType | None = None
        self.description = ""

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
        """Raise ``ValueError`` if bound to another model object."""
        bound = self.model
        if self._model is None or bound is model:
            return
        was = self.description + ("" if bound is not None else " [since garbage-collected]")
        raise ValueError(
            f"this {self.owner} instance is bound to {was}; it cannot be used with "
            f"{self.describe(model)}. A method instance keeps engines and state built on the first model "
            "it is used with: create one method instance per model (correction methods: or call .clear() "
            "to drop the state)"
        )

    def bind(self, model: torch.nn.Module) -> None:
        self.check(model)
        if self._model is None:
            self._model = weakref.ref(model)
            self.description = self.describe(model)

    def clear(self) -> None:
        self._model = None
        self.description = ""

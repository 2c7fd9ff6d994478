"""The cache the PReCache methods build: an agent's K/V over a shared base and its low-rank cache."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .. import _compat
from ..cache import SharedCache


class _PrefixViewLayer(DynamicLayer):
    """A cache layer whose first ``prefix_length`` positions are rebuilt from a view at every read.

    Only the positions the model appends are stored (``keys``/``values``); ``update`` returns the
    view's prefix concatenated with them, so no copy of the prefix outlives a forward.
    """

    def __init__(self, view: Any, layer_idx: int):
        super().__init__()
        self.view = view
        self.layer_idx = layer_idx
        self.prefix_length = view.length

    def _tail_length(self) -> int:
        return super().get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.prefix_length == 0:
            return keys, values
        prefix_k, prefix_v = self.view.layer(self.layer_idx, self.prefix_length)
        return torch.cat([prefix_k, keys], dim=-2), torch.cat([prefix_v, values], dim=-2)

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix and appended positions ``[batch, kv_heads, seq, head_dim]``."""
        if self.prefix_length == 0:  # the request's first turn: no stored prefix (and no base yet)
            return self.keys, self.values
        prefix_k, prefix_v = self.view.layer(self.layer_idx, self.prefix_length)
        if self._tail_length() == 0:
            return prefix_k, prefix_v
        return torch.cat([prefix_k, self.keys], dim=-2), torch.cat([prefix_v, self.values], dim=-2)

    def get_seq_length(self) -> int:
        return self.prefix_length + self._tail_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop expects a negative number of tokens to remove, got {tokens_to_remove}")
        remove = -tokens_to_remove
        tail = self._tail_length()
        super().crop(-min(remove, tail))
        self.prefix_length -= min(max(remove - tail, 0), self.prefix_length)

    def reset(self) -> None:
        _compat.drop_layer_states([self])
        super().reset()
        self.prefix_length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "a lazily materialized BaseLRCache cannot be expanded for beams/samples; use materialize='turn'"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(
            "a lazily materialized BaseLRCache cannot select batch rows; use materialize='turn'"
        )

    def copy(self) -> _PrefixViewLayer:
        new = _PrefixViewLayer(self.view, self.layer_idx)
        new.prefix_length = self.prefix_length
        if self.is_initialized and self.keys is not None:
            new.update(self.keys.clone(), self.values.clone())
        return new


class BaseLRCache(SharedCache):
    """An agent's cache over a shared base K/V and its low-rank (LR) cache (PReCache).

    Positions ``[0, view.length)`` read, for a batch row whose agent is ``a`` (``None``: an
    adapter-free row, which reads the base alone)::

        K = K_base + rope(s_a * B_a (A_a x)),    V = V_base + s_a * B_a (A_a x)

    where ``K_base``/``V_base`` ``[1, kv_heads, L, head_dim]`` (keys after RoPE) are stored once per
    request for all agents and ``A_a x`` ``[1, L, r_a]`` is agent ``a``'s rank-``r_a`` LR cache
    (:class:`hf_kvshare.lora.LowRankStore`, presented by a :class:`hf_kvshare.lora.LowRankView`).
    Positions the model appends are stored as usual, so ``generate`` runs unchanged.

    Args:
        config: the model config.
        view: the :class:`~hf_kvshare.lora.LowRankView` to present.
        materialize: ``"turn"`` builds every layer's prefix once, when the cache is built (one
            full-size copy for the turn, plain decoding); ``"lazy"`` rebuilds a layer's prefix from
            the store at every forward (no copy kept; one ``B_a (A_a x)`` matmul per layer and step).

    Differs from ``DynamicCache``'s constructor: ``config`` and ``view`` are required and there is no
    ``offloading`` nor rebuild from ``(keys, values)`` pairs (``DataParallel`` / pytree): the prefix is
    read from the request's shared store, which plain tensors do not carry. For the same reason
    :func:`hf_kvshare.export.register_export_support` does not register it (no ``torch.export``).
    ``materialize="lazy"`` also refuses batch expansion (beams, several samples) with the reason.

    >>> cache = BaseLRCache(model.config, view, materialize="turn")  # doctest: +SKIP
    >>> cache.memory()  # base once + every agent's LR cache, and what this turn materialized  # doctest: +SKIP
    """

    MATERIALIZE = ("turn", "lazy")
    _PYTREE_NODE = False  # rebuilt from K/V pairs it would lose its view of the shared store

    def __init__(self, config: Any, view: Any, materialize: str = "turn"):
        if materialize not in self.MATERIALIZE:
            raise ValueError(f"materialize must be one of {self.MATERIALIZE}; got {materialize!r}")
        super().__init__(config)
        self.view = view
        self.materialize = materialize
        if materialize == "lazy":
            self.layers = [_PrefixViewLayer(view, i) for i in range(self.num_layers)]
        elif view.length > 0:
            for layer_idx in range(self.num_layers):
                self.layers[layer_idx].update(*view.layer(layer_idx))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        start = self.layers[layer_idx].get_seq_length()
        if start < self.view.rewrite_end:
            key_states, value_states = self.view.rewrite(layer_idx, start, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if isinstance(layer, _PrefixViewLayer):
            if layer.get_seq_length() == 0:
                raise ValueError(f"layer {layer_idx} of the cache is empty")
            return layer.full()
        return super().layer_kv(layer_idx)

    def kv_range(
        self, layer_idx: int, start: int, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions ``[start, end)`` ``[batch, kv_heads, end - start, head_dim]``, without
        rebuilding a lazy prefix that the range does not touch."""
        layer = self.layers[layer_idx]
        end = layer.get_seq_length() if end is None else end
        if isinstance(layer, _PrefixViewLayer) and start >= layer.prefix_length:
            lo, hi = start - layer.prefix_length, end - layer.prefix_length
            return layer.keys[..., lo:hi, :], layer.values[..., lo:hi, :]
        k, v = self.layer_kv(layer_idx)
        return k[..., start:end, :], v[..., start:end, :]

    def freeze(self) -> None:
        """Copy every lazy layer's prefix out of the store: the cache then holds what it read
        during its turn even after the store changes (a rebuilt base). Plain caches are unchanged."""
        for layer in self.layers:
            if isinstance(layer, _PrefixViewLayer) and layer.prefix_length:
                layer.keys, layer.values = layer.full()
                layer.prefix_length = 0

    def memory(self) -> dict[str, Any]:
        """Exact bytes: the request's shared store (base once + each agent's LR cache) and this turn's own K/V."""
        report = dict(self.view.store.memory())
        report["turn_bytes"] = self.nbytes
        return report

    def copy(self) -> BaseLRCache:
        if self.materialize != "lazy":
            return super().copy()
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        DynamicCache.__init__(new, config=self.config)
        new.layers = [layer.copy() for layer in self.layers]
        new.segments = [replace(s, info=dict(s.info)) for s in self.segments]
        return new

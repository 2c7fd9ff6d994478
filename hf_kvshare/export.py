"""Export support: our caches as pytree nodes, for ``torch.export`` and other pytree users.

Every private torch / transformers name this needs is reached through :mod:`hf_kvshare._compat`.
"""

from __future__ import annotations

from functools import partial
from itertools import zip_longest
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from . import _compat
from .cache import Segment, SegmentedCache
from .cache_layer import SegmentLayer


def register_export_support() -> None:
    """Register our caches as pytree nodes, as ``transformers.integrations.executorch.
    register_dynamic_cache_export_support()`` registers ``DynamicCache``, so that ``torch.export``
    (and other pytree users) accept them where they accept a ``DynamicCache``.

    Flattening gives the per-layer keys and values (the leaves, as for ``DynamicCache``); the segment
    table (without the ``info`` reports) and the sealing state (each class's ``_PYTREE_STATE``) travel
    in the tree spec, so a round trip gives back the same class with the same table. Call it once,
    after importing hf_kvshare (it registers :class:`~hf_kvshare.cache.SegmentedCache` and every
    subclass defined by then). Like transformers, it is not done on import: a registered cache is
    rebuilt by any pytree ``tree_map`` it passes through.

    Not registered: caches whose layers are not plain ``DynamicLayer`` (their class sets
    ``_PYTREE_NODE = False``: a lazily materialized ``BaseLRCache`` reads its prefix from a shared store
    that no tensor list carries; flattening one raises ``RuntimeError`` with that reason).

    >>> register_export_support()  # doctest: +SKIP
    >>> torch.export.export(model, (), {"input_ids": ids, "cache": cache, "use_cache": True}, strict=False)  # doctest: +SKIP
    """
    classes, todo = [], [SegmentedCache]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in classes:
        if not cls.__dict__.get("_PYTREE_NODE", True):
            continue
        _compat.register_pytree_node(
            cls,
            lambda cache: _pytree_flatten(cache, with_keys=False),
            partial(_pytree_unflatten, cls),
            lambda cache: _pytree_flatten(cache, with_keys=True),
            lambda cache, spec: [_pytree_dict(cache)[key] for key in spec.context[0]],
        )


def _pytree_dict(cache: SegmentedCache) -> dict[str, list[torch.Tensor]]:
    odd = {type(layer).__name__ for layer in cache.layers if type(layer) not in (DynamicLayer, SegmentLayer)}
    if odd:
        raise RuntimeError(
            f"{type(cache).__name__} holds {sorted(odd)} layers; only plain DynamicLayer K/V can be flattened "
            "(a lazily materialized BaseLRCache reads its prefix from a shared store: use materialize='turn')"
        )
    return {
        "key_cache": [layer.keys for layer in cache.layers if layer.keys is not None],
        "value_cache": [layer.values for layer in cache.layers if layer.values is not None],
    }


def _pytree_flatten(cache: SegmentedCache, with_keys: bool):
    values, keys = _compat.pytree_dict_flatten(_pytree_dict(cache), with_keys=with_keys)
    table = tuple((s.name, s.kind, s.start, s.end, s.provenance, s.source_agent) for s in cache.segments)
    state = tuple(getattr(cache, name) for name in cache._PYTREE_STATE)
    return values, [keys, len(cache.layers), table, state]


def _pytree_unflatten(cls: type[SegmentedCache], values: list, context: Any) -> SegmentedCache:
    keys, num_layers, table, state = context
    tensors = _compat.pytree_dict_unflatten(values, keys)
    pairs = list(zip_longest(tensors["key_cache"], tensors["value_cache"]))
    pairs += [(None, None)] * (num_layers - len(pairs))
    cache = cls(pairs)
    cache.segments = [Segment(*row) for row in table]
    for name, value in zip(cls._PYTREE_STATE, state):
        setattr(cache, name, value)
    return cache

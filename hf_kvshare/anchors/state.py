"""What correction methods keep besides their pools: the model they are bound to, and per-request
state (context-free references, slot versions) that lives as long as the request's Session."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import config_name_or_path
from ..cache import SegmentedCache, SegmentKV, config_signature
from .pool import REFERENCE


class ModelBinding:
    """Ties cross-request state (anchor pools, profiles) to the one model it was built on.

    The first :meth:`bind` records the model's identity; binding another model object raises,
    because K/V pools of one model are meaningless for another (even one of the same shape).
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

    def bind(self, model: torch.nn.Module) -> None:
        bound = self.model
        if bound is model:
            return
        if self._model is not None:
            was = self.description + ("" if bound is not None else " [since garbage-collected]")
            raise ValueError(
                f"this {self.owner} instance holds state built on {was}; it cannot be used with "
                f"{self.describe(model)}. Pools are keyed by model identity: create one method "
                "instance per model (or call .clear() to drop the state)"
            )
        self._model = weakref.ref(model)
        self.description = self.describe(model)

    def clear(self) -> None:
        self._model = None
        self.description = ""


@dataclass
class RequestState:
    """Per-request (per-Session) state of a correction method."""

    uid: int
    #: slot -> the slot's K/V prefilled with nothing before it (positions 0 ..)
    references: dict[str, SegmentKV] = field(default_factory=dict)
    #: slot -> how many turns have replaced the slot's latest materialized cache
    versions: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.references.values())


class RequestStates:
    """``Session -> RequestState``, dropped when the session is garbage-collected."""

    def __init__(self):
        self._states: weakref.WeakKeyDictionary[Any, RequestState] = weakref.WeakKeyDictionary()
        self._uids = itertools.count()

    def get(self, session: Any) -> RequestState:
        state = self._states.get(session)
        if state is None:
            state = self._states[session] = RequestState(uid=next(self._uids))
        return state

    def nbytes(self, session: Any) -> int:
        """Bytes of ``session``'s state (its context-free references); 0 when it has none."""
        state = self._states.get(session)
        return 0 if state is None else state.nbytes

    def __len__(self) -> int:
        return len(self._states)

    def clear(self) -> None:
        self._states = weakref.WeakKeyDictionary()


def context_free_reference(model: torch.nn.Module, token_ids: torch.Tensor) -> SegmentKV:
    """Prefill ``token_ids`` ``[S]`` alone at positions ``0 .. S-1`` and return its K/V (batch 1).

    This is the reference KVComm, GraphFlow and non-chained KVCMAS correct from; it is a prefill
    outside the agent workflow.
    """
    token_ids = torch.as_tensor(token_ids).flatten()
    if token_ids.numel() == 0:
        raise ValueError("cannot build a reference for an empty segment")
    cache = SegmentedCache(model.config)
    cache.append_dense(model, token_ids[None])
    return cache.extract(0, token_ids.numel(), agent=REFERENCE)

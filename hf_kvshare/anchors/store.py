"""What a correction method keeps across requests, bounded and persisted: one helper for the anchor
pools of KVCMAS / KVComm and the relation profiles of GraphFlow.

A :class:`BoundedStore` holds the entries (an :class:`~.pool.LRUDict`: past ``limit`` the least
recently used entry is dropped) and the per-request states (:class:`~.state.RequestStates`, whose
next uid is saved with the entries so that a restored instance never reuses one). The method keeps
its knobs and calls the store from its hooks: ``clear``, ``export_state`` / ``import_state``,
``state_bytes``, ``state_summary``, ``request_state_bytes``; :class:`Stored` names the store's
entries on the method (``pools``, ``profiles``). :func:`check_rank` and
:func:`clamp_ranks` are the rank option's check and its clamp to the model's K/V feature dimension.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..cache import config_signature
from .lowrank import columns
from .persist import TensorTable
from .pool import LRUDict
from .state import RequestStates

if TYPE_CHECKING:
    from .sharded import Shard

#: ``to_state(entries, table) -> metadata`` (tensors go to ``table``);
#: ``from_state(metadata, tensors, dims) -> (entries, names of the tensors used)``
ToState = Callable[[Any, TensorTable], list[dict[str, Any]]]
FromState = Callable[
    [list[dict[str, Any]], dict[str, torch.Tensor], "tuple[int, int, int] | None"],
    tuple[dict[Any, Any], set[str]],
]


class BoundedStore:
    """The entries a method keeps across requests (named ``kind`` in its saved metadata and summary:
    ``"pools"``, ``"profiles"``), at most ``limit``, and its per-request states.

    Args:
        owner: the method's name, for error messages.
        kind: the metadata key of the entries; the summary reports ``kind``, ``max_<kind>`` and
            ``evicted_<kind>``.
        limit: entries kept; past it the least recently used one is dropped (and counted).
        to_state, from_state: the entries as named tensors plus metadata and back
            (:mod:`~hf_kvshare.anchors.persist`).
        max_bytes: the entries' bytes (``None``: no bound): :meth:`trim` keeps them within it
            (:meth:`LRUDict.trim <hf_kvshare.anchors.pool.LRUDict.trim>`).

    :attr:`shard` is the engine's one shard context (:class:`~.sharded.Shard`: this tensor-parallel
    rank's heads and its group; ``None``, the default: one rank holds every head): the engine policies
    reading this store pass it to every reduction over the feature dimension and every factorization.
    """

    def __init__(
        self,
        owner: str,
        kind: str,
        limit: int,
        to_state: ToState,
        from_state: FromState,
        max_bytes: int | None = None,
    ):
        self.owner, self.kind, self.limit, self.max_bytes = owner, kind, limit, max_bytes
        self._to_state, self._from_state = to_state, from_state
        self.entries: LRUDict = LRUDict(limit, max_bytes)
        self.requests = RequestStates()
        self.shard: Shard | None = None

    def clear(self) -> None:
        """Drop every entry and every request's state (the next request uid is kept)."""
        self.entries = LRUDict(self.limit, self.max_bytes)
        self.requests.clear()

    def export(self, table: TensorTable) -> dict[str, Any]:
        """The metadata of the entries (in LRU order; their tensors go to ``table``), the next request
        uid and the evictions so far."""
        return {
            self.kind: self._to_state(self.entries, table),
            "next_request": self.requests.next_uid,
            "evicted": self.entries.evicted,
        }

    def read(
        self,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        dims: tuple[int, int, int] | None = None,
    ) -> tuple[dict[Any, Any], int, int]:
        """``(entries, next uid, evictions)`` from an exported state, checked (shapes against each
        other and ``dims``, the saved model's layers, kv heads and head dim; every tensor named once)
        and built aside, nothing replaced; damaged metadata raises ``ValueError`` naming the owner."""
        try:
            entries, used = self._from_state(meta[self.kind], tensors, dims)
            next_uid, evicted = meta["next_request"], meta.get("evicted", 0)
            for name, value in (("next_request", next_uid), ("evicted", evicted)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{name} must be an int >= 0, got {value!r}")
            if len(entries) != len(meta[self.kind]):
                raise ValueError(
                    f"{len(meta[self.kind])} {self.kind} saved under {len(entries)} distinct keys"
                )
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as error:
            raise ValueError(f"{self.owner}: saved state metadata is damaged ({error})") from error
        extra = sorted(set(tensors) - used)
        if extra:
            raise ValueError(
                f"{self.owner}: the saved state holds tensors no {self.kind} entry names: {extra[:5]}"
            )
        return entries, next_uid, evicted

    def replace(self, entries: dict[Any, Any], next_uid: int, evicted: int) -> None:
        """Replace the entries (in the saved order: least recently used first) and drop the state of
        live requests; the next request gets uid ``next_uid``."""
        self.entries = LRUDict(self.limit, self.max_bytes)
        self.entries.update(entries)
        self.entries.evicted = evicted
        self.requests = RequestStates(next_uid)
        self.trim()

    def bound_bytes(self, max_bytes: int | None) -> None:
        """Keep the entries within ``max_bytes`` from now on (``None``: no bound), trimmed at once."""
        self.max_bytes = self.entries.max_bytes = max_bytes
        self.trim()

    def trim(self) -> None:
        """The entries within ``max_bytes``: least recently used dropped first (counted)."""
        self.entries.trim(self.shard)

    def load(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """:meth:`read` then :meth:`replace`."""
        self.replace(*self.read(tensors, meta))

    @property
    def nbytes(self) -> int:
        """Exact bytes of every entry (a storage several of them keep alive counted once)."""
        return self.entries.nbytes

    def summary(self) -> dict[str, Any]:
        """``{kind: count, max_<kind>: limit, evicted_<kind>: evictions}`` and the bytes:
        ``<kind>_bytes``, ``max_<kind>_bytes`` (``None``: no bound), ``<kind>_evicted_for_bytes``."""
        return {
            self.kind: len(self.entries),
            f"max_{self.kind}": self.entries.limit,
            f"evicted_{self.kind}": self.entries.evicted,
            f"{self.kind}_bytes": self.nbytes,
            f"max_{self.kind}_bytes": self.max_bytes,
            f"{self.kind}_evicted_for_bytes": self.entries.evicted_for_bytes,
        }


class Stored:
    """A method attribute that is its store's (``self._store``): ``pools = Stored("entries")`` reads and
    writes ``self._store.entries``, ``_requests = Stored("requests")`` its request states."""

    def __init__(self, field: str, doc: str = ""):
        self.field, self.__doc__ = field, doc

    def __get__(self, owner: Any, cls: type | None = None) -> Any:
        return self if owner is None else getattr(owner._store, self.field)

    def __set__(self, owner: Any, value: Any) -> None:
        setattr(owner._store, self.field, value)


def check_rank(name: str, value: Any) -> None:
    """A rank option is a positive int (not a bool) or ``None`` (dense)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int or None (dense), got {value!r}")


def clamp_ranks(config: Any, shard: Shard | None = None, **ranks: int | None) -> dict[str, int | None]:
    """The rank options clamped to the model's K/V feature dimension ``D = kv_heads * head_dim``,
    with a warning for each one above it (pointing at the caller of ``Method.bind``). Under ``shard``
    ``config`` is a tensor-parallel rank's (its KV heads) and ``D`` every rank's."""
    _, kv_heads, head_dim = config_signature(config)
    kv_heads = columns(kv_heads, shard)
    dim = kv_heads * head_dim
    clamped = {}
    for knob, rank in ranks.items():
        if rank is not None and rank > dim:
            warnings.warn(
                f"{knob}={rank} exceeds the model's K/V feature dimension D = {kv_heads} kv heads x "
                f"{head_dim} = {dim}; clamped to {dim} (full rank, exact)",
                UserWarning,
                stacklevel=4,  # clamp_ranks <- attach <- bind <- its caller
            )
            rank = dim
        clamped[knob] = rank
    return clamped

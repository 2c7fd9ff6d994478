"""K/V kept where vLLM computed them: the connector's store in the worker, on the paged cache's device,
and the scheduler's view of it.

A finished request's K/V are read from the paged cache by the worker (:mod:`.connector_worker`). The
scheduler decides which of them the worker keeps (:class:`StoreMirror`: least recently used first, by
bytes, within ``device_store_bytes``); the worker keeps them in its :class:`DeviceStore` under the
request id, on the cache's device. A later claim whose K/V are rows of a kept request (FullShared's
placements, prefix_reuse's own text, exact mode) then travels as a reference (request id, rows, where
they go, their RoPE shift): the worker re-positions the keys on its device and writes them, and no K/V
cross the process boundary for it.

Deterministic: the scheduler's mirror is the only one that decides. A keep order (the capture's
``keep``) carries the evictions that make room for it (``drop``), applied by the worker before it keeps
the new request, so the worker's bytes never pass the mirror's; an entry a claim in flight references
is pinned (never evicted) until that request ends. A reference to rows the worker does not hold (it
could not keep them) is never written from anything else: the worker reports the claim's blocks as
failed loads (vLLM recomputes or fails the request, its ``kv_load_failure_policy``).

:class:`Sources` (scheduler side) finds a placement's provenance: the host's slots hold the read-back
K/V as views (:meth:`Sharing._engine_cache <hf_kvshare.serving.host.Sharing._engine_cache>`), so a
placement whose keys and values are views of one kept read-back's rows is those rows; anything else
(KVCMAS's corrected spans, a compacted copy, rotated keys) is not a reference.

A value-free method (:data:`~hf_kvshare.serving.host.VALUE_FREE`) gets no read-back at all: the worker
returns :func:`stand_ins` of what it keeps (``meta`` tensors, no bytes), the record holds views of them
and :class:`Sources` registers them as it registers K/V (a ``meta`` view keeps its storage and offset),
so the scheduler keeps no host copy and every claim of such a record is a reference.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..budgets import check_byte_budget

#: the worker store's default bound (bytes of kept K/V on the paged cache's device)
DEFAULT_DEVICE_STORE_BYTES = 2 << 30
#: dropped request ids the worker remembers (a keep order for one, taken after its drop, is refused)
DROPPED_MAX = 4096


def stand_ins(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a value-free method's record holds of a read-back the worker keeps: ``meta`` tensors of its
    shapes and dtypes (no bytes; :func:`~hf_kvshare.segment_kv.is_stand_in`), which :class:`Sources`
    registers as it registers K/V: a placement that views their rows is those rows of the worker's."""
    return (
        torch.empty(keys.shape, dtype=keys.dtype, device="meta"),
        torch.empty(values.shape, dtype=values.dtype, device="meta"),
    )


def check_bound(value: Any) -> int:
    """``device_store_bytes`` as an int >= 0 (0: the worker keeps nothing; every claim's K/V travel)."""
    return check_byte_budget("device_store_bytes", value)


class DeviceStore:
    """The worker's kept K/V: request id -> ``(keys, values)`` ``[layers, n, kv_heads, head_dim]`` on the
    paged cache's device, at most ``max_bytes`` (a keep that would pass it is refused, counted). A request
    once dropped is never kept again (orders taken out of order: its keep after its drop)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = check_bound(max_bytes)
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()
        self.bytes = 0
        self.refused = 0
        self._lock = threading.Lock()

    @staticmethod
    def nbytes(keys: torch.Tensor, values: torch.Tensor) -> int:
        return keys.numel() * keys.element_size() + values.numel() * values.element_size()

    def keep(self, request_id: str, keys: torch.Tensor, values: torch.Tensor) -> bool:
        size = self.nbytes(keys, values)
        with self._lock:
            self._drop(request_id)
            if request_id in self._dropped or self.bytes + size > self.max_bytes:
                self.refused += 1
                return False
            self._kv[request_id] = (keys, values)
            self.bytes += size
            return True

    def drop(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._drop(request_id)
                self._dropped[request_id] = None
            while len(self._dropped) > DROPPED_MAX:
                self._dropped.popitem(last=False)

    def _drop(self, request_id: str) -> None:
        kv = self._kv.pop(request_id, None)
        if kv is not None:
            self.bytes -= self.nbytes(*kv)

    def get(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            return self._kv.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._kv

    def __len__(self) -> int:
        return len(self._kv)


class StoreMirror:
    """The scheduler's copy of what the worker's :class:`DeviceStore` holds (ids and bytes, no tensor),
    and the one that decides: least recently used first, by bytes. Thread-safe.

    ``bytes_per_token`` (every layer's keys and values of one position, as the worker stores them) is
    what the worker announces; until then nothing is kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = check_bound(max_bytes)
        self.bytes_per_token: int | None = None
        self._held: OrderedDict[str, int] = OrderedDict()
        self._pins: dict[str, set[str]] = {}  # claiming request -> kept requests it references
        self.bytes = 0
        self.kept = 0
        self.evicted = 0
        self.refused = 0  # finished requests not kept: larger than the budget, or it was pinned full
        self._lock = threading.Lock()

    def admit(self, request_id: str, tokens: int) -> tuple[bool, list[str]]:
        """Whether the worker keeps a finished request's ``tokens`` positions, and what it drops first to
        make room (the least recently used entries no claim in flight references)."""
        with self._lock:
            if self.bytes_per_token is None or not self.max_bytes:
                return False, []
            size = tokens * self.bytes_per_token
            pinned = set().union(*self._pins.values()) if self._pins else set()
            free = self.max_bytes - self.bytes + sum(b for r, b in self._held.items() if r not in pinned)
            if size > free:
                self.refused += 1
                return False, []
            drops = []
            for held in list(self._held):
                if self.bytes + size <= self.max_bytes:
                    break
                if held not in pinned:
                    self.bytes -= self._held.pop(held)
                    self.evicted += 1
                    drops.append(held)
            self._held[request_id] = size
            self.bytes += size
            self.kept += 1
            return True, drops

    def forget(self, request_id: str) -> bool:
        """A kept request the scheduler will not reference (not recorded): ``True`` when it was held (the
        worker must be told to drop it)."""
        with self._lock:
            size = self._held.pop(request_id, None)
            if size is None:
                return False
            self.bytes -= size
            return True

    def pin(self, claiming: str, request_ids: list[str]) -> bool:
        """Pin the kept requests a claim references until :meth:`unpin`; ``False`` (nothing pinned) when
        one of them is not held any more. A reference marks its entry used (least recently used last)."""
        with self._lock:
            if any(r not in self._held for r in request_ids):
                return False
            self._pins.setdefault(claiming, set()).update(request_ids)
            for r in request_ids:
                self._held.move_to_end(r)
            return True

    def unpin(self, claiming: str) -> None:
        with self._lock:
            self._pins.pop(claiming, None)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._held

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "device_bytes": self.bytes,
                "device_max_bytes": self.max_bytes,
                "device_requests": len(self._held),
                "device_kept": self.kept,
                "device_evicted": self.evicted,
                "device_refused": self.refused,
            }


@dataclass(frozen=True)
class Origin:
    """Where a placement's K/V come from: rows ``[row, row + n)`` of kept request ``request_id``'s K/V,
    which sat at positions ``start ..`` when it computed them."""

    request_id: str
    row: int
    n: int
    start: int


@dataclass(frozen=True)
class CorrectedOrigin(Origin):
    """A corrected placement whose source is kept rows (:class:`Origin`) and whose delta is low rank
    (KVCMAS's corrected spans: :class:`~hf_kvshare.anchors.corrected.LowRankDelta`): the worker
    re-positions the rows and adds the delta on its device (:func:`add_delta`); only the factors travel.
    ``factors[layer]``: ``((a_k, b_k), (a_v, b_v))`` of the span's first ``rows`` rows, ``None`` for a layer
    left uncorrected; keys' deltas canonical (rotated to the target) or, ``frame="writer"``, added as is."""

    rows: int = 0
    frame: str = "canonical"
    factors: tuple = ()


def corrected_origin(kv: Any, find: Any) -> CorrectedOrigin | None:
    """``kv``'s provenance when it is a corrected segment (``low_rank`` exposed) of kept rows ``find``
    finds (:meth:`Sources.find`), its factors computed now (what they read may change later), fewer bytes
    than the span's rows (``r (m + D)`` numbers per anchor and layer against ``S D``) and finite (all of
    them checked in one host read); else ``None``."""
    low_rank = getattr(kv, "low_rank", None)
    source = getattr(kv, "source", None)
    if low_rank is None or source is None or not kv.deferred:
        return None
    origin = find(source)
    if origin is None:
        return None
    factors = []
    for layer in range(len(source.keys)):
        pair = None
        if low_rank.rows and not (low_rank.skip_layer0 and layer == 0):
            pair = low_rank.factors(layer)
            if pair is None:  # a layer without low-rank factors: the rows are computed on the scheduler
                return None
        factors.append(pair)
    tensors = [t for pair in factors if pair for side in pair for t in side]
    factor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    row_bytes = sum(t[:1].numel() * t.element_size() for t in (*source.keys, *source.values))
    if factor_bytes >= row_bytes:
        return None  # the corrected rows are fewer bytes (a short span, many anchors): they are sent
    # every factor's finiteness in one host read; non-finite: computed on the scheduler, which refuses a
    # non-finite correction as before
    if tensors and not torch.stack([torch.isfinite(t).all() for t in tensors]).all():
        return None
    return CorrectedOrigin(**vars(origin), rows=low_rank.rows, frame=low_rank.frame, factors=tuple(factors))


def add_delta(
    key: torch.Tensor,
    value: torch.Tensor,
    delta: Any,
    rotation: Any,
    shifter: Any,
    layer: int,
    heads: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a corrected piece, on the worker's device: ``key`` / ``value`` ``[n, kv_heads,
    head_dim]`` (the kept source rows, keys already re-positioned) plus the delta ``a @ b`` of their first
    ``m`` rows (``delta``: ``((a_k, b_k), (a_v, b_v))``, ``a`` ``[m, R]``, ``b`` ``[R, D]`` over all KV
    heads, ``heads`` this rank's ``[start, stop)`` of them), the keys' delta rotated by ``rotation``
    (``None``: added as is). New tensors (the kept rows are not changed); the values
    :class:`~hf_kvshare.anchors.corrected.CorrectedKV` writes, up to float rounding."""
    (a_k, b_k), (a_v, b_v) = delta
    m, dim = a_k.shape[0], key.shape[-1]

    def rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d = (a.to(key.device) @ b.to(key.device)).view(m, -1, dim)  # [m, kv_heads, head_dim]
        return d if heads is None else d[:, heads[0] : heads[1]]

    delta_k, delta_v = rows(a_k, b_k), rows(a_v, b_v)
    if rotation is not None:  # as the shifter's [1, heads, m, dim]
        delta_k = shifter.apply(delta_k.transpose(0, 1)[None], rotation, layer=layer)[0].transpose(0, 1)
    key, value = key.clone(), value.clone()
    key[:m] += delta_k.to(key.dtype)
    value[:m] += delta_v.to(value.dtype)
    return key, value


class Sources:
    """The scheduler's registry of the read-backs the worker keeps (weak: a storage freed is gone), and
    the provenance of a placement's K/V among them (:meth:`find`). Thread-safe."""

    def __init__(self, mirror: StoreMirror):
        self._mirror = mirror
        self._by_storage: dict[int, tuple[weakref.ref, str, int, int]] = {}  # id -> (ref, rid, base, n)
        self._of_request: dict[str, list[int]] = {}
        #: the registered storages the worker's store holds itself (handed over in-process: one copy)
        self._shared: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()

    def register(
        self, request_id: str, keys: torch.Tensor, values: torch.Tensor, shared: bool = False
    ) -> None:
        """A kept request's read-back ``[layers, n, kv_heads, head_dim]`` K/V (the tensors its record
        keeps views of); ``shared``: they are the very tensors the worker's store keeps (the channel's
        in-process handoff), not a copy."""
        if keys.dim() != 4 or not keys.is_contiguous() or not values.is_contiguous():
            return
        with self._lock:
            ids = []
            for tensor in (keys, values):
                storage = tensor.untyped_storage()
                if shared:
                    self._shared[id(storage)] = weakref.ref(storage)
                self._by_storage[id(storage)] = (
                    weakref.ref(storage),
                    request_id,
                    tensor.data_ptr(),
                    keys.shape[1],
                )
                ids.append(id(storage))
            self._of_request[request_id] = ids

    def summary(self) -> dict[str, Any]:
        """The worker's store as the scheduler's mirror sees it (:meth:`StoreMirror.summary`)."""
        return self._mirror.summary()

    def forget(self, request_id: str) -> None:
        with self._lock:
            for key in self._of_request.pop(request_id, []):
                self._by_storage.pop(key, None)
                self._shared.pop(key, None)

    def shared_storages(self) -> set[tuple[str, int]]:
        """``(device, data pointer)`` of each live storage registered ``shared`` (the accounting's
        key: :func:`~hf_kvshare.segment_kv.storage_bytes` counts storages so)."""
        with self._lock:
            live = [ref() for ref in self._shared.values()]
        return {(str(s.device), s.data_ptr()) for s in live if s is not None}

    def kept(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of a read-back the worker's store keeps itself (registered
        ``shared``, not forgotten since: the mirror has not evicted it): a record's views of it are no
        second copy, so its host keeps them as views (:attr:`Request.kept_elsewhere
        <hf_kvshare.request.Request.kept_elsewhere>`) until the worker drops it."""
        storage = tensor.untyped_storage()
        with self._lock:
            ref = self._shared.get(id(storage))
        return ref is not None and ref() is storage

    def _rows(self, tensors: list[torch.Tensor]) -> tuple[str, int, int] | None:
        """``(request id, first row, rows)`` when every layer's ``[1, heads, m, dim]`` tensor is a view of
        one registered read-back at one row (the layer's own part of it), else ``None``."""
        found = None
        for layer, t in enumerate(tensors):
            if t.dim() != 4 or t.shape[0] != 1:
                return None
            _, heads, m, dim = t.shape
            storage = t.untyped_storage()
            entry = self._by_storage.get(id(storage))
            if entry is None or entry[0]() is not storage:
                return None
            _, rid, base, n = entry
            if m > 1 and t.stride(2) != heads * dim or heads > 1 and t.stride(1) != dim or t.stride(3) != 1:
                return None
            offset, rest = divmod(t.data_ptr() - base, t.element_size())
            row, rest2 = divmod(offset - layer * n * heads * dim, heads * dim)
            if rest or rest2 or row < 0 or row + m > n:
                return None
            if found is None:
                found = (rid, row, m)
            elif found != (rid, row, m):
                return None
        return found

    def find(self, kv: Any) -> Origin | None:
        """The kept rows ``kv`` (a :class:`~hf_kvshare.segment_kv.SegmentKV`) shows, or ``None`` (K/V
        computed later, a :class:`~hf_kvshare.segment_kv.DeferredKV` not computed yet, a copy, an image's
        multimodal-RoPE layout)."""
        if kv is None or getattr(kv, "deferred", False) or getattr(kv, "rope", None) is not None:
            return None
        with self._lock:
            keys, values = self._rows(list(kv.keys)), self._rows(list(kv.values))
        if keys is None or keys != values or keys[0] not in self._mirror:
            return None
        return Origin(keys[0], keys[1], keys[2], kv.start)


#: the worker's default budget for claims' K/V that came on the order channel and wait for their step
#: (``payload_bytes`` in ``kv_connector_extra_config``)
DEFAULT_PAYLOAD_BYTES = 1 << 30
#: request ids whose claim's K/V the payload buffer dropped, remembered so their claim fails at once
PAYLOADS_DROPPED_MAX = 4096


class PayloadBuffer:
    """Claims' K/V that came on the order channel (:meth:`put`, the channel's thread), by request id,
    until the step that writes them takes them (:meth:`take`), within ``max_bytes``: past it the oldest
    are dropped (an aborted request's, whose step never came), and K/V larger than the whole budget are
    not kept. Each drop is counted (``dropped``) and returned to the caller, which logs it; the claim
    then finds no K/V (at once, not after the wait) and its blocks are reported failed: vLLM recomputes
    them, never a write from anything else."""

    def __init__(self, max_bytes: int):
        self.max_bytes = check_byte_budget("payload_bytes", max_bytes)
        self._kv: OrderedDict[Hashable, tuple[torch.Tensor, ...]] = OrderedDict()
        self._dropped: OrderedDict[Hashable, None] = OrderedDict()
        self.bytes = 0
        self.dropped = 0
        self._ready = threading.Condition()

    def put(self, request_id: Hashable, *tensors: torch.Tensor) -> list[Hashable]:
        """Hold a claim's tensors (its K/V; or, keyed ``("factors", request id)``, a corrected claim's
        factors); returns the keys dropped to stay within the budget (this one when it alone passes it)."""
        size = sum(t.nbytes for t in tensors)
        with self._ready:
            self._pop(request_id)
            dropped = []
            if size > self.max_bytes:
                dropped.append(request_id)
            else:
                while self.bytes + size > self.max_bytes:
                    dropped.append(next(iter(self._kv)))
                    self._pop(dropped[-1])
                self._kv[request_id] = tensors
                self.bytes += size
                self._dropped.pop(request_id, None)
            for gone in dropped:
                self._dropped[gone] = None
            while len(self._dropped) > PAYLOADS_DROPPED_MAX:
                self._dropped.popitem(last=False)
            self.dropped += len(dropped)
            self._ready.notify_all()
        return dropped

    def take(self, request_id: Hashable, timeout: float) -> tuple[tuple[torch.Tensor, ...] | None, str]:
        """A claim's tensors, waiting up to ``timeout`` seconds for them to come, and why there are none
        (``""`` when there are)."""
        with self._ready:
            self._ready.wait_for(lambda: request_id in self._kv or request_id in self._dropped, timeout)
            if request_id in self._dropped:
                del self._dropped[request_id]
                return None, f"dropped past the worker's payload budget ({self.max_bytes} bytes)"
            kv = self._pop(request_id)
            return kv, "" if kv is not None else f"never came on the order channel within {timeout:g} s"

    def _pop(self, request_id: Hashable) -> tuple[torch.Tensor, ...] | None:
        kv = self._kv.pop(request_id, None)
        if kv is not None:
            self.bytes -= sum(t.nbytes for t in kv)
        return kv

    def __len__(self) -> int:
        return len(self._kv)

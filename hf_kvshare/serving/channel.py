"""Side channels between vLLM's scheduler and its worker for the K/V a finished request used.

vLLM hands what a worker's connector returns (``build_connector_worker_meta``) to the scheduler only
at the end of the engine step, after that step's forward, and the scheduler's orders to the worker
(the connector metadata) only at the start of the next step, after the scheduler has scheduled it
(which waits for the plans being decided: :mod:`.admission`). A finished request's K/V went both
ways: its record (and the next agent's plan, which waits for it) started only once the whole next
step had run: behind another request's prefill, seconds. Two channels take them off vLLM's steps:

- **orders** (scheduler -> worker; :class:`Orders` in the worker, :meth:`Sender.order` in the
  scheduler): when a request finishes (``request_finished``), the scheduler orders its read-back at
  once; the worker's order thread reads it from the paged cache (its blocks are kept until the worker
  reports them read) while the engine goes on;
- **claims' K/V** (scheduler -> worker, on the order channel: :meth:`Sender.send` in the scheduler,
  :class:`Orders`' ``deliver`` in the worker): the K/V of a claim that are not rows the worker keeps
  (:mod:`.worker_store`; e.g. KVCMAS's corrected spans), under the request id, so the step's metadata
  carries no tensor;
- **claims' correction factors** (scheduler -> worker, on the order channel: :meth:`Sender.send_tensors`,
  :class:`Orders`' ``deliver_tensors``): a corrected claim whose source is rows the worker keeps sends only
  its delta's low-rank factors (KVCMAS; :func:`~.worker_store.add_delta`), not its rows;
- **read-back** (worker -> scheduler; :meth:`Sender.send` in the worker, :class:`Receiver` in the
  scheduler): the K/V the moment the worker has them; the scheduler's channel thread queues the
  record.

Without an order (the order channel not up yet, or full) or when the read-back channel refuses, the
worker reads the request in the next step's ``wait_for_save`` and returns it with the step's output, as
before the channels (the one fallback: :mod:`.connector_worker`).

ZeroMQ PUSH / PULL pairs over ``ipc://`` sockets in private temporary folders (pyzmq is one of
vLLM's own dependencies; NIXL's connector has a ZeroMQ side channel of its own). Each listener names
its own address and the other side learns it from vLLM's own messages (the read-back address in the
connector metadata, the order address in the worker's metadata), so the two never guess each
other's address (the worker process may be vLLM's engine-core process or a child of it). A read-back
is one message per request and worker: a JSON header (request id, shape, dtype, when it was read, the
worker's tensor-parallel rank), then the keys' and the values' bytes (none for stand-ins, ``meta``
tensors: a value-free method's record of K/V the worker keeps); an order is one JSON frame.

**In-process handoff.** At one worker rank vLLM's executor is "uni": the worker runs in the engine-core
process, the scheduler's own. Each listener registers its address in a process-local table while it is
bound, and a :class:`Sender` whose address is a listener of this process (``in_process``; unless built
with ``in_process=False``: the ``in_process`` key of ``kv_connector_extra_config``, the escape hatch)
sends its tensors by reference: they are parked in a process-local, bounded handoff table under a key,
the message is its JSON header alone (``handoff``: the key), and the listener takes them back: the
receiver gets the very same tensor objects (same storage, same device), no copy, no bytes. Only this
module parks tensors there (``tests/test_layout.py``). A sender to another process's address
serializes as above. Each end counts its messages ``in_process`` / ``serialized`` and the bytes it
serialized (``counts``: the connector's summary).

Bounded: a sender never blocks (a full or absent channel: ``send`` / ``order`` return ``False`` and
the connector takes the fallback above), at most ``max_queued`` messages wait in it (in-process: at
most ``max_queued`` parked entries per sender, its socket then carrying headers and orders only; a
refused send parks nothing, and a listener's close drops what was parked for it), and a listener's
thread polls with a timeout, so it stops within ``POLL_S`` of ``close``. No vLLM import here (tests
drive it directly).
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

logger = logging.getLogger("hf_kvshare.serving")

#: how long the receiver's thread waits for a message before it looks at whether it was closed (s)
POLL_S = 0.1
#: messages the sender holds before ``send`` refuses (each is one request's read-back K/V)
DEFAULT_MAX_QUEUED = 8

_DTYPES = MappingProxyType({str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)})
#: a tensor message's (:func:`encode_tensors`): K/V's and factors' dtypes, and int64 (the leader replica's
#: published byte counts, :mod:`.replica`)
_TENSOR_DTYPES = MappingProxyType({**_DTYPES, str(torch.int64): torch.int64})


def encode(
    request_id: str, keys: torch.Tensor, values: torch.Tensor, via: str = "", rank: int = 0
) -> list[Any]:
    """The frames of one message: a JSON header, then the keys' and values' bytes (not copied);
    ``via`` says when the sender read them (the report's ``read_back``), ``rank`` which tensor-parallel
    worker (whose KV heads they are)."""
    _check_kv(keys, values)
    header = {
        "request_id": request_id,
        "shape": list(keys.shape),
        "dtype": str(keys.dtype),
        "via": via,
        "rank": int(rank),
    }
    if keys.is_meta:  # stand-ins (the K/V stay in the worker): shapes, no bytes
        return [json.dumps({**header, "stand_in": True}).encode(), b"", b""]
    return [json.dumps(header).encode(), *(_bytes(t) for t in (keys, values))]


def _check_kv(keys: torch.Tensor, values: torch.Tensor) -> None:
    """A read-back's keys and values: one shape, one known dtype, both stand-ins or both values."""
    if keys.shape != values.shape or keys.dtype != values.dtype:
        raise ValueError(
            f"keys and values must have one shape and dtype; got {tuple(keys.shape)} {keys.dtype} and "
            f"{tuple(values.shape)} {values.dtype}"
        )
    if str(keys.dtype) not in _DTYPES:
        raise ValueError(f"a read-back's dtype must be one of {sorted(_DTYPES)}; got {keys.dtype}")
    if keys.is_meta != values.is_meta:
        raise ValueError("keys and values must both be stand-ins (meta) or both hold values")


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")


def decode(frames: list[Any]) -> tuple[str, torch.Tensor, torch.Tensor, str, int]:
    """``(request_id, keys, values, via, rank)`` of a message :func:`encode` made (writable tensors of
    their own)."""
    if len(frames) != 3:
        raise ValueError(f"a read-back message has 3 frames (header, keys, values); got {len(frames)}")
    header = json.loads(bytes(frames[0]))
    dtype = _DTYPES.get(header.get("dtype"))
    shape = header.get("shape")
    if dtype is None or not isinstance(shape, list):
        raise ValueError(f"a read-back message's header needs a known dtype and a shape; got {header!r}")
    if header.get("stand_in") is True:
        stand_in = torch.empty(shape, dtype=dtype, device="meta")
        return (
            str(header["request_id"]),
            stand_in,
            torch.empty_like(stand_in),
            str(header.get("via", "")),
            int(header.get("rank", 0)),
        )
    out = []
    for frame in frames[1:]:
        raw = bytearray(frame)  # one copy: the tensor owns writable memory
        tensor = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out.append(tensor.view(dtype).reshape(shape))
    return str(header["request_id"]), out[0], out[1], str(header.get("via", "")), int(header.get("rank", 0))


def encode_tensors(request_id: str, kind: str, tensors: list[torch.Tensor]) -> list[Any]:
    """The frames of a list of tensors of any shapes under ``request_id``: a JSON header (``kind``, each
    tensor's shape and dtype), then each tensor's bytes (a claim's correction factors)."""
    _check_dtypes(tensors)
    header = {
        "request_id": request_id,
        "kind": kind,
        "tensors": [[list(t.shape), str(t.dtype)] for t in tensors],
    }
    return [json.dumps(header).encode(), *(_bytes(t) for t in tensors)]


def _check_dtypes(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if str(t.dtype) not in _TENSOR_DTYPES:
            raise ValueError(
                f"a tensor message's dtype must be one of {sorted(_TENSOR_DTYPES)}; got {t.dtype}"
            )


def decode_tensors(frames: list[Any]) -> tuple[str, str, list[torch.Tensor]]:
    """``(request_id, kind, tensors)`` of a message :func:`encode_tensors` made."""
    header = json.loads(bytes(frames[0]))
    specs = header.get("tensors")
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ValueError(f"a tensor message's header must list its {len(frames) - 1} tensors; got {header!r}")
    out = []
    for (shape, dtype), frame in zip(specs, frames[1:]):
        raw = bytearray(frame)
        tensor = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out.append(tensor.view(_TENSOR_DTYPES[dtype]).reshape(shape))
    return str(header["request_id"]), str(header["kind"]), out


def _is_tensors(frames: list[Any]) -> bool:
    """Whether a message of several frames is a :func:`encode_tensors` one (its header names a kind)."""
    try:
        return "kind" in json.loads(bytes(frames[0]))
    except ValueError:
        return False


def check_in_process(value: Any) -> bool:
    """``in_process`` (``kv_connector_extra_config``; :class:`Sender`'s keyword): true or false."""
    if not isinstance(value, bool):
        raise ValueError(f"hf_kvshare: in_process must be true or false; got {value!r}")
    return value


class _Handoff:
    """The process-local handoff table: the addresses of this process's bound listeners, and per
    listener the tensors parked for it by reference (key -> ``(sender, message)``) until its thread
    takes them. Thread-safe (one lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._parked: dict[str, OrderedDict[str, tuple[int, tuple[Any, ...]]]] = {}
        self._keys = itertools.count()

    def register(self, address: str) -> None:
        with self._lock:
            self._parked[address] = OrderedDict()

    def unregister(self, address: str) -> None:
        """The listener is closing: nothing is parked for it from here, and what was is dropped."""
        with self._lock:
            self._parked.pop(address, None)

    def is_local(self, address: str) -> bool:
        with self._lock:
            return address in self._parked

    def park(self, address: str, sender: int, max_queued: int, message: tuple[Any, ...]) -> str | None:
        """Park ``message`` for the listener at ``address``; its key, or ``None`` (nothing parked) when
        the listener is not bound in this process or ``sender`` has ``max_queued`` entries waiting."""
        with self._lock:
            parked = self._parked.get(address)
            if parked is None or sum(1 for owner, _ in parked.values() if owner == sender) >= max_queued:
                return None
            key = f"{sender:x}-{next(self._keys)}"
            parked[key] = (sender, message)
            return key

    def take(self, address: str, key: str) -> tuple[Any, ...] | None:
        """The message parked under ``key`` for ``address``, removed (``None``: dropped or never parked)."""
        with self._lock:
            entry = self._parked.get(address, {}).pop(key, None)
        return None if entry is None else entry[1]

    def cancel(self, address: str, key: str) -> None:
        self.take(address, key)

    def parked(self, address: str) -> int:
        """Entries waiting for the listener at ``address`` (tests)."""
        with self._lock:
            return len(self._parked.get(address, ()))


#: this process's handoff table (the only place tensors are parked by reference)
_HANDOFF = _Handoff()
#: the JSON header's key of an in-process message (the parked entry's key)
HANDOFF_KEY = "handoff"


def _handed(frames: list[Any], address: str) -> tuple[Any, ...] | None:
    """The parked message an in-process message's one frame names (``(kind, arguments)``), taken from
    the handoff table; ``None`` for any other message. A key whose entry is gone (dropped): an error."""
    if len(frames) != 1:
        return None
    try:
        header = json.loads(bytes(frames[0]))
    except ValueError:
        return None
    if not isinstance(header, dict) or HANDOFF_KEY not in header:
        return None
    message = _HANDOFF.take(address, str(header[HANDOFF_KEY]))
    if message is None:
        raise ValueError(f"an in-process message's tensors are gone from the handoff table: {header!r}")
    return message


def _tensor_bytes(frames: list[Any]) -> int:
    """Bytes of a serialized message's tensor frames (its header not counted)."""
    return sum(len(memoryview(f)) for f in frames[1:])


class _Listener:
    """A PULL socket bound in a temporary folder of its own and a thread that hands each message's
    frames to ``handle`` (its errors logged: one bad message does not stop the channel); ``kind``
    names its socket and thread."""

    kind: str

    def __init__(self, handle: Callable[[list[Any]], None]):
        import zmq

        self._handle = handle
        self._dir = tempfile.mkdtemp(prefix="hf_kvshare-")
        self.address = f"ipc://{Path(self._dir) / self.kind}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(self.address)
        except Exception:
            self._socket.close(0)
            self._context.term()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._closed = threading.Event()
        #: messages received and handed on (the connector's tests and reports)
        self.received = 0
        #: messages taken from the handoff table / deserialized, and the tensor bytes deserialized
        self.counts = {"in_process": 0, "serialized": 0, "serialized_bytes": 0}
        _HANDOFF.register(self.address)
        self._thread = threading.Thread(target=self._run, name=f"hf_kvshare-{self.kind}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if not poller.poll(int(POLL_S * 1000)):
                    continue
                frames = self._socket.recv_multipart(copy=False)
            except zmq.ZMQError:
                if not self._closed.is_set():
                    logger.exception(
                        "hf_kvshare: the %s channel failed; the step's output path is used", self.kind
                    )
                return
            try:
                self.received += 1
                frames = [f.buffer for f in frames]
                handed = _handed(frames, self.address)
                if handed is not None:
                    self.counts["in_process"] += 1
                    self._handle_handed(*handed)
                else:
                    self.counts["serialized"] += 1
                    self.counts["serialized_bytes"] += _tensor_bytes(frames)
                    self._handle(frames)
            except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                logger.exception("hf_kvshare: a %s message could not be handled", self.kind)

    def _handle_handed(self, kind: str, arguments: tuple[Any, ...]) -> None:
        """One in-process message: ``kind`` ``"kv"`` (:meth:`Sender.send`'s arguments) or ``"tensors"``
        (:meth:`Sender.send_tensors`'), the very tensors sent."""
        raise ValueError(f"the {self.kind} channel takes no {kind!r} message")

    def close(self, timeout: float = 5.0) -> None:
        _HANDOFF.unregister(self.address)  # what waits for it dropped; nothing parked for it from here
        self._closed.set()
        self._thread.join(timeout)
        self._socket.close(0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class Receiver(_Listener):
    """The scheduler's end of the read-back channel: ``deliver(request_id, keys, values, via, rank)`` on
    its own thread for each message (``via``: what the sender said of when it read them; ``rank``: the
    tensor-parallel worker that read them), and ``deliver_tensors(request_id, kind, tensors)`` for each
    tensor message (:meth:`Sender.send_tensors`: the leader replica's published values,
    :mod:`.replica`; without ``deliver_tensors`` refused)."""

    kind = "read-back"

    def __init__(
        self,
        deliver: Callable[[str, torch.Tensor, torch.Tensor, str, int], None],
        deliver_tensors: Callable[[str, str, list[torch.Tensor]], None] | None = None,
    ):
        def handle(frames: list[Any]) -> None:
            if deliver_tensors is not None and len(frames) > 1 and _is_tensors(frames):
                deliver_tensors(*decode_tensors(frames))
                return
            deliver(*decode(frames))

        self._deliver, self._deliver_tensors = deliver, deliver_tensors
        super().__init__(handle)

    def _handle_handed(self, kind: str, arguments: tuple[Any, ...]) -> None:
        if kind == "kv":
            self._deliver(*arguments)
        elif kind == "tensors" and self._deliver_tensors is not None:
            self._deliver_tensors(*arguments)
        else:
            super()._handle_handed(kind, arguments)


class Orders(_Listener):
    """The worker's end of the order channel: ``take(order)`` on its own thread for each JSON order the
    scheduler sent (:meth:`Sender.order`: read a finished request's K/V now, not at the next step), and
    ``deliver(request_id, keys, values, via)`` for each K/V message (:meth:`Sender.send`: a claim's K/V
    that are not rows the worker keeps, for the step that writes them; without ``deliver`` refused), and
    ``deliver_tensors(request_id, kind, tensors)`` for each tensor message (:meth:`Sender.send_tensors`:
    a corrected claim's factors)."""

    kind = "orders"

    def __init__(
        self,
        take: Callable[[dict[str, Any]], None],
        deliver: Callable[[str, torch.Tensor, torch.Tensor, str], None] | None = None,
        deliver_tensors: Callable[[str, str, list[torch.Tensor]], None] | None = None,
    ):
        def handle(frames: list[Any]) -> None:
            if len(frames) > 1 and deliver_tensors is not None and _is_tensors(frames):
                deliver_tensors(*decode_tensors(frames))
                return
            if len(frames) == 3 and deliver is not None:
                deliver(*decode(frames))
                return
            if len(frames) != 1:
                raise ValueError(f"an order has 1 frame; got {len(frames)}")
            order = json.loads(bytes(frames[0]))
            if not isinstance(order, dict):
                raise ValueError(f"an order is a JSON object; got {order!r}")
            take(order)

        self._deliver, self._deliver_tensors = deliver, deliver_tensors
        super().__init__(handle)

    def _handle_handed(self, kind: str, arguments: tuple[Any, ...]) -> None:
        if kind == "kv" and self._deliver is not None:
            self._deliver(*arguments)
        elif kind == "tensors" and self._deliver_tensors is not None:
            self._deliver_tensors(*arguments)
        else:
            super()._handle_handed(kind, arguments)


class Sender:
    """A PUSH socket connected to a listener's address; never blocks, and one thread at a time sends
    (its own lock: ZeroMQ sockets are not thread-safe). ``in_process``: whether its tensors go by
    reference (the address is a listener of this process and ``in_process`` was not turned off: the
    module docstring's handoff), else they are serialized."""

    def __init__(self, address: str, max_queued: int = DEFAULT_MAX_QUEUED, in_process: bool = True):
        import zmq

        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued must be an int >= 1; got {max_queued!r}")
        check_in_process(in_process)
        self.address = address
        self.max_queued = max_queued
        self.in_process = in_process and _HANDOFF.is_local(address)
        #: messages sent by reference / serialized, and the tensor bytes serialized
        self.counts = {"in_process": 0, "serialized": 0, "serialized_bytes": 0}
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        # in-process the parked entries are the bound (max_queued); the socket, which then carries their
        # headers and the orders only, holds up to twice that (ZeroMQ counts reads back in batches)
        self._socket.setsockopt(zmq.SNDHWM, 2 * max_queued if self.in_process else max_queued)
        # no completed connection: send refuses at once rather than queueing for a peer that is not there
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.connect(address)

    def _send(self, frames: list[Any]) -> bool:
        with self._lock:
            return self._send_locked(frames)

    def _send_tensors(self, kind: str, arguments: tuple[Any, ...], encoded: Callable[[], list[Any]]) -> bool:
        """One message of tensors: parked by reference when in-process (its header alone on the socket;
        refused: nothing stays parked), else ``encoded()``'s frames."""
        if not self.in_process:
            frames = encoded()  # outside the lock: the copy to host memory
            with self._lock:
                if not self._send_locked(frames):
                    return False
                self.counts["serialized"] += 1
                self.counts["serialized_bytes"] += _tensor_bytes(frames)
            return True
        with self._lock:  # parked and sent as one step: the socket's order is the parking's
            key = _HANDOFF.park(self.address, id(self), self.max_queued, (kind, arguments))
            if key is None:
                return False
            header = json.dumps({HANDOFF_KEY: key, "request_id": arguments[0]}).encode()
            if not self._send_locked([header]):
                _HANDOFF.cancel(self.address, key)
                return False
            self.counts["in_process"] += 1
        return True

    def _send_locked(self, frames: list[Any]) -> bool:
        import zmq

        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError:  # closed, or the context terminated: the caller takes its other path
            logger.exception("hf_kvshare: sending on %s failed", self.address)
            return False
        return True

    def send(
        self, request_id: str, keys: torch.Tensor, values: torch.Tensor, via: str = "", rank: int = 0
    ) -> bool:
        """Queue one read-back (of tensor-parallel ``rank``'s heads); ``False`` when the channel is full
        or not connected (nothing sent)."""
        if self.in_process:
            _check_kv(keys, values)
        return self._send_tensors(
            "kv", (request_id, keys, values, via, rank), lambda: encode(request_id, keys, values, via, rank)
        )

    def send_tensors(self, request_id: str, kind: str, tensors: list[torch.Tensor]) -> bool:
        """Queue one tensor message (:func:`encode_tensors`); ``False`` when the channel is full or not
        connected (nothing sent)."""
        if self.in_process:
            _check_dtypes(tensors)
        return self._send_tensors(
            "tensors", (request_id, kind, list(tensors)), lambda: encode_tensors(request_id, kind, tensors)
        )

    def order(self, order: dict[str, Any]) -> bool:
        """Queue one JSON order; ``False`` when the channel is full or not connected (nothing sent)."""
        return self._send([json.dumps(order).encode()])

    def close(self) -> None:
        with self._lock:
            self._socket.close(0)
        self._context.term()

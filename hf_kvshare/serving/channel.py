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

Bounded: a sender never blocks (a full or absent channel: ``send`` / ``order`` return ``False`` and
the connector takes the fallback above), at most ``max_queued`` messages wait in it, and a
listener's thread polls with a timeout, so it stops within ``POLL_S`` of ``close``. No vLLM import
here (tests drive it directly).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
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


def encode(
    request_id: str, keys: torch.Tensor, values: torch.Tensor, via: str = "", rank: int = 0
) -> list[Any]:
    """The frames of one message: a JSON header, then the keys' and values' bytes (not copied);
    ``via`` says when the sender read them (the report's ``read_back``), ``rank`` which tensor-parallel
    worker (whose KV heads they are)."""
    if keys.shape != values.shape or keys.dtype != values.dtype:
        raise ValueError(
            f"keys and values must have one shape and dtype; got {tuple(keys.shape)} {keys.dtype} and "
            f"{tuple(values.shape)} {values.dtype}"
        )
    if str(keys.dtype) not in _DTYPES:
        raise ValueError(f"a read-back's dtype must be one of {sorted(_DTYPES)}; got {keys.dtype}")
    header = {
        "request_id": request_id,
        "shape": list(keys.shape),
        "dtype": str(keys.dtype),
        "via": via,
        "rank": int(rank),
    }
    if keys.is_meta or values.is_meta:  # stand-ins (the K/V stay in the worker): shapes, no bytes
        if not (keys.is_meta and values.is_meta):
            raise ValueError("keys and values must both be stand-ins (meta) or both hold values")
        return [json.dumps({**header, "stand_in": True}).encode(), b"", b""]
    return [json.dumps(header).encode(), *(_bytes(t) for t in (keys, values))]


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
    for t in tensors:
        if str(t.dtype) not in _DTYPES:
            raise ValueError(f"a tensor message's dtype must be one of {sorted(_DTYPES)}; got {t.dtype}")
    header = {
        "request_id": request_id,
        "kind": kind,
        "tensors": [[list(t.shape), str(t.dtype)] for t in tensors],
    }
    return [json.dumps(header).encode(), *(_bytes(t) for t in tensors)]


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
        out.append(tensor.view(_DTYPES[dtype]).reshape(shape))
    return str(header["request_id"]), str(header["kind"]), out


def _is_tensors(frames: list[Any]) -> bool:
    """Whether a message of several frames is a :func:`encode_tensors` one (its header names a kind)."""
    try:
        return "kind" in json.loads(bytes(frames[0]))
    except ValueError:
        return False


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
                self._handle([f.buffer for f in frames])
            except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                logger.exception("hf_kvshare: a %s message could not be handled", self.kind)

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        self._thread.join(timeout)
        self._socket.close(0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class Receiver(_Listener):
    """The scheduler's end of the read-back channel: ``deliver(request_id, keys, values, via, rank)`` on
    its own thread for each message (``via``: what the sender said of when it read them; ``rank``: the
    tensor-parallel worker that read them)."""

    kind = "read-back"

    def __init__(self, deliver: Callable[[str, torch.Tensor, torch.Tensor, str, int], None]):
        super().__init__(lambda frames: deliver(*decode(frames)))


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

        super().__init__(handle)


class Sender:
    """A PUSH socket connected to a listener's address; never blocks, and one thread at a time sends
    (its own lock: ZeroMQ sockets are not thread-safe)."""

    def __init__(self, address: str, max_queued: int = DEFAULT_MAX_QUEUED):
        import zmq

        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued must be an int >= 1; got {max_queued!r}")
        self.address = address
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, max_queued)
        # no completed connection: send refuses at once rather than queueing for a peer that is not there
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.connect(address)

    def _send(self, frames: list[Any]) -> bool:
        import zmq

        with self._lock:
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
        return self._send(encode(request_id, keys, values, via, rank))

    def send_tensors(self, request_id: str, kind: str, tensors: list[torch.Tensor]) -> bool:
        """Queue one tensor message (:func:`encode_tensors`); ``False`` when the channel is full or not
        connected (nothing sent)."""
        return self._send(encode_tensors(request_id, kind, tensors))

    def order(self, order: dict[str, Any]) -> bool:
        """Queue one JSON order; ``False`` when the channel is full or not connected (nothing sent)."""
        return self._send([json.dumps(order).encode()])

    def close(self) -> None:
        with self._lock:
            self._socket.close(0)
        self._context.term()

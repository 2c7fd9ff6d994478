"""A side channel from vLLM's worker to its scheduler for the K/V a finished request used.

vLLM hands what a worker's connector returns (``build_connector_worker_meta``) to the scheduler only
at the end of the engine step, after that step's forward. A finished request's K/V are read back in
the step after it finished, so through that path its record (and the next agent's plan, which waits
for it) starts only once that whole next step has run: behind another request's prefill, seconds.
This channel carries the read-back the moment the worker has it, before the step's forward
(:meth:`HFKVShareConnector.bind_connector_metadata <hf_kvshare.serving.connector.HFKVShareConnector>`):
the record runs on the connector's thread beside the forward.

A ZeroMQ PUSH / PULL pair over an ``ipc://`` socket in a private temporary folder (pyzmq is one of
vLLM's own dependencies; NIXL's connector has a ZeroMQ side channel of its own), named by the
scheduler and sent to the worker in the step's connector metadata, so the two never guess each
other's address (the worker process may be vLLM's engine-core process or a child of it). One message
per request: a JSON header (request id, shape, dtype), then the keys' and the values' bytes.

Bounded: the sender never blocks (a full or absent channel: ``send`` returns ``False`` and the
connector hands that request's K/V through the worker's metadata, as without the channel), at most
``max_queued`` messages wait in it, and the receiver's thread polls with a timeout, so it stops
within ``POLL_S`` of :meth:`Receiver.close`. No vLLM import here (tests drive it directly).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("hf_kvshare.serving")

#: how long the receiver's thread waits for a message before it looks at whether it was closed (s)
POLL_S = 0.1
#: messages the sender holds before ``send`` refuses (each is one request's read-back K/V)
DEFAULT_MAX_QUEUED = 8

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def encode(request_id: str, keys: torch.Tensor, values: torch.Tensor) -> list[Any]:
    """The frames of one message: a JSON header, then the keys' and values' bytes (not copied)."""
    if keys.shape != values.shape or keys.dtype != values.dtype:
        raise ValueError(
            f"keys and values must have one shape and dtype; got {tuple(keys.shape)} {keys.dtype} and "
            f"{tuple(values.shape)} {values.dtype}"
        )
    if str(keys.dtype) not in _DTYPES:
        raise ValueError(f"a read-back's dtype must be one of {sorted(_DTYPES)}; got {keys.dtype}")
    header = {"request_id": request_id, "shape": list(keys.shape), "dtype": str(keys.dtype)}
    return [json.dumps(header).encode(), *(_bytes(t) for t in (keys, values))]


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")


def decode(frames: list[Any]) -> tuple[str, torch.Tensor, torch.Tensor]:
    """``(request_id, keys, values)`` of a message :func:`encode` made (writable tensors of their own)."""
    if len(frames) != 3:
        raise ValueError(f"a read-back message has 3 frames (header, keys, values); got {len(frames)}")
    header = json.loads(bytes(frames[0]))
    dtype = _DTYPES.get(header.get("dtype"))
    shape = header.get("shape")
    if dtype is None or not isinstance(shape, list):
        raise ValueError(f"a read-back message's header needs a known dtype and a shape; got {header!r}")
    out = []
    for frame in frames[1:]:
        raw = bytearray(frame)  # one copy: the tensor owns writable memory
        tensor = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out.append(tensor.view(dtype).reshape(shape))
    return str(header["request_id"]), out[0], out[1]


class Receiver:
    """The scheduler's end: binds a PULL socket in a temporary folder of its own and calls
    ``deliver(request_id, keys, values)`` on its own thread for each message."""

    def __init__(self, deliver: Callable[[str, torch.Tensor, torch.Tensor], None]):
        import zmq

        self._deliver = deliver
        self._dir = tempfile.mkdtemp(prefix="hf_kvshare-")
        self.address = f"ipc://{Path(self._dir) / 'read-back'}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._closed = threading.Event()
        #: messages received and delivered (the connector's tests and reports)
        self.received = 0
        self._thread = threading.Thread(target=self._run, name="hf_kvshare-read-back", daemon=True)
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
                if self._closed.is_set():
                    return
                logger.exception(
                    "hf_kvshare: the read-back channel failed; read-backs come with the step's output"
                )
                return
            try:
                request_id, keys, values = decode([f.buffer for f in frames])
                self.received += 1
                self._deliver(request_id, keys, values)
            except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                logger.exception("hf_kvshare: a read-back message could not be delivered")

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        self._thread.join(timeout)
        self._socket.close(0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class Sender:
    """The worker's end: a PUSH socket connected to the receiver's address; never blocks."""

    def __init__(self, address: str, max_queued: int = DEFAULT_MAX_QUEUED):
        import zmq

        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued must be an int >= 1; got {max_queued!r}")
        self.address = address
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, max_queued)
        # no completed connection: send refuses at once rather than queueing for a peer that is not there
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.connect(address)

    def send(self, request_id: str, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Queue one read-back; ``False`` when the channel is full or not connected (nothing sent)."""
        import zmq

        try:
            self._socket.send_multipart(encode(request_id, keys, values), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()

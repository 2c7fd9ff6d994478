"""The connector's worker side (vLLM's worker process): writes claimed K/V into the paged cache before
the forward and reads a finished request's K/V back for its record.

- ``start_load_kv``: each claim is written with the attention backend's own writer (:mod:`.paged`: CPU
  and CUDA backends alike), synchronously, before the forward.
- A finished request's K/V (prompt + output but its last token; its blocks kept until this side says
  they are read, ``get_finished``) are read once, on one path with one fallback:

  - **the path**: the scheduler's order (the order channel's thread, :mod:`.channel`), as the request
    finishes; the K/V go back on the read-back channel (``read_back: "at finish"``), beside the
    engine's next forward;
  - **the fallback**: the capture in the next step's metadata, read in ``wait_for_save`` (after that
    step's forward) when no order took it first (the channels refused or not connected yet, an order
    lost), or an order's K/V the read-back channel refused; they go with the step's output
    (``build_connector_worker_meta``: ``"step output"``).

  A third path, reading the step's captures when vLLM binds its metadata (before the forward) and
  sending them on the read-back channel (``"next step"``), was removed: measured with ``hf-kvshare
  bench serve`` (FullShared, 2 QPS, four runs with and without it; docs/architecture.md, "Serving on
  vLLM") it only caught the 4-6 of 32 requests whose order's thread had not started yet, later than
  the order path takes its own (p50 0.36-0.43 s against 0.17-0.18 s), and no read-back or TTFT
  quantile moved beyond the runs' spread without it.

Two threads touch this object (the engine's step and the order thread): the sets of requests read,
sent and taken are shared under one lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from . import channel, paged
from .connector_common import Capture, Captured, HFKVShareMetadata
from .host import ServingError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("hf_kvshare.serving")

#: request ids the worker remembers having read back (an order arriving after the step's own read of
#: the same request is then ignored, never read from blocks vLLM may have freed)
TAKEN_MAX = 4096
#: where read-back K/V go: the store, the method's state and its plans are in host memory on every device
STORE_DEVICE = torch.device("cpu")


class HFKVShareWorker:
    """The worker side of :class:`~hf_kvshare.serving.connector.HFKVShareConnector` (see the module
    docstring)."""

    def __init__(self, vllm_config: VllmConfig):
        self._vllm_config = vllm_config
        self._block_size = vllm_config.cache_config.block_size
        self._io: dict[str, paged.LayerIO] = {}
        self._layer_of: dict[str, int] = {}
        self._captured: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._sent: set[str] = set()
        self._sent_on_channel: set[str] = set()
        self._sender: channel.Sender | None = None
        self._sender_address: str | None = None
        self._orders: channel.Orders | None = None
        self._orders_announced = False
        #: request ids read back (or being read), oldest first, at most TAKEN_MAX; with the sets above,
        #: shared by the worker's step and its order thread, under this lock
        self._taken: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        layers = self._vllm_config.compilation_config.static_forward_context
        self._io = {}
        for name, tensor in kv_caches.items():
            layer = layers.get(name)
            if layer is None:
                raise ServingError(f"hf_kvshare: no attention layer {name!r} in vLLM's forward context")
            # clear errors here, at start-up, for a cache or backend the connector cannot read and write
            # (the reason and what works: paged.open_layer)
            try:
                self._io[name] = paged.open_layer(name, tensor, layer, self._block_size)
            except ValueError as error:
                raise ServingError(f"hf_kvshare: {error}") from error
        self._layer_of = {name: extract_layer_index(name) for name in kv_caches}

    def start_load_kv(self, metadata: HFKVShareMetadata) -> None:
        if metadata.read_back and metadata.read_back != self._sender_address:
            self._connect(metadata.read_back)  # the scheduler's read-back channel, new
        for load in metadata.loads:
            for name, io in self._io.items():
                layer = self._layer_of[name]
                io.write(load.block_ids, load.start, load.keys[layer], load.values[layer])

    def _connect(self, address: str) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender, self._sender_address = None, address
        try:
            self._sender = channel.Sender(address)
        except Exception:  # noqa: BLE001 - read-backs then go with the step's output
            logger.exception("hf_kvshare: connecting the read-back channel %s failed", address)
            return
        if self._orders is None:
            try:
                self._orders = channel.Orders(self._on_order)
            except Exception:  # noqa: BLE001 - read-backs then come with the step's output
                logger.exception("hf_kvshare: no order channel; read-backs come with the step's output")

    def _on_order(self, order: dict[str, Any]) -> None:
        """The scheduler's order (its thread): read a request that just finished back now and send it
        on the read-back channel (the path)."""
        try:
            capture = Capture(
                str(order["request_id"]), [int(b) for b in order["block_ids"]], int(order["tokens"])
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"an order needs request_id, block_ids and tokens; got {order!r}") from error
        self._take(capture, on_channel=True)

    def wait_for_save(self, metadata: HFKVShareMetadata) -> None:
        for capture in metadata.captures:  # the fallback: those no order took, with the step's output
            self._take(capture, on_channel=False)

    def _take(self, capture: Capture, on_channel: bool) -> None:
        """Read a finished request's K/V back, once (the order thread or the step's, whichever comes
        first): through the read-back channel when ``on_channel`` and it takes them, else with the
        step's output (``None`` when reading failed: the request is released, not recorded)."""
        with self._lock:
            if capture.request_id in self._taken:
                return
            self._taken[capture.request_id] = None
            while len(self._taken) > TAKEN_MAX:
                self._taken.popitem(last=False)
        kv = None
        try:
            kv = self._read(capture)
        except Exception:  # noqa: BLE001 - the engine must keep running; the turn is not recorded
            logger.exception("hf_kvshare: reading back request %s failed", capture.request_id)
        sent = (
            on_channel
            and kv is not None
            and self._sender is not None
            and self._sender.send(capture.request_id, *kv, "at finish")
        )
        with self._lock:
            if sent:
                self._sent_on_channel.add(capture.request_id)
            else:
                self._captured[capture.request_id] = kv
            self._sent.add(capture.request_id)  # its blocks may be freed now (get_finished)

    def _read(self, capture: Capture) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's K/V of the capture into one ``[layers, n, kv_heads, head_dim]`` tensor each,
        read straight into it, moved to the store's device at once."""
        names = sorted(self._io, key=self._layer_of.__getitem__)
        first = self._io[names[0]]
        shape = (len(names), capture.tokens, first.heads, first.dim)
        keys = torch.empty(shape, dtype=first.kv_cache.dtype, device=first.kv_cache.device)
        values = torch.empty_like(keys)
        for i, name in enumerate(names):
            self._io[name].read(capture.block_ids, 0, capture.tokens, out=(keys[i], values[i]))
        # the store (and the method's plans) live in host memory
        return keys.to(STORE_DEVICE), values.to(STORE_DEVICE)

    def build_connector_worker_meta(self) -> Captured | None:
        announce = self._orders is not None and not self._orders_announced
        with self._lock:
            if not self._captured and not self._sent_on_channel and not announce:
                return None
            meta = Captured(kv=self._captured, sent=self._sent_on_channel)
            self._captured, self._sent_on_channel = {}, set()
        if announce:
            meta.orders, self._orders_announced = self._orders.address, True
        return meta

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            sent, self._sent = self._sent, set()
        return (sent or None), None

    def shutdown(self) -> None:
        for end in (self._orders, self._sender):
            if end is not None:
                end.close()

"""The connector's worker side (vLLM's worker process): writes claimed K/V into the paged cache before
the forward and reads a finished request's K/V back for its record.

- ``start_load_kv``: each claim is written with the attention backend's own writer (:mod:`.paged`: CPU
  and CUDA backends alike), synchronously, before the forward. The step's metadata carries no K/V: a
  claim's piece is either rows of a request this worker keeps (:mod:`.worker_store`), re-positioned here
  on the cache's device, or K/V the scheduler sent on the order channel under the request id (waited
  for, :data:`PAYLOAD_WAIT_S`). A piece that cannot be written (its rows not kept, its K/V never came)
  is reported as failed blocks (``get_block_ids_with_load_errors``): vLLM recomputes or fails the
  request, never runs on what the blocks held.
- A finished request the scheduler says to keep (the capture's ``keep``) stays in the worker's
  :class:`~.worker_store.DeviceStore`, on the cache's device, after the requests it says to drop; one it
  says not to ship (a value-free method's) goes back as stand-ins only (shapes, no bytes), unless the
  worker could not keep it or it holds NaN / inf (:meth:`HFKVShareWorker._for_scheduler`).
- A finished request's K/V (prompt + output but its last token; its blocks kept until this side says
  they are read, ``get_finished``) are read once, on one path with one fallback:

  - **the path**: the scheduler's order (the order channel's thread, :mod:`.channel`), as the request
    finishes; the K/V go back on the read-back channel (``read_back: "at finish"``), beside the
    engine's next forward;
  - **the fallback**: the capture in the next step's metadata, read in ``wait_for_save`` (after that
    step's forward) when no order took it first (the channels refused or not connected yet, an order
    lost), or an order's K/V the read-back channel refused; they go with the step's output
    (``build_connector_worker_meta``: ``"step output"``).

  At one rank the worker runs in the scheduler's process (vLLM's "uni" executor) and the K/V go back
  by reference on both (:attr:`HFKVShareWorker.in_process`: the channel's in-process handoff), on the
  cache's device, the store's own tensors when it keeps them; across processes (tensor or pipeline
  parallel, ``in_process: false``) they go back in host memory, serialized.

  A third path, reading the step's captures when vLLM binds its metadata (before the forward) and
  sending them on the read-back channel (``"next step"``), was removed: measured with ``hf-kvshare
  bench serve`` (FullShared, 2 QPS, four runs with and without it; docs/architecture.md, "Serving on
  vLLM") it only caught the 4-6 of 32 requests whose order's thread had not started yet, later than
  the order path takes its own (p50 0.36-0.43 s against 0.17-0.18 s), and no read-back or TTFT
  quantile moved beyond the runs' spread without it.

Tensor parallel: vLLM gives each worker rank its slice of the KV heads in its paged cache
(:func:`~.tensor_parallel.kv_head_range`); this side writes that slice of each claim (the claim
carries all heads) and reads back its own heads only, sending its rank with them (the read-back
channel's header, :attr:`Captured.rank`); the scheduler assembles the ranks' read-backs
(:class:`~.tensor_parallel.RankAssembly`).

Worker replicas (:mod:`.replica`; a value-reading method at TP > 1 or PP > 1): this side makes its
rank's tensor-parallel group (its stage's pipeline-parallel group; at both, its stage's tensor-parallel
group too) and its Sharing replica on its KV heads (its stage's layers; at both, its heads of them) at
``register_kv_caches``, hands the op stream (orders
with an ``op``) to it, keeps each read-back for its record op and sends the scheduler stand-ins, writes
a ``from_replica`` claim from its replica's plan (:meth:`HFKVShareWorker._load_from_replica`), and,
on rank 0, publishes the replica's reduced values on the read-back channel for the scheduler's follower.

Pipeline parallel: vLLM registers only the layers of this worker's stage (its paged caches); this side
writes, keeps, re-positions and reads back those layers only, announces them once (with its order
channel: :attr:`Captured.layers`), and the claims' K/V the scheduler sends it are those layers' (the
scheduler routes them, :meth:`RankAssembly.layers <.tensor_parallel.RankAssembly.layers>`).

Two threads touch this object (the engine's step and the order thread): the sets of requests read,
sent and taken are shared under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from . import channel, paged
from .connector_common import Capture, Captured, HFKVShareMetadata, Load, Source, make_sharing
from .host import ServingError, Sharing, skeleton_model
from .replica import DEFAULT_READ_BACK_BYTES, DEFAULT_WAIT_S, Replica, rank_shard, stage_shard, wants_replicas
from .tensor_parallel import kv_head_range, pipeline_parallel_size, tensor_parallel_size, worker_rank
from .worker_store import (
    DEFAULT_DEVICE_STORE_BYTES,
    DEFAULT_PAYLOAD_BYTES,
    DeviceStore,
    PayloadBuffer,
    add_delta,
    stand_ins,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("hf_kvshare.serving")

#: request ids the worker remembers having read back (an order arriving after the step's own read of
#: the same request is then ignored, never read from blocks vLLM may have freed)
TAKEN_MAX = 4096
#: where read-back K/V go when they cross a process boundary (serialized: the channel's bytes, vLLM's
#: step output); in-process (:attr:`HFKVShareWorker.in_process`) they stay on the cache's device
STORE_DEVICE = torch.device("cpu")
#: how long a claim's write waits for K/V the scheduler sent on the order channel (seconds; then its
#: blocks are reported failed)
PAYLOAD_WAIT_S = 10.0


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
        self._listened = False
        #: request ids read back (or being read), oldest first, at most TAKEN_MAX; with the sets above,
        #: shared by the worker's step and its order thread, under this lock
        self._taken: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        #: this worker's rank (:func:`~.tensor_parallel.worker_rank`) and the KV heads ``[start, stop)``
        #: of a claim it writes
        self.rank, self._heads = worker_share(vllm_config)
        extra = dict(
            getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None) or {}
        )
        self.store = DeviceStore(int(extra.get("device_store_bytes", DEFAULT_DEVICE_STORE_BYTES)))
        #: ``in_process`` in ``kv_connector_extra_config`` (default true): ``false`` serializes every
        #: read-back even to a scheduler of this process (for comparison, and as the escape hatch)
        self._handoff = channel.check_in_process(extra.get("in_process", True))
        self._bytes_per_token: int | None = None
        self._names: list[str] = []  # the layers in the store's order
        self._shifter: Any = None  # built from the served model's config at the first re-positioning
        #: claims' K/V from the order channel, by request id, and their correction factors, by
        #: ``("factors", request id)`` (its thread puts, the step takes), by bytes
        self.payloads = PayloadBuffer(extra.get("payload_bytes", DEFAULT_PAYLOAD_BYTES))
        self._load_errors: set[int] = set()
        #: this rank's replica of the method's engine on its KV heads of its stage's layers (:mod:`.replica`;
        #: a value-reading method under tensor or pipeline parallel), made at ``register_kv_caches``;
        #: ``None``: none
        self.replica: Replica | None = None
        self._replica_reported: dict[str, Any] | None = None
        self._extra = extra

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
        self._names = sorted(self._io, key=self._layer_of.__getitem__)
        self._bytes_per_token = sum(
            2 * io.heads * io.dim * io.kv_cache.element_size() for io in self._io.values()
        )
        tp, pp = tensor_parallel_size(self._vllm_config), pipeline_parallel_size(self._vllm_config)
        if wants_replicas(self._extra.get("method"), tp, pp, self._extra):
            head_dim = self._io[self._names[0]].dim
            if pp > 1:
                self.replica = self._make_stage_replica(pp, tp, head_dim)
            else:
                self.replica = self._make_replica(tp, head_dim)

    def _head_share(self, tp: int, head_dim: int) -> tuple[int, int, int, int]:
        """This rank's KV heads ``[start, stop)``, their width (times the head size) and the ranks holding
        each (vLLM's replicated KV heads when the model has fewer than ``tp``)."""
        start, stop = self._heads
        total = self._vllm_config.model_config.get_total_num_kv_heads()
        return start, stop, (stop - start) * head_dim, max(1, tp // total)

    def _make_replica(self, tp: int, head_dim: int) -> Replica:
        """This rank's replica (:mod:`.replica`): its tensor-parallel group made (by every rank, in the
        same order: here, at start-up), the method on its shard of the KV heads."""
        wait_s = float(self._extra.get("replica_wait_s", DEFAULT_WAIT_S))
        start, stop, width, replicas = self._head_share(tp, head_dim)
        publish = self._publish if self.rank == 0 else None  # the leader: its values for the follower
        shard = rank_shard(tp, width, replicas, 2 * wait_s, publish)
        sharing = make_sharing(self._vllm_config, shard=shard, kv_heads=stop - start)
        return self._replica(sharing, wait_s, f"KV heads [{start}, {stop})")

    def _make_stage_replica(self, pp: int, tp: int, head_dim: int) -> Replica:
        """This stage's replica (:mod:`.replica`): its pipeline-parallel group (and at tensor parallel > 1
        its stage's tensor-parallel group) made by every rank, in the same order (here, at start-up), the
        method on its stage's layers (the ones vLLM registered here, which must be consecutive) and at
        tensor parallel > 1 on its KV heads of them, its skeleton those layers' (and heads') config."""
        wait_s = float(self._extra.get("replica_wait_s", DEFAULT_WAIT_S))
        held = [self._layer_of[name] for name in self._names]
        start, stop = held[0], held[-1] + 1
        if held != list(range(start, stop)):
            raise ServingError(
                f"hf_kvshare: a pipeline stage's layers must be consecutive; this worker holds {held}"
            )
        layers = self._vllm_config.model_config.hf_config.get_text_config().num_hidden_layers
        # stage 0's first rank, the leader: its values for the follower
        publish = self._publish if self.rank == 0 else None
        part = f"layers [{start}, {stop}) of {layers}"
        if tp == 1:
            shard = stage_shard(pp, start, stop, layers, 2 * wait_s, publish)
            sharing = make_sharing(self._vllm_config, shard=shard, layers=(start, stop))
            return self._replica(sharing, wait_s, part)
        first, last, width, replicas = self._head_share(tp, head_dim)
        shard = stage_shard(
            pp, start, stop, layers, 2 * wait_s, publish, tp_size=tp, width=width, replicas=replicas
        )
        sharing = make_sharing(self._vllm_config, shard=shard, kv_heads=last - first, layers=(start, stop))
        return self._replica(sharing, wait_s, f"KV heads [{first}, {last}) of {part}")

    def _replica(self, sharing: Sharing, wait_s: float, part: str) -> Replica:
        """The :class:`Replica` of ``sharing`` (on this rank's ``part`` of the model), said at start-up."""
        logger.info("hf_kvshare: rank %d runs a replica of %s on %s", self.rank, sharing.method, part)
        return Replica(
            sharing,
            wait_s=wait_s,
            max_bytes=self._extra.get("replica_read_back_bytes", DEFAULT_READ_BACK_BYTES),
        )

    def start_load_kv(self, metadata: HFKVShareMetadata) -> None:
        if metadata.read_back and metadata.read_back != self._sender_address:
            self._connect(metadata.read_back)  # the scheduler's read-back channel, new
        elif not self._listened:
            self._listen()  # no read-back channel (inline admission): the order channel still brings K/V
        for load in metadata.loads:
            try:
                written = self._load(load)
            except Exception:  # noqa: BLE001 - the engine must keep running; vLLM recomputes or fails it
                logger.exception("hf_kvshare: writing the claim of request %s failed", load.request_id)
                written = False
            if not written:
                first = load.start // self._block_size
                last = (load.start + load.tokens - 1) // self._block_size
                self._load_errors.update(load.block_ids[first : last + 1])
        self.store.drop(metadata.drops)

    def _load(self, load: Load) -> bool:
        """Write one claim: each kept source's rows (keys re-positioned here, a corrected one's delta
        added here: :func:`~.worker_store.add_delta`) and the K/V the order channel brought; ``False`` when
        a piece is missing (nothing is written from anything else)."""
        if load.from_replica:
            return self._load_from_replica(load)
        pieces = []
        factors = None
        if any(source.correction is not None for source in load.sources):
            factors, missing = self.payloads.take(("factors", load.request_id), PAYLOAD_WAIT_S)
            if factors is None:
                logger.error("hf_kvshare: request %s's correction factors %s", load.request_id, missing)
                return False
        for source in load.sources:
            kept = self.store.get(source.request_id)
            if kept is None or source.row + source.n > kept[0].shape[1]:
                logger.error(
                    "hf_kvshare: request %s's claim references rows of %s, which this worker does not keep",
                    load.request_id,
                    source.request_id,
                )
                return False
            rows = slice(source.row, source.row + source.n)
            rotation = None
            if source.src_start != source.dst_start:
                rotation = self.shifter.rotation(source.src_start, source.dst_start, source.n)
            pieces.append(
                (source.offset, kept[0][:, rows], kept[1][:, rows], rotation, self._delta(source, factors))
            )
        if load.payload:
            kv, missing = self.payloads.take(load.request_id, PAYLOAD_WAIT_S)
            if kv is None:
                logger.error("hf_kvshare: request %s's claimed K/V %s", load.request_id, missing)
                return False
            at = 0
            for lo, hi in load.payload:
                keys, values = (
                    self.own_heads(kv[0][:, at : at + hi - lo]),
                    self.own_heads(kv[1][:, at : at + hi - lo]),
                )
                pieces.append((lo, keys, values, None, None))
                at += hi - lo
            if kv[0].shape[0] != len(self._names):  # the scheduler sends this worker's layers only
                logger.error(
                    "hf_kvshare: request %s's claimed K/V came with %d layers; this worker holds %d",
                    load.request_id,
                    kv[0].shape[0],
                    len(self._names),
                )
                return False
        for offset, keys, values, rotation, delta in pieces:
            for i, name in enumerate(self._names):
                key, value, layer = keys[i], values[i], self._layer_of[name]
                if rotation is not None:  # [n, heads, dim] as the shifter's [1, heads, n, dim]
                    moved = self.shifter.apply(key.transpose(0, 1)[None], rotation, layer=layer)
                    key = moved[0].transpose(0, 1)
                if delta is not None and delta[0][layer] is not None:
                    key, value = add_delta(
                        key, value, delta[0][layer], delta[1], self.shifter, layer, self._heads
                    )
                self._io[name].write(load.block_ids, load.start + offset, key, value)
        return True

    def _publish(self, value: torch.Tensor) -> None:
        """The leader replica's reduced value to the scheduler's follower, on the read-back channel (its
        thread; a full channel retried for up to :data:`PAYLOAD_WAIT_S`: the follower waits for it)."""
        deadline = time.monotonic() + PAYLOAD_WAIT_S
        while True:
            sender = self._sender
            if sender is not None and sender.send_tensors("", "published", [value]):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the leader replica's value could not be sent to the scheduler")
            time.sleep(0.001)

    def _load_from_replica(self, load: Load) -> bool:
        """Write the claim this rank's replica decided (:mod:`.replica`: its heads of the claimed K/V, on
        this rank's device; nothing came on a channel): ``False`` when it has none, it stopped, or its
        claim starts elsewhere or is shorter than the scheduler's."""
        if self.replica is None:
            claim, missing = None, "no replica on this rank"
        else:
            claim, missing = self.replica.claim_of(load.request_id, PAYLOAD_WAIT_S)
        if claim is None:
            logger.error("hf_kvshare: request %s's claim from the replica: %s", load.request_id, missing)
            return False
        start, keys, values = claim
        if start != load.start or keys is None or keys.shape[1] < load.tokens:
            logger.error(
                "hf_kvshare: request %s: this rank's replica claims %s positions from %d, the scheduler %d "
                "from %d: vLLM recomputes them",
                load.request_id,
                0 if keys is None else keys.shape[1],
                start,
                load.tokens,
                load.start,
            )
            return False
        for i, name in enumerate(self._names):
            self._io[name].write(load.block_ids, load.start, keys[i, : load.tokens], values[i, : load.tokens])
        return True

    def _delta(self, source: Source, factors: list[torch.Tensor] | None) -> tuple[list, Any] | None:
        """A corrected source's delta: per layer ``((a_k, b_k), (a_v, b_v))`` (``None``: uncorrected) from
        the request's factors message, and the rotation of its keys (``None``: added as is)."""
        correction = source.correction
        if correction is None or factors is None:
            return None
        layers = []
        for at in range(correction.first, correction.first + 4 * correction.layers, 4):
            a_k, b_k, a_v, b_v = factors[at : at + 4]
            layers.append(None if a_k.numel() == 0 else ((a_k, b_k), (a_v, b_v)))
        rotation = None
        if correction.delta_from is not None and correction.delta_from != source.dst_start:
            rotation = self.shifter.rotation(correction.delta_from, source.dst_start, correction.rows)
        return layers, rotation

    @property
    def shifter(self) -> Any:
        """The served model's RoPE re-positioning (:class:`~hf_kvshare.rope.RopeShifter`, from its
        config: the scheduler's, so the keys move exactly as its placements did)."""
        if self._shifter is None:
            from ..rope import RopeShifter

            self._shifter = RopeShifter.from_model(skeleton_model(self._vllm_config.model_config.model))
        return self._shifter

    def _on_payload(
        self, request_id: str, keys: torch.Tensor, values: torch.Tensor, via: str, rank: int = 0
    ) -> None:
        """A claim's K/V from the order channel (its thread), for the step that writes them."""
        self._hold(request_id, keys, values)

    def _on_tensors(self, request_id: str, kind: str, tensors: list[torch.Tensor]) -> None:
        """A claim's tensors from the order channel (its thread; ``"factors"``: a corrected claim's)."""
        self._hold((kind, request_id), *tensors)

    def _hold(self, key: Any, *tensors: torch.Tensor) -> None:
        """Keep what the order channel brought for the step that writes it; what the payload budget
        drops is logged (its claim's blocks are then reported failed)."""
        for dropped in self.payloads.put(key, *tensors):
            kind, request_id = dropped if isinstance(dropped, tuple) else ("claimed K/V", dropped)
            logger.error(
                "hf_kvshare: request %s's %s dropped past the worker's payload budget (%d bytes; "
                "payload_bytes in kv_connector_extra_config): vLLM recomputes them",
                request_id,
                kind,
                self.payloads.max_bytes,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def own_heads(self, kv: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads of a claim's ``[layers, n, kv_heads, head_dim]`` K/V (all of them at
        one rank)."""
        if self._heads is None:
            return kv
        start, stop = self._heads
        return kv[:, :, start:stop]

    def _connect(self, address: str) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender, self._sender_address = None, address
        try:
            self._sender = channel.Sender(address, in_process=self._handoff)
        except Exception:  # noqa: BLE001 - read-backs then go with the step's output
            logger.exception("hf_kvshare: connecting the read-back channel %s failed", address)
            return
        self._listen()

    def _listen(self) -> None:
        if self._listened:
            return
        self._listened = True  # tried once
        try:
            self._orders = channel.Orders(self._on_order, self._on_payload, self._on_tensors)
        except Exception:  # noqa: BLE001 - read-backs then come with the step's output
            logger.exception("hf_kvshare: no order channel; read-backs come with the step's output")

    def _on_order(self, order: dict[str, Any]) -> None:
        """The scheduler's order (its thread): an op of the replicas' stream (:mod:`.replica`), or read a
        request that just finished back now and send it on the read-back channel (the path)."""
        if "op" in order:
            if self.replica is not None:
                self.replica.submit(order)
            return
        try:
            capture = Capture(
                str(order["request_id"]),
                [int(b) for b in order["block_ids"]],
                int(order["tokens"]),
                bool(order.get("keep", False)),
                [str(r) for r in order.get("drop", ())],
                bool(order.get("ship", True)),
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
        self.store.drop(capture.drop)  # room for it, as the scheduler's mirror decided
        if kv is not None and self.replica is not None:  # the rank's heads, for its replica's record op
            self.replica.keep(capture.request_id, *kv)
        if kv is not None:
            kept = capture.keep and self.store.keep(capture.request_id, *kv)
            kv = self._for_scheduler(capture, kv, kept)
        sent = (
            on_channel
            and kv is not None
            and self._sender is not None
            and self._sender.send(capture.request_id, *kv, "at finish", rank=self.rank)
        )
        with self._lock:
            if sent:
                self._sent_on_channel.add(capture.request_id)
            else:
                self._captured[capture.request_id] = kv
            self._sent.add(capture.request_id)  # its blocks may be freed now (get_finished)

    @property
    def in_process(self) -> bool:
        """Whether this worker runs in the scheduler's process (vLLM's "uni" executor: one rank) and
        hands it the K/V by reference: its read-back channel is in-process (:class:`~.channel.Sender`);
        vLLM's step output then does not leave the process either."""
        return self._sender is not None and self._sender.in_process

    def _for_scheduler(
        self, capture: Capture, kv: tuple[torch.Tensor, torch.Tensor], kept: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What goes back for the record: stand-ins when the capture says not to ship the K/V and this
        rank's replica records them, or (a value-free method's) the worker keeps them as ordered and they
        hold no NaN / inf (checked here, on the device); else the K/V (the scheduler's record checks them): in-process as read, on
        the cache's device (the very tensors the store keeps when it keeps them: one copy, which the
        record only reads), else in host memory."""
        if not capture.ship and (
            self.replica is not None  # the replica records them: the scheduler follows
            or (kept == capture.keep and all(bool(torch.isfinite(t).all()) for t in kv))
        ):
            return stand_ins(*kv)
        if self.in_process:
            return kv
        return kv[0].to(STORE_DEVICE), kv[1].to(STORE_DEVICE)

    def _read(self, capture: Capture) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's K/V of the capture into one ``[layers, n, kv_heads, head_dim]`` tensor each,
        read straight into it, on the cache's device (:meth:`_for_scheduler` moves what goes back)."""
        names = self._names or sorted(self._io, key=self._layer_of.__getitem__)
        first = self._io[names[0]]
        shape = (len(names), capture.tokens, first.heads, first.dim)
        keys = torch.empty(shape, dtype=first.kv_cache.dtype, device=first.kv_cache.device)
        values = torch.empty_like(keys)
        for i, name in enumerate(names):
            self._io[name].read(capture.block_ids, 0, capture.tokens, out=(keys[i], values[i]))
        return keys, values

    def build_connector_worker_meta(self) -> Captured | None:
        announce = self._orders is not None and not self._orders_announced
        with self._lock:
            counts = dict(self.replica.counts) if self.replica is not None else None
            fresh = counts != self._replica_reported  # the replica's counts moved: reported
            if not self._captured and not self._sent_on_channel and not announce and not fresh:
                return None
            meta = Captured(kv=self._captured, sent=self._sent_on_channel, rank=self.rank, replica=counts)
            self._replica_reported = counts
            self._captured, self._sent_on_channel = {}, set()
        if announce:
            meta.orders, self._orders_announced = self._orders.address, True
            meta.bytes_per_token = self._bytes_per_token
            meta.layers = self.layers
        return meta

    @property
    def layers(self) -> list[int]:
        """The layers (their indices in the model) this worker holds: all of them, or its pipeline
        stage's."""
        return [self._layer_of[name] for name in self._names]

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            sent, self._sent = self._sent, set()
        return (sent or None), None

    def shutdown(self) -> None:
        for end in (self._orders, self._sender):
            if end is not None:
                end.close()
        if self.replica is not None:
            self.replica.close()


def worker_share(vllm_config: VllmConfig) -> tuple[int, tuple[int, int] | None]:
    """This worker's rank among vLLM's workers (:func:`~.tensor_parallel.worker_rank`: its pipeline
    stage and tensor-parallel rank) and its KV heads ``[start, stop)`` (``None``: all, one
    tensor-parallel rank), from vLLM's parallel groups (rank 0 with all heads: one worker)."""
    tp, pp = tensor_parallel_size(vllm_config), pipeline_parallel_size(vllm_config)
    if tp == 1 and pp == 1:
        return 0, None
    from vllm.distributed import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    pp_rank = parallel_state.get_pp_group().rank_in_group if pp > 1 else 0
    heads = kv_head_range(tp_rank, tp, vllm_config.model_config.get_total_num_kv_heads()) if tp > 1 else None
    return worker_rank(tp_rank, pp_rank, tp), heads


#: the name this function had under tensor parallel alone
tensor_parallel_share = worker_share

"""vLLM KV connector: agents of one multi-agent task share K/V of common segments inside a stock vLLM.

Loaded out of tree (no patch of vLLM)::

    KVTransferConfig(
        kv_connector="HFKVShareConnector",
        kv_connector_module_path="hf_kvshare.serving.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"method": "fullshared", "options": {"prefix_reuse": True},
                                   "max_bytes": 2 << 30, "max_tasks": 1024},
    )

``hf-kvshare serve`` sets this up (:mod:`.server`). What each hook does:

- ``get_num_new_matched_tokens`` (scheduler, at admission): :meth:`Sharing.plan
  <hf_kvshare.serving.host.Sharing.plan>` runs the method's contract on the request's layout
  (:mod:`.layout`) and claims the longest placed range that starts at vLLM's own (block-aligned)
  prefix-cache hit, the only shape vLLM accepts (one contiguous range per request). The plan is
  decided on the connector's background thread (:mod:`.admission`); until it is, the hook answers
  ``None`` (vLLM's "not decided yet": the request is skipped this step and asked again), so a KVCMAS
  correction never stops the other requests. ``"background": false`` in ``kv_connector_extra_config``
  (``--inline-admission``) decides inline.
- ``update_state_after_alloc`` / ``build_connector_meta``: the claimed K/V and the request's block ids
  go to the worker in the step's metadata.
- ``start_load_kv`` (worker, before the forward): writes them with the attention backend's own
  writer (:mod:`.paged`: CPU and CUDA backends alike), synchronously.
- ``request_finished`` (scheduler, before the blocks are freed): a finished request keeps its blocks
  (``delay_free``) until the worker has read back the K/V it used (prompt + output but its last token,
  into host memory, where the store is, on any device). The scheduler orders the read-back at once on
  the order channel (:mod:`.channel`); the worker's order thread reads the blocks and sends the K/V on
  the read-back channel, and the connector's channel thread in the scheduler's process queues the
  turn's record (slots, ``method.record``, on the same background thread, behind the plans asked for
  before it) while the engine goes on. A request no order reached is read when vLLM binds the next
  step's metadata (``bind_connector_metadata``, before its forward), once whichever comes first.
  Without the channels (refused, full, ``"read_back_channel": false``; always with inline admission)
  it is read in ``wait_for_save`` and comes back in ``build_connector_worker_meta``, and
  ``update_connector_output`` queues the record after the next step. Then the blocks are freed
  (``get_finished``). ``has_pending_push_work`` keeps the engine stepping until then. A report line
  says how a request's K/V came (``read_back``: ``"at finish"``, ``"next step"``, ``"step output"``)
  and how long after its end its record was queued (``read_back_s``). One worker (tensor and
  pipeline parallel size 1) and one KV cache group are supported; more are refused at start-up, as is
  a cache :mod:`.paged` cannot read (MLA, quantized).

Each finished request's report (what admission decided: the claim, its PH / PF tokens, each span's
placement; :meth:`Plan.report <hf_kvshare.serving.host.Plan.report>`) is the reply's
``kv_transfer_params["hf_kvshare"]`` (non-streaming replies: vLLM's streaming chat path drops
``kv_transfer_params``) and, with ``report_path`` in ``kv_connector_extra_config`` (or the environment
variable :data:`REPORTS_ENV`), one JSON line of that file, written once the request is recorded (so
each dense span carries its gate outcome too: why it was not reused), with vLLM's request ids (``request_id``,
and ``external_id``: the id the OpenAI server made from the client's ``request_id``), which is how
``hf-kvshare bench serve`` reads them for streamed requests.

The per-method ``cache_salt`` (``hf_kvshare.serving.host.salt``) is set on each request by the server's
middleware (:mod:`.middleware`): injected blocks enter vLLM's prefix cache under the plain token hashes
of their salt, so approximate K/V never serve another method or a plain request.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from . import channel, paged
from .admission import DEFAULT_RUNNING_WAIT_S, DEFAULT_WAIT_S, Background, task_of
from .host import Plan, ServingError, Sharing, skeleton_model

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("hf_kvshare.serving")

#: environment variable naming the JSONL file each finished request's report is appended to
REPORTS_ENV = "HF_KVSHARE_REPORTS"
#: the store summary's counts each report line of that file carries
STORE_COUNTS = ("bytes", "max_bytes", "tasks", "evicted_tasks", "dropped_slot_kv", "queued_jobs", "settles")
#: how long the scheduler waits, at the end of a step, for a read-back the worker says it sent
#: through the channel and that has not arrived yet (seconds; then the request is not recorded)
READ_BACK_WAIT_S = 5.0
#: request ids the worker remembers having read back (an order arriving after the step's own read of
#: the same request is then ignored, never read from blocks vLLM may have freed)
TAKEN_MAX = 4096
#: where read-back K/V go: the store, the method's state and its plans are in host memory on every device
STORE_DEVICE = torch.device("cpu")


@dataclass
class Load:
    """Claimed K/V to write before the request's first forward."""

    request_id: str
    block_ids: list[int]
    start: int
    keys: torch.Tensor  # [layers, n, kv_heads, head_dim]: one buffer to the worker (Plan.keys)
    values: torch.Tensor


@dataclass
class Capture:
    """A finished request's K/V to read back: positions ``[0, tokens)`` of its blocks."""

    request_id: str
    block_ids: list[int]
    tokens: int


@dataclass
class HFKVShareMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)
    #: the scheduler's read-back channel (:mod:`.channel`), ``None`` without one: the worker connects
    #: to it when it first sees it and sends each capture through it before the step's forward
    read_back: str | None = None


@dataclass
class Captured(KVConnectorWorkerMetadata):
    """K/V read back by the worker: request id -> (keys, values), ``[layers, n, kv_heads, head_dim]``
    each (one buffer apiece back to the scheduler; ``None`` when reading failed)."""

    kv: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=dict)
    #: requests whose K/V went through the read-back channel instead (the scheduler waits for them)
    sent: set[str] = field(default_factory=set)
    #: the worker's order channel (:mod:`.channel`), once: the scheduler orders read-backs there
    orders: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, Captured):
            self.kv.update(other.kv)
            self.sent |= other.sent
            self.orders = self.orders or other.orders
        return self


@dataclass
class _Finishing:
    plan: Plan
    output_ids: list[int]
    stop_ids: set[int]
    ids: tuple[str, str | None]  # the request's id and external id (its report line)
    finished_at: float = 0.0  # time.perf_counter() at request_finished (the report's read_back_s)


_LOCK = threading.Lock()
_SHARING: dict[str, Sharing] = {}


def current_sharing() -> Sharing | None:
    """The :class:`Sharing` service of this engine process (one per process; tests and reports)."""
    return next(iter(_SHARING.values()), None)


class HFKVShareConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ServingError(
                "hf_kvshare's connector supports one worker (tensor_parallel_size = pipeline_parallel_size = 1); "
                f"got {parallel.tensor_parallel_size} x {parallel.pipeline_parallel_size}"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ServingError(
                "hf_kvshare's connector supports models whose layers share one KV cache group (one block "
                f"table per request); this model has {len(groups)} (sliding-window / hybrid layers)"
            )
        self._block_size = vllm_config.cache_config.block_size
        self._extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        # scheduler side
        self._plans: dict[str, Plan] = {}
        self._loads: dict[str, Load] = {}
        self._to_capture: list[Capture] = []
        #: finished requests waiting for their K/V (read back by the worker); the read-back channel's
        #: thread takes them too, so every access holds this condition's (re-entrant) lock, as do
        #: those of the requests waiting for them
        self._finishing: dict[str, _Finishing] = {}
        self._finishing_cond = threading.Condition(threading.RLock())
        #: requests that arrived while their task had a finished request not yet recorded: planned as soon
        #: as that record is queued (by the channel's thread when it brings the K/V, or at the step's
        #: end), not a step later at their next admission
        self._waiting: dict[str, tuple[Request, float]] = {}
        #: seconds each such request waited before its plan could start (its report's record_wait_s)
        self._record_waits: dict[str, float] = {}
        self._receiver: channel.Receiver | None = None
        self._order_sender: channel.Sender | None = None
        # worker side
        self._io: dict[str, paged.LayerIO] = {}
        self._layer_of: dict[str, int] = {}
        self._captured: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]] | None] = {}
        self._sent: set[str] = set()
        self._sent_on_channel: set[str] = set()
        self._sender: channel.Sender | None = None
        self._sender_address: str | None = None
        self._orders: channel.Orders | None = None
        self._orders_announced = False
        #: request ids read back (or being read), oldest first, at most TAKEN_MAX; with the sets above,
        #: shared by the worker's step and its order thread, under this lock
        self._taken: OrderedDict[str, None] = OrderedDict()
        self._worker_lock = threading.Lock()
        self._report_path = self._extra.get("report_path") or os.environ.get(REPORTS_ENV) or None
        if role == KVConnectorRole.SCHEDULER:
            key = str(vllm_config.kv_transfer_config.engine_id)
            with _LOCK:
                if key not in _SHARING:
                    _SHARING[key] = self._make_sharing(vllm_config)
                self._sharing = _SHARING[key]
            self._background = Background(
                self._sharing,
                enabled=self._extra.get("background", True),
                wait_s=self._extra.get("plan_wait_s", DEFAULT_WAIT_S),
                running_wait_s=self._extra.get("plan_running_wait_s", DEFAULT_RUNNING_WAIT_S),
            )
            read_back = self._extra.get("read_back_channel", True)
            if not isinstance(read_back, bool):
                raise ServingError(f"hf_kvshare: read_back_channel must be true or false; got {read_back!r}")
            # inline admission records on the engine loop: its read-backs keep the step's output path
            if read_back and self._background.enabled:
                try:
                    self._receiver = channel.Receiver(self._on_read_back)
                except Exception:  # noqa: BLE001 - serving works without it (the step's output path)
                    logger.exception(
                        "hf_kvshare: no read-back channel; read-backs come with the step's output"
                    )

    def _make_sharing(self, vllm_config: VllmConfig) -> Sharing:
        from transformers import AutoTokenizer

        model_config = vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer or model_config.model)
        options = dict(self._extra.get("options") or {})
        sharing = Sharing(
            skeleton_model(model_config.model),
            tokenizer,
            self._extra.get("method", "nonshared"),
            max_bytes=int(self._extra.get("max_bytes", 2 << 30)),
            max_tasks=int(self._extra.get("max_tasks", 1024)),
            min_segment_tokens=int(self._extra.get("min_segment_tokens", 16)),
            **options,
        )
        logger.info("hf_kvshare: serving method %r (cache_salt %r)", sharing.method, sharing.salt)
        return sharing

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        layers = self._vllm_config.compilation_config.static_forward_context
        self._io = {}
        for name, tensor in kv_caches.items():
            layer = layers.get(name)
            if layer is None:
                raise ServingError(f"hf_kvshare: no attention layer {name!r} in vLLM's forward context")
            # clear errors here, at start-up, for a cache or backend the connector cannot read and write
            try:
                self._io[name] = paged.LayerIO(name, tensor, paged.backend_writer(layer), self._block_size)
            except ValueError as error:
                raise ServingError(f"hf_kvshare: {error}") from error
        self._layer_of = {name: extract_layer_index(name) for name in kv_caches}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, HFKVShareMetadata):
            return
        for load in metadata.loads:
            for name, io in self._io.items():
                layer = self._layer_of[name]
                io.write(load.block_ids, load.start, load.keys[layer], load.values[layer])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, HFKVShareMetadata):
            return
        if connector_metadata.read_back and connector_metadata.read_back != self._sender_address:
            self._connect(connector_metadata.read_back)
        if self._sender is not None:
            # before the step's forward (vLLM binds the metadata first): the record runs beside it;
            # a request the order thread took already is skipped
            for capture in connector_metadata.captures:
                self._take(capture, "next step")

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
            except Exception:  # noqa: BLE001 - read-backs then wait for the next step
                logger.exception("hf_kvshare: no order channel; read-backs wait for the next step")

    def _on_order(self, order: dict[str, Any]) -> None:
        """The scheduler's order (its thread): read a request that just finished back now."""
        try:
            capture = Capture(
                str(order["request_id"]), [int(b) for b in order["block_ids"]], int(order["tokens"])
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"an order needs request_id, block_ids and tokens; got {order!r}") from error
        self._take(capture, "at finish")

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, HFKVShareMetadata):
            return
        for capture in metadata.captures:  # those not taken before the forward
            self._take(capture, "next step")

    def _take(self, capture: Capture, via: str) -> None:
        """Read a finished request's K/V back, once (the step's thread or the order thread, whichever
        comes first): through the read-back channel when it takes them, else with the step's output
        (``None`` when reading failed: the request is released, not recorded)."""
        with self._worker_lock:
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
        sent = kv is not None and self._sender is not None and self._sender.send(capture.request_id, *kv, via)
        with self._worker_lock:
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

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        announce = self._orders is not None and not self._orders_announced
        with self._worker_lock:
            if not self._captured and not self._sent_on_channel and not announce:
                return None
            meta = Captured(kv=self._captured, sent=self._sent_on_channel)
            self._captured, self._sent_on_channel = {}, set()
        if announce:
            meta.orders, self._orders_announced = self._orders.address, True
        return meta

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._worker_lock:
            sent, self._sent = self._sent, set()
        return (sent or None), None

    # ============================================================= scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        old = self._plans.get(request.request_id)
        if old is not None:
            if old.local_hit == num_computed_tokens:
                return old.claimed, False
            del self._plans[request.request_id]
            self._background.release(old)
        if not self._background.deciding(request.request_id) and self._waits_for_record(request):
            # an earlier request of this task finished but its K/V is not read back yet: its record
            # comes first, or this plan would not see the output it reads
            return None, False
        prompt = list(request.prompt_token_ids or [])
        plan = self._background.plan(
            request.request_id, prompt, request.kv_transfer_params, num_computed_tokens
        )
        if plan is None:  # still being decided off the engine loop: vLLM skips the request and asks again
            return None, False
        if plan.error:
            logger.warning("hf_kvshare: request %s: no claim (%s)", request.request_id, plan.error)
        plan.record_wait_s = self._record_waits.pop(request.request_id, None)
        self._plans[request.request_id] = plan
        return plan.claimed, False

    def _unrecorded(self, task: str | None) -> bool:
        """Whether a finished request of ``task`` waits to be read back and recorded."""
        if task is None:
            return False
        with self._finishing_cond:
            return any(f.plan.host is not None and f.plan.host.task == task for f in self._finishing.values())

    def _waits_for_record(self, request: Request) -> bool:
        """Whether a finished request of ``request``'s task waits to be recorded; if so ``request``
        waits for it (checked and noted under the lock the channel's thread takes to record)."""
        with self._finishing_cond:
            if not self._unrecorded(task_of(request.kv_transfer_params)):
                self._waiting.pop(request.request_id, None)  # planned now: never again from the list
                return False
            if request.request_id not in self._waiting:
                self._waiting[request.request_id] = (request, time.perf_counter())
            return True

    def _ready(self) -> list[Request]:
        """The waiting requests whose task has no unrecorded request left (taken off the waiting list;
        under the lock)."""
        ready = []
        with self._finishing_cond:
            for request_id, (request, since) in list(self._waiting.items()):
                if not self._unrecorded(task_of(request.kv_transfer_params)):
                    del self._waiting[request_id]
                    self._record_waits[request_id] = time.perf_counter() - since
                    ready.append(request)
        return ready

    def _prepare(self, requests: list[Request]) -> None:
        for request in requests:  # planned behind the records queued before (the task's queue order)
            self._background.prepare(
                request.request_id, list(request.prompt_token_ids or []), request.kv_transfer_params
            )

    def on_new_request(self, request: Request) -> None:
        # plan ahead while the engine finishes its step (not when an earlier request of the task still
        # waits to be read back: that request's record must come first; it is planned then)
        if not self._waits_for_record(request):
            self._prepare([request])

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        if num_external_tokens != plan.claimed:  # vLLM took less (prompt_logprobs, a local partial block)
            keep = max(0, min(num_external_tokens, plan.claimed))
            plan.claim_end = plan.claim_start + keep
            plan.keys = plan.keys[:, :keep] if keep else []
            plan.values = plan.values[:, :keep] if keep else []
        if plan.claimed:
            self._loads[request.request_id] = Load(
                request.request_id, [], plan.claim_start, plan.keys, plan.values
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HFKVShareMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            load = self._loads.pop(new.req_id, None)
            if load is not None:
                load.block_ids = list(new.block_ids[0])
                meta.loads.append(load)
        meta.captures, self._to_capture = self._to_capture, []
        meta.read_back = self._receiver.address if self._receiver is not None else None
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._loads.pop(request.request_id, None)
        with self._finishing_cond:  # the channel's thread may be planning it (a waiting request)
            self._waiting.pop(request.request_id, None)
            self._background.forget(request.request_id)  # a plan being decided is released when done
        self._record_waits.pop(request.request_id, None)
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            return False, None
        report = {"hf_kvshare": {**plan.report(), "store": self._background.summary()}}
        ids = (request.request_id, getattr(request, "external_req_id", None))
        finished = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        if plan.turn is None or not finished or not block_ids:
            if self._report_path:
                self._write_report(ids, report["hf_kvshare"])
            self._background.release(plan)
            return False, report
        stop = set(request.sampling_params.all_stop_token_ids or ()) if request.sampling_params else set()
        eos = getattr(request.sampling_params, "eos_token_id", None) if request.sampling_params else None
        if eos is not None:
            stop.add(eos)
        tokens = min(request.num_computed_tokens, len(block_ids) * self._block_size)
        # the report file's line is written once the request is recorded: a dense span's gate outcome
        # (why it was not reused) is known then (the reply carries the admission's report)
        with self._finishing_cond:
            self._finishing[request.request_id] = _Finishing(
                plan, list(request.output_token_ids), stop, ids, time.perf_counter()
            )
        capture = Capture(request.request_id, list(block_ids), tokens)
        self._to_capture.append(capture)  # the next step's metadata, unless the worker took it already
        if self._order_sender is not None:  # read back now, not at the next step
            self._order_sender.order(asdict(capture))
        return True, report  # the blocks stay until the worker has read them (get_finished)

    def _reporter(self, ids: tuple[str, str | None]):
        """What runs after the request's record: its report file line (``None`` without a file)."""
        if not self._report_path:
            return None

        def write(plan: Plan) -> None:
            self._write_report(ids, {**plan.report(), "store": self._background.summary()})

        return write

    def _write_report(self, ids: tuple[str, str | None], report: dict[str, Any]) -> None:
        store = report.get("store", {})
        line = {
            "request_id": ids[0],
            "external_id": ids[1],
            **{k: v for k, v in report.items() if k != "store"},
            # the store's counts when the request ended (its bound's evictions explain a claim missing),
            # and the bytes the method keeps across requests (KVCMAS's anchor pools, kept prefixes)
            "store": {
                **{k: store.get(k) for k in STORE_COUNTS},
                "method_bytes": (store.get("method_state") or {}).get("bytes"),
            },
        }
        try:
            with open(self._report_path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:  # the engine must keep running
            logger.exception("hf_kvshare: writing the report of request %s failed", ids[0])

    def _on_read_back(self, request_id: str, keys: torch.Tensor, values: torch.Tensor, via: str) -> None:
        """A read-back from the channel (its thread), while the engine goes on: the request's record is
        queued now, not after the step."""
        with self._finishing_cond:
            finishing = self._finishing.pop(request_id, None)
            if finishing is not None:  # else given up on (update_connector_output): dropped
                # queued under the lock: whoever sees the request gone sees its record queued first
                self._record(finishing, (keys, values), via or "next step")
                # the requests that waited for it: planned now, behind it (under the lock, so a request
                # ending meanwhile is forgotten after its plan is queued, never before)
                self._prepare(self._ready())
            self._finishing_cond.notify_all()

    def _record(self, finishing: _Finishing, kv: tuple[torch.Tensor, torch.Tensor] | None, how: str) -> None:
        then = self._reporter(finishing.ids)
        plan = finishing.plan
        plan.read_back = how
        plan.read_back_s = time.perf_counter() - finishing.finished_at
        if kv is None:
            self._background.release(plan, then)
        else:
            self._background.record(plan, kv[0], kv[1], finishing.output_ids, finishing.stop_ids, then)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        captured = meta.kv if isinstance(meta, Captured) else {}
        on_channel = meta.sent if isinstance(meta, Captured) else set()
        if (
            isinstance(meta, Captured)
            and meta.orders
            and self._order_sender is None
            and self._receiver is not None
        ):
            try:
                self._order_sender = channel.Sender(meta.orders)
            except Exception:  # noqa: BLE001 - read-backs then wait for the next step
                logger.exception("hf_kvshare: connecting the order channel %s failed", meta.orders)
        for request_id in set(captured) | on_channel | set(connector_output.finished_sending or ()):
            with self._finishing_cond:
                if request_id in on_channel:
                    # sent on the channel before the worker's output was built: here already, or soon
                    self._finishing_cond.wait_for(
                        lambda rid=request_id: rid not in self._finishing, READ_BACK_WAIT_S
                    )
                finishing = self._finishing.pop(request_id, None)
                if finishing is None:
                    continue
                if request_id in on_channel:
                    logger.warning(
                        "hf_kvshare: request %s's K/V did not come through the read-back channel within "
                        "%s s: not recorded",
                        request_id,
                        READ_BACK_WAIT_S,
                    )
                self._record(finishing, captured.get(request_id), "step output")
        # the requests that waited for these records: planned now, behind them in the task's queue order
        self._prepare(self._ready())

    def has_pending_push_work(self) -> bool:
        with self._finishing_cond:
            return bool(self._to_capture or self._finishing)

    def shutdown(self) -> None:
        for end in (self._receiver, self._order_sender, self._orders, self._sender):
            if end is not None:
                end.close()
        background = getattr(self, "_background", None)
        if background is not None:
            background.close()
        super().shutdown()

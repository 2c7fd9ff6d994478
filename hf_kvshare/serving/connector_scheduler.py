"""The connector's scheduler side (vLLM's engine-core process): admission, claims, and each finished
request's record, over one :class:`~hf_kvshare.serving.host.Sharing` of its own.

- ``get_num_new_matched_tokens`` (at admission): :meth:`Sharing.plan
  <hf_kvshare.serving.host.Sharing.plan>` runs the method's contract on the request's layout
  (:mod:`.layout`) and claims the longest placed range that starts at vLLM's own (block-aligned)
  prefix-cache hit, the only shape vLLM accepts (one contiguous range per request). The plan is
  decided on the admission thread (:mod:`.admission`); until it is, the hook answers ``None`` (vLLM's
  "not decided yet": the request is skipped this step and asked again), so a KVCMAS correction never
  stops the other requests. ``"background": false`` in ``kv_connector_extra_config``
  (``--inline-admission``) decides inline.
- ``update_state_after_alloc`` / ``build_connector_meta``: the claim and the request's block ids go to
  the worker in the step's metadata, with no tensor (:class:`~.connector_common.Load`): each placed
  span whose K/V are rows of a request the worker keeps (:mod:`.worker_store`: the plan's
  ``origins``) as a reference (request id, rows, RoPE shift), the rest (KVCMAS's corrected spans, K/V
  the worker does not keep) as one message on the order channel (:mod:`.channel`) under the request
  id. Without an order channel yet, the claim stops where its first such piece starts.
- which finished requests the worker keeps, on its device, and which it drops: the scheduler's
  :class:`~.worker_store.StoreMirror` decides (least recently used first, by bytes,
  ``device_store_bytes``), in the capture's ``keep`` / ``drop``; a kept request a claim references is
  pinned from admission until the claiming request ends. A value-free method's kept request
  (:data:`~hf_kvshare.serving.host.VALUE_FREE`) is captured with ``ship=False``: its record is
  stand-ins of the worker's K/V (no read-back bytes here, none held against the read-back budget).
- ``request_finished`` (before the blocks are freed): a finished request keeps its blocks
  (``delay_free``) until the worker has read back the K/V it used; the scheduler orders the read-back
  at once on the order channel (:mod:`.channel`) and the capture also rides in the next step's
  metadata. The K/V come back on the read-back channel (the path: this side's channel thread queues
  the turn's record, ``method.record``, on the admission thread, behind the plans asked for before
  it, while the engine goes on) or, the fallback, with the worker's step output
  (``update_connector_output`` queues the record; :mod:`.connector_worker` says when). Without the
  channels (refused, ``"read_back_channel": false``; always with inline admission) only the step's
  output. ``has_pending_push_work`` keeps the engine stepping until then.

A finished request's read-back is held against the store's read-back budget (``max_read_back_bytes``:
``Sharing.read_backs``) from its end until its record has run: reserved before the read-back is ordered
(the bytes per position learned from the first read-back), checked exactly as it comes; one that would
pass it is not recorded (not read back at all when known at its end), its report's ``error`` says so.

Each finished request's report (:meth:`Plan.report <hf_kvshare.serving.host.Plan.report>`) is the
reply's ``kv_transfer_params["hf_kvshare"]`` and, with ``report_path`` in ``kv_connector_extra_config``
(or the environment variable :data:`REPORTS_ENV`), one JSON line of that file, written once the
request is recorded.

A request whose claim stops at what an in-flight request computes right now (a PH span whose slot has
no K/V yet: :data:`~hf_kvshare.serving.host.NOT_RECORDED_YET`, e.g. agents reading one fresh document
arriving while the first still prefills it; or its agent's own text, computed by the agent's earlier
request in flight and kept by ``prefix_reuse``) waits for that record instead of computing it again:
the hook answers ``None`` until a producer's record has run, every producer is gone, or the bound
passes while one still runs; then it is planned again (and waits again, within the same deadline, if
its claim still stops at pending work). Bounded by ``producer_wait_s`` (``kv_connector_extra_config``,
default :data:`DEFAULT_PRODUCER_WAIT_S`; ``0``: never wait) and by the time computing the pending spans
would take, and only when that estimate (seconds per computed token, from the requests finished so
far, times :data:`SHARED_ENGINE`) says waiting for the producers' remaining work is cheaper. The
report's ``producer_wait`` says how it went, or why it did not wait. A request whose claim stops at
text nobody in flight computes (a cold agent's own new text) never waits.

Worker replicas (:mod:`.replica`; a value-reading method at TP > 1 or PP > 1, unless
``worker_replicas: false``): this side's Sharing is the follower of the workers' replicas (``meta``
stand-ins, rank 0's published values from the read-back channel); the admission thread drives it through
:class:`~.replica.Lockstep`, whose op stream rides every rank's order channel; every claim is
``from_replica`` (no K/V or factors sent) and is cut to nothing while a rank's order channel is not
connected or a rank reports its replica stopped or deciding otherwise; the workers send stand-ins of
their read-backs (``ship=False``).

Two threads touch this object (the engine's scheduler thread and the read-back channel's thread): the
finishing and waiting requests are shared under one condition's lock.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from . import channel
from .admission import DEFAULT_MAX_PLANNED_BYTES, DEFAULT_RUNNING_WAIT_S, DEFAULT_WAIT_S, Background, task_of
from .connector_common import Capture, Captured, Correction, HFKVShareMetadata, Load, Source, make_sharing
from .host import NOT_RECORDED_YET, Plan, ServingError, ServingHost, Sharing
from .layout import images_of
from .replica import DEFAULT_WAIT_S as DEFAULT_REPLICA_WAIT_S
from .replica import Lockstep, OpStream, Published, follower_shard, reads_values, wants_replicas
from .tensor_parallel import PENDING, pipeline_parallel_size, rank_assembly, tensor_parallel_size
from .worker_store import DEFAULT_DEVICE_STORE_BYTES, CorrectedOrigin, Sources, StoreMirror

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("hf_kvshare.serving")

#: environment variable naming the JSONL file each finished request's report is appended to
REPORTS_ENV = "HF_KVSHARE_REPORTS"
#: the store summary's counts each report line of that file carries
STORE_COUNTS = (
    "bytes",
    "max_bytes",
    "tasks",
    "evicted_tasks",
    "dropped_slot_kv",
    "queued_jobs",
    "settles",
    "device_bytes",
    "device_evicted",
    "metadata_bytes",
    "load_tokens",
    "load_bytes",
    "handoff",
    "replicas",
)
#: messages the order channel holds (read-back orders and claims' K/V) before a send is refused
ORDER_QUEUE = 32
#: how long the scheduler waits, at the end of a step, for a read-back the worker says it sent
#: through the channel and that has not arrived yet (seconds; then the request is not recorded)
READ_BACK_WAIT_S = 5.0
#: the longest a request waits for an in-flight request of its task to record the span it reads
#: (seconds; the estimate of computing the span bounds it further)
DEFAULT_PRODUCER_WAIT_S = 30.0
#: how much longer computing a span takes while the producer runs beside it (one engine shared by both
#: requests): the wait is worth it while the producer's remaining time is below this times the span's
SHARED_ENGINE = 2.0
#: the weight of the newest finished request in the seconds-per-token estimate (an exponential average)
RATE_WEIGHT = 0.5


@dataclass
class _ProducerWait:
    """A request waiting for the records of in-flight requests that compute what its claim stopped at."""

    request: Request
    producers: set[str]  # the in-flight requests' ids
    span: str  # where its claim stopped
    since: float
    deadline: float
    outcome: str | None = None  # set when the wait ends
    ended: float | None = None
    rounds: int = 1  # planned again and still waiting: one more round, within the same deadline

    def report(self) -> dict[str, Any]:
        ended = self.ended if self.ended is not None else time.perf_counter()
        return {
            "span": self.span,
            "seconds": round(ended - self.since, 6),
            "outcome": self.outcome,
            "rounds": self.rounds,
        }


@dataclass
class _Finishing:
    plan: Plan
    output_ids: list[int]
    stop_ids: set[int]
    ids: tuple[str, str | None]  # the request's id and external id (its report line)
    finished_at: float = 0.0  # time.perf_counter() at request_finished (the report's read_back_s)
    reserved: int = 0  # bytes its read-back holds against the read-back budget (an estimate until it came)


class HFKVShareScheduler:
    """The scheduler side of :class:`~hf_kvshare.serving.connector.HFKVShareConnector` (see the module
    docstring). ``sharing``: the service to drive (built from ``kv_connector_extra_config`` when not
    given)."""

    def __init__(self, vllm_config: VllmConfig, sharing: Sharing | None = None):
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._block_size = vllm_config.cache_config.block_size
        #: the leader replica's published values (:mod:`.replica`), which the scheduler's Sharing, their
        #: follower, takes in order; ``None``: no worker replicas (the Sharing decides on read-backs)
        self._published = self._replica_values(vllm_config, extra)
        if sharing is None and self._published is not None:
            sharing = make_sharing(vllm_config, shard=follower_shard(self._published.take))
        elif sharing is None:
            sharing = make_sharing(vllm_config)
        self.sharing = sharing
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
        #: requests waiting for the record of a span an in-flight request of their task computes
        self._producer_waits: dict[str, _ProducerWait] = {}
        #: finished requests whose record is queued and has not run yet (under the finishing lock)
        self._recording: dict[str, Plan] = {}
        #: admitted requests: (when admitted, tokens the engine computes for them: prompt after the
        #: claim + the most it generates), for the seconds-per-token estimate and a producer's remaining
        self._admitted_at: dict[str, tuple[float, int]] = {}
        self._seconds_per_token: float | None = None
        #: bytes of one position's read-back K/V (learned from the first read-back): a finished request's
        #: read-back is held against the budget before it is ordered, so one past it is never read
        self._read_back_token_bytes: int | None = None
        self._producer_wait_s = extra.get("producer_wait_s", DEFAULT_PRODUCER_WAIT_S)
        if (
            isinstance(self._producer_wait_s, bool)
            or not isinstance(self._producer_wait_s, (int, float))
            or not 0 <= self._producer_wait_s
        ):
            raise ServingError(
                f"hf_kvshare: producer_wait_s must be a number of seconds >= 0; got {self._producer_wait_s!r}"
            )
        self._receiver: channel.Receiver | None = None
        #: ``in_process`` (default true): K/V to and from a worker of this process go by reference
        #: (:mod:`.channel`'s handoff); ``false`` serializes them (for comparison; the escape hatch)
        try:
            self._handoff = channel.check_in_process(extra.get("in_process", True))
        except ValueError as error:
            raise ServingError(str(error)) from None
        #: read-backs that came with the workers' step output: in-process (a worker of this process:
        #: vLLM's "uni" executor hands its output over as is) or serialized (by vLLM), and their bytes
        self.step_output = {"in_process": 0, "serialized": 0, "serialized_bytes": 0}
        #: each worker rank's order channel (one at one rank), connected when the rank announces it
        self._order_senders: dict[int, channel.Sender] = {}
        #: the worker ranks' read-backs of a finished request, assembled into all KV heads and layers for
        #: its record (tensor and pipeline parallel; under the finishing lock), and the layers each holds
        self._assembly = rank_assembly(vllm_config)
        #: what the worker keeps on its device (decided here) and the provenance of placements among it
        self.device_store = StoreMirror(int(extra.get("device_store_bytes", DEFAULT_DEVICE_STORE_BYTES)))
        self.sharing.sources = Sources(self.device_store)
        self._drops: list[str] = []  # kept requests never recorded: dropped by the worker next step
        #: the step metadata's pickled bytes, last and most (``metadata_bytes`` in the summary)
        self.metadata_bytes = {"last": 0, "max": 0, "steps": 0}
        #: claimed tokens written from rows the worker keeps (``referenced``), sent on the order channel
        #: (``sent``) and, with worker replicas, written from each rank's replica's claim (``replica``)
        self.load_tokens = {"referenced": 0, "sent": 0}
        #: bytes sent on the order channel for claims: K/V rows (``sent``) and correction factors
        #: (``factors``, for ``corrected`` tokens whose delta the worker adds to rows it keeps)
        self.load_bytes = {"sent": 0, "factors": 0, "corrected": 0}
        self._report_path = extra.get("report_path") or os.environ.get(REPORTS_ENV) or None
        #: the op stream every worker rank's replica runs (:mod:`.replica`; ``None``: no replicas) and
        #: each rank's replica counts as it last reported them
        self._stream = OpStream(self._assembly.size) if self._published is not None else None
        if self._stream is not None:
            self.load_tokens["replica"] = 0
        self.replica_counts: dict[int, dict[str, Any]] = {}
        self._background = Background(
            Lockstep(self.sharing, self._stream) if self._stream is not None else self.sharing,
            enabled=extra.get("background", True),
            wait_s=extra.get("plan_wait_s", DEFAULT_WAIT_S),
            running_wait_s=extra.get("plan_running_wait_s", DEFAULT_RUNNING_WAIT_S),
            max_planned_bytes=extra.get("planned_bytes", DEFAULT_MAX_PLANNED_BYTES),
        )
        read_back = extra.get("read_back_channel", True)
        if not isinstance(read_back, bool):
            raise ServingError(f"hf_kvshare: read_back_channel must be true or false; got {read_back!r}")
        # inline admission records on the engine loop: its read-backs keep the step's output path
        if read_back and self._background.enabled:
            try:
                self._receiver = channel.Receiver(self._on_read_back, self._on_tensors)
            except Exception:  # noqa: BLE001 - serving works without it (the step's output path)
                logger.exception("hf_kvshare: no read-back channel; read-backs come with the step's output")

    @staticmethod
    def _replica_values(vllm_config: VllmConfig, extra: dict[str, Any]) -> Published | None:
        """Where the leader replica's values arrive when the workers run replicas
        (:func:`~.replica.wants_replicas`, which every worker decides alike from the same configuration);
        what runs otherwise is said at start-up."""
        tp, pp = tensor_parallel_size(vllm_config), pipeline_parallel_size(vllm_config)
        try:
            wanted = wants_replicas(extra.get("method"), tp, pp, extra)
        except ValueError as error:
            raise ServingError(f"hf_kvshare: {error}") from None
        if wanted:
            logger.info(
                "hf_kvshare: every %s runs a replica of the method on its %s; this side follows them "
                "(metadata only)",
                "tensor-parallel rank" if pp == 1 else "pipeline stage" if tp == 1 else "rank",
                "KV heads" if pp == 1 else "layers" if tp == 1 else "KV heads of its stage's layers",
            )
            return Published(float(extra.get("replica_wait_s", DEFAULT_REPLICA_WAIT_S)))
        if reads_values(extra.get("method")) and tp * pp > 1:
            logger.info(
                "hf_kvshare: %s over %d ranks (tensor parallel %d, pipeline parallel %d): the ranks' K/V "
                "are read back and assembled here, where the method runs (worker replicas need the admission "
                "thread, the read-back channel and worker_replicas true)",
                extra.get("method"),
                tp * pp,
                tp,
                pp,
            )
        return None

    # ================================================================ admission
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        old = self._plans.get(request.request_id)
        if old is not None:
            if old.local_hit == num_computed_tokens:
                return old.claimed, False
            del self._plans[request.request_id]
            self.device_store.unpin(request.request_id)
            self._background.release(old)
        if self._admitted(request) is None:
            return 0, False  # not under the method's cache_salt: exact, nothing injected (Sharing.admit)
        with self._finishing_cond:  # the channel's thread ends a wait when it queues the record
            waiting = self._producer_waits.get(request.request_id)
            if waiting is not None and not self._wait_over(waiting):
                return None, False  # the span's producer is still at work: its record first
        if not self._background.deciding(request.request_id) and self._waits_for_record(request):
            # an earlier request of this task finished but its K/V is not read back yet: its record
            # comes first, or this plan would not see the output it reads
            return None, False
        prompt = list(request.prompt_token_ids or [])
        plan = self._background.plan(request.request_id, prompt, self._admitted(request), num_computed_tokens)
        if plan is None:  # still being decided off the engine loop: vLLM skips the request and asks again
            return None, False
        if self._waits_for_producer(request, plan, waiting):
            return None, False
        if waiting is not None:  # planned again after its wait
            with self._finishing_cond:
                self._producer_waits.pop(request.request_id, None)
            plan.producer_wait = waiting.report()
        if plan.error:
            logger.warning("hf_kvshare: request %s: no claim (%s)", request.request_id, plan.error)
        plan.record_wait_s = self._record_waits.pop(request.request_id, None)
        if plan.claimed and self._stream is not None and not (self._orders_connected() and self._in_step()):
            # the replicas get their ops once every rank's order channel is connected; a replica stopped
            # or deciding otherwise writes nothing this side could stand behind
            _trim(plan, 0)
        elif plan.claimed and not self._orders_connected():  # no way to send what the worker does not keep
            pieces = _pieces(plan)
            unsent = [
                lo
                for lo, _, origin, _ in pieces
                if origin is None or origin.request_id not in self.device_store
            ]
            if unsent:
                _trim(plan, min(unsent) - plan.claim_start)
        self._pin(plan)
        self._plans[request.request_id] = plan
        computes = len(prompt) - num_computed_tokens - plan.claimed + _max_tokens(request)
        self._admitted_at[request.request_id] = (time.perf_counter(), max(1, computes))
        return plan.claimed, False

    # ================================================================ waiting for a producer
    def _waits_for_producer(self, request: Request, plan: Plan, previous: _ProducerWait | None) -> bool:
        """Whether ``plan``'s claim stopped at what in-flight requests compute now (:meth:`_pending`)
        and waiting for their records is worth it (module docstring): then the plan is released and the
        request waits (``True``); otherwise the plan's ``producer_wait`` says why it did not. A request
        planned again after a wait that still stops at pending work waits again, within its deadline."""
        stop = plan.claim_stop
        if stop is None or plan.turn is None:
            return False
        producers, gain = self._pending(plan)
        if not gain:
            if previous is None and stop["reason"].startswith(NOT_RECORDED_YET):
                plan.producer_wait = {
                    "span": stop["span"],
                    "outcome": "not waited",
                    "why": "no request of the task admitted computes it (planned ahead, not running)",
                }
            return False
        now = time.perf_counter()
        if previous is not None:
            if now >= previous.deadline or not producers:
                return False  # its report says how the wait ended
            wait = replace(previous, producers=producers, span=stop["span"], outcome=None, ended=None)
            wait.rounds += 1
        elif self._producer_wait_s <= 0:
            plan.producer_wait = {
                "span": stop["span"],
                "outcome": "not waited",
                "why": "producer_wait_s is 0",
            }
            return False
        else:
            remaining = self._producer_remaining(producers, now)
            rate = self._seconds_per_token
            # computed beside the producer, the span takes the engine's time the producer would have
            compute = None if rate is None else SHARED_ENGINE * rate * gain
            if compute is not None and remaining > compute:
                plan.producer_wait = {
                    "span": stop["span"],
                    "outcome": "not waited",
                    "why": f"computing its {gain} tokens (~{compute:.3g} s) is cheaper than waiting for "
                    f"the requests computing them (~{remaining:.3g} s left)",
                }
                return False
            bound = self._producer_wait_s if compute is None else min(self._producer_wait_s, compute)
            wait = _ProducerWait(request, producers, stop["span"], now, now + bound)
        with self._finishing_cond:
            self._producer_waits[request.request_id] = wait
            self._background.release(plan)  # its output slot freed; planned again when the wait ends
            if not producers:  # recorded since the plan was made: plan it again now
                wait.outcome, wait.ended = "recorded", now
                self._prepare([request])
        return True

    def _pending(self, plan: Plan) -> tuple[set[str], int]:
        """The in-flight requests whose records would let ``plan``'s claim pass where it stopped, and the
        tokens it would then pass: from the stop, over each span placed or pending (a PH span
        :data:`NOT_RECORDED_YET`, or recorded since the plan; the agent's own text that an in-flight
        request of the same agent computes, kept by ``prefix_reuse``), to the first that is neither."""
        turn, stop = plan.turn, plan.claim_stop
        with self._finishing_cond:
            in_flight = [(rid, f.plan) for rid, f in self._finishing.items()] + list(self._recording.items())
        in_flight += [(rid, other) for rid, other in self._plans.items() if rid in self._admitted_at]
        producers: set[str] = set()
        end = stop["position"]
        last = len(plan.prompt) - 1
        for span, placement in zip(turn.spans, plan.placements):
            if span.end <= end:
                continue
            if placement is None:
                found = self._producers_of(plan, span, in_flight)
                if found is None:
                    break
                producers |= found
            end = span.end
        if not producers and not self._recorded_since(plan):
            return set(), 0
        return producers, max(0, min(end, last) - stop["position"])

    def _producers_of(self, plan: Plan, span: Any, in_flight: list[tuple[str, Plan]]) -> set[str] | None:
        """The in-flight requests computing ``span`` of ``plan`` (an empty set: recorded since the plan),
        or ``None``: nothing in flight computes it."""
        if span.kind == "PH":
            if plan.unplaced.get(span.name) != NOT_RECORDED_YET:
                return None
            if self.sharing.has_kv(plan.host, span.name):
                return set()
            found = {rid for rid, other in in_flight if _reads(other, plan.host, span.name)}
            return found or None
        if getattr(self.sharing.method, "prefix_reuse", False) is not True:
            return None
        found = {
            rid
            for rid, other in in_flight
            if other.turn is not None
            and other.turn.agent == plan.turn.agent
            and any(s.kind == "PF" and torch.equal(s.token_ids, span.token_ids) for s in other.turn.spans)
        }
        return found or None

    def _recorded_since(self, plan: Plan) -> bool:
        """Whether the span ``plan``'s claim stopped at, not recorded when it was planned, is now."""
        stop = plan.claim_stop
        return plan.unplaced.get(stop["span"]) == NOT_RECORDED_YET and self.sharing.has_kv(
            plan.host, stop["span"]
        )

    def _producer_recorded(self, plan: Plan) -> None:
        """``plan``'s record has run: the requests waiting for it end their wait and are planned now
        (whatever their task: a plan waits on the admission thread only for its own task's records;
        under the finishing lock)."""
        now = time.perf_counter()
        for wait in self._producer_waits.values():
            if wait.outcome is None and plan.request_id in wait.producers:
                wait.outcome, wait.ended = "recorded", now
                self._prepare([wait.request])

    def _producer_remaining(self, producers: set[str], now: float) -> float:
        """Seconds the soonest of ``producers`` still needs (0 once one finished: its K/V are read back,
        and without an estimate yet: the wait's bound alone limits it)."""
        with self._finishing_cond:
            if producers & (set(self._finishing) | set(self._recording)):
                return 0.0
        left = [self._admitted_at[rid] for rid in producers if rid in self._admitted_at]
        if not left or self._seconds_per_token is None:
            return 0.0
        return min(max(0.0, self._seconds_per_token * tokens - (now - at)) for at, tokens in left)

    def _wait_over(self, wait: _ProducerWait) -> bool:
        """Whether a producer wait ended: a producer's record queued (or every producer gone), or its
        bound passed (the outcome kept for the report; under the finishing lock)."""
        if wait.outcome is not None:
            return True
        now = time.perf_counter()
        running = any(rid in self._plans for rid in wait.producers)
        if not running and not any(
            rid in self._finishing or rid in self._recording for rid in wait.producers
        ):
            wait.outcome = "recorded"  # recorded, or ended unrecorded
        elif running and now >= wait.deadline:  # past it, a producer that finished is still waited for
            wait.outcome = "timed out"
        else:
            return False
        wait.ended = now
        return True

    def _learn_rate(self, request_id: str, computed: int) -> None:
        """The seconds-per-computed-token estimate, from a request's admission to its end."""
        admitted = self._admitted_at.pop(request_id, None)
        if admitted is None or computed <= 0:
            return
        sample = (time.perf_counter() - admitted[0]) / computed
        rate = self._seconds_per_token
        self._seconds_per_token = sample if rate is None else RATE_WEIGHT * sample + (1 - RATE_WEIGHT) * rate

    def _admitted(self, request: Request) -> Any:
        """The request's layout fenced by its tenant; ``None``: nothing to inject (:meth:`Sharing.admit`)."""
        return self.sharing.admit(
            request.kv_transfer_params,
            getattr(request, "cache_salt", None),
            images=images_of(getattr(request, "mm_features", None)),
        )

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
            if not self._unrecorded(task_of(self._admitted(request))):
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
                if not self._unrecorded(task_of(self._admitted(request))):
                    del self._waiting[request_id]
                    self._record_waits[request_id] = time.perf_counter() - since
                    ready.append(request)
        return ready

    def _prepare(self, requests: list[Request]) -> None:
        for request in requests:  # planned behind the records queued before (the task's queue order)
            params = self._admitted(request)
            if params is None:  # not under the method's salt: never planned (get_num_new_matched_tokens)
                continue
            self._background.prepare(request.request_id, list(request.prompt_token_ids or []), params)

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
            _trim(plan, num_external_tokens)
        if plan.claimed:
            self._loads[request.request_id] = self._load(plan)

    def _pin(self, plan: Plan) -> None:
        """Pin the kept requests ``plan``'s claim references (until the request ends), before vLLM takes
        the claim; the claim stops at the first whose rows the worker no longer keeps (the scheduler has
        no copy of them to send: :func:`~hf_kvshare.segment_kv.is_stand_in`)."""
        for lo, _, origin, _ in _pieces(plan):
            if origin is not None and not self.device_store.pin(plan.request_id, [origin.request_id]):
                _trim(plan, lo - plan.claim_start)
                return

    def _load(self, plan: Plan) -> Load:
        """The claim as references to rows the worker keeps (pinned at admission, until the request
        ends), with the low-rank factors of a corrected one's delta, and the rest sent now on the order
        channel (:class:`Load`; module docstring)."""
        if self._stream is not None:  # each rank writes its replica's claim: no K/V, no factors sent
            self.load_tokens["replica"] += plan.claimed
            return Load(plan.request_id, [], plan.claim_start, plan.claimed, from_replica=True)
        load = Load(plan.request_id, [], plan.claim_start, plan.claimed)
        factors: list[torch.Tensor] = []
        for lo, hi, origin, span_start in _pieces(plan):
            if origin is None:
                load.payload.append((lo - plan.claim_start, hi - plan.claim_start))
                continue
            skip = lo - span_start
            load.sources.append(
                Source(
                    origin.request_id,
                    origin.row + skip,
                    hi - lo,
                    lo - plan.claim_start,
                    origin.start + skip,
                    lo,
                    _correction(origin, skip, hi - lo, factors),
                )
            )
        self.load_tokens["referenced"] += sum(source.n for source in load.sources)
        self.load_tokens["sent"] += sum(hi - lo for lo, hi in load.payload)
        if factors:
            self.load_bytes["corrected"] += sum(s.correction.rows for s in load.sources if s.correction)
            self.load_bytes["factors"] += _nbytes(factors)
            # every rank takes its own layers (by index in the model) and heads of the whole model's factors
            self._send(
                plan,
                lambda: all(
                    [
                        s.send_tensors(plan.request_id, "factors", factors)
                        for s in self._order_senders.values()
                    ]
                ),
            )
        if load.payload:
            # plan.keys holds exactly the payload's rows, in order (Plan.sent_ranges); each rank takes its
            # stage's layers (pipeline parallel) and its own heads of them (tensor parallel)
            self.load_bytes["sent"] += _nbytes(plan.keys) + _nbytes(plan.values)
            self._send(plan, lambda: self._send_claim(plan.request_id, plan.keys, plan.values))
        return load

    def _send(self, plan: Plan, send: Any) -> None:
        """``send()`` (``True`` when every rank's order channel took it); when one refuses the worker
        reports the claim's blocks failed (vLLM recomputes or fails it)."""
        if not (self._orders_connected() and send()):
            logger.error(
                "hf_kvshare: request %s's claimed K/V could not be sent to the worker", plan.request_id
            )

    def _send_claim(self, request_id: str, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """A claim's K/V to every worker rank's order channel, each the layers its stage holds (pipeline
        parallel); every rank takes its own heads of them (tensor parallel). ``True`` when all took it."""
        sent = []
        for rank, sender in self._order_senders.items():
            layers = self._assembly.layers(rank)
            sent.append(layers is not None and sender.send(request_id, keys[layers], values[layers], "load"))
        return all(sent)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HFKVShareMetadata:
        meta = HFKVShareMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            load = self._loads.pop(new.req_id, None)
            if load is not None:
                load.block_ids = list(new.block_ids[0])
                meta.loads.append(load)
        meta.captures, self._to_capture = self._to_capture, []
        with self._finishing_cond:
            meta.drops, self._drops = self._drops, []
        meta.read_back = self._receiver.address if self._receiver is not None else None
        if self._stream is not None:
            self._stream.flush()  # ops a rank's full channel refused: sent again, in order
        if meta.loads or meta.captures or meta.drops:
            self._measure(meta)
        return meta

    def _measure(self, meta: HFKVShareMetadata) -> None:
        """The metadata's pickled size (what vLLM sends the worker each step), kept for the summary."""
        import pickle

        size = len(pickle.dumps(meta))
        self.metadata_bytes["last"] = size
        self.metadata_bytes["max"] = max(self.metadata_bytes["max"], size)
        self.metadata_bytes["steps"] += 1

    # ================================================================ finish and record
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._loads.pop(request.request_id, None)
        self.device_store.unpin(request.request_id)  # its claim was written (or never will be)
        with self._finishing_cond:  # the channel's thread may be planning it (a waiting request)
            self._waiting.pop(request.request_id, None)
            self._background.forget(request.request_id)  # a plan being decided is released when done
        self._record_waits.pop(request.request_id, None)
        with self._finishing_cond:
            self._producer_waits.pop(request.request_id, None)
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            self._admitted_at.pop(request.request_id, None)
            return False, None
        computed = len(request.prompt_token_ids or []) - plan.local_hit - plan.claimed
        self._learn_rate(request.request_id, computed + len(request.output_token_ids))
        report = {"hf_kvshare": {**plan.report(), "store": self._summary()}}
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
        keep, drop = self.device_store.admit(request.request_id, tokens) if self._keeps() else (False, [])
        # a value-free method's record is stand-ins of what the worker keeps (nothing to read back here);
        # a follower's too: the K/V stay in the workers, for their replicas' records
        ship = not (
            self.sharing.follower
            or (self.sharing.value_free and (keep or not self.sharing.method.uses_sources))
        )
        # the report file's line is written once the request is recorded: a dense span's gate outcome
        # (why it was not reused) is known then (the reply carries the admission's report)
        reserved = self._reserve_before_read_back(plan, tokens) if ship else 0
        if reserved is None:  # past the read-back budget: not read back, not recorded
            self.device_store.forget(request.request_id)  # never kept: no capture orders it
            for dropped in drop:  # what the mirror evicted for it: the worker drops them next step
                self.sharing.sources.forget(dropped)
            with self._finishing_cond:
                self._drops.extend(drop)
            report = {"hf_kvshare": {**plan.report(), "store": self._background.summary()}}
            if self._report_path:
                self._write_report(ids, report["hf_kvshare"])
            self._background.release(plan)
            return False, report
        with self._finishing_cond:
            self._finishing[request.request_id] = _Finishing(
                plan, list(request.output_token_ids), stop, ids, time.perf_counter(), reserved
            )
        for dropped in drop:
            self.sharing.sources.forget(dropped)
        capture = Capture(request.request_id, list(block_ids), tokens, keep, drop, ship)
        self._to_capture.append(capture)  # the next step's metadata, unless the worker took it already
        if self._receiver is not None:  # read back now, not at the next step
            for sender in self._order_senders.values():
                sender.order(asdict(capture))
        return True, report  # the blocks stay until the worker has read them (get_finished)

    def _keeps(self) -> bool:
        """Whether the worker keeps finished requests in its device store at all: a method that
        references recorded K/V (``uses_sources``; NonShared's are never read again), unless the workers'
        replicas hold them (their claims reference no kept rows)."""
        return self.sharing.method.uses_sources and not self.sharing.follower

    def _reporter(self, ids: tuple[str, str | None]):
        """What runs after the request's record: its report file line (``None`` without a file)."""
        if not self._report_path:
            return None

        def write(plan: Plan) -> None:
            self._write_report(ids, {**plan.report(), "store": self._summary()})

        return write

    def _summary(self) -> dict[str, Any]:
        """The host store's summary with the worker's device store (the mirror's counts) and the step
        metadata's size."""
        return {
            **self._background.summary(),
            **self.device_store.summary(),
            "metadata_bytes": dict(self.metadata_bytes),
            "load_tokens": dict(self.load_tokens),
            "load_bytes": dict(self.load_bytes),
            "handoff": self.handoff_summary(),
            "replicas": self.replicas_summary(),
        }

    def _in_step(self) -> bool:
        """Whether the replicas are in step: the op stream has not stopped and no rank reported its
        replica stopped or a decision differing from this side's (else nothing is claimed)."""
        if self._stream is None or self._stream.stopped is not None:
            return False
        return not any(c.get("stopped") or c.get("differ") for c in list(self.replica_counts.values()))

    def _on_tensors(self, request_id: str, kind: str, tensors: list[torch.Tensor]) -> None:
        """A tensor message on the read-back channel (its thread): the leader replica's published values."""
        if kind == "published" and self._published is not None:
            for value in tensors:
                self._published.put(value)

    def replicas_summary(self) -> dict[str, Any] | None:
        """The op stream's counts and each rank's replica's (``None``: no replicas)."""
        if self._stream is None:
            return None
        return {
            "stream": self._stream.summary(),
            "published": dict(self._published.counts),
            "ranks": dict(self.replica_counts),
        }

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
                # each store's bytes, budget and evictions (Sharing.stores)
                "stores": store.get("stores"),
            },
        }
        try:
            with open(self._report_path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:  # the engine must keep running
            logger.exception("hf_kvshare: writing the report of request %s failed", ids[0])

    def _on_read_back(
        self, request_id: str, keys: torch.Tensor, values: torch.Tensor, via: str, rank: int = 0
    ) -> None:
        """A read-back from the channel (its thread), while the engine goes on: the request's record is
        queued now (once every worker rank's came), not after the step."""
        with self._finishing_cond:
            # queued under the lock: whoever sees the request gone sees its record queued first
            if self._add_read_back(request_id, rank, (keys, values), via or "at finish"):
                # the requests that waited for it: planned now, behind it (under the lock, so a request
                # ending meanwhile is forgotten after its plan is queued, never before)
                self._prepare(self._ready())
            self._finishing_cond.notify_all()

    def _add_read_back(
        self, request_id: str, rank: int, kv: tuple[torch.Tensor, torch.Tensor] | None, how: str
    ) -> bool:
        """One worker rank's read-back of a finished request (under the finishing lock): its record is
        queued once every rank's came (:class:`~.tensor_parallel.RankAssembly`: all KV heads; one rank:
        at once); ``True`` then. A request already recorded or given up on: dropped."""
        finishing = self._finishing.get(request_id)
        if finishing is None:
            return False
        assembled = self._assembly.add(request_id, rank, kv)
        if assembled is PENDING:
            return False
        del self._finishing[request_id]
        self._record(finishing, assembled, how)
        return True

    def _record(self, finishing: _Finishing, kv: tuple[torch.Tensor, torch.Tensor] | None, how: str) -> None:
        report = self._reporter(finishing.ids)
        plan = finishing.plan
        plan.read_back = how
        plan.read_back_s = time.perf_counter() - finishing.finished_at
        self._recording[plan.request_id] = plan  # under the finishing lock (both callers hold it)
        kv, held = self._reserve_read_back(plan, kv, finishing.reserved)

        def then(recorded: Plan) -> None:  # on the admission thread, once the record has run
            self.sharing.read_backs.release(held)
            if report is not None:
                report(recorded)
            with self._finishing_cond:
                self._recording.pop(recorded.request_id, None)
                self._producer_recorded(recorded)

        if kv is None:
            if self.device_store.forget(plan.request_id):  # kept by the worker, never referenced
                self._drops.append(plan.request_id)
            self._background.release(plan, then)
        else:
            if plan.request_id in self.device_store:  # before the record: the plans behind it find it
                # handed over in-process, they are the worker's store's own tensors (one copy)
                self.sharing.sources.register(plan.request_id, kv[0], kv[1], shared=self.colocated)
            self._background.record(plan, kv[0], kv[1], finishing.output_ids, finishing.stop_ids, then)

    def _reserve_before_read_back(self, plan: Plan, tokens: int) -> int | None:
        """The bytes a finished request's read-back of ``tokens`` positions will hold, reserved against the
        read-back budget (``Sharing.read_backs``) before it is ordered (0 until a first read-back taught
        the bytes per position); ``None`` when they would pass it: its report's ``error`` says so."""
        if self._read_back_token_bytes is None:
            return 0
        nbytes = tokens * self._read_back_token_bytes
        if self.sharing.read_backs.reserve(nbytes):
            return nbytes
        self._refused(plan, nbytes)
        return None

    def _reserve_read_back(
        self, plan: Plan, kv: tuple[Any, Any] | None, reserved: int
    ) -> tuple[tuple[Any, Any] | None, int]:
        """``(kv, bytes held)``: the read-back's exact bytes held against the read-back budget until its
        record has run (what ``reserved`` held at its end adjusted); past it, ``(None, 0)``: the K/V
        dropped now, the request not recorded (its report's ``error`` says so, the summary counts it)."""
        budget = self.sharing.read_backs
        if kv is None:
            budget.release(reserved)
            return None, 0
        nbytes = sum(_nbytes(part) for part in kv)  # stand-ins (the K/V stay in the worker): 0
        positions = _positions(kv[0])
        if positions and nbytes:
            self._read_back_token_bytes = -(-nbytes // positions)  # rounded up: never under the bytes
        if nbytes <= reserved:
            budget.release(reserved - nbytes)
            return kv, nbytes
        if budget.reserve(nbytes - reserved):
            return kv, nbytes
        budget.release(reserved)
        self._refused(plan, nbytes)
        return None, 0

    def _refused(self, plan: Plan, nbytes: int) -> None:
        budget = self.sharing.read_backs
        plan.error = (
            f"read-back: not recorded: its {nbytes} bytes of K/V would pass the read-back budget "
            f"(max_read_back_bytes {budget.max_bytes}; {budget.held} held by the records waiting)"
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' step output: each rank's :class:`Captured` and the requests whose blocks every
        rank has read (``finished_sending``)."""
        meta = connector_output.kv_connector_worker_meta
        parts = meta.by_rank() if isinstance(meta, Captured) else {}
        self._connect_orders(parts)
        captured: dict[str, dict[int, Any]] = {}  # request id -> rank -> its K/V (None: failed)
        on_channel: dict[str, set[int]] = {}  # request id -> the ranks that sent it on the channel
        for rank, part in parts.items():
            for request_id, kv in part.kv.items():
                captured.setdefault(request_id, {})[rank] = kv
            for request_id in part.sent:
                on_channel.setdefault(request_id, set()).add(rank)
        finished = set(connector_output.finished_sending or ())
        all_ranks = set(range(self._assembly.size))
        for rank, part in parts.items():
            if part.replica is not None:
                self.replica_counts[rank] = part.replica
        for part in parts.values():  # the most any rank keeps per position (its heads' share, its layers)
            if part.bytes_per_token:
                known = self.device_store.bytes_per_token or 0
                self.device_store.bytes_per_token = max(known, int(part.bytes_per_token))
        for request_id in set(captured) | set(on_channel) | finished:
            with self._finishing_cond:
                for rank, kv in captured.get(request_id, {}).items():
                    self._count_step_output(kv)
                    self._add_read_back(request_id, rank, kv, "step output")
                # sent on the channel before the workers' output was built: here already, or soon
                waits = set(on_channel.get(request_id, ()))
                if request_id in finished and len(all_ranks) > 1:
                    waits = all_ranks  # every rank has read it: the pieces not here went on the channel
                self._finishing_cond.wait_for(
                    lambda rid=request_id, w=waits: rid not in self._finishing or self._assembly.has(rid, w),
                    READ_BACK_WAIT_S if waits else 0,
                )
                if request_id not in self._finishing:
                    continue
                if waits and not self._assembly.has(request_id, waits):
                    logger.warning(
                        "hf_kvshare: request %s's K/V did not come through the read-back channel within "
                        "%s s: not recorded",
                        request_id,
                        READ_BACK_WAIT_S,
                    )
                elif request_id not in finished:
                    continue  # other ranks' read-backs still to come
                self._assembly.discard(request_id)
                self._record(self._finishing.pop(request_id), None, "step output")
        # the requests that waited for these records: planned now, behind them in the task's queue order
        self._prepare(self._ready())

    def _connect_orders(self, parts: dict[int, Captured]) -> None:
        """Connect to each worker rank's order channel the first time the rank announces it (with the
        layers it holds: a claim's K/V are routed by them)."""
        for rank, part in parts.items():
            if not part.orders or rank in self._order_senders:
                continue
            if part.layers is not None:
                try:  # at the first step: the ranks' read-backs could not be joined in layer order
                    self._assembly.announce(rank, part.layers)
                except ValueError as error:
                    raise ServingError(
                        f"hf_kvshare's connector cannot serve this partition: {error}"
                    ) from None
            try:
                self._order_senders[rank] = channel.Sender(part.orders, ORDER_QUEUE, self._handoff)
            except Exception:  # noqa: BLE001 - read-backs then come with the step's output
                logger.exception("hf_kvshare: connecting the order channel %s failed", part.orders)
                continue
            if self._stream is not None:
                self._stream.connect(rank, self._order_senders[rank])

    @property
    def colocated(self) -> bool:
        """Whether the worker runs in this process and hands K/V over by reference: one rank whose order
        channel is in-process (the worker's read-back sender is then in-process too: one process, one
        ``in_process`` setting)."""
        senders = list(self._order_senders.values())
        return len(senders) == 1 and senders[0].in_process

    def _count_step_output(self, kv: Any) -> None:
        """Count one read-back that came with the workers' step output (``None``: reading it failed)."""
        if kv is None:
            return
        if self.colocated:
            self.step_output["in_process"] += 1
        else:
            self.step_output["serialized"] += 1
            self.step_output["serialized_bytes"] += sum(_nbytes(part) for part in kv)

    def handoff_summary(self) -> dict[str, Any]:
        """The channels' and the step output's messages by path (``in_process`` / ``serialized``) and the
        tensor bytes serialized: ``read_back`` (worker -> scheduler: the read-back channel and the step
        output), ``orders`` (scheduler -> worker: claims' K/V and factors; orders themselves are JSON)."""
        read_back = dict(self.step_output)
        if self._receiver is not None:
            for key, n in self._receiver.counts.items():
                read_back[key] += n
        orders = {"in_process": 0, "serialized": 0, "serialized_bytes": 0}
        for sender in list(self._order_senders.values()):
            for key, n in sender.counts.items():
                orders[key] += n
        return {
            "enabled": self._handoff,
            "colocated": self.colocated,
            "read_back": read_back,
            "orders": orders,
        }

    def _orders_connected(self) -> bool:
        """Whether every worker rank's order channel is connected (a claim's K/V that the workers do
        not keep can be sent to each)."""
        return len(self._order_senders) >= self._assembly.size

    def has_pending_push_work(self) -> bool:
        with self._finishing_cond:
            return bool(self._to_capture or self._finishing)

    def shutdown(self) -> None:
        for end in (self._receiver, *self._order_senders.values()):
            if end is not None:
                end.close()
        self._background.close()


def _nbytes(part: Any) -> int:
    """Bytes of a tensor or of a list of tensors (a read-back's keys or values; a ``meta`` stand-in
    holds none)."""
    tensors = [part] if isinstance(part, torch.Tensor) else list(part)
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def _correction(origin: Any, skip: int, n: int, factors: list[torch.Tensor]) -> Correction | None:
    """A referenced piece's :class:`Correction` (rows ``skip .. skip + n`` of a corrected span, a
    :class:`~.worker_store.CorrectedOrigin`), its factors' rows appended to ``factors``; ``None`` for
    plain kept rows or a piece past the corrected rows."""
    rows = min(getattr(origin, "rows", 0), skip + n) - skip
    if not isinstance(origin, CorrectedOrigin) or rows <= 0:
        return None
    correction = Correction(
        len(factors), len(origin.factors), rows, skip if origin.frame == "canonical" else None
    )
    none = torch.empty(0)
    for pair in origin.factors:
        if pair is None:
            factors += [none] * 4
            continue
        (a_k, b_k), (a_v, b_v) = pair
        factors += [a_k[skip : skip + rows], b_k, a_v[skip : skip + rows], b_v]
    return correction


def _positions(keys: Any) -> int:
    """Positions of a read-back's keys (``[layers, n, heads, dim]``, or a list of ``[n, heads, dim]``)."""
    if isinstance(keys, torch.Tensor):
        return keys.shape[1] if keys.dim() == 4 else 0
    return keys[0].shape[0] if len(keys) else 0


def _trim(plan: Plan, keep: int) -> None:
    """Cut ``plan``'s claim to its first ``keep`` positions (its K/V with it)."""
    plan.cut(keep)


def _pieces(plan: Plan) -> list[tuple[int, int, Any, int]]:
    """The claimed range by placed span: ``(lo, hi, origin, span start)``, ``origin`` the kept rows the
    span's K/V are (``None``: not a reference)."""
    return plan.claimed_pieces()


def _max_tokens(request: Request) -> int:
    """The most tokens ``request`` generates (0 when its sampling parameters do not say)."""
    value = getattr(request.sampling_params, "max_tokens", None) if request.sampling_params else None
    return value if isinstance(value, int) and value > 0 else 0


def _reads(plan: Plan, host: ServingHost | None, slot: str) -> bool:
    """Whether ``plan`` is a turn of ``host`` reading ``slot`` (its record keeps the slot's K/V)."""
    return (
        plan.host is host
        and plan.turn is not None
        and any(s.kind == "PH" and s.name == slot for s in plan.turn.spans)
    )

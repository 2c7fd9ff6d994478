"""The method's admission and recording off vLLM's engine loop.

vLLM's scheduler asks the connector at admission how many tokens it supplies
(``get_num_new_matched_tokens``) and hands it every finished request's K/V
(``update_connector_output``). Deciding a claim (a KVCMAS gate, its token weights and the corrected
K/V) and recording a turn (the observed deltas factorized for the anchor pools) take far longer than a
decode step; run inline they stop the whole engine — every other request's prefill and decode waits.

:class:`Background` runs them on one thread of its own, in the order the engine asked for them (a
plan submitted after a record sees that record, as a Session's next turn sees the last one): the
connector answers "not decided yet" (vLLM's ``None``: the scheduler skips the request this step and
asks again) until the plan is ready (after waiting up to ``running_wait_s`` when it is already
running or next in line behind the one job running: a "not yet" costs the request the whole next
step), and a record is queued and returns at once. The engine keeps
stepping the other requests meanwhile; torch's kernels release the GIL, so the method's work runs
beside vLLM's forward (on another core when there is one). ``enabled=False`` runs everything inline
(the earlier behaviour), for comparison and debugging.

A request's plan starts when it arrives (:meth:`Background.prepare`, from vLLM's ``on_new_request``),
before vLLM knows its prefix-cache hit: the method's placements do not depend on the hit, only the
claim does, which admission cuts (:meth:`~hf_kvshare.serving.host.Sharing.claim`, cheap and without
the store's lock). A plan started only at admission costs its request a whole engine step when it is
not ready at once (measured: ``admission_wait_s`` 2-3.5 s at 2 QPS beside 0.14-0.26 s of planning).
A request arriving while its task has a finished request not yet read back is planned when that
request's record is queued (the connector's ``update_connector_output``), behind it. A plan's
``admission_wait_s`` counts from vLLM's first admission query (what the method costs the engine);
``queued_s``, from the arrival to that query, is vLLM's own queue (before 2026-12-02 a plan made on
arrival counted its wait from the arrival, vLLM's queue included).

The queue's order: a plan waits only for the records (and releases) of **its own task** queued before
it (the next agent reads the last one's output slot and its gate decision); it runs ahead of other
tasks' records, which only teach the method's pools for later requests (a plan sees the anchors of
the records finished when it runs). Without that a plan waited behind every other task's record —
seconds under load (measured: ``admission_wait_s`` 3-9 s beside 0.1-0.4 s of planning at 2 QPS).
More than ``max_queued_records`` records waiting (their captured K/V held in memory) run first.

What a record leaves for later (``Method.deferred_work``: KVCMAS's anchor factorizations with
``defer_factorization``, which serving states) is queued as *settle* jobs, one per part (one anchor's
delta or base), run only when no plan or record is waiting: a dense record (its factorizations most of
its time, measured 1.2-1.7 s on the server) no longer holds up the plans queued behind it (a part is
one factorization, ~0.1 s at 1K tokens: a plan next in line behind it is waited for). A plan that reads an anchor whose part has not run
factorizes it itself (the same factors). More than ``max_queued_records`` settles waiting (each holds
the K/V it factorizes) run before plans. Under worker replicas (:class:`~.replica.Lockstep` as the
Sharing) each settle job is numbered on the op stream when it runs, so every rank runs its part at
the same op.

A plan decided ahead holds its K/V (its placements', its claim's) until vLLM asks for it: those bytes
are bounded by ``max_planned_bytes`` (``planned_bytes`` in ``kv_connector_extra_config``). A plan
decided ahead that would pass it is dropped (released, counted in ``plans_dropped_for_bytes``, logged)
and its request is planned at its admission query instead, as without planning ahead; a plan vLLM has
already asked for is handed at its next query, never dropped.

Each plan says where its request's admission time went (:class:`~hf_kvshare.serving.host.Plan`'s
``plan_queue_s`` and ``plan_behind``: the time from its submission to its start, split by what the
thread ran meanwhile; ``not_ready``: the queries answered "not yet"; ``taken_after_s``: what they cost
after the decision), so a slow first token can be traced to the record it had to see, another task's
work, or an engine step it missed.

No vLLM import here (tests drive it with a plain :class:`~hf_kvshare.serving.host.Sharing`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from ..budgets import check_byte_budget
from . import layout as lay
from .host import Plan, Sharing

logger = logging.getLogger("hf_kvshare.serving")

#: how long one admission query waits for a plan being decided before it answers "not yet" (seconds):
#: bounds the engine loop's spinning while the plan is the only work, and costs the other requests at
#: most this per step
DEFAULT_WAIT_S = 0.002
#: how long one admission query waits for a plan already *running* on the thread (seconds): a plan not
#: ready at vLLM's query costs its request the whole engine step vLLM runs before asking again (another
#: request's prefill: seconds), while a running plan ends in its own time (0.01-0.6 s measured); only
#: one plan runs at a time, so this bounds the engine loop's wait per step. ``0``: never wait longer
#: than ``wait_s``
DEFAULT_RUNNING_WAIT_S = 0.5
#: records queued beyond this run before any plan (each holds a finished request's K/V until it runs)
DEFAULT_MAX_QUEUED_RECORDS = 16
#: the bytes of K/V the plans decided ahead may hold until vLLM asks for them (``max_planned_bytes``)
DEFAULT_MAX_PLANNED_BYTES = 1 << 30


@dataclass
class _Job:
    kind: str  # "plan", "record" (a record or a release: both end a request of their task), "settle"
    task: str | None
    fn: Callable[..., Any]
    args: tuple
    future: Future
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    ended_at: float | None = None
    #: a plan's: seconds of the jobs the thread ran while it was queued, by kind (:data:`BEHIND_KINDS`)
    behind: dict[str, float] = field(default_factory=dict)
    #: a plan's: admission queries answered "not decided yet" (each costs the request an engine step)
    not_ready: int = 0
    #: a decided plan's: the bytes of K/V it holds against ``max_planned_bytes`` until it is handed out
    held: int = 0


#: what a queued plan can wait behind on the thread (its report's ``plan_behind``): a record (or release)
#: of its own task (the one it must see), another task's, a record's deferred work (``settle``), another
#: plan, the store's summary refreshed after each job
#: request ids whose plan :meth:`Background.plan` handed to the scheduler, remembered (at most this
#: many, oldest forgotten first) so that a late :meth:`Background.prepare` of the same request (the
#: read-back channel's thread, after a record it waited for) does not plan it a second time
HANDED_MAX = 4096
BEHIND_KINDS = ("task record", "other record", "settle", "plan", "summary")


def _behind_kind(ran: _Job, waiting: _Job) -> str:
    if ran.kind == "record":
        return "task record" if ran.task is not None and ran.task == waiting.task else "other record"
    return ran.kind


class Background:
    """Plans, records and releases of a :class:`Sharing`, run on one background thread (the order in
    the module docstring).

    The engine's scheduler thread calls this object (vLLM's scheduler side is one thread), and the
    connector's read-back channel thread queues records, releases and plans (:meth:`record`,
    :meth:`release`, :meth:`prepare`): the queue and the plans pending are kept under its condition's
    (re-entrant) lock, so a request gets one plan whichever thread asks first; the background thread
    only runs :class:`Sharing` calls, which take its lock."""

    def __init__(
        self,
        sharing: Sharing,
        *,
        enabled: bool = True,
        wait_s: float = DEFAULT_WAIT_S,
        running_wait_s: float = DEFAULT_RUNNING_WAIT_S,
        max_queued_records: int = DEFAULT_MAX_QUEUED_RECORDS,
        max_planned_bytes: int = DEFAULT_MAX_PLANNED_BYTES,
    ):
        if not isinstance(enabled, bool):
            raise TypeError(f"background must be true or false; got {enabled!r}")
        for name, value in (("plan_wait_s", wait_s), ("plan_running_wait_s", running_wait_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a number of seconds in [0, 1]; got {value!r}")
        if (
            isinstance(max_queued_records, bool)
            or not isinstance(max_queued_records, int)
            or max_queued_records < 0
        ):
            raise ValueError(f"max_queued_records must be an int >= 0; got {max_queued_records!r}")
        self.sharing = sharing
        self.enabled = enabled
        self.wait_s = float(wait_s)
        self.running_wait_s = float(running_wait_s)
        self.max_queued_records = max_queued_records
        self.max_planned_bytes = check_byte_budget("planned_bytes", max_planned_bytes)
        #: the bytes of K/V the decided plans not yet handed out hold, and the plans dropped for them
        self.planned_bytes = 0
        self.plans_dropped_for_bytes = 0
        self._pending: dict[str, tuple[tuple[int, float], _Job]] = {}  # id -> ((hit, asked at), plan job)
        self._handed: OrderedDict[str, None] = OrderedDict()  # plans handed out, not released (HANDED_MAX)
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._running: _Job | None = None
        self._closed = False
        self._summary_lock = threading.Lock()
        self._summary: dict[str, Any] = sharing.state_summary()
        #: admission queries answered "not decided yet" (the scheduler asked again later)
        self.deferred_queries = 0
        self._thread = None
        if enabled:
            self._thread = threading.Thread(target=self._work, name="hf_kvshare-admission", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ admission
    def prepare(self, request_id: str, prompt: list[int], params: Any) -> None:
        """Start the request's plan when it arrives (vLLM's ``on_new_request``), so it runs while the
        engine finishes the step in progress; :meth:`plan` at admission claims from vLLM's hit."""
        with self._cond:  # one plan per request, whichever thread asks first (the connector's channel)
            if self._thread is None or request_id in self._pending or request_id in self._handed:
                return
            job = self._enqueue(
                "plan", task_of(params), self.sharing.plan, request_id, list(prompt), params, None
            )
            # (claimed-from hit, first admission query, arrival): the query's time is set when vLLM asks
            self._pending[request_id] = ((None, None, time.perf_counter()), job)

    def plan(self, request_id: str, prompt: list[int], params: Any, local_hit: int) -> Plan | None:
        """The request's plan, or ``None`` while it is still being decided (ask again)."""
        if self._thread is None:
            plan = self.sharing.plan(request_id, prompt, params, local_hit)
            self._refresh()
            return plan
        with self._cond:  # the bookkeeping only: the wait for the plan is outside the lock
            pending = self._pending.get(request_id)
            if pending is not None and pending[0][0] not in (None, local_hit):  # vLLM's hit changed
                self.forget(request_id)
                pending = None
            if pending is None:
                job = self._enqueue(
                    "plan", task_of(params), self.sharing.plan, request_id, list(prompt), params, local_hit
                )
                now = time.perf_counter()
                pending = self._pending[request_id] = ((local_hit, now, now), job)
            (hit, asked, arrived), job = pending
            if asked is None:  # planned on arrival; this is vLLM's first admission query
                asked = time.perf_counter()
                self._pending[request_id] = ((hit, asked, arrived), job)
        try:
            plan = self._result(job)
        except FutureTimeout:
            with self._cond:
                self.deferred_queries += 1
                job.not_ready += 1
            return None
        except Exception as error:  # noqa: BLE001 - Sharing.plan never raises; the engine must keep running
            logger.exception("hf_kvshare: planning request %s failed", request_id)
            plan = Plan(request_id=request_id, prompt=list(prompt), local_hit=local_hit)
            plan.error = f"{type(error).__name__}: {error}"
            self._hand_out(request_id)
            self._timings(plan, job, asked, arrived)
            return plan
        self._hand_out(request_id)
        if plan.local_hit is None:  # planned ahead: claim from the hit vLLM has now
            started = time.perf_counter()
            self.sharing.claim(plan, local_hit)
            plan.claim_s = time.perf_counter() - started
        self._timings(plan, job, asked, arrived)
        return plan

    @staticmethod
    def _timings(plan: Plan, job: _Job, asked: float, arrived: float) -> None:
        """Where the request's admission time went (the report's fields; :class:`Plan`)."""
        now = time.perf_counter()
        plan.admission_wait_s = now - asked
        plan.queued_s = asked - arrived
        plan.not_ready = job.not_ready
        if job.started_at is not None:
            plan.plan_queue_s = job.started_at - job.queued_at
            plan.plan_behind = {kind: job.behind[kind] for kind in BEHIND_KINDS if kind in job.behind}
        if job.ended_at is not None:  # a plan decided before vLLM asked was waited for by no one
            plan.taken_after_s = max(0.0, now - max(job.ended_at, asked))

    def _result(self, job: _Job) -> Plan:
        """The plan when it is decided within ``wait_s``, or within ``running_wait_s`` once it is
        running on the thread or next in line behind the job that is (a record, a settle, another
        plan: short since records leave their factorizations for later); else ``FutureTimeout``."""
        try:
            return job.future.result(timeout=self.wait_s)
        except FutureTimeout:
            if job.future.done():  # it ended just after the wait: take it
                return job.future.result()
            if not (job.future.running() or self._next_in_line(job)) or self.running_wait_s <= self.wait_s:
                raise  # queued behind other jobs
        return job.future.result(timeout=self.running_wait_s - self.wait_s)

    def _next_in_line(self, job: _Job) -> bool:
        """Whether ``job`` runs as soon as the job running ends."""
        with self._cond:
            return self._running is not None and bool(self._queue) and self._next() is job

    def _drop_pending(self, request_id: str) -> None:
        with self._cond:
            self._pending.pop(request_id, None)

    def _hand_out(self, request_id: str) -> None:
        """The request's plan leaves for the scheduler: no longer pending, and not planned again by a
        late :meth:`prepare` until it is released (:meth:`release`, :meth:`forget`)."""
        with self._cond:
            self._unhold(self._pending.pop(request_id, None))
            self._handed[request_id] = None
            while len(self._handed) > HANDED_MAX:
                self._handed.popitem(last=False)

    def deciding(self, request_id: str) -> bool:
        """Whether the request's plan is queued, running, or decided and not yet asked for."""
        with self._cond:
            return request_id in self._pending

    def forget(self, request_id: str) -> None:
        """A request whose plan may still be deciding ended (aborted, finished before admission): a plan
        not started is dropped; one running or decided is released (its reserved output slot freed)."""
        with self._cond:
            self._handed.pop(request_id, None)
            pending = self._pending.pop(request_id, None)
            if pending is None:
                return
            self._unhold(pending)
            job = pending[1]
            if job in self._queue:  # never started: nothing to release
                self._queue.remove(job)
                job.future.cancel()
                self._cond.notify_all()
                return

        def release_when_decided() -> None:
            if job.future.exception() is None:  # runs after the plan: the thread is one
                self.sharing.release(job.future.result())

        self._submit("record", job.task, release_when_decided)

    # --------------------------------------------------------------------- record
    def record(
        self,
        plan: Plan,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        output_ids: list[int],
        stop_ids: set[int],
        then: Callable[[Plan], None] | None = None,
    ) -> None:
        """Record a finished request (queued; the task's later plans wait for it); ``then(plan)`` runs
        after it on the same thread (the connector writes the request's report there)."""
        self._submit(
            "record",
            _task_of_plan(plan),
            self._settling(_then(functools.partial(self.sharing.record, settle=False), then)),
            plan,
            keys,
            values,
            list(output_ids),
            set(stop_ids),
        )

    def _settling(self, record: Callable[..., None]) -> Callable[..., None]:
        """``record(plan, ...)``, then what it left for later queued as settle jobs (run at once inline)."""

        def run(plan: Plan, *args: Any) -> None:
            try:
                record(plan, *args)
            finally:
                deferred, plan.deferred = plan.deferred, []
                for work in deferred:
                    self._submit("settle", None, self.sharing.settle, work)

        return run

    def release(self, plan: Plan, then: Callable[[Plan], None] | None = None) -> None:
        """A planned request that will not be recorded (``then`` as :meth:`record`'s); it may be
        planned again (a request that waits for a producer's record)."""
        with self._cond:
            self._handed.pop(plan.request_id, None)
        self._submit("record", _task_of_plan(plan), _then(self.sharing.release, then), plan)

    # ------------------------------------------------------------------- reading
    def summary(self) -> dict[str, Any]:
        """The store's :meth:`Sharing.state_summary` as of the last finished job (never waits for one
        in progress), with this object's own counts."""
        with self._summary_lock:
            summary = dict(self._summary)
        summary["background"] = self.enabled
        summary["queued_jobs"] = self.queued()
        summary["deferred_queries"] = self.deferred_queries
        with self._cond:
            summary["planned_bytes"] = self.planned_bytes
        summary["max_planned_bytes"] = self.max_planned_bytes
        summary["plans_dropped_for_bytes"] = self.plans_dropped_for_bytes
        return summary

    def queued(self) -> int:
        """Jobs submitted and not finished (0 when running inline)."""
        with self._cond:
            return len(self._queue) + (self._running is not None)

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every job submitted so far has run (tests; shutdown)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._queue and self._running is None, timeout):
                raise TimeoutError(
                    f"the admission thread did not finish its {len(self._queue)} queued jobs in {timeout} s"
                )

    def close(self, timeout: float = 60.0) -> None:
        """Run what is queued, then stop the thread."""
        if self._thread is None:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ internals
    def _submit(self, kind: str, task: str | None, fn, *args: Any) -> None:
        if self._thread is None:
            fn(*args)
            self._refresh()
        else:
            self._enqueue(kind, task, fn, *args)

    def _enqueue(self, kind: str, task: str | None, fn, *args: Any) -> _Job:
        job = _Job(kind, task, fn, args, Future())
        with self._cond:
            if self._closed:
                raise RuntimeError("the admission thread is closed")
            self._queue.append(job)
            self._cond.notify_all()
        return job

    def _next(self) -> _Job:
        """The job to run now (the queue is not empty; called under the condition's lock)."""
        records = [job for job in self._queue if job.kind == "record"]
        settles = [job for job in self._queue if job.kind == "settle"]
        if len(records) > self.max_queued_records:
            return records[0]
        if len(settles) > self.max_queued_records:
            return settles[0]
        ended: set[str | None] = set()  # tasks with a record queued before the job looked at
        blocked: list[str | None] = []
        for job in self._queue:
            if job.kind == "settle":
                continue  # ends no request: waited for by nothing
            if job.kind == "record":
                ended.add(job.task)
            elif job.task is None or job.task not in ended:
                return job  # the oldest plan free to run
            else:
                blocked.append(job.task)
        if blocked:  # the record the oldest blocked plan waits for
            return next(job for job in records if job.task == blocked[0])
        return records[0] if records else self._queue[0]  # settles last

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:  # closed and drained
                    return
                job = self._next()
                self._queue.remove(job)
                self._running = job
            if job.future.set_running_or_notify_cancel():
                job.started_at = time.perf_counter()
                try:
                    result = job.fn(*job.args)
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the job
                    job.ended_at = time.perf_counter()
                    job.future.set_exception(error)
                    if job.kind != "plan":
                        logger.exception("hf_kvshare: a background %s job failed", job.kind)
                else:
                    job.ended_at = time.perf_counter()
                    if job.kind == "plan":
                        self._hold(job, result)
                    job.future.set_result(result)
                self._waited(job, job.started_at, job.ended_at)
            started = time.perf_counter()
            self._refresh()
            self._waited(None, started, time.perf_counter())
            with self._cond:
                self._running = None
                self._cond.notify_all()

    def _hold(self, job: _Job, plan: Plan) -> None:
        """A decided plan's K/V held until it is handed out, against ``max_planned_bytes``: a plan
        decided ahead that would pass it is dropped (released here, on the thread) and its request
        planned at its admission query instead (not ahead again); one vLLM asked for is kept."""
        nbytes = held_bytes(plan)
        with self._cond:
            pending = self._pending.get(plan.request_id)
            if pending is None or pending[1] is not job:  # forgotten meanwhile
                return
            asked = pending[0][1] is not None
            if asked or self.planned_bytes + nbytes <= self.max_planned_bytes:
                job.held = nbytes
                self.planned_bytes += nbytes
                return
            del self._pending[plan.request_id]
            self._handed[plan.request_id] = None  # not planned ahead again (prepare)
            self.plans_dropped_for_bytes += 1
        logger.warning(
            "hf_kvshare: request %s's plan, decided ahead, dropped: its %d bytes of K/V would pass "
            "planned_bytes (%d; %d held); planned again at its admission",
            plan.request_id,
            nbytes,
            self.max_planned_bytes,
            self.planned_bytes,
        )
        self.sharing.release(plan)

    def _unhold(self, pending: tuple[Any, _Job] | None) -> None:
        """A decided plan handed out or forgotten: its K/V no longer count (under the condition's lock)."""
        if pending is not None:
            self.planned_bytes -= pending[1].held
            pending[1].held = 0

    def _waited(self, ran: _Job | None, started: float, ended: float) -> None:
        """The plans still queued waited behind ``ran`` (``None``: the summary's refresh) from
        ``started`` (or from their submission, if later) to ``ended``."""
        with self._cond:
            for waiting in self._queue:
                if waiting.kind == "plan" and ended > waiting.queued_at:
                    kind = "summary" if ran is None else _behind_kind(ran, waiting)
                    seconds = ended - max(started, waiting.queued_at)
                    waiting.behind[kind] = waiting.behind.get(kind, 0.0) + seconds

    def _refresh(self) -> None:
        try:
            summary = self.sharing.state_summary()
        except Exception:  # noqa: BLE001 - a summary must not stop the engine
            logger.exception("hf_kvshare: reading the store's summary failed")
            return
        with self._summary_lock:
            self._summary = summary


def _then(fn: Callable[..., None], then: Callable[[Plan], None] | None) -> Callable[..., None]:
    """``fn(plan, ...)``, then ``then(plan)`` (even when ``fn`` failed: a report is still written)."""
    if then is None:
        return fn

    def both(plan: Plan, *args: Any) -> None:
        try:
            fn(plan, *args)
        finally:
            then(plan)

    return both


def held_bytes(plan: Plan) -> int:
    """The bytes of K/V a decided plan holds: its claim's and its placements' (what a deferred K/V is
    computed from; a ``meta`` stand-in holds none)."""
    tensors = [t for t in (plan.keys, plan.values) if isinstance(t, torch.Tensor)]
    for placement in plan.placements:
        if placement is not None:
            stored = placement.kv.stored
            tensors += [*stored.keys, *stored.values]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def task_of(params: Any) -> str | None:
    """The task a request's layout names (``None`` when it does not parse: its plan fails fast)."""
    try:
        return lay.parse(params).task
    except Exception:  # noqa: BLE001 - the plan itself reports the layout's error
        return None


def _task_of_plan(plan: Plan) -> str | None:
    return plan.host.task if plan.host is not None else None

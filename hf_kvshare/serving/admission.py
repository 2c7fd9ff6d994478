"""The method's admission and recording off vLLM's engine loop.

vLLM's scheduler asks the connector at admission how many tokens it supplies
(``get_num_new_matched_tokens``) and hands it every finished request's K/V
(``update_connector_output``). Deciding a claim (a KVCMAS gate, its token weights and the corrected
K/V) and recording a turn (the observed deltas factorized for the anchor pools) take far longer than a
decode step; run inline they stop the whole engine — every other request's prefill and decode waits.

:class:`Background` runs them on one thread of its own, in the order the engine asked for them (a
plan submitted after a record sees that record, as a Session's next turn sees the last one): the
connector answers "not decided yet" (vLLM's ``None``: the scheduler skips the request this step and
asks again) until the plan is ready, and a record is queued and returns at once. The engine keeps
stepping the other requests meanwhile; torch's kernels release the GIL, so the method's work runs
beside vLLM's forward (on another core when there is one). ``enabled=False`` runs everything inline
(the earlier behaviour), for comparison and debugging.

No vLLM import here (tests drive it with a plain :class:`~hf_kvshare.serving.host.Sharing`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from .host import Plan, Sharing

logger = logging.getLogger("hf_kvshare.serving")

#: how long one admission query waits for a plan being decided before it answers "not yet" (seconds):
#: bounds the engine loop's spinning while the plan is the only work, and costs the other requests at
#: most this per step
DEFAULT_WAIT_S = 0.002


class Background:
    """Plans, records and releases of a :class:`Sharing`, run in order on one background thread.

    Only the engine's scheduler thread calls this object (vLLM's scheduler side is one thread); the
    background thread only runs :class:`Sharing` calls, which take its lock."""

    def __init__(self, sharing: Sharing, *, enabled: bool = True, wait_s: float = DEFAULT_WAIT_S):
        if not isinstance(enabled, bool):
            raise TypeError(f"background must be true or false; got {enabled!r}")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= 1:
            raise ValueError(f"plan_wait_s must be a number of seconds in [0, 1]; got {wait_s!r}")
        self.sharing = sharing
        self.enabled = enabled
        self.wait_s = float(wait_s)
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_kvshare") if enabled else None
        )
        self._pending: dict[str, tuple[tuple[int, float], Future]] = {}  # id -> ((hit, asked at), plan)
        self._jobs = 0  # submitted and not finished
        self._summary_lock = threading.Lock()
        self._summary: dict[str, Any] = sharing.state_summary()
        #: admission queries answered "not decided yet" (the scheduler asked again later)
        self.deferred_queries = 0

    # ------------------------------------------------------------------ admission
    def plan(self, request_id: str, prompt: list[int], params: Any, local_hit: int) -> Plan | None:
        """The request's plan, or ``None`` while it is still being decided (ask again)."""
        if self._executor is None:
            plan = self.sharing.plan(request_id, prompt, params, local_hit)
            self._refresh()
            return plan
        pending = self._pending.get(request_id)
        if pending is not None and pending[0][0] != local_hit:  # vLLM's own hit changed: decide again
            self.forget(request_id)
            pending = None
        if pending is None:
            future = self._enqueue(self.sharing.plan, request_id, list(prompt), params, local_hit)
            pending = self._pending[request_id] = ((local_hit, time.perf_counter()), future)
        (_, asked), future = pending
        try:
            plan = future.result(timeout=self.wait_s)
        except FutureTimeout:
            self.deferred_queries += 1
            return None
        except Exception as error:  # noqa: BLE001 - Sharing.plan never raises; the engine must keep running
            logger.exception("hf_kvshare: planning request %s failed", request_id)
            plan = Plan(request_id=request_id, prompt=list(prompt), local_hit=local_hit)
            plan.error = f"{type(error).__name__}: {error}"
        del self._pending[request_id]
        plan.admission_wait_s = time.perf_counter() - asked
        return plan

    def forget(self, request_id: str) -> None:
        """A request whose plan may still be deciding ended (aborted, finished before admission): the
        plan, once decided, is released (its reserved output slot freed)."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        future = pending[1]

        def release_when_decided() -> None:
            if future.exception() is None:  # decided before this job: the queue is in order
                self.sharing.release(future.result())

        self._submit(release_when_decided)

    # --------------------------------------------------------------------- record
    def record(
        self,
        plan: Plan,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        output_ids: list[int],
        stop_ids: set[int],
    ) -> None:
        """Record a finished request (queued behind the plans and records asked for before it)."""
        self._submit(self.sharing.record, plan, keys, values, list(output_ids), set(stop_ids))

    def release(self, plan: Plan) -> None:
        """A planned request that will not be recorded."""
        self._submit(self.sharing.release, plan)

    # ------------------------------------------------------------------- reading
    def summary(self) -> dict[str, Any]:
        """The store's :meth:`Sharing.state_summary` as of the last finished job (never waits for one
        in progress), with this object's own counts."""
        with self._summary_lock:
            summary = dict(self._summary)
        summary["background"] = self.enabled
        summary["queued_jobs"] = self.queued()
        summary["deferred_queries"] = self.deferred_queries
        return summary

    def queued(self) -> int:
        """Jobs submitted and not finished (0 when running inline)."""
        with self._summary_lock:
            return self._jobs

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every job submitted so far has run (tests; shutdown)."""
        if self._executor is None:
            return
        self._executor.submit(lambda: None).result(timeout=timeout)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ internals
    def _submit(self, fn, *args: Any) -> None:
        if self._executor is None:
            fn(*args)
            self._refresh()
        else:
            self._enqueue(fn, *args)

    def _enqueue(self, fn, *args: Any) -> Future:
        with self._summary_lock:
            self._jobs += 1
        return self._executor.submit(self._job, fn, *args)

    def _job(self, fn, *args: Any):
        try:
            return fn(*args)
        finally:
            self._refresh()
            with self._summary_lock:
                self._jobs -= 1

    def _refresh(self) -> None:
        try:
            summary = self.sharing.state_summary()
        except Exception:  # noqa: BLE001 - a summary must not stop the engine
            logger.exception("hf_kvshare: reading the store's summary failed")
            return
        with self._summary_lock:
            self._summary = summary

"""Worker-side replicas of the scheduler's :class:`~hf_kvshare.serving.host.Sharing` under tensor parallel
(issue 51 items 1+2): every worker rank runs the value-reading method (KVCMAS, KVComm) on its own KV
heads (under pipeline parallel: of its stage's layers; :func:`stage_shard`), in lockstep with the other
ranks, driven by an ordered stream of operations from the scheduler.

- **The op stream** (scheduler side, :class:`OpStream`): every :class:`Sharing` call the scheduler's
  admission thread makes that changes the engine (a plan, a claim, a release, a record, a settle) is numbered
  under one lock and queued for every rank's order channel (:mod:`.channel`), then run on the
  scheduler's Sharing (:class:`Lockstep`, what :class:`~.admission.Background` calls). After each, a
  ``check`` op carries the scheduler's decision (:func:`decision`: claims, placements, gate outcomes;
  metadata only). An op is JSON: no tensor ever travels in one. Ops wait in a bounded backlog until
  every rank's order channel is connected and took them (a refused send is retried at the next op or
  step, in order); past the backlog's bound the stream stops and says so.
- **A replica** (worker side, :class:`Replica`): a Sharing whose model skeleton has the rank's KV heads
  and whose method runs on a :class:`~hf_kvshare.anchors.sharded.Shard` of the tensor-parallel group
  (``run_on_shard``; the group: :func:`~hf_kvshare.anchors.sharded.tensor_parallel_groups`). Its thread runs the ops strictly in
  number order (early arrivals buffered): the same calls with the same arguments on every rank, so
  every rank's collectives pair up. A record runs on the rank's own heads of the request's read-back,
  kept for it by the worker (:meth:`Replica.keep`, by bytes). A record's deferred work (its anchors'
  factorizations, :attr:`Plan.deferred`) is not settled at the record: the scheduler's admission thread
  runs each part as a settle job when no plan waits (:mod:`.admission`), numbered first as a ``settle``
  op (the request and the part's index), and each replica keeps its record's parts (weak references:
  no bytes) and runs the numbered one at that op, so every rank factorizes at the same op number. A
  plan that reads an anchor still deferred factorizes it inside the plan op (every rank alike); the
  later settle is then a no-op everywhere. A ``check`` compares the replica's decision with
  the scheduler's: ``agree`` / ``differ`` counted (and a difference logged), which the worker reports
  with its step output. A claim's K/V are the replica's (:meth:`Replica.claim_of`: the worker writes its
  heads of them; the step metadata says only "from your replica").
- **The follower** (scheduler side): the scheduler's Sharing holds no K/V (``meta`` stand-ins of every
  head, the workers send stand-ins of their read-backs) and takes every reduced value a decision reads
  from the leader, rank 0, whose ``Shard.publish`` sends each on the read-back channel
  (:class:`Published`, :func:`follower_shard`). A follower that left its leader's path (a value of
  another shape, none within ``wait_s``) stops the stream (:class:`Lockstep`): nothing more is shared,
  never a hang.

A replica that cannot go on in step (an op missing past ``wait_s`` while later ones wait, a record whose
read-back never came, a record that left another count of deferred parts than the scheduler's, a settle
of a part it does not hold or out of order, an op it cannot run) stops, logs why and says so in its counts (``stopped``):
the engine never waits for it (it runs on its own thread; a claim it cannot give is reported as failed
blocks, which vLLM recomputes), and the scheduler claims nothing more once it hears of it. No vLLM
import (tests drive it on gloo ranks).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .host import VALUE_FREE, Plan, Sharing
from .worker_store import PayloadBuffer

logger = logging.getLogger("hf_kvshare.serving")

#: the ops of the stream (an op is a JSON object: ``op``, ``seq`` and its fields, never a tensor)
OPS = ("plan", "claim", "release", "record", "check", "settle")
#: how long a replica waits for a missing op number while later ones wait, or for a record's read-back,
#: before it stops (seconds)
DEFAULT_WAIT_S = 30.0
#: the ops the scheduler holds for ranks that have not taken them yet before the stream stops
MAX_BACKLOG = 4096
#: the read-backs a worker holds for its replica's records (``replica_read_back_bytes``)
DEFAULT_READ_BACK_BYTES = 1 << 30
#: the key of ``kv_connector_extra_config`` that turns the replicas off (``false``: the RankAssembly path)
OPTION = "worker_replicas"
#: the leader's published values the scheduler holds for its follower before the stream stops
MAX_PUBLISHED = 1 << 16


def reads_values(method: Any) -> bool:
    """Whether the configured method (``kvcmas``, ``kvcmas:...``; ``None``: nonshared) reads K/V values
    (not :data:`VALUE_FREE`): what needs the read-backs, or the replicas under tensor or pipeline parallel."""
    return str(method or "nonshared").split(":")[0] not in VALUE_FREE


def wants_replicas(method: Any, tp_size: int, pp_size: int, extra: dict[str, Any]) -> bool:
    """Whether a server runs worker replicas: a value-reading method (not :data:`VALUE_FREE`) at tensor
    or pipeline parallel > 1 (a replica per rank's KV heads: :func:`rank_shard`; per stage's layers:
    :func:`stage_shard`; per rank's KV heads of its stage's layers at both), with the admission thread
    and the read-back channel (the leader's values reach the follower on it), unless
    ``worker_replicas: false``. Decided alike by the scheduler and every worker from the same
    configuration."""
    wanted = extra.get(OPTION, True)
    if not isinstance(wanted, bool):
        raise ValueError(f"{OPTION} must be true or false; got {wanted!r}")
    channels = (
        extra.get("background", True) is not False and extra.get("read_back_channel", True) is not False
    )
    return wanted and channels and tp_size * pp_size > 1 and reads_values(method)


def rank_shard(
    tp_size: int, width: int, replicas: int, timeout_s: float, publish: Callable[[torch.Tensor], None] | None
) -> Any:
    """This worker rank's :class:`~hf_kvshare.anchors.sharded.Shard` of the KV heads (``width``: its
    heads times the head size) over its tensor-parallel group, made now by every rank of the world in the
    same order (:func:`~hf_kvshare.anchors.sharded.tensor_parallel_groups`; call it at start-up, on every
    rank); ``publish`` (the leader's, rank 0's): where each reduced value goes, for the scheduler's
    follower. With :func:`stage_shard` and :func:`follower_shard`, the serving side's only reach into the
    anchors engine (``tests/test_layout.py``)."""
    from ..anchors.sharded import Shard, tensor_parallel_groups

    return Shard(tensor_parallel_groups(tp_size, timeout_s), width, replicas, publish=publish)


def stage_shard(
    pp_size: int,
    start: int,
    stop: int,
    layers: int,
    timeout_s: float,
    publish: Callable[[torch.Tensor], None] | None,
    *,
    tp_size: int = 1,
    width: int = 0,
    replicas: int = 1,
) -> Any:
    """This worker's :class:`~hf_kvshare.anchors.sharded.StageShard`: its pipeline stage's layers
    ``[start, stop)`` of the model's ``layers``, over its pipeline-parallel group, every head of them at
    tensor parallel 1, else (``tp_size`` > 1) its KV heads (``width``, ``replicas``: as
    :func:`rank_shard`'s) over its stage's tensor-parallel group; the groups made now by every rank of
    the world in the same order (the tensor-parallel ones first:
    :func:`~hf_kvshare.anchors.sharded.tensor_parallel_groups`,
    :func:`~hf_kvshare.anchors.sharded.pipeline_parallel_groups`; at start-up, on every rank);
    ``publish``: world rank 0's (stage 0's first rank), as :func:`rank_shard`'s."""
    from ..anchors.sharded import Shard, StageShard, pipeline_parallel_groups, tensor_parallel_groups

    heads = Shard(tensor_parallel_groups(tp_size, timeout_s), width, replicas) if tp_size > 1 else None
    group = pipeline_parallel_groups(tp_size, pp_size, timeout_s)
    return StageShard(group, start, stop, layers, publish=publish, heads=heads)


def follower_shard(receive: Callable[[], torch.Tensor]) -> Any:
    """The scheduler's :class:`~hf_kvshare.anchors.sharded.FollowerShard`: every reduced value a decision
    reads taken from ``receive`` (:meth:`Published.take`)."""
    from ..anchors.sharded import FollowerShard

    return FollowerShard(receive)


class Published:
    """The leader replica's published values on the scheduler (:meth:`put`: the read-back channel's
    thread), taken in order by the follower (:meth:`take`, its ``FollowerShard``'s ``receive``) within
    ``wait_s``: past it, or past :data:`MAX_PUBLISHED` values waiting, the follower has left its
    leader's path (``FollowerDiverged``): the scheduler's :class:`Lockstep` stops, never a hang."""

    def __init__(self, wait_s: float = DEFAULT_WAIT_S, max_values: int = MAX_PUBLISHED):
        self.wait_s = float(wait_s)
        self._values: queue.Queue[torch.Tensor] = queue.Queue(max_values)
        #: values received and their bytes, and values that found the queue full
        self.counts = {"values": 0, "bytes": 0, "overflow": 0}

    def put(self, value: torch.Tensor) -> None:
        try:
            self._values.put_nowait(value)
        except queue.Full:
            self.counts["overflow"] += 1
            return
        self.counts["values"] += 1
        self.counts["bytes"] += value.numel() * value.element_size()

    def take(self) -> torch.Tensor:
        from ..anchors.sharded import FollowerDiverged

        if self.counts["overflow"]:
            raise FollowerDiverged(
                f"{self.counts['overflow']} of the leader's values were dropped (queue full)"
            )
        try:
            return self._values.get(timeout=self.wait_s)
        except queue.Empty:
            raise FollowerDiverged(f"no value from the leader replica within {self.wait_s:g} s") from None


def decision(plan: Plan) -> dict[str, Any]:
    """What a plan decided, as metadata: its claim, each span's placement (provenance and source agent,
    ``None``: not placed) and gate outcome, and whether it failed."""
    return {
        "error": plan.error is not None,
        "claim": [plan.claim_start, plan.claim_end],
        "placed": [None if p is None else [p.provenance, p.source_agent] for p in plan.placements],
        "gates": {name: gate.get("gate") for name, gate in sorted(plan.gates.items())},
    }


class OpStream:
    """The scheduler's end of the op stream: :meth:`op` numbers one op under the lock and sends the
    backlog, in order, to every rank connected (:meth:`connect`); ops wait until all ``size`` ranks are
    connected and took them (a refused send is retried by the next :meth:`op` or :meth:`flush`)."""

    def __init__(self, size: int, max_backlog: int = MAX_BACKLOG):
        self.size = size
        self.max_backlog = max_backlog
        self._lock = threading.Lock()
        self._senders: dict[int, Any] = {}
        self._backlog: list[dict[str, Any]] = []  # ops from number ``_first`` on, not yet taken by all
        self._first = 0
        self._taken: dict[int, int] = {}  # rank -> ops it took (numbers below it)
        self.numbered = 0
        #: why the stream stopped (``None``: running)
        self.stopped: str | None = None

    def connect(self, rank: int, sender: Any) -> None:
        """Rank ``rank``'s order channel (a :class:`~.channel.Sender`): it gets every op from the first."""
        with self._lock:
            self._senders[rank] = sender
            self._taken.setdefault(rank, 0)
            self._flush()

    def op(self, kind: str, **fields: Any) -> None:
        """Number one op (:data:`OPS`) and send what every rank has not taken yet."""
        if kind not in OPS:
            raise ValueError(f"not an op: {kind!r}")
        with self._lock:
            if self.stopped:
                return
            op = {"op": kind, "seq": self.numbered, **fields}
            try:
                json.dumps(op)
            except (TypeError, ValueError) as error:
                self._stop(f"op {self.numbered} ({kind}) is not JSON: {error}")
                return
            self._backlog.append(op)
            self.numbered += 1
            if len(self._backlog) > self.max_backlog:
                self._stop(
                    f"{len(self._backlog)} ops wait for a rank's order channel (max {self.max_backlog})"
                )
                return
            self._flush()

    def flush(self) -> None:
        """Send what waits (the scheduler calls it each step)."""
        with self._lock:
            if not self.stopped:
                self._flush()

    def _flush(self) -> None:
        for rank, sender in self._senders.items():
            while self._taken[rank] < self.numbered:
                op = self._backlog[self._taken[rank] - self._first]
                if not sender.order(op):
                    break  # full or not connected: retried next time, in order
                self._taken[rank] += 1
        if len(self._senders) >= self.size:
            done = min(self._taken.values()) - self._first
            del self._backlog[:done]
            self._first += done

    def stop(self, why: str) -> None:
        """Stop the stream (nothing more is sent; the replicas idle)."""
        with self._lock:
            if not self.stopped:
                self._stop(why)

    def _stop(self, why: str) -> None:
        self.stopped = why
        self._backlog.clear()
        logger.error("hf_kvshare: the replicas' op stream stopped: %s; nothing more is shared", why)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {"ops": self.numbered, "waiting": len(self._backlog), "stopped": self.stopped}


@dataclass(frozen=True)
class Part:
    """Part ``index`` of request ``request_id``'s record's deferred work (:attr:`Plan.deferred`, in its
    order), as :meth:`Lockstep.record` leaves it: run by calling it, numbered by :meth:`Lockstep.settle`."""

    request_id: str
    index: int
    work: Callable[[], None]

    def __call__(self) -> None:
        self.work()


class Lockstep:
    """The scheduler's :class:`Sharing` as :class:`~.admission.Background` calls it, every call that
    changes the engine first numbered on the op stream (:class:`OpStream`), then run, then its decision
    sent as a ``check``. Numbering and running are two steps: the admission thread runs plans, records
    and releases in its order; a claim (vLLM's scheduler thread) changes nothing a later op reads and
    reads no published value. A record leaves its deferred work to the caller as numbered parts
    (:class:`Part`): :meth:`settle` numbers each as a ``settle`` op, then runs it, so every replica runs
    the same part at the same op number (the final ``check`` of the record says how many it left).

    A follower that left its leader's path (the method's ``fatal_errors``: a value of another shape, or
    none within the wait) stops the stream: from then on every plan claims nothing and a record is
    released (serving goes on without sharing; logged, the summary says why)."""

    def __init__(self, sharing: Sharing, stream: OpStream):
        self.sharing = sharing
        self.stream = stream
        self._fatal = tuple(getattr(sharing.method, "fatal_errors", ()))

    def plan(self, request_id: str, prompt: list[int], params: Any, local_hit: int | None) -> Plan:
        if self.stream.stopped:
            return self._refused(request_id, prompt, local_hit)
        self.stream.op("plan", request_id=request_id, prompt=list(prompt), params=params, local_hit=local_hit)
        try:
            plan = self.sharing.plan(request_id, prompt, params, local_hit)
        except self._fatal as error:
            self.stream.stop(f"the scheduler's follower left its leader's path: {error}")
            return self._refused(request_id, prompt, local_hit)
        self.stream.op("check", request_id=request_id, decision=decision(plan))
        return plan

    def claim(self, plan: Plan, local_hit: int) -> Plan:
        if plan.turn is None or self.stream.stopped:
            plan.local_hit = int(local_hit)  # nothing claimed
            return plan
        self.stream.op("claim", request_id=plan.request_id, local_hit=int(local_hit))
        self.sharing.claim(plan, local_hit)
        self.stream.op("check", request_id=plan.request_id, decision=decision(plan))
        return plan

    def release(self, plan: Plan) -> None:
        self.stream.op("release", request_id=plan.request_id)
        self.sharing.release(plan)

    def record(
        self, plan: Plan, keys: Any, values: Any, output_ids: list[int], stop_ids: set[int], **_: Any
    ) -> None:
        if plan.turn is None:
            return
        if self.stream.stopped:
            self.sharing.release(plan)
            return
        self.stream.op(
            "record", request_id=plan.request_id, output_ids=list(output_ids), stop_ids=sorted(stop_ids)
        )
        try:
            self.sharing.record(plan, keys, values, output_ids, stop_ids, settle=False)
        except self._fatal as error:
            self.stream.stop(f"the scheduler's follower left its leader's path: {error}")
            plan.error = f"record: {type(error).__name__}: {error}"
            return
        plan.deferred = [Part(plan.request_id, i, work) for i, work in enumerate(plan.deferred)]
        self.stream.op(
            "check",
            request_id=plan.request_id,
            decision=decision(plan),
            final=True,
            deferred=len(plan.deferred),
        )

    def settle(self, work: Callable[[], None]) -> None:
        """One part of a record's deferred work (:attr:`Plan.deferred`): a :class:`Part` is numbered as a
        ``settle`` op first (once the stream stopped, it only runs here)."""
        if isinstance(work, Part):
            self.stream.op("settle", request_id=work.request_id, index=work.index)
        try:
            self.sharing.settle(work)
        except self._fatal as error:
            self.stream.stop(f"the scheduler's follower left its leader's path: {error}")

    def state_summary(self) -> dict[str, Any]:
        return {**self.sharing.state_summary(), "op_stream": self.stream.summary()}

    def _refused(self, request_id: str, prompt: list[int], local_hit: int | None) -> Plan:
        plan = Plan(request_id=request_id, prompt=list(prompt), local_hit=local_hit)
        plan.error = f"sharing stopped: {self.stream.stopped}"
        return plan


class Replica:
    """A worker rank's replica (the module docstring): :meth:`submit` takes ops from any thread (the
    order channel's), its own thread runs them in number order on ``sharing``; :meth:`keep` holds the
    rank's read-back of a finished request for its record op, within ``max_bytes``; a record's deferred
    parts wait for their ``settle`` ops (as many as the scheduler's record left, run in order)."""

    def __init__(
        self, sharing: Sharing, *, wait_s: float = DEFAULT_WAIT_S, max_bytes: int = DEFAULT_READ_BACK_BYTES
    ):
        self.sharing = sharing
        self.wait_s = float(wait_s)
        self.read_backs = PayloadBuffer(max_bytes)
        self._plans: dict[str, Plan] = {}
        #: request id -> (claim start, keys, values) of the replica's claim (``None`` K/V: it claims
        #: nothing), until the worker's step that writes it takes it (:meth:`claim_of`) or the request ends
        self._claims: dict[str, tuple[int, torch.Tensor | None, torch.Tensor | None]] = {}
        #: request id -> its record's deferred parts (:attr:`Plan.deferred`: weak references, no bytes)
        #: and how many of them ran, until its last ``settle`` op
        self._deferred: dict[str, tuple[list[Callable[[], None]], int]] = {}
        self._ops: dict[int, dict[str, Any]] = {}
        self._next = 0
        self._cond = threading.Condition()
        self._closed = False
        #: ops run, checks that agreed with the scheduler's decision and that differed, read-backs the
        #: budget dropped, and why the replica stopped (``None``: running)
        self.counts: dict[str, Any] = {"ops": 0, "agree": 0, "differ": 0, "dropped": 0, "stopped": None}
        self._thread = threading.Thread(target=self._work, name="hf_kvshare-replica", daemon=True)
        self._thread.start()

    def submit(self, op: dict[str, Any]) -> None:
        """One op of the stream (any order; a number already run or held is ignored)."""
        seq = op.get("seq")
        if op.get("op") not in OPS or isinstance(seq, bool) or not isinstance(seq, int):
            raise ValueError(f"not an op of the stream: {op!r}")
        with self._cond:
            if seq >= self._next and seq not in self._ops:
                self._ops[seq] = op
                self._cond.notify_all()

    def keep(self, request_id: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The rank's read-back of a finished request, for its record op."""
        dropped = self.read_backs.put(request_id, keys, values)
        if dropped:
            self.counts["dropped"] += len(dropped)
            logger.error("hf_kvshare: the replica's read-back budget dropped %s", dropped)

    def claim_of(
        self, request_id: str, timeout: float
    ) -> tuple[tuple[int, torch.Tensor | None, torch.Tensor | None] | None, str]:
        """The replica's claim of a request, ``(start, keys, values)`` with this rank's heads
        (``[layers, claimed, heads, head_dim]``; ``None``: it claims nothing), waiting up to ``timeout``
        seconds for its plan or claim op to run, and why there is none (``""`` when there is)."""
        with self._cond:
            self._cond.wait_for(lambda: request_id in self._claims or self.counts["stopped"], timeout)
            if request_id in self._claims:
                return self._claims.pop(request_id), ""
            if self.counts["stopped"]:
                return None, f"this rank's replica stopped ({self.counts['stopped']})"
            return None, f"its plan did not run on this rank's replica within {timeout:g} s"

    def done(self, ops: int, timeout: float) -> bool:
        """Wait until the first ``ops`` ops have run (or the replica stopped); whether they did."""
        with self._cond:
            self._cond.wait_for(lambda: self._next >= ops or self.counts["stopped"], timeout)
            return self._next >= ops

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            with self._cond:
                # idle (nothing waiting) is normal; a gap (later ops waiting, this one missing) is bounded
                ready = self._cond.wait_for(lambda: self._next in self._ops or self._closed, self.wait_s)
                if self._closed:
                    return
                if not ready:
                    if self._ops:
                        self._stop(f"op {self._next} never came within {self.wait_s:g} s")
                        return
                    continue
                op = self._ops.pop(self._next)
            try:
                self._run(op)
            except Exception as error:  # noqa: BLE001 - the engine must keep running
                logger.exception("hf_kvshare: the replica could not run op %s", op.get("seq"))
                self._stop(f"op {op['seq']} ({op['op']}): {type(error).__name__}: {error}")
                return
            with self._cond:
                self._next += 1
                self.counts["ops"] += 1
                self._cond.notify_all()

    def _stop(self, why: str) -> None:
        with self._cond:
            self.counts["stopped"] = why
            self._cond.notify_all()
        logger.error("hf_kvshare: this rank's replica stopped: %s", why)

    def _run(self, op: dict[str, Any]) -> None:
        kind, request_id = op["op"], str(op["request_id"])
        if kind == "plan":
            plan = self._plans[request_id] = self.sharing.plan(
                request_id, list(op["prompt"]), op["params"], op["local_hit"]
            )
            if plan.local_hit is not None:
                self._claimed(plan)
        elif kind == "claim":
            self._claimed(self.sharing.claim(self._plan(request_id), int(op["local_hit"])))
        elif kind == "release":
            plan = self._plans.pop(request_id, None)
            self.read_backs.take(request_id, 0)
            self._forget_claim(request_id)
            if plan is not None:
                self.sharing.release(plan)
        elif kind == "record":
            self._forget_claim(request_id)
            plan = self._plan(request_id)
            kv, missing = self.read_backs.take(request_id, self.wait_s)
            if kv is None:
                raise RuntimeError(f"request {request_id}'s read-back {missing}")
            if request_id in self._deferred:
                raise RuntimeError(f"request {request_id} recorded again while its deferred parts wait")
            self.sharing.record(plan, kv[0], kv[1], list(op["output_ids"]), set(op["stop_ids"]), settle=False)
            deferred, plan.deferred = plan.deferred, []
            if deferred:  # run one by one at the settle ops
                self._deferred[request_id] = (deferred, 0)
        elif kind == "check":
            self._check(request_id, op["decision"], op.get("final", False))
            if "deferred" in op:  # the record's: as many parts as the scheduler's left, or out of step
                mine = len(self._deferred.get(request_id, ((), 0))[0])
                if mine != op["deferred"]:
                    raise RuntimeError(
                        f"request {request_id}'s record left {mine} deferred parts here, "
                        f"{op['deferred']} on the scheduler"
                    )
        elif kind == "settle":
            self._settle(request_id, op["index"])

    def _settle(self, request_id: str, index: Any) -> None:
        """Part ``index`` of the request's record's deferred work: the next one, in order (a part that
        fails here stops the replica: the other ranks' factorization went on without this rank's)."""
        parts, ran = self._deferred.get(request_id, ((), 0))
        if isinstance(index, bool) or index != ran or ran >= len(parts):
            held = f"part {ran} of {len(parts)} is next" if parts else "it holds none"
            raise RuntimeError(f"settle of part {index!r} of request {request_id}'s record: {held}")
        errors = self.sharing.errors
        self.sharing.settle(parts[index])
        if self.sharing.errors > errors:  # counted, not raised: but the other ranks' collectives ran
            raise RuntimeError(f"part {index} of request {request_id}'s record failed on this rank")
        if ran + 1 < len(parts):
            self._deferred[request_id] = (parts, ran + 1)
        else:
            del self._deferred[request_id]

    def _claimed(self, plan: Plan) -> None:
        """The plan's claim, for the worker's step that writes it (:meth:`claim_of`)."""
        keys = plan.keys if isinstance(plan.keys, torch.Tensor) and plan.claimed else None
        values = plan.values if keys is not None else None
        with self._cond:
            self._claims[plan.request_id] = (plan.claim_start, keys, values)
            self._cond.notify_all()

    def _forget_claim(self, request_id: str) -> None:
        with self._cond:
            self._claims.pop(request_id, None)

    def _plan(self, request_id: Hashable) -> Plan:
        plan = self._plans.get(request_id)
        if plan is None:
            raise RuntimeError(f"no plan of request {request_id} on this replica")
        return plan

    def _check(self, request_id: str, theirs: dict[str, Any], final: bool) -> None:
        plan = self._plans.pop(request_id, None) if final else self._plans.get(request_id)
        mine = None if plan is None else json.loads(json.dumps(decision(plan)))
        if mine == theirs:
            self.counts["agree"] += 1
            return
        self.counts["differ"] += 1
        logger.warning(
            "hf_kvshare: request %s: this rank's replica decided %s, the scheduler %s",
            request_id,
            mine,
            theirs,
        )

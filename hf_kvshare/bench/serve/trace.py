"""The request trace of ``bench serve``: the trace workload as served (:class:`ServeTrace`), its seeded
Poisson arrivals, the order a run's requests arrive in and whose reply each reads, the document-first
layout of a request, and the seeds of every run and warm-up (fresh documents each)."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...serving.client import ChatRequest

#: the two plain-vLLM rows (no connector): the real layout and the document-first upper bound
PLAIN, DOC_FIRST = "plain", "document-first"
BASELINES = (PLAIN, DOC_FIRST)
DEFAULT_METHODS = (PLAIN, DOC_FIRST, "fullshared")
MAX_REQUESTS = 2000  # per run: tasks x agents
#: the orders a run's requests arrive in (``--order``)
ORDERS = ("agent", "task")


def poisson_schedule(n: int, qps: float, seed: Any, max_duration: float | None = None) -> list[float]:
    """Arrival offsets (seconds from the run's start) of ``n`` requests of a Poisson process at ``qps``
    requests per second, seeded; the first arrives at 0. With ``max_duration``, arrivals after it
    are dropped (the list is shorter)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not (qps > 0 and math.isfinite(qps)):
        raise ValueError(f"qps must be a positive number, got {qps}")
    rng = random.Random(f"poisson:{seed}:{qps!r}")
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(qps)
        if max_duration is not None and t > max_duration:
            break
        times.append(t)
    return times


def run_seed(seed: int, *parts: Any) -> int:
    """A seed of its own for one run (method-independent: every method at a QPS reads the same
    documents), distinct across ``parts`` (repeat, QPS index, ...)."""
    text = "/".join(map(str, (seed, *parts)))
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


@dataclass(frozen=True)
class ServeTrace:
    """The trace workload as served: ``tasks`` tasks, each ``agents`` agents reading one shared
    document of ``shared_tokens`` tokens and every earlier reply, ``output_tokens`` per reply."""

    shared_tokens: int = 1024
    agents: int = 4
    tasks: int = 5
    output_tokens: int = 8

    def __post_init__(self) -> None:
        for name in ("shared_tokens", "agents", "tasks", "output_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        from ..workloads.trace import ROLES

        if self.agents > len(ROLES):
            raise ValueError(f"--agents: at most {len(ROLES)} agents (the trace's roles), got {self.agents}")
        if self.tasks * self.agents > MAX_REQUESTS:
            raise ValueError(
                f"--tasks x --agents = {self.tasks * self.agents} requests per run; at most {MAX_REQUESTS}"
            )

    def tag(self) -> str:
        return f"serve-S{self.shared_tokens}-N{self.agents}-T{self.tasks}-O{self.output_tokens}"

    def task_specs(self, tokenizer: Any, seed: int) -> list[Any]:
        """The tasks of one run: documents drawn from ``seed`` (use :func:`run_seed` per run)."""
        from ..workloads.trace import TraceWorkload

        workload = TraceWorkload(
            shared_tokens=self.shared_tokens,
            agents=self.agents,
            rounds=1,
            output_tokens=self.output_tokens,
            requests=self.tasks,
        )
        return workload.tasks(tokenizer, seed)


def warmup_tasks(workload: ServeTrace, n: int, tokenizer: Any, seed: int, repeat: int) -> list[Any]:
    """The ``n`` warm-up tasks of a repeat: documents of their own, the same for every server of the
    repeat (as the timed runs' are the same for every method at a QPS), so each method's pools and kept
    prefixes learn from the same texts. (They once depended on the server's port, a free port picked at
    random: every server warmed up on other documents and KVCMAS's gates, which its warm-up anchors
    decide, changed from run to run.)"""
    warm = ServeTrace(workload.shared_tokens, workload.agents, n, workload.output_tokens)
    return warm.task_specs(tokenizer, run_seed(seed, "warmup", repeat))


def document_first(request: ChatRequest, slot: str = "context") -> ChatRequest:
    """The document-first layout of a request: the shared ``slot``'s text moved to the very front of
    the prompt (the system message starts with it, the agent's own system prompt follows), so that
    vLLM's own prefix cache serves it to every agent of the task. Changes the prompt: an upper bound."""
    spans = [s for s in request.spans if s.slot == slot]
    if not spans:
        raise ValueError(f"the request of agent {request.agent!r} does not read slot {slot!r}")
    span = spans[0]
    document = request.messages[span.message]["content"][span.start : span.end]
    messages = [dict(m) for m in request.messages]
    source = messages[span.message]["content"]
    rest = (source[: span.start] + source[span.end :]).strip()
    messages[span.message]["content"] = rest
    if messages[0]["role"] == "system":
        system = messages[0]["content"]
        messages[0]["content"] = document + ("\n\n" + system if system else "")
    else:
        messages.insert(0, {"role": "system", "content": document})
    messages = [m for m in messages if m["content"] or m["role"] != "user"] or messages
    return ChatRequest(
        request.agent,
        messages,
        request.output_slot,
        [],
        request.max_tokens,
        request.min_tokens,
        request.reads,
    )


@dataclass
class PlannedRequest:
    """One request of a run: its task and agent position, arrival offset, the turn that builds it."""

    index: int
    task: int
    position: int
    arrival_s: float
    depends_on: int | None  # index of the request whose reply this one reads


def request_place(i: int, tasks: int, agents: int, order: str = "task") -> tuple[int, int, int | None]:
    """``(task, position, depends_on)`` of request ``i``. ``"task"``-major (the default, the authors'
    serving traces: one task's agents, then the next task's): task ``i // agents``, position
    ``i % agents``, reading request ``i - 1``. ``"agent"``-major (every task's first agent, then every
    task's second, ...; the default before 2026-12-02): task ``i % tasks``, position ``i // tasks``,
    reading the reply of request ``i - tasks``."""
    if order == "agent":
        task, position = i % tasks, i // tasks
        return task, position, (i - tasks if position else None)
    if order == "task":
        task, position = i // agents, i % agents
        return task, position, (i - 1 if position else None)
    raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {order!r}")


def plan_run(tasks: int, agents: int, arrivals: Sequence[float], order: str = "task") -> list[PlannedRequest]:
    """The requests of a run in ``order`` (:func:`request_place`), the ``i``-th arriving at
    ``arrivals[i]``; ``arrivals`` may be shorter than ``tasks * agents`` (a time bound): the rest are
    not planned."""
    planned = []
    for i, arrival in enumerate(arrivals[: tasks * agents]):
        task, position, depends_on = request_place(i, tasks, agents, order)
        planned.append(PlannedRequest(i, task, position, arrival, depends_on))
    return planned

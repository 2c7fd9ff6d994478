"""The client side of ``bench serve``: a streaming chat request sent and timed (:func:`stream_chat`),
one (method, QPS) run's requests sent at their arrivals with each agent fed the replies it reads
(:func:`run_once`), the warm-up and teacher-forced passes, the server's ``/metrics`` and the
connector's per-request reports read back."""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...serving.client import ChatRequest, task_requests, task_trajectory, task_turns
from ...serving.server import HOST
from .columns import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    agreement,
    compact_report,
    connector_columns,
    console_line,
    metric_delta,
    summarize_run,
)
from .trace import (
    DOC_FIRST,
    PlannedRequest,
    ServeTrace,
    document_first,
    plan_run,
    poisson_schedule,
    request_place,
    run_seed,
    warmup_tasks,
)

if TYPE_CHECKING:
    import argparse

    from .runs import Plan, ServerGroup


def stream_chat(
    port: int,
    body: Mapping[str, Any],
    timeout: float,
    host: str = HOST,
    headers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """POST a streaming chat request (``headers``: added, e.g. the router's affinity header); returns ``ok``, ``ttft_s`` (send to the first chunk carrying an
    output token), ``e2e_s``, the reply text, usage (prompt / completion / cached tokens) or ``error``."""
    body = {"return_token_ids": True, **body}  # vLLM: each chunk carries its token ids (TTFT, replies)
    t0 = time.perf_counter()
    deadline = t0 + timeout
    out: dict[str, Any] = {"ok": False, "ttft_s": None, "text": ""}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"Content-Type": "application/json", **(headers or {})},
        )
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


def metrics_snapshot(port: int) -> dict[str, float]:
    try:
        status, text = get(port, "/metrics")
    except OSError:
        return {}
    return parse_metrics(text) if status == 200 else {}


def read_reports(
    path: Path | Sequence[Path] | None, ids: Sequence[str], wait_s: float = 10.0
) -> dict[str, dict[str, Any]]:
    """The connector's reports (its JSONL file, :data:`hf_kvshare.serving.connector.REPORTS_ENV`) of
    the requests the bench sent with ``request_id`` in ``ids``: vLLM names a request
    ``chatcmpl-<id>-<random>`` inside the engine. Waits up to ``wait_s`` for missing ones. A list of
    paths: one per replica behind a router, each report tagged with its ``replica`` (the index)."""
    found: dict[str, dict[str, Any]] = {}
    if path is None:
        return found
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    wanted = set(ids)
    deadline = time.monotonic() + wait_s
    while True:
        lines = []
        for replica, one in enumerate(paths):
            try:
                lines += [(replica, line) for line in Path(one).read_text().splitlines()]
            except OSError:
                pass
        for replica, line in lines:
            try:
                report = json.loads(line)
            except ValueError:
                continue
            if len(paths) > 1:
                report["replica"] = replica
            rid = str(report.get("external_id") or report.get("request_id") or "")
            key = rid.removeprefix("chatcmpl-")
            for candidate in (key, key.rsplit("-", 1)[0]):
                if candidate in wanted:
                    found[candidate] = report
                    break
        if wanted <= set(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


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
    #: the connector's report file (``None``: a plain server; a list: one per replica behind a router)
    report_path: Path | list[Path] | None = None
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
            headers = request.headers()  # the task's affinity header (document-first's request has no task)
            if spec.layout == DOC_FIRST:
                request = document_first(request)
            body = request.body(
                spec.served_name, stream=True, explicit_layout=spec.explicit_layout, extra=spec.extra_body
            )
            body["request_id"] = spec.request_id(p.index)
            rec.update(agent=agent, sent_s=now, dependency_wait_s=max(now - p.arrival_s, 0.0))
            timeout = min(spec.request_timeout, max(hard_stop - time.perf_counter(), 1.0))
            result = stream_chat(port, body, timeout, headers=headers)
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
                if "replica" in report:
                    r["replica"] = report["replica"]
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
        print(console_line(spec.method, spec.qps, row), file=log, flush=True)
    return row, snapshot


def warm_up(
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
            body = request.body(getattr(args, "served_model", "model"), stream=True, explicit_layout=explicit)
            result = stream_chat(port, body, args.request_timeout)
            if not result["ok"]:
                raise RuntimeError(f"warm-up request failed: {result.get('error')}")
            traj.record(slot, result["text"])


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


def forced_pass(
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

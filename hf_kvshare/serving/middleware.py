"""The ASGI middleware ``hf-kvshare serve`` adds to vLLM's OpenAI server (vLLM's own ``--middleware``).

For ``POST /v1/chat/completions`` and ``/v1/completions`` it

- answers ``400`` (OpenAI error JSON) to a layout that cannot be used (:mod:`.layout`: unknown keys,
  a segment not in the prompt, overlapping segments, a span beyond the prompt, another method than the
  served one), before the engine sees the request, so nothing is stored;
- sets the request's ``cache_salt`` to the served method's salt (``host.salt``; a client's own salt is
  kept after it), so K/V a method injected never serves another method or a plain request.

Every other endpoint gets no salt and no layout: the connector injects nothing into a request without
the method's salt (``Sharing.admit``), and a request that sends that salt itself there, or opted out
with ``"method": "nonshared"`` on the two above, is answered ``400``: shared K/V reach only requests
whose layout was checked here.

It also keeps the server's reports where a client cannot read the response body (an agent
framework drops ``kv_transfer_params``): each non-streamed reply's ``kv_transfer_params["hf_kvshare"]``
(the connector's report: what was supplied, and why each span was not: :mod:`hf_kvshare.reasons`) is
kept per tenant (the client's own ``cache_salt``; bounded in count and bytes, :class:`ReportBook`) and
answered by ``GET /v1/hf_kvshare/reports?task=T&last=N`` (header :data:`TENANT_HEADER`: the client's
``cache_salt``, none for none) with a per-task summary of the causes. A tenant sees only its own
reports. The path lies under ``/v1`` so that vLLM's ``--api-key`` guards it: the middleware answers it
only where vLLM's app, its checks passed, found no route (404). A reply's report is the admission's:
with the connector's report file (:data:`REPORTS_ENV`) each kept report is replaced by its recorded
line, which adds why each dense span was not shared (its gate). Streamed replies carry no report (vLLM
puts ``kv_transfer_params`` on non-streamed ones only): with the report file, a streamed reply is kept
by its id (read from its first chunk) and its task, and its recorded line fills it in; without one it is
not kept. Each API-server process keeps its own book.

It reads its settings from the environment variable :data:`ENV` (JSON: ``method``, ``salt``,
``model``, ``api_key``: whether vLLM may check an API key, :func:`api_key_may_be_set`; unset: it may)
that :mod:`.server` sets. Without a key the middleware does not show a POST to vLLM's check first (the
probe of :meth:`LayoutCheck._authorized`: one route lookup per request). The prompt is tokenized here as vLLM does it (the tokenizer's
chat template with the generation prompt; completions with special tokens); where that rendering
fails the request passes unchecked and the engine (which never raises on a layout) reports the
error in the response's ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs

from .. import reasons
from . import layout as lay

ENV = "HF_KVSHARE_SERVE"
#: the largest request body the layout check reads (a larger one is answered 413 before any parsing)
MAX_BODY_BYTES = 32 << 20
PATHS = ("/v1/chat/completions", "/v1/completions")
#: where a client reads its reports back (:class:`ReportBook`)
REPORTS_PATH = "/v1/hf_kvshare/reports"
#: a path under ``/v1`` with no route: a request's headers are shown to vLLM's ``--api-key`` check there
#: (:meth:`LayoutCheck._authorized`) before this middleware reads its body
AUTH_PROBE_PATH = "/v1/hf_kvshare/auth"
#: vLLM's options and variable that set an API key (``--config``: a file that may name one)
API_KEY_FLAGS = ("--api-key", "--config")
API_KEY_ENV = "VLLM_API_KEY"
#: the request header that names the tenant whose reports are read: the client's ``cache_salt``
TENANT_HEADER = b"x-hf-kvshare-cache-salt"
#: the connector's report file variable (``connector_scheduler.REPORTS_ENV``; that module imports vLLM)
REPORTS_ENV = "HF_KVSHARE_REPORTS"
#: a reply larger than this is passed on without its report kept
MAX_REPLY_BYTES = 4 << 20
#: a streamed reply's first chunk (its id) is looked for in at most this many bytes
MAX_FIRST_CHUNK_BYTES = 64 << 10


def api_key_may_be_set(vllm_args: list[str], env: dict[str, str]) -> bool:
    """Whether vLLM started with ``vllm_args`` in ``env`` may check an API key: ``--api-key`` given, a
    ``--config`` file (which may name one) or ``VLLM_API_KEY`` set. Only where none is does the
    middleware let POSTs through without showing them to vLLM's check first."""
    given = any(arg.split("=", 1)[0] in API_KEY_FLAGS for arg in vllm_args)
    return given or bool(env.get(API_KEY_ENV))


class LayoutCheck:
    """ASGI middleware class (``--middleware hf_kvshare.serving.middleware.LayoutCheck``)."""

    def __init__(self, app: Any):
        self.app = app
        settings = json.loads(os.environ.get(ENV) or "{}")
        self.method = settings.get("method", "nonshared")
        self.salt = settings.get("salt")
        self.model = settings.get("model")
        #: whether vLLM may check an API key (the launcher says; unsaid: it may): POSTs are shown to it
        self.api_key = bool(settings.get("api_key", True))
        self._tokens: lay.TokenInfo | None = None
        self.max_body_bytes = int(settings.get("max_body_bytes", MAX_BODY_BYTES))
        #: the layout checks run here, one at a time (a tokenizer is not for concurrent use), while the
        #: event loop goes on answering (``/health``, other requests' streams)
        self._checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_kvshare-layout")
        self.reports = ReportBook(
            per_tenant=int(settings.get("reports_per_tenant", ReportBook.per_tenant)),
            max_bytes=int(settings.get("reports_bytes", ReportBook.max_bytes)),
            tenants=int(settings.get("report_tenants", ReportBook.tenants)),
            report_file=os.environ.get(REPORTS_ENV) or None,
        )

    @property
    def tokens(self) -> lay.TokenInfo | None:
        if self._tokens is None and self.model:
            from transformers import AutoTokenizer

            self._tokens = lay.TokenInfo(AutoTokenizer.from_pretrained(self.model))
        return self._tokens

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http" and scope.get("method") == "GET" and scope.get("path") == REPORTS_PATH:
            await self.app(scope, receive, self._answer_reports(scope, send))
            return
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if self.api_key and not await self._authorized(scope):  # vLLM's check answers it (401), unread
            await self.app(scope, receive, send)
            return
        if scope.get("path") not in PATHS:  # vLLM's other endpoints: no layout, no salt, nothing injected
            await self._unshared(scope, receive, send)
            return
        try:
            messages, body, complete = await _receive_body(receive, self.max_body_bytes)
        except _TooLarge:  # checked before anything is parsed or tokenized
            await _error(send, 413, f"request body over {self.max_body_bytes} bytes")
            return
        if not complete:  # the client went away
            await self.app(scope, _replay(messages[-1:], receive), send)
            return
        data = _json(body)
        if isinstance(data, dict) and not data.get("stream"):
            send = self._keep_report(_tenant(data.get("cache_salt")), send)
        elif isinstance(data, dict) and self.reports.completes_streams:
            send = self._keep_streamed(_tenant(data.get("cache_salt")), _layout_task(data), send)
        if isinstance(data, dict):
            try:  # tokenizing and locating a long prompt takes a while: not on the server's event loop
                await asyncio.get_running_loop().run_in_executor(
                    self._checks, self.check, data, scope["path"]
                )
            except lay.LayoutError as error:
                await _error(send, 400, str(error))
                return
            body = json.dumps(data).encode()
        await self.app(
            scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send
        )

    async def _unshared(self, scope, receive, send) -> None:
        """Another endpoint (``/v1/responses``, ``/v1/messages``, ``/invocations``, batches, ...): the
        connector injects nothing into a request without the method's salt, and one that carries that
        salt itself is refused (it would read the shared, approximate K/V without a layout check)."""
        headers = dict(scope.get("headers") or [])
        if not self.salt or b"json" not in headers.get(b"content-type", b""):
            await self.app(scope, receive, send)
            return
        messages, body, _ = await _receive_body(receive)
        data = _json(body)
        if isinstance(data, dict) and _reserved(data.get("cache_salt"), self.salt):
            await _error(
                send,
                400,
                f"cache_salt starting with this server's method salt is reserved for {' and '.join(PATHS)}, "
                f"where hf_kvshare checks the layout; {scope.get('path')} gets exact K/V only",
            )
            return
        await self.app(scope, _replay(messages, receive), send)

    def _keep_report(self, tenant: str, send):
        """``send`` that passes the reply on as it comes and, once it is whole, keeps its report (a
        JSON reply of at most :data:`MAX_REPLY_BYTES` carrying ``kv_transfer_params["hf_kvshare"]``)."""
        chunks: list[bytes] = []
        state = {"size": 0, "ok": False}

        async def keeping(message):
            await send(message)
            if message["type"] == "http.response.start":
                state["ok"] = message.get("status") == 200
            elif message["type"] == "http.response.body" and state["ok"]:
                chunks.append(message.get("body", b""))
                state["size"] += len(chunks[-1])
                if state["size"] > MAX_REPLY_BYTES:
                    state["ok"] = False
                    chunks.clear()
                elif not message.get("more_body", False):
                    reply = _json(b"".join(chunks))
                    params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
                    report = params.get(lay.KEY) if isinstance(params, dict) else None
                    if isinstance(report, dict):
                        self.reports.add(
                            tenant, report, reply.get("id") if isinstance(reply.get("id"), str) else None
                        )

        return keeping

    def _keep_streamed(self, tenant: str, task: str, send):
        """``send`` that passes a streamed reply on as it comes and keeps a report of it under the id
        of its first chunk (``data: {"id": ...}``), to be filled in by its recorded line
        (:meth:`ReportBook.add_streamed`)."""
        state = {"ok": False, "head": b""}

        async def keeping(message):
            await send(message)
            if message["type"] == "http.response.start":
                state["ok"] = message.get("status") == 200
            elif message["type"] == "http.response.body" and state["ok"]:
                head = state["head"] + message.get("body", b"")
                end = head.find(b"\n\n")
                if end < 0 and len(head) <= MAX_FIRST_CHUNK_BYTES and message.get("more_body", False):
                    state["head"] = head
                    return
                state["ok"], state["head"] = False, b""  # one look at the first chunk only
                first = _json(head[:end].removeprefix(b"data:").strip()) if end >= 0 else None
                reply_id = first.get("id") if isinstance(first, dict) else None
                if isinstance(reply_id, str) and reply_id:
                    self.reports.add_streamed(tenant, task, reply_id)

        return keeping

    async def _authorized(self, scope) -> bool:
        """Whether vLLM's own ``--api-key`` check lets this request's headers through: asked with a
        ``GET`` of :data:`AUTH_PROBE_PATH` (under ``/v1``, no route) carrying them, which vLLM answers 401
        (refused) or 404. So a request without the key never meets this middleware's own answers (a
        400 for its layout, a 413) or its tokenizer: vLLM refuses it first, as without the middleware."""
        probe = {**scope, "method": "GET", "path": AUTH_PROBE_PATH, "query_string": b""}
        probe["raw_path"] = AUTH_PROBE_PATH.encode()
        status: dict[str, int] = {}

        async def nothing():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def note(message):
            if message["type"] == "http.response.start":
                status["code"] = message.get("status", 0)

        await self.app(probe, nothing, note)
        return status.get("code") != 401

    def _answer_reports(self, scope, send):
        """``send`` for ``GET`` :data:`REPORTS_PATH`: vLLM's own answer where it is not a 404 (its
        ``--api-key`` check said 401, or a route of that path exists), else the tenant's reports."""
        query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
        headers = dict(scope.get("headers") or [])
        tenant = _tenant(headers.get(TENANT_HEADER, b"").decode("latin-1"))
        task = (query.get("task") or [None])[0]
        last = (query.get("last") or ["20"])[0]
        state = {"ours": False}

        async def answering(message):
            if message["type"] == "http.response.start" and message.get("status") == 404:
                state["ours"] = True
                try:
                    n = max(int(last), 0)
                except ValueError:
                    await _error(send, 400, f"last must be an integer; got {last!r}")
                    return
                lines = await asyncio.get_running_loop().run_in_executor(self._checks, self.reports.read)
                self.reports.apply(lines)
                await _send_json(send, 200, self.reports.answer(tenant, task, n))
            elif not state["ours"]:
                await send(message)

        return answering

    def check(self, data: dict, path: str) -> None:
        """Validate the request's layout and set its ``cache_salt`` (raises :class:`LayoutError`)."""
        params = data.get("kv_transfer_params")
        if isinstance(params, dict) and isinstance(params.get(lay.KEY), dict):
            for key, source in (
                (lay.TENANT, "the request's cache_salt"),
                (lay.IMAGES, "vLLM's multimodal hashes"),
            ):
                if key in params[lay.KEY]:
                    raise lay.LayoutError(
                        f"kv_transfer_params.{lay.KEY}.{key} is set by the server (from {source})"
                    )
        request = lay.parse(params)
        if request.method is not None and request.method not in (self.method, "nonshared"):
            raise lay.LayoutError(
                f"this server runs method {self.method!r} (or 'nonshared' to opt out); the request asks "
                f"{request.method!r}"
            )
        plain = request.method == "nonshared" or self.salt is None
        if plain and self.salt and _reserved(data.get("cache_salt"), self.salt):
            raise lay.LayoutError(
                "cache_salt starting with this server's method salt is reserved for its shared (approximate) "
                "K/V; a request opted out with method 'nonshared' gets exact K/V only"
            )
        if not plain:
            user = data.get("cache_salt")
            data["cache_salt"] = self.salt if not user else f"{self.salt}|{user}"
        if request.segments is None or self.tokens is None:
            return
        prompts = self._prompts(data, path)
        if prompts is None:
            return
        if len(prompts) != 1:
            raise lay.LayoutError("an explicit layout needs one prompt per request (got a batch)")
        lay.resolve(request, prompts[0], self.tokens, known=None)

    def _prompts(self, data: dict, path: str) -> list[list[int]] | None:
        tokenizer = self.tokens.tokenizer
        try:
            if path.endswith("/chat/completions"):
                if _has_media(data.get("messages")):  # vLLM expands its images: checked when planned
                    return None
                kwargs = dict(data.get("chat_template_kwargs") or {})
                ids = tokenizer.apply_chat_template(
                    data.get("messages") or [],
                    add_generation_prompt=data.get("add_generation_prompt", True),
                    tokenize=True,
                    **kwargs,
                )
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                return [list(ids)]
            prompt = data.get("prompt")
            if isinstance(prompt, str):
                return [
                    tokenizer(prompt, add_special_tokens=data.get("add_special_tokens", True))["input_ids"]
                ]
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return [prompt]
            if isinstance(prompt, list):
                return [p if isinstance(p, list) else tokenizer(p)["input_ids"] for p in prompt]
        except Exception:  # noqa: BLE001 - vLLM answers malformed requests itself
            return None
        return None


class ReportBook:
    """The latest connector reports of each tenant, bounded: ``per_tenant`` reports and ``max_bytes``
    of them per tenant (the oldest go first; a report over the bytes alone is kept without its
    segments), ``tenants`` tenants (the least recently reported goes). Tenants are held by a hash of
    their ``cache_salt``; each report is kept as the client named things (its task and agent without
    the server's tenant fence) with its causes (:func:`hf_kvshare.reasons.report_causes`).

    A reply carries the admission's report: a dense span's gate outcome is known once the request is
    recorded. With the connector's report file (``report_file``, :data:`REPORTS_ENV`) :meth:`refresh`
    reads the lines appended since (at most ``read_bytes`` a call) and replaces each kept report by its
    recorded line (matched by the reply's id: vLLM's external request id, or its engine id less the
    suffixes vLLM adds), ``"recorded": true``."""

    per_tenant = 256
    max_bytes = 512 << 10
    tenants = 64
    read_bytes = 4 << 20

    def __init__(
        self,
        per_tenant: int = per_tenant,
        max_bytes: int = max_bytes,
        tenants: int = tenants,
        report_file: str | None = None,
    ):
        self.per_tenant, self.max_bytes, self.tenants = per_tenant, max_bytes, tenants
        #: per tenant key: its entries, oldest first, each [size, report, reply id, tenant, signature]
        self._books: OrderedDict[str, deque[list[Any]]] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._ids: dict[str, list[Any]] = {}  # a kept report's reply id -> its entry
        self._file = report_file
        self._offset = _size(report_file)  # lines written before this server's start are not ours

    @property
    def completes_streams(self) -> bool:
        """Whether streamed replies are kept: only their recorded lines (the report file) say anything."""
        return bool(self._file)

    def add(
        self, tenant: str, report: dict[str, Any], reply_id: str | None = None, signature: tuple | None = None
    ) -> None:
        key = _key(tenant)
        entry = [0, {}, reply_id, tenant, signature or _signature(report)]
        if not self._fill(entry, report):
            return
        book = self._books.setdefault(key, deque())
        self._books.move_to_end(key)
        book.append(entry)
        self._bytes[key] = self._bytes.get(key, 0) + entry[0]
        if reply_id:
            self._ids[reply_id] = entry
        while len(book) > self.per_tenant or self._bytes[key] > self.max_bytes:
            self._drop(key, book.popleft())
        while len(self._books) > self.tenants:
            gone, book = self._books.popitem(last=False)
            for old in book:
                self._drop(gone, old)
            self._bytes.pop(gone, None)

    def add_streamed(self, tenant: str, task: str, reply_id: str) -> None:
        """Keep a streamed reply (it carries no report) under its id: a report saying so until its
        recorded line replaces it, matched by the id and its task as the server fenced it (the tenant's:
        no other tenant's line is taken; its agent and prompt length are not known here)."""
        fenced = f"{tenant}|{task}" if tenant else task
        report = {"task": fenced, "agent": None, "streamed": True, "recorded": False}
        self.add(tenant, report, reply_id, signature=(fenced, _ANY, _ANY))

    def _fill(self, entry: list[Any], report: dict[str, Any]) -> bool:
        """``entry``'s report as kept (client-named, with its causes; without its segments past the
        bound); ``False`` where it is over the bound even so."""
        kept = _as_client_named(report, entry[3])
        size = len(json.dumps(kept, default=str))
        if size > self.max_bytes:
            kept.pop("segments", None)
            size = len(json.dumps(kept, default=str))
            if size > self.max_bytes:
                return False
        entry[0], entry[1] = size, kept
        return True

    def _drop(self, key: str, entry: list[Any]) -> None:
        self._bytes[key] = self._bytes.get(key, 0) - entry[0]
        if entry[2] is not None and self._ids.get(entry[2]) is entry:
            del self._ids[entry[2]]

    def refresh(self) -> None:
        """Kept reports replaced by their recorded lines of the report file (class docstring)."""
        self.apply(self.read())

    def read(self) -> list[dict[str, Any]]:
        """The report file's whole lines appended since the last read (at most :attr:`read_bytes`). Only
        the file position is touched: the middleware reads on its checks' thread and applies on the
        event loop (:meth:`apply`), where every other change to the book is made."""
        if not self._file:
            return []
        try:
            with open(self._file, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(self.read_bytes)
        except OSError:
            return []
        whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self._offset += len(whole) if whole or len(chunk) < self.read_bytes else len(chunk)
        return [line for line in map(_json, whole.splitlines()) if isinstance(line, dict)]

    def apply(self, lines: list[dict[str, Any]]) -> None:
        """Each kept report of ``lines`` (the same request: reply id, fenced task, agent and prompt
        length) replaced by its line, ``"recorded": true``."""
        for line in lines:
            entry = next((self._ids[i] for i in _reply_ids(line) if i in self._ids), None)
            if entry is None or not _same_request(_signature(line), entry[4]):  # as the server fenced it
                continue
            key, before = _key(entry[3]), entry[0]
            report = {k: v for k, v in line.items() if k not in ("request_id", "external_id")}
            if entry[1].get("streamed"):
                report["streamed"] = True
            if self._fill(entry, {**report, "recorded": True}):
                self._bytes[key] = self._bytes.get(key, 0) + entry[0] - before

    def held(self, tenant: str, task: str | None = None) -> list[dict[str, Any]]:
        """The tenant's reports held (of ``task``), oldest first."""
        book = self._books.get(_key(tenant)) or ()
        return [e[1] for e in book if task is None or e[1].get("task") == task]

    def answer(self, tenant: str, task: str | None = None, last: int = 20) -> dict[str, Any]:
        """What ``GET`` :data:`REPORTS_PATH` answers: the ``last`` reports held (of ``task``) and, per
        task, the requests, PH tokens supplied of all, and the causes of those not supplied."""
        held = self.held(tenant, task)
        tasks: dict[str, list[dict[str, Any]]] = {}
        for r in held:
            tasks.setdefault(str(r.get("task")), []).append(r)
        return {
            "task": task,
            "held": len(held),
            "reports": held[-last:] if last else [],
            "summary": {name: _summary(rows) for name, rows in tasks.items()},
        }


def _reply_ids(line: dict[str, Any]) -> list[str]:
    """The reply ids a report line's request may have: vLLM's external id, or its engine id without
    the suffixes vLLM adds (``"<reply id>-<random>"``; a completion's ``"<reply id>-<i>-<random>"``)."""
    ids = []
    for raw in (line.get("external_id"), line.get("request_id")):
        if isinstance(raw, str) and raw:
            one = raw.rpartition("-")[0]
            ids += [raw, one, one.rpartition("-")[0]]
    return [i for i in ids if i]


def _signature(report: dict[str, Any]) -> tuple:
    """What ties a report file's line to a kept reply's report: the task and agent as the server fenced
    them (by tenant) and the prompt's length."""
    return report.get("task"), report.get("agent"), report.get("prompt_tokens")


#: a part of a kept report's signature that any line matches (a streamed reply's agent, prompt length)
_ANY = object()


def _same_request(line: tuple, kept: tuple) -> bool:
    return all(k is _ANY or k == v for v, k in zip(line, kept))


def _layout_task(data: dict) -> str:
    """The task a request names in its layout (the server's default where it names none)."""
    params = data.get("kv_transfer_params")
    layout = params.get(lay.KEY) if isinstance(params, dict) else None
    task = layout.get("task") if isinstance(layout, dict) else None
    return task if isinstance(task, str) and task else lay.DEFAULT_TASK


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    ph = sum(r.get("ph_tokens") or 0 for r in reports)
    supplied = sum(r.get("supplied_ph_tokens") or 0 for r in reports)
    counts = reasons.merge(r.get("not_shared") for r in reports)
    return {
        "requests": len(reports),
        "ph_tokens": ph,
        "supplied_ph_tokens": supplied,
        "rho": supplied / ph if ph else None,
        "not_shared": dict(reasons.top(counts)),
        "not_shared_top": reasons.describe(counts),
    }


def _tenant(cache_salt: Any) -> str:
    """A request's tenant: its client's ``cache_salt`` (``""`` for none)."""
    return cache_salt if isinstance(cache_salt, str) else ""


def _key(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()


def _as_client_named(report: dict[str, Any], tenant: str) -> dict[str, Any]:
    """``report`` with its task and agent as the client named them (the server fences them by tenant:
    ``"<tenant>|<task>"``, ``"<agent>|<tenant>"``) and its causes."""
    kept = dict(report)
    kept.pop("store", None)  # the whole store's counts: not this tenant's
    task, agent = kept.get("task"), kept.get("agent")
    if tenant and isinstance(task, str) and task.startswith(f"{tenant}|"):
        kept["task"] = task[len(tenant) + 1 :]
    if tenant and isinstance(agent, str) and agent.endswith(f"|{tenant}"):
        kept["agent"] = agent[: -len(tenant) - 1]
    kept["not_shared"] = reasons.report_causes(report)
    return kept


class _TooLarge(Exception):
    """A request body past the middleware's limit."""


def _has_media(messages: Any) -> bool:
    """Whether chat ``messages`` hold a part other than text (an image, audio, a video)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(part, dict) and part.get("type", "text") != "text" for part in m["content"])
        for m in messages
    )


async def _receive_body(receive, limit: int | None = None) -> tuple[list[dict], bytes, bool]:
    """The request's messages as they came, its body, and whether the body is complete (``False``: the
    client went away first, its last message says so); :class:`_TooLarge` past ``limit`` bytes."""
    messages, chunks, size = [], [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, b"".join(chunks), False
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if limit is not None and size > limit:
            raise _TooLarge
        if not message.get("more_body", False):
            return messages, b"".join(chunks), True


def _json(body: bytes) -> Any:
    """The body as JSON, or ``None`` where it is not JSON (vLLM answers that itself)."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def _reserved(cache_salt: Any, salt: str) -> bool:
    return isinstance(cache_salt, str) and cache_salt.startswith(salt)


def _replay(messages: list[dict], then):
    """A ``receive`` that gives ``messages`` first, then the client's own (its disconnect)."""
    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        return await then()

    return receive


async def _error(send, status: int, message: str) -> None:
    await _send_json(
        send,
        status,
        {
            "error": {
                "message": message,
                "type": "BadRequestError",
                "param": "kv_transfer_params",
                "code": status,
            }
        },
    )


async def _send_json(send, status: int, payload: Any) -> None:
    body = json.dumps(payload, default=str).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})

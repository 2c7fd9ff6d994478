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

It reads its settings from the environment variable :data:`ENV` (JSON: ``method``, ``salt``,
``model``) that :mod:`.server` sets. The prompt is tokenized here as vLLM does it (the tokenizer's
chat template with the generation prompt; completions with special tokens); where that rendering
fails the request passes unchecked and the engine (which never raises on a layout) reports the
error in the response's ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import layout as lay

ENV = "HF_KVSHARE_SERVE"
#: the largest request body the layout check reads (a larger one is answered 413 before any parsing)
MAX_BODY_BYTES = 32 << 20
PATHS = ("/v1/chat/completions", "/v1/completions")


class LayoutCheck:
    """ASGI middleware class (``--middleware hf_kvshare.serving.middleware.LayoutCheck``)."""

    def __init__(self, app: Any):
        self.app = app
        settings = json.loads(os.environ.get(ENV) or "{}")
        self.method = settings.get("method", "nonshared")
        self.salt = settings.get("salt")
        self.model = settings.get("model")
        self._tokens: lay.TokenInfo | None = None
        self.max_body_bytes = int(settings.get("max_body_bytes", MAX_BODY_BYTES))
        #: the layout checks run here, one at a time (a tokenizer is not for concurrent use), while the
        #: event loop goes on answering (``/health``, other requests' streams)
        self._checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_kvshare-layout")

    @property
    def tokens(self) -> lay.TokenInfo | None:
        if self._tokens is None and self.model:
            from transformers import AutoTokenizer

            self._tokens = lay.TokenInfo(AutoTokenizer.from_pretrained(self.model))
        return self._tokens

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST":
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

    def check(self, data: dict, path: str) -> None:
        """Validate the request's layout and set its ``cache_salt`` (raises :class:`LayoutError`)."""
        params = data.get("kv_transfer_params")
        if (
            isinstance(params, dict)
            and isinstance(params.get(lay.KEY), dict)
            and lay.TENANT in params[lay.KEY]
        ):
            raise lay.LayoutError(
                f"kv_transfer_params.{lay.KEY}.{lay.TENANT} is set by the server (from the request's cache_salt)"
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


class _TooLarge(Exception):
    """A request body past the middleware's limit."""


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
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "BadRequestError",
                "param": "kv_transfer_params",
                "code": status,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})

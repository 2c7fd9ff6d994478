"""How a request served by ``hf-kvshare serve`` carries its layout (which tokens are shared).

Any OpenAI-compatible client works: without anything extra the server derives the layout itself;
a client that knows its workflow states it in the request's ``kv_transfer_params`` (a field vLLM's
OpenAI server already accepts on ``/v1/chat/completions`` and ``/v1/completions``; with the
``openai`` client pass ``extra_body={"kv_transfer_params": {...}}``).

Explicit layout
---------------

.. code-block:: json

    {"kv_transfer_params": {"hf_kvshare": {
        "task": "req-17",              // the multi-agent request this call belongs to (one Session)
        "agent": "coder",              // who is speaking (anchor pools and kept PF text are per agent)
        "output": "coder",             // the PH slot its output becomes (default: the agent, then agent#2...)
        "method": "fullshared",        // optional: must be the served method, or "nonshared" (opt out)
        "segments": [                  // the PH (shared) spans, in prompt order; the rest is PF
            {"slot": "doc", "text": "The document ...",    // located by its tokens (alone) in the prompt
             "kind": "observation"},                       // optional: "question" | "observation"
            {"slot": "planner"},                            // a slot recorded earlier in this task
            {"slot": "q", "start": 212, "end": 240}         // token positions [start, end) of the prompt
        ]}}}

- ``text`` is tokenized on its own (no special tokens) and must occur, token for token, in the
  prompt after the previous segment; chat templates that open a message with a header line (ChatML
  ``<|im_start|>user\\n``, Llama 3 ``<|end_header_id|>\\n\\n``) keep a message's content tokens as they
  are alone, so give whole message contents (or text starting a line).
- ``{"slot": name}`` alone: the slot's token ids as recorded earlier in the task (a document given
  before, or an agent's output: its generated ids, EOS stripped) are looked for in the prompt; when
  they are not there (the client re-worded an output) that segment is the agent's own text and the
  response's report lists it under ``missing``.
- ``start`` / ``end``: token positions, for clients that send token ids (``/v1/completions``).
- A slot's content is fixed within a task (another text under a known slot name is an error).
- ``kind`` states what given text is, as ``PH(..., kind=...)`` does in a ``Session``: the task's
  ``"question"`` (at most one per task) or an ``"observation"`` (a document, a tool result). Unstated,
  the one rule of :func:`hf_kvshare.turn.given_text_slot` applies here as in a ``Session``: text
  whose tokens equal an output this task already produced *is* that output (read under the output's
  name, with its producer's cache and gate decision); otherwise the task's first given text is its
  question and every later one an observation. (The default layout below applies the same rule to
  the chunks it makes slots of, in prompt order.)
- Errors (unknown keys, a segment not in the prompt, overlapping or unordered segments, a span
  beyond the prompt, a method other than the served one) are answered ``400`` by the server's
  middleware before the engine sees the request; nothing is stored.
- ``"hf_kvshare": {"method": "nonshared"}`` opts a request out: the engine computes it as plain
  vLLM does (prefix cache included) and nothing approximate can serve it.

Default layout (no ``segments``)
--------------------------------

The prompt's token ids are split into *chunks* at the tokenizer's special tokens (chat templates
delimit messages with them); a chunk's leading role line (``user\\n``, ``assistant\\n``, ...: a first
line of at most :data:`ROLE_LINE_TOKENS` tokens) and leading whitespace tokens are dropped, leaving
the message content. Then:

1. every slot the task already holds (earlier chunks, earlier agents' outputs) whose token ids occur
   in the prompt becomes a PH span there (longest first, no overlap);
2. every other chunk of at least :data:`MIN_SEGMENT_TOKENS` tokens becomes a new PH slot (computed by
   this agent, shared with the agents after it) named by where it sits: ``<agent>.m<k>``, the prompt's
   k-th chunk (``#2``, ... when this agent's earlier prompt of the task had other text there). Names
   are per task, so the same place in the same agent's prompt has the same name in every task: what
   a method that learns per slot (KVCMAS's anchor pools of given text) needs to learn across tasks;
   ``slot_name``-style content hashes would give every document a pool of its own;
3. everything else is the agent's own text (PF).

So a task, a document or another agent's output that a later agent's prompt repeats as a message is
shared without any client change. The task is ``"default"`` (one task for the whole server: give
``task`` to separate requests), the agent ``"a<sha1 of the prompt's first chunk>"`` (an agent is its
system prompt).

Sampling K/V of the prompt's log-probabilities (``prompt_logprobs``) makes vLLM skip the connector
unless ``skip_reading_prefix_cache=False`` is sent too (then with ``detokenize=False``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..trajectory import GIVEN_KINDS

#: a chunk's first line of at most this many tokens is a role header, not content
ROLE_LINE_TOKENS = 4
#: default layout: a new chunk becomes a shared slot from this many tokens on
MIN_SEGMENT_TOKENS = 16
#: the key under ``kv_transfer_params`` that holds hf_kvshare's layout
KEY = "hf_kvshare"
DEFAULT_TASK = "default"
_REQUEST_KEYS = frozenset({"task", "agent", "output", "method", "segments"})
#: set by the server itself (``Sharing.admit``: the client's ``cache_salt``), never by a client
TENANT = "tenant"
_SEGMENT_KEYS = frozenset({"slot", "text", "start", "end", "kind"})


class LayoutError(ValueError):
    """A request's layout cannot be used (answered 400 by the server; nothing is stored)."""


@dataclass
class SegmentRequest:
    """One PH segment as the request names it (before it is located in the prompt)."""

    slot: str
    text: str | None = None
    start: int | None = None
    end: int | None = None
    #: ``"question"`` / ``"observation"``; ``None``: the default rule
    kind: str | None = None


@dataclass
class RequestLayout:
    """What ``kv_transfer_params["hf_kvshare"]`` says (validated, not yet located)."""

    task: str = DEFAULT_TASK
    agent: str | None = None
    output: str | None = None
    method: str | None = None
    #: ``None``: derive the layout from the prompt
    segments: list[SegmentRequest] | None = None
    #: the request's tenant (the server's, from its ``cache_salt``): a derived agent name carries it
    tenant: str | None = None


@dataclass
class LocatedSegment:
    """A PH span of the prompt: slot name, token positions ``[start, end)``, the text it was given."""

    slot: str
    start: int
    end: int
    text: str | None = None
    new: bool = False  # default layout: a chunk that becomes a new slot
    kind: str | None = None


@dataclass
class ResolvedLayout:
    task: str
    agent: str
    output: str | None
    segments: list[LocatedSegment] = field(default_factory=list)
    derived: bool = False
    #: slots named without text or positions whose recorded tokens are not in the prompt (e.g. an
    #: output the client re-worded): left to the engine as PF text, reported
    missing: list[str] = field(default_factory=list)


def parse(params: Any) -> RequestLayout:
    """``kv_transfer_params`` (a dict, or ``None``) -> the validated :class:`RequestLayout`."""
    if params is None:
        return RequestLayout()
    if not isinstance(params, Mapping):
        raise LayoutError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    raw = params.get(KEY)
    if raw is None:
        return RequestLayout()
    if not isinstance(raw, Mapping):
        raise LayoutError(f"kv_transfer_params.{KEY} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _REQUEST_KEYS - {TENANT})
    if unknown:
        raise LayoutError(f"kv_transfer_params.{KEY}: unknown keys {unknown}; known: {sorted(_REQUEST_KEYS)}")
    for key in ("task", "agent", "output", "method", TENANT):
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise LayoutError(f"kv_transfer_params.{KEY}.{key} must be a non-empty string, got {value!r}")
    layout = RequestLayout(
        task=raw.get("task") or DEFAULT_TASK,
        agent=raw.get("agent"),
        output=raw.get("output"),
        method=raw.get("method"),
        tenant=raw.get(TENANT),
    )
    segments = raw.get("segments")
    if segments is None:
        return layout
    if not isinstance(segments, Sequence) or isinstance(segments, (str, bytes)):
        raise LayoutError(f"kv_transfer_params.{KEY}.segments must be a list, got {type(segments).__name__}")
    layout.segments = []
    names = set()
    for i, seg in enumerate(segments):
        where = f"kv_transfer_params.{KEY}.segments[{i}]"
        if not isinstance(seg, Mapping):
            raise LayoutError(f"{where} must be an object, got {type(seg).__name__}")
        unknown = sorted(set(seg) - _SEGMENT_KEYS)
        if unknown:
            raise LayoutError(f"{where}: unknown keys {unknown}; known: {sorted(_SEGMENT_KEYS)}")
        slot = seg.get("slot")
        if not isinstance(slot, str) or not slot:
            raise LayoutError(f"{where}.slot must be a non-empty string, got {slot!r}")
        if slot in names:
            raise LayoutError(f"{where}: slot {slot!r} is named twice in one prompt")
        names.add(slot)
        text, start, end = seg.get("text"), seg.get("start"), seg.get("end")
        if text is not None and (not isinstance(text, str) or not text):
            raise LayoutError(f"{where}.text must be a non-empty string, got {text!r}")
        if (start is None) != (end is None):
            raise LayoutError(f"{where}: give both start and end (token positions), or neither")
        if start is not None:
            if text is not None:
                raise LayoutError(f"{where}: give text or start/end, not both")
            for key, value in (("start", start), ("end", end)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise LayoutError(f"{where}.{key} must be an int >= 0, got {value!r}")
            if end <= start:
                raise LayoutError(f"{where}: end ({end}) must be greater than start ({start})")
        kind = seg.get("kind")
        if kind is not None and kind not in GIVEN_KINDS:
            raise LayoutError(
                f"{where}.kind must be one of {', '.join(map(repr, GIVEN_KINDS))}, got {kind!r}"
            )
        if kind == "question" and any(s.kind == "question" for s in layout.segments):
            raise LayoutError(f"{where}: a second question in one request (a task has one question)")
        layout.segments.append(SegmentRequest(slot=slot, text=text, start=start, end=end, kind=kind))
    return layout


def occurrences(haystack: Sequence[int], needle: Sequence[int], begin: int = 0) -> Iterator[int]:
    """Every index >= ``begin`` where ``needle`` occurs in ``haystack``, in order, overlapping ones
    included: one linear pass (Knuth-Morris-Pratt), so a long prompt of repeated tokens costs no more
    than any other (a naive search is quadratic there: seconds on the event loop for a 300 KB request)."""
    n = len(needle)
    if n == 0:
        return
    needle = list(needle)
    fallback = [0] * n  # the longest proper border of needle[: i + 1]
    k = 0
    for i in range(1, n):
        while k and needle[i] != needle[k]:
            k = fallback[k - 1]
        if needle[i] == needle[k]:
            k += 1
        fallback[i] = k
    k = 0
    for i in range(max(begin, 0), len(haystack)):
        token = haystack[i]
        while k and token != needle[k]:
            k = fallback[k - 1]
        if token == needle[k]:
            k += 1
        if k == n:
            yield i - n + 1
            k = fallback[k - 1]


def find(haystack: Sequence[int], needle: Sequence[int], begin: int = 0) -> int:
    """First index >= ``begin`` where ``needle`` occurs in ``haystack`` (-1 if none); linear."""
    return next(occurrences(haystack, needle, begin), -1)


def slot_name(ids: Sequence[int]) -> str:
    return "c" + hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]


def chunks(prompt: Sequence[int], special: set[int], is_space) -> list[tuple[int, int]]:
    """Message-content chunks ``[start, end)`` of ``prompt``: runs between special tokens, their role
    line and leading whitespace tokens dropped (see the module docstring)."""
    out, i, n = [], 0, len(prompt)
    while i < n:
        if prompt[i] in special:
            i += 1
            continue
        j = i
        while j < n and prompt[j] not in special:
            j += 1
        start = i
        for k in range(i, min(j, i + ROLE_LINE_TOKENS)):
            if is_space(prompt[k]) == "newline":
                start = k + 1
                break
        while start < j and is_space(prompt[start]):
            start += 1
        if start < j:
            out.append((start, j))
        i = j
    return out


class TokenInfo:
    """What the layout needs from a tokenizer: special ids, and which tokens are whitespace."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._space: dict[int, str | bool] = {}

    def is_space(self, token: int) -> str | bool:
        """``"newline"`` for a whitespace token holding a newline, ``True`` for other whitespace."""
        kind = self._space.get(token)
        if kind is None:
            text = self.tokenizer.decode([token])
            kind = ("newline" if "\n" in text else True) if text and not text.strip() else False
            self._space[token] = kind
        return kind

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def resolve(
    layout: RequestLayout,
    prompt: Sequence[int],
    tokens: TokenInfo,
    known: Mapping[str, Sequence[int]] | None,
    min_tokens: int = MIN_SEGMENT_TOKENS,
) -> ResolvedLayout:
    """Locate the request's PH spans in ``prompt`` (token ids); ``known``: the task's slots (name ->
    token ids), or ``None`` when they are not known here (the server's middleware: segments that name
    only a recorded slot are then not checked). Raises :class:`LayoutError` for an explicit layout that
    does not fit the prompt."""
    prompt = list(prompt)
    check_only = known is None
    known = known or {}
    pieces = chunks(prompt, tokens.special, tokens.is_space)
    agent = layout.agent or ("a" + slot_name(prompt[pieces[0][0] : pieces[0][1]])[1:] if pieces else "agent")
    if layout.tenant and not layout.agent:  # a named agent was fenced by the server already
        agent = f"{agent}|{layout.tenant}"
    resolved = ResolvedLayout(task=layout.task, agent=agent, output=layout.output)
    if layout.segments is None:
        resolved.derived = True
        resolved.segments = derive(prompt, pieces, known, min_tokens, agent)
        return resolved
    cursor = 0
    for i, seg in enumerate(layout.segments):
        where = f"segments[{i}] (slot {seg.slot!r})"
        if seg.start is not None:
            if seg.end > len(prompt):
                raise LayoutError(
                    f"{where}: [{seg.start}, {seg.end}) lies beyond the prompt ({len(prompt)} tokens)"
                )
            if seg.start < cursor:
                raise LayoutError(
                    f"{where}: [{seg.start}, {seg.end}) overlaps or precedes the segment before it"
                )
            ids = prompt[seg.start : seg.end]
            if seg.slot in known and list(known[seg.slot]) != ids:
                raise LayoutError(
                    f"{where}: the task's slot {seg.slot!r} holds other tokens than [{seg.start}, {seg.end})"
                )
            located = LocatedSegment(seg.slot, seg.start, seg.end, kind=seg.kind)
        else:
            if seg.text is not None:
                ids = tokens.tokenize(seg.text)
                if not ids:
                    raise LayoutError(f"{where}: the text tokenizes to zero tokens")
                if seg.slot in known and list(known[seg.slot]) != ids:
                    raise LayoutError(
                        f"{where}: the task's slot {seg.slot!r} already holds other text (a slot's content is "
                        "fixed within a task; use another slot name or task)"
                    )
            elif seg.slot in known:
                ids = list(known[seg.slot])
            elif check_only:
                continue
            else:
                raise LayoutError(
                    f"{where}: no text and no such slot recorded in task {layout.task!r}; "
                    f"recorded: {sorted(known)[:20]}"
                )
            at = find(prompt, ids, cursor)
            if at < 0 and seg.text is None:
                resolved.missing.append(seg.slot)
                continue
            if at < 0:
                before = find(prompt, ids, 0)
                if before >= 0:
                    raise LayoutError(
                        f"{where}: its tokens occur only at {before}, overlapping or before the segment before it"
                    )
                raise LayoutError(
                    f"{where}: its {len(ids)} tokens do not occur in the prompt ({len(prompt)} tokens)"
                )
            located = LocatedSegment(seg.slot, at, at + len(ids), text=seg.text, kind=seg.kind)
        resolved.segments.append(located)
        cursor = located.end
    return resolved


def derive(
    prompt: list[int],
    pieces: list[tuple[int, int]],
    known: Mapping[str, Sequence[int]],
    min_tokens: int,
    agent: str = "agent",
) -> list[LocatedSegment]:
    """The default layout (module docstring): known slots found in the prompt, then new chunks, named
    ``<agent>.m<k>`` by their place in the prompt."""
    taken: list[tuple[int, int]] = []

    def free(start: int, end: int) -> bool:
        return all(end <= s or start >= e for s, e in taken)

    found = []
    for name, ids in sorted(known.items(), key=lambda item: -len(item[1])):
        ids = list(ids)
        at = next((i for i in occurrences(prompt, ids) if free(i, i + len(ids))), -1)
        if at >= 0 and ids:
            taken.append((at, at + len(ids)))
            found.append(LocatedSegment(name, at, at + len(ids)))
    names = set(known)
    for k, (start, end) in enumerate(pieces):
        if end - start >= min_tokens and free(start, end):
            name, n = f"{agent}.m{k}", 2
            while name in names:  # this agent had other text at this place earlier in the task
                name, n = f"{agent}.m{k}#{n}", n + 1
            names.add(name)
            taken.append((start, end))
            found.append(LocatedSegment(name, start, end, new=True))
    return sorted(found, key=lambda s: s.start)

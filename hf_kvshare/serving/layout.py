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

1. shared text is found by content (:func:`hf_kvshare.matching.match`): the runs of the prompt that
   repeat runs of the slots the task already holds (earlier chunks, earlier agents' outputs), at
   least :data:`MIN_SEGMENT_TOKENS` tokens long (a shorter slot: whole, where it is a whole message
   or starts one, being :data:`MIN_MESSAGE_TOKENS` long or half of it at least: a reply cut at its
   length limit is recorded without its last token, which the client passes back), longest first,
   each prompt token and each slot token used once. A run that is a whole slot is that slot's PH span; a run
   inside a slot is a *piece*, the slot ``"<slot>[s:e]"`` (its tokens ``[s, e)``, the parent's
   producer and kind, its K/V the slice of the parent's: :meth:`hf_kvshare.request.Request.piece_slot`).
   So a document or a reply inside a larger message (a client's f-string: ``f"Report:\\n{report}
   \\n\\nEarlier replies:\\n{reply}"``) is found inside the chunk that holds it; a chunk made of
   other text around it is matched against the earlier chunks of the task, so text an agent has only
   *seen* (inside its message, never its own slot) is found as a piece of that message's chunk; and a
   reply whose text re-tokenizes differently at a place (a generated ``"\\n\\n"`` token read back as
   two) is found as the pieces on either side of it (a piece shorter than the minimum is the agent's
   own text);
2. every chunk nothing was found in (but the agent's instructions: a ``system`` / ``developer``
   message, :data:`OWN_ROLES`, which is its own text), of at least :data:`MIN_MESSAGE_TOKENS` tokens (a
   task statement or a question of one sentence is a message too), becomes a new PH
   slot (computed by this agent, shared with the agents after it) named by where it sits:
   ``<agent>.m<k>``, the prompt's k-th chunk (``#2``, ... when this agent's earlier prompt of the task
   had other text there); in a chunk where pieces were found, each run between them of at least that
   many tokens becomes a slot ``<agent>.m<k>.<r>`` (its r-th run). Names are per task, so the same
   place in the same agent's prompt has the same name in every task: what a method that learns per
   slot (KVCMAS's anchor pools of given text) needs to learn across tasks; ``slot_name``-style content
   hashes would give every document a pool of its own;
3. everything else is the agent's own text (PF).

So a task, a document or another agent's output that a later agent's prompt repeats, as a message or
inside one, is shared without any client change. The task is ``"default"`` (one task for the whole
server: give ``task`` to separate requests), the agent ``"a<sha1 of the prompt's first chunk>"`` (an
agent is its system prompt). A template that gives a role a header of its own between special tokens
(Llama 3's ``<|start_header_id|>system<|end_header_id|>``) makes that header no chunk: its role goes
to the chunk after it (:func:`message_chunks`). An explicit segment ``{"slot": name}`` whose recorded tokens do not occur
whole in the prompt is matched the same way against that slot alone: the pieces found are its spans
(the report lists them under ``matched``), and only a slot of which nothing is found is ``missing``.

What vLLM's connector rules out: it takes external K/V for ONE contiguous range of a request, from its
own prefix-cache hit on; every token after the first one nothing places is computed by the engine.
A piece after the agent's own text (the f-string's glue, a task line, the template tokens between
messages) is placed by the method but claimed only when everything before it is placed too (vLLM's
prefix cache, the agent's kept text with ``prefix_reuse=True``, or other pieces); otherwise the
engine computes it and the record keeps it dense (the report's ``placed`` vs ``supplied``). So the
pieces a one-message client gets are the ones a run of placed text reaches, in order; what lies after
a gap of new text is shared in a Session (any layout) but not through this connector. This is why a
message as short as a task statement is a slot of its own (:data:`MIN_MESSAGE_TOKENS`): folded into
the agent's leading text, that text would be new in every task (prefix reuse keys kept text by its
exact ids), the claim would stop at position 0, and every note and reply behind it would be computed
again; as a slot, the agent's leading text (its system prompt and the template's glue) is the same in
every task and is placed, the task statement is computed once by the task's first agent and placed
for the next ones. (Kept text matched by its longest common prefix instead would not close this: the
new task text would still sit between the kept part and the shared spans.)

Images (vision-language models)
-------------------------------

An image (or video) of the request, as vLLM's processor expanded it into placeholder tokens, is one
PH span of its own, found by the server, never by its token ids: every image's placeholders are the
same ids, so the connector reads each item's place and hash from vLLM's request
(``Request.mm_features``: ``mm_position`` and ``identifier``, the hash vLLM caches the item's encoder
output under) and states them under the server's key :data:`IMAGES` (a client cannot). The span's slot
is named by that hash (:func:`image_slot`: ``"image:<hash>"``): a repeated image is one slot, read by
every agent of the task as ``PH(slot, image=...)`` is in a Session (an ``"observation"``: FullShared
places its K/V re-positioned); two different images are two slots and never share. The text layout
never sees the placeholders (:func:`masked_prompt`: they split the chunks and match nothing), and an
explicit segment that overlaps an image is an error.

Sampling K/V of the prompt's log-probabilities (``prompt_logprobs``) makes vLLM skip the connector
unless ``skip_reading_prefix_cache=False`` is sent too (then with ``detokenize=False``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from ..matching import match, parse_piece_name, piece_name
from ..trajectory import GIVEN_KINDS

#: a chunk's first line of at most this many tokens is a role header, not content
ROLE_LINE_TOKENS = 4
#: the roles chat templates name in a message's header (a role line, or a header chunk of its own)
ROLE_NAMES = frozenset({"system", "developer", "user", "assistant", "tool", "ipython", "model", "function"})
#: roles whose message is the agent's own instructions: its own text, never a new shared slot (the
#: agent frameworks' "instructions"; a slot of them shares nothing, as no other agent reads them, and
#: stops a method that gates each slot, KVCMAS, at the prompt's start)
OWN_ROLES = frozenset({"system", "developer"})
#: default layout: a run of new text inside a message where shared text was found becomes a shared
#: slot from this many tokens on (shorter runs are the client's glue around it: ``"Report:\n"``)
MIN_SEGMENT_TOKENS = 16
#: default layout: a whole message nothing was found in becomes a shared slot from this many tokens on
#: (at most ``min_tokens``): a message is a unit the client chose, so a short one (a task statement, a
#: question) is content another agent may read; shorter ones are labels (``"Task:"``, ``"Your
#: answer:"``), the agent's own glue as in a Session's layout. A short slot is found later only whole,
#: where it is a message of its own or starts one (:func:`derive`), never inside a larger one.
MIN_MESSAGE_TOKENS = 8
#: the key under ``kv_transfer_params`` that holds hf_kvshare's layout
KEY = "hf_kvshare"
DEFAULT_TASK = "default"
_REQUEST_KEYS = frozenset({"task", "agent", "output", "method", "segments"})
#: set by the server itself (``Sharing.admit``: the client's ``cache_salt``), never by a client
TENANT = "tenant"
#: set by the server itself (the connector, from vLLM's ``Request.mm_features``), never by a client:
#: the request's images / videos as ``[{"hash", "start", "end", "modality"}, ...]``
IMAGES = "images"
#: the modalities whose items are image spans (named ``"<modality>:<hash>"``)
IMAGE_MODALITIES = ("image", "video")
#: what an image's placeholder tokens read as in the text layout (no token id is negative)
MASKED = -1
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


@dataclass(frozen=True)
class ImageSpan:
    """One image (or video) of the prompt as vLLM placed it: its placeholder tokens ``[start, end)``
    and the hash vLLM keeps its encoder output under (``MultiModalFeatureSpec.identifier``)."""

    hash: str
    start: int
    end: int
    modality: str = "image"

    @property
    def slot(self) -> str:
        return image_slot(self.hash, self.modality)


def image_slot(hash_: str, modality: str = "image") -> str:
    """The slot an image (video) of hash ``hash_`` is: one slot per image content in a task."""
    return f"{modality}:{hash_}"


def is_image_slot(name: str) -> bool:
    """Whether slot ``name`` is an image's (:func:`image_slot`): named by the server, never by a client."""
    return name.partition(":")[0] in IMAGE_MODALITIES and ":" in name


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
    #: the request's images (the server's, from vLLM's request), in prompt order
    images: list[ImageSpan] = field(default_factory=list)


@dataclass
class LocatedSegment:
    """A PH span of the prompt: slot name, token positions ``[start, end)``, the text it was given."""

    slot: str
    start: int
    end: int
    text: str | None = None
    new: bool = False  # default layout: a chunk that becomes a new slot
    kind: str | None = None
    #: a piece of a held slot found by content: ``(slot, start, end)``, ``slot`` then its piece's name
    piece_of: tuple[str, int, int] | None = None
    #: an image's span (:class:`ImageSpan`): its slot is named by the image's hash
    image: ImageSpan | None = None


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
    #: slots named without text or positions found in the prompt as pieces, not whole (an output that
    #: re-tokenizes differently in the client's text): ``{"slot", "pieces": [[start, end, at], ...],
    #: "tokens": covered, "of": its length}``
    matched: list[dict[str, Any]] = field(default_factory=list)


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
    unknown = sorted(set(raw) - _REQUEST_KEYS - {TENANT, IMAGES})
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
        images=parse_images(raw.get(IMAGES)),
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
        if is_image_slot(slot):
            raise LayoutError(
                f"{where}: slot names starting with {' / '.join(m + ':' for m in IMAGE_MODALITIES)} are the "
                "server's (an image's slot is named by its hash); use another name"
            )
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


def parse_images(raw: Any) -> list[ImageSpan]:
    """The server's :data:`IMAGES` entry -> the request's :class:`ImageSpan` s, in prompt order,
    checked (non-overlapping, non-empty)."""
    if raw is None:
        return []
    where = f"kv_transfer_params.{KEY}.{IMAGES}"
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise LayoutError(f"{where} must be a list, got {type(raw).__name__}")
    images = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise LayoutError(f"{where}[{i}] must be an object, got {type(item).__name__}")
        hash_, start, end = item.get("hash"), item.get("start"), item.get("end")
        modality = item.get("modality", "image")
        if not isinstance(hash_, str) or not hash_:
            raise LayoutError(f"{where}[{i}].hash must be a non-empty string, got {hash_!r}")
        if modality not in IMAGE_MODALITIES:
            raise LayoutError(f"{where}[{i}].modality must be one of {IMAGE_MODALITIES}, got {modality!r}")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (start, end)) or end <= start:
            raise LayoutError(f"{where}[{i}]: [start, end) must be token positions, got [{start!r}, {end!r})")
        images.append(ImageSpan(hash_, start, end, modality))
    images.sort(key=lambda image: image.start)
    for before, after in zip(images, images[1:]):
        if after.start < before.end:
            raise LayoutError(
                f"{where}: images at [{before.start}, {before.end}) and [{after.start}, {after.end}) overlap"
            )
    return images


def images_of(features: Any) -> list[dict[str, Any]]:
    """vLLM's ``Request.mm_features`` -> the :data:`IMAGES` entry: each image's (video's) placeholder
    range (``mm_position``) and the hash vLLM keeps its encoder output under (``identifier``, else
    ``mm_hash``). Other modalities are left out (their tokens are then the agent's own text)."""
    images = []
    for feature in features or ():
        modality = getattr(feature, "modality", None)
        position = getattr(feature, "mm_position", None)
        hash_ = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        if modality in IMAGE_MODALITIES and position is not None and hash_:
            start = int(position.offset)
            images.append(
                {
                    "hash": str(hash_),
                    "start": start,
                    "end": start + int(position.length),
                    "modality": modality,
                }
            )
    return images


def masked_prompt(prompt: Sequence[int], images: Sequence[ImageSpan]) -> list[int]:
    """``prompt`` with every image's placeholder tokens read as :data:`MASKED`: for the text layout they
    end a chunk (as a special token does) and match no text."""
    masked = list(prompt)
    for image in images:
        if image.end > len(masked):
            raise LayoutError(
                f"the {image.modality} at [{image.start}, {image.end}) lies beyond the prompt ({len(masked)} tokens)"
            )
        masked[image.start : image.end] = [MASKED] * (image.end - image.start)
    return masked


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


def message_chunks(
    prompt: Sequence[int], special: set[int], is_space, decode
) -> tuple[list[tuple[int, int]], list[str | None]]:
    """:func:`chunks` and each one's role (``None`` where no header names one): its dropped role line
    (ChatML's ``system\\n``), or a header chunk of its own before it (Llama 3's role between special
    tokens), which is then no chunk. ``decode``: token ids -> text."""
    out, roles, pending = [], [], None
    for start, end in chunks(prompt, special, is_space):
        raw = start
        while raw > 0 and prompt[raw - 1] not in special:
            raw -= 1
        line = decode(prompt[raw:start]).strip().lower() if raw < start else ""
        text = decode(prompt[start:end]).strip().lower() if end - start <= ROLE_LINE_TOKENS else ""
        if text in ROLE_NAMES:
            pending = text  # a header chunk of its own: the next chunk's role
            continue
        out.append((start, end))
        roles.append(line if line in ROLE_NAMES else pending)
        pending = None
    return out, roles


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

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids)) if len(ids) else ""


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
    prompt = masked_prompt(prompt, layout.images)  # images: spans of their own, never text
    check_only = known is None
    known = {name: ids for name, ids in (known or {}).items() if not is_image_slot(name)}
    special = tokens.special | {MASKED} if layout.images else tokens.special
    pieces, roles = message_chunks(prompt, special, tokens.is_space, tokens.decode)
    agent = layout.agent or ("a" + slot_name(prompt[pieces[0][0] : pieces[0][1]])[1:] if pieces else "agent")
    if layout.tenant and not layout.agent:  # a named agent was fenced by the server already
        agent = f"{agent}|{layout.tenant}"
    resolved = ResolvedLayout(task=layout.task, agent=agent, output=layout.output)
    if layout.segments is None:
        resolved.derived = True
        own = {piece for piece, role in zip(pieces, roles) if role in OWN_ROLES}
        resolved.segments = with_images(derive(prompt, pieces, known, min_tokens, agent, own=own), layout)
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
            if MASKED in ids:
                raise LayoutError(f"{where}: [{seg.start}, {seg.end}) overlaps an image of the prompt")
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
                pieces = located_pieces(prompt, cursor, seg.slot, ids, min_tokens)
                if not pieces:
                    resolved.missing.append(seg.slot)
                    continue
                resolved.matched.append(
                    {
                        "slot": seg.slot,
                        "pieces": [[p.piece_of[1], p.piece_of[2], p.start] for p in pieces],
                        "tokens": sum(p.end - p.start for p in pieces),
                        "of": len(ids),
                    }
                )
                resolved.segments.extend(pieces)
                cursor = pieces[-1].end
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
    resolved.segments = with_images(resolved.segments, layout)
    return resolved


def with_images(segments: list[LocatedSegment], layout: RequestLayout) -> list[LocatedSegment]:
    """``segments`` (text, found on the masked prompt: none overlaps an image) and one PH span per
    image, its slot named by its hash (an ``"observation"``, as ``PH(slot, image=...)`` is), in order."""
    images = [
        LocatedSegment(image.slot, image.start, image.end, kind="observation", image=image)
        for image in layout.images
    ]
    return sorted(segments + images, key=lambda s: s.start) if images else segments


def located_pieces(
    prompt: list[int], begin: int, slot: str, ids: Sequence[int], min_tokens: int
) -> list[LocatedSegment]:
    """The pieces of slot ``slot`` (token ids ``ids``) found in ``prompt[begin:]``, as PH spans in
    prompt order (a whole occurrence is the slot itself)."""
    found = match(prompt[begin:], {slot: ids}, min_tokens).pieces
    return [_located(p, len(ids), begin) for p in found]


def _located(piece, slot_length: int, offset: int = 0) -> LocatedSegment:
    start = piece.prompt_start + offset
    if (piece.slot_start, piece.slot_end) == (0, slot_length):
        return LocatedSegment(piece.slot, start, start + piece.length)
    return LocatedSegment(
        piece_name(piece.slot, piece.slot_start, piece.slot_end),
        start,
        start + piece.length,
        piece_of=(piece.slot, piece.slot_start, piece.slot_end),
    )


def derive(
    prompt: list[int],
    pieces: list[tuple[int, int]],
    known: Mapping[str, Sequence[int]],
    min_tokens: int,
    agent: str = "agent",
    own: Set[tuple[int, int]] = frozenset(),
) -> list[LocatedSegment]:
    """The default layout (module docstring): the task's slots found in the prompt by content (whole or
    as pieces), then the chunks and the runs of chunks nothing was found in, named ``<agent>.m<k>``
    (``.<r>``) by their place in the prompt. ``known``: the task's slots in the order they were
    recorded; a piece a task holds already (``"<slot>[s:e]"``) is found through its parent. ``own``:
    the chunks that are the agent's instructions (never a new slot; a known slot inside one is found)."""
    sources = {name: ids for name, ids in known.items() if not _piece_of_known(name, known)}
    whole_chunks = set(pieces)
    chunk_ends = dict(pieces)  # a chunk's start -> its end
    min_message = min(min_tokens, MIN_MESSAGE_TOKENS)

    def starts_a_message(p) -> bool:
        """``p`` starts a message and is ``min_message`` long or covers at least half of it."""
        end = chunk_ends.get(p.prompt_start)
        return end is not None and (p.length >= min_message or 2 * p.length >= end - p.prompt_start)

    found = [
        _located(p, len(sources[p.slot]))
        for p in match(prompt, sources, min_tokens).pieces
        # a slot shorter than min_tokens (a short reply) counts as a message of its own only: inside a
        # larger message so few tokens are as likely a coincidence (a reply's words quoted by a new
        # document) and splitting the message there would cost more than the piece saves. Or as the
        # start of one (a reply cut at its length limit is recorded without its last token, which the
        # engine never computed K/V for and the client passes back)
        if len(sources[p.slot]) >= min_tokens
        or (p.prompt_start, p.prompt_end) in whole_chunks
        or starts_a_message(p)
    ]
    names = set(known)

    def new_slot(name: str, start: int, end: int) -> LocatedSegment:
        base, n = name, 2
        while name in names:  # this agent had other text at this place earlier in the task
            name, n = f"{base}#{n}", n + 1
        names.add(name)
        return LocatedSegment(name, start, end, new=True)

    taken = sorted((s.start, s.end) for s in found)
    chunks_found = []
    for k, (start, end) in enumerate(pieces):
        if (start, end) in own:  # the agent's instructions: its own text, where nothing was found in them
            continue
        inside = [(max(a, start), min(b, end)) for a, b in taken if a < end and b > start]
        if not inside:
            if end - start >= min_message:
                chunks_found.append(new_slot(f"{agent}.m{k}", start, end))
            continue
        runs, pos = [], start
        for a, b in inside:
            if a > pos:
                runs.append((pos, a))
            pos = max(pos, b)
        if pos < end:
            runs.append((pos, end))
        long_runs = [(a, b) for a, b in runs if b - a >= min_tokens]
        for r, (a, b) in enumerate(long_runs):
            chunks_found.append(new_slot(f"{agent}.m{k}.{r}", a, b))
    return sorted(found + chunks_found, key=lambda s: s.start)


def _piece_of_known(name: str, known: Mapping[str, Sequence[int]]) -> bool:
    """``name`` is a piece (``"<slot>[s:e]"``) of a slot ``known`` holds: matched through that slot."""
    piece = parse_piece_name(name)
    return piece is not None and piece[0] in known

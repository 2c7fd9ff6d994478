"""Agent trajectories: PF (agent-specific prefix) and PH (shared placeholder) segments.

A turn's prompt is a list of segments::

    [PF(system prompt), PH("query"), PF(glue before planner), PH("planner"), PF(assistant header)]

Each segment is tokenized on its own (``add_special_tokens=False``), so every segment's token
span is exact and identical across methods, and a PH slot has the same token ids wherever it
appears. :func:`chat` lays segments out with the tokenizer's chat template (system / user /
assistant header) without giving up that property.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class PF:
    """Agent-specific text, always computed densely for the agent that reads it."""

    text: str
    label: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"PF text must be a string; got {self.text!r} ({type(self.text).__name__})")
        if self.label is not None and not isinstance(self.label, str):
            raise TypeError(
                f"PF label must be a string or None; got {self.label!r} ({type(self.label).__name__})"
            )


#: the kinds of shared text given with a request (agent outputs have none: they are outputs)
GIVEN_KINDS = ("question", "observation")


@dataclass(frozen=True)
class PH:
    """Shared content named by ``slot``. Give ``text`` the first time a slot appears in a session;
    later references (and agent outputs, recorded under the agent's name) need only the slot.

    ``kind`` says what given text is: ``"question"`` (the request's question: KVCMAS's
    ``user_question``) or ``"observation"`` (documents, tool results, test feedback: the reference
    code's conditions). ``None`` (default) lets the request decide, in this order
    (:func:`hf_kvshare.turn.given_text_slot`): text whose tokens equal an output this request already
    produced *is* that output (its slot, cache, gate decision and pools); otherwise the first given
    text of a request is its question and every later one an observation. A stated kind keeps the
    text given text of that kind (even when it equals an output); a request has at most one question.
    A reference to a slot already held (no text) may state the slot's kind, not another.

    ``image`` / ``video`` (instead of ``text``) make the slot an image or a video on a
    vision-language model (:mod:`hf_kvshare.vision`): a ``PIL.Image``, an image file's path, or the
    model's processor output for it (``pixel_values``, ``image_sizes``, optional ``input_ids``); a video
    as a list of frames or processor output (``pixel_values_videos``). The session's processor expands
    the placeholder tokens; the vision tower runs once per request. Unstated, its kind is
    ``"observation"``."""

    slot: str
    text: str | None = None
    kind: str | None = None
    image: Any = field(default=None, compare=False, repr=False)
    video: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.slot, str) or not self.slot:
            raise TypeError(
                f"PH slot must be a non-empty string naming the shared content (PH(slot, text)); "
                f"got {self.slot!r} ({type(self.slot).__name__})"
            )
        if self.text is not None and not isinstance(self.text, str):
            raise TypeError(
                f"PH text must be a string or None; got {self.text!r} ({type(self.text).__name__})"
            )
        given = [name for name in ("text", "image", "video") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"PH {self.slot!r}: give one of text, image or video; got {' and '.join(given)}")
        if self.video is not None and isinstance(self.video, (list, tuple)) and not self.video:
            raise ValueError(
                f"PH {self.slot!r}: a video needs at least one frame; got an empty {type(self.video).__name__}"
            )
        if self.kind is not None and self.kind not in GIVEN_KINDS:
            raise ValueError(
                f"PH {self.slot!r}: kind must be one of {', '.join(map(repr, GIVEN_KINDS))} or None "
                f"(agent outputs have no kind); got {self.kind!r}"
            )

    @property
    def visual(self) -> tuple[str, Any] | None:
        """``("image", value)`` / ``("video", value)`` for an image or video slot, else ``None``."""
        if self.image is not None:
            return "image", self.image
        if self.video is not None:
            return "video", self.video
        return None


SegmentSpec = PF | PH


@dataclass
class Span:
    """A tokenized segment at positions ``[start, end)`` of the prompt."""

    spec: SegmentSpec
    name: str
    token_ids: torch.Tensor  # [n] long
    start: int
    #: an image / video segment's :class:`~hf_kvshare.vision.Visual` (its input embeddings), else ``None``
    visual: Any = None

    @property
    def kind(self) -> str:
        return "PH" if isinstance(self.spec, PH) else "PF"

    @property
    def end(self) -> int:
        return self.start + self.token_ids.numel()

    @property
    def length(self) -> int:
        return self.token_ids.numel()


_SENTINEL_MARK = "\u27e6hfkv:"
_SENTINEL = "\u27e6hfkv:{}\u27e7"
_SENTINEL_RE = re.compile("\u27e6hfkv:(\\d+)\u27e7")


def chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
) -> list[SegmentSpec]:
    """Lay segments out with the tokenizer's chat template.

    ``messages`` are chat messages whose ``content`` is a string or a list of ``str`` / ``PF`` /
    ``PH``. The template's own text (role headers, separators) becomes PF segments; plain strings
    become PF; PH segments stay where they are.

    >>> chat(tok, [{"role": "system", "content": "You are a critic."},
    ...            {"role": "user", "content": [PH("query", "What is 2+2?"), "\\nPlanner said: ", PH("planner")]}])
    ... # doctest: +SKIP
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; pass the segments as a list of PF/PH instead")
    parts: list[SegmentSpec] = []
    rendered_messages = []
    for message in messages:
        if "role" not in message or "content" not in message:
            raise ValueError(f"each message needs 'role' and 'content'; got keys {sorted(message)}")
        content, role = message["content"], message["role"]
        if not isinstance(role, str) or _SENTINEL_MARK in role:
            raise ValueError(
                f"a message role must be a string without the segment marker {_SENTINEL_MARK!r}...; got {role!r}"
            )
        if not isinstance(content, (str, PF, PH, list, tuple)):
            raise TypeError(
                f"message content must be a str, PF, PH or a list of them; got a {type(content).__name__} "
                f"({content!r:.60})"
            )
        items = [content] if isinstance(content, (str, PF, PH)) else list(content)
        text = ""
        for item in items:
            if isinstance(item, str):
                item = PF(item)
            if not isinstance(item, (PF, PH)):
                raise TypeError(f"message content items must be str, PF or PH; got {type(item).__name__}")
            text += _SENTINEL.format(len(parts))
            parts.append(item)
        rendered_messages.append({"role": message["role"], "content": text})
    rendered = tokenizer.apply_chat_template(
        rendered_messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    found = [int(m.group(1)) for m in _SENTINEL_RE.finditer(rendered)]
    if found != list(range(len(parts))):
        raise ValueError(
            f"the chat template rendered the segment markers {found} for segments 0..{len(parts) - 1}: a message "
            f"field or the template itself holds the marker text {_SENTINEL_MARK!r} (or the template drops or "
            "repeats message content), so the segments cannot be placed exactly"
        )
    segments: list[SegmentSpec] = []
    pos = 0
    for match in _SENTINEL_RE.finditer(rendered):
        if match.start() > pos:
            segments.append(PF(rendered[pos : match.start()], label="template"))
        segments.append(parts[int(match.group(1))])
        pos = match.end()
    if pos < len(rendered):
        segments.append(PF(rendered[pos:], label="template"))
    return merge_adjacent_pf(segments)


def merge_adjacent_pf(segments: Sequence[SegmentSpec]) -> list[SegmentSpec]:
    """Join consecutive PF segments (one dense block each; PH segments keep their boundaries)."""
    merged: list[SegmentSpec] = []
    for seg in segments:
        if isinstance(seg, PF) and merged and isinstance(merged[-1], PF):
            merged[-1] = PF(merged[-1].text + seg.text, label=merged[-1].label)
        elif isinstance(seg, PF) and seg.text == "":
            continue
        else:
            merged.append(seg)
    return merged


def tokenize_text(tokenizer: Any, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def validate_segments(segments: Any) -> list[SegmentSpec]:
    if isinstance(segments, (PF, PH, str)):
        raise TypeError("segments must be a list of PF/PH (or chat messages), not a single segment")
    segments = list(segments)
    if not segments:
        raise ValueError("a turn needs at least one segment")
    out = []
    for i, seg in enumerate(segments):
        if isinstance(seg, str):
            seg = PF(seg)
        if not isinstance(seg, (PF, PH)):
            raise TypeError(f"segment {i} is a {type(seg).__name__}; expected PF, PH or str")
        out.append(seg)
    return out


def is_messages(segments: Any) -> bool:
    return (
        isinstance(segments, (list, tuple)) and bool(segments) and all(isinstance(s, dict) for s in segments)
    )

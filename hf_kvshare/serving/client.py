"""Client side of serving: a ``Session``-style multi-agent trajectory as OpenAI-compatible chat requests.

A trajectory is what :class:`~hf_kvshare.Session` runs: agents, shared slots (the task, a document,
another agent's output) and turns whose messages hold ``str`` / :class:`~hf_kvshare.trajectory.PF` /
:class:`~hf_kvshare.trajectory.PH` items (the input of :func:`hf_kvshare.trajectory.chat`). The
client resolves every ``PH`` to its text (given with the slot, or the reply an earlier agent
produced under that slot), so each request is plain chat messages with string contents that any
OpenAI-compatible client sends unchanged. The server derives the shared segments from those
messages by default; :meth:`ChatRequest.kv_transfer_params` gives the explicit layout (where each
shared slot's text sits: message index and character range) for a request that wants to state it.

>>> traj = ChatTrajectory(slots={"doc": "Shared notes ..."})            # doctest: +SKIP
>>> req = traj.request("critic", [{"role": "system", "content": "You are a critic."},
...                                {"role": "user", "content": [PH("doc"), "\\n\\nYour answer:"]}])
>>> body = req.body(model="m", max_tokens=8)      # POST /v1/chat/completions
>>> traj.record(req.output_slot, reply_text)      # the next agent reads PH("critic")
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..trajectory import PF, PH

#: the key of this package's explicit layout inside a request's ``kv_transfer_params``
LAYOUT_KEY = "hf_kvshare"
#: the HTTP header vLLM's router (``consistent_hash``) keys its session affinity by: the task, so that a
#: task's agents reach the replica holding its K/V (:mod:`hf_kvshare.serving.replicas`)
SESSION_HEADER = "X-Session-ID"


@dataclass(frozen=True)
class SharedSpan:
    """Where a shared slot's text sits in a request: ``messages[message].content[start:end]``."""

    slot: str
    message: int
    start: int
    end: int
    #: the slot's text was given with the trajectory (a document, the task), not recorded from a reply
    given: bool = True
    #: a given slot's stated kind (``"question"`` / ``"observation"``); ``None``: the server's default rule
    kind: str | None = None


@dataclass
class ChatRequest:
    """One agent turn as an OpenAI chat request: ``messages`` (string contents), the slot its reply
    is recorded under, and where the shared slots sit (``spans``)."""

    agent: str
    messages: list[dict[str, str]]
    output_slot: str
    spans: list[SharedSpan] = field(default_factory=list)
    max_tokens: int | None = None
    min_tokens: int | None = None
    #: the slots this turn reads, in order
    reads: tuple[str, ...] = ()
    #: the multi-agent request (one ``Session``) this turn belongs to; ``None``: the server's default
    task: str | None = None

    def kv_transfer_params(self) -> dict[str, Any]:
        """The explicit layout (``hf_kvshare.serving.layout``; overrides the server's derivation from
        the messages): task, agent, output slot, and the shared segments in prompt order, a given
        slot with its text (located by its tokens in the prompt), a reply by its slot name alone (the
        server matches the token ids it generated)."""
        segments = [
            ({"slot": s.slot, "text": self.text(s)} if s.given else {"slot": s.slot})
            | ({"kind": s.kind} if s.given and s.kind is not None else {})
            for s in self.spans
        ]
        layout: dict[str, Any] = {"agent": self.agent, "output": self.output_slot, "segments": segments}
        if self.task is not None:
            layout = {"task": self.task, **layout}
        return {LAYOUT_KEY: layout}

    def headers(self) -> dict[str, str]:
        """The request's HTTP headers for replicas behind vLLM's router: ``X-Session-ID: <task>`` (none
        without a task); with the OpenAI client, ``extra_headers=request.headers()``."""
        return {SESSION_HEADER: self.task} if self.task else {}

    def text(self, span: SharedSpan) -> str:
        """The text of a shared span."""
        return self.messages[span.message]["content"][span.start : span.end]

    def body(
        self,
        model: str,
        *,
        max_tokens: int | None = None,
        stream: bool = False,
        explicit_layout: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The JSON body of ``POST /v1/chat/completions``: greedy, ``max_tokens`` (default the
        request's), ``min_tokens`` when set (fixed-length outputs: a vLLM sampling parameter),
        the explicit layout when asked; ``extra`` keys are added last."""
        body: dict[str, Any] = {"model": model, "messages": self.messages, "temperature": 0.0}
        n = self.max_tokens if max_tokens is None else max_tokens
        if n is not None:
            body["max_tokens"] = n
        if self.min_tokens is not None:
            body["min_tokens"] = min(self.min_tokens, n) if n is not None else self.min_tokens
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if explicit_layout:
            body["kv_transfer_params"] = self.kv_transfer_params()
        body.update(extra or {})
        return body

    def openai_kwargs(self, model: str, **kwargs: Any) -> dict[str, Any]:
        """Keyword arguments for ``openai.OpenAI().chat.completions.create``: the non-standard fields
        (``min_tokens``, ``kv_transfer_params``, ...) go in ``extra_body``."""
        body = self.body(model, **kwargs)
        standard = ("model", "messages", "temperature", "max_tokens", "stream", "stream_options")
        out = {k: body.pop(k) for k in standard if k in body}
        if body:
            out["extra_body"] = body
        return out


class ChatTrajectory:
    """The shared slots of one multi-agent request and the replies recorded so far.

    ``slots`` maps a slot name to its text (the task, a document). :meth:`request` turns one agent
    turn into a :class:`ChatRequest`; :meth:`record` stores an agent's reply under its output slot
    (default: the agent's name, then ``name#2``, ... as a ``Session`` names them) so later turns can
    read it with ``PH(slot)``. A ``PH`` with text defines its slot on first use, as in a ``Session``.
    """

    def __init__(self, slots: Mapping[str, str] | None = None, task: str | None = None) -> None:
        self.slots: dict[str, str] = {}
        #: given slots' stated kinds (from ``PH(..., kind=...)``), sent with the explicit layout
        self.kinds: dict[str, str] = {}
        self.task = task
        for name, text in (slots or {}).items():
            self._define(name, text)
        self._pending: set[str] = set()
        self._recorded: set[str] = set()

    def _define(self, name: str, text: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a slot name must be a non-empty string; got {name!r}")
        if not isinstance(text, str) or not text:
            raise ValueError(f"slot {name!r}: its text must be a non-empty string")
        if name in self.slots and self.slots[name] != text:
            raise ValueError(f"slot {name!r} is already defined with another text")
        self.slots[name] = text

    def output_slot(self, agent: str) -> str:
        """The slot an agent's next reply goes to: ``agent``, then ``agent#2``, ..."""
        name, n = agent, 2
        while name in self.slots or name in self._pending:
            name, n = f"{agent}#{n}", n + 1
        return name

    def request(
        self,
        agent: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        output_slot: str | None = None,
        max_tokens: int | None = None,
        min_tokens: int | None = None,
        split: bool = True,
    ) -> ChatRequest:
        """One agent turn: chat messages whose ``content`` is a string or a list of ``str`` / ``PF`` /
        ``PH`` items; every ``PH`` becomes its slot's text (an unknown slot is a ``ValueError``).

        ``split`` (default): a message mixing text and ``PH`` items becomes consecutive messages of
        its role, each ``PH`` a message of its own and the text between them others (whitespace-only
        text dropped), so every shared segment is a whole message content, which is what the
        server's default derivation recognises; ``split=False`` keeps one message with the slots'
        texts joined into it (then state the layout with :meth:`ChatRequest.kv_transfer_params`)."""
        if not messages:
            raise ValueError("a request needs at least one message")
        pieces: list[tuple[int, str, list[Any]]] = []  # (source message, role, items)
        for i, message in enumerate(messages):
            if "role" not in message or "content" not in message:
                raise ValueError(f"message {i} needs 'role' and 'content'; got keys {sorted(message)}")
            content = message["content"]
            items = [content] if isinstance(content, (str, PF, PH)) else list(content)
            for item in items:
                if not isinstance(item, (str, PF, PH)):
                    raise TypeError(
                        f"message {i}: content items must be str, PF or PH; got {type(item).__name__}"
                    )
            role = str(message["role"])
            if not split:
                pieces.append((i, role, items))
                continue
            run: list[Any] = []
            for item in items:
                if isinstance(item, PH):
                    if "".join(x.text if isinstance(x, PF) else x for x in run).strip():
                        pieces.append((i, role, run))
                    pieces.append((i, role, [item]))
                    run = []
                else:
                    run.append(item)
            if "".join(x.text if isinstance(x, PF) else x for x in run).strip() or not items:
                pieces.append((i, role, run))
        out: list[dict[str, str]] = []
        spans: list[SharedSpan] = []
        reads: list[str] = []
        for source, role, items in pieces:
            text = ""
            for item in items:
                if isinstance(item, PH):
                    if item.text is not None:
                        self._define(item.slot, item.text)
                    if item.kind is not None:
                        if self.kinds.setdefault(item.slot, item.kind) != item.kind:
                            raise ValueError(
                                f"slot {item.slot!r} was stated as kind {self.kinds[item.slot]!r}; got {item.kind!r}"
                            )
                    if item.slot not in self.slots:
                        known = ", ".join(sorted(self.slots)) or "none"
                        raise ValueError(
                            f"message {source} reads slot {item.slot!r}, which has no text yet (neither given "
                            f"nor recorded from an earlier reply); slots: {known}"
                        )
                    start = len(text)
                    text += self.slots[item.slot]
                    given = item.slot not in self._recorded
                    spans.append(
                        SharedSpan(item.slot, len(out), start, len(text), given, self.kinds.get(item.slot))
                    )
                    reads.append(item.slot)
                else:
                    text += item.text if isinstance(item, PF) else item
            out.append({"role": role, "content": text})
        slot = output_slot or self.output_slot(agent)
        if slot in self.slots:
            raise ValueError(f"output slot {slot!r} already exists")
        self._pending.add(slot)
        return ChatRequest(agent, out, slot, spans, max_tokens, min_tokens, tuple(reads), self.task)

    def record(self, slot: str, text: str) -> None:
        """Store an agent's reply under ``slot`` (its request's ``output_slot``)."""
        self._pending.discard(slot)
        self._define(slot, text if text else " ")  # an empty reply still names a slot
        self._recorded.add(slot)


def task_turns(task: Any) -> Iterator[tuple[str, list[dict[str, Any]], str, int, int | None]]:
    """The turns of a bench :class:`~hf_kvshare.bench.workloads.spec.TaskSpec` in the chat layout of
    ``TaskSpec.to_workflow`` (both from ``TaskSpec.turns``): per step ``(agent, messages with PF / PH
    items, output slot, max_tokens, min_tokens)``; a given slot's ``PH`` carries its text and kind."""
    for turn in task.turns():
        yield turn.agent, turn.messages(), turn.output, turn.max_new_tokens, turn.min_new_tokens


def task_trajectory(task: Any, name: str | None = None) -> ChatTrajectory:
    """A :class:`ChatTrajectory` holding a bench task's given slots (``name``: its ``task`` in the layout)."""
    return ChatTrajectory({s.name: s.text for s in task.slots}, task=name)


def task_requests(
    task: Any, replies: Mapping[str, str] | None = None, split: bool = True
) -> list[ChatRequest]:
    """Every request of a bench task, for replies known in advance (``replies``: output slot -> text,
    e.g. NonShared's outputs for a teacher-forced pass); a missing reply stops at that turn's
    successor with the ``ValueError`` of :meth:`ChatTrajectory.request`."""
    traj, out = task_trajectory(task), []
    for agent, messages, slot, max_tokens, min_tokens in task_turns(task):
        request = traj.request(
            agent, messages, output_slot=slot, max_tokens=max_tokens, min_tokens=min_tokens, split=split
        )
        out.append(request)
        if replies is not None and slot in replies:
            traj.record(slot, replies[slot])
    return out

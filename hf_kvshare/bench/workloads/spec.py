"""The task format every workload is expressed in (``docs/workloads.md``): agents, shared slots, a
schedule. :meth:`TaskSpec.from_record` validates a record and names the offending field;
:meth:`TaskSpec.to_workflow` lays the steps out as PF/PH segments.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ...evaluation.workflow import Step, Workflow
from ...trajectory import GIVEN_KINDS, PF, PH, SegmentSpec, chat

#: answer checkers a task may name (see :mod:`hf_kvshare.bench.checkers`)
FILE_CHECKERS = ("exact", "numeric", "letter", "answer")
CHECKERS = (*FILE_CHECKERS, "humaneval")

DEFAULT_GLUE = "\n\n{label}:\n"
DEFAULT_TAIL = "\n\nYour answer:"


class WorkloadFormatError(ValueError):
    """A workload record does not follow the format; the message names the record and field."""


#: how many characters a glue's format specs may add beyond its literal text and labels
MAX_GLUE_PADDING = 4096
_GLUE_ALLOWED = (
    "allowed: literal text and {label}, optionally with a conversion (!s, !r, !a) and a string format "
    f"spec whose widths add up to at most {MAX_GLUE_PADDING} (e.g. {{label:>12}}, {{label:.20}}); "
    "a literal brace is written {{ or }}"
)


def glue_problem(glue: str, labels: list[str]) -> str | None:
    """Why ``glue`` cannot be formatted safely with ``labels`` (``None`` when it can): an unknown or
    malformed replacement field, a format spec or conversion that fails on a label, or widths that
    would pad the glue by more than :data:`MAX_GLUE_PADDING` characters (checked before formatting)."""
    try:
        parsed = list(string.Formatter().parse(glue))
    except ValueError as e:
        return f"cannot be formatted ({e}) in {glue!r}; {_GLUE_ALLOWED}"
    literal, count, width = 0, 0, 0
    for text, name, spec, conversion in parsed:
        literal += len(text)
        if name is None:
            continue
        shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if name != "label":
            return f"unknown placeholder {shown}; only {{label}} is allowed"
        if "{" in spec or "}" in spec:
            return f"{shown}: a nested field in a format spec is not allowed; {_GLUE_ALLOWED}"
        count += 1
        width += sum(int(d) for d in re.findall(r"\d+", spec))  # an upper bound of the padding
        if width > MAX_GLUE_PADDING:
            return f"{shown}: the format widths add up to {width} characters; {_GLUE_ALLOWED}"
    for label in labels:
        try:
            text = glue.format(label=label)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            return f"cannot be formatted with label {label!r} ({e}); {_GLUE_ALLOWED}"
        padding = len(text) - literal - count * len(label)
        if padding > MAX_GLUE_PADDING:  # a !r of a label with escapes grows it
            return f"formats to {padding} characters beyond its text and labels; {_GLUE_ALLOWED}"
    return None


def positions_problem(new_tokens: int, limit: int, model: str) -> str | None:
    """Why ``new_tokens`` new tokens plus one prompt token cannot fit in the ``limit`` positions of
    ``model`` (``None`` when they fit)."""
    if new_tokens + 1 <= limit:
        return None
    return (
        f"{new_tokens} new tokens plus at least 1 prompt token exceed the {limit} positions of model "
        f"{model} (max_position_embeddings); at most {limit - 1}"
    )


@dataclass(frozen=True)
class AgentSpec:
    """An agent: its system prompt, the glue text before each slot it reads, the text after the
    last slot, and optionally the PEFT adapter it runs with."""

    name: str
    system: str = ""
    glue: str = DEFAULT_GLUE  # may use {label}: the slot's label
    tail: str = DEFAULT_TAIL
    adapter: str | None = None


@dataclass(frozen=True)
class SlotSpec:
    """Shared content given with the request (the user query, a document, an instruction), or an
    image (``image``: a ``PIL.Image`` or an image file's path, read by a vision-language model's
    processor as ``PH(name, image=...)``; ``text`` then stays empty) or a video (``video``: its
    frames). Workloads draw them in memory (``mathvista``, ``videomme``); the JSONL file format names
    image files (``"image": "chart.png"``, ``"video": ["f0.png", ...]``, relative to the file)."""

    name: str
    text: str = ""
    label: str | None = None  # how glue names it; default: the slot name
    #: "question" or "observation" (:class:`~hf_kvshare.trajectory.PH`); None: :meth:`TaskSpec.slot_kinds`
    kind: str | None = None
    image: Any = field(default=None, compare=False, repr=False)
    #: a video: a list of frames (``PIL.Image`` s or image files' paths), ``PH(name, video=...)``
    video: Any = field(default=None, compare=False, repr=False)

    @property
    def media(self) -> tuple[str, Any] | None:
        """``("image", value)`` / ``("video", frames)`` for an image or video slot, else ``None``."""
        if self.image is not None:
            return "image", self.image
        if self.video is not None:
            return "video", self.video
        return None


@dataclass(frozen=True)
class StepSpec:
    """One agent turn: which slots it reads, in order, and where its output goes."""

    agent: str
    reads: tuple[str, ...] = ()
    output: str | None = None  # output slot; default <agent>, then <agent>#2, ...
    label: str | None = None  # label of the output when later agents read it; default: the agent name
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None


@dataclass
class BenchStep(Step):
    """A :class:`~hf_kvshare.evaluation.Step` that also names the slots it reads."""

    reads: tuple[str, ...] = ()


@dataclass(frozen=True)
class TaskTurn:
    """One step of a task as its agent says it (:meth:`TaskSpec.turns`), before any layout."""

    agent: str
    system: str
    #: the user content: ``PF`` glue and tail, a ``PH`` per slot read (given slots with their text)
    content: list[SegmentSpec]
    output: str
    max_new_tokens: int
    min_new_tokens: int | None = None
    adapter: str | None = None
    reads: tuple[str, ...] = ()

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages: the system prompt (when the agent has one), then the user content."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": list(self.content)}]


@dataclass
class TaskSpec:
    """One request: agents, given slots, the schedule, and an optional answer with its checker."""

    id: str
    agents: list[AgentSpec]
    slots: list[SlotSpec]
    schedule: list[StepSpec]
    max_new_tokens: int = 48
    chat: bool | None = None  # None: use the chat template when the tokenizer has one
    answer: str | None = None
    checker: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # not in the file format (e.g. HumanEval tests)

    def __post_init__(self) -> None:
        self._check()

    def agent(self, name: str) -> AgentSpec:
        return {a.name: a for a in self.agents}[name]

    @property
    def adapters(self) -> list[str]:
        return sorted({a.adapter for a in self.agents if a.adapter})

    def output_slots(self) -> list[str]:
        """The output slot of each step (explicit, or ``agent``, ``agent#2``, ... as a Session names them)."""
        taken = {s.name for s in self.slots}
        names = []
        for step in self.schedule:
            name = step.output
            if name is None:
                name, n = step.agent, 2
                while name in taken:
                    name, n = f"{step.agent}#{n}", n + 1
            taken.add(name)
            names.append(name)
        return names

    def reused_slots(self) -> list[set[str]]:
        """Per step, the slots it reads that an earlier step already read or produced (reusable)."""
        seen: set[str] = set()
        out = []
        for step, produced in zip(self.schedule, self.output_slots()):
            out.append(set(step.reads) & seen)
            seen.update(step.reads)
            seen.add(produced)
        return out

    def slot_kinds(self) -> dict[str, str]:
        """Each given slot's kind as the session reads it: the stated one; unstated, the first given slot
        the schedule reads is the question (unless a slot is stated as the question) and every later
        one an observation (the session's default, :func:`hf_kvshare.turn.given_text_slot`)."""
        stated = {s.name: s.kind for s in self.slots}
        question = any(kind == "question" for kind in stated.values())
        order = [slot for step in self.schedule for slot in step.reads if slot in stated]
        order = list(dict.fromkeys(order + list(stated)))
        media = {s.name for s in self.slots if s.media is not None}  # images aside, as the session
        first = next((name for name in order if name not in media), None)
        return {
            name: stated[name] or ("observation" if question or name != first else "question")
            for name in order
        }

    def _labels(self) -> list[str]:
        """Every label a glue may be formatted with: the slots' (and their names), the outputs' and
        the agents' names."""
        names = [s.label or s.name for s in self.slots] + [s.name for s in self.slots]
        names += [s.label or s.agent for s in self.schedule] + [a.name for a in self.agents]
        return list(dict.fromkeys(n for n in names if isinstance(n, str)))

    def check_positions(self, limit: int, model: str) -> None:
        """Raise :class:`WorkloadFormatError` naming the field when a turn's ``max_new_tokens`` plus one
        prompt token exceeds ``limit``, the positions ``model`` supports (``max_position_embeddings``)."""
        fields_ = [("max_new_tokens", self.max_new_tokens)]
        fields_ += [
            (f"schedule[{i}].max_new_tokens", s.max_new_tokens)
            for i, s in enumerate(self.schedule)
            if s.max_new_tokens is not None
        ]
        for where, n in fields_:
            problem = positions_problem(n, limit, model)
            if problem:
                raise WorkloadFormatError(f"{where}: {problem}")

    def _check(self) -> None:
        def fail(where: str, msg: str) -> None:
            raise WorkloadFormatError(f"{where}: {msg}")

        if not self.agents:
            fail("agents", "at least one agent is needed")
        names = [a.name for a in self.agents]
        for i, a in enumerate(self.agents):
            if names.index(a.name) != i:
                fail(f"agents[{i}].name", f"agent {a.name!r} is defined twice")
            problem = glue_problem(a.glue, self._labels())
            if problem:
                fail(f"agents[{i}].glue", problem)
        slot_names = [s.name for s in self.slots]
        for i, s in enumerate(self.slots):
            if slot_names.index(s.name) != i:
                fail(f"slots[{i}].name", f"slot {s.name!r} is defined twice")
            given = ["text"] * bool(s.text) + [n for n in ("image", "video") if getattr(s, n) is not None]
            if len(given) > 1:
                fail(f"slots[{i}]", f"give one of text, an image or a video; got {' and '.join(given)}")
            if s.video is not None and (not isinstance(s.video, (list, tuple)) or not s.video):
                fail(f"slots[{i}].video", f"a video needs a non-empty list of frames; got {s.video!r}")
            if not s.text and s.media is None:
                fail(f"slots[{i}].text", "must be a non-empty string")
            if s.kind is not None and s.kind not in GIVEN_KINDS:
                fail(
                    f"slots[{i}].kind",
                    f"unknown kind {s.kind!r}; one of {', '.join(map(repr, GIVEN_KINDS))} (or absent)",
                )
            if s.kind == "question" and [t.kind for t in self.slots[:i]].count("question"):
                fail(f"slots[{i}].kind", "a request has one question; the other given slots are observations")
        if not self.schedule:
            fail("schedule", "at least one step is needed")
        if self.max_new_tokens < 1:
            fail("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        available = set(slot_names)
        outputs = self.output_slots()
        for i, step in enumerate(self.schedule):
            where = f"schedule[{i}]"
            if step.agent not in names:
                fail(f"{where}.agent", f"unknown agent {step.agent!r}; agents: {', '.join(names)}")
            for j, slot in enumerate(step.reads):
                if slot not in available:
                    later = " (it is produced by a later step)" if slot in outputs[i:] else ""
                    fail(
                        f"{where}.reads[{j}]",
                        f"slot {slot!r} is neither a given slot nor an earlier step's output{later}",
                    )
                if step.reads.index(slot) != j:
                    fail(f"{where}.reads[{j}]", f"slot {slot!r} is read twice in one step")
            agent = self.agent(step.agent)
            if not step.reads and not agent.tail and not agent.system:
                fail(where, f"agent {step.agent!r} reads nothing and has no system prompt or tail")
            if outputs[i] in available:
                fail(f"{where}.output", f"slot {outputs[i]!r} already exists")
            n_max = step.max_new_tokens if step.max_new_tokens is not None else self.max_new_tokens
            if n_max < 1:
                fail(f"{where}.max_new_tokens", f"must be >= 1, got {n_max}")
            if step.min_new_tokens is not None and not 0 <= step.min_new_tokens <= n_max:
                fail(f"{where}.min_new_tokens", f"must be between 0 and max_new_tokens={n_max}")
            available.add(outputs[i])
        if self.checker is not None:
            if self.checker not in CHECKERS:
                fail("checker", f"unknown checker {self.checker!r}; one of {', '.join(CHECKERS)}")
            if self.checker != "humaneval" and self.answer is None:
                fail("answer", f"checker {self.checker!r} needs an answer")

    def turns(self) -> list[TaskTurn]:
        """Every step as the agent says it, before any layout: its system prompt and its user content
        (the glue before each slot it reads, the slot, the agent's tail) as ``PF`` / ``PH`` items, a
        given slot with its text and, where the session's default would read it otherwise, its kind.
        The one source of :meth:`to_workflow` (HF) and of ``hf_kvshare.serving.client.task_turns``
        (chat requests to a server), so both lay a task out alike."""
        given = {s.name: s for s in self.slots}
        kinds = self.slot_kinds()
        explicit = "question" in (s.kind for s in self.slots)
        labels = {s.name: s.label or s.name for s in self.slots}
        out = []
        for step, output in zip(self.schedule, self.output_slots()):
            agent = self.agent(step.agent)
            content: list[SegmentSpec] = []
            for j, slot in enumerate(step.reads):
                glue = agent.glue.format(label=labels[slot])
                if j == 0:
                    glue = glue.lstrip()
                if glue:
                    content.append(PF(glue))
                if slot in given:  # kinds stated where the session's default would read them otherwise
                    kind = kinds[slot] if explicit or given[slot].kind else None
                    media = given[slot].media
                    if media is not None:
                        content.append(PH(slot, kind=kind, **dict([media])))
                    else:
                        content.append(PH(slot, given[slot].text, kind=kind))
                else:
                    content.append(PH(slot))
            if agent.tail:
                content.append(PF(agent.tail.lstrip() if not step.reads else agent.tail))
            labels[output] = step.label or step.agent
            out.append(
                TaskTurn(
                    agent=step.agent,
                    system=agent.system,
                    content=content,
                    output=output,
                    max_new_tokens=step.max_new_tokens or self.max_new_tokens,
                    min_new_tokens=step.min_new_tokens,
                    adapter=agent.adapter,
                    reads=tuple(step.reads),
                )
            )
        return out

    def to_workflow(self, tokenizer: Any) -> Workflow:
        """Lay every step out as PF/PH segments (chat or plain layout: ``docs/workloads.md``, "Layout")."""
        use_chat = self.chat
        if use_chat is None:
            use_chat = getattr(tokenizer, "chat_template", None) is not None
        elif use_chat and getattr(tokenizer, "chat_template", None) is None:
            raise WorkloadFormatError(
                f"task {self.id!r} asks for the chat layout; the tokenizer has no chat template"
            )
        steps = []
        for turn in self.turns():
            if use_chat:
                segments = chat(tokenizer, turn.messages())
            else:
                segments = ([PF(turn.system + "\n\n")] if turn.system else []) + list(turn.content)
            kwargs = {} if turn.min_new_tokens is None else {"min_new_tokens": turn.min_new_tokens}
            steps.append(
                BenchStep(
                    agent=turn.agent,
                    segments=segments,
                    max_new_tokens=turn.max_new_tokens,
                    output_slot=turn.output,
                    adapter=turn.adapter,
                    reads=turn.reads,
                    generate_kwargs=kwargs,
                )
            )
        return Workflow(steps=steps, max_new_tokens=self.max_new_tokens, name=self.id)

    @classmethod
    def from_record(
        cls,
        record: Any,
        where: str = "record",
        default_id: str = "task",
        base: str | os.PathLike | None = None,
    ) -> TaskSpec:
        """Parse and validate one record (a JSON object; ``None`` values count as absent); a
        :class:`WorkloadFormatError` names ``where`` and the field. A slot's image file and video
        frames are paths relative to ``base`` (the task file's folder; default the working
        directory); whether they are readable images is the file loader's check
        (:func:`hf_kvshare.bench.workloads.files.check_media`)."""
        r = _Reader(where)
        obj = r.mapping(record, "")
        r.no_unknown(obj, "", _TOP_KEYS)
        agents = [
            AgentSpec(
                name=r.string(a, "name", path, required=True),
                system=r.string(a, "system", path, default="", allow_empty=True),
                glue=r.string(a, "glue", path, default=DEFAULT_GLUE, allow_empty=True),
                tail=r.string(a, "tail", path, default=DEFAULT_TAIL, allow_empty=True),
                adapter=r.string(a, "adapter", path),
            )
            for path, a in r.records(obj, "agents", AgentSpec, required=True)
        ]
        slots = []
        for path, s in r.records(obj, "slots", SlotSpec):
            image, video = r.media(s, path, base)
            slots.append(
                SlotSpec(
                    name=r.string(s, "name", path, required=True),
                    text=r.string(s, "text", path, required=image is None and video is None, default=""),
                    label=r.string(s, "label", path),
                    kind=r.string(s, "kind", path),
                    image=image,
                    video=video,
                )
            )
        schedule = []
        for path, st in r.records(obj, "schedule", StepSpec, required=True):
            reads = r.list_of(st, "reads", path)
            for j, slot in enumerate(reads):
                if not isinstance(slot, str) or not slot:
                    r.fail(f"{path}.reads[{j}]", f"expected a slot name (string), got {slot!r}")
            schedule.append(
                StepSpec(
                    agent=r.string(st, "agent", path, required=True),
                    reads=tuple(reads),
                    output=r.string(st, "output", path),
                    label=r.string(st, "label", path),
                    max_new_tokens=r.integer(st, "max_new_tokens", path, minimum=1),
                    min_new_tokens=r.integer(st, "min_new_tokens", path, minimum=0),
                )
            )
        checker = r.string(obj, "checker", "")
        if checker is not None and checker not in FILE_CHECKERS:
            r.fail("checker", f"unknown checker {checker!r}; one of {', '.join(FILE_CHECKERS)}")
        chat_flag = obj.get("chat")
        if chat_flag is not None and not isinstance(chat_flag, bool):
            r.fail("chat", f"expected true or false, got {chat_flag!r}")
        try:
            return cls(
                id=r.string(obj, "id", "") or default_id,
                agents=agents,
                slots=slots,
                schedule=schedule,
                max_new_tokens=r.integer(obj, "max_new_tokens", "", minimum=1) or 48,
                chat=chat_flag,
                answer=r.string(obj, "answer", "", allow_empty=True),
                checker=checker,
            )
        except WorkloadFormatError as e:
            raise WorkloadFormatError(f"{where}: {e}") from None

    def to_record(self) -> dict[str, Any]:
        """The JSON object of this task in the file format (``meta`` is not part of it); image files and
        frames as the paths the slots hold. A task with an image or a frame in memory (a drawn one, a
        ``PIL.Image``) has none (``WorkloadFormatError``: the file format names image files)."""
        drawn = [s.name for s in self.slots if s.media is not None and not _all_paths(s.media)]
        if drawn:
            raise WorkloadFormatError(
                f"task {self.id!r}: slot(s) {', '.join(map(repr, drawn))} hold an image or a video in memory; "
                'the JSONL task format names image files ("image": "chart.png", "video": ["frame0.png", ...])'
            )

        def slot(s: SlotSpec) -> dict[str, Any]:
            out = {k: v for k, v in asdict(s).items() if k not in ("image", "video")}
            if s.image is not None:
                out.update(text=None, image=os.fspath(s.image))
            if s.video is not None:
                out.update(text=None, video=[os.fspath(f) for f in s.video])
            return out

        return {
            "id": self.id,
            "chat": self.chat,
            "max_new_tokens": self.max_new_tokens,
            "agents": [asdict(a) for a in self.agents],
            "slots": [slot(s) for s in self.slots],
            "schedule": [{**asdict(s), "reads": list(s.reads)} for s in self.schedule],
            "answer": self.answer,
            "checker": self.checker if self.checker in FILE_CHECKERS else None,
        }


_TOP_KEYS = ("id", "chat", "max_new_tokens", "agents", "slots", "schedule", "answer", "checker")


class _Reader:
    """Typed field access with errors that name the record and the field path."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, msg: str) -> None:
        raise WorkloadFormatError(f"{self.where}: {path or 'record'}: {msg}")

    def mapping(self, value: Any, path: str) -> Mapping:
        if not isinstance(value, Mapping):
            self.fail(path, f"expected a JSON object, got {type(value).__name__}")
        return value

    def no_unknown(self, obj: Mapping, path: str, known: tuple[str, ...]) -> None:
        for key in obj:
            if key not in known and obj[key] is not None:
                self.fail(_join(path, key), f"unknown field; expected one of {', '.join(known)}")

    def records(self, obj: Mapping, key: str, spec: type, required: bool = False) -> list:
        """``(path, object)`` of each item of the list ``key``, whose fields are those of ``spec``."""
        items = []
        for i, item in enumerate(self.list_of(obj, key, required=required)):
            path = f"{key}[{i}]"
            items.append((path, self.mapping(item, path)))
            self.no_unknown(item, path, tuple(f.name for f in fields(spec) if f.metadata.get("file", True)))
        return items

    def _get(self, obj: Mapping, key: str, path: str, required: bool) -> Any:
        value = obj.get(key)
        if value is None and required:
            self.fail(_join(path, key), "is required")
        return value

    def string(self, obj: Mapping, key: str, path: str, required=False, default=None, allow_empty=False):
        value = self._get(obj, key, path, required)
        if value is None:
            return default
        if not isinstance(value, str):
            self.fail(_join(path, key), f"expected a string, got {type(value).__name__} {value!r}")
        if not value and not allow_empty:
            self.fail(_join(path, key), "must be a non-empty string")
        return value

    def integer(self, obj: Mapping, key: str, path: str, minimum: int) -> int | None:
        value = obj.get(key)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # datasets may widen integer columns to float
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(_join(path, key), f"expected an integer, got {type(value).__name__} {value!r}")
        if value < minimum:
            self.fail(_join(path, key), f"must be >= {minimum}, got {value}")
        return value

    def media(
        self, obj: Mapping, path: str, base: str | os.PathLike | None
    ) -> tuple[str | None, list | None]:
        """A slot's ``image`` (an image file's path) and ``video`` (a non-empty list of frame paths),
        resolved against ``base``: at most one of them, and no text beside it."""
        image = self.string(obj, "image", path)
        video = None
        if obj.get("video") is not None:
            video = self.list_of(obj, "video", path)
            if not video:
                self.fail(_join(path, "video"), "a video needs at least one frame; got an empty list")
            for j, frame in enumerate(video):
                if not isinstance(frame, str) or not frame:
                    self.fail(
                        f"{path}.video[{j}]", f"expected a frame's image file path (string), got {frame!r}"
                    )
        given = [k for k in ("text", "image", "video") if obj.get(k) is not None]
        if len(given) > 1:
            self.fail(path, f"give one of text, image or video; got {' and '.join(given)}")

        def resolve(name: str) -> str:
            return name if base is None or os.path.isabs(name) else os.path.join(os.fspath(base), name)

        return (None if image is None else resolve(image)), (
            None if video is None else [resolve(f) for f in video]
        )

    def list_of(self, obj: Mapping, key: str, path: str = "", required: bool = False) -> list:
        value = self._get(obj, key, path, required)
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            self.fail(_join(path, key), f"expected a list, got {type(value).__name__}")
        if required and not value:
            self.fail(_join(path, key), "must not be empty")
        return list(value)


def _all_paths(media: tuple[str, Any]) -> bool:
    kind, value = media
    items = [value] if kind == "image" else list(value)
    return all(isinstance(v, (str, os.PathLike)) for v in items)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def trajectory_task(
    task_id: str,
    roles: list[str],
    turns: list[tuple[str, str]],
    max_new_tokens: int,
    leading: tuple[SlotSpec, ...] = (),
    step_tokens: int | None = None,
    answer: str | None = None,
) -> TaskSpec:
    """One append-only trajectory of agents that differ by adapter only (PReCache's setting): the
    ``leading`` slots, then per turn ``t`` of ``turns`` (agent, instruction) the slot
    ``instruction<t>`` and the output ``<agent>@<t>``; turn ``t`` reads everything before its output,
    so every prompt extends the previous turn's tokens. No chat template (instructions carry their
    own markup), no system prompt, glue or tail; ``step_tokens`` fixes every turn's length."""
    agents = [AgentSpec(name=r, system="", glue="", tail="", adapter=r) for r in roles]
    slots, schedule = list(leading), []
    trajectory = [s.name for s in leading]
    for t, (agent, text) in enumerate(turns):
        slots.append(SlotSpec(name=f"instruction{t}", text=text))
        trajectory.append(f"instruction{t}")
        schedule.append(
            StepSpec(
                agent=agent,
                reads=tuple(trajectory),
                output=f"{agent}@{t}",
                max_new_tokens=step_tokens,
                min_new_tokens=step_tokens,
            )
        )
        trajectory.append(f"{agent}@{t}")
    return TaskSpec(
        id=task_id,
        agents=agents,
        slots=slots,
        schedule=schedule,
        max_new_tokens=max_new_tokens,
        chat=False,
        answer=answer,
        checker=None if answer is None else "answer",
    )

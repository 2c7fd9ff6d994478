"""Loading workload data through ``datasets``: JSONL task files (each line validated on its own first,
so a bad record is reported with its line number and field) and benchmark tables (GSM8K, MMLU, ...)
from a hub name or a local file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import Workload, register_workload, select
from .spec import TaskSpec, WorkloadFormatError

#: local file extensions and the ``datasets`` builder that reads them
#: the largest task file read (bytes)
MAX_TASK_FILE = 256 * 2**20
#: the longest name, label, kind or id a task names (an identifier, not text)
MAX_NAME_CHARS = 256
#: the longest glue or tail (the text an agent puts around each slot it reads: repeated per read)
MAX_GLUE_CHARS = 4096
#: the longest system prompt
MAX_SYSTEM_CHARS = 2**16
#: the most characters of given text one turn's prompt may hold (system, glue, slot texts, tail), checked
#: before anything is tokenized
MAX_TURN_CHARS = 2**22
#: the bounded string fields of a task record: (list, field, bound); ``None``: the record itself
_BOUNDED_FIELDS = (
    (None, "id", MAX_NAME_CHARS),
    ("agents", "name", MAX_NAME_CHARS),
    ("agents", "adapter", MAX_NAME_CHARS),
    ("agents", "glue", MAX_GLUE_CHARS),
    ("agents", "tail", MAX_GLUE_CHARS),
    ("agents", "system", MAX_SYSTEM_CHARS),
    ("slots", "name", MAX_NAME_CHARS),
    ("slots", "label", MAX_NAME_CHARS),
    ("slots", "kind", MAX_NAME_CHARS),
    ("schedule", "agent", MAX_NAME_CHARS),
    ("schedule", "output", MAX_NAME_CHARS),
    ("schedule", "label", MAX_NAME_CHARS),
    ("schedule", "reads", MAX_NAME_CHARS),
)
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def validate_task_file(
    path: str | os.PathLike,
    adapters: Iterable[str] | None = None,
    max_positions: int | None = None,
    model: str = "the model",
) -> list[TaskSpec]:
    """Parse and validate every line of a JSONL task file; raise naming the line and field.

    With ``adapters`` (the names of the loaded PEFT adapters, ``bench run --adapter NAME=PATH``),
    every adapter an agent names must be among them. With ``max_positions`` (the positions of
    ``model``, :func:`hf_kvshare.models.max_positions`), every turn's ``max_new_tokens`` plus one
    prompt token must fit in them."""
    return _validate_text(Path(path), _read_task_file(path), adapters, max_positions, model)


def _read_task_file(path: str | os.PathLike) -> str:
    from ..inputs import InputFileError, read_input_text

    try:
        return read_input_text(path, "workload file", MAX_TASK_FILE)
    except InputFileError as e:
        if not os.path.lexists(path):
            raise FileNotFoundError(str(e)) from None
        raise WorkloadFormatError(str(e)) from None


def _validate_text(
    path: Path, text: str, adapters: Iterable[str] | None, max_positions: int | None, model: str
) -> list[TaskSpec]:
    tasks: list[TaskSpec] = []
    ids: dict[str, int] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise WorkloadFormatError(f"{where}: JSON nested too deeply") from None
        except ValueError as e:  # an integer longer than Python converts (sys.get_int_max_str_digits)
            raise WorkloadFormatError(
                f"{where}: not valid JSON here ({' '.join(str(e).split())[:200]})"
            ) from None
        check_lengths(record, where)
        task = TaskSpec.from_record(record, where=where, default_id=f"line-{number}", base=path.parent)
        check_turn_lengths(task, where)
        check_media(task, where)
        if adapters is not None:
            check_adapters(task, adapters, where)
        if max_positions is not None:
            try:
                task.check_positions(max_positions, model)
            except WorkloadFormatError as e:
                raise WorkloadFormatError(f"{where}: {e}") from None
        if task.id in ids:
            raise WorkloadFormatError(f"{where}: id: {task.id!r} is already used on line {ids[task.id]}")
        ids[task.id] = number
        tasks.append(task)
    if not tasks:
        raise WorkloadFormatError(f"{path.name}: the file holds no task (one JSON object per line)")
    return tasks


def kinds_report(tasks: Iterable[TaskSpec]) -> str:
    """How many given slots of ``tasks`` are questions and observations (stated or by the default rule,
    :meth:`TaskSpec.slot_kinds`), e.g. ``"given slots: 12 question, 5 observation"``; for ``validate``."""
    counts = {"question": 0, "observation": 0}
    for task in tasks:
        for kind in task.slot_kinds().values():
            counts[kind] += 1
    return "given slots: " + ", ".join(f"{n} {kind}" for kind, n in counts.items())


def check_adapters(task: TaskSpec, adapters: Iterable[str], where: str) -> None:
    """Raise when an agent of ``task`` names an adapter that is not in ``adapters``."""
    loaded = sorted(set(adapters))
    for agent in task.agents:
        if agent.adapter and agent.adapter not in loaded:
            raise WorkloadFormatError(
                f"{where}: agent {agent.name!r} runs with adapter {agent.adapter!r}, which is not loaded "
                f"(loaded: {', '.join(loaded) or 'none'}; give --adapter {agent.adapter}=PATH)"
            )


def load_task_file(path: str | os.PathLike) -> list[TaskSpec]:
    """The tasks of a JSONL task file, validated line by line, loaded with ``datasets``."""
    text = _read_task_file(path)
    validated = _validate_text(Path(path), text, None, None, "the model")
    # ``datasets`` caches a local file by its path, size and mtime: hand it a copy named by the
    # content's hash instead, so a file edited in place (same size and mtime) runs its new rows,
    # and the rows loaded are the bytes validated above
    data = text.encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    copies = Path(tempfile.gettempdir()) / "hfkv-task-files"
    copies.mkdir(parents=True, exist_ok=True)
    copy = copies / f"{digest}.jsonl"
    if not copy.is_file() or hashlib.sha256(copy.read_bytes()).hexdigest() != digest:
        fd, tmp = tempfile.mkstemp(dir=copies, prefix=f".{digest[:16]}-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, copy)
    rows = _load_dataset("json", {"data_files": str(copy), "split": "train"}, str(path))
    if len(rows) != len(validated):
        raise WorkloadFormatError(
            f"{path}: datasets read {len(rows)} rows, the file has {len(validated)} tasks"
        )
    # rows carry every column of the file (None where a line lacks it): parse them again
    base = Path(path).parent
    return [
        TaskSpec.from_record(row, where=f"{Path(path).name} task {i + 1}", default_id=first.id, base=base)
        for i, (row, first) in enumerate(zip(rows, validated))
    ]


def check_lengths(record: Any, where: str) -> None:
    """Every name, label, glue, tail and system prompt of a raw task record within its bound
    (:data:`_BOUNDED_FIELDS`), checked before the record is parsed (a glue is formatted with every
    label there); ``WorkloadFormatError`` naming ``where``, the field, its length and the bound. Fields
    of another type are left to :meth:`TaskSpec.from_record`, which names them."""
    if not isinstance(record, dict):
        return
    for key, name, bound in _BOUNDED_FIELDS:
        listed = [] if key is None else record.get(key)
        if not isinstance(listed, list):
            continue  # absent, or not a list: from_record says so
        for i, item in [("", record)] if key is None else enumerate(listed):
            value = item.get(name) if isinstance(item, dict) else None
            values = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
            for j, text in values:
                if isinstance(text, str) and len(text) > bound:
                    field = name if key is None else f"{key}[{i}].{name}"
                    field += "" if j is None else f"[{j}]"
                    raise WorkloadFormatError(
                        f"{where}: {field}: {len(text):,} characters; at most {bound:,} ({_what(name)})"
                    )


def _what(name: str) -> str:
    if name in ("glue", "tail"):
        return "the text around each slot an agent reads"
    return "a system prompt" if name == "system" else "a name or label, not text"


def check_turn_lengths(task: TaskSpec, where: str) -> None:
    """Every turn's given text (its system prompt, glue, slot texts and tail) within
    :data:`MAX_TURN_CHARS` characters, before anything is tokenized."""
    for i, turn in enumerate(task.turns()):
        chars = len(turn.system) + sum(len(getattr(item, "text", None) or "") for item in turn.content)
        if chars > MAX_TURN_CHARS:
            raise WorkloadFormatError(
                f"{where}: schedule[{i}]: the turn's prompt holds {chars:,} characters of given text (system, "
                f"glue, slots, tail); at most {MAX_TURN_CHARS:,}"
            )


def check_media(task: TaskSpec, where: str) -> None:
    """Every image file and video frame a slot of ``task`` names is a readable image (opened and
    decoded with PIL); ``WorkloadFormatError`` naming ``where``, the slot's field and the file."""
    for i, slot in enumerate(task.slots):
        if slot.media is None:
            continue
        kind, value = slot.media
        named = (
            [(f"slots[{i}].image", value)]
            if kind == "image"
            else [(f"slots[{i}].video[{j}]", frame) for j, frame in enumerate(value)]
        )
        for field, name in named:
            if not isinstance(name, (str, os.PathLike)):
                continue  # an image in memory (a workload's): nothing to read
            problem = image_file_problem(name)
            if problem:
                raise WorkloadFormatError(f"{where}: {field}: {problem}")


def image_file_problem(name: str | os.PathLike) -> str | None:
    """Why ``name`` is not a readable image file, or ``None``."""
    from ...vision import open_image

    path = Path(name)
    if not path.exists():
        return f"no image file at {str(path)!r}"
    if not path.is_file():
        return f"{str(path)!r} is not a regular file"
    try:
        open_image(path)  # its size checked before it is decoded (a decompression bomb is refused)
    except ValueError as error:
        return str(error)
    return None


def load_table(source: str, config: str | None = None, split: str = "test") -> Any:
    """A ``datasets.Dataset`` from a local file (by extension) or a hub dataset name."""
    path = Path(source)
    if path.exists():
        if path.is_dir():
            return _load_dataset(str(path), {"name": config, "split": split}, source)
        builder = BUILDERS.get("".join(path.suffixes[-1:]).lower())
        if builder is None:
            raise ValueError(
                f"cannot tell the format of {source!r} from its extension; use one of {', '.join(sorted(BUILDERS))}"
            )
        return _load_dataset(builder, {"data_files": str(path), "split": "train"}, source)
    if source.startswith((".", "/", "~")) or source.endswith(tuple(BUILDERS)):
        raise FileNotFoundError(f"data file {source!r} does not exist")
    return _load_dataset(source, {"name": config, "split": split}, source)


def _load_dataset(builder: str, kwargs: dict[str, Any], source: str):
    try:  # imported here: `import hf_kvshare` and the trace / stress workloads work without it
        import datasets
    except ImportError as e:
        raise ModuleNotFoundError(
            f"reading {source!r} (the file workload and the gsm8k / mmlu / humaneval data) needs the "
            "`datasets` package, which is not installed: pip install datasets. The trace and stress "
            "workloads need no data",
            name="datasets",
        ) from e

    try:
        return datasets.load_dataset(builder, **{k: v for k, v in kwargs.items() if v is not None})
    except Exception as e:  # datasets raises many types (hub, schema, file errors); say what was loaded
        raise RuntimeError(
            f"datasets could not load {source!r} ({type(e).__name__}: {e}). A hub name needs network access; "
            "a local file needs the same JSON type for a field on every line"
        ) from e


@register_workload
@dataclass
class FileWorkload(Workload):
    """Tasks from a JSONL file in the task format (``docs/workloads.md``)."""

    name = "file"
    description = "tasks from a JSONL file in the documented task format (--data PATH)"

    data: str = ""
    limit: int | None = None
    offset: int = 0

    @property
    def visual(self) -> bool:
        """The file names image files or video frames for its slots: the bench then loads the model's
        processor and refuses a text-only model before it loads (read from the file once)."""
        if self.__dict__.get("_visual") is None:
            tasks = validate_task_file(self.data) if self.data else []
            self.__dict__["_visual"] = any(s.media is not None for t in tasks for s in t.slots)
        return self.__dict__["_visual"]

    def tag(self) -> str:
        path = Path(self.data)
        digest = hashlib.sha1(path.read_bytes()).hexdigest()[:8] if path.is_file() else "missing"
        parts = [f"O{self.offset}" if self.offset else "", f"L{self.limit}" if self.limit else ""]
        return "-".join([f"file-{path.stem}-{digest}", *filter(None, parts)])

    def check(self, adapters: Iterable[str] = ()) -> None:
        if not self.data:
            raise ValueError("the file workload needs --data PATH (a JSONL task file)")
        validate_task_file(self.data, adapters)

    def check_positions(self, limit: int, model: str) -> None:
        if not self.data:
            raise ValueError("the file workload needs --data PATH (a JSONL task file)")
        validate_task_file(self.data, max_positions=limit, model=model)

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        if not self.data:
            raise ValueError("the file workload needs --data PATH (a JSONL task file)")
        tasks = load_task_file(self.data)
        return [tasks[i] for i in select(len(tasks), self.offset, self.limit)]

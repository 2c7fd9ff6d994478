"""Reading the bench's input files and checking its output places, so that an environment failure
(a directory, FIFO or device where a file was expected, an oversized, non-UTF-8 or truncated file,
an output path that is a file or read-only) is one clear error before any work, never a hang, a
read that does not end or a traceback.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ..bounded_read import InputFileError, read_input, read_input_text  # noqa: F401 (public here)

#: the largest task file (JSONL) the bench reads
MAX_TASK_FILE = 256 * 2**20
#: the largest file a method option may name (a DroidSpeak ``layer_profile``)
MAX_OPTION_FILE = 64 * 2**20


def check_option_files(options: Any, where: str) -> None:
    """Every option value of a method spec that names an existing path must be a bounded regular
    file (``droidspeak:layer_profile=PATH``): checked before the method reads it."""
    for key, value in options:
        if isinstance(value, str) and value and os.path.lexists(value):
            read_input(value, f"{where}: option {key}", MAX_OPTION_FILE)


def check_output_dir(path: str | os.PathLike, what: str) -> None:
    """``path`` is a directory that can be written, or can be created as one: every existing
    component is a directory and the deepest existing one takes a file (a probe file is created
    and removed). Nothing is created. :class:`InputFileError` naming ``what`` otherwise."""
    target = Path(path)
    check_no_dangling_link(target, what)
    probe = target
    while not os.path.lexists(probe):
        if probe.parent == probe:
            break
        probe = probe.parent
    for ancestor in [probe, *probe.parents]:
        if os.path.lexists(ancestor) and not ancestor.is_dir():
            raise InputFileError(f"{what} {str(path)!r}: {str(ancestor)!r} exists and is not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".hfkv-write-probe-", dir=probe)
    except OSError as e:
        raise InputFileError(
            f"{what} {str(path)!r}: {str(probe)!r} is not writable ({e.strerror or e})"
        ) from None
    os.close(fd)
    os.remove(name)
    try:
        free = os.statvfs(probe)
    except OSError:
        return
    if free.f_bavail * free.f_frsize < 2**20:
        raise InputFileError(
            f"{what} {str(path)!r}: the file system of {str(probe)!r} is full (under 1 MiB free)"
        )


def check_input_dir(path: str | os.PathLike, what: str) -> None:
    if not os.path.isdir(path):
        state = "is not a directory" if os.path.lexists(path) else "does not exist"
        raise InputFileError(f"{what} {str(path)!r} {state}")


#: the largest JSON file of a run's output the bench reads back (summary.json, config.json)
MAX_RESULT_FILE = 64 * 2**20


def read_json_file(path: str | os.PathLike, what: str, max_bytes: int = MAX_RESULT_FILE) -> Any:
    """The JSON value in ``path`` (read as :func:`read_input_text`); :class:`InputFileError` naming
    ``what`` and the reason for a file that is not valid JSON (truncated, nested too deeply)."""
    import json

    text = read_input_text(path, what, max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputFileError(f"{what} {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise InputFileError(f"{what} {str(path)!r} is JSON nested too deeply") from None


def read_json_object(path: str | os.PathLike, what: str, max_bytes: int = MAX_RESULT_FILE) -> dict:
    """:func:`read_json_file` that must give a JSON object."""
    value = read_json_file(path, what, max_bytes)
    if not isinstance(value, dict):
        raise InputFileError(f"{what} {str(path)!r} must hold a JSON object, got {type(value).__name__}")
    return value


def check_no_dangling_link(path: str | os.PathLike, what: str) -> None:
    """``path`` and its ancestors hold no symbolic link to a missing target (``mkdir`` would fail
    late with a confusing ``FileExistsError``)."""
    target = Path(path)
    for candidate in [target, *target.parents]:
        if os.path.islink(candidate) and not os.path.exists(candidate):
            raise InputFileError(
                f"{what} {str(path)!r}: {str(candidate)!r} is a symbolic link to a missing target "
                f"({os.readlink(candidate)!r})"
            )

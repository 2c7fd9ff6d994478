"""Reading a file the library is given by path (a saved state's ``state.json``, a method option's
file, the bench's inputs) as one bounded read: a regular file of at most a stated size, opened without
blocking (a FIFO never hangs) and checked on the open descriptor (``/dev/zero`` is refused before any
read). Imports nothing of hf_kvshare.
"""

from __future__ import annotations

import os
import stat


class InputFileError(ValueError):
    """An input file that is not a bounded regular file (or cannot be read). ``reason`` says which:
    ``"missing"``, ``"unopenable"``, ``"not_regular"`` (``kind`` names what it is), ``"too_large"`` or
    ``"unreadable"``, for callers that word the error their own way."""

    def __init__(self, message: str, reason: str = "unreadable", kind: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.kind = kind


def read_input(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``; :class:`InputFileError`
    (naming ``what``) for anything else. Opened non-blocking, so a FIFO never hangs, and its type
    is checked on the open descriptor, so ``/dev/zero`` is refused before any read."""
    name = str(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputFileError(f"{what} {name!r} does not exist", "missing") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise InputFileError(
            f"{what} {name!r} cannot be opened: {getattr(e, 'strerror', None) or e}", "unopenable"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = _kind(info.st_mode)
            raise InputFileError(f"{what} {name!r} must be a regular file, got a {kind}", "not_regular", kind)
        if info.st_size > max_bytes:
            raise InputFileError(
                f"{what} {name!r} has {info.st_size} bytes, more than the {max_bytes} accepted", "too_large"
            )
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:  # it grew while read
                raise InputFileError(
                    f"{what} {name!r} has more than the {max_bytes} bytes accepted", "too_large"
                )
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise InputFileError(f"{what} {name!r} cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def read_input_text(path: str | os.PathLike, what: str, max_bytes: int) -> str:
    data = read_input(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise InputFileError(f"{what} {str(path)!r} is not UTF-8 (byte {e.start}, line {line})") from None


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return kind
    return "special file"

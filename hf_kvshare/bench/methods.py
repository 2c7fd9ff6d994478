"""Methods as the benchmark names them: a registry name with options (``kvcmas:tau=0.4,capacity=10``),
checked against the method class's signature."""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from ..method import option_names
from ..methods import METHODS, Method

#: the longest method spec taken (``name:key=value,...``): options are knobs, not text
MAX_SPEC_CHARS = 4096


@dataclass(frozen=True)
class MethodSpec:
    """A registry name with options, as written on the command line: ``kvcmas:tau=0.4,capacity=10``."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(
                f"method spec {text[:60]!r}... is {len(text):,} characters; at most {MAX_SPEC_CHARS} "
                "(a registry name and its options)"
            )
        name, _, rest = text.partition(":")
        name = name.strip()
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; registered methods: {', '.join(sorted(METHODS))}")
        options: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in _split_options(rest))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"method option {item!r} in {text!r} is not of the form key=value")
            if key.strip() in options:
                raise ValueError(
                    f"method option {key.strip()!r} is given twice in {text!r}; give each option once"
                )
            options[key.strip()] = _parse_value(value.strip())
        spec = cls(name, tuple(sorted(options.items())))
        spec.check_options()
        return spec

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def cls(self) -> type[Method]:
        return METHODS[self.name]

    @property
    def tag(self) -> str:
        """Directory name in plain characters (the options are recorded in ``config.json``):
        ``kvcmas:tau=0.4,capacity=10`` -> ``kvcmas-capacity_10-tau_0.4``; options that are not short
        plain words get a readable part plus 8 hex digits of their hash, so that distinct options never
        share a directory (``droidspeak:layer_profile=runs/p.json`` -> ``droidspeak-layer_profile_p-<hash>``).
        """
        if not self.options:
            return self.name
        plain = "-".join(f"{k}_{v}" for k, v in self.options)
        if len(plain) <= _TAG_OPTIONS_CHARS and all(
            isinstance(v, (bool, int, float, str)) and _PLAIN_VALUE.fullmatch(str(v)) for _, v in self.options
        ):
            return f"{self.name}-{plain}"
        readable = "-".join(f"{k}_{_readable_value(v)}" for k, v in self.options)[:_TAG_OPTIONS_CHARS]
        digest = hashlib.sha1(str(self).encode()).hexdigest()[:8]
        return f"{self.name}-{readable.strip('-_')}-{digest}"

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.options) if self.options else "")

    def option_names(self) -> list[str] | None:
        return option_names(self.cls)

    def check_options(self) -> None:
        names = self.option_names()
        if names is None:
            return
        unknown = [k for k, _ in self.options if k not in names]
        if unknown:
            accepted = ", ".join(names) or "none"
            raise ValueError(
                f"method {self.name!r} has no option {', '.join(unknown)}; its options: {accepted}"
            )

    def create(self, defaults: dict[str, Any] | None = None) -> Method:
        """An instance with the spec's options over ``defaults`` (e.g. a workload's tau)."""
        try:
            return self.cls(**{**(defaults or {}), **self.kwargs})
        except (TypeError, ValueError) as e:
            raise ValueError(f"creating method {self}: {e}") from e

    @property
    def requires_adapters(self) -> bool:
        return requires_adapters(self.cls)


def requires_adapters(cls: type[Method]) -> bool:
    """The capability flag: a method that only works on a PeftModel with one adapter per agent."""
    return cls.requires_adapters


_PLAIN_VALUE = re.compile(r"[A-Za-z0-9.]+")  # no "-" or "_": a tag's parts split back into key_value
_TAG_OPTIONS_CHARS = 48


def _readable_value(value: Any) -> str:
    """An option value inside a directory name: a file path by its stem, a list joined by ``_``,
    characters other than letters, digits, ``-``, ``_``, ``.`` as ``_``."""
    if isinstance(value, (list, tuple)):
        return "_".join(_readable_value(v) for v in value)
    text = str(value)
    if isinstance(value, str) and ("/" in text or "\\" in text):
        text = PurePath(text.replace("\\", "/")).stem
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def _split_options(text: str) -> list[str]:
    """Split ``a=1,b=[1, 2],c=x`` on the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def _parse_value(text: str) -> Any:
    """An option value: bool, None, a number, a list (as a tuple), else the string itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    if isinstance(value, (list, tuple)):
        return tuple(value)  # hashable: a MethodSpec is a dict key
    return value if isinstance(value, (int, float, str)) else text


def short_label(method: str) -> str:
    """A method as directory names, tables and figures show it: option values that are file paths
    by their file name (``droidspeak:layer_profile=runs/x.json`` -> ``droidspeak:layer_profile=x.json``)."""
    return re.sub(r"=[^,=]*/([^,/=]+)", r"=\1", method)

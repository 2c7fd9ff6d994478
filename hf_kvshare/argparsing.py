"""The command lines' argument parser: a usage error is one line on stderr and exit code 2.

A leaf module (imports nothing from the package), shared by ``hf-kvshare`` (``cli.py``), the bench
and ``train-roles``.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE (PROG --help)``,
    instead of the whole usage block followed by the message."""

    def error(self, message: str) -> NoReturn:
        one_line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {one_line} (see --help)\n")


def fail(prog: str, message: str) -> NoReturn:
    """The same one-line usage error outside a parser (checks that need several arguments)."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(2)


def _shown(text: str) -> str:
    """``text`` as an error message quotes it: at most 40 characters."""
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


def _integer(text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:  # not an integer, or more digits than Python converts
        raise argparse.ArgumentTypeError(f"expected {expected}, got {_shown(text)}") from None


def positive_int(text: str) -> int:
    """``type=`` for options that must be integers >= 1 (``--threads``)."""
    value = _integer(text, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """``type=`` for options that must be integers >= 0 (``--warmup``)."""
    value = _integer(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def int_in(low: int, high: int):
    """``type=`` for options that must be integers in ``[low, high]`` (``--seed``, ``--threads``)."""
    expected = f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        value = _integer(text, expected)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {_shown(str(value))}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def positive_int_at_most(high: int):
    """``type=`` for integers in ``[1, high]`` (``--threads``): :func:`positive_int`'s message below 1."""

    def parse(text: str) -> int:
        value = positive_int(text)
        if value > high:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= 1 and at most {high}, got {_shown(text)}"
            )
        return value

    parse.__name__ = "integer"
    return parse


def positive_float(text: str) -> float:
    """``type=`` for options that must be finite numbers > 0 (``--exec-timeout``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {_shown(text)}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text.strip()}")
    return value


#: the dtypes ``--dtype`` takes (weights and activations; quantized weights are not a dtype)
DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(text: str) -> str:
    """``type=`` for ``--dtype``: one of :data:`DTYPES` (``torch.`` prefix allowed), returned bare."""
    name = text.strip().removeprefix("torch.")
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)}, got {text!r}")
    return name


def device_name(text: str) -> str:
    """``type=`` for ``--device``: a torch device string whose device exists on this machine."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as cpu, cuda, cuda:1; got {text!r}"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available here (use --device cpu)")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no MPS device is available here (use --device cpu)")
    elif device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise argparse.ArgumentTypeError(f"expected a device such as cpu, cuda, cuda:1; got {text!r}")
    return text

"""The one check of a byte budget (a store's bound in bytes), for the engines, the methods and the
serving stores alike. Imports nothing of hf_kvshare."""

from __future__ import annotations

from typing import Any


def check_byte_budget(name: str, value: Any, optional: bool = False, none_is: str = "no bound") -> int | None:
    """A byte budget: an int >= 0 (``None`` too when ``optional``, which means ``none_is``); anything
    else (a bool, a float, a string, a negative number) raises ``ValueError`` naming ``name``. Returns
    ``value``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        allowed = f"an int >= 0 (bytes) or None ({none_is})" if optional else "an int >= 0 (bytes)"
        raise ValueError(f"{name} must be {allowed}; got {value!r} ({type(value).__name__})")
    return value

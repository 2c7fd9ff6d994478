"""Workload base class and registry: a workload turns its parameters (dataclass fields, filled by
the CLI) and the run's seed into a list of :class:`TaskSpec` requests."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from .spec import TaskSpec

WORKLOADS: dict[str, type[Workload]] = {}


def register_workload(cls: type[Workload]) -> type[Workload]:
    if cls.name in WORKLOADS and WORKLOADS[cls.name] is not cls:
        raise ValueError(
            f"workload name {cls.name!r} is already registered by {WORKLOADS[cls.name].__name__}"
        )
    WORKLOADS[cls.name] = cls
    return cls


@dataclasses.dataclass
class Workload:
    """Base class: subclasses are dataclasses whose fields are the workload's parameters."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: the gate threshold the KVCMAS authors ran this task with; the runner gives it to methods that
    #: take a workload tau (``Method.workload_tau``) unless the method's options set ``tau``
    tau: ClassVar[float | None] = None
    #: the requests hold image slots: the bench loads the model's processor and refuses a text-only model
    visual: ClassVar[bool] = False

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        raise NotImplementedError

    def check(self, adapters: Iterable[str] = ()) -> None:
        """Raise ``ValueError`` (or ``FileNotFoundError``) on what can be checked without a model or
        tokenizer (the command line calls it before loading the model); ``adapters``: the names of
        the adapters the run loads. Nothing by default."""

    #: parameters that set a turn's new tokens (checked against the model's positions)
    NEW_TOKEN_PARAMS: ClassVar[tuple[str, ...]] = ("max_new_tokens", "output_tokens")

    def check_positions(self, limit: int, model: str) -> None:
        """Raise ``ValueError`` when a turn's new tokens plus one prompt token cannot fit in the ``limit``
        positions of ``model`` (``max_position_embeddings``), before the model loads. By default the
        :attr:`NEW_TOKEN_PARAMS` parameters the workload has (given or default)."""
        from .spec import positions_problem

        for name in self.NEW_TOKEN_PARAMS:
            value = getattr(self, name, None)
            problem = positions_problem(value, limit, model) if isinstance(value, int) else None
            if problem:
                raise ValueError(f"--{name.replace('_', '-')} {value}: {problem}")

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def tag(self) -> str:
        """A short, file-system-safe name for this workload and its parameters."""
        parts = [self.name]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value != f.default:
                parts.append(f"{_short(f.name)}{_text(value)}")
        return "-".join(parts)

    @classmethod
    def param_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def make_workload(name: str, **params: Any) -> Workload:
    """A workload by registry name; ``params`` must be among its parameters (``None`` = default)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; available: {', '.join(sorted(WORKLOADS))}")
    cls = WORKLOADS[name]
    allowed = set(cls.param_names())
    given = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ValueError(
            f"workload {name!r} does not take {', '.join(unknown)}; its parameters: {', '.join(sorted(allowed))}"
        )
    return cls(**given)


def select(n: int, offset: int, limit: int | None) -> range:
    """Indices ``offset .. offset + limit - 1`` of ``n`` items (``limit`` None or 0: to the end)."""
    if offset < 0 or (limit is not None and limit < 0):
        raise ValueError(f"offset and limit must be >= 0; got offset={offset}, limit={limit}")
    if offset >= n:
        raise ValueError(f"offset {offset} is past the end of the data ({n} items)")
    return range(offset, n if not limit else min(n, offset + limit))


def _short(name: str) -> str:
    return "".join(w[0] for w in name.split("_")).upper()


def _text(value: Any) -> str:
    import os
    import re

    if isinstance(value, str) and os.sep in value:
        value = os.path.basename(value.rstrip(os.sep))
    return re.sub(r"[^A-Za-z0-9_.=+]", "_", str(value))[:40]


def workload_tau(name: str, overrides: Mapping[str, float] | None = None) -> float | None:
    """Workload ``name``'s tau default: ``overrides[name]`` if given, else the workload's ``tau``.

    Every name in ``overrides`` must be a registered workload and every value a real number in
    [0, 1]; otherwise ``ValueError`` (checked before anything runs).
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(WORKLOADS))
    if unknown:
        raise ValueError(
            f"per-workload tau for unknown workload(s) {', '.join(map(repr, unknown))}; "
            f"known workloads: {', '.join(sorted(WORKLOADS))}"
        )
    for key, value in overrides.items():
        real = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not real or not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise ValueError(f"per-workload tau for {key!r} must be a real number in [0, 1], got {value!r}")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; available: {', '.join(sorted(WORKLOADS))}")
    return overrides.get(name, WORKLOADS[name].tau)

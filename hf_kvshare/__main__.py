"""Command line: ``python -m hf_kvshare demo [--methods nonshared fullshared] [--max-new-tokens 48]``."""

from __future__ import annotations

import argparse
import sys

#: (summary key, title, format, width) of the demo's table
DEMO_COLUMNS = [
    ("method", "method", "", 14),
    ("ttft_s", "TTFT s", ".3f", 6),
    ("ttft_ratio", "NonShared/TTFT", ".2f", 14),
    ("reuse_ratio", "rho", ".2f", 4),
    ("agreement", "top1 agree", ".3f", 10),
    ("kl", "mean KL", ".4f", 7),
    ("kv_error", "PH KV rel.err", ".4f", 13),
    ("exact_match", "same output", ".2f", 11),
]


def demo(argv: list[str]) -> int:
    from .bench.report import format_table
    from .evaluation import compare_methods, demo_workflow
    from .methods import METHODS
    from .models import DEFAULT_MODEL, add_model_arguments, load_model, model_arguments

    parser = argparse.ArgumentParser(
        prog="python -m hf_kvshare demo", description="4-agent workflow, methods side by side"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["nonshared", "fullshared"],
        help=f"any of: {', '.join(sorted(METHODS))}",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name, hub id or local path")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    add_model_arguments(
        parser
    )  # --dtype, --load-in-4bit, --load-in-8bit, --bnb-4bit-quant-type, --device-map
    args = parser.parse_args(argv)
    try:
        loading = model_arguments(args)  # checked before the model loads
    except (ValueError, ImportError) as e:
        parser.error(str(e))
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; registered: {', '.join(sorted(METHODS))}")

    print(f"loading {args.model} ...", file=sys.stderr)
    model, tok = load_model(args.model, **loading)
    reports = compare_methods(
        model, tok, lambda: demo_workflow(tok, max_new_tokens=args.max_new_tokens), args.methods
    )
    reference = reports["nonshared"]
    rows = [r.summary(reference) for r in reports.values()]
    print()
    print(format_table(rows, DEMO_COLUMNS))
    print("\nper turn (teacher-forced on NonShared's outputs):")
    for name, report in reports.items():
        cells = "  ".join(
            f"{r['agent']}: agree {r['agreement']:.2f} kv-err {r['kv_error']:.3f}" for r in report.per_turn
        )
        print(f"  {name:<12} {cells}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hf_kvshare demo [options]   (python -m hf_kvshare demo --help)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return demo(rest)
    print(f"unknown command {command!r}; available: demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

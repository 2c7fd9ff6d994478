"""One prepared device check (``scripts/device_check.sh``): exactness on the device, then the
single-stream TTFT / E2E / memory sweep of the seeds' setup, through the bench's trace workload.

``python -m hf_kvshare.bench.device_check [--tiny] [--out DIR] [--device cuda]`` writes under ``DIR``
(default ``$OUT``, else ``./device-out``):

- ``device_check.json``: environment, exactness results, every configuration's method summaries;
- ``device_check.md``: the markdown table (one row per shared length x method);
- ``bench/``: the bench's own configuration directories (records per turn and request);
- ``adapters/``: the random LoRA adapters of the PReCache timings.

Full mode: ``random:llama-3.1-8b`` in bf16 at 4K, 8K, 16K and 32K shared tokens for nonshared,
fullshared (also with prefix reuse: KVCMAS's like-for-like pair), kvcmas, kvcomm, cacheblend (3 agents, 2 warm-up requests that fill the anchor pools,
1 measured request (``--measured N``), 8 output tokens per turn; ``--lengths`` replaces the
lengths), plus prelrshared / rebaseshared-lp with random q/v rank-8 LoRA adapters (one per agent)
at 8K on the trace's trajectory layout (one append-only trajectory, agents differing by adapter). ``--tiny``: ``random:tiny-llama`` (2 layers, hidden
64; a test size, not a published model) at 256 tokens, on CPU in seconds, so CI-like checks keep
the script working.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

FULL = {
    "model": "random:llama-3.1-8b",
    "dtype": "bfloat16",
    "lengths": [4096, 8192, 16384, 32768],
    # tau = 1: every gate with two or more anchors accepts (random weights give no meaningful
    # entropy), so the timed path is the correction, as at the seeds' rho = 0.8 point
    # fullshared:prefix_reuse=True: KVCMAS's like-for-like pair (both reuse each agent's own prompt)
    "methods": [
        "nonshared",
        "fullshared",
        "fullshared:prefix_reuse=True",
        "kvcmas:tau=1.0",
        "kvcomm:tau=1.0",
        "cacheblend",
    ],
    "lora_length": 8192,
    "lora_methods": ["nonshared", "prelrshared", "rebaseshared-lp"],
    "output_tokens": 8,
    "measured": 1,  # measured requests after the warm-up (--measured)
}
TINY = {**FULL, "model": "random:tiny-llama", "dtype": "float32", "lengths": [256], "lora_length": 256}
AGENTS = 3
#: warm-up requests before the measured one: the anchor methods' gates need two anchors per slot
WARMUP = 2
LORA_RANK = 8


def exactness(device: str) -> dict[str, Any]:
    """(a) on ``device`` in fp32 with a tiny random Llama 3.1: NonShared == plain greedy ``generate``
    token for token, and re-positioning: layer-0 keys of a segment computed at position 0 and moved
    to position ``d`` equal the keys computed at ``d`` (layer 0's keys depend on token and position
    only), and every layer's keys moved ``0 -> d -> 0`` come back."""
    from .._compat import output_cache
    from ..cache import SegmentKV
    from ..models import load_model
    from ..session import Session
    from ..trajectory import PF

    model, tok = load_model("random:tiny-llama", device_map=device, dtype="float32", seed=1)
    text = "The council reviewed the bridge before winter. Continue:"
    session = Session(model, tok, "nonshared")
    result = session.run_turn("a", [PF(text)], max_new_tokens=12, min_new_tokens=12)
    prompt = result.prompt_ids.reshape(1, -1).to(device)
    with torch.no_grad():
        plain = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
        )
    generated = plain[0, prompt.shape[1] :].cpu()
    same = torch.equal(generated, result.output_ids.cpu())

    seg = tok(" shared notes about the old mill", add_special_tokens=False, return_tensors="pt")["input_ids"]
    seg = seg.to(device)
    filler = torch.full((1, 37), 32, device=device)  # 37 spaces before the segment
    with torch.no_grad():
        alone = output_cache(model(seg, use_cache=True))
        after = output_cache(model(torch.cat([filler, seg], dim=1), use_cache=True))
    keys = [alone.layers[i].keys for i in range(len(alone.layers))]
    values = [alone.layers[i].values for i in range(len(alone.layers))]
    kv = SegmentKV(keys=keys, values=values, start=0)
    moved = kv.repositioned(session.shifter, 37)
    layer0_error = (moved.keys[0] - after.layers[0].keys[:, :, 37:]).abs().max().item()
    back = moved.repositioned(session.shifter, 0)
    roundtrip_error = max((b - k).abs().max().item() for b, k in zip(back.keys, keys))
    return {
        "device": device,
        "nonshared_equals_generate": same,
        "nonshared_tokens": result.output_ids.tolist(),
        "generate_tokens": generated.tolist(),
        "reposition_layer0_max_abs_error": layer0_error,
        "reposition_roundtrip_max_abs_error": roundtrip_error,
        "passed": same and layer0_error < 1e-4 and roundtrip_error < 1e-4,
    }


def make_lora_adapters(
    model_name: str, dtype: str, device: str, roles: list[str], out: Path
) -> dict[str, str]:
    """Random PEFT LoRA adapters (q_proj / v_proj, rank 8, both factors random so B != 0), one per
    role, saved under ``out/<role>``; returns ``{role: directory}``."""
    from peft import LoraConfig, get_peft_model

    from .._compat import peft_wrapping_warnings_silenced
    from ..models import load_model

    base, _ = load_model(model_name, device_map=device, dtype=dtype, seed=0)
    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,  # random A and B: the adapters change K/V
    )
    torch.manual_seed(0)
    with peft_wrapping_warnings_silenced():
        model = get_peft_model(base, config, adapter_name=roles[0])
    for role in roles[1:]:
        model.add_adapter(role, config)
    paths = {}
    for role in roles:
        model.save_pretrained(str(out), selected_adapters=[role])
        # PEFT saves a non-default adapter under out/<role>; the first one at the root
        paths[role] = str(out / role) if (out / role / "adapter_config.json").exists() else str(out)
    del model, base
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return paths


def sweep(
    plan: dict[str, Any],
    device: str,
    out: Path,
    lengths: list[int],
    methods: list[str],
    adapters: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """(b) the bench's ``run`` on the trace workload: one model build, every shared length; with
    ``adapters`` (``{role: path}``) the agents run with their role's adapter."""
    from .command import RunOptions, run_command

    options = RunOptions(
        workload="trace",
        model=plan["model"],
        dtype=plan["dtype"],
        device=device,
        shared_tokens=list(lengths),
        agents=AGENTS,
        output_tokens=plan["output_tokens"],
        requests=WARMUP + plan["measured"],
        warmup=WARMUP,
        methods=list(methods),
        no_fidelity=True,
        no_plots=True,
        no_progress=True,
        out=str(out / "bench"),
        agent_adapters=True if adapters else None,
        adapters=dict(adapters or {}),
    )
    code, runners = run_command(options)
    if code != 0:
        raise RuntimeError(f"bench run failed ({code}): {options}")
    return [row for runner in runners for row in _rows(runner.dir, runner.load_summaries().values())]


def _rows(directory: Path, summaries: Any) -> list[dict[str, Any]]:
    """The table rows of one configuration directory: its method ``summaries`` with the shared length
    and whether the agents ran with adapters (from the directory's ``config.json``)."""
    params = json.loads((directory / "config.json").read_text())["config"].get("workload_params") or {}
    return [
        {
            "shared_tokens": params.get("shared_tokens"),
            "lora": bool(params.get("agent_adapters")),
            **{k: v for k, v in summary.items() if k != "config"},
            "dir": str(directory),
        }
        for summary in summaries
    ]


def collect_rows(out: Path) -> list[dict[str, Any]]:
    """The rows of every configuration that finished under ``out/bench`` (read from its method
    summaries): what a check stopped before its end still reports."""
    rows = []
    for config in sorted((out / "bench").glob("*/config.json")):
        summaries = [json.loads(p.read_text()) for p in sorted(config.parent.glob("*/summary.json"))]
        rows += _rows(config.parent, summaries)
    rows.sort(key=lambda r: (r["lora"], r["shared_tokens"] or 0, r.get("method") != "nonshared"))
    return rows


TABLE = [
    ("shared_tokens", "shared tokens", "d"),
    ("method", "method", ""),
    ("ttft_mean_s", "TTFT s (reuse turns)", ".3f"),
    ("ttft_ratio", "NonShared/TTFT", ".2f"),
    # every turn's, the first agents' dense prefills included (with prefix reuse they follow kept text)
    ("ttft_all_mean_s", "TTFT s (all turns)", ".3f"),
    ("e2e_mean_s", "E2E s", ".3f"),
    ("e2e_ratio", "NonShared/E2E", ".2f"),
    ("peak_memory_mb", "peak MB", ".0f"),
    ("reuse_ratio", "rho", ".2f"),
    # after the first token, mean seconds per turn (measure.PHASES): where E2E goes beyond the TTFT
    ("decode_mean_s", "decode s", ".3f"),
    ("record_mean_s", "record s", ".3f"),
    ("gate_mean_s", "gate s", ".3f"),
    ("factorize_mean_s", "factorize s", ".3f"),
    ("anchor_store_mean_s", "anchor store s", ".3f"),
]


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"# Device check ({'tiny, CPU mode' if results['tiny'] else 'full'})",
        "",
        f"- machine: {env.get('machine')}; torch {env.get('torch')}, transformers {env.get('transformers')}",
        f"- model: {results['plan']['model']} ({results['plan']['dtype']}, random weights: timings and "
        "memory only, no fidelity)",
        f"- command: `{results['command']}`; wall time {results['wall_s']:.0f} s",
        f"- exactness on {results['exactness']['device']}: NonShared == generate: "
        f"{results['exactness']['nonshared_equals_generate']}; re-positioning max abs error layer 0 "
        f"{results['exactness']['reposition_layer0_max_abs_error']:.2e}, round trip "
        f"{results['exactness']['reposition_roundtrip_max_abs_error']:.2e}",
        *([f"- **incomplete**: {results['interrupted']}"] if results.get("interrupted") else []),
        "",
        "| " + " | ".join(title for _, title, _ in TABLE) + " | LoRA |",
        "|" + "---|" * (len(TABLE) + 1),
    ]
    for row in results["rows"]:
        cells = []
        for key, _, fmt in TABLE:
            value = row.get(key)
            cells.append("-" if value is None else format(value, fmt))
        lines.append("| " + " | ".join(cells) + f" | {'q/v r8' if row['lora'] else '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hf_kvshare.bench.device_check", description=__doc__.split("\n")[0]
    )
    p.add_argument("--tiny", action="store_true", help="CPU mode: random:tiny-llama at 256 tokens (seconds)")
    p.add_argument("--out", default=None, help="output directory (default $OUT, else ./device-out)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="shared lengths of the sweep")
    p.add_argument("--measured", type=int, default=None, help="measured requests after the 2 warm-up ones")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.lengths or []) or (args.measured is not None and args.measured < 1):
        p.error(f"--lengths and --measured take positive integers, got {args.lengths} and {args.measured}")
    out = Path(args.out or os.environ.get("OUT") or "device-out")
    out.mkdir(parents=True, exist_ok=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and device == "cpu":
        print(
            "error: the full check needs a GPU (an 8B model at 32K tokens); use --tiny on CPU",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(min(torch.get_num_threads(), 4) if device == "cpu" else torch.get_num_threads())
    plan = dict(TINY if args.tiny else FULL)
    if args.lengths:
        plan["lengths"] = sorted(args.lengths)
    if args.measured:
        plan["measured"] = args.measured
    from .runner import environment

    started = time.perf_counter()
    results: dict[str, Any] = {
        "tiny": args.tiny,
        "plan": plan,
        "command": "bash scripts/device_check.sh"
        + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "environment": environment(),
    }

    def write(rows: list[dict[str, Any]], interrupted: str | None = None) -> None:
        """Both files, rewritten after every stage (a check cut short keeps what finished)."""
        results["rows"], results["wall_s"] = rows, time.perf_counter() - started
        if interrupted:
            results["interrupted"] = interrupted
        (out / "device_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (out / "device_check.md").write_text(markdown(results))

    results["exactness"] = exactness(device)
    print(f"exactness: {results['exactness']}", file=sys.stderr)
    write([])
    try:
        rows = sweep(plan, device, out, plan["lengths"], plan["methods"])
        write(rows)
        from .workloads.trace import ROLES

        roles = [name for name, _ in ROLES[:AGENTS]]
        adapters = make_lora_adapters(plan["model"], plan["dtype"], device, roles, out / "adapters")
        rows += sweep(plan, device, out, [plan["lora_length"]], plan["lora_methods"], adapters)
    except KeyboardInterrupt:  # `timeout -s INT`: keep the configurations that finished
        write(
            collect_rows(out),
            "stopped (SIGINT) before the end; the rows are the configurations that finished",
        )
        print(markdown(results))
        return 1
    write(rows)
    print(markdown(results))
    if not results["exactness"]["passed"]:
        print("error: exactness failed (see device_check.json)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Figures of a benchmark run: PNG (matplotlib) plus a CSV of the data behind each one.

- ``fidelity_vs_ttft``: teacher-forced top-1 agreement vs mean reuse-turn TTFT per method, with
  the Pareto front (lower TTFT, higher agreement); ``accuracy_vs_ttft`` likewise where a checker
  scored the answers;
- ``kv_error_by_layer`` and ``kv_error_by_agent`` (relative KV error of reusable shared segments
  against NonShared's exact cache);
- ``effective_rank_by_layer``: 90%-energy effective rank of the exact shared K/V (base) and of the
  residual each method leaves (for FullShared, the cross-agent correction);
- ``ttft_vs_shared_length`` (and throughput) across the configurations of a controlled-trace sweep.

Without matplotlib (the ``plots`` extra) the CSVs are still written.
"""

from __future__ import annotations

import csv
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..evaluation.metrics import pareto_front
from .methods import short_label


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(
            "matplotlib is not installed (pip install hf_kvshare[plots]): writing CSV data only", stacklevel=3
        )
        return None
    return plt


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _save(fig, legend_ax, path: Path) -> Path:
    """Save with one legend right of ``legend_ax``, outside the panels (many methods would cover
    the curves); returns ``path``."""
    fig.tight_layout()
    legend_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)


def configuration_plots(config_dir: str | Path) -> list[Path]:
    """Write every per-configuration figure of ``config_dir`` (reads its ``summary.json``)."""
    config_dir = Path(config_dir)
    summary_path = config_dir / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{summary_path} does not exist: run the benchmark first")
    methods = json.loads(summary_path.read_text())["methods"]
    out = config_dir / "plots"
    out.mkdir(exist_ok=True)
    plt = _pyplot()
    written = []
    written += _tradeoff(methods, out, plt, "agreement", "fidelity_vs_ttft", "teacher-forced top-1 agreement")
    if any(m.get("accuracy") is not None for m in methods):
        written += _tradeoff(methods, out, plt, "accuracy", "accuracy_vs_ttft", "task accuracy")
    written += _kv_error_by_layer(methods, out, plt)
    written += _kv_error_by_agent(methods, out, plt)
    written += _erank_by_layer(methods, out, plt)
    if plt is not None:
        plt.close("all")
    return written


def _tradeoff(methods, out: Path, plt, key: str, name: str, label: str) -> list[Path]:
    rows = [
        {
            "method": m["method"],
            "ttft_mean_s": m.get("ttft_mean_s"),
            "ttft_ratio": m.get("ttft_ratio"),
            key: m.get(key),
        }
        for m in methods
        if m.get(key) is not None
    ]
    if not rows:
        return []
    points = [(_num(r["ttft_mean_s"]), _num(r[key])) for r in rows]
    front = set(pareto_front(points))
    for i, r in enumerate(rows):
        r["pareto"] = i in front
    written = [_write_csv(out / f"{name}.csv", rows)]
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for (x, y), r in zip(points, rows):
            ax.scatter([x], [y], s=45, zorder=3, color="C3" if r["pareto"] else "C0")
            ax.annotate(
                short_label(r["method"]), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8
            )
        ordered = sorted((points[i] for i in front), key=lambda p: p[0])
        if len(ordered) > 1:
            ax.plot(*zip(*ordered), "--", color="C3", label="Pareto front", zorder=2)
            ax.legend(fontsize=8)
        ax.set_xlabel("mean TTFT of reuse turns (s)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs TTFT")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)
        written.append(out / f"{name}.png")
    return written


def _kv_error_by_layer(methods, out: Path, plt) -> list[Path]:
    rows = [
        {"method": m["method"], "layer": r["layer"], "key": r["key"], "value": r["value"]}
        for m in methods
        for r in m.get("kv_error_by_layer") or []
    ]
    if not rows:
        return []
    written = [_write_csv(out / "kv_error_by_layer.csv", rows)]
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        for part, ax in zip(("key", "value"), axes):
            for m in methods:
                layers = m.get("kv_error_by_layer") or []
                if layers:
                    ax.plot(
                        [r["layer"] for r in layers],
                        [r[part] for r in layers],
                        marker=".",
                        label=short_label(m["method"]),
                    )
            ax.set_title(f"relative {part} error of shared segments")
            ax.set_xlabel("layer")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("||C_hat - C|| / ||C||")
        written.append(_save(fig, axes[1], out / "kv_error_by_layer.png"))
    return written


def _kv_error_by_agent(methods, out: Path, plt) -> list[Path]:
    rows = [
        {
            "method": m["method"],
            "position": r["position"],
            "agent": r["agent"],
            "kv_error": r.get("kv_error"),
            "agreement": r.get("agreement"),
            "kl": r.get("kl"),
            "exact_match": r.get("exact_match"),
        }
        for m in methods
        for r in m.get("by_position") or []
        if "agreement" in r
    ]
    if not rows:
        return []
    written = [_write_csv(out / "kv_error_by_agent.csv", rows)]
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for m in methods:
            pos = [r for r in m.get("by_position") or [] if "agreement" in r]
            if not pos:
                continue
            xs = [r["position"] for r in pos]
            axes[0].plot(
                xs, [_num(r.get("kv_error")) for r in pos], marker="o", label=short_label(m["method"])
            )
            axes[1].plot(
                xs, [_num(r.get("agreement")) for r in pos], marker="o", label=short_label(m["method"])
            )
        ticks = [f"{r['position']}:{r['agent']}" for r in (methods[0].get("by_position") or [])]
        for ax, title in zip(
            axes, ("relative KV error of shared segments", "top-1 agreement with NonShared")
        ):
            ax.set_title(title)
            ax.set_xlabel("agent position (hop)")
            ax.set_xticks(range(len(ticks)), ticks, rotation=30, fontsize=7)
            ax.grid(alpha=0.3)
        written.append(_save(fig, axes[1], out / "kv_error_by_agent.png"))
    return written


def _erank_by_layer(methods, out: Path, plt) -> list[Path]:
    rows = [{"method": m["method"], **r} for m in methods for r in m.get("erank_by_layer") or []]
    if not rows:
        return []
    written = [_write_csv(out / "effective_rank_by_layer.csv", rows)]
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        base = next((m for m in methods if m.get("erank_by_layer")), None)
        for part, ax in zip(("key", "value"), axes):
            layers = base["erank_by_layer"]
            ax.plot(
                [r["layer"] for r in layers],
                [r[f"base_{part}"] for r in layers],
                "k-",
                label="exact cache (base)",
            )
            for m in methods:
                layers = m.get("erank_by_layer") or []
                if layers and any(r[f"delta_{part}"] for r in layers):
                    ax.plot(
                        [r["layer"] for r in layers],
                        [r[f"delta_{part}"] for r in layers],
                        marker=".",
                        label=f"residual: {short_label(m['method'])}",
                    )
            ax.set_title(f"effective rank (90% energy), {part}s")
            ax.set_xlabel("layer")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("rank")
        written.append(_save(fig, axes[1], out / "effective_rank_by_layer.png"))
    return written


def sweep_plots(
    config_dirs: Sequence[str | Path], out_dir: str | Path, param: str = "shared_tokens"
) -> list[Path]:
    """TTFT (mean, p50, p90) and throughput vs ``param`` per method across configurations."""
    rows = []
    for d in config_dirs:
        data = json.loads((Path(d) / "summary.json").read_text())
        value = (data["config"].get("workload_params") or {}).get(param)
        if value is None:
            continue
        for m in data["methods"]:
            rows.append(
                {
                    param: value,
                    "method": m["method"],
                    "ttft_mean_s": m.get("ttft_mean_s"),
                    "ttft_p50_s": m.get("ttft_p50_s"),
                    "ttft_p90_s": m.get("ttft_p90_s"),
                    "ttft_ratio": m.get("ttft_ratio"),
                    "throughput_tok_s": m.get("throughput_tok_s"),
                    "throughput_ratio": m.get("throughput_ratio"),
                    "peak_memory_mb": m.get("peak_memory_mb"),
                    "config": Path(d).name,
                }
            )
    if len({r[param] for r in rows}) < 2:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows.sort(key=lambda r: (r["method"] != "nonshared", r["method"], r[param]))
    written = [_write_csv(out / f"ttft_vs_{param}.csv", rows)]
    plt = _pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method]
            xs = [r[param] for r in mine]
            axes[0].plot(xs, [_num(r["ttft_mean_s"]) for r in mine], marker="o", label=short_label(method))
            axes[1].plot(
                xs, [_num(r["throughput_tok_s"]) for r in mine], marker="o", label=short_label(method)
            )
        axes[0].set_ylabel("mean reuse-turn TTFT (s)")
        axes[1].set_ylabel("trajectory tokens / E2E (tok/s)")
        for ax in axes:
            ax.set_xlabel(param.replace("_", " "))
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        written.append(_save(fig, axes[1], out / f"ttft_vs_{param}.png"))
        plt.close(fig)
    return written

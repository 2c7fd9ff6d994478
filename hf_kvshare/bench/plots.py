"""Figures of a benchmark run: PNG (matplotlib) plus a CSV of the data behind each one (written
without matplotlib too). The effective-rank figure shows the exact shared K/V (base) and the
residual each method leaves (for FullShared, the cross-agent correction).
"""

from __future__ import annotations

import os
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..evaluation.metrics import pareto_front
from .methods import short_label
from .report import read_configuration_summary, write_csv


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


def _save(fig, legend_ax, path: Path, title: str = "") -> Path:
    """Save with one legend right of ``legend_ax``, outside the panels (many methods would cover
    the curves) and ``title`` (the workload and model) above them; returns ``path``."""
    if title:
        fig.suptitle(wrap_title(title), fontsize=10)
    fig.tight_layout()
    legend_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """``fig`` saved as ``path`` (its suffix names the format) through a temporary file in the same
    directory, renamed over ``path`` once complete: a save that fails midway (disk full, a backend
    error) leaves the previous figure, or none, never a truncated one, and no temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


PARTS = ("key", "value")

#: points closer than these fractions of the axis ranges (x, y) share a label position: a label is
#: about a quarter of a panel wide and a twentieth of it high
COINCIDE = (0.08, 0.05)
#: vertical step (points) between stacked labels of coinciding points
LABEL_STEP = 9


def label_offsets(
    points: Sequence[tuple[float, float]],
    base: tuple[int, int] = (5, 4),
    widths: Sequence[float] | None = None,
) -> list[tuple[int, int]]:
    """Label offsets (in points) for scatter ``points``: each label goes :data:`LABEL_STEP` points
    higher until it clears every earlier label whose box it would overlap: boxes ``widths[i]`` wide
    (fractions of the x range; default ``COINCIDE[0]``) and ``COINCIDE[1]`` high, measured where
    those labels ended up, so labels of close points never overprint."""
    finite = [(x, y) for x, y in points if x == x and y == y]
    low = [min((p[i] for p in finite), default=0.0) for i in (0, 1)]
    span = [max((p[i] for p in finite), default=0.0) - low[i] for i in (0, 1)]
    widths = [COINCIDE[0]] * len(points) if widths is None else list(widths)
    placed: list[tuple[float, float, float]] = []  # (x, width, label y) in fractions of the axis ranges
    offsets = []
    for (x, y), width in zip(points, widths):
        if x != x or y != y:
            offsets.append(base)
            continue
        fx, fy = ((v - lo) / s if s > 0 else 0.0 for v, lo, s in zip((x, y), low, span))
        k = 0
        while any(
            fx <= px + pw and px <= fx + width and abs(fy + k * COINCIDE[1] - py) < COINCIDE[1] - 1e-12
            for px, pw, py in placed
        ):
            k += 1
        placed.append((fx, width, fy + k * COINCIDE[1]))
        offsets.append((base[0], base[1] + LABEL_STEP * k))
    return offsets


#: width of one label character as a fraction of a scatter panel's x range (8 pt font, 6 in figure)
CHAR_WIDTH = 0.011


def run_title(config: dict[str, Any]) -> str:
    """``workload (parameters) on model`` of a configuration's ``config`` (its ``summary.json``)."""
    params = ", ".join(
        f"{k}={v}" for k, v in (config.get("workload_params") or {}).items() if v not in (None, "", 0, False)
    )
    workload = f"{config.get('workload', '?')}" + (f" ({params})" if params else "")
    model = str(config.get("model", "?")).rstrip("/\\").rsplit("/", 1)[-1]
    return f"{workload} on {model}" + (f", {config['dtype']}" if config.get("dtype") else "")


def wrap_title(title: str, width: int = 70) -> str:
    """``title`` broken into lines of at most ``width`` characters (a long workload description
    would run past the figure's edge)."""
    return "\n".join(textwrap.wrap(title, width)) or title


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)


def configuration_plots(config_dir: str | Path) -> list[Path]:
    """Write every per-configuration figure of ``config_dir`` (reads its ``summary.json``)."""
    config_dir = Path(config_dir)
    summary_path = config_dir / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{summary_path} does not exist: run the benchmark first")
    summary = read_configuration_summary(config_dir)
    methods, title = summary["methods"], run_title(summary.get("config") or {})
    out = config_dir / "plots"
    out.mkdir(exist_ok=True)
    plt = _pyplot()
    written = _tradeoff(
        methods, out, plt, "agreement", "fidelity_vs_ttft", "teacher-forced top-1 agreement", title
    )
    if any(m.get("accuracy") is not None for m in methods):
        written += _tradeoff(methods, out, plt, "accuracy", "accuracy_vs_ttft", "task accuracy", title)
    written += _kv_error_by_layer(methods, out, plt, title)
    written += _kv_error_by_agent(methods, out, plt, title)
    written += _erank_by_layer(methods, out, plt, title)
    if plt is not None:
        plt.close("all")
    return written


def _tradeoff(methods, out: Path, plt, key: str, name: str, label: str, title: str = "") -> list[Path]:
    rows = [
        {k: m.get(k) for k in ("method", "ttft_mean_s", "ttft_ratio", key)}
        for m in methods
        if m.get(key) is not None
    ]
    if not rows:
        return []
    points = [(_num(r["ttft_mean_s"]), _num(r[key])) for r in rows]
    front = set(pareto_front(points))
    for i, r in enumerate(rows):
        r["pareto"] = i in front
    written = [write_csv(out / f"{name}.csv", rows)]
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        widths = [CHAR_WIDTH * len(short_label(r["method"])) for r in rows]
        for (x, y), r, offset in zip(points, rows, label_offsets(points, widths=widths)):
            ax.scatter([x], [y], s=45, zorder=3, color="C3" if r["pareto"] else "C0")
            ax.annotate(
                short_label(r["method"]), (x, y), textcoords="offset points", xytext=offset, fontsize=8
            )
        ax.margins(x=0.15, y=0.12)  # room for the labels (stacked ones too) inside the axes
        ordered = sorted((points[i] for i in front), key=lambda p: p[0])
        if len(ordered) > 1:
            ax.plot(*zip(*ordered), "--", color="C3", label="Pareto front", zorder=2)
            ax.legend(fontsize=8)
        _axes(
            [ax],
            [f"{label} vs TTFT" + (f"\n{wrap_title(title, 60)}" if title else "")],
            "mean TTFT of reuse turns (s)",
            label,
        )
        fig.tight_layout()
        written.append(save_figure(fig, out / f"{name}.png"))
    return written


def _line(ax, rows: list[dict[str, Any]], x: str, y: str, *fmt: str, **style: Any) -> None:
    """One curve of ``rows``' ``y`` against ``x``; nothing for no rows."""
    if rows:
        ax.plot([r[x] for r in rows], [_num(r.get(y)) for r in rows], *fmt, **style)


def _axes(axes, titles: Sequence[str], xlabel: str, ylabel: str = "") -> None:
    """Titles, the x label, a grid on each panel; ``ylabel`` on the first."""
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    if ylabel:
        axes[0].set_ylabel(ylabel)


def _kv_error_by_layer(methods, out: Path, plt, title: str = "") -> list[Path]:
    layers = {m["method"]: m.get("kv_error_by_layer") or [] for m in methods}
    rows = [
        {"method": m, **{k: r[k] for k in ("layer", "key", "value")}} for m, rs in layers.items() for r in rs
    ]
    if not rows:
        return []
    written = [write_csv(out / "kv_error_by_layer.csv", rows)]
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        for part, ax in zip(PARTS, axes):
            for method, rs in layers.items():
                _line(ax, rs, "layer", part, marker=".", label=short_label(method))
        _axes(
            axes, [f"relative {p} error of shared segments" for p in PARTS], "layer", "||C_hat - C|| / ||C||"
        )
        written.append(_save(fig, axes[1], out / "kv_error_by_layer.png", title))
    return written


def _kv_error_by_agent(methods, out: Path, plt, title: str = "") -> list[Path]:
    hops = {m["method"]: [r for r in m.get("by_position") or [] if "agreement" in r] for m in methods}
    keys = ("position", "agent", "kv_error", "agreement", "kl", "exact_match")
    rows = [{"method": m, **{k: r.get(k) for k in keys}} for m, rs in hops.items() for r in rs]
    if not rows:
        return []
    written = [write_csv(out / "kv_error_by_agent.csv", rows)]
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for method, rs in hops.items():
            for ax, y in zip(axes, ("kv_error", "agreement")):
                _line(ax, rs, "position", y, marker="o", label=short_label(method))
        ticks = [f"{r['position']}:{r['agent']}" for r in (methods[0].get("by_position") or [])]
        titles = ("relative KV error of shared segments", "top-1 agreement with NonShared")
        for ax in axes:
            ax.set_xticks(range(len(ticks)), ticks, rotation=30, fontsize=7)
        _axes(axes, titles, "agent position (hop)")
        written.append(_save(fig, axes[1], out / "kv_error_by_agent.png", title))
    return written


def _erank_by_layer(methods, out: Path, plt, title: str = "") -> list[Path]:
    rows = [{"method": m["method"], **r} for m in methods for r in m.get("erank_by_layer") or []]
    if not rows:
        return []
    written = [write_csv(out / "effective_rank_by_layer.csv", rows)]
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        base = next(m for m in methods if m.get("erank_by_layer"))["erank_by_layer"]
        for part, ax in zip(PARTS, axes):
            _line(ax, base, "layer", f"base_{part}", "k-", label="exact cache (base)")
            for m in methods:
                layers = m.get("erank_by_layer") or []
                if any(r[f"delta_{part}"] for r in layers):
                    label = f"residual: {short_label(m['method'])}"
                    _line(ax, layers, "layer", f"delta_{part}", marker=".", label=label)
        _axes(axes, [f"effective rank (90% energy), {p}s" for p in PARTS], "layer", "rank")
        written.append(_save(fig, axes[1], out / "effective_rank_by_layer.png", title))
    return written


SWEEP_KEYS = (
    "method",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_ratio",
    "throughput_tok_s",
    "throughput_ratio",
    "peak_memory_mb",
)


def sweep_plots(
    config_dirs: Sequence[str | Path], out_dir: str | Path, param: str = "shared_tokens"
) -> list[Path]:
    """TTFT (mean, p50, p90) and throughput vs ``param`` per method across configurations."""
    rows, configs = [], []
    for d in config_dirs:
        data = read_configuration_summary(d)
        configs.append(data["config"])
        value = (data["config"].get("workload_params") or {}).get(param)
        if value is not None:
            rows += [
                {param: value, **{k: m.get(k) for k in SWEEP_KEYS}, "config": Path(d).name}
                for m in data["methods"]
            ]
    if len({r[param] for r in rows}) < 2:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows.sort(key=lambda r: (r["method"] != "nonshared", r["method"], r[param]))
    written = [write_csv(out / f"ttft_vs_{param}.csv", rows)]
    plt = _pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method]
            for ax, y in zip(axes, ("ttft_mean_s", "throughput_tok_s")):
                _line(ax, mine, param, y, marker="o", label=short_label(method))
        titles = ("TTFT of reuse turns", "throughput")
        _axes(axes, titles, param.replace("_", " "), "mean reuse-turn TTFT (s)")
        axes[1].set_ylabel("trajectory tokens / E2E (tok/s)")
        values = sorted({r[param] for r in rows})
        for ax in axes:  # log-spaced lengths, ticked at the measured values as plain numbers
            ax.set_xscale("log", base=2)
            ax.set_xticks(values, [f"{v:g}" for v in values])
            ax.minorticks_off()
        common = {**configs[0], "workload_params": {**(configs[0].get("workload_params") or {}), param: None}}
        title = f"{run_title(common)}: {param.replace('_', ' ')} {', '.join(f'{v:g}' for v in values)}"
        written.append(_save(fig, axes[1], out / f"ttft_vs_{param}.png", title))
        plt.close(fig)
    return written

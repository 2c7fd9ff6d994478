"""The bench's figures from synthetic summaries (no model): files written, labels of coinciding
points apart, titles naming the workload and the model, length ticks as plain numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_kvshare.bench import plots

pytest.importorskip("matplotlib")


def method(name: str, ttft: float, agreement: float) -> dict:
    layers = [{"layer": i, "key": 0.1 * i, "value": 0.2 * i} for i in range(3)]
    hops = [{"position": i, "agent": f"a{i}", "kv_error": 0.1, "agreement": agreement} for i in range(2)]
    erank = [{"layer": i, "base_key": 4, "base_value": 5, "delta_key": 1, "delta_value": 2} for i in range(3)]
    return {
        "method": name,
        "ttft_mean_s": ttft,
        "ttft_ratio": 1.0,
        "agreement": agreement,
        "kv_error_by_layer": layers,
        "by_position": hops,
        "erank_by_layer": erank,
        "throughput_tok_s": 100.0 / ttft,
    }


def write_config(directory: Path, shared_tokens: int, methods: list[dict]) -> Path:
    directory.mkdir(parents=True)
    config = {
        "workload": "trace",
        "workload_params": {"shared_tokens": shared_tokens, "agents": 3},
        "model": "/models/SmolLM2-135M-Instruct/",
    }
    (directory / "summary.json").write_text(json.dumps({"config": config, "methods": methods}))
    return directory


@pytest.fixture
def saved_figures(monkeypatch):
    """Every figure the plot functions save, in order."""
    from matplotlib.figure import Figure

    figures = []
    original = Figure.savefig

    def record(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return figures


def test_configuration_plots_keep_coinciding_labels_apart(tmp_path, saved_figures):
    # nonshared and kvcmas at exactly the same point (kvcmas reused nothing), fullshared elsewhere
    methods = [method("nonshared", 1.0, 1.0), method("kvcmas", 1.0, 1.0), method("fullshared", 0.5, 0.8)]
    config = write_config(tmp_path / "config", 256, methods)
    written = plots.configuration_plots(config)
    names = {p.name for p in written}
    for name in ("fidelity_vs_ttft", "kv_error_by_layer", "kv_error_by_agent", "effective_rank_by_layer"):
        assert {f"{name}.png", f"{name}.csv"} <= names and (config / "plots" / f"{name}.png").stat().st_size
    tradeoff = saved_figures[0]
    labels = {t.get_text(): t.xyann for t in tradeoff.axes[0].texts}
    assert set(labels) == {"nonshared", "kvcmas", "fullshared"}
    assert labels["nonshared"] != labels["kvcmas"]  # the same point, labels stacked
    assert "trace" in tradeoff.axes[0].get_title() and "SmolLM2-135M-Instruct" in tradeoff.axes[0].get_title()
    for fig in saved_figures[1:]:
        assert "trace (shared_tokens=256, agents=3) on SmolLM2-135M-Instruct" == fig._suptitle.get_text()


def test_label_offsets():
    assert plots.label_offsets([(1.0, 1.0), (2.0, 0.0)]) == [(5, 4), (5, 4)]
    stacked = plots.label_offsets([(1.0, 1.0), (1.0, 1.0), (1.001, 1.0), (2.0, 0.0)])
    assert len({o for o in stacked[:3]}) == 3 and stacked[3] == (5, 4)
    # close in both axes (labels would overprint) though not equal: stacked as well
    near = plots.label_offsets([(1.0, 1.0), (1.05, 0.97), (0.0, 0.0), (2.0, 0.0)])
    assert near[0] != near[1]
    # apart in x, but the first label is wide enough to reach the second point's label
    wide = [(0.0, 0.5), (0.3, 0.5), (1.0, 0.0)]
    assert plots.label_offsets(wide)[1] == (5, 4)
    assert plots.label_offsets(wide, widths=[0.5, 0.1, 0.1])[1] != (5, 4)


def test_long_titles_are_wrapped():
    title = "autoact (hops=1, limit=4, max_new_tokens=64, rounds=1) on smollm2-135m, float32, seed 0"
    wrapped = plots.wrap_title(title)
    assert wrapped.replace("\n", " ") == title and all(len(line) <= 70 for line in wrapped.split("\n"))
    assert "\n" in wrapped and plots.wrap_title("short") == "short"


def test_sweep_plot_ticks_are_plain_numbers_and_titled(tmp_path, saved_figures):
    dirs = [
        write_config(
            tmp_path / str(n), n, [method("nonshared", n / 64, 1.0), method("fullshared", n / 128, 0.9)]
        )
        for n in (64, 128, 256)
    ]
    written = plots.sweep_plots(dirs, tmp_path / "sweep")
    assert [p.name for p in written] == ["ttft_vs_shared_tokens.csv", "ttft_vs_shared_tokens.png"]
    fig = saved_figures[-1]
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "128", "256"]
    title = fig._suptitle.get_text()
    assert "trace" in title and "SmolLM2-135M-Instruct" in title and "64, 128, 256" in title


def test_a_figure_save_that_fails_midway_keeps_the_previous_figure(tmp_path, monkeypatch):
    """A save that fails after writing part of the file (disk full): every figure already there is
    kept byte for byte, a figure not there yet is not created, and no temporary file is left."""
    import errno

    from matplotlib.figure import Figure

    config = write_config(
        tmp_path / "config", 256, [method("nonshared", 1.0, 1.0), method("fullshared", 0.5, 0.8)]
    )
    plots.configuration_plots(config)
    before = {p.name: p.read_bytes() for p in (config / "plots").glob("*.png")}
    assert "fidelity_vs_ttft.png" in before and all(before.values())
    original = Figure.savefig

    def full_disk(self, fname, *args, **kwargs):
        original(self, fname, *args, **kwargs)
        with open(fname, "r+b") as f:  # what a failed write leaves: the first half of the file
            f.truncate(max(1, Path(fname).stat().st_size // 2))
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    monkeypatch.setattr(Figure, "savefig", full_disk)
    summary = json.loads((config / "summary.json").read_text())
    summary["methods"][1]["agreement"] = 0.5  # another figure than the one on disk
    (config / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(OSError, match="No space left"):
        plots.configuration_plots(config)
    assert {p.name: p.read_bytes() for p in (config / "plots").glob("*.png")} == before
    sweep = tmp_path / "sweep"
    dirs = [write_config(tmp_path / str(n), n, [method("nonshared", n / 64, 1.0)]) for n in (64, 128)]
    with pytest.raises(OSError, match="No space left"):
        plots.sweep_plots(dirs, sweep)
    assert not list(sweep.glob("*.png"))
    assert not [p for d in (config / "plots", sweep) for p in d.iterdir() if p.name.startswith(".")]

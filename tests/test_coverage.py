"""Reconstruction coverage: the criteria find hand-made deviations; extremes, random baseline, CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tiny import tiny_model

from hf_kvshare import PF, PH
from hf_kvshare.cache import SegmentKV
from hf_kvshare.evaluation import Step, Workflow, collect_transitions, entry_errors, reconstruction_coverage
from hf_kvshare.methods import CacheBlend, DroidSpeak, RelayCaching

QUERY = "Write a function that returns the n-th Fibonacci number, iteratively."


def workflow() -> Workflow:
    return Workflow(
        [
            Step("planner", [PF("You plan.\n"), PH("query", QUERY), PF("\nPlan:")]),
            Step(
                "coder",
                [PF("You write code.\n"), PH("query", QUERY), PF("\nPlan: "), PH("planner"), PF("\nCode:")],
            ),
            Step(
                "final",
                [PF("Decide.\n"), PH("planner"), PF("\n"), PH("coder"), PF("\nTask: "), PH("query", QUERY)],
            ),
        ],
        max_new_tokens=5,
    )


@pytest.fixture(scope="module")
def six_layers():
    return tiny_model("llama", num_hidden_layers=6)


@pytest.fixture(scope="module")
def transitions(six_layers, tokenizer):
    band_start = RelayCaching().band_layers(6)[0]
    return collect_transitions(six_layers, tokenizer, [workflow()], hidden_layers=[band_start])


def perturbed(t, layers=None, tokens=None, scale=1.0, seed=0):
    """``t`` with its reused cache replaced by the exact one plus noise at the given layers/tokens."""
    g = torch.Generator().manual_seed(seed)
    keys, values = [], []
    for layer in range(t.exact.num_layers):
        k, v = t.exact.keys[layer].clone(), t.exact.values[layer].clone()
        if layers is None or layer in layers:
            rows = slice(None) if tokens is None else tokens
            k[..., rows, :] += scale * torch.randn(k[..., rows, :].shape, generator=g)
            v[..., rows, :] += scale * torch.randn(v[..., rows, :].shape, generator=g)
        keys.append(k)
        values.append(v)
    return replace(t, reused=SegmentKV(keys=keys, values=values, start=t.exact.start))


def test_transitions_pair_reused_and_exact(transitions):
    # coder reads query and planner; final reads planner, coder and query
    assert [(t.target_agent, t.slot) for t in transitions] == [
        ("coder", "query"),
        ("coder", "planner"),
        ("final", "planner"),
        ("final", "coder"),
        ("final", "query"),
    ]
    band_start = RelayCaching().band_layers(6)[0]
    assert band_start == 2  # round(0.25 * 6)
    for t in transitions:
        assert t.reused.start == t.exact.start == t.start and t.reused.length == t.length
        assert t.prefix.get_seq_length() >= t.start
        assert set(t.source_hidden) == {band_start}
        assert t.source_hidden[band_start].shape == (1, t.length, 64)
    # the latest materialization is the source: the coder's turn re-materialized query and planner
    assert [t.source_agent for t in transitions] == ["planner", "planner", "coder", "coder", "coder"]


def test_entry_errors_normalized_per_tensor():
    exact = SegmentKV(keys=[torch.ones(1, 1, 2, 2) * 2], values=[torch.ones(1, 1, 2, 2)], start=0)
    reused = SegmentKV(
        keys=[torch.tensor([[[[2.0, 2.0], [2.0, 4.0]]]])], values=[torch.ones(1, 1, 2, 2)], start=0
    )
    e = entry_errors(reused, exact)
    assert e.shape == (1, 2)
    assert e[0].tolist() == pytest.approx([0.0, 4.0 / 16.0])  # ||dK_t||^2 / ||K||^2
    with pytest.raises(ValueError, match="same shape"):
        entry_errors(reused, replace(exact, keys=[torch.ones(1, 1, 3, 2)], values=[torch.ones(1, 1, 3, 2)]))


def test_deviation_criterion_finds_the_deviating_token(six_layers, tokenizer, transitions):
    t = perturbed(transitions[0], tokens=[4], scale=3.0)
    report = reconstruction_coverage(
        six_layers, tokenizer, [], rho=0.8, transitions=[t], droidspeak=DroidSpeak(layer_profile=[0] * 6)
    )
    dev = report.rows["deviation"]
    assert dev.coverage == pytest.approx(1.0)  # all the error sits in token 4, which CacheBlend selects
    k = CacheBlend(rho=0.8).tokens_to_recompute(t.length)
    assert dev.random_coverage == pytest.approx(k / t.length, abs=0.08)
    assert dev.relative == pytest.approx(dev.coverage / dev.random_coverage)


def test_layer_criterion_follows_the_profile(six_layers, tokenizer, transitions):
    t = perturbed(transitions[1], layers=[3], scale=1.0)
    on_target = DroidSpeak(layer_profile=[0, 0, 0, 5, 0, 0])
    off_target = DroidSpeak(layer_profile=[0, 5, 0, 0, 0, 0])
    hit = reconstruction_coverage(six_layers, tokenizer, [], rho=0.8, transitions=[t], droidspeak=on_target)
    miss = reconstruction_coverage(six_layers, tokenizer, [], rho=0.8, transitions=[t], droidspeak=off_target)
    assert hit.layer_groups == [(3, 4)] and hit.rows["layer"].coverage == pytest.approx(1.0)
    assert miss.layer_groups == [(1, 2)] and miss.rows["layer"].coverage == pytest.approx(0.0)
    assert hit.rows["layer"].budget == pytest.approx(1 / 6)
    assert on_target.rho == 0.9  # the caller's instance is not modified


def test_extremes_and_random_baseline(six_layers, tokenizer, transitions):
    profile = DroidSpeak(layer_profile=[0, 1, 2, 3, 2, 1])
    everything = reconstruction_coverage(
        six_layers, tokenizer, [], rho=0.0, transitions=transitions, droidspeak=profile
    )
    for row in everything.rows.values():
        assert row.coverage == pytest.approx(1.0) and row.budget == pytest.approx(1.0)
    nothing = reconstruction_coverage(
        six_layers, tokenizer, [], rho=1.0, transitions=transitions, droidspeak=profile
    )
    for row in nothing.rows.values():
        assert row.removed == 0.0 and row.budget == 0.0
    report = reconstruction_coverage(
        six_layers, tokenizer, [], rho=0.6, transitions=transitions, droidspeak=profile, random_trials=400
    )
    # random token selection removes k/S of each transition's error in expectation
    cb = CacheBlend(rho=0.6)
    expected = sum(
        cb.tokens_to_recompute(r["tokens"]) / r["tokens"] * r["total"] for r in report.per_transition
    )
    assert report.rows["deviation"].random_removed == pytest.approx(expected, rel=0.05)
    for row in report.rows.values():
        assert 0.0 <= row.coverage <= 1.0 + 1e-9 and row.random_coverage > 0
    assert 0.0 < report.mean_reuse_error < 1.0
    assert "| deviation |" in report.to_markdown()


def test_needs_a_profile_or_calibration(six_layers, tokenizer, transitions):
    with pytest.raises(ValueError, match="calibration"):
        reconstruction_coverage(six_layers, tokenizer, [], rho=0.9, transitions=transitions)
    with pytest.raises(ValueError, match="rho"):
        reconstruction_coverage(six_layers, tokenizer, [], rho=1.2, transitions=transitions)


def test_study_cli(tmp_path, tokenizer):
    from hf_kvshare.bench.studies.coverage import main

    model = tiny_model("llama", num_hidden_layers=6)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "runs"
    code = main(
        [
            "--model",
            str(tmp_path / "tiny"),
            "--rho",
            "0.5",
            "--limit",
            "1",
            "--calibration",
            "1",
            "--max-new-tokens",
            "3",
            "--random-trials",
            "4",
            "--out",
            str(out),
            "--no-progress",
            "--no-plots",
        ]
    )
    assert code == 0
    (config,) = [d for d in out.iterdir() if (d / "coverage.json").exists()]
    results = json.loads((config / "coverage.json").read_text())
    assert len(results["layer_profile"]) == 6
    criteria = results["coverage"]["0.5"]["criteria"]
    assert set(criteria) == {"layer", "deviation", "attention", "relaycaching"}
    assert all(0.0 <= c["coverage"] <= 1.0 + 1e-9 for c in criteria.values())
    summary = json.loads((config / "summary.json").read_text())
    methods = {row["method"].split(":")[0]: row for row in summary["methods"]}
    assert set(methods) == {"nonshared", "fullshared", "cacheblend", "droidspeak", "relaycaching", "limit"}
    assert all(
        "rho=0.5" in row["method"]
        for name, row in methods.items()
        if name not in ("nonshared", "fullshared", "limit")
    )
    assert methods["nonshared"]["agreement"] == 1.0 and methods["nonshared"]["kv_error"] == 0.0
    assert 0.0 < methods["cacheblend"]["reuse_ratio"] < methods["fullshared"]["reuse_ratio"]
    assert "| deviation |" in (config / "coverage.md").read_text()


def test_calibrates_droidspeak_when_given_calibration_workflows(six_layers, tokenizer, transitions):
    report = reconstruction_coverage(
        six_layers, tokenizer, [], rho=0.8, transitions=transitions, calibration=[workflow()]
    )
    assert len(report.layer_profile) == 6 and report.layer_profile[0] < 1e-8
    assert len([layer for a, b in report.layer_groups for layer in range(a, b)]) == round(0.2 * 6)

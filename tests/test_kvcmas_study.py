"""The KVCMAS study's bookkeeping (summaries, tables, plots) on hand-made rows: no model runs."""

from __future__ import annotations

import argparse

import pytest

from hf_kvshare.bench.studies import kvcmas as study


def turn(method, request, i, ttft, reused, ph, agreement=1.0):
    return {
        "method": method,
        "request": request,
        "agent_index": i,
        "agent": study.AGENTS[i],
        "ttft_s": ttft,
        "e2e_s": 2 * ttft,
        "prompt_tokens": 100,
        "tokens_prefilled": 100 - reused,
        "rho": reused / ph if ph else 0.0,
        "ph_tokens": ph,
        "tokens_reused": reused,
        "same_output": 1.0,
        "rho_forced": reused / ph if ph else 0.0,
        "tokens_reused_forced": reused,
        "ph_tokens_forced": ph,
        "agreement": agreement,
        "kl": 0.0 if agreement == 1.0 else 0.1,
    }


def segment(method, request, i, slot, provenance, error):
    return {
        "method": method,
        "request": request,
        "agent_index": i,
        "agent": study.AGENTS[i],
        "slot": slot,
        "length": 10,
        "provenance": provenance,
        "kv_error": error,
    }


@pytest.fixture
def data():
    turns, segments = [], []
    for r in range(2):
        for i in range(4):
            turns.append(turn("nonshared", r, i, ttft=1.0, reused=0, ph=20 * (i + 1)))
            # kvcmas: dense on request 0, 3/4 of PH tokens reused (and twice as fast) on request 1
            reused = 0 if r == 0 else 15 * (i + 1)
            turns.append(
                turn(
                    "kvcmas", r, i, ttft=1.0 if r == 0 else 0.5, reused=reused, ph=20 * (i + 1), agreement=0.5
                )
            )
            segments.append(
                segment("kvcmas", r, i, "query", "dense" if r == 0 or i == 0 else "corrected", 0.1 * i)
            )
    return {
        "turns": turns,
        "segments": segments,
        "layers": [{"method": "kvcmas", "layer": 0, "key": 0.1, "value": 0.2, "segments": 3}],
        "sweep": [
            {
                "tau": 0.1,
                "temperature": 1.0,
                "request": 1,
                "agent_index": 0,
                "rho": 0.5,
                "ph_tokens": 10,
                "tokens_reused": 5,
                "agreement": 0.9,
                "kl": 0.01,
                "kv_error_ph_sum": 0.3,
                "ph_segments": 3,
            }
        ],
        "rank": [
            {
                "request": 0,
                "slot": "query",
                "edge": "planner->designer",
                "length": 12,
                "layer": layer,
                "base_key": 4,
                "base_value": 6,
                "delta_key": 3,
                "delta_value": 5,
            }
            for layer in range(2)
        ],
        "bytes": [
            {"length": 64, "dense_bytes": 300, "rank32_bytes": 200, "ratio": 1.5, "rank32_rel_error": 0.2}
        ],
        "pools": {
            "kvcmas": {
                "free_bytes": 1234,
                "forced_bytes": 1234,
                "profiles": 0,
                "config": "KVCMAS()",
                "pools": [
                    {"slot": "query", "anchors": 2, "capacity": 10, "deltas": 2, "evicted": 0, "bytes": 1234}
                ],
            }
        },
        "wall_s": 1.0,
        "queries": ["q0", "q1"],
        "main_kvcmas": (0.3, 1.0),
    }


def test_summary_numbers(data):
    summary = study.summarize(data, warmup=1)
    k = summary["methods"]["kvcmas"]
    assert k["rho_steady"] == pytest.approx(0.75) and k["rho_all"] == pytest.approx(0.375)
    assert k["ttft_ratio_steady"] == pytest.approx(2.0) and k["ttft_ratio_all"] == pytest.approx(1 / 0.75)
    assert k["ttft_ratio_paired_median"] == pytest.approx(2.0)
    assert k["agreement_steady"] == 0.5 and k["pool_bytes"] == 1234
    # reused segments of the steady request: agents 1..3 with errors 0.1, 0.2, 0.3
    assert k["kv_error_reused_steady"] == pytest.approx(0.2) and k["reused_segments_steady"] == 3
    assert k["query_error_A0"] == 0.0 and k["query_error_A3"] == pytest.approx(0.3)
    taus = [(s["tau"], s["rho"]) for s in summary["sweep"]]
    assert taus == [(0.1, 0.5), (0.3, pytest.approx(0.75))]  # the main run joins the sweep
    assert summary["sweep"][0]["kv_error_ph"] == pytest.approx(0.1)
    assert summary["rank_by_layer"][1]["delta_value"] == 5


def test_markdown_and_plots(data, tmp_path):
    summary = study.summarize(data, warmup=1)
    args = argparse.Namespace(requests=2, warmup=1, max_new_tokens=8)
    text = study.summary_markdown(
        "python -m hf_kvshare.bench.studies.kvcmas --requests 2", summary, data, args
    )
    assert "Command: `python -m hf_kvshare.bench.studies.kvcmas --requests 2`" in text
    assert "| kvcmas | 0.75 | 0.75 | 2.00 | 2.00 |" in text
    files = study.plot(tmp_path, data, summary)
    assert set(files) == {
        "methods.png",
        "error_by_layer.png",
        "error_by_hop.png",
        "tau_sweep.png",
        "effective_rank.png",
        "anchor_bytes.png",
    }
    assert all((tmp_path / f).stat().st_size > 1000 for f in files)


def test_arguments_and_workloads():
    with pytest.raises(SystemExit):
        study.parse_args(["--requests", "3", "--warmup", "3"])
    assert study.parse_args(["--methods", "kvcmas"]).methods == ["nonshared", "kvcmas"]
    assert study.load_queries("demo", 3, offset=19)[:2] == [study.QUERIES[19], study.QUERIES[0]]
    with pytest.raises(ValueError, match="unknown workload"):
        study.load_queries("mmlu", 2)

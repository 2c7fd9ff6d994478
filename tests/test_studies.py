"""Studies are bench configurations plus collectors: each runs through the bench runner on a tiny
random model (seconds) and writes its report, its collectors' tables and the bench's summaries."""

from __future__ import annotations

import csv
import json

import pytest
from bench_helpers import save_random_adapters, save_tiny, trace_args

from hf_kvshare.bench.studies import kvcmas, precache

#: the runs read a saved model folder once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("folders_read_once")

TRACE = trace_args(rounds=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    return str(save_tiny(tmp_path_factory.mktemp("tiny-llama"), tokenizer))


def _config_dir(out):
    dirs = [d for d in out.iterdir() if (d / "config.json").exists()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_kvcmas_study_runs_through_the_bench(tiny_dir, tmp_path):
    argv = [
        *TRACE,
        "--requests",
        "2",
        "--model",
        tiny_dir,
        "--out",
        str(tmp_path),
        "--no-progress",
        "--no-plots",
    ]
    argv += ["--methods", "nonshared", "fullshared", "kvcmas", "kvcomm"]
    assert kvcmas.main(argv) == 0
    config = _config_dir(tmp_path)
    summary = json.loads((config / "summary.json").read_text())
    methods = ["nonshared", "fullshared", "kvcmas", "kvcomm", "limit"]  # limit: the bench's limit row
    assert [m["method"] for m in summary["methods"]] == methods
    text = (config / "kvcmas.md").read_text()
    assert text.startswith("# kvcmas study") and "Command: `python -m hf_kvshare.bench study kvcmas " in text
    assert "| kvcmas |" in text and "kv_error by hop" in text
    for section in ("Effective rank", "Bytes of one stored cache", "Anchor pools"):
        assert section in text
    ranks = list(csv.DictReader((config / "rank.csv").open()))
    assert [int(r["layer"]) for r in ranks] == list(range(4))
    assert all(float(r["base_key"]) > 0 for r in ranks) and float(ranks[0]["delta_value"]) == 0  # layer 0
    pairs = list(csv.DictReader((config / "rank_pairs.csv").open()))
    assert {p["slot"] for p in pairs} and all("->" in p["edge"] for p in pairs)
    pools = list(csv.DictReader((config / "pools.csv").open()))
    assert {p["method"] for p in pools} <= {"kvcmas", "kvcomm"} and all(int(p["bytes"]) > 0 for p in pools)
    sizes = list(csv.DictReader((config / "anchor_bytes.csv").open()))
    assert sizes and all(int(r["dense_bytes"]) > 0 for r in sizes)


def test_precache_study_with_role_adapters(tiny_dir, tmp_path):
    adapters = save_random_adapters(tmp_path / "adapters")
    argv = ["--adapters", str(adapters["plan"].parent), "--limit", "1", "--max-new-tokens", "3"]
    argv += ["--model", tiny_dir, "--out", str(tmp_path / "runs"), "--no-progress", "--no-plots"]
    argv += ["--methods", "nonshared", "prelrshared", "rebaseshared-db"]
    assert precache.main(argv) == 0
    config = _config_dir(tmp_path / "runs")
    text = (config / "precache.md").read_text()
    assert "--adapters" in text and "| prelrshared |" in text and "| rebaseshared-db |" in text
    rows = list(csv.DictReader((config / "adapter_free.csv").open()))
    assert {r["agent"] for r in rows} <= {"plan", "act", "reflect"} and rows
    assert sum(int(r["turns"]) for r in rows) == 6  # the first six NonShared turns of the request

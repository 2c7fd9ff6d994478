"""The PReCache study end to end on a tiny random model (seconds): numbers computed, report written."""

from __future__ import annotations

import json

import pytest
import torch
from lora_helpers import lora_model

from hf_kvshare.bench.studies import precache
from hf_kvshare.bench.workloads.autoact_world import ROLES


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_study_runs_and_reports(tokenizer, tmp_path):
    model = lora_model("llama", roles={r: 4 for r in ROLES})
    config = precache.StudyConfig(hops=1, filler=0, new_tokens={"plan": 4, "act": 3, "reflect": 5})
    data = precache.run_study(model, tokenizer, config, progress=False)
    s = data["summary"]
    assert set(s) == set(precache.FREE_METHODS)
    rows = data["free"]["rows"]
    assert [t["agent"] for t in rows["nonshared"]] == ["plan", "act", "plan", "act", "reflect"]
    # every method saw trajectories of the same length (fixed output lengths)
    lengths = {m: [t["prompt_tokens"] for t in turns] for m, turns in rows.items()}
    assert len({tuple(v) for v in lengths.values()}) == 1
    assert (
        s["prelrshared"]["tokens_prefilled"]
        < s["baseshared"]["tokens_prefilled"]
        < s["nonshared"]["tokens_prefilled"]
    )
    assert s["nonshared"]["agreement_mean"] == 1.0
    assert [t["agent"] for t in data["free"]["adapter_free"]] == [t["agent"] for t in rows["nonshared"]]
    assert s["rebaseshared-lp"]["agreement_mean"] == pytest.approx(s["rebaseshared-db"]["agreement_mean"])
    assert s["prelrshared-lazy"]["same_outputs_as_nonshared"] == s["prelrshared"]["same_outputs_as_nonshared"]
    for m in precache.BASE_ERROR_METHODS:
        assert 0 < s[m]["base_key_error_mean"] < 10
    # base once + small LR caches: well below one cache per agent
    assert s["prelrshared"]["state_kv_bytes"] < len(ROLES) * s["nonshared"]["last_turn_kv_bytes"] / 2
    assert s["prelrshared-lazy"]["last_turn_kv_bytes"] < s["prelrshared"]["last_turn_kv_bytes"]
    data["command"] = "python -m hf_kvshare.bench.studies.precache --test"
    precache.write(data, tmp_path)
    text = (tmp_path / "precache.md").read_text()
    assert "--test" in text and "| prelrshared |" in text and "| rebaseshared-db |" in text
    assert "## Findings" in text and "Neutral base" in text
    for png in ("ttft_e2e_ratio.png", "base_cache_error.png"):
        assert (tmp_path / "precache" / png).stat().st_size > 10_000
    # the report re-renders from the saved data alone (plus the adapters' training report, when given)
    saved = str(tmp_path / "precache" / "precache.json")
    assert (
        precache.main(["--from-json", saved, "--out", str(tmp_path / "again"), "--adapters", str(tmp_path)])
        == 0
    )
    assert (tmp_path / "again" / "precache.md").read_text() == text
    roles = {
        "loss": {"plan": [3.0, 0.5]},
        "train_seconds": 12.0,
        "command": "python -m hf_kvshare.bench.train_roles --x",
    }
    (tmp_path / "roles.json").write_text(json.dumps(roles))
    assert (
        precache.main(["--from-json", saved, "--out", str(tmp_path / "third"), "--adapters", str(tmp_path)])
        == 0
    )
    assert (
        "Trained by `python -m hf_kvshare.bench.train_roles --x` in 12 s"
        in (tmp_path / "third" / "precache.md").read_text()
    )

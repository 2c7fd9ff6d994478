"""Role-adapter training on a tiny model: the loss falls, adapters round-trip through save/load."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model

from hf_kvshare.bench.train_roles import load_role_adapters, main, train_roles
from hf_kvshare.bench.workloads.autoact_world import ROLES


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_train_save_and_load(tokenizer, tmp_path):
    model = tiny_model("llama", seed=5)
    report = train_roles(
        tmp_path / "adapters",
        steps=6,
        batch_size=2,
        max_length=48,
        rank=4,
        lr=1e-2,
        questions=6,
        model=model,
        tokenizer=tokenizer,
        progress=False,
    )
    assert set(report["loss"]) == set(ROLES)
    for losses in report["loss"].values():
        assert len(losses) == 6 and losses[-1] < losses[0]
    saved = json.loads((tmp_path / "adapters" / "roles.json").read_text())
    assert saved["settings"]["steps"] == 6 and saved["examples"]["act"] > 0
    loaded = load_role_adapters(tiny_model("llama", seed=5), tmp_path / "adapters")
    assert list(loaded.peft_config) == list(ROLES) and not loaded.training
    ids = tokenizer("Action: Lookup[", return_tensors="pt")["input_ids"]
    outputs = {}
    with torch.no_grad():
        with loaded.disable_adapter():
            base = loaded(input_ids=ids).logits
        for role in ROLES:
            loaded.set_adapter(role)
            outputs[role] = loaded(input_ids=ids).logits
            assert (outputs[role] - base).abs().max() > 1e-3  # trained: the adapter changes the output
    assert (outputs["plan"] - outputs["act"]).abs().max() > 1e-3  # and each role differently


def test_missing_adapters_and_bad_settings(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_roles --out"):
        load_role_adapters(tiny_model("llama"), tmp_path)
    with pytest.raises(ValueError, match="steps >= 1"):
        train_roles(tmp_path, steps=0)
    with pytest.raises(SystemExit):
        main([])  # --out is required

"""Role-adapter training on a tiny model: the loss falls, adapters round-trip through save/load;
reference targets (q/v, rank a multiple of 8) and the shared v_proj lora_A for baselrshared."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model

from hf_kvshare import Session
from hf_kvshare.bench.train_roles import BEYOND_REFERENCE_TARGETS, load_role_adapters, main, train_roles
from hf_kvshare.bench.workloads.autoact_world import ROLES


def test_train_save_and_load(tokenizer, tmp_path):
    model = tiny_model("llama", seed=5)
    report = train_roles(
        tmp_path / "adapters",
        steps=6,
        batch_size=2,
        max_length=48,
        rank=8,
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
    assert saved["settings"]["rank"] == 8 and saved["settings"]["lora_alpha"] == 16
    assert saved["targets"] == saved["settings"]["targets"] == ["q_proj", "v_proj"]
    assert saved["shared_lora_a"] is None and saved["settings"]["shared_lora_a"] is False
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


def _v_downs(model, role):
    return [m.lora_A[role].weight.detach().clone() for n, m in model.named_modules() if n.endswith("v_proj")]


def test_shared_lora_a_for_baselrshared(tokenizer, tmp_path):
    """--shared-lora-a: the first role trains as usual; the others get its v_proj lora_A, frozen."""
    model = tiny_model("llama", seed=5)
    report = train_roles(
        tmp_path / "shared",
        steps=2,
        batch_size=2,
        max_length=48,
        lr=1e-2,
        questions=4,
        model=model,
        tokenizer=tokenizer,
        progress=False,
        shared_lora_a=True,
    )
    assert report["shared_lora_a"] == ROLES[0] and report["settings"]["shared_lora_a"] is True
    loaded = load_role_adapters(tiny_model("llama", seed=5), tmp_path / "shared")
    first = _v_downs(loaded, ROLES[0])
    for role in ROLES[1:]:
        assert all(torch.equal(a, b) for a, b in zip(_v_downs(loaded, role), first))
    q = [m for n, m in loaded.named_modules() if n.endswith("q_proj")][0]
    assert not torch.equal(q.lora_A[ROLES[1]].weight, q.lora_A[ROLES[0]].weight)  # only v_proj is shared
    Session(loaded, tokenizer, "baselrshared")  # accepted: one shared lora_A
    with pytest.raises(ValueError, match="--shared-lora-a"):  # default training: each role its own lora_A
        Session(_unshared(tokenizer, tmp_path), tokenizer, "baselrshared")


def _unshared(tokenizer, tmp_path):
    train_roles(
        tmp_path / "own",
        steps=1,
        batch_size=2,
        max_length=48,
        lr=1e-2,
        questions=4,
        model=tiny_model("llama", seed=5),
        tokenizer=tokenizer,
        progress=False,
    )
    return load_role_adapters(tiny_model("llama", seed=5), tmp_path / "own")


def test_rank_targets_and_shared_a_checked_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "never"
    for kwargs, message in (
        ({"rank": 4}, "multiple of 8"),
        ({"rank": 12}, "multiple of 8"),
        ({"targets": ["q_proj", "wq"]}, "subset of"),
        ({"targets": ["q_proj"], "shared_lora_a": True}, "v_proj is not among the targets"),
    ):
        with pytest.raises(ValueError, match=message):
            train_roles(out, **kwargs)
        assert not out.exists()
    with pytest.raises(SystemExit) as info:
        main(["--out", str(out), "--rank", "4"])
    assert info.value.code == 2 and "rank must be a positive multiple of 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--targets", "q_proj", "--shared-lora-a"])
    assert "v_proj is not among the targets" in capsys.readouterr().err
    assert not out.exists()
    assert "k_proj" in BEYOND_REFERENCE_TARGETS  # the earlier, documented beyond-reference set

"""Exactness on the embedded SmolLM2-135M model (marked: real_model)."""

from __future__ import annotations

import pytest
import torch

from hf_kvshare import PF, PH, RopeShifter, SegmentedCache, Session, cache_kwargs, chat
from hf_kvshare.__main__ import main
from hf_kvshare.models import embedded_gguf_path

pytestmark = pytest.mark.real_model

QUERY = "List three practical ways to reduce the memory used by a large language model at inference time."


def test_embedded_model_shape(real):
    model, tok = real
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (30, 576, 3)
    assert model.dtype == torch.float32 and embedded_gguf_path().exists()


def test_nonshared_equals_plain_generate(real):
    model, tok = real
    segments = chat(
        tok,
        [
            {"role": "system", "content": "You are a concise engineer."},
            {"role": "user", "content": [PH("query", QUERY)]},
        ],
    )
    r = Session(model, tok, "nonshared").run_turn("engineer", segments, max_new_tokens=20)
    ids = r.prompt_ids
    with torch.no_grad():
        plain = model.generate(
            input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=20, do_sample=False
        )
    expected = plain[0, ids.numel() :].tolist()
    assert r.output_ids.tolist() == expected[: r.output_ids.numel()]
    assert all(t in (2,) for t in expected[r.output_ids.numel() :])  # only the stripped EOS differs


def test_repositioning_through_all_layers(real):
    model, tok = real
    ids = tok(QUERY, add_special_tokens=False, return_tensors="pt").input_ids
    n, d = ids.shape[1], 173
    at0, atd = SegmentedCache(model.config), SegmentedCache(model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(n)[None], use_cache=True, **cache_kwargs(at0))
        model(input_ids=ids, position_ids=torch.arange(d, d + n)[None], use_cache=True, **cache_kwargs(atd))
    moved = at0.extract(0, n).repositioned(RopeShifter.from_model(model), d)
    worst = max(
        max(
            (moved.keys[i] - atd.layer_kv(i)[0]).abs().max().item(),
            (moved.values[i] - atd.layer_kv(i)[1]).abs().max().item(),
        )
        for i in range(model.config.num_hidden_layers)
    )
    assert worst <= 1e-4, worst


def test_fullshared_deviates_but_generates(real):
    model, tok = real
    first = [PF("You are a cautious security reviewer.\n"), PH("query", QUERY), PF("\nReview:")]
    second = [
        PF("You are an enthusiastic marketing writer who loves superlatives.\n"),
        PH("query", QUERY),
        PF("\nPitch:"),
    ]
    exact, shared = Session(model, tok, "nonshared"), Session(model, tok, "fullshared")
    for s in (exact, shared):
        s.run_turn("reviewer", first, max_new_tokens=4)
    ref = exact.run_turn("writer", second, max_new_tokens=8, keep_cache=True)
    got = shared.run_turn("writer", second, force_output=ref.output_ids, keep_cache=True)
    q = got.cache.segment("query")
    from hf_kvshare.evaluation.metrics import kv_error

    assert q.provenance == "reused" and kv_error(got.cache, ref.cache, q.start, q.end) > 1e-3
    assert got.output_ids.numel() >= 1


def test_demo_command_prints_table(capsys):
    assert main(["demo", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "fullshared" in out and "NonShared/TTFT" in out and "rho" in out

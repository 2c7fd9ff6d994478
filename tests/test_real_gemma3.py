"""The second embedded model, Gemma 3 270M (the ``gemma3`` extra; marked: real_model).

A base model (no chat template: segments are PF/PH) with sliding-window layers (window 512 on five of
every six layers): nonshared must equal plain ``generate`` on a prompt that crosses the window, and
the sharing methods must run on it. Skipped when the ``gemma3`` extra is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_kvshare import PF, PH, Session
from hf_kvshare._compat import layer_types, sliding_window
from hf_kvshare.evaluation.metrics import kv_error
from hf_kvshare.models import EMBEDDED_INSTALL, EMBEDDED_MODELS, load_model

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        importlib.util.find_spec(EMBEDDED_MODELS["gemma3-270m"][0]) is None,
        reason=f"Gemma 3 270M is the `gemma3` extra, not installed: `{EMBEDDED_INSTALL['gemma3-270m']}`",
    ),
]

#: a shared document long enough that every prompt crosses the 512-token window
DOCUMENT = " ".join(
    f"Step {i}: the service reads batch {i} from the queue, checks its schema, writes the valid rows to "
    f"table t{i % 7} and logs the rejected ones with their line number."
    for i in range(24)
)
QUESTION = "Which table receives the valid rows of batch 9?"


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


def _prompt(role: str):
    return [PF(f"{role}\n\nDocument:\n"), PH("document", DOCUMENT), PF(f"\n\nQuestion: {QUESTION}\nAnswer:")]


def test_gemma3_shape(gemma):
    model, _ = gemma
    cfg = model.config
    types = layer_types(cfg)
    assert cfg.num_hidden_layers == 18 and sliding_window(cfg) == 512
    assert types.count("sliding_attention") == 15 and types.count("full_attention") == 3
    assert model.dtype == torch.float32


def test_gemma3_nonshared_equals_plain_generate_past_the_window(gemma):
    model, tok = gemma
    r = Session(model, tok, "nonshared").run_turn(
        "reader", _prompt("You answer from the document."), max_new_tokens=12
    )
    ids = r.prompt_ids
    assert ids.numel() > 512 + 100  # crosses the window
    with torch.no_grad():
        plain = model.generate(
            input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=12, do_sample=False
        )
    expected = plain[0, ids.numel() :].tolist()
    assert r.output_ids.tolist() == expected[: r.output_ids.numel()]


@pytest.mark.parametrize("method", ["fullshared", "kvcmas"])
def test_gemma3_sharing_methods_run(gemma, method):
    """Two agents read the same document: the second reuses the first's K/V (re-positioned)."""
    model, tok = gemma
    exact, shared = Session(model, tok, "nonshared"), Session(model, tok, method)
    first, second = _prompt("You are a careful auditor."), _prompt("You are a data engineer on call tonight.")
    for s in (exact, shared):
        s.run_turn("auditor", first, max_new_tokens=4)
    ref = exact.run_turn("engineer", second, max_new_tokens=6, keep_cache=True)
    got = shared.run_turn("engineer", second, max_new_tokens=6, keep_cache=True)
    doc = got.cache.segment("document")
    assert got.prompt_ids.numel() > 512 and got.output_ids.numel() >= 1
    assert doc.provenance != "dense" and got.reuse_ratio > 0
    assert kv_error(got.cache, ref.cache, doc.start, doc.end) < 1.0

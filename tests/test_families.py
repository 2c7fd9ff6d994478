"""17 decoder families (tiny random models from transformers' own configs): every method at its exact
setting equals plain greedy ``generate`` token for token, or refuses with a clear ``ValueError`` before
generating (nothing mutated); re-positioning moves keys exactly on every family.

The matrix and its helpers live in tests/families.py (``python tests/families.py`` prints the table of
docs/architecture.md).
"""

from __future__ import annotations

import re

import pytest
import torch
from families import FAMILIES, METHOD_CASES, family_model, run_case
from transformers import DynamicCache

from hf_kvshare import PF, PH, RopeShifter, Session, cache_kwargs
from hf_kvshare.recompute import DecoderStack, SegmentRecompute

#: one worker under ``--dist loadgroup``: the 17 models and their plain references are built once per process
#: (families.family_model / family_reference, ~4 CPU-s), not on both workers
pytestmark = pytest.mark.xdist_group("test_families")

#: (family, method) -> the refusal's message (regex); every other case must be exact
REFUSED: dict[tuple[str, str], str] = {
    # RelayCaching scores attention with the layer's queries; GPT-NeoX fuses q/k/v per head
    ("gpt_neox", "relaycaching"): "no query projection",
}


@pytest.mark.parametrize("method", list(METHOD_CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_method_is_exact_or_refused(family, method, tokenizer):
    result = run_case(family, method, tokenizer)
    expected = REFUSED.get((family, method))
    if expected is None:
        assert result == "exact", result
    else:
        assert result.startswith("refused: ") and re.search(expected, result), result


@pytest.mark.parametrize("family", list(FAMILIES))
def test_repositioning_invariant(family):
    """Keys computed at offset 0 and moved by d equal keys computed at offset d, on every layer
    (RoPE attention depends on relative positions only, so deeper layers move too)."""
    model = family_model(family)
    shifter = RopeShifter.from_model(model)
    torch.manual_seed(0)
    ids = torch.randint(3, 49000, (1, 24))
    keys = []
    for offset in (0, 37):
        cache = DynamicCache()  # no config: every layer keeps all its keys
        with torch.no_grad():
            model(
                input_ids=ids,
                position_ids=torch.arange(offset, offset + 24)[None],
                use_cache=True,
                **cache_kwargs(cache),
            )
        keys.append([layer.keys for layer in cache.layers])
    rotation = shifter.rotation(0, 37, 24)
    for layer, (at0, at37) in enumerate(zip(*keys)):
        moved = shifter.apply(at0, rotation, layer=layer)
        assert (moved - at37).abs().max() <= 1e-5 * at37.abs().max(), (family, layer)
        if rotation is not None and layer == 0:
            assert (at0 - at37).abs().max() > 1e-3  # the positions do matter


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt_neox"])
def test_probe_attention_matches_the_models_attention_weights(family, tokenizer):
    """RelayCaching's attention scores use queries rebuilt from the layer's query projection (query
    norm, RoPE layout of the family): they equal the model's own attention weights (eager)."""
    model = family_model(family, attention="eager")
    segments = [
        PF("You are the solver. Think about the task carefully.\n"),
        PH("query", "Sum the primes below 30."),
        PF("\nGo:"),
    ]
    cache, ids = Session(model, tokenizer).build_cache("a", segments)
    seg = cache.segment("query")
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    stack = DecoderStack(model)
    engine = SegmentRecompute(stack, cache, cache.extract(seg.start, seg.end), ids[0, seg.start : seg.end])
    seen = {}

    def record(probe):
        seen["attention"] = probe.attention()
        return torch.arange(probe.rows.numel())

    hidden, rows = engine.run_layer(0, engine.embeddings(), engine.all_rows())
    engine.run_layer(1, hidden, rows, record, attention=True)
    weights = out.attentions[1][0]  # [heads, P, P]
    expected = weights[:, seg.start : seg.end, seg.start : seg.end].double().mean(0).sum(0)
    assert torch.allclose(seen["attention"], expected, atol=1e-4), (seen["attention"], expected)

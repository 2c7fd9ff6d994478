"""The decoder-family matrix: tiny random models of 17 families built from transformers' own configs,
each registered method at its exact setting, compared token for token with plain greedy ``generate``.

Imported by tests/test_families.py. ``python tests/families.py`` prints the "Supported models" table
of docs/architecture.md (family x method: exact / refused + reason).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

if __name__ == "__main__":  # run as a script: import this checkout's hf_kvshare, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiny import STEPS, TINY, roles  # noqa: E402

from hf_kvshare import PF, PH, Session  # noqa: E402

SLIDING_WINDOW = 16  # the prompts below are 40-90 tokens: they cross it

COMMON = {**TINY, "num_hidden_layers": 4, "head_dim": 16}

#: family -> config overrides on top of COMMON (what makes the family's case interesting)
FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},  # q/k norms
    "gemma": {},  # scaled embeddings
    "phi3": {  # longrope over partial rotary
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.1, 1.2, 1.3],
            "long_factor": [2.0, 2.3, 2.6, 2.9],
            "original_max_position_embeddings": 256,
        },
    },
    "olmo2": {},
    "granite": {"embedding_multiplier": 2.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5},
    "smollm3": {},  # every 4th layer without RoPE (no_rope_layers)
    "cohere": {},  # interleaved rotary
    "mistral": {"sliding_window": SLIDING_WINDOW},
    "gemma2": {"sliding_window": SLIDING_WINDOW},  # local/global interleaved, soft-capping
    "gemma3_text": {
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    },
    "starcoder2": {"sliding_window": SLIDING_WINDOW},
    "phi": {},  # partial_rotary_factor 0.5
    "stablelm": {},  # partial_rotary_factor 0.25
    "gpt_neox": {"num_key_value_heads": None},  # rotary_pct 0.25, fused qkv, no GQA
    "glm4": {},  # GLM's half rotary, interleaved
}


#: the same agent again behind the same prefix: reuse is exact there (FullShared's exact case)
SAME_PREFIX_STEPS = [
    ("first", roles("first")),
    ("first", roles("first") + [PH("first"), PF("\nGo on:")]),
]

#: method -> (registry name, options, steps): each method at the setting where it must equal NonShared
METHOD_CASES: dict[str, tuple[str, dict, list]] = {
    "nonshared": ("nonshared", {}, STEPS),
    "fullshared": ("fullshared", {}, SAME_PREFIX_STEPS),
    "kvcmas": ("kvcmas", {"tau": 0.0}, STEPS),
    "kvcmas-nonchained": ("kvcmas-nonchained", {"tau": 0.0}, STEPS),
    "kvcomm": ("kvcomm", {"tau": 0.0}, STEPS),
    "cacheblend": ("cacheblend", {"rho": 0.0}, STEPS),
    "droidspeak": ("droidspeak", {"rho": 0.0}, STEPS),
    "relaycaching": ("relaycaching", {"rho": 0.0}, STEPS),
}


def family_config(family: str):
    overrides = {**COMMON, **FAMILIES[family]}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return AutoConfig.for_model(family, **overrides)


@cache
def family_model(family: str, seed: int = 0, attention: str | None = None):
    """A tiny random model of ``family`` (eval mode; biases and norms randomized so they matter;
    ``attention``: an ``attn_implementation``, default the family's)."""
    torch.manual_seed(seed)
    kwargs = {} if attention is None else {"attn_implementation": attention}
    model = AutoModelForCausalLM.from_config(family_config(family), **kwargs).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def plain_generate(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=n, do_sample=False
        )
    return out[0, ids.numel() :]


@cache
def family_reference(family: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """Plain greedy ``generate`` of ``family_model(family)`` on ``prompt``: the methods of one family reach
    the same prompts when exact, so each reference is computed once per process (the suite's cost)."""
    return tuple(plain_generate(family_model(family), torch.tensor(prompt), n).tolist())


def run_case(family: str, method: str, tokenizer, n: int = 6) -> str:
    """``"exact"``, ``"refused: <message>"`` (a ValueError before the first turn's generate that left the
    session empty), ``"differs: ..."`` or ``"crash: <error>"``."""
    model = family_model(family)
    name, options, steps = METHOD_CASES[method]
    try:
        session = Session(model, tokenizer, name, **options)
    except ValueError as e:
        return f"refused: {e}"
    for i, (agent, segments) in enumerate(steps):
        before = dict(session.slots)
        try:
            r = session.run_turn(agent, segments, max_new_tokens=n)
        except ValueError as e:
            if session.slots != before:
                return f"crash: refusal at turn {i} mutated the session: {e}"
            return f"refused: {e}"
        except Exception as e:  # noqa: BLE001 - the matrix reports every failure
            return f"crash: {type(e).__name__}: {e}"
        expected = session._strip_eos(torch.tensor(family_reference(family, tuple(r.prompt_ids.tolist()), n)))
        if r.output_ids.tolist() != expected.tolist():
            return f"differs at turn {i}: {r.output_ids.tolist()} != {expected.tolist()}"
    return "exact"


def markdown_table(tokenizer) -> str:
    methods = list(METHOD_CASES)
    rows = ["| family | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    reasons: dict[str, int] = {}
    for family in FAMILIES:
        cells = []
        for method in methods:
            result = run_case(family, method, tokenizer)
            if result == "exact":
                cells.append("exact")
                continue
            kind, _, why = result.partition(": ")
            why = why.split(";")[0].strip()
            ref = reasons.setdefault(why, len(reasons) + 1)
            cells.append(f"{kind} [{ref}]")
        rows.append(f"| {family} | " + " | ".join(cells) + " |")
    rows.append("")
    rows += [f"[{i}] {why}" for why, i in reasons.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # tiny.py; this checkout
    from tiny import embedded_tokenizer

    torch.set_num_threads(1)
    print(markdown_table(embedded_tokenizer()))

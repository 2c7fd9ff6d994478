"""Where a turn's torch tensor memory goes, per method (issue 25): for each agent of the second of two
requests (the first one warms the pools), the turn's tensor peak (``TurnResult.tensor_peak_bytes``:
what is held when it starts plus the turn's own peak above that) split into what the session holds
(the slots' K/V, each storage once and whole), the method's state across requests (anchor pools, kept
PF text), the request's state the method keeps (producer caches, reference prefills) and the turn's
own peak. Tiny random Llama of tests/test_memory.py (8 layers x 4 kv heads x 32: the cache outweighs
the activations), a ~700-token context read by three agents; a KVCMAS gate rejects there (fewer than
two anchors, or unrelated ones), so its consumers' turns are dense fallbacks, as on the trace run.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/memory_breakdown.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import embedded_tokenizer, tiny_model  # noqa: E402

from hf_kvshare import PF, PH, Session, get_method  # noqa: E402

AGENTS = ("planner", "critic", "judge")
METHODS = {
    "nonshared": ("nonshared", {}),
    "fullshared": ("fullshared", {}),
    "cacheblend": ("cacheblend", {}),
    "kvcmas": ("kvcmas", {}),
    "kvcmas:defer_base=True": ("kvcmas", {"defer_base": True}),
    "kvcomm": ("kvcomm", {}),
    "kvcomm:base_rank=32,delta_rank=32": ("kvcomm", {"base_rank": 32, "delta_rank": 32}),
}


def segments(agent: str, context: str, earlier: list[str]) -> list:
    out = [PF(f"You are the {agent}.\n"), PH("context", context)]
    for name in earlier:
        out += [PF(f"\n{name} wrote: "), PH(name)]
    return out + [PF("\nContinue:")]


def main() -> None:
    tok = embedded_tokenizer()
    model = tiny_model(
        "llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=8,
        max_position_embeddings=2048,
    )
    context = " ".join(f"Note {i}: the council reviewed the bridge before winter." for i in range(60))
    mb = 1e6
    print("| method | agent | peak MB | session holds | method state | request state | turn above held |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, (name, options) in METHODS.items():
        method = get_method(name, **options)
        for request in range(2):
            session = Session(model, tok, method, tensor_memory=True)
            for i, agent in enumerate(AGENTS):
                request_state = method.request_state_bytes(session)
                slots = session.held_bytes() - request_state
                state = method.state_bytes()
                turn = session.run_turn(agent, segments(agent, context, list(AGENTS[:i])), max_new_tokens=4)
                if request == 1:
                    above = turn.tensor_peak_bytes - slots - request_state - state
                    print(
                        f"| {label} | {agent} | {turn.tensor_peak_bytes / mb:.2f} | {slots / mb:.2f} | "
                        f"{state / mb:.2f} | {request_state / mb:.2f} | {above / mb:.2f} |"
                    )


if __name__ == "__main__":
    main()

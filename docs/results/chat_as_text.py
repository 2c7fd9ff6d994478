"""Why the HumanEval chat workflow of issue 24 reused nothing under the reading before kinds.

4 agents (manager, designer, coder, final) in a chat layout; the task and every earlier reply are
passed to the next agents as *given text* (one token added, so the replies stay given text under
the outputs-as-text rule). Tiny random Llama (tests/tiny.py), KVCMAS at tau = 1, 5 requests; the
last request's per-span gate records are printed for the default (replies as observations) and for
``observation_source="question"`` (every given text read as the question: chained, ungated).

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/results/chat_as_text.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from tiny import embedded_tokenizer, tiny_model  # noqa: E402

from hf_kvshare import PF, PH, Session  # noqa: E402
from hf_kvshare.methods.kvcmas import KVCMAS  # noqa: E402

torch.set_num_threads(1)
AGENTS = ["manager", "designer", "coder", "final"]
TASKS = [
    "Write a function that sorts a list.",
    "Write a function that adds two numbers.",
    "Reverse a string in Python.",
    "Count vowels in a word.",
    "Return the maximum of a list.",
]


def main() -> None:
    tok, model = embedded_tokenizer(), tiny_model("llama")
    for opts in ({}, {"observation_source": "question"}):
        method = KVCMAS(tau=1.0, **opts)
        for n, task in enumerate(TASKS):
            session, replies, rows = Session(model, tok, method), [], []
            for agent in AGENTS:
                segs = [PF(f"<|im_start|>system\nYou are the {agent}.<|im_end|>\n<|im_start|>user\nTask:\n")]
                segs.append(PH("task", task))
                for j, text in enumerate(replies):
                    segs += [PF(f"\nFrom the {AGENTS[j]}:\n"), PH(f"{AGENTS[j]}_reply", text)]
                segs.append(PF("<|im_end|>\n<|im_start|>assistant\n"))
                turn = session.run_turn(agent, segs, max_new_tokens=4, min_new_tokens=4, keep_cache=True)
                replies.append(turn.text + " ok")  # given text, not the output's tokens
                gates = [(s.name, s.provenance, s.info.get("gate")) for s in turn.cache.placeholders()]
                rows.append((agent, round(turn.reuse_ratio, 2), gates))
            anchors = sum(len(p) for p in method.pools.values())
            print(f"kvcmas {opts or 'default'} request {n}: anchors {anchors}")
        for row in rows:
            print("  ", *row)


if __name__ == "__main__":
    main()

"""Drive an OpenAI-compatible server (``hf-kvshare serve``, or plain vLLM) from a real multi-agent loop, with the client helper (``hf_kvshare.serving.client.ChatTrajectory``).

Three agents work on one shared document; each agent's reply is fed to the next one as text. The
requests are ordinary chat completions sent with the ``openai`` client: by default the server
derives the shared segments from the messages (the document and earlier replies are messages of
their own); ``--explicit-layout`` also sends the layout in ``kv_transfer_params`` (README.md, "Serving on vLLM").

    python examples/serve_agents_client.py --base-url http://127.0.0.1:8000/v1 --model model

Needs ``pip install openai`` (vLLM's venv has it) and hf_kvshare importable (``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import time

from hf_kvshare.serving.client import ChatTrajectory
from hf_kvshare.trajectory import PH

DOCUMENT = (
    "The town council plans to repair the old bridge before winter. Two contractors bid: North Works "
    "asks 120,000 and needs eight weeks; River & Sons asks 95,000 and needs twelve weeks. The bridge "
    "carries the school bus route, and the first frost usually comes in the sixth week from now."
)

AGENTS = [
    ("planner", "You are the planner. Break the work into small steps.", ["document"]),
    ("critic", "You are the critic. Point out the risks in the plan.", ["document", "planner"]),
    (
        "writer",
        "You are the writer. Give the council a one-paragraph recommendation.",
        ["document", "planner", "critic"],
    ),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="model", help="the served model name")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--explicit-layout", action="store_true", help="send the layout in kv_transfer_params")
    args = p.parse_args()

    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key="unused")
    trajectory = ChatTrajectory({"document": DOCUMENT}, task=f"bridge-{time.time_ns()}")
    for name, system, reads in AGENTS:
        content: list = []
        for slot in reads:
            content += [
                f"{'Shared notes' if slot == 'document' else slot.capitalize() + ' wrote'}:",
                PH(slot),
            ]
        content.append("Your answer:")
        request = trajectory.request(
            name, [{"role": "system", "content": system}, {"role": "user", "content": content}]
        )
        kwargs = request.openai_kwargs(
            args.model, max_tokens=args.max_tokens, stream=True, explicit_layout=args.explicit_layout
        )
        start, first, parts = time.perf_counter(), None, []
        for chunk in client.chat.completions.create(**kwargs):
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                first = first or time.perf_counter() - start
                parts.append(delta)
        reply = "".join(parts).strip()
        trajectory.record(request.output_slot, reply)  # the next agent reads PH(name)
        print(f"[{name}] TTFT {first or float('nan'):.3f} s\n{reply}\n")


if __name__ == "__main__":
    main()

"""A multi-agent loop against ``hf-kvshare serve`` with the ``openai`` client.

Start the server (the embedded SmolLM2-135M; any vLLM option after ours goes to vLLM)::

    hf-kvshare serve --model smollm2-135m --method fullshared:prefix_reuse=True --dtype float32 --port 8000

then run ``python examples/serve_agents.py --base-url http://127.0.0.1:8000/v1``. Three agents read one
document; each later agent also reads the earlier agents' outputs. Every request names its layout in
``kv_transfer_params`` (the convention: ``hf_kvshare/serving/layout.py``): the document by its text, the
earlier outputs by their slot (the server recorded each output under the agent's name). With
``--derived`` the same requests go out with no ``kv_transfer_params`` at all and the server derives the
layout from the messages. Each reply's ``kv_transfer_params["hf_kvshare"]`` says what was supplied.
"""

from __future__ import annotations

import argparse
import json
import uuid

DOCUMENT = (
    "The river Lune rises on the fells of Cumbria, flows south through Kirkby Lonsdale and Lancaster, "
    "and reaches the sea at Plover Scar near Glasson, after passing under the aqueduct that carries the "
    "Lancaster Canal. Salmon run up it each autumn."
)
AGENTS = [
    ("planner", "You are the planner. List the steps to write a short guide."),
    ("critic", "You are the critic. Point out what the plan misses."),
    ("writer", "You are the writer. Write the guide's first sentence."),
]


def run(base_url: str, model: str | None = None, explicit: bool = True, max_tokens: int = 24) -> list[dict]:
    """One task: the agents in turn; returns per agent its text and the server's report."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", timeout=120, max_retries=0)
    model = model or client.models.list().data[0].id
    task = f"guide-{uuid.uuid4().hex[:8]}"
    outputs: list[tuple[str, str]] = []
    results = []
    for agent, system in AGENTS:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": DOCUMENT}]
        segments = [{"slot": "doc", "text": DOCUMENT}]
        for name, text in outputs:  # each earlier output as its own message: its tokens stay as generated
            messages.append({"role": "user", "content": text})
            segments.append({"slot": name})
        extra = {"kv_transfer_params": {"hf_kvshare": {"task": task, "agent": agent, "segments": segments}}}
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            extra_body=extra if explicit else None,
        )
        text = reply.choices[0].message.content or ""
        report = (reply.model_extra.get("kv_transfer_params") or {}).get("hf_kvshare") or {}
        outputs.append((agent, text))
        results.append({"agent": agent, "text": text, "report": report})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the server's one model")
    parser.add_argument("--derived", action="store_true", help="send no layout: the server derives it")
    parser.add_argument("--tasks", type=int, default=2, help="tasks in a row (agents keep their own text)")
    args = parser.parse_args()
    for i in range(max(1, min(args.tasks, 20))):
        print(f"task {i + 1}")
        for row in run(args.base_url, args.model, explicit=not args.derived):
            report = row["report"]
            print(
                f"  {row['agent']:>8}: supplied {report.get('supplied_tokens')} of {report.get('prompt_tokens')} prompt tokens"
            )
            print(f"            {json.dumps(row['text'])[:100]}")


if __name__ == "__main__":
    main()

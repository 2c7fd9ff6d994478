"""One-message (f-string) clients against separate-message clients on the same 4-agent workflow (issue
50, item 2), through the serving contract without vLLM: ``Sharing`` with the HF stand-in engine
(``hf_kvshare.serving.standin.engine``) and a simulated vLLM prefix cache (16-token blocks of the
sequences computed before), method ``fullshared:prefix_reuse=True``, the default layout (no layout
fields). Four agents, each with its own system prompt, read a fresh ~180-token incident report and the
earlier agents' replies:

- ``separate``: the report, then each earlier reply, as user messages of their own;
- ``one-message``: one user message ``f"{request}\\n\\nReport:\\n{report}\\n\\nEarlier replies:\\n{replies}"``.

Counted over agents 2-4 of tasks 2-4 (task 1 warms the agents' kept text): the PH tokens the method
placed (``placed``: what a connector taking several ranges would supply), the PH tokens the connector
supplies (``supplied_ph``: vLLM's one contiguous range from its hit) and the tokens the engine does not
compute (``not_computed``: the prefix hit plus the claim); and the turns whose earlier replies were all
recognised (each read as its output slot or pieces of it), and how many replies were read as pieces
(their text is not the output's tokens: stripped, or re-tokenized differently).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/message_styles.py [separate] [one-message]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from hf_kvshare.models import load_model
from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.host import Sharing
from hf_kvshare.serving.standin import engine

SYSTEMS = [
    "You are the planner. Read the report and list the steps to check it.",
    "You are the critic. Say what is wrong in the report and in the replies.",
    "You are the writer. Write a short summary of the report and the replies.",
    "You are the judge. Give a one-line verdict on the report.",
]
REQUESTS = [
    "List the steps to check the report below.",
    "Say what is wrong in the report and in the replies below.",
    "Summarize the report and the replies below in three sentences.",
    "Give a verdict on the report below, using the replies.",
]
FACTS = [
    "The river Lune reaches the sea at Plover Scar near Glasson.",
    "High water on the Scar was at 14:05 and the lighthouse keeper logged a north wind.",
    "Two walkers were seen crossing the sands at low tide without a guide.",
    "The coastguard station at Heysham received the first call at 15:20.",
    "A second call reported a small boat drifting past Sunderland Point.",
    "The lifeboat from Morecambe launched at 15:31 and reached the boat by 15:50.",
    "Both walkers were found on a sandbank and taken back to Glasson Dock.",
    "The boat's owner said the mooring line had been cut during the night.",
    "Police inspected the harbour wall and found fresh marks from a cutting tool.",
    "The harbour master asked for lights on the outer wall to be repaired.",
    "Tide tables for the week show spring tides with a range of nine metres.",
    "The local council will review signage at the crossing points next month.",
]
BLOCK = 16  # the simulated prefix cache's block


def report(task: int) -> str:
    return f"Incident report {task}. " + " ".join(FACTS[(task * 5 + i) % len(FACTS)] for i in range(10))


def messages(style: str, agent: int, text: str, replies: list[str]) -> list[dict[str, str]]:
    system = {"role": "system", "content": SYSTEMS[agent]}
    if style == "separate":
        return [system, {"role": "user", "content": text}] + [{"role": "user", "content": r} for r in replies]
    body = f"{REQUESTS[agent]}\n\nReport:\n{text}"
    if replies:
        body += "\n\nEarlier replies:\n" + "\n\n".join(replies)
    return [system, {"role": "user", "content": body}]


def prefix_hit(prompt: list[int], seen: list[list[int]]) -> int:
    """vLLM's prefix-cache hit, simulated: the longest common prefix with a sequence computed before, in
    whole blocks, short of the prompt's last token."""
    best = 0
    for other in seen:
        n = 0
        for a, b in zip(prompt, other):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // BLOCK * BLOCK


def run(model, tokenizer, style: str, tasks: int = 4, new_tokens: int = 24) -> list[dict]:
    sharing = Sharing(model, tokenizer, "fullshared", prefix_reuse=True)
    seen, rows = [], []
    for t in range(tasks):
        replies, outputs = [], []
        for agent in range(len(SYSTEMS)):
            prompt = tokenizer.apply_chat_template(
                messages(style, agent, report(t), replies),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            hit = prefix_hit(prompt, seen)
            plan = sharing.plan(f"{style}{t}.{agent}", prompt, {lay.KEY: {"task": f"{style}{t}"}}, hit)
            assert plan.error is None, plan.error
            out, keys, values = engine(model, plan, max_new_tokens=new_tokens)
            sharing.record(plan, keys, values, out, {tokenizer.eos_token_id})
            seen.append(prompt + out)
            summary = plan.report()
            host = sharing.hosts[f"{style}{t}"]
            ph = [(s, p) for s, p in zip(plan.turn.spans, plan.placements) if s.kind == "PH"]
            read, in_pieces = set(), set()
            for span, _ in ph:
                slot = host.slots.get(span.name)
                read.add(slot.piece_of[0] if slot is not None and slot.piece_of else span.name)
                if slot is not None and slot.piece_of:
                    in_pieces.add(slot.piece_of[0])
            rows.append(
                {
                    "task": t,
                    "agent": agent,
                    "hit": hit,
                    "ph": summary["ph_tokens"],
                    "placed": sum(s.length for s, p in ph if p is not None),
                    "supplied_ph": summary["supplied_ph_tokens"],
                    "supplied": summary["supplied_tokens"],
                    "replies": len(outputs),
                    "recognised": all(o in read for o in outputs),
                    "in_pieces": sum(o in in_pieces for o in outputs),
                }
            )
            replies.append(tokenizer.decode(out, skip_special_tokens=True).strip())
            outputs.append(plan.turn.output_slot)
    return rows


def summarize(rows: list[dict]) -> dict:
    later = [r for r in rows if r["task"] >= 1 and r["agent"] >= 1]
    out = {k: sum(r[k] for r in later) for k in ("hit", "ph", "placed", "supplied_ph", "supplied")}
    out["not_computed"] = out["hit"] + out["supplied"]
    turns = [r for r in rows if r["replies"]]
    out["replies_recognised"] = f"{sum(r['recognised'] for r in turns)}/{len(turns)}"
    out["replies_read_as_pieces"] = f"{sum(r['in_pieces'] for r in turns)}/{sum(r['replies'] for r in turns)}"
    return out


def main(styles: list[str]) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    results = {}
    for style in styles:
        t0 = time.perf_counter()
        results[style] = summarize(run(model, tokenizer, style))
        results[style]["seconds"] = round(time.perf_counter() - t0, 1)
        print(style, json.dumps(results[style]), flush=True)
    if len(results) == 2:
        one, sep = results["one-message"], results["separate"]
        for key in ("placed", "supplied_ph", "not_computed"):
            print(
                f"{key}: one-message / separate = {one[key]} / {sep[key]} = {one[key] / max(sep[key], 1):.2f}"
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["separate", "one-message"])

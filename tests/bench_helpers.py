"""Shared helpers of the bench tests: a tiny random Llama saved with the embedded tokenizer, task files."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from tiny import tiny_model

#: a file workload covering sequential, fan-out (two agents read the planner), fan-in (the judge
#: reads both) and a loop (the planner speaks again and reads the judge)
GRAPH_TASKS = [
    {
        "id": "graph-1",
        "max_new_tokens": 3,
        "agents": [
            {"name": "planner", "system": "You plan the work in short steps."},
            {"name": "coder", "system": "You write Python.", "glue": "\n[{label}]\n"},
            {"name": "tester", "system": "You write tests.", "tail": "\nTests:"},
            {"name": "judge", "system": "You decide.", "tail": ""},
        ],
        "slots": [{"name": "query", "text": "Write a function that reverses a list.", "label": "Task"}],
        "schedule": [
            {"agent": "planner", "reads": ["query"]},
            {"agent": "coder", "reads": ["query", "planner"]},
            {"agent": "tester", "reads": ["query", "planner"], "max_new_tokens": 2},
            {"agent": "judge", "reads": ["query", "coder", "tester"]},
            {"agent": "planner", "reads": ["query", "judge"], "min_new_tokens": 2},
        ],
        "answer": "4",
        "checker": "numeric",
    },
    {
        "id": "graph-2",
        "chat": False,
        "agents": [{"name": "a", "system": "Agent A."}, {"name": "b", "glue": "<{label}> ", "tail": " =>"}],
        "slots": [{"name": "doc", "text": "The sky is blue and the grass is green."}],
        "schedule": [
            {"agent": "a", "reads": ["doc"]},
            {"agent": "b", "reads": ["doc", "a"], "output": "verdict"},
        ],
        "max_new_tokens": 2,
    },
]


def trace_args(rounds: int = 2) -> list[str]:
    """``bench run`` arguments of a small trace: 24 shared tokens, 3 agents, ``rounds`` rounds, 3 output tokens."""
    sizes = {"--shared-tokens": 24, "--agents": 3, "--rounds": rounds, "--output-tokens": 3}
    return ["--workload", "trace", *(a for flag, n in sizes.items() for a in (flag, str(n)))]


def write_jsonl(path: Path, records) -> Path:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def save_tiny(directory: Path, tokenizer, **overrides) -> Path:
    """A tiny random Llama (long enough positions for the workloads) + the embedded tokenizer."""
    # 4 layers: RelayCaching needs a middle band of at least two layers
    model = tiny_model("llama", **{"max_position_embeddings": 4096, "num_hidden_layers": 4, **overrides})
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_random_adapters(directory: Path, names=("plan", "act", "reflect"), seed: int = 0) -> dict[str, Path]:
    """Random (non-zero) LoRA adapters on q_proj, v_proj and o_proj of the tiny Llama.

    No k_proj (the PReCache methods refuse it by default, as the reference code does) and one
    ``v_proj`` ``lora_A`` shared by all adapters (LRAgent's training), so that every LoRA method,
    ``baselrshared`` included, runs on them."""
    import torch
    from peft import LoraConfig, get_peft_model

    paths = {}
    shared_down: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        torch.manual_seed(seed + i)
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "o_proj"],
            init_lora_weights=False,
        )
        with warnings.catch_warnings():  # raised inside PEFT on transformers 5.x, not by our calls
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(
                tiny_model("llama", max_position_embeddings=4096, num_hidden_layers=4), config
            )
        torch.manual_seed(seed + 1000 + i)  # tiny_model() reseeds: draw each adapter's weights apart
        with torch.no_grad():  # strong enough to change greedy outputs of the random model
            for pname, p in peft_model.named_parameters():
                if "lora_" in pname:
                    p.normal_(0, 0.5)
                if "v_proj.lora_A" in pname:
                    p.copy_(shared_down.setdefault(pname, p.detach().clone()))
        paths[name] = directory / name
        peft_model.save_pretrained(paths[name])
    return paths

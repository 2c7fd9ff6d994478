"""Train small plan / act / reflect LoRA adapters on the embedded model, on CPU, in minutes.

The data is generated here (:mod:`hf_kvshare.bench.workloads.autoact_world`: gold AutoAct-style trajectories over a
fictional world), so nothing is downloaded. Each role's adapter learns its output format and
behaviour (``Thought: ...``, ``Action: Lookup[...]``, ``Reflection: ... Answer: ...``) from the
tail of the shared trajectory; the loss covers only the role's output tokens. Defaults (LoRA on
``q_proj`` + ``v_proj``, rank 8, alpha 16, as the authors' code), ``--targets`` and
``--shared-lora-a`` (LRAgent's training, for ``baselrshared``): ``README.md``.

Writes ``<out>/<role>/adapter_config.json`` + ``adapter_model.safetensors`` (PEFT
``save_pretrained``) and ``<out>/roles.json`` (settings, loss per step, time); load them with
:func:`load_role_adapters`.
"""

from __future__ import annotations

import json
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm

from .._compat import peft_wrapping_warnings_silenced
from ..agents import load_adapters
from ..argparsing import ArgumentParser, positive_int
from .workloads.autoact_world import ROLES, TRAINING_FILLER, World, training_examples

#: the reference's LoRA targets (PReCache refuses k_proj and requires v_proj; LRAgent runs q/v)
TARGETS = ["q_proj", "v_proj"]
#: our earlier setting, beyond the reference: needs ``lr_keys=True`` in the PReCache methods (k_proj)
BEYOND_REFERENCE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def check_settings(rank: int, targets: list[str] | tuple[str, ...], shared_lora_a: bool = False) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 8 or rank % 8:
        raise ValueError(
            f"rank must be a positive multiple of 8 (the PReCache reference kernels exist for ranks 8, 16, 32 "
            f"and 64); got {rank!r}"
        )
    unknown = [t for t in targets if t not in BEYOND_REFERENCE_TARGETS]
    if not targets or unknown:
        raise ValueError(
            f"targets must be a non-empty subset of {BEYOND_REFERENCE_TARGETS}; got {list(targets)}"
        )
    if shared_lora_a and "v_proj" not in targets:
        raise ValueError(
            f"shared_lora_a shares the v_proj lora_A, but v_proj is not among the targets {list(targets)}"
        )


def role_config(
    rank: int = 8, alpha: int | None = None, targets: list[str] | tuple[str, ...] = tuple(TARGETS)
):
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        lora_dropout=0.0,
        target_modules=list(targets),
        task_type="CAUSAL_LM",
    )


def _batches(tokenizer, examples, batch_size: int, max_length: int, rng: random.Random):
    """Endless shuffled batches ``(input_ids [B, T], labels [B, T])``, left-truncated, right-padded;
    labels are -100 outside the target."""
    encoded = []
    for context, target in examples:
        c = tokenizer(context, add_special_tokens=False)["input_ids"]
        t = tokenizer(target, add_special_tokens=False)["input_ids"]
        ids = (c + t)[-max_length:]
        labels = ([-100] * len(c) + t)[-max_length:]
        encoded.append((ids, labels))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    while True:
        rng.shuffle(encoded)
        for i in range(0, len(encoded) - batch_size + 1, batch_size):
            chunk = encoded[i : i + batch_size]
            ids = pad_sequence([torch.tensor(x) for x, _ in chunk], batch_first=True, padding_value=pad)
            labels = pad_sequence([torch.tensor(y) for _, y in chunk], batch_first=True, padding_value=-100)
            mask = pad_sequence([torch.ones(len(x), dtype=torch.long) for x, _ in chunk], batch_first=True)
            yield ids, labels, mask


def train_roles(
    out: str | Path,
    steps: int = 16,
    batch_size: int = 4,
    max_length: int = 96,
    rank: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    questions: int = 120,
    model: Any = None,
    tokenizer: Any = None,
    progress: bool = True,
    command: str | None = None,
    targets: list[str] | tuple[str, ...] = tuple(TARGETS),
    shared_lora_a: bool = False,
) -> dict[str, Any]:
    """Train one adapter per role (``plan``, ``act``, ``reflect``) and save them under ``out``;
    ``shared_lora_a``: the first role's ``v_proj`` ``lora_A`` is copied into the other roles and
    frozen there. Returns the report also written to ``<out>/roles.json``."""
    from peft import get_peft_model

    from ..models import load_model

    if steps < 1 or batch_size < 1 or max_length < 16:
        raise ValueError(
            f"need steps >= 1, batch_size >= 1, max_length >= 16; got {steps}, {batch_size}, {max_length}"
        )
    check_settings(rank, targets, shared_lora_a)
    targets = list(targets)
    torch.manual_seed(seed)
    if model is None:
        model, tokenizer = load_model()
    world = World.generate(seed=seed, filler=TRAINING_FILLER)
    by_role: dict[str, list[tuple[str, str]]] = {r: [] for r in ROLES}
    for role, context, target in training_examples(world, questions, seed=seed):
        by_role[role].append((context, target))
    with peft_wrapping_warnings_silenced():
        peft_model = get_peft_model(model, role_config(rank, targets=targets), adapter_name=ROLES[0])
    for role in ROLES[1:]:
        peft_model.add_adapter(role, role_config(rank, targets=targets))
    report: dict[str, Any] = {
        "settings": dict(
            steps=steps,
            batch_size=batch_size,
            max_length=max_length,
            rank=rank,
            lr=lr,
            seed=seed,
            questions=questions,
            lora_alpha=2 * rank,
            targets=targets,
            shared_lora_a=shared_lora_a,
        ),
        "command": command,
        "threads": torch.get_num_threads(),
        "targets": targets,
        "shared_lora_a": ROLES[0] if shared_lora_a else None,
        "examples": {r: len(v) for r, v in by_role.items()},
        "loss": {},
    }
    t0 = time.perf_counter()
    for role in ROLES:
        peft_model.set_adapter(role)
        frozen = (
            _share_value_down(peft_model, ROLES[0], role) if shared_lora_a and role != ROLES[0] else set()
        )
        for name, p in peft_model.named_parameters():
            p.requires_grad_(f".{role}." in name and "lora_" in name and name not in frozen)
        params = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        batches = _batches(tokenizer, by_role[role], batch_size, max_length, random.Random(seed))
        peft_model.train()
        losses = []
        bar = tqdm(range(steps), desc=f"train {role}", disable=not progress)
        for _ in bar:
            ids, labels, mask = next(batches)
            loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 4))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        report["loss"][role] = losses
    peft_model.eval()
    for p in peft_model.parameters():
        p.requires_grad_(False)
    report["train_seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out))
    (out / "roles.json").write_text(json.dumps(report, indent=1))
    return report


def _share_value_down(peft_model: Any, source: str, role: str) -> set[str]:
    """Copy ``source``'s ``v_proj`` ``lora_A`` weights into ``role``'s; the names of the copied
    parameters (to be kept frozen while ``role`` trains)."""
    frozen = set()
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if name.endswith("v_proj") and source in getattr(module, "lora_A", {}):
                module.lora_A[role].weight.copy_(module.lora_A[source].weight)
                frozen.add(f"{name}.lora_A.{role}.weight")
    return frozen


def load_role_adapters(model: Any, path: str | Path, roles: tuple[str, ...] = ROLES):
    """Wrap ``model`` with the role adapters saved by :func:`train_roles` (adapter name = role)."""
    path = Path(path)
    missing = [r for r in roles if not (path / r / "adapter_config.json").exists()]
    if missing:
        raise FileNotFoundError(
            f"no trained adapter for {missing} under {path}; train them with "
            f"`python -m hf_kvshare.bench.train_roles --out {path}`"
        )
    return load_adapters(model, {role: path / role for role in roles})


def main(argv: list[str] | None = None, prog: str = "python -m hf_kvshare.bench.train_roles") -> int:
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for the adapters (created)")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per role")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=96, help="tokens per example (left-truncated)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank, a multiple of 8 (alpha = 2 * rank)")
    parser.add_argument(
        "--targets",
        nargs="+",
        default=list(TARGETS),
        metavar="MODULE",
        help="LoRA target modules (default: q_proj v_proj, as the reference code); our earlier, beyond-reference "
        f"set is `{' '.join(BEYOND_REFERENCE_TARGETS)}` (k_proj: the PReCache methods then need lr_keys=True)",
    )
    parser.add_argument(
        "--shared-lora-a",
        action="store_true",
        help=f"train {ROLES[0]!r} first, copy its v_proj lora_A into the other roles and freeze it there "
        "(LRAgent's training; adapters for baselrshared)",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--questions", type=int, default=120, help="generated questions (training trajectories)"
    )
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)"
    )
    args = parser.parse_args(argv)
    try:
        check_settings(args.rank, args.targets, args.shared_lora_a)
    except ValueError as e:
        parser.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    command = shlex.join([*prog.split(), *(sys.argv[1:] if argv is None else argv)])
    settings = {k: v for k, v in vars(args).items() if k != "threads"}
    report = train_roles(**settings, command=command)
    first_last = {r: (v[0], v[-1]) for r, v in report["loss"].items()}
    print(
        f"saved {list(report['loss'])} to {args.out} in {report['train_seconds']} s; loss first/last: {first_last}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

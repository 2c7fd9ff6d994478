"""Tiny PEFT models for the PReCache tests: random adapters whose ``lora_B`` is not zero.

PEFT is imported by the helpers that use it, not at collection: it loads bitsandbytes (~2 CPU-s per
test process)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from tiny import tiny_model

from hf_kvshare import PH
from hf_kvshare._compat import peft_wrapping_warnings_silenced

if TYPE_CHECKING:
    from peft import LoraConfig

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # k_proj: the methods need lr_keys=True
ATTENTION_AND_MLP = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
QV = ["q_proj", "v_proj"]  # the reference's targets (PReCache / LRAgent): value-only LR caches
ROLES = {"plan": 4, "act": 2, "reflect": 3}  # adapter -> rank


def lora_config(r: int, targets=ATTENTION, **kwargs) -> LoraConfig:
    from peft import LoraConfig

    # init_lora_weights=False: lora_B random (PEFT's default zero B would make every adapter a no-op)
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False, **kwargs)


def lora_model(
    arch: str = "llama", roles=ROLES, targets=ATTENTION, seed: int = 0, keep_base: bool = False, **cfg
):
    """A tiny random model wrapped with one LoRA adapter per role (and a deep copy of the bare model)."""
    from peft import get_peft_model

    base = tiny_model(arch, seed=seed)
    plain = copy.deepcopy(base) if keep_base else None
    torch.manual_seed(seed + 1)
    names = list(roles)
    with peft_wrapping_warnings_silenced():
        model = get_peft_model(base, lora_config(roles[names[0]], targets, **cfg), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora_config(roles[name], targets, **cfg))
    model.eval()
    return (model, plain) if keep_base else model


def share_value_down(model) -> None:
    """Copy the first adapter's ``v_proj`` ``lora_A`` into every other adapter (LRAgent's training of
    adapters for BaseLRShared); ranks must agree."""
    first = next(iter(model.peft_config))
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("v_proj") and hasattr(module, "lora_A") and first in module.lora_A:
                for adapter, down in module.lora_A.items():
                    if adapter != first:
                        down.weight.copy_(module.lora_A[first].weight)


QUERY = "Question: which river flows through the capital of the country north of Spain? Work step by step."


def run_trajectory(session, agents, max_new_tokens=6, forced=None, keep_cache=False):
    """The PReCache turn layout: the whole trajectory so far as PH slots, plus the new instruction."""
    trajectory = [PH("query", QUERY)]
    results = []
    for i, agent in enumerate(agents):
        segments = [*trajectory, PH(f"instruction{i}", f"\n[{agent}] step {i}, go on:")]
        result = session.run_turn(
            agent,
            segments,
            max_new_tokens=max_new_tokens,
            force_output=None if forced is None else forced[i],
            keep_cache=keep_cache,
        )
        trajectory = [*segments, PH(result.output_slot)]
        results.append(result)
    return results

"""PEFT LoRA adapters seen from the key/value projections.

A ``peft`` ``lora.Linear`` computes ``base_layer(x) + sum_a lora_B[a](lora_A[a](dropout(x))) * scaling[a]``.
For ``k_proj`` / ``v_proj`` of every decoder layer, :class:`LoraBank` knows which adapters have a
LoRA pair there, concatenates their ``lora_A`` weights (so one matmul gives every adapter's
rank-``r`` down-projection ``A_a x``) and applies one adapter's up-projection ``s_a B_a``.

By default the bank follows the PReCache / LRAgent reference code: low-rank caches hold **values
only** (keys are ``k_proj(x)`` of the pass that wrote each token, kept in the shared base), so an
adapter with a LoRA on ``k_proj`` or without one on ``v_proj`` is refused. ``lr_keys=True`` is
our extension beyond the reference: a per-agent key term ``rope(s B_k A_k x)`` on top of the
shared keys, which also admits adapters without a ``v_proj`` LoRA.

Agents are adapters: on a ``PeftModel`` an agent's name is its adapter's name; checking and
activating an agent's adapter is :mod:`hf_kvshare.agents`.
"""

from __future__ import annotations

import re
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .._compat import is_peft_model, lora_variant_name
from ..agents import BASE_ROW, adapter_names, check_agent_adapter, merged_adapters
from ..cache import config_signature

_KV_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_proj|v_proj)$")
_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> adapters already warned about


@dataclass
class KVProjection:
    """One layer's ``k_proj`` or ``v_proj`` and the adapters that have a LoRA pair on it.

    ``module`` is the model's projection (a PEFT ``lora.Linear``, or the plain ``nn.Linear`` when no
    adapter targets it); ``base`` computes ``W x + b``.
    """

    layer: int
    kind: str  # "key" | "value"
    module: nn.Module
    base: nn.Module
    adapters: tuple[str, ...] = ()
    slices: dict[str, slice] = field(default_factory=dict)  # adapter -> its columns of `down`

    @property
    def name(self) -> str:
        """``layers.<i>.self_attn.k_proj`` or ``...v_proj``."""
        return f"layers.{self.layer}.self_attn.{'k_proj' if self.kind == 'key' else 'v_proj'}"

    @property
    def has_lora(self) -> bool:
        return bool(self.adapters)

    def rank(self, adapter: str) -> int:
        s = self.slices.get(adapter)
        return 0 if s is None else s.stop - s.start

    def down_weight(self) -> torch.Tensor | None:
        """The concatenated ``lora_A`` weights ``[sum of ranks, hidden]`` (``None`` without LoRA)."""
        if not self.adapters:
            return None
        return torch.cat([self.module.lora_A[a].weight for a in self.adapters], dim=0)

    def down(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        """``[A_1 x, ..., A_N x]`` ``[batch, seq, sum of ranks]`` for hidden states ``x`` ``[batch, seq, hidden]``."""
        weight = self.down_weight() if weight is None else weight
        if weight is None:
            return None
        return F.linear(x.to(weight.dtype), weight)

    def up(self, adapter: str, ax: torch.Tensor) -> torch.Tensor:
        """``s_a B_a (A_a x)`` ``[batch, seq, out]`` from the adapter's own columns ``ax`` ``[batch, seq, r_a]``."""
        return self.module.lora_B[adapter](ax) * self.module.scaling[adapter]


class LoraBank:
    """The LoRA adapters of a ``PeftModel`` at ``k_proj`` / ``v_proj`` of every decoder layer.

    Args:
        model: a ``peft.PeftModel`` over a Llama/Qwen2-style decoder (``layers.<i>.self_attn.k_proj``).
        warn: warn (once per model and adapter) about adapters without any LoRA on k/v projections
            (only reachable with ``lr_keys=True``; the default refuses them).
        lr_keys: ``False`` (default, as the reference code): value-only low-rank caches; adapters
            must have a LoRA on ``v_proj`` and none on ``k_proj``. ``True`` (beyond the reference):
            adapters may also adapt ``k_proj`` (their keys get a low-rank term ``rope(s B_k A_k x)``
            over the shared base keys) or leave ``v_proj`` alone (rank-0 value cache).

    Raises ``ValueError`` (mutating nothing) for a model without PEFT, non-LoRA adapters, merged
    adapters, LoRA variants that are not ``W x + s B A x`` on k/v (DoRA, ...), keys normalized
    after the projection (``k_norm``) and, unless ``lr_keys``, adapters with a LoRA on ``k_proj`` or
    without one on ``v_proj``.

    >>> bank = LoraBank(peft_model)  # doctest: +SKIP
    >>> bank.keys[0].rank("planner"), bank.num_kv_heads, bank.head_dim  # doctest: +SKIP
    (8, 3, 64)
    """

    def __init__(self, model: nn.Module, warn: bool = False, lr_keys: bool = False):
        if not is_peft_model(model):
            raise ValueError(
                f"PReCache methods need a peft.PeftModel whose adapters are the agents; got "
                f"{type(model).__name__}. Wrap the model with `peft.get_peft_model` or `PeftModel.from_pretrained`"
            )
        self.model = model
        self.lr_keys = bool(lr_keys)
        self.adapters = tuple(adapter_names(model))
        other = {a: str(getattr(c, "peft_type", "?")) for a, c in model.peft_config.items()}
        other = {a: t for a, t in other.items() if not t.endswith("LORA")}
        if other:
            raise ValueError(f"PReCache needs LoRA adapters; got {other}")
        merged = merged_adapters(model)
        if merged:
            raise ValueError(
                f"adapter(s) {merged} are merged into the base weights: K = W x + s B A x cannot be split into a "
                "shared base and a per-agent LR part any more; call `model.unmerge_adapter()` first"
            )
        layers, self.num_kv_heads, self.head_dim = config_signature(model.config)
        found: dict[tuple[int, str], tuple[str, nn.Module]] = {}
        for name, module in model.named_modules():
            match = _KV_NAME.search(name)
            if match:
                found[(int(match.group(1)), "key" if match.group(2) == "k_proj" else "value")] = (
                    name,
                    module,
                )
        missing = [(i, kind) for i in range(layers) for kind in ("key", "value") if (i, kind) not in found]
        if missing:
            raise ValueError(
                f"expected `layers.<i>.self_attn.k_proj` and `v_proj` for each of the {layers} decoder layers; "
                f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}"
            )
        self.keys = [self._projection(i, "key", *found[(i, "key")]) for i in range(layers)]
        self.values = [self._projection(i, "value", *found[(i, "value")]) for i in range(layers)]
        self._check_keys_are_linear(found[(0, "key")][0])
        if not self.lr_keys:
            self._check_value_only()
        self._lr_width = {a: sum(p.rank(a) for p in self.projections()) for a in self.adapters}
        if warn:
            self._warn_without_kv()

    # ------------------------------------------------------------------ building
    def _projection(self, layer: int, kind: str, name: str, module: nn.Module) -> KVProjection:
        lora_a = getattr(module, "lora_A", None)
        if lora_a is None:
            return KVProjection(layer, kind, module, module)
        adapters = tuple(a for a in self.adapters if a in lora_a)
        for a in adapters:
            variant = lora_variant_name(module, a)
            if variant is not None:
                raise ValueError(
                    f"adapter {a!r} uses the LoRA variant {variant!r} on {name}: "
                    + (
                        "DoRA rescales each output column by m / ||W + s B A||, so its key/value is not "
                        "W x + s B A x and cannot be split into a shared base and a low-rank part"
                        if variant == "dora"
                        else "only plain LoRA (W x + s B A x) can be split into a shared base and a low-rank part"
                    )
                )
        slices, start = {}, 0
        for a in adapters:
            r = module.lora_A[a].weight.shape[0]
            slices[a] = slice(start, start + r)
            start += r
        return KVProjection(layer, kind, module, module.get_base_layer(), adapters, slices)

    def _check_keys_are_linear(self, k_proj_name: str) -> None:
        attention = self.model.get_submodule(k_proj_name.rsplit(".", 1)[0])
        if getattr(attention, "k_norm", None) is not None:
            raise ValueError(
                f"{type(attention).__name__} normalizes keys after k_proj (k_norm), so K is not linear in the "
                "projection output and cannot be split into a shared base and a low-rank part"
            )

    def _check_value_only(self) -> None:
        """The reference's rule (PReCache's FastChat patch): LoRA on ``v_proj`` required, on ``k_proj`` refused."""
        on_keys = [a for a in self.adapters if any(a in p.adapters for p in self.keys)]
        if on_keys:
            layers = sorted({p.layer for p in self.keys if p.adapters})
            raise ValueError(
                f"adapter(s) {on_keys} have a LoRA on k_proj (layers {layers[:6]}{' ...' if len(layers) > 6 else ''}): "
                "PReCache/LRAgent keep every key in the shared base (k_proj(x) of the pass that wrote the token) "
                "and low-rank caches for values only, as the authors' code does. Train the adapters on q_proj + "
                "v_proj (`python -m hf_kvshare.bench.train_roles --targets q_proj v_proj`), or pass lr_keys=True "
                "(beyond the reference: adds a per-agent low-rank key term rope(s B_k A_k x) to the shared keys)"
            )
        no_values = [a for a in self.adapters if not any(a in p.adapters for p in self.values)]
        if no_values:
            raise ValueError(
                f"adapter(s) {no_values} have no LoRA on any v_proj: PReCache/LRAgent low-rank caches hold the "
                "value term s B_v A_v x, and the authors' code requires v_proj among the LoRA targets. Add v_proj "
                "to the adapters' target_modules, or pass lr_keys=True (beyond the reference: such an adapter "
                "gets a rank-0 value cache)"
            )

    def _warn_without_kv(self) -> None:
        warned = _WARNED.setdefault(self.model, set())
        for adapter in self.without_kv():
            if adapter in warned:
                continue
            warned.add(adapter)
            warnings.warn(
                f"adapter {adapter!r} has no LoRA on any k_proj/v_proj: its LR cache is empty (rank 0) and its "
                "cache is the shared base alone. Its K/V can still differ from other agents' through its other "
                "LoRA modules (they change the hidden states), which a shared base does not capture",
                UserWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ queries
    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def projection(self, layer: int, kind: str) -> KVProjection:
        return (self.keys if kind == "key" else self.values)[layer]

    def projections(self) -> Iterator[KVProjection]:
        for layer in range(self.num_layers):
            yield self.keys[layer]
            yield self.values[layer]

    def without_kv(self) -> list[str]:
        """Adapters with no LoRA pair on any key/value projection (their LR part is zero)."""
        return [a for a in self.adapters if not any(a in p.adapters for p in self.projections())]

    def unshared_down(self) -> tuple[str, KVProjection, str] | None:
        """The first place where the adapters do not share one ``lora_A``: ``(adapter, projection, why)``,
        or ``None`` when at every adapted projection all adapters have a LoRA with equal ``lora_A``
        weights (LRAgent's shared low-rank cache needs that)."""
        for proj in self.projections():
            if not proj.adapters:
                continue
            missing = [a for a in self.adapters if a not in proj.adapters]
            if missing:
                return missing[0], proj, f"has no LoRA there while {proj.adapters[0]!r} has one"
            first = proj.module.lora_A[proj.adapters[0]].weight
            for a in proj.adapters[1:]:
                weight = proj.module.lora_A[a].weight
                if weight.shape != first.shape:
                    why = f"has rank {weight.shape[0]} there, {proj.adapters[0]!r} rank {first.shape[0]}"
                    return a, proj, why
                if not torch.equal(weight, first.to(weight.device)):
                    return a, proj, f"has a lora_A there that differs from {proj.adapters[0]!r}'s"
        return None

    def lr_width(self, adapter: str) -> int:
        """Sum of the adapter's ranks over all k/v projections: LR-cache numbers stored per token."""
        return self._lr_width.get(adapter, 0)

    def check_agent(self, agent: str) -> None:
        check_agent_adapter(self.model, agent)

    def check_mixed_batch(self, agent: str) -> None:
        """PEFT refuses ``adapter_names`` batches with DoRA adapters anywhere in the model."""
        for module in self.model.modules():
            if lora_variant_name(module, agent) == "dora":
                raise ValueError(
                    f"adapter {agent!r} uses DoRA, which PEFT cannot run in a mixed-adapter batch "
                    f"(adapter_names=[{agent!r}, {BASE_ROW!r}]); use rebaseshared-lp instead of rebaseshared-db"
                )

    def __repr__(self) -> str:
        ranks = {a: self.lr_width(a) for a in self.adapters}
        return (
            f"LoraBank(layers={self.num_layers}, adapters={list(self.adapters)}, lr_width={ranks}, "
            f"lr_keys={self.lr_keys})"
        )

"""Hooks that capture what the key/value projections see during forward passes.

While a :class:`KVCapture` is active, a forward pre-hook on every layer's ``v_proj`` (and
``k_proj`` when adapters have a LoRA there, ``lr_keys=True``) (PEFT ``lora.Linear``) takes their input ``x`` (the input-layernormed hidden state) and keeps
``[A_1 x, ..., A_N x]`` for all adapters (one matmul over the concatenated ``lora_A`` weights);
optionally a forward hook on the projection's base layer keeps ``W x + b`` as the model computed
it (no second matmul). Hooks are added on entry and removed in ``finally``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hooks import thread_hook
from .adapters import KVProjection, LoraBank


class KVCapture:
    """Collects per forward call and per layer the adapters' down-projections (and the base outputs).

    Args:
        bank: the model's :class:`LoraBank`.
        base: also keep the base outputs ``W x + b`` ``[batch, seq, kv_heads * head_dim]``.

    The object is a re-enterable context manager: a turn enters it for its prefill and again
    for ``generate``; the chunks accumulate in order, one per forward call.

    >>> capture = KVCapture(LoraBank(model), base=True)  # doctest: +SKIP
    >>> with capture:  # doctest: +SKIP
    ...     model(input_ids)
    >>> capture.down(0, "key").shape  # [batch, seq, sum of ranks]  # doctest: +SKIP
    """

    def __init__(self, bank: LoraBank, base: bool = False):
        self.bank = bank
        self.keep_base = base
        self._down: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._base: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._weights: dict[tuple[int, str], torch.Tensor | None] = {}
        self._handles: list[Any] = []
        self._tokens = 0

    # ---------------------------------------------------------------- hooks
    def attach(self) -> None:
        if self._handles:
            return
        try:
            self._handles.append(self.bank.keys[0].module.register_forward_pre_hook(thread_hook(self._count)))
            for proj in self.bank.projections():
                key = (proj.layer, proj.kind)
                self._weights[key] = proj.down_weight()
                if proj.has_lora:
                    self._handles.append(
                        proj.module.register_forward_pre_hook(thread_hook(self._pre_hook(proj)))
                    )
                if self.keep_base:
                    self._handles.append(proj.base.register_forward_hook(thread_hook(self._base_hook(proj))))
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        """Remove the hooks (idempotent); captured tensors are kept."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> KVCapture:
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _count(self, module, args) -> None:
        self._tokens += args[0].shape[1]

    def _pre_hook(self, proj: KVProjection):
        key = (proj.layer, proj.kind)

        def hook(module, args):
            x = args[0]
            self._down.setdefault(key, []).append(proj.down(x.detach(), self._weights[key]))

        return hook

    def _base_hook(self, proj: KVProjection):
        key = (proj.layer, proj.kind)

        def hook(module, args, output):
            self._base.setdefault(key, []).append(output.detach())

        return hook

    # ---------------------------------------------------------------- reading
    @property
    def tokens(self) -> int:
        """Positions the model ran while the capture was active (counted at layer 0's key projection)."""
        return self._tokens

    def latest(self, layer: int, kind: str) -> torch.Tensor | None:
        """The down-projections of the most recent forward at this projection ``[batch, seq, sum of ranks]``."""
        chunks = self._down.get((layer, kind))
        return chunks[-1] if chunks else None

    def down(self, layer: int, kind: str) -> torch.Tensor | None:
        """All captured down-projections at this projection ``[batch, captured, sum of ranks]`` (``None``
        where no adapter has LoRA on it)."""
        chunks = self._down.get((layer, kind))
        if not chunks:
            return None
        if len(chunks) > 1:
            chunks[:] = [torch.cat(chunks, dim=1)]
        return chunks[0]

    def base(self, layer: int, kind: str) -> torch.Tensor:
        """All captured base outputs ``W x + b`` ``[batch, captured, kv_heads * head_dim]``."""
        if not self.keep_base:
            raise ValueError("this KVCapture was created with base=False")
        chunks = self._base.get((layer, kind))
        if not chunks:
            raise ValueError(f"nothing was captured at layer {layer} ({kind} projection)")
        if len(chunks) > 1:
            chunks[:] = [torch.cat(chunks, dim=1)]
        return chunks[0]

    def adapter_down(self, layer: int, kind: str, adapter: str, row: int = 0) -> torch.Tensor | None:
        """One adapter's ``A_a x`` ``[1, captured, r_a]`` from batch row ``row`` (``None`` without LoRA there)."""
        proj = self.bank.projection(layer, kind)
        if adapter not in proj.slices:
            return None
        return self.down(layer, kind)[row : row + 1, :, proj.slices[adapter]]

    def clear(self) -> None:
        self._down.clear()
        self._base.clear()
        self._tokens = 0

"""Neutral (adapter-free) reconstruction of the shared base cache: lazy prefill and double batching.

ReBaseShared keeps the shared base cache *neutral*: built from the hidden states of the model
with every adapter disabled, attending only to the neutral base. Two schedules do the same work:

- **lazy prefill (LP)**: after the agent's turn, one adapter-free prefill over the turn's new
  tokens extends the neutral base (:func:`neutral_prefill`); suited to single-stream use.
- **double batching (DB)**: the turn runs as a PEFT mixed-adapter batch ``[agent, "__base__"]``;
  row 1 is the adapter-free path, kept on row 0's tokens by :class:`FollowFirstRow` (greedy
  decoding), with its own cache view (the neutral base). Suited to serving, where the second row
  rides along in the batch.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LogitsProcessor

from ..prefill import prefill_dense
from .adapters import LoraBank
from .cache import BaseLRCache
from .capture import KVCapture
from .store import LowRankStore
from .view import AbsoluteRope, LowRankView


def neutral_prefill(
    model: nn.Module,
    store: LowRankStore,
    bank: LoraBank,
    rope: AbsoluteRope,
    ids: torch.Tensor,
    start: int,
    materialize: str = "turn",
) -> tuple[list[torch.Tensor], list[torch.Tensor], KVCapture]:
    """Run ``ids`` ``[T]`` at positions ``start .. start + T - 1`` with adapters disabled, attending to the
    stored neutral base ``[0, start)``.

    Returns the new positions' keys and values per layer ``[1, kv_heads, T, head_dim]`` (exactly what
    the base model caches) and the capture holding every adapter's ``A_a x`` of the adapter-free
    hidden states ``[1, T, r_a]``.
    """
    view = LowRankView(store, bank, rope, [None], length=start)
    cache = BaseLRCache(model.config, view, materialize=materialize)
    capture = KVCapture(bank, base=False)
    with model.disable_adapter(), capture:
        prefill_dense(cache, model, ids[None])
    keys, values = [], []
    for layer in range(bank.num_layers):
        k, v = cache.kv_range(layer, start)
        keys.append(k)
        values.append(v)
    return keys, values, capture


class FollowFirstRow(LogitsProcessor):
    """Keeps every row of a double batch on row 0's tokens.

    Copies row 0's scores to the other rows, so greedy decoding picks the same token in every row.
    Sampling draws each row on its own, so the rows may drift apart: the processor then notes where
    (``diverged_at``, a sequence length) instead of raising inside ``generate`` (PEFT removes its
    ``adapter_names`` hooks only when ``generate`` returns), and the method rebuilds the neutral base
    with a lazy prefill.
    """

    def __init__(self) -> None:
        self._ids: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] < 2:
            return scores
        self._ids = input_ids  # compared after generate: no host sync per decoding step
        return scores[:1].expand_as(scores).clone()

    @property
    def diverged_at(self) -> int | None:
        """The first position where the rows differ (read once, after ``generate``), or ``None``."""
        if self._ids is None:
            return None
        differs = (self._ids[1:] != self._ids[:1]).any(dim=0)
        return int(differs.nonzero()[0, 0]) if bool(differs.any()) else None

"""Preconstructed corrections for recurring relations (GraphFlow; KVCMAS paper Appendix A.2).

A :class:`RelationProfile` is the correction of one recurring (PH slot, consuming agent)
relation relative to the context-free reference, ``Δ = C_agent - Align(C_ref)``, calibrated on
the first ``calibration_requests`` requests that show the relation (the position-wise mean of
their observed deltas, keys canonical) and then frozen: later requests apply it without any
online matching. ``rank=None`` keeps it dense (GraphFlow); a rank (8 in the paper's A.2) keeps
its truncated SVD, re-positioned when applied like any canonical key correction.
"""

from __future__ import annotations

import torch

from .lowrank import FactoredKV, to_matrix


class RelationProfile:
    """Calibrating, then frozen, correction of one (slot, agent) relation.

    Args:
        slot: the PH slot.
        target: the consuming agent.
        calibration_requests: distinct requests to average before the profile is used.
        rank: rank of the frozen profile (``None``: dense).
    """

    def __init__(self, slot: str, target: str, calibration_requests: int, rank: int | None):
        if calibration_requests < 1:
            raise ValueError(f"calibration_requests must be >= 1, got {calibration_requests}")
        self.slot = slot
        self.target = target
        self.calibration_requests = calibration_requests
        self.rank = rank
        self.requests: set[int] = set()
        self._key_sums: list[torch.Tensor] = []  # per layer [L_max, D] float32
        self._value_sums: list[torch.Tensor] = []
        self._counts: torch.Tensor | None = None  # [L_max] observations per row
        self._kv_heads = 0
        self.frozen: FactoredKV | None = None

    @property
    def ready(self) -> bool:
        return self.frozen is not None

    @property
    def length(self) -> int:
        if self.frozen is not None:
            return self.frozen.length
        return 0 if self._counts is None else self._counts.numel()

    def observe(self, request: int, delta_keys: list[torch.Tensor], delta_values: list[torch.Tensor]) -> bool:
        """Add one request's observed delta (per layer ``[batch, kv_heads, L, head_dim]``, keys
        canonical). Ignored once frozen or when the request was already counted; returns whether
        it was used."""
        if self.ready or request in self.requests:
            return False
        keys = [to_matrix(k).float() for k in delta_keys]
        values = [to_matrix(v).float() for v in delta_values]
        length = keys[0].shape[0]
        if self._counts is None:
            self._kv_heads = delta_keys[0].shape[1]
            self._key_sums = [torch.zeros_like(k) for k in keys]
            self._value_sums = [torch.zeros_like(v) for v in values]
            self._counts = torch.zeros(length, device=keys[0].device)
        if length > self._counts.numel():
            grow = length - self._counts.numel()
            self._key_sums = [torch.cat([s, s.new_zeros(grow, s.shape[1])]) for s in self._key_sums]
            self._value_sums = [torch.cat([s, s.new_zeros(grow, s.shape[1])]) for s in self._value_sums]
            self._counts = torch.cat([self._counts, self._counts.new_zeros(grow)])
        for sums, new in ((self._key_sums, keys), (self._value_sums, values)):
            for s, x in zip(sums, new):
                s[:length] += x
        self._counts[:length] += 1
        self.requests.add(request)
        if len(self.requests) >= self.calibration_requests:
            self._freeze(dtype=delta_keys[0].dtype)
        return True

    def _freeze(self, dtype: torch.dtype) -> None:
        counts = self._counts[:, None]
        keys = [(s / counts).to(dtype) for s in self._key_sums]
        values = [(s / counts).to(dtype) for s in self._value_sums]
        self.frozen = FactoredKV.from_matrices(keys, values, self.rank, self._kv_heads)
        self._key_sums, self._value_sums, self._counts = [], [], None

    def layer_delta(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical key and value corrections ``[rows, D]`` of the frozen profile."""
        if self.frozen is None:
            raise ValueError(
                f"profile ({self.slot!r}, {self.target!r}) is still calibrating "
                f"({len(self.requests)}/{self.calibration_requests} requests)"
            )
        keys, values = self.frozen.keys[layer], self.frozen.values[layer]
        return keys.reconstruct(rows).float(), values.reconstruct(rows).float()

    @property
    def nbytes(self) -> int:
        if self.frozen is not None:
            return self.frozen.nbytes
        tensors = [*self._key_sums, *self._value_sums] + ([self._counts] if self._counts is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        state = "frozen" if self.ready else f"calibrating {len(self.requests)}/{self.calibration_requests}"
        return (
            f"RelationProfile({self.slot!r} -> {self.target!r}, {state}, {self.length} rows, {self.nbytes} B)"
        )

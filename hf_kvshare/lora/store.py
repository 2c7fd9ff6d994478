"""The per-request PReCache state: one shared base K/V and every agent's low-rank (LR) cache.

For the shared trajectory's tokens ``ids[0:L]``:

- ``base_keys[l]`` / ``base_values[l]``: ``[1, kv_heads, L, head_dim]``, keys after RoPE — the
  base part ``W x + b`` of layer ``l``'s key/value projections, stored once for all agents;
- ``lr[agent].keys[l]`` / ``.values[l]``: ``[1, L_a, r]`` — the agent's down-projection ``A_a x``
  of the same positions (``None`` where the adapter has no LoRA on that projection); valid over
  ``[0, L_a)`` with ``L_a = coverage(agent) <= L``.

An agent's K/V is ``K_base`` and ``V_base + s_a B_a (A_a x)`` (value-only, the reference default:
``keys`` hold ``None``), or with ``lr_keys=True`` (beyond the reference) ``K_base + rope(s_a B_a (A_a x))``
(:class:`~hf_kvshare.lora.view.LowRankView`). BaseLRShared keeps one LR cache under
:data:`SHARED_LR` that every agent reads. Only a method's ``record`` step mutates a store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: the store entry of the one LR cache all agents share (BaseLRShared)
SHARED_LR = "__shared__"


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _cat(a: torch.Tensor | None, b: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    if b is None:
        return a
    if a is None:
        return b.contiguous()
    return torch.cat([a, b], dim=dim)


@dataclass
class AgentLR:
    """One agent's LR cache: per layer ``[1, length, r]`` down-projections (``None``: no LoRA there)."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    length: int = 0

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in (*self.keys, *self.values))


@dataclass
class LowRankStore:
    """Shared base K/V plus per-agent LR caches over one shared trajectory (see the module docstring).

    >>> store = session.method_state["prelrshared"]  # doctest: +SKIP
    >>> store.length, store.coverage("planner"), store.memory()  # doctest: +SKIP
    """

    num_layers: int
    ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    base_keys: list[torch.Tensor | None] = field(default_factory=list)
    base_values: list[torch.Tensor | None] = field(default_factory=list)
    lr: dict[str, AgentLR] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_keys:
            self.base_keys = [None] * self.num_layers
            self.base_values = [None] * self.num_layers

    # ------------------------------------------------------------------ reading
    @property
    def length(self) -> int:
        return int(self.ids.numel())

    def coverage(self, agent: str) -> int:
        """Positions ``[0, n)`` over which ``agent``'s LR cache is valid."""
        lr = self.lr.get(agent)
        return 0 if lr is None else lr.length

    def common_prefix(self, ids: torch.Tensor) -> int:
        """Length of the longest common prefix of the stored trajectory and ``ids`` ``[n]``."""
        n = min(self.length, int(ids.numel()))
        if n == 0:
            return 0
        same = self.ids[:n] == ids[:n].to(self.ids.device)
        return n if bool(same.all()) else int((~same).nonzero()[0, 0])

    def base(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Base keys/values of positions ``[start, end)`` ``[1, kv_heads, end - start, head_dim]``."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"base positions [{start}, {end}) are outside the stored [0, {self.length})")
        return self.base_keys[layer][..., start:end, :], self.base_values[layer][..., start:end, :]

    def agent_lr(
        self, agent: str, layer: int, start: int, end: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``A_a x`` for keys and values over ``[start, end)`` ``[1, end - start, r]`` (``None``: no LoRA there)."""
        lr = self.lr.get(agent)
        if end > self.coverage(agent) or start < 0:
            raise ValueError(f"{agent!r}'s LR cache covers [0, {self.coverage(agent)}), not [{start}, {end})")
        if lr is None:
            return None, None
        k, v = lr.keys[layer], lr.values[layer]
        return (
            None if k is None else k[:, start:end],
            None if v is None else v[:, start:end],
        )

    # ------------------------------------------------------------------ memory
    def memory(self) -> dict[str, object]:
        """Exact bytes held: the base once, each agent's LR cache, and the total."""
        base = sum(_nbytes(t) for t in (*self.base_keys, *self.base_values))
        lr = {agent: state.nbytes for agent, state in self.lr.items()}
        return {
            "tokens": self.length,
            "base_bytes": base,
            "lr_bytes": lr,
            "total_bytes": base + sum(lr.values()),
        }

    @property
    def nbytes(self) -> int:
        return int(self.memory()["total_bytes"])

    # ------------------------------------------------------------------ writing (record only)
    def truncate(self, length: int) -> None:
        """Keep positions ``[0, length)`` (a turn diverged from the stored trajectory there)."""
        if length >= self.length:
            return
        self.ids = self.ids[:length].clone()
        self.base_keys = [None if k is None else k[..., :length, :].clone() for k in self.base_keys]
        self.base_values = [None if v is None else v[..., :length, :].clone() for v in self.base_values]
        for state in self.lr.values():
            if state.length > length:
                state.keys = [None if t is None else t[:, :length].clone() for t in state.keys]
                state.values = [None if t is None else t[:, :length].clone() for t in state.values]
                state.length = length

    def append_base(self, ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Extend the trajectory by ``ids`` ``[T]`` with their base K/V (per layer ``[1, kv_heads, T, head_dim]``)."""
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise ValueError(
                f"expected {self.num_layers} layers of base K/V, got {len(keys)} / {len(values)}"
            )
        for k in keys:
            if k.shape[0] != 1 or k.shape[-2] != ids.numel():
                raise ValueError(
                    f"base keys must be [1, kv_heads, {ids.numel()}, head_dim]; got {tuple(k.shape)}"
                )
        self.ids = torch.cat([self.ids, ids.to(self.ids.device, torch.long)])
        self.base_keys = [_cat(a, b, -2) for a, b in zip(self.base_keys, keys)]
        self.base_values = [_cat(a, b, -2) for a, b in zip(self.base_values, values)]

    def append_lr(
        self,
        agent: str,
        start: int,
        end: int,
        keys: list[torch.Tensor | None],
        values: list[torch.Tensor | None],
    ) -> None:
        """Extend ``agent``'s LR cache from ``start`` (its current coverage) to ``end`` with per-layer
        ``[1, end - start, r]`` down-projections (``None`` where the adapter has no LoRA)."""
        state = self.lr.setdefault(agent, AgentLR([None] * self.num_layers, [None] * self.num_layers))
        if start != state.length:
            raise ValueError(f"{agent!r}'s LR cache covers [0, {state.length}); cannot append at {start}")
        if end > self.length:
            raise ValueError(f"LR cache would cover [0, {end}) but the base covers [0, {self.length})")
        for t in (*keys, *values):
            if t is not None and (t.dim() != 3 or t.shape[:2] != (1, end - start)):
                raise ValueError(f"LR chunks must be [1, {end - start}, r]; got {tuple(t.shape)}")
        state.keys = [_cat(a, b, 1) for a, b in zip(state.keys, keys)]
        state.values = [_cat(a, b, 1) for a, b in zip(state.values, values)]
        state.length = end

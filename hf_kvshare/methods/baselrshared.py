"""BaseLRShared (LRAgent's public variant): one base K/V and one LR cache shared by all agents."""

from __future__ import annotations

from ..lora.adapters import LoraBank
from ..method import register
from .lowrank_sharing import LowRankSharing


@register
class BaseLRShared(LowRankSharing):
    """The agents' adapters share one frozen ``v_proj`` ``lora_A`` (LRAgent trains the first adapter,
    then copies its ``v_proj`` ``lora_A`` into the others and freezes it), so ``A x`` is the same for
    every agent: the request keeps one base K/V and **one** LR cache (store entry
    :data:`~hf_kvshare.lora.store.SHARED_LR`), both extended from the hidden states of whichever
    agent processed each token. A reader applies its own up-projection and scaling,
    ``V = V_base + s_a B_a (A x)``. Nothing is re-processed or precomputed for other agents.

    Same K/V as ``prelrshared`` on such adapters, with one LR cache instead of one per agent.
    ``attach`` refuses adapters whose ``lora_A`` differ (layer and adapter named). Options as
    :class:`~.lowrank_sharing.LowRankSharing` (with ``lr_keys=True`` the ``k_proj`` ``lora_A`` must be
    shared too).

    >>> Session(peft_model, tok, "baselrshared")  # doctest: +SKIP
    """

    name = "baselrshared"
    precompute = False
    neutral = None
    shared_lr = True

    def check_bank(self, bank: LoraBank) -> None:
        problem = bank.unshared_down()
        if problem is None:
            return
        adapter, proj, why = problem
        raise ValueError(
            f"{self.name} keeps one low-rank cache A x for all agents, so every adapter needs the same lora_A "
            f"at each adapted projection; adapter {adapter!r} {why} ({proj.name}). Train the adapters with a "
            "shared frozen v_proj lora_A (`python -m hf_kvshare.bench.train_roles --shared-lora-a`), or use "
            "prelrshared (one LR cache per agent)"
        )

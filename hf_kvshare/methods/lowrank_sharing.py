"""The PReCache family of methods: agents that differ by LoRA adapter share one trajectory cache.

Every turn's prompt is the shared trajectory so far plus the new instruction. The request keeps
one :class:`LowRankStore` (in ``session.method_state[method.name]``): a base K/V stored once and
each agent's rank-``r`` LR cache. As in the authors' code (PReCache, LRAgent) the LR caches hold
**values only** by default: keys are ``k_proj(x)`` of the pass that wrote each token, stored in the
base, and a LoRA on ``k_proj`` is refused; ``lr_keys=True`` is our extension beyond the reference
(per-agent key term ``rope(s B_k A_k x)``). A turn of agent ``a``:

1. **build**: the longest prefix of the prompt that the store holds (``shared``) is reused; agent
   ``a`` reads it as ``K_base``, ``V_base + s_a B_a A_a x`` (:class:`~hf_kvshare.lora.cache.BaseLRCache`)
   where its LR cache covers it (``own``), re-processes ``[own, shared)`` with its adapter to
   build its LR part there (the base stays shared), and prefills the new tokens densely.
   Hooks on ``v_proj`` (and ``k_proj`` with ``lr_keys``) capture ``A x`` of every adapter, and the
   base layers' ``W x + b``, meanwhile.
2. **generate** with the agent's adapter; the hooks keep capturing the decoded tokens.
3. **record** (after the first token: E2E, not TTFT): the store is cut back to ``shared`` (a turn
   that diverges from the stored trajectory replaces its tail) and extended over the turn's new
   positions — the base from the agent's hidden states, or from adapter-free ones for
   ReBaseShared — and the LR caches of the agent and, with precomputation, of every agent.

The subclasses only set class flags (see ``hf_kvshare/methods/``): ``precompute`` (extend
every agent's LR cache when context is first processed), ``neutral`` (``None``, ``"lazy"``
or ``"double"``: where the base comes from and when it is built) and ``shared_lr`` (BaseLRShared:
one LR cache for all agents, whose adapters share ``lora_A``).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..agents import BASE_ROW
from ..cache import Segment, config_signature
from ..lora.adapters import LoraBank
from ..lora.cache import BaseLRCache
from ..lora.capture import KVCapture
from ..lora.neutral import FollowFirstRow, neutral_prefill
from ..lora.store import SHARED_LR, LowRankStore
from ..lora.view import AbsoluteRope, LowRankView, split_heads
from ..method import Method
from ..prefill import model_input_device, prefill_dense

if TYPE_CHECKING:
    from ..session import Session
    from ..turn import Turn

OWN_LR_SOURCES = ("adapted", "neutral")


@dataclass
class _TurnState:
    capture: KVCapture
    bank: LoraBank
    rope: AbsoluteRope
    shared: int  # prompt positions [0, shared) held by the store
    own: int  # of which [0, own) are covered by the agent's LR cache
    follow: FollowFirstRow | None = None  # double batching: keeps the adapter-free row on the agent's tokens


LayerChunks = tuple[list[torch.Tensor | None], list[torch.Tensor | None]]


@dataclass(eq=False)
class LowRankSharing(Method):
    """Base of ``baseshared``, ``baselrshared``, ``prelrshared``, ``rebaseshared-lp`` and ``rebaseshared-db``.

    Args:
        materialize: how a turn presents the agent's K/V of the shared prefix: ``"turn"`` (built
            once per turn, a full-size copy for the turn) or ``"lazy"`` (rebuilt per layer at each
            forward from the store; no copy kept, more compute per decoding step).
        own_lr: ReBaseShared only — where the current agent's LR cache over the turn's new tokens
            comes from: ``"adapted"`` (its own hidden states, as in the PReCache paper) or
            ``"neutral"`` (the adapter-free hidden states, like every other agent's).
        lr_keys: ``False`` (default, the reference code): value-only LR caches, keys from the shared
            base; adapters must have a LoRA on ``v_proj`` and none on ``k_proj`` (refused with a
            ``ValueError`` when the session is created). ``True``: **beyond the reference** — adapters
            may adapt ``k_proj`` (each agent's keys get ``rope(s B_k A_k x)`` over the shared base keys,
            the LR caches hold keys and values) or leave ``v_proj`` alone (rank-0 value cache).

    The session must run on a ``peft.PeftModel`` in eval mode whose adapters are the agents.
    """

    uses_sources = False  # the store replaces per-slot sources
    supports_batch = False
    requires_adapters = True
    visual_segments = False  # its build prefills the prompt's token ids (no image features)
    #: extend every agent's LR cache when new context is first processed (PreLRShared, ReBaseShared)
    precompute: ClassVar[bool] = True
    #: where the shared base comes from: the agent's hidden states (None) or adapter-free ones,
    #: built after the turn ("lazy") or alongside it in a batch of two ("double")
    neutral: ClassVar[str | None] = None
    #: one LR cache (store entry ``SHARED_LR``) extended by every agent and read by all (BaseLRShared)
    shared_lr: ClassVar[bool] = False

    materialize: str = "turn"
    own_lr: str = "adapted"
    lr_keys: bool = False

    def __post_init__(self) -> None:
        if self.materialize not in BaseLRCache.MATERIALIZE:
            raise ValueError(
                f"materialize must be one of {BaseLRCache.MATERIALIZE}; got {self.materialize!r}"
            )
        if self.own_lr not in OWN_LR_SOURCES:
            raise ValueError(f"own_lr must be one of {OWN_LR_SOURCES}; got {self.own_lr!r}")
        if self.own_lr != "adapted" and self.neutral is None:
            raise ValueError(
                f"own_lr applies to rebaseshared only; {self.name} has no adapter-free path "
                f"(own_lr must be 'adapted'; got {self.own_lr!r})"
            )
        if not isinstance(self.lr_keys, bool):
            raise ValueError(f"lr_keys must be True or False; got {self.lr_keys!r}")

    def legacy_options(self, meta: dict[str, Any]) -> dict[str, Any]:
        # states saved before these methods recorded their options are empty (the methods keep no
        # state across requests): nothing options could change, so any instance takes them
        return self.state_options()

    def attach(self, model: torch.nn.Module) -> None:
        # clear errors (k_proj/v_proj rule, and with lr_keys the k/v-coverage warning) at session creation
        self.check_bank(LoraBank(model, warn=True, lr_keys=self.lr_keys))
        AbsoluteRope(model)

    def bank(self, model: torch.nn.Module) -> LoraBank:
        """The model's :class:`LoraBank` under this method's rules (raises ``ValueError``)."""
        bank = LoraBank(model, lr_keys=self.lr_keys)
        self.check_bank(bank)
        return bank

    def check_bank(self, bank: LoraBank) -> None:
        """Method-specific checks of the adapters (BaseLRShared: one shared ``lora_A``)."""

    # ------------------------------------------------------------------ state
    def store(self, session: Session) -> LowRankStore:
        """The request's store (an empty one before the first recorded turn; not registered until then)."""
        store = session.method_state.get(self.name)
        if store is None:
            store = LowRankStore(num_layers=config_signature(session.model.config)[0])
        return store

    def session_memory(self, session: Session) -> dict[str, Any]:
        """Exact bytes the request holds: base once + each agent's LR cache."""
        return self.store(session).memory()

    def request_state_bytes(self, session: Session) -> int:
        return self.store(session).nbytes

    # ------------------------------------------------------------------ building
    def build(self, turn: Turn) -> BaseLRCache:
        model = turn.model
        if model.training:
            raise ValueError(
                f"{self.name} needs the model in eval mode (LoRA dropout would make A x differ from what "
                "attention saw); call model.eval()"
            )
        bank = self.bank(model)
        bank.check_agent(turn.agent)
        if self.neutral == "double":
            bank.check_mixed_batch(turn.agent)
        rope = AbsoluteRope(model)
        store = self.store(turn.request)
        P = turn.prompt_length
        ids = turn.prompt_ids
        shared = store.common_prefix(ids[: P - 1])
        owner = SHARED_LR if self.shared_lr else turn.agent
        own = shared if bank.lr_width(turn.agent) == 0 else min(store.coverage(owner), shared)
        rows = [turn.agent, None] if self.neutral == "double" else [turn.agent]
        turn.batch_size = len(rows)
        capture = KVCapture(bank, base=self.neutral is None)
        view = LowRankView(
            store, bank, rope, rows, own, shared, capture, SHARED_LR if self.shared_lr else None
        )
        cache = BaseLRCache(model.config, view, materialize=self.materialize)

        info = {"base": "neutral" if self.neutral else "shared", "lr": turn.agent}
        reused = _segments(turn, 0, own, "reused", info)
        cache.segments.extend(reused)
        turn.stats.ph_reused += sum(s.length for s in reused if s.kind == "PH")
        dense = _segments(turn, own, shared, "recomputed", {**info, "lr": f"{turn.agent} (re-processed)"})
        dense += _segments(turn, shared, P - 1, "dense", {})
        if own < P - 1:
            with capture:
                prefill_dense(cache, model, turn.batch(ids[own : P - 1]), dense, **self.forward_kwargs(turn))
            turn.stats.tokens_prefilled += P - 1 - own
        turn.scratch["precache"] = _TurnState(capture=capture, bank=bank, rope=rope, shared=shared, own=own)
        return cache

    # ------------------------------------------------------------------ generation
    def generation_context(self, turn: Turn) -> contextlib.AbstractContextManager:
        state = turn.scratch.get("precache")
        return state.capture if state is not None else contextlib.nullcontext()

    def forward_kwargs(self, turn: Turn) -> dict[str, Any]:
        if self.neutral == "double":
            return {"adapter_names": [turn.agent, BASE_ROW]}
        return {}

    def generate_kwargs(self, turn: Turn) -> dict[str, Any]:
        state = turn.scratch.get("precache")
        if self.neutral == "double" and state is not None:
            state.follow = FollowFirstRow()
            return {"logits_processor": [state.follow]}
        return {}

    # ------------------------------------------------------------------ recording
    def record(self, turn: Turn, cache: BaseLRCache) -> None:
        state: _TurnState = turn.scratch.pop("precache")
        if turn.keep_cache and self.neutral is not None:  # kept for later reading; the base is rebuilt below
            cache.freeze()
        state.capture.detach()
        model, bank, capture = turn.model, state.bank, state.capture
        shared, own = state.shared, state.own
        cached = cache.get_seq_length()
        if capture.tokens != cached - own:
            raise RuntimeError(
                f"{self.name}: the turn's cache holds {cached} positions and its hooks captured {capture.tokens} "
                f"from position {own}; expected {cached - own}"
            )
        output = turn.slot(turn.output_slot).token_ids
        fed = torch.cat([turn.prompt_ids, output])
        # generate never feeds its last token; padding fed after an early EOS is not trajectory
        end = min(cached, fed.numel())
        new_ids = fed[shared:end]
        store = self.store(turn.request)

        # the base over the new positions, and where the other agents' LR caches come from
        if self.neutral is None:
            keys, values = self._base_from_capture(state, shared, end)
            source, source_row, source_offset = capture, 0, shared - own
        elif self.neutral == "lazy" or (state.follow is not None and state.follow.diverged_at is not None):
            if self.neutral == "double":
                warnings.warn(
                    f"{self.name}: the adapter-free row left the agent's tokens at position "
                    f"{state.follow.diverged_at} (sampling?); rebuilt the neutral base with a lazy prefill instead. "
                    "Double batching needs greedy decoding to save that prefill",
                    UserWarning,
                    stacklevel=2,
                )
            keys, values, source = neutral_prefill(
                model,
                store,
                bank,
                state.rope,
                new_ids.to(model_input_device(model)),
                shared,
                self.materialize,
            )
            source_row, source_offset = 0, 0
        else:  # double batching: row 1 is the adapter-free path
            keys, values = [], []
            for layer in range(bank.num_layers):
                k, v = cache.kv_range(layer, shared, end)
                keys.append(k[1:2])
                values.append(v[1:2])
            source, source_row, source_offset = capture, 1, shared - own

        coverage = {a: min(store.coverage(a), shared) for a in bank.adapters}
        updates: dict[str, tuple[int, LayerChunks]] = {}
        agent = turn.agent
        if self.shared_lr:  # A_shared x of the agent's hidden states: everyone's LR cache
            if bank.lr_width(agent) > 0:
                updates[SHARED_LR] = (own, _lr_chunks(bank, capture, agent, 0, 0, end - own))
        elif self.neutral is not None and self.own_lr == "neutral":
            before = _lr_chunks(bank, capture, agent, 0, 0, shared - own)
            after = _lr_chunks(bank, source, agent, source_row, source_offset, end - shared)
            updates[agent] = (own, _join(before, after))
        else:
            updates[agent] = (own, _lr_chunks(bank, capture, agent, 0, 0, end - own))
        if self.precompute and not self.shared_lr:
            for other in bank.adapters:
                if other != agent and coverage[other] == shared:
                    updates[other] = (
                        shared,
                        _lr_chunks(bank, source, other, source_row, source_offset, end - shared),
                    )

        store.truncate(shared)
        store.append_base(new_ids.cpu(), keys, values)
        for name, (start, (lr_keys, lr_values)) in updates.items():
            store.append_lr(name, start, end, lr_keys, lr_values)
        turn.set_request_state(self.name, store)

    def _base_from_capture(self, state: _TurnState, start: int, end: int) -> tuple[list, list]:
        """``rope(W x + b)`` and ``W x + b`` of positions ``[start, end)`` from the agent's own forward."""
        offset = start - state.own
        keys, values = [], []
        cos = sin = None
        for layer in range(state.bank.num_layers):
            k = split_heads(
                state.capture.base(layer, "key")[:1, offset : offset + end - start], state.bank.head_dim
            )
            v = split_heads(
                state.capture.base(layer, "value")[:1, offset : offset + end - start], state.bank.head_dim
            )
            if cos is None:
                cos, sin = state.rope.cos_sin(start, end, k.dtype, k.device)
            keys.append(state.rope.apply(k, cos, sin))
            values.append(v)
        return keys, values


def _segments(turn: Turn, start: int, end: int, provenance: str, info: dict[str, Any]) -> list[Segment]:
    """Segment-table rows for positions ``[start, end)`` of the prompt, split at span boundaries."""
    rows = []
    for span in turn.spans:
        lo, hi = max(start, span.start), min(end, span.end)
        if lo < hi:
            segment = turn.segment_for(span, provenance, info=info)
            segment.start, segment.end = lo, hi
            rows.append(segment)
    return rows


def _lr_chunks(
    bank: LoraBank, capture: KVCapture, agent: str, row: int, offset: int, length: int
) -> LayerChunks:
    """Per-layer ``A_a x`` ``[1, length, r]`` for positions ``offset .. offset + length - 1`` of a capture row."""
    keys: list[torch.Tensor | None] = []
    values: list[torch.Tensor | None] = []
    for layer in range(bank.num_layers):
        for kind, out in (("key", keys), ("value", values)):
            ax = capture.adapter_down(layer, kind, agent, row)
            out.append(None if ax is None else ax[:, offset : offset + length])
    return keys, values


def _join(a: LayerChunks, b: LayerChunks) -> LayerChunks:
    def cat(x, y):
        return None if x is None else torch.cat([x, y], dim=1)

    return [cat(x, y) for x, y in zip(a[0], b[0])], [cat(x, y) for x, y in zip(a[1], b[1])]

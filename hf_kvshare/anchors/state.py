"""What correction methods keep besides their pools: the model they are bound to, and per-request
state (references, producer caches, gate decisions, token weights, slot versions) that lives as
long as the request's Session; and the reference prefill of a given text (KVComm)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import SegmentedCache, SegmentKV
from ..identity import ModelBinding  # noqa: F401  (re-exported)
from ..prefill import input_embeds, prefill_dense
from .gate import GateDecision
from .pool import REFERENCE


@dataclass
class RequestState:
    """Per-request (per-Session) state of a correction method."""

    uid: int
    #: slot -> the slot's K/V prefilled with nothing before it (positions 0 ..)
    references: dict[str, SegmentKV] = field(default_factory=dict)
    #: slot -> how many turns have replaced the slot's latest materialized cache
    versions: dict[str, int] = field(default_factory=dict)
    #: slot -> its first materialization: an output's producer cache, a given text's first consumer's
    produced: dict[str, SegmentKV] = field(default_factory=dict)
    #: slot -> the gate's decision, taken once per (slot, request) and obeyed by every consumer
    decisions: dict[str, GateDecision] = field(default_factory=dict)
    #: slot -> (anchors the gate compared, their distances or None) for the segment reports
    gate_reports: dict[str, tuple[int, list[float] | None]] = field(default_factory=dict)
    #: (slot, anchors, rows) -> token-wise (key, value) weights, computed once and reused by later consumers
    weights: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: (slot, pool, reader frame) -> (a weak reference to the source compared, {anchor serial: (its
    #: base, key distances [rows], value distances [rows])}): each anchor's token distances from a
    #: source computed once per request, whichever anchor set a consumer's weights take
    #: (``weights_cache``); the source is not kept alive by this (the session drops it when no turn reads it)
    distances: dict[Any, tuple[Any, dict[int, tuple[Any, torch.Tensor, torch.Tensor]]]] = field(
        default_factory=dict
    )
    #: weak references to the anchor bases this request stored deferred (a chained question's): the
    #: ones still deferred and still held are factorized when the request ends (its session is freed)
    deferred: list[weakref.ref] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        held = [*self.references.values(), *self.produced.values()]
        return sum(r.nbytes for r in {id(r): r for r in held}.values())


class RequestStates:
    """``Session -> RequestState``, dropped when the session is garbage-collected."""

    def __init__(self, next_uid: int = 0):
        self._states: weakref.WeakKeyDictionary[Any, RequestState] = weakref.WeakKeyDictionary()
        #: the uid the next request gets (anchor origins and profiles name requests by uid: saved
        #: state carries it so that a restored instance never reuses one)
        self.next_uid = next_uid

    def get(self, session: Any) -> RequestState:
        state = self._states.get(session)
        if state is None:
            state = self._states[session] = RequestState(uid=self.next_uid)
            self.next_uid += 1
            # the request's deferred bases are factorized when it ends: off every turn's critical path,
            # and a base no later request reads does not keep its source's cache alive in the pool
            done = weakref.finalize(session, settle_deferred, state.deferred)
            done.atexit = False  # at interpreter exit no one reads them
        return state

    def find(self, session: Any) -> RequestState | None:
        """``session``'s state, ``None`` when it has none (read only: nothing is created)."""
        return self._states.get(session)

    def nbytes(self, session: Any) -> int:
        """Bytes of ``session``'s state (references, producer caches the session no longer holds as a
        slot's latest); 0 when it has none."""
        state = self._states.get(session)
        if state is None:
            return 0
        latest = {id(slot.latest) for slot in getattr(session, "slots", {}).values()}
        held = [*state.references.values(), *state.produced.values()]
        return sum(r.nbytes for r in {id(r): r for r in held if id(r) not in latest}.values())

    def __len__(self) -> int:
        return len(self._states)

    def clear(self) -> None:
        self._states = weakref.WeakKeyDictionary()


def settle_deferred(deferred: list[weakref.ref]) -> None:
    """Factorize the deferred bases (:class:`~.lowrank.DeferredFactoredKV`) still held and unresolved."""
    for ref in deferred:
        base = ref()
        if base is not None and not base.resolved:
            base.resolve()
    deferred.clear()


def context_free_reference(
    model: torch.nn.Module, token_ids: torch.Tensor, embeds: torch.Tensor | None = None, rope: Any = None
) -> SegmentKV:
    """Prefill ``token_ids`` ``[S]`` alone at positions ``0 .. S-1`` and return its K/V (batch 1).

    This is the reference KVComm, GraphFlow and non-chained KVCMAS correct from; it is a prefill
    outside the agent workflow. ``embeds`` ``[1, S, hidden]``: the segment's own input embeddings (an
    image's features, ``Slot.visual``), fed instead of its ids; ``rope``: its multimodal-RoPE layout
    (``Visual.rope``) on such a model.
    """
    token_ids = torch.as_tensor(token_ids).flatten()
    if token_ids.numel() == 0:
        raise ValueError("cannot build a reference for an empty segment")
    cache = SegmentedCache(model.config)
    layout = None if rope is None else [(0, rope)]
    prefill_dense(cache, model, token_ids[None], inputs_embeds=embeds, rope=layout)
    with cache.sharing_storage():  # the reference is the whole cache: its layers, not a copy
        return cache.extract(0, token_ids.numel(), agent=REFERENCE)


def reference_prefill(
    model: torch.nn.Module,
    lead_ids: torch.Tensor,
    token_ids: torch.Tensor,
    embeds: torch.Tensor | None = None,
    rope: Any = None,
) -> SegmentKV:
    """Prefill ``lead_ids + token_ids`` and return the K/V of ``token_ids`` only (batch 1, ``start =
    len(lead_ids)``): the leading context is kept during the prefill, then dropped (KVComm's
    reference, so the segment's first token is not an attention sink). Empty ``lead_ids`` is
    :func:`context_free_reference`. ``embeds``: the segment's own input embeddings (as there)."""
    lead_ids = torch.as_tensor(lead_ids, dtype=torch.long).flatten()
    token_ids = torch.as_tensor(token_ids).flatten()
    if token_ids.numel() == 0:
        raise ValueError("cannot build a reference for an empty segment")
    lead = lead_ids.numel()
    cache = SegmentedCache(model.config)
    inputs = input_embeds(model, [(lead_ids, None), (token_ids, embeds)])
    prefill_dense(
        cache,
        model,
        torch.cat([lead_ids.to(token_ids.device), token_ids])[None],
        inputs_embeds=inputs,
        rope=None if rope is None else [(lead, rope)],
    )
    with cache.sharing_storage():  # views: the dropped lead keeps its few rows alive, no copy is made
        return cache.extract(lead, lead + token_ids.numel(), agent=REFERENCE)


def chat_markers(tokenizer: Any) -> tuple[str, str, str]:
    """``(begin, start, end)`` chat markers as the KVComm reference code reads them from a tokenizer
    (``_extract_chat_markers``): ``begin`` = the first of ``<|begin_of_text|>``, ``<s>``, the BOS
    token found in the chat template (else the BOS token, else ``""``); ``start`` = the first of
    ``<|start_header_id|>``, ``<|im_start|>`` in the template (else ``""``); ``end`` = the first of
    ``<|end_header_id|>``, ``<|im_end|>``, ``"\\n"`` in the template (else ``""``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = str(template)
    bos = getattr(tokenizer, "bos_token", None) or ""
    begin = next((m for m in ("<|begin_of_text|>", "<s>", bos) if m and m in template), bos)
    start = next((m for m in ("<|start_header_id|>", "<|im_start|>") if m in template), "")
    end = next((m for m in ("<|end_header_id|>", "<|im_end|>", "\n") if m in template), "")
    return begin, start, end


def reference_lead(tokenizer: Any, lead_in: str = "") -> str:
    """The text KVComm prefills before a given text: ``begin + start + "user" + end + "\\n" + lead_in``."""
    begin, start, end = chat_markers(tokenizer)
    return f"{begin}{start}user{end}\n{lead_in}"

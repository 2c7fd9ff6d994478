"""What a method sees and returns for one agent turn.

:class:`Turn` is everything a method reads while building one agent's cache (the tokenized
trajectory, the session's slots, a per-turn scratch space); :class:`Slot` is a PH slot of a
session; :class:`TurnResult` is what :meth:`~hf_kvshare.session.Session.run_turn` returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from . import reasons
from .cache import CachePart, Segment, SegmentKV, SharedCache
from .measure import PHASES
from .trajectory import PH

if TYPE_CHECKING:
    from .method import Placement
    from .rope import RopeShifter
    from .trajectory import Span

T = TypeVar("T")


@dataclass
class Slot:
    """A PH slot of a session: fixed token ids, and the latest materialized cache of them."""

    name: str
    token_ids: torch.Tensor
    text: str
    producer: str | None = None  # agent whose output this is (None for given text)
    #: given text: ``"question"`` or ``"observation"`` (:func:`given_text_slot`); ``None`` for outputs
    kind: str | None = None
    latest: SegmentKV | None = None  # K/V of the slot from the latest turn that read/wrote it
    #: method-specific state kept with ``latest`` (e.g. the hidden states selective recomputation
    #: restarts from), keyed by a name the method owns
    extras: dict[str, Any] = field(default_factory=dict)
    #: an image or video slot: its processed pixels and, once encoded, its projected features
    #: (:class:`hf_kvshare.vision.Visual`); ``None`` for text
    visual: Any = None
    #: a piece of another slot (:meth:`hf_kvshare.request.Request.piece_slot`): ``(slot, start, end)``,
    #: its tokens ``[start, end)``; ``None`` for a slot of its own
    piece_of: tuple[str, int, int] | None = None


@dataclass
class TurnStats:
    tokens_prefilled: int = 0  # prompt tokens run through the model for this agent
    ph_tokens: int = 0  # PH tokens in the prompt
    ph_reused: float = 0  # PH tokens whose K/V was not computed for this agent (token-equivalents)
    pf_reused: int = 0  # PF tokens re-used from this agent's earlier turn (prefix reuse), not computed
    ph_corrected: float = 0  # of ph_reused: served through an accepted delta correction
    ph_recomputed: float = 0  # PH token-equivalents of placed spans recomputed (selective recomputation)

    def count(self, span: Span, placement: Placement | None) -> None:
        """Count the reuse of ``span`` placed by ``placement`` (``None``: computed, nothing to count):
        PH tokens as the placement reports them (token-equivalents: reused, of which corrected, and the
        rest of the span recomputed), PF tokens all. The walk (:meth:`hf_kvshare.walk.Walk.place`) calls
        it for every span."""
        if placement is None:
            return
        if span.kind == "PH":
            reused = span.length if placement.reused_tokens is None else placement.reused_tokens
            corrected = placement.corrected_tokens
            if corrected is None:
                corrected = reused if placement.provenance == "corrected" else 0
            self.ph_reused += reused
            self.ph_corrected += min(corrected, reused)
            self.ph_recomputed += span.length - reused
        else:
            self.pf_reused += span.length


@dataclass
class TurnResult:
    """What a turn returns. Times in seconds, memory in bytes."""

    agent: str
    method: str
    output_slot: str
    text: str
    output_ids: torch.Tensor
    prompt_ids: torch.Tensor
    ttft_s: float
    e2e_s: float
    tokens_prefilled: int
    tokens_reused: float  # token-equivalents: layer-wise methods reuse fractions of tokens
    ph_tokens: int
    peak_memory_bytes: int
    segments: list[Segment]
    #: PF tokens placed from the agent's earlier turn (prefix reuse), not computed; not part of rho
    prefix_reused: int = 0
    #: the split of the shared (PH) tokens: of ``tokens_reused``, those served through an accepted
    #: delta correction; the PH token-equivalents recomputed in placed spans; the rest is prefilled
    tokens_corrected: float = 0
    tokens_recomputed: float = 0
    #: the method is a correction method (``Method.corrects``): see :attr:`paper_reuse_ratio`
    corrects: bool = False
    #: seconds after the first token, by phase (:data:`hf_kvshare.measure.PHASES`: decode, record, gate,
    #: factorize, anchor_store, bookkeeping); they add up to ``e2e_s - ttft_s``
    phases: dict[str, float] = field(default_factory=dict)
    #: peak torch tensor bytes of the turn (what the session and method held at its start + the
    #: profiler's peak of allocations during it), when the session measured it (``tensor_memory``)
    tensor_peak_bytes: int | None = None
    logits: torch.Tensor | None = None  # [T, vocab] when the output was teacher-forced
    cache: SharedCache | None = None  # when run with keep_cache=True

    @property
    def reuse_ratio(self) -> float:
        """rho: the fraction of this turn's PH tokens whose K/V was reused rather than computed."""
        return self.tokens_reused / self.ph_tokens if self.ph_tokens else 0.0

    @property
    def tokens_reused_uncorrected(self) -> float:
        """PH tokens reused as their source was (re-positioned only), no correction applied."""
        return self.tokens_reused - self.tokens_corrected

    @property
    def ph_prefilled(self) -> float:
        """PH tokens computed densely for this agent (corrected + reused uncorrected + recomputed +
        prefilled = ``ph_tokens``)."""
        return self.ph_tokens - self.tokens_reused - self.tokens_recomputed

    @property
    def paper_reuse_ratio(self) -> float:
        """rho as the KVCMAS paper defines it (4.1): the fraction of the shared cache "excluded from
        selective recomputation or served through accepted delta correction": for a correction method
        its corrected tokens only (an uncorrected reuse is neither), for any other its reused ones."""
        served = self.tokens_corrected if self.corrects else self.tokens_reused
        return served / self.ph_tokens if self.ph_tokens else 0.0

    def not_shared(self) -> dict[str, dict[str, Any]]:
        """Why the prefilled PH tokens were not shared: ``{cause: {"tokens", "spans", "detail"}}``, the
        causes of :data:`hf_kvshare.reasons.CAUSES`, most tokens first; the tokens add up to
        :attr:`ph_prefilled` (:func:`hf_kvshare.reasons.turn_causes`)."""
        return dict(reasons.top(reasons.turn_causes(self)))

    def accounting(self) -> dict[str, Any]:
        """The split of the shared tokens, both rhos, and ``not_shared``: the prefilled PH tokens per
        cause (``{cause: tokens}``, most first; :meth:`not_shared` has the details). Every turn record
        carries it."""
        return {
            "tokens_corrected": self.tokens_corrected,
            "tokens_reused_uncorrected": self.tokens_reused_uncorrected,
            "tokens_recomputed": self.tokens_recomputed,
            "ph_prefilled": self.ph_prefilled,
            "paper_reuse_ratio": self.paper_reuse_ratio,
            "not_shared": {name: row["tokens"] for name, row in self.not_shared().items()},
        }

    def metrics(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "method": self.method,
            "prompt_tokens": int(self.prompt_ids.numel()),
            "output_tokens": int(self.output_ids.numel()),
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "tokens_prefilled": self.tokens_prefilled,
            "tokens_reused": self.tokens_reused,
            "ph_tokens": self.ph_tokens,
            "reuse_ratio": self.reuse_ratio,
            "prefix_reused": self.prefix_reused,
            **self.accounting(),
            "corrects": self.corrects,
            "peak_memory_bytes": self.peak_memory_bytes,
            "tensor_peak_bytes": self.tensor_peak_bytes,
            **{f"{name}_s": self.phases.get(name, 0.0) for name in PHASES},
        }


def output_with_tokens(slots: Mapping[str, Slot], token_ids: torch.Tensor) -> Slot | None:
    """The output slot of ``slots`` whose token ids equal ``token_ids`` (the most recently produced
    one when several do), or ``None``: an earlier agent's reply handed on as text."""
    ids = token_ids.flatten().cpu()
    found = None
    for slot in slots.values():
        if (
            slot.producer is not None
            and slot.token_ids.numel() == ids.numel()
            and torch.equal(slot.token_ids, ids)
        ):
            found = slot
    return found


def given_text_slot(spec: PH, token_ids: torch.Tensor, slots: Mapping[str, Slot]) -> Slot:
    """What a PH with text the request does not hold yet becomes, given the request's ``slots`` (in
    the order they appeared, this turn's new ones last). The one rule every host applies (the
    :class:`~hf_kvshare.session.Session`, a serving host building its own Turns):

    1. ``spec.kind is None`` and ``token_ids`` equal an output already produced in the request
       (:func:`output_with_tokens`): that output's slot is returned: the PH *is* the output (the
       host reads it under the output's name: its producer's cache, gate decision and pools). One
       token different: given text.
    2. otherwise a new given-text :class:`Slot` of ``spec.kind``, by default ``"question"`` when the
       request holds no given text yet (images and videos aside) and ``"observation"`` after.

    A second question in one request is refused (``ValueError``), nothing changed."""
    if spec.kind is None:
        output = output_with_tokens(slots, token_ids)
        if output is not None:
            return output
    given = [s for s in slots.values() if s.producer is None]
    # an image / video (kind stated by hf_kvshare.vision) does not make later text an observation
    kind = spec.kind or ("observation" if any(s.visual is None for s in given) else "question")
    if kind == "question":
        question = next((s for s in given if s.kind == "question"), None)
        if question is not None:
            raise ValueError(
                f"PH slot {spec.slot!r} is stated as the request's question, but slot {question.name!r} "
                f"already is (a request has one question; state kind='observation' for other given text)"
            )
    return Slot(name=spec.slot, token_ids=token_ids, text=spec.text, kind=kind)


def check_slot_kind(spec: PH, slot: Slot) -> None:
    """A PH that states a kind must agree with the slot it names (outputs have none)."""
    if spec.kind is None or spec.kind == slot.kind:
        return
    what = f"the output of {slot.producer!r}" if slot.producer is not None else f"a {slot.kind}"
    raise ValueError(
        f"PH slot {spec.slot!r} is stated as kind={spec.kind!r}, but the request holds it as {what}"
    )


class TurnHost(Protocol):
    """What runs turns and holds one request's state: a :class:`~hf_kvshare.request.Request` (the
    :class:`~hf_kvshare.session.Session`, HF ``generate``; a served task). Methods and engines never
    read it directly: they use the :class:`Turn`'s read API (``turn.slot``, ``turn.request_state``, ...)."""

    model: torch.nn.Module
    tokenizer: Any
    slots: dict[str, Slot]
    #: per-request state a method keeps between turns, keyed by a name the method owns
    method_state: dict[str, Any]

    @property
    def shifter(self) -> RopeShifter: ...

    @property
    def device(self) -> torch.device: ...


@dataclass
class Turn:
    """Everything a method sees while building one agent's cache.

    The request's state is read through this object only: :meth:`slot` / :attr:`slots` (the PH slots:
    token ids, producer, latest K/V), :meth:`request_state` (what a method keeps for the request),
    :attr:`request` (the key per-request engine state is kept under), :attr:`model`, :attr:`tokenizer`,
    :attr:`device`, :attr:`shifter`."""

    host: TurnHost
    agent: str
    spans: list[Span]
    output_slot: str
    #: rows the session feeds; row 0 is the agent's. A method may widen it in ``build`` (double
    #: batching adds an adapter-free row), together with ``forward_kwargs`` (``adapter_names``).
    batch_size: int = 1
    stats: TurnStats = field(default_factory=TurnStats)
    #: per-turn working state of the method, from build to record (e.g. the sources it used,
    #: which the session replaces in ``slot.latest`` before ``method.record`` runs)
    scratch: dict[str, Any] = field(default_factory=dict)
    #: the caller keeps the built cache (``run_turn(keep_cache=True)``): a method whose cache reads
    #: shared state lazily must leave it reading what this turn saw (a fact of the request a method
    #: reads, not a setting of the executor)
    keep_cache: bool = False
    #: what runs this turn's model work: the HF executor (:class:`hf_kvshare.executor.HFExecutor`, set
    #: by it before it asks ``method.build(turn)``); ``None`` on a served turn (the engine computes it)
    executor: Any = None

    @property
    def generate_tail(self) -> bool:
        """Deprecated: the HF executor's :attr:`~hf_kvshare.executor.HFExecutor.leave_tail`."""
        warnings.warn(
            "Turn.generate_tail is deprecated: use turn.executor.leave_tail (hf_kvshare.executor.HFExecutor)",
            DeprecationWarning,
            stacklevel=2,
        )
        return bool(getattr(self.executor, "leave_tail", False))

    @property
    def tail_segments(self) -> list:
        """Deprecated: the HF executor's :attr:`~hf_kvshare.executor.HFExecutor.tail_segments`."""
        warnings.warn(
            "Turn.tail_segments is deprecated: use turn.executor.tail_segments (hf_kvshare.executor.HFExecutor)",
            DeprecationWarning,
            stacklevel=2,
        )
        return list(getattr(self.executor, "tail_segments", []))

    @property
    def model(self) -> torch.nn.Module:
        return self.host.model

    @property
    def shifter(self) -> RopeShifter:
        return self.host.shifter

    @property
    def tokenizer(self) -> Any:
        return self.host.tokenizer

    @property
    def device(self) -> torch.device:
        """Where input ids go (the input embeddings' device)."""
        return self.host.device

    @property
    def request(self) -> TurnHost:
        """The request this turn belongs to: the key (weakly referenced) that per-request engine
        state is kept under; one object per request for the request's whole life."""
        return self.host

    @property
    def slots(self) -> Mapping[str, Slot]:
        """The request's PH slots by name (read-only mapping)."""
        return MappingProxyType(self.host.slots)

    def slot(self, name: str) -> Slot:
        """The request's PH slot ``name`` (``KeyError`` naming the known slots when it has none)."""
        try:
            return self.host.slots[name]
        except KeyError:
            raise KeyError(f"no PH slot {name!r} in this request; slots: {sorted(self.host.slots)}") from None

    def request_state(self, key: str, default: Callable[[], T]) -> T:
        """The per-request state a method keeps under ``key`` (created by ``default()`` on first use)."""
        state = self.host.method_state.get(key)
        if state is None:
            state = self.host.method_state[key] = default()
        return state

    def set_request_state(self, key: str, value: Any) -> None:
        """Replace the per-request state a method keeps under ``key``."""
        self.host.method_state[key] = value

    @property
    def prompt_ids(self) -> torch.Tensor:
        return torch.cat([s.token_ids for s in self.spans])

    @property
    def prompt_length(self) -> int:
        return self.spans[-1].end

    def batch(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` ids as a ``[batch, n]`` model input."""
        return ids[None].expand(self.batch_size, -1)

    def new_cache(self) -> SharedCache:
        return SharedCache(self.model.config)

    def segment_for(self, span: Span, provenance: str, source_agent: str | None = None, info=None) -> Segment:
        return Segment(
            name=span.name,
            kind=span.kind,
            start=span.start,
            end=span.end,
            provenance=provenance,
            source_agent=source_agent
            if source_agent is not None
            else (self.agent if provenance == "dense" else None),
            info=dict(info or {}),
        )

    def _dense_info(self, span: Span) -> dict[str, Any]:
        """A dense PH span's one fact for its cause (:func:`hf_kvshare.reasons.cause`): whether the
        request held a cache of its slot when the span was built (``slot_cached``)."""
        slot = self.host.slots.get(span.name) if span.kind == "PH" else None
        return {} if slot is None else {"slot_cached": slot.latest is not None}

    def part(self, span: Span, placement: Placement | None) -> CachePart:
        """The cache part of ``span``: its placed K/V (checked finite, widened to the turn's batch), or
        its tokens to compute (``placement=None``: dense). Counts nothing (:meth:`TurnStats.count`)."""
        if placement is None:
            embeds = None if span.visual is None else span.visual.embeds(self.model, self.batch_size)
            return CachePart(
                self.segment_for(span, "dense", info=self._dense_info(span)),
                token_ids=self.batch(span.token_ids),
                embeds=embeds,
                rope=span_rope(span),
            )
        kv = placement.kv
        kv.check_finite(
            f"{'PH slot' if span.kind == 'PH' else 'PF segment'} {span.name!r} ({placement.provenance} from {placement.source_agent or 'its source'})"
        )
        if self.batch_size > 1 and kv.keys[0].shape[0] == 1:
            kv = SegmentKV(
                keys=[k.expand(self.batch_size, -1, -1, -1) for k in kv.keys],
                values=[v.expand(self.batch_size, -1, -1, -1) for v in kv.values],
                start=kv.start,
                agent=kv.agent,
                rope=kv.rope,
            )
        segment = self.segment_for(span, placement.provenance, placement.source_agent, placement.info)
        return CachePart(segment, kv=kv, rope=span_rope(span))


def span_rope(span: Span) -> Any:
    """An image / video span's multimodal-RoPE layout (``mrope.VisualRope``; ``None`` for text or a
    1D-RoPE model)."""
    return None if span.visual is None else getattr(span.visual, "rope", None)

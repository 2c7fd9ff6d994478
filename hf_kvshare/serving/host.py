"""The serving side of the ONE method contract: a :class:`~hf_kvshare.turn.TurnHost` per multi-agent
task, a :class:`~hf_kvshare.turn.Turn` per engine request, and the bounded store of captured K/V.

:class:`Sharing` drives a method inside an engine exactly as :class:`~hf_kvshare.session.Session`
drives it inside HF ``generate``: the same request bookkeeping (a :class:`ServingHost` is a
:class:`~hf_kvshare.request.Request`), the same walk over the method's hooks
(:class:`~hf_kvshare.walk.Walk`), with the engine's forward in place of the HF executor:
prepare -> walk -> claim -> record.

1. admission (:meth:`Sharing.plan`): the request's layout (:mod:`.layout`) becomes a ``Turn`` over
   the task's :class:`ServingHost` (prepare); ``method.plan(turn)``, then ``method.placeholder`` for
   each PH span and ``method.prefix`` for each PF span (the walk). The engine can take K/V for ONE
   contiguous range starting at its own prefix-cache hit, so the claim runs from that hit through the
   last position covered by consecutive placements (at most the prompt's last token but one); every
   other token is computed by the engine (a span placed after the first dense one is computed too,
   and recorded as dense). A rejected KVCMAS gate places nothing: no claim.
2. after the request ran (:meth:`Sharing.record`): the K/V the engine used (read back from its paged
   cache: injected and computed alike) fill ``method.new_cache(turn)`` with the turn's segment table
   (``append_kv``), ``method.finish``, the task records the output (``Request.record_output``: the
   agent's PH slot, each PH slot's materialized K/V its ``latest``), then ``method.record``, then the
   task releases what no later turn reads (``Request.release``).

No HF forward runs in serving: the "model" is a skeleton built on ``meta`` from the served model's
``config.json`` with only its rotary module materialized (:func:`skeleton_model`; enough for
``bind``, the config and RoPE re-positioning). Methods or options that need a forward (reference
prefills, selective recomputation, LoRA agents) are refused by :func:`check_serving_method`.

Memory is bounded: tasks are kept least recently used first, by bytes of the K/V their slots hold
(:class:`Sharing` ``max_bytes``) and by count (``max_tasks``); :meth:`Sharing.state_summary` reports
it with the method's own ``state_summary()``. Every other store has a byte budget of its own
(:data:`BUDGETS`): the agents' kept PF text (``max_prefix_bytes``), the anchor pools
(``max_anchor_bytes``) and the finished requests' read-back K/V waiting for their record
(``max_read_back_bytes``: :class:`ByteBudget`, reserved by the connector; a read-back past it is not
recorded, and counted); ``state_summary()["stores"]`` reports each one's bytes, budget and evictions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ..budgets import check_byte_budget
from ..cache import Segment, SegmentKV, SharedCache
from ..measure import Phases, timing
from ..method import Method, Placement, get_method
from ..request import NewSlots, Request
from ..rope import RopeShifter, find_rotary_module
from ..segment_kv import OTHER_RANK, is_stand_in
from ..trajectory import PF, PH, Span
from ..turn import Turn
from ..walk import Walk
from . import layout as lay
from .worker_store import corrected_origin

logger = logging.getLogger(__name__)

#: methods whose placements need no HF forward (and their refusals below)
SERVED = ("nonshared", "fullshared", "kvcmas", "kvcmas-nonchained", "kvcomm")
#: methods that read no K/V value where they are served (a placement is a slot's K/V as recorded, moved
#: by the worker): their records may hold stand-ins (:func:`~hf_kvshare.segment_kv.is_stand_in`) of
#: the K/V vLLM's worker keeps (:mod:`.worker_store`), so no read-back crosses to the scheduler
VALUE_FREE = ("nonshared", "fullshared")
DEFAULT_MAX_BYTES = 2 << 30
DEFAULT_MAX_TASKS = 1024
#: the anchor pools' bytes (KVCMAS / KVComm: ``max_pool_bytes``) unless ``max_anchor_bytes`` says
DEFAULT_MAX_ANCHOR_BYTES = 1 << 30
#: the read-back K/V of finished requests waiting for their record, together
DEFAULT_MAX_READ_BACK_BYTES = 2 << 30
#: every store's byte budget: a :class:`Sharing` keyword, a ``kv_connector_extra_config`` key, a
#: :class:`~hf_kvshare.serving.server.Server` argument and an ``hf-kvshare serve`` flag
#: (``--max-store-bytes`` for ``max_bytes``, ``--max-<store>-bytes`` for the others)
BUDGETS = ("max_bytes", "max_prefix_bytes", "max_anchor_bytes", "max_read_back_bytes")
#: slots one task keeps (the oldest that no request in flight reads are forgotten past it)
DEFAULT_MAX_TASK_SLOTS = 256


#: vision-language families served with their images shared (``config.model_type``): 1-D RoPE, so an
#: image's K/V re-positioned by its token offset is exact as in a Session (:mod:`hf_kvshare.vision`)
SERVED_VISION_MODELS = ("llava_onevision",)
_MROPE_REFUSAL = (
    "multimodal RoPE: vLLM rotates its K/V by (t, h, w) positions where an image advances the text's "
    "positions by its grid, not its token count, and the serving store re-positions by token offsets "
    "(the Session tracks each image's rope positions: hf_kvshare.mrope), so a segment after an image would "
    "be rotated by the wrong distance"
)
#: vision-language families refused, and why (the Python API's Session shares their images)
REFUSED_VISION_MODELS = MappingProxyType(
    {
        "qwen2_vl": _MROPE_REFUSAL,
        "qwen2_5_vl": _MROPE_REFUSAL,
        "idefics3": "tiled images (marker text tokens inside each image's span) are not built for serving yet",
        "smolvlm": "tiled images (marker text tokens inside each image's span) are not built for serving yet",
    }
)


class ServingError(ValueError):
    """A method, option or model the serving integration cannot run (a clear message, at start-up)."""


def check_serving_method(method: Method) -> None:
    """Refuse a method (or options) that would need an HF forward inside the engine."""
    name = method.name
    if getattr(method, "requires_adapters", False) or name in (
        "baseshared",
        "baselrshared",
        "prelrshared",
        "rebaseshared-lp",
        "rebaseshared-db",
    ):
        raise ServingError(f"method {name!r} runs LoRA agents (PEFT adapters); serving does not support it")
    if getattr(method, "verify_tokens", 0):
        raise ServingError(
            f"{name}: verify_tokens={method.verify_tokens} verifies each correction on a probe run through the "
            "model's layers; the scheduler cannot run the model (vLLM's worker computes the prompt); serve "
            f"{name}:verify_tokens=0"
        )
    if getattr(method, "reads_prefix", False) or name in ("cacheblend", "droidspeak", "relaycaching"):
        raise ServingError(
            f"method {name!r} recomputes tokens through the model's layers (an HF forward inside the "
            "engine); serving supports " + ", ".join(SERVED)
        )
    if name not in SERVED:
        raise ServingError(f"method {name!r} is not supported by serving; supported: {', '.join(SERVED)}")
    for knob, bad, use in (
        ("text_source", ("lead", "context_free"), "chained"),
        ("output_source", ("context_free",), "producer"),
        ("observation_source", ("lead", "context_free"), "question"),
    ):
        value = getattr(method, knob, None)
        if value in bad:
            raise ServingError(
                f"{name}: {knob}={value!r} needs a reference prefill (an HF forward outside the workflow), "
                f"which serving cannot run; use {name}:{knob}={use}"
            )


def serving_options(method: str, options: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The options serving runs ``method`` with, and a note for each it states for the user: where the
    method's *default* reads observations through a reference prefill (``observation_source="lead"``,
    kvcmas' and kvcomm's default: an HF forward outside the workflow), serving states
    ``observation_source="question"`` (observations read as the question: chained, ungated for
    KVCMAS) and says so; a user who states ``lead`` is refused by :func:`check_serving_method`.
    Where the method can leave its record's factorizations for later (``defer_factorization``: the same
    anchors, so no note), serving states it: the background thread runs them when no plan waits.
    Unknown methods / options raise ``ValueError`` as :func:`~hf_kvshare.method.get_method` does."""
    options = dict(options or {})
    instance = get_method(method, **options)
    notes = []
    if "observation_source" not in options and getattr(instance, "observation_source", None) in (
        "lead",
        "context_free",
    ):
        options["observation_source"] = "question"
        notes.append(
            f"{instance.name}: serving states observation_source=question (observations read as the question); "
            f"the default {instance.observation_source!r} prefills each observation outside the workflow "
            "(an HF forward), which serving cannot run"
        )
    if "defer_factorization" not in options and getattr(instance, "defer_factorization", None) is False:
        options["defer_factorization"] = True  # the same anchors; the factorizations off admission's way
    return options, notes


#: the server's secret, mixed into its method's salt (set by :class:`~hf_kvshare.serving.server.Server`
#: for the middleware's and the connector's processes): a client cannot compute the salt from the options
SALT_SECRET_ENV = "HF_KVSHARE_SALT_SECRET"


def salt(method: Method, secret: str | None = None) -> str | None:
    """The ``cache_salt`` of requests served by ``method``: injected approximate K/V enter vLLM's prefix
    cache under it, so they can never serve a request of another method or a plain one. ``nonshared``
    injects nothing: no salt (plain vLLM's prefix cache). ``secret``: the server's (none: the salt is
    computable from the method's options)."""
    if method.name == "nonshared":
        return None
    digest = hashlib.sha1((repr(method) + (secret or "")).encode()).hexdigest()[:16]  # vLLM allows 128 chars
    return f"hf_kvshare:{method.name}:{digest}"


def check_serving_vision(model_type: str) -> None:
    """A vision-language family serving cannot share images of is refused with its reason (images are
    spans identified by vLLM's multimodal hashes: :mod:`.layout`, "Images")."""
    if model_type in SERVED_VISION_MODELS:
        return
    from ..vision import UNSUPPORTED_VISION_MODELS

    why = REFUSED_VISION_MODELS.get(model_type) or UNSUPPORTED_VISION_MODELS.get(model_type)
    raise ServingError(
        f"{model_type}: a vision-language model serving does not share images of"
        + (f" ({why})" if why else " (not built for serving)")
        + f"; served vision-language families: {', '.join(SERVED_VISION_MODELS)}. Share this model's "
        "images with the Python API's Session: PH(slot, image=...)"
    )


def skeleton_model(model_dir: str | Path, **overrides: Any) -> torch.nn.Module:
    """The served model as an HF module on ``meta`` (no weights) with its rotary embedding built on CPU:
    what a method reads from ``turn.model`` (config, binding, RoPE frequencies) without a forward.
    ``overrides``: config attributes changed (a tensor-parallel rank's ``num_key_value_heads``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir), **overrides)
    auto = AutoModelForCausalLM
    if getattr(config, "vision_config", None) is not None:
        check_serving_vision(config.model_type)
        from transformers import AutoModelForImageTextToText as auto  # LLaVA-OneVision
    with torch.device("meta"):
        model = auto.from_config(config)
    rotary = find_rotary_module(model)
    names = [name for name, module in model.named_modules() if module is rotary]
    if not names:
        raise ServingError(f"{type(model).__name__}: no rotary module found; serving needs RoPE")
    try:
        with torch.device("cpu"):
            real = type(rotary)(config=rotary.config)
    except TypeError as error:
        raise ServingError(
            f"{type(rotary).__name__} cannot be rebuilt on CPU from its config ({error})"
        ) from error
    parent_name, _, attr = names[0].rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, real)
    model.eval()
    return model


@dataclass(frozen=True)
class EngineImage:
    """An image (video) slot's content on the server: vLLM holds its pixels and encoder output (under
    ``hash``); the store keeps its K/V only. As a Session's ``Slot.visual`` it makes the slot an image
    (text after it is still the task's question; a piece of it is refused)."""

    kind: str
    hash: str
    nbytes: int = 0


class ServingHost(Request):
    """One multi-agent task: a :class:`~hf_kvshare.request.Request` (what a
    :class:`~hf_kvshare.session.Session` is for one request) whose turns the engine computes."""

    def __init__(self, task: str, model: torch.nn.Module, tokenizer: Any, shifter: RopeShifter | None):
        super().__init__(model, tokenizer, shifter)
        self.task = task
        self.described = f"task {task!r}"
        #: :meth:`held_bytes` as of the last change of the slots' K/V (a record, the bound's drops):
        #: what the store's bound sums over its tasks without walking every tensor of every task
        self.held = 0
        #: the storages the slots' K/V keep alive as of the same change, ``(device, data pointer)`` ->
        #: bytes: what :meth:`Sharing.shared_bytes` looks up without walking the slots' tensors
        self.storages: dict[tuple[str, int], int] = {}
        #: slots whose K/V the store's bound evicted (oldest first; their reason is ``evicted``)
        self.evicted: OrderedDict[str, None] = OrderedDict()

    @property
    def shifter(self) -> RopeShifter:
        if self._shifter is None:
            raise ServingError("this method does not re-position K/V (no RoPE shifter)")
        return self._shifter

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


@dataclass
class Plan:
    """What admission decided for one engine request."""

    request_id: str
    prompt: list[int]
    host: ServingHost | None = None
    turn: Turn | None = None
    placements: list[Placement | None] = field(default_factory=list)
    local_hit: int | None = 0  # None: planned ahead, not claimed yet
    claim_start: int = 0
    claim_end: int = 0
    #: the claimed K/V the worker is sent, ``[layers, m, kv_heads, head_dim]`` (``keys[i]`` is layer
    #: ``i``'s): the claim's positions whose placement is not rows the worker keeps (:attr:`origins`), in
    #: order (:meth:`sent_ranges`; the whole claim without a worker store); an empty list without any
    keys: torch.Tensor | list = field(default_factory=list)
    values: torch.Tensor | list = field(default_factory=list)
    #: per placement, the kept rows its K/V are (:class:`~.worker_store.Origin`: the connector then sends
    #: a reference, not the K/V), or ``None``
    origins: list[Any] = field(default_factory=list)
    error: str | None = None
    opt_out: bool = False
    missing: list[str] = field(default_factory=list)
    #: slots the layout named that were found as pieces, not whole (:attr:`.layout.ResolvedLayout.matched`)
    matched: list[dict[str, Any]] = field(default_factory=list)
    #: seconds the method's plan took (the claim decided: gates, corrections, the claimed K/V built)
    plan_s: float = 0.0
    #: seconds from the engine's first admission query to the decision (the plan plus the records and
    #: plans queued before it on the connector's thread; :mod:`.admission`), ``None`` when inline
    admission_wait_s: float | None = None
    #: seconds from the request's arrival (its plan started: :meth:`.admission.Background.prepare`) to
    #: vLLM's first admission query: vLLM's own queue (its token budget, running requests), not the
    #: method's; ``None`` when inline
    queued_s: float | None = None
    #: where ``admission_wait_s`` went on the connector's thread (``None`` when inline): seconds from the
    #: plan's submission (the arrival, or vLLM's first query) to its start, ``plan_behind`` that time split
    #: by what the thread ran meanwhile (:data:`.admission.BEHIND_KINDS`: ``task record`` (the record
    #: it must see), ``other record``, ``settle``, ``plan``, ``summary``), ``not_ready`` the admission
    #: queries answered "not decided yet" (each one costs the request the engine step vLLM runs before it
    #: asks again) and ``taken_after_s`` the seconds from the decision (or vLLM's first query, if later)
    #: to the query that took it: what those answers cost beyond the plan, and the claim (``claim_s``:
    #: the claimed K/V laid out for the worker, on vLLM's scheduler thread) with it
    plan_queue_s: float | None = None
    plan_behind: dict[str, float] = field(default_factory=dict)
    not_ready: int | None = None
    taken_after_s: float | None = None
    claim_s: float | None = None
    #: span name -> the method's gate outcome for it (:data:`GATE_KEYS` of the segment row's ``info``:
    #: ``gate`` accepted / fallback / turn / first / ungated, ``entropy``, ``anchors`` compared,
    #: ``reason``): a placed span's from admission, a dense one's from the record (``method.finish``
    #: writes it on the dense rows, as in a Session's segment table)
    gates: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: seconds the request's record took (the method's work after the request: slots, observed deltas
    #: factorized into anchors, kept prefixes), ``None`` until recorded; the task's later plans wait for it
    record_s: float | None = None
    #: seconds this request waited, before its plan could start, for an earlier request of its task to be
    #: read back and its record queued (the connector); ``None`` when it did not wait
    record_wait_s: float | None = None
    #: how this request's K/V reached its record: ``"at finish"`` (read by the worker on the scheduler's
    #: order as the request finished, sent through the read-back channel), ``"next step"`` (read when
    #: vLLM bound the next step, before its forward, through that channel) or ``"step output"`` (with the
    #: next step's output, after its forward: no channel); ``None`` unrecorded
    read_back: str | None = None
    #: seconds from the request's end (vLLM's ``request_finished``) to its record queued
    read_back_s: float | None = None
    #: the method's named phases (:data:`hf_kvshare.measure.PHASES`: ``gate``, ``factorize``,
    #: ``anchor_store``, ...) inside the plan and inside the record, seconds each (exclusive): e.g. a plan
    #: that factorizes an anchor a record left for later shows it under ``factorize``
    plan_phases: dict[str, float] = field(default_factory=dict)
    record_phases: dict[str, float] = field(default_factory=dict)
    #: what the method's record left for later (``Method.deferred_work``): run by the background thread
    #: when no plan waits (:mod:`.admission`), or at once inline; not part of the report. Its order is
    #: a function of the record alone (the order the record stored its anchors' parts): under tensor
    #: parallel every rank's driver runs them in this order, between the same records
    deferred: list[Callable[[], None]] = field(default_factory=list, repr=False)
    #: span name -> why admission did not place it (:data:`NOT_RECORDED_YET`, the agent's own text not
    #: kept, the method's gate), for each unplaced span (:meth:`Sharing._plan`); the claim's stop reads it
    unplaced: dict[str, str] = field(default_factory=dict)
    #: where the claim stopped before the prompt's last token and why (``span``, ``position``,
    #: ``reason``: :meth:`Sharing._claim`), ``None`` when it reached it (or nothing was planned)
    claim_stop: dict[str, Any] | None = None
    #: the wait for an in-flight request of the task that computes the span the claim stopped at
    #: (:mod:`.connector_scheduler`): ``slot``, ``seconds``, ``outcome`` (``recorded``, ``timed out``,
    #: ``producer gone``, or ``not waited`` with ``why``); ``None`` when there was nothing to wait for
    producer_wait: dict[str, Any] | None = None

    @property
    def claimed(self) -> int:
        return self.claim_end - self.claim_start

    def claimed_pieces(self) -> list[tuple[int, int, Any, int]]:
        """The claimed range by placed span: ``(lo, hi, origin, span start)`` (positions), ``origin`` the
        kept rows the span's K/V are (:class:`~.worker_store.Origin`; ``None``: sent, in :attr:`keys`)."""
        if self.turn is None:
            return []
        pieces = []
        origins = self.origins or [None] * len(self.placements)
        for span, origin in zip(self.turn.spans, origins):
            lo, hi = max(span.start, self.claim_start), min(span.end, self.claim_end)
            if hi > lo:
                pieces.append((lo, hi, origin, span.start))
        return pieces

    def sent_ranges(self) -> list[tuple[int, int]]:
        """Claim offsets ``[lo, hi)`` whose K/V are in :attr:`keys` / :attr:`values` (in order)."""
        return [
            (lo - self.claim_start, hi - self.claim_start)
            for lo, hi, origin, _ in self.claimed_pieces()
            if origin is None
        ]

    def cut(self, keep: int) -> None:
        """Cut the claim to its first ``keep`` positions (the sent K/V with it)."""
        keep = max(0, min(keep, self.claimed))
        self.claim_end = self.claim_start + keep
        rows = sum(hi - lo for lo, hi in self.sent_ranges())
        self.keys = self.keys[:, :rows] if rows else []
        self.values = self.values[:, :rows] if rows else []

    def drop_kv(self) -> None:
        """After the record: the claimed K/V and the placements' are not read again (the report reads
        each placement's provenance only), so the plan stops holding them; what the task keeps is then
        only what its slots and the method hold (:meth:`ServingHost.compact_views` sees that)."""
        self.keys, self.values = [], []
        self.placements = [None if p is None else replace(p, kv=None) for p in self.placements]

    def supplied_in(self, kind: str) -> int:
        """Tokens of ``kind`` ("PH" or "PF") spans inside the claimed range (what the connector wrote)."""
        if self.turn is None or not self.claimed:
            return 0
        return sum(
            max(0, min(s.end, self.claim_end) - max(s.start, self.claim_start))
            for s in self.turn.spans
            if s.kind == kind
        )

    def report(self) -> dict[str, Any]:
        """What admission decided, exactly: the claim, its PH / PF tokens, each span's placement.

        ``supplied_ph_tokens / ph_tokens`` is this request's rho (PH tokens whose K/V the connector
        supplied: re-positioned or corrected, not computed by the engine), as ``TurnResult.reuse_ratio``
        counts it; ``supplied_pf_tokens`` is the agent's own text placed by prefix reuse (not in rho).
        A segment's ``placed`` says the method placed it; ``supplied`` that it lies in the claim (a
        placed span after the first unplaced one is computed by the engine). ``gate`` (where the method
        gates) says why: accepted and its normalized entropy, or the fallback's reason and how many
        anchors the gate compared; a dense span's is known once the request is recorded."""
        turn = self.turn
        return {
            "task": self.host.task if self.host else None,
            "agent": turn.agent if turn else None,
            "output_slot": turn.output_slot if turn else None,
            "prompt_tokens": len(self.prompt),
            "prefix_cache_hit": self.local_hit,
            "claimed": [self.claim_start, self.claim_end] if self.claimed else None,
            "supplied_tokens": self.claimed,
            "ph_tokens": sum(s.length for s in turn.spans if s.kind == "PH") if turn else 0,
            "supplied_ph_tokens": self.supplied_in("PH"),
            "supplied_pf_tokens": self.supplied_in("PF"),
            "segments": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "span": [s.start, s.end],
                    "placed": p is not None,
                    "supplied": bool(self.claimed)
                    and self.claim_start <= s.start
                    and s.end <= self.claim_end,
                    "provenance": p.provenance if p is not None else "dense",
                    **({"gate": self.gates[s.name]} if s.name in self.gates else {}),
                    **({"unplaced": self.unplaced[s.name]} if p is None and s.name in self.unplaced else {}),
                }
                for s, p in zip(turn.spans, self.placements)
            ]
            if turn
            else [],
            "missing": self.missing,
            "matched": self.matched,
            "error": self.error,
            "plan_s": round(self.plan_s, 6),
            "admission_wait_s": None if self.admission_wait_s is None else round(self.admission_wait_s, 6),
            "queued_s": None if self.queued_s is None else round(self.queued_s, 6),
            "plan_queue_s": None if self.plan_queue_s is None else round(self.plan_queue_s, 6),
            "plan_behind": {k: round(v, 6) for k, v in self.plan_behind.items()},
            "not_ready": self.not_ready,
            "taken_after_s": None if self.taken_after_s is None else round(self.taken_after_s, 6),
            "claim_s": None if self.claim_s is None else round(self.claim_s, 6),
            "record_s": None if self.record_s is None else round(self.record_s, 6),
            "record_wait_s": None if self.record_wait_s is None else round(self.record_wait_s, 6),
            "read_back": self.read_back,
            "read_back_s": None if self.read_back_s is None else round(self.read_back_s, 6),
            "plan_phases": {k: round(v, 6) for k, v in self.plan_phases.items()},
            "record_phases": {k: round(v, 6) for k, v in self.record_phases.items()},
            "claim_stop": self.claim_stop,
            "producer_wait": self.producer_wait,
        }


#: the keys of a segment row's ``info`` a report keeps (the gate's outcome; not its distances)
GATE_KEYS = ("gate", "entropy", "anchors", "reason")

#: why a PH span was not placed when another request of its task in flight computes it: its K/V come
#: with that request's record (the connector may wait for it: :mod:`.connector_scheduler`)
NOT_RECORDED_YET = "not recorded yet"
#: why a method that places nothing (:attr:`~hf_kvshare.method.Method.places`: NonShared) placed nothing
METHOD_SHARES_NOTHING = "the method shares nothing (nonshared)"
#: why a PH span was not placed when no K/V of it are kept (this request is the first to read it, or
#: the store's bound dropped them)
NO_KV_KEPT = "no K/V kept for it (the first request to read it, or dropped by the store's bound)"
#: why a PH span was not placed when the store's bound evicted its slot's K/V (its task, the slot, or
#: the slot forgotten past ``max_task_slots``) before this request
EVICTED = "its slot's K/V were evicted from the store by its bound before this request"
#: why a span was not placed when its K/V are a stand-in of rows vLLM's worker evicted from its device
#: store (its bound, ``device_store_bytes``): the scheduler holds no values to send instead
DEVICE_EVICTED = (
    "its K/V were evicted from the worker's device store by its bound (device_store_bytes) before this "
    "request, and the scheduler keeps no copy of them"
)
#: why the agent's own (PF) text was not placed: vLLM computes only the tokens after the claim, which
#: starts at its own block-aligned prefix-cache hit, and the connector runs no model
OWN_TEXT_NEW = (
    "the agent's own text, new here (not in vLLM's prefix cache, which keeps whole blocks only, nor "
    "kept by prefix_reuse): vLLM computes every token from it on"
)
OWN_TEXT_OFF = (
    "the agent's own text, computed by vLLM (prefix_reuse is off: the claim cannot pass it unless "
    "vLLM's block-aligned prefix cache holds it)"
)


def _keep_gate(plan: Plan, name: str, info: dict[str, Any] | None) -> None:
    if info and "gate" in info:
        plan.gates[name] = {
            k: round(float(info[k]), 6) if k == "entropy" else info[k] for k in GATE_KEYS if k in info
        }


class ByteBudget:
    """Bytes held against a budget, reserved and released by several threads (the connector's
    read-backs waiting for their record: reserved when one arrives, released once its record ran).

    A reservation past the budget is refused (counted in ``refused``): its caller drops what it would
    have held, so the bytes held never pass ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.held = 0
        self.peak = 0
        self.refused = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self.held + nbytes > self.max_bytes:
                self.refused += 1
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


def check_budgets(**budgets: Any) -> None:
    """The store budgets (:data:`BUDGETS`), before anything is built: ``max_bytes`` a positive int (a
    store that holds nothing shares nothing), the others an int >= 0 or ``None`` (the default); a bool,
    a float, a string or a negative number raises ``ValueError`` naming it."""
    for name, value in budgets.items():
        if name == "max_bytes":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"max_bytes must be a positive integer (a store that holds nothing shares "
                    f"nothing: use the method nonshared); got {value!r}"
                )
        else:
            check_byte_budget(name, value, optional=True, none_is="the default")


class Sharing:
    """The method instance, the tasks' hosts and the bounded store: everything the connector calls.

    Byte budgets (:data:`BUDGETS`; ``None``: the default): ``max_bytes`` the tasks' slots' K/V;
    ``max_prefix_bytes`` the agents' kept PF text (default a quarter of ``max_bytes``, at most
    ``PREFIX_MAX_BYTES``); ``max_anchor_bytes`` the anchor pools (default
    :data:`DEFAULT_MAX_ANCHOR_BYTES`, or the method's smaller ``max_pool_bytes``);
    ``max_read_back_bytes`` the read-backs waiting for their record (:attr:`read_backs`; default
    :data:`DEFAULT_MAX_READ_BACK_BYTES`). A bad value is refused before anything, the method included,
    changes.

    Thread-safe (one lock): the engine's scheduler and worker may call from different threads."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        method: str | Method = "nonshared",
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_tasks: int = DEFAULT_MAX_TASKS,
        max_task_slots: int = DEFAULT_MAX_TASK_SLOTS,
        min_segment_tokens: int = lay.MIN_SEGMENT_TOKENS,
        max_prefix_bytes: int | None = None,
        max_anchor_bytes: int | None = None,
        max_read_back_bytes: int | None = None,
        **options: Any,
    ):
        check_budgets(
            max_bytes=max_bytes,
            max_prefix_bytes=max_prefix_bytes,
            max_anchor_bytes=max_anchor_bytes,
            max_read_back_bytes=max_read_back_bytes,
        )
        for name, value in (
            ("max_tasks", max_tasks),
            ("max_task_slots", max_task_slots),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name} must be a positive integer (a store that holds nothing shares "
                    f"nothing: use the method nonshared); got {value!r}"
                )
        if isinstance(method, str):
            options, notes = serving_options(method, options)
            for note in notes:
                logger.warning(note)
        self.method = get_method(method, **options)
        check_serving_method(self.method)
        # the salt of the method as configured, before the budgets below set its bounds (the launcher
        # computes it from the same method and options: Server.salt, the middleware's)
        self.salt = salt(self.method, os.environ.get(SALT_SECRET_ENV))
        self.model = model
        self.tokenizer = tokenizer
        self.tokens = lay.TokenInfo(tokenizer)
        self.method.bind(model)
        self.shifter = RopeShifter.from_model(model) if self.method.repositions else None
        self.max_bytes = max_bytes
        self.max_tasks = max_tasks
        self.max_task_slots = max_task_slots
        if hasattr(self.method, "bound_prefixes"):  # agents' kept text: a quarter of the store's budget
            if max_prefix_bytes is None:
                max_prefix_bytes = min(self.method.PREFIX_MAX_BYTES, max_bytes // 4)
            self.method.bound_prefixes(max_prefix_bytes)
        if hasattr(self.method, "bound_pools"):  # anchor pools: the smaller of the two bounds
            anchors = DEFAULT_MAX_ANCHOR_BYTES if max_anchor_bytes is None else max_anchor_bytes
            if self.method.max_pool_bytes is not None and max_anchor_bytes is None:
                anchors = min(anchors, self.method.max_pool_bytes)
            self.method.bound_pools(anchors)
        #: the read-backs of finished requests waiting for their record (the connector reserves them)
        self.read_backs = ByteBudget(
            DEFAULT_MAX_READ_BACK_BYTES if max_read_back_bytes is None else max_read_back_bytes
        )
        self.min_segment_tokens = int(min_segment_tokens)
        self.hosts: OrderedDict[str, ServingHost] = OrderedDict()
        #: the slot names of the last evicted tasks (a task planned again learns which were evicted)
        self.evicted_slots: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self.evicted_tasks = 0
        self.tasks_over_bound = 0  # times a new task found every other task busy (none evictable)
        self.forgotten_slots = 0  # slots forgotten by a task over max_task_slots
        self.dropped_slots = 0
        self.requests = 0
        self.claimed_requests = 0
        self.supplied_tokens = 0
        self.errors = 0
        self.records = 0
        self.plan_seconds = 0.0  # summed over every plan (admission) and record: where the method's time goes
        self.record_seconds = 0.0
        self.settles = 0  # parts of records' deferred work run (:meth:`settle`)
        self.settle_seconds = 0.0
        self._lock = threading.RLock()
        self._counts = threading.Lock()
        #: the connector's registry of the K/V its worker keeps (:class:`~.worker_store.Sources`): each
        #: placement's provenance in :attr:`Plan.origins`; ``None``: none found
        self.sources: Any = None
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids: set[int] = {eos} if isinstance(eos, int) else set()

    @property
    def value_free(self) -> bool:
        """Whether the method reads no K/V value here (:data:`VALUE_FREE`): the connector then keeps a
        finished request's K/V in vLLM's worker only, and records stand-ins of them."""
        return self.method.name in VALUE_FREE

    @property
    def follower(self) -> bool:
        """Whether this is the scheduler's follower of the workers' replicas (the method's engine on a
        ``FollowerShard``: ``KVCMAS.follower``): it records ``meta`` stand-ins of every read-back,
        whatever the method, and its placements of them are the workers' to compute."""
        return bool(getattr(self.method, "follower", False))

    def _any_rank(self, test: Callable[[], bool]) -> bool:
        """``test`` of this member's K/V, answered alike by every tensor-parallel rank and the follower
        where the method's engine runs on a shard (``KVCMAS.any_rank``; else ``test()`` itself)."""
        any_rank = getattr(self.method, "any_rank", None)
        return any_rank(test) if any_rank is not None else test()

    @property
    def _first_layer(self) -> int:
        """The model's index of this member's first layer (a later pipeline stage's engine holds its
        layers only; ``KVCMAS.first_layer``), for the layer an error names."""
        return getattr(self.method, "first_layer", 0)

    def _kv_bytes(self, count: Callable[[], int]) -> int:
        """The bytes of K/V ``max_bytes`` compares, from ``count()`` (this member's): one rank's bytes, the
        same on every tensor-parallel rank and the follower where the method's engine runs on a shard
        (``KVCMAS.kv_bytes``; else ``count()`` itself)."""
        kv_bytes = getattr(self.method, "kv_bytes", None)
        return kv_bytes(count) if kv_bytes is not None else count()

    def _fatal(self, error: Exception) -> bool:
        """Whether ``error`` must reach the caller instead of being counted (the method's
        ``fatal_errors``: a follower that left its leader's path can decide nothing more)."""
        return isinstance(error, getattr(self.method, "fatal_errors", ()))

    # ---------------------------------------------------------------- admission
    def admit(self, params: Any, cache_salt: str | None, images: list[dict[str, Any]] | None = None) -> Any:
        """The layout a request is planned under, fenced by its tenant, or ``None``: nothing injected.

        Approximate K/V are only ever injected under the method's ``cache_salt`` (vLLM's prefix cache
        keeps them there): a request without it (one that did not pass the layout check, e.g. another
        endpoint of vLLM's server) gets none, so it can never leave them in the plain prefix cache.
        A client's own salt (after the method's: ``"<method salt>|<client salt>"``) is its tenant: its
        task and its agents (named or derived from the prompt: the method's per-agent state, e.g. kept
        prefix text, included) are kept apart from every other tenant's in the store; a client cannot
        state a tenant itself. ``images``: the request's images as vLLM placed them
        (:func:`.layout.images_of`), stated under :data:`.layout.IMAGES` (a client's is dropped)."""
        if self.salt is not None and not (
            isinstance(cache_salt, str)
            and (cache_salt == self.salt or cache_salt.startswith(self.salt + "|"))
        ):
            return None
        raw = params.get(lay.KEY) if isinstance(params, dict) else None
        if params is not None and (not isinstance(params, dict) or not isinstance(raw, (dict, type(None)))):
            return params  # malformed: its plan reports the layout's error, nothing is claimed
        # the server's keys, not a client's
        fenced = {k: v for k, v in (raw or {}).items() if k not in (lay.TENANT, lay.IMAGES)}
        if images:
            fenced[lay.IMAGES] = images
        tenant = cache_salt[len(self.salt) + 1 :] if self.salt is not None else ""
        if tenant:
            fenced["task"] = f"{tenant}|{fenced.get('task') or lay.DEFAULT_TASK}"
            if isinstance(fenced.get("agent"), str) and fenced["agent"]:
                fenced["agent"] = f"{fenced['agent']}|{tenant}"
            fenced[lay.TENANT] = tenant  # a derived agent name carries it (layout.resolve)
        return {**(params or {}), lay.KEY: fenced}

    def plan(self, request_id: str, prompt: list[int], params: Any, local_hit: int | None) -> Plan:
        """Decide the claim for one request; never raises (an error is kept in ``plan.error``: no claim,
        nothing recorded). ``local_hit=None`` plans ahead of admission: :meth:`claim` then claims."""
        plan = Plan(request_id=request_id, prompt=list(prompt), local_hit=local_hit)
        with self._lock:
            t0 = time.perf_counter()
            self.requests += 1
            phases = Phases()
            try:
                request = lay.parse(params)
                if request.method == "nonshared" and self.method.name != "nonshared":
                    plan.opt_out = True
                    return plan
                if request.method is not None and request.method != self.method.name:
                    raise lay.LayoutError(
                        f"this server runs method {self.method.name!r}; the request asks {request.method!r}"
                    )
                with timing(phases):
                    self._plan(plan, request)
            except Exception as error:  # noqa: BLE001 - the engine must keep running
                if self._fatal(error):
                    raise
                self.errors += 1
                plan.error = f"{type(error).__name__}: {error}"
                if plan.host is not None and plan.turn is not None:  # refused after its turn was opened
                    plan.host.drop_turn(plan.turn)
                plan.turn, plan.placements, plan.keys, plan.values = None, [], [], []
                plan.origins = []
                plan.claim_start = plan.claim_end = 0
            finally:
                plan.plan_phases = dict(phases.times)
                plan.plan_s = time.perf_counter() - t0
                self.plan_seconds += plan.plan_s
        return plan

    def _kept_by_worker(self, tensor: torch.Tensor) -> bool:
        """Whether the worker's store keeps ``tensor``'s storage itself (:meth:`.worker_store.Sources.kept`):
        a record's views of it are no second copy (:attr:`Request.kept_elsewhere
        <hf_kvshare.request.Request.kept_elsewhere>`)."""
        return self.sources is not None and self.sources.kept(tensor)

    def _host(self, task: str) -> ServingHost:
        host = self.hosts.get(task)
        if host is None:
            host = self.hosts[task] = ServingHost(task, self.model, self.tokenizer, self.shifter)
            host.kept_elsewhere = self._kept_by_worker
            self._mark_evicted(host, self.evicted_slots.pop(task, ()))
        self.hosts.move_to_end(task)
        # tasks with a request in flight cannot go: the store stays over its count until they finish
        # (counted), rather than spinning here with the store's lock held
        while len(self.hosts) > self.max_tasks:
            if not self._evict_one(keep=host):
                self.tasks_over_bound += 1
                break
        return host

    def _plan(self, plan: Plan, request: lay.RequestLayout) -> None:
        host = self._host(request.task)
        known = {name: slot.token_ids.tolist() for name, slot in host.slots.items()}
        if request.segments is not None:  # an explicit layout may name an output by the name it gave it
            known |= {alias: known[name] for alias, name in host.aliases.items() if name in known}
        resolved = lay.resolve(request, plan.prompt, self.tokens, known, self.min_segment_tokens)
        turn = self._turn(host, resolved, plan.prompt)
        plan.host, plan.turn, plan.missing, plan.matched = host, turn, resolved.missing, resolved.matched
        walk = Walk(self.method, turn)
        scratch_cache = walk.plan()
        refused: list[Exception] = []  # this member's placements that could not be computed
        # placements computed here (a follower's: by the workers), the same count on every member
        computed = 0
        for span, placement in walk.place(scratch_cache):
            find = self.sources.find if self.sources is not None and placement is not None else None
            origin = find(placement.kv) if find is not None else None  # before it is moved
            if origin is None and find is not None:  # a corrected span of kept rows: its delta's factors
                origin = corrected_origin(placement.kv, find)
            if placement is not None and origin is None and is_stand_in(placement.kv) and not self.follower:
                # rows the worker no longer keeps, and no values here to send: computed by the engine
                placement = None
                plan.unplaced[span.name] = self._why_unplaced(host, turn, span, dropped=True)
            elif placement is not None:
                # sent to the worker: computed here, on the plan's thread (a follower's: by the workers)
                if origin is None:
                    computed += 1
                    if not self.follower and not refused:
                        try:
                            placement.kv = placement.kv.materialize(self._first_layer).repositioned(
                                turn.shifter, span.start
                            )
                        except Exception as error:  # noqa: BLE001 - refused below, on every member alike
                            if self._fatal(error):
                                raise
                            refused.append(error)
                _keep_gate(plan, span.name, placement.info)  # (rows the worker keeps: it moves them)
            else:
                plan.unplaced[span.name] = self._why_unplaced(host, turn, span)
            plan.origins.append(origin)
            plan.placements.append(placement)
        # the walk goes on past a placement this member could not compute (a correction NaN in its heads),
        # so every member makes the same collectives; then all refuse the plan, or none
        if computed and self._any_rank(lambda: bool(refused)):
            if refused:
                raise refused[0]
            raise ValueError(
                f"request {plan.request_id}: a placement could not be computed from {OTHER_RANK} "
                "(NaN or inf): not claimed"
            )
        if plan.local_hit is not None:  # None: planned ahead, claimed at admission (:meth:`claim`)
            self._claim(plan)

    def _why_unplaced(self, host: ServingHost, turn: Turn, span: Span, dropped: bool = False) -> str:
        """Why admission did not place ``span`` (under the store's lock): its K/V a stand-in of rows the
        worker dropped (``dropped``: :data:`DEVICE_EVICTED`); the agent's own text; a slot another open
        turn of the task will record (:data:`NOT_RECORDED_YET`); the method's own reason (its gate:
        :meth:`~hf_kvshare.method.Method.why_not_placed`), before what the store knows (KVCMAS keeps its
        sources in the request's state, not in the slot: an empty slot is not why its gate refused)."""
        if dropped:
            return DEVICE_EVICTED
        if span.kind == "PF":
            return OWN_TEXT_OFF if getattr(self.method, "prefix_reuse", None) is False else OWN_TEXT_NEW
        if not self.method.places:  # NonShared: no record can give it anything to wait for
            return METHOD_SHARES_NOTHING
        empty = not self.has_kv(host, span.name)
        if empty and self._in_flight_reads(host, span.name, turn):
            return NOT_RECORDED_YET
        own = self.method.why_not_placed(turn, span)
        if own:
            return own
        if empty:
            return EVICTED if span.name in host.evicted else NO_KV_KEPT
        return "not placed by the method"

    def _in_flight_reads(self, host: ServingHost, slot: str, turn: Turn | None = None) -> bool:
        """Whether an open turn of ``host`` other than ``turn`` reads ``slot`` and its record keeps the
        slot's source (:meth:`~hf_kvshare.method.Method.readers_add_source`)."""
        if not self.method.readers_add_source(host, slot):
            return False
        own = turn.output_slot if turn is not None else None
        return any(slot in reads for out, reads in dict(host.reading).items() if out != own)

    def has_kv(self, host: ServingHost | None, slot: str) -> bool:
        """Whether ``host``'s ``slot`` has now the K/V a placement of it reads: the method's source
        (:meth:`~hf_kvshare.method.Method.has_source`; the slot's latest K/V by default, KVCMAS's
        request state for an output or a first given text). Without the store's lock (read on vLLM's
        scheduler thread, which must not wait for a record): a snapshot, asked again at the next step."""
        return host is not None and self.method.has_source(host, slot)

    def recorded(self, host: ServingHost, slot: str) -> bool:
        """Whether ``host``'s ``slot`` has its K/V now (:meth:`has_kv`), or no open turn will record any (a
        waiting request then has nothing left to wait for); a snapshot, as :meth:`has_kv`."""
        return self.has_kv(host, slot) or not self._in_flight_reads(host, slot)

    def _turn(self, host: ServingHost, resolved: lay.ResolvedLayout, prompt: list[int]) -> Turn:
        """The request as a :class:`Turn` over its task: each located segment a PH span, the slot it
        reads resolved by the task (:meth:`~hf_kvshare.request.Request.resolve`: the rule a ``Session``
        applies); nothing of the task changes when the request is refused."""
        ids = torch.tensor(prompt, dtype=torch.long)
        spans: list[Span] = []
        new = NewSlots()
        pos, pf = 0, 0
        for seg in resolved.segments:
            if seg.start > pos:
                spans.append(self._pf(ids[pos : seg.start], pos, pf))
                pf += 1
            seg_ids = ids[seg.start : seg.end]
            slot = self._segment_slot(host, seg, seg_ids, new)
            spans.append(Span(spec=PH(slot.name), name=slot.name, token_ids=seg_ids, start=seg.start))
            pos = seg.end
        if pos < len(prompt):
            spans.append(self._pf(ids[pos:], pos, pf))
        return host.open_turn(resolved.agent, spans, resolved.output, new)

    def _segment_slot(
        self, host: ServingHost, seg: lay.LocatedSegment, seg_ids: torch.Tensor, new: NewSlots
    ) -> Any:
        """The slot a located segment reads: a piece of a held slot found by content
        (:meth:`~hf_kvshare.request.Request.piece_slot`), or what the task resolves its name to."""
        if seg.image is not None:
            return self._image_slot(host, seg, seg_ids, new)
        if seg.piece_of is not None:
            slot = host.piece_slot(*seg.piece_of, new)
            if not torch.equal(slot.token_ids, seg_ids):
                raise lay.LayoutError(
                    f"piece {slot.name!r} holds other tokens than the prompt's at {seg.start}"
                )
            return slot
        text = seg.text
        if text is None and host.held_slot(seg.slot, new)[0] is None:  # given text: the slot keeps it
            text = self.tokenizer.decode(seg_ids.tolist())
        return host.resolve(PH(seg.slot, text, kind=seg.kind), new, seg_ids.clone)

    def _image_slot(
        self, host: ServingHost, seg: lay.LocatedSegment, seg_ids: torch.Tensor, new: NewSlots
    ) -> Any:
        """An image's slot, named by its hash (one per image content in the task): an observation whose
        ids are its placeholders, as ``PH(slot, image=...)`` makes it in a Session; its pixels and
        features stay in vLLM (:class:`EngineImage`)."""
        held, _ = host.held_slot(seg.slot, new)
        if held is not None and not torch.equal(held.token_ids, seg_ids):
            raise lay.LayoutError(
                f"{seg.image.modality} {seg.image.hash!r}: {seg_ids.numel()} placeholder tokens here, "
                f"{held.token_ids.numel()} in the task's slot (the same hash must expand the same way)"
            )
        slot = host.resolve(PH(seg.slot, "", kind=seg.kind), new, seg_ids.clone)
        if slot.visual is None:
            slot.visual = EngineImage(seg.image.modality, seg.image.hash)
        return slot

    def _pf(self, ids: torch.Tensor, start: int, index: int) -> Span:
        return Span(
            spec=PF(self.tokenizer.decode(ids.tolist())), name=f"pf{index}", token_ids=ids, start=start
        )

    def claim(self, plan: Plan, local_hit: int) -> Plan:
        """Claim for a plan made ahead of admission (``plan(..., local_hit=None)``, when the request
        arrived): its placements do not depend on vLLM's prefix-cache hit, the claim does. Cheap
        (slices of the placed K/V) and without the store's lock, so the engine loop never waits for a
        record running on the connector's thread."""
        if plan.local_hit is not None:
            raise ValueError(f"request {plan.request_id}: already claimed from position {plan.local_hit}")
        plan.local_hit = int(local_hit)
        if plan.turn is not None and plan.error is None and not plan.opt_out:
            self._claim(plan)
        return plan

    def _claim(self, plan: Plan) -> None:
        """The longest run of placed positions from the engine's prefix-cache hit (module docstring)."""
        turn, start = plan.turn, plan.local_hit
        last = len(plan.prompt) - 1  # the engine computes at least the prompt's last token
        end = start
        for span, placement in zip(turn.spans, plan.placements):
            if span.end <= start:
                continue
            if placement is None or span.start > end:
                reason = plan.unplaced.get(span.name, "not placed by the method")
                gate = plan.gates.get(span.name, {}).get("reason")
                plan.claim_stop = {
                    "span": span.name,
                    "position": max(span.start, start),
                    "reason": f"{reason} ({gate})" if gate else reason,
                }
                break
            end = span.end
        end = min(end, last)
        if end <= start:
            return
        plan.claim_start, plan.claim_end = start, end
        # what is sent (not rows the worker keeps), as one [layers, m, heads, dim] tensor per K and V:
        # one buffer on the order channel, not 2 x layers copies
        origins = plan.origins or [None] * len(plan.placements)
        sent = [
            (max(span.start, start), min(span.end, end), span.start, placement.kv)
            for span, placement, origin in zip(turn.spans, plan.placements, origins)
            if origin is None and min(span.end, end) > max(span.start, start)
        ]
        rows = sum(hi - lo for lo, hi, _, _ in sent)
        if rows:
            first = sent[0][3].stored  # its shapes and dtypes (a follower's placement is not computed)
            k0 = first.keys[0]
            shape = (len(first.keys), rows, k0.shape[1], k0.shape[3])
            # on the placements' device (a worker's replica: the paged cache's); the follower's claimed rows
            # stand in: each worker's replica places its own heads
            device = "meta" if self.follower else k0.device
            plan.keys = torch.empty(shape, dtype=k0.dtype, device=device)
            plan.values = torch.empty(shape, dtype=first.values[0].dtype, device=device)
            at = 0
            for lo, hi, span_start, kv in sent if not self.follower else ():
                a, b = lo - span_start, hi - span_start
                for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
                    plan.keys[layer, at : at + b - a] = k[0, :, a:b].transpose(0, 1)  # [n, heads, dim]
                    plan.values[layer, at : at + b - a] = v[0, :, a:b].transpose(0, 1)
                at += b - a
        with self._counts:  # claim() runs outside the store's lock
            self.claimed_requests += 1
            self.supplied_tokens += end - start

    # ------------------------------------------------------------------ record
    def release(self, plan: Plan) -> None:
        """A request that will not be recorded (aborted, preempted, an error): free its output slot."""
        with self._lock:
            if plan.host is not None and plan.turn is not None:
                plan.host.drop_turn(plan.turn)

    def record(
        self,
        plan: Plan,
        keys: torch.Tensor | list[torch.Tensor],
        values: torch.Tensor | list[torch.Tensor],
        output_ids: list[int],
        stop_ids: set[int],
        *,
        settle: bool = True,
    ) -> None:
        """Record a finished request: ``keys``/``values`` (``[layers, n, kv_heads, head_dim]``, or a
        list of the layers' ``[n, kv_heads, head_dim]``) hold the K/V the engine used for positions
        ``[0, n)`` (prompt + output but its last token), or stand in for them (``meta`` tensors: the
        K/V stay in vLLM's worker, a :data:`VALUE_FREE` method's record holds references). What the method's record leaves for later is
        run here too, unless ``settle=False`` (the background thread's: it is left in
        :attr:`Plan.deferred` for the caller)."""
        if plan.turn is None:
            return
        with self._lock:
            t0 = time.perf_counter()
            phases = Phases()
            recorded = False
            try:
                with timing(phases):
                    self._finish_request(plan, keys, values, list(output_ids), stop_ids)
                recorded = True
            except Exception as error:  # noqa: BLE001 - the engine must keep running
                if self._fatal(error):
                    raise
                self.errors += 1
                plan.error = f"record: {type(error).__name__}: {error}"
            finally:
                plan.record_phases = dict(phases.times)
                plan.host.drop_turn(plan.turn)
                plan.deferred = self.method.deferred_work()
                plan.drop_kv()
            if recorded:  # as a Session's: the K/V no later turn reads dropped, the views compacted
                plan.host.release(plan.turn, self.method)
            else:
                plan.host.compact_views()
            self._forget_oldest_slots(plan.host)
            plan.host.held = self._kv_bytes(plan.host.held_bytes)
            plan.host.storages = slot_storages(plan.host)
            self._bound(plan.host)
            self.records += 1
            plan.record_s = time.perf_counter() - t0
            self.record_seconds += plan.record_s
        if settle:
            deferred, plan.deferred = plan.deferred, []
            for work in deferred:
                self.settle(work)

    def settle(self, work: Callable[[], None]) -> None:
        """Run one part of what a record left for later (:attr:`Plan.deferred`: e.g. one anchor's
        factorization); never raises (an error is counted: a reader that needs the result computes it)."""
        with self._lock:
            t0 = time.perf_counter()
            try:
                work()
            except Exception as error:  # noqa: BLE001 - the engine must keep running
                if self._fatal(error):
                    raise
                self.errors += 1
                logger.exception("hf_kvshare: a record's deferred work failed")
            self.settles += 1
            self.settle_seconds += time.perf_counter() - t0

    def _finish_request(self, plan: Plan, keys, values, output_ids: list[int], stop_ids: set[int]) -> None:
        """The rest of the walk for a request the engine ran: its K/V as the turn's cache
        (:meth:`_engine_cache`), ``finish``, the output recorded by the task
        (:meth:`~hf_kvshare.request.Request.record_output`), then the method's ``record``."""
        turn, host, method = plan.turn, plan.host, self.method
        walk = Walk(method, turn)
        cache = self._engine_cache(plan, keys, values)
        stand_in = bool(cache.layers) and cache.layers[0].keys.is_meta
        walk.finish(cache)
        for segment in cache.segments:
            if segment.kind == "PH" and segment.provenance == "dense":
                _keep_gate(plan, segment.name, segment.info)
        P, n = len(plan.prompt), cache.get_seq_length()
        out = list(output_ids)
        stop_ids = set(stop_ids) | self.stop_ids
        while len(out) > 1 and out[-1] in stop_ids:
            out.pop()
        if method.uses_sources and P + len(out) > n >= P + 1:
            # generation stopped on its length: the engine never fed the last token, so it holds no K/V
            # for it (the HF Session computes it with one more dense step; serving runs no HF forward).
            # The slot is the output whose K/V the producer computed (all but that last token): later
            # agents find these ids in their prompts and the token after them is their own text. With
            # output_source="producer" this is what lets KVCMAS gate and place the output at all.
            out = out[: n - P]
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        output = torch.tensor(out, dtype=torch.long)
        host.record_output(turn, cache, output, text, keep_kv=method.uses_sources)
        for name, slot in host.slots.items() if host.evicted else ():  # kept again: not the bound's eviction
            if slot.latest is not None:
                host.evicted.pop(name, None)
        # stand-ins: what the method keeps (prefix reuse's text) are views, so they stay references to
        # the worker's rows (a copy of a stand-in holds no values and no provenance)
        with cache.sharing_storage() if stand_in else contextlib.nullcontext():
            walk.record(cache)

    def _engine_cache(self, plan: Plan, keys, values) -> SharedCache:
        """The serving executor's read-back: the K/V the engine used for positions ``[0, n)``, injected
        and computed alike, as ``method.new_cache(turn)`` with the turn's segment table (a placed span
        inside the claim keeps its placement's row; everything else is dense)."""
        turn = plan.turn
        P = len(plan.prompt)
        n = keys[0].shape[0] if len(keys) else 0
        if n < P:
            raise ValueError(f"the engine holds K/V of {n} positions, the prompt has {P}")

        # checked once, whole (one reduction per layer), before anything is recorded; the turn's slots
        # and the method's checks then read it as checked (SegmentKV.finite), and a placement's K/V is
        # not checked again (what was injected is in it)
        used = SegmentKV(
            keys=[k[:n].transpose(0, 1)[None] for k in keys],
            values=[v[:n].transpose(0, 1)[None] for v in values],
            start=0,
            agent=turn.agent,
        )
        # under a shard every rank refuses a read-back NaN on one rank's heads, and a follower (stand-ins:
        # its values stay in the workers) takes the leader's answer
        refused: list[ValueError] = []

        def non_finite() -> bool:
            if not is_stand_in(used):  # a stand-in's rows were checked by the worker (or came with values)
                try:
                    used.check_finite(f"the engine's K/V of request {plan.request_id}", self._first_layer)
                except ValueError as error:
                    refused.append(error)
            return bool(refused)

        if self._any_rank(non_finite):
            if refused:
                raise refused[0]
            raise ValueError(
                f"the engine's K/V of request {plan.request_id} hold NaN or inf in {OTHER_RANK}: not recorded"
            )
        used.finite = True  # the store holds it from here, and nothing writes it
        cache = self.method.new_cache(turn)
        covered = max(plan.claim_end, plan.local_hit)
        segments = []
        for i, (span, placement) in enumerate(zip(turn.spans, plan.placements)):
            if placement is not None and span.end <= covered:
                segment = turn.segment_for(span, placement.provenance, placement.source_agent, placement.info)
            else:
                segment = turn.segment_for(span, "dense")
            end = span.end - 1 if i == len(turn.spans) - 1 else span.end
            if end > span.start:
                segment.end = end
                segments.append(segment)
        segments.append(Segment("prompt_tail", "PF", P - 1, P))
        if n > P:
            segments.append(Segment("generated", "PF", P, n))
        # the cache holds the engine's K/V of [0, n) as they are (views of the read-back, no copy)
        cache.append_tiled(used, segments, adopt=True)
        return cache

    # ------------------------------------------------------------------ bounds
    def held_bytes(self) -> int:
        """Bytes the tasks' slots keep alive (each task's count as of its last record: ServingHost.held)."""
        return sum(h.held for h in self.hosts.values())

    def _forget_oldest_slots(self, host: ServingHost) -> None:
        """A task holds at most ``max_task_slots`` slots: the oldest ones no request in flight reads
        are forgotten (their K/V, text and aliases), so a long-lived task (every task-less request is
        task ``default``) does not make each plan search an ever-growing list."""
        excess = len(host.slots) - self.max_task_slots
        if excess <= 0:
            return
        busy = set().union(*host.reading.values()) if host.reading else set()
        for name in [n for n in host.slots if n not in busy][:excess]:
            del host.slots[name]
            self.forgotten_slots += 1
            self._mark_evicted(host, [name])
        for alias in [a for a, target in host.aliases.items() if target not in host.slots]:
            del host.aliases[alias]
        host.compact_views()

    def _evict_one(self, keep: ServingHost) -> bool:
        for task in self.hosts:
            if self.hosts[task] is not keep and not self.hosts[task].reserved:
                gone = self.hosts.pop(task)
                self.evicted_tasks += 1
                self.evicted_slots[task] = OrderedDict.fromkeys([*gone.evicted, *gone.slots])
                while len(self.evicted_slots) > self.max_tasks:
                    self.evicted_slots.popitem(last=False)
                return True
        return False

    def _mark_evicted(self, host: ServingHost, names: Any) -> None:
        """Remember that ``names``' K/V were evicted from ``host`` (at most ``max_task_slots`` names)."""
        for name in names:
            host.evicted[name] = None
            host.evicted.move_to_end(name)
        while len(host.evicted) > self.max_task_slots:
            host.evicted.popitem(last=False)

    def own_bytes(self) -> int:
        """What ``max_bytes`` bounds: the bytes the slots keep alive (:meth:`held_bytes`) but those the
        worker's store keeps itself (:meth:`shared_bytes`, bounded by its own budget,
        ``device_store_bytes``): each byte counted under one budget. A read-back the worker drops counts
        here from then on, until its views are copied out (the next record's compaction) or evicted."""
        return self.held_bytes() - self.shared_bytes()

    def _bound(self, current: ServingHost) -> None:
        while self.own_bytes() > self.max_bytes and self._evict_one(keep=current):
            pass
        if self.own_bytes() > self.max_bytes:  # the current task alone is over: drop its oldest K/V
            for name, slot in current.slots.items():
                if slot.latest is not None:
                    slot.latest = None
                    self.dropped_slots += 1
                    self._mark_evicted(current, [name])
                    current.held = self._kv_bytes(current.held_bytes)
                    current.storages = slot_storages(current)
                    if self.own_bytes() <= self.max_bytes:
                        break

    def shared_bytes(self) -> int:
        """Bytes of the slots' K/V that are the worker's own device store's tensors, not a second copy
        (read back in-process and kept by the worker: ``Sources.register(shared=True)``), each storage
        counted once and whole, as :meth:`held_bytes` counts it, from each task's :attr:`ServingHost.storages`
        as of its last record and the worker's store now."""
        shared = self.sources.shared_storages() if self.sources is not None else set()
        if not shared:
            return 0
        seen = {key: n for host in self.hosts.values() for key, n in host.storages.items() if key in shared}
        return sum(seen.values())

    def stores(self, method_state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Each store's ``bytes`` held, its ``max_bytes`` budget and its evictions (``evicted``; the
        read-backs: ``refused``, not recorded, and ``peak`` bytes); the method's stores (kept PF text, from
        its ``prefix_summary()``; anchor pools, from ``method_state``, its ``state_summary()``) where it
        keeps them."""
        stores = {
            "slots": {
                "bytes": self.held_bytes(),
                # ``max_bytes`` bounds ``bytes - shared_bytes`` (:meth:`own_bytes`)
                "max_bytes": self.max_bytes,
                "evicted": self.evicted_tasks + self.dropped_slots,
                # of ``bytes``, those the worker's device store holds itself (in-process handoff: one copy,
                # bounded by the worker store's budget)
                "shared_bytes": self.shared_bytes(),
            },
            "read_backs": {
                "bytes": self.read_backs.held,
                "max_bytes": self.read_backs.max_bytes,
                "refused": self.read_backs.refused,
                "peak": self.read_backs.peak,
            },
        }
        if hasattr(self.method, "prefix_summary"):
            kept = self.method.prefix_summary()
            stores["prefixes"] = {
                "bytes": kept["prefix_bytes"],
                "max_bytes": kept["max_prefix_bytes"],
                "evicted": kept["prefixes_evicted"],
            }
        if "pools_bytes" in method_state:
            stores["anchors"] = {
                "bytes": method_state["pools_bytes"],
                "max_bytes": method_state["max_pools_bytes"],
                "evicted": method_state["pools_evicted_for_bytes"],
            }
        return stores

    def state_summary(self) -> dict[str, Any]:
        with self._lock:
            method_state = self.method.state_summary()
            return {
                "bytes": self.held_bytes(),
                "max_bytes": self.max_bytes,
                "tasks": len(self.hosts),
                "max_tasks": self.max_tasks,
                "evicted_tasks": self.evicted_tasks,
                "tasks_over_bound": self.tasks_over_bound,
                "forgotten_slots": self.forgotten_slots,
                "max_task_slots": self.max_task_slots,
                "dropped_slot_kv": self.dropped_slots,
                "slots": sum(len(h.slots) for h in self.hosts.values()),
                "requests": self.requests,
                "claimed_requests": self.claimed_requests,
                "supplied_tokens": self.supplied_tokens,
                "errors": self.errors,
                "records": self.records,
                "plan_seconds": round(self.plan_seconds, 6),
                "record_seconds": round(self.record_seconds, 6),
                "settles": self.settles,
                "settle_seconds": round(self.settle_seconds, 6),
                "method": self.method.name,
                "method_state": method_state,
                "stores": self.stores(method_state),
                # what the connector's worker keeps on its device (kept / evicted / refused, bytes)
                "device_store": self.sources.summary() if self.sources is not None else None,
            }


def slot_storages(host: ServingHost) -> dict[tuple[str, int], int]:
    """``(device, data pointer)`` -> bytes of each storage ``host``'s slots' K/V keep alive (as
    :meth:`~hf_kvshare.request.Request.held_bytes` counts them: once and whole; stand-ins hold none)."""
    seen = {}
    for slot in host.slots.values():
        for t in (*slot.latest.keys, *slot.latest.values) if slot.latest is not None else ():
            if not t.is_meta:
                storage = t.untyped_storage()
                seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return seen


def model_files(model_dir: str | Path) -> dict[str, Any]:
    """The served folder's config (for a clear error when it is not an HF model folder)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ServingError(f"{model_dir}: no config.json (serving needs an HF model folder)")
    return json.loads(path.read_text())

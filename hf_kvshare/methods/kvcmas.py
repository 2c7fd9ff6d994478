"""KVCMAS: low-rank online anchor pools with chained correction (and its non-chained ablation).

A PH segment's K/V for a consuming agent is obtained from a *source* cache, re-positioned to where
the segment lands, plus an estimated correction: a token-wise weighted sum of the deltas stored in
the slot's anchor pool. The sources, frames and correction follow the authors' reference code
(``hjeon2k/KVCMAS`` on ``FastMAS/KVCOMM``); the earlier readings stay available as named options.

Profiles (``profile``): ``"reuse"`` (KVCMAS's default, beyond the reference) and ``"reference"``
(every rule of the authors' code, KVComm's default). The reference's gate rejects a team's repeated
documents forever: a pool grows only by rejections, fewer than two anchors reject, and two anchors
of the same text are equally close (normalized entropy 1 > tau), so the better the match the surer
the rejection. ``"reuse"`` sets :data:`PROFILES` ``["reuse"]``:

- ``agreement=0.3``: where the entropy rule rejects, the gate accepts when the candidate anchors'
  corrections agree (per consumer, the deltas' spread relative to their size at most 0.3; one
  anchor suffices once a refresh showed its correction repeats); it still rejects when they disagree;
- ``nearest=0.5``: an acceptance (by either rule) stands only when the candidate is near an anchor
  (gate distance at most half that anchor's size): corrections observed on other content do not
  carry over on the weights alone (on the embedded model the entropy rule accepted outputs of other
  text, 0.7-1.3 of the nearest anchor's size; the same notes sit at about 0.3);
- ``trust_agreement=True``: ... unless the anchors' corrections agree: a candidate far from every
  anchor is accepted when the agreement rule's test passes (a correction that repeats over other
  content does not depend on the content); anchors that disagree, or a correction seen once, refuse it;
- ``gate_chained=False`` (an option of both profiles, off in each): with ``True`` a chained question
  (the reference admits it ungated, corrected with deltas observed on other requests' questions) is
  gated too, by each consumer on its own source and its own corrections (as ``gating="paper"`` gates
  it, with the rules above): where they disagree the span is prefilled and its exact delta learned.
  Measured on the bench's workloads it kept KL under FullShared's everywhere but reused nothing on
  four of six (their consumers' corrections disagree), so the default leaves it off;
- ``duplicate=0.05``: an observation whose base nearly duplicates a pooled anchor's (values within
  5 %) refreshes that anchor instead of joining the pool (no duplicate anchors);
- ``learn_dense=True``: pools learn from every exact delta a dense span gives, not only rejections;
- ``turn_fallback="span"``: a rejection prefills the rejected span, not the whole turn;
- ``piecewise=True``: a span fewer than two anchors cover whole (the reference's length rule: an
  anchor corrects only a span no longer than itself, so a longer span went dense) is gated over the
  longest prefix two anchors cover and corrected window by window, each row by every anchor covering
  it; the rows past the longest anchor are reused uncorrected.

An option of both profiles, off in each: ``verify_tokens=8`` verifies each correction on a probe (the
exact K/V of the span's last tokens over the agent's prefix and the corrected span,
:mod:`hf_kvshare.anchors.verify`) and places it when its error there is at most ``verify_threshold`` of the
uncorrected source's; a span the gate rejected is placed when its probe accepts it.

``profile="reference"`` sets ``agreement=0, nearest=0, duplicate=0, learn_dense=False, turn_fallback="turn",
piecewise=False, trust_agreement=False, gate_chained=False, verify_tokens=0``:
the accept/reject decisions of the authors' code. Options given beside a profile win over it.

Sources (``output_source`` for agent outputs, ``text_source`` for the request's question,
``observation_source`` for the other given text: :class:`~hf_kvshare.trajectory.PH` ``kind``):

- ``"producer"`` (outputs): the producer's own cache of its output, re-positioned (reference).
- ``"chained"``: the latest hop's materialized cache of the slot (dense or itself corrected). For
  given text this is KVCMAS's chaining of the question hop to hop (reference); the first hop of a
  request computes it densely. For outputs it is the previous reading of the segment.
- ``"first"`` (given text): the first consumer's dense cache, for every later hop (the reference
  code's ``--no-chained``: the question harvested once, a star).
- ``"lead"`` (given text): KVComm's reference prefill: BOS + chat header + a lead-in, then the
  text, the leading tokens dropped (:func:`~hf_kvshare.anchors.state.reference_prefill`).
- ``"context_free"``: the segment prefilled alone at positions ``0 ..`` (our earlier reading).

Gating (``gate_scope``):

- ``"slot"`` (reference): one gate decision per (slot, request), taken by the producer right after
  its turn for an output, by the first consumer for a reference-prefilled given text; chained /
  first given text is not gated. The candidate's values are compared (L2 over every layer, computed
  from the factors) with every pooled anchor at least as long (``match="full"``; fewer than two →
  reject). Every consumer obeys: a consumer of a rejected slot without its own delta in the slot's
  anchor of this request prefills (with ``turn_fallback="turn"``, the reference, its whole turn;
  ``"span"``: that span only) and adds its delta to the one anchor of (slot, request); otherwise it
  reuses every PH span, corrected by the anchors holding its delta (the anchors covering the
  segment, else the longest: ``partial_coverage``), uncorrected when none does. Token weights are
  computed once per (slot, request, anchor set) and reused by later consumers
  (``weights_cache``). Pools are per producing agent for outputs (``agent#2`` shares ``agent``'s).
- ``"edge"`` (our earlier reading): every (source, consumer) edge is gated separately over the
  anchors built from the same source label holding the consumer's delta; ``match="prefix"``
  compares over the longest prefix two anchors cover. Anchors are split by source version.

Observations (given text of kind ``"observation"``: documents, tool results, test feedback) follow
the reference's conditions (``update_condition_anchor`` in both authors' codes) by default
(``observation_source="lead"``): prefilled once per request after BOS + chat header + a lead-in that
are dropped, gated once per (slot, request) by the first consumer, anchored on rejection, corrected on
acceptance, never chained. ``observation_source="question"`` reads them as the question (the reading
before kinds: for KVCMAS chained and ungated; gated per edge with ``gate_chained``). ``gating="paper"`` is the paper's text (A.3): every PH
span gated, the question included, fewer than two compatible anchors → dense.

``guard=True`` (ours, beyond the paper) shrinks each layer's correction toward zero by a held-out
estimate of its reliability (each anchor's delta predicted from the others), so that over the
anchors it is never worse than serving the source uncorrected (the option's docstring).

The two scopes are engine policies driven from this method's hooks (``plan`` / ``placeholder`` /
``prefix`` / ``finish`` / ``record``): :class:`~hf_kvshare.anchors.slot_scope.SlotScope` and
:class:`~hf_kvshare.anchors.edge_scope.EdgeScope` (their common part, sources and deltas:
:mod:`hf_kvshare.anchors.scope`); the pools and per-request state are a
:class:`~hf_kvshare.anchors.store.BoundedStore`. This module keeps the knobs and the wiring.

``tau = 0`` accepts nothing and reuses nothing: every PH span is prefilled (NonShared exactly),
while the pools still learn.

The previous behaviour of each method, for ablations (given text read as the question:
``observation_source=question``)::

    kvcmas:gate_scope=edge,match=prefix,output_source=chained,skip_layer0=False,svd=exact,pool_peak=capacity,delta_frame=canonical
    kvcmas-nonchained:gate_scope=edge,match=prefix,output_source=context_free,text_source=context_free,skip_layer0=False,svd=exact,pool_peak=capacity,delta_frame=canonical
    kvcomm:gate_scope=edge,match=prefix,output_source=context_free,text_source=context_free,skip_layer0=False,pool_peak=capacity,delta_frame=canonical,key_frame=canonical,prefix_delta=False
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..anchors.cache import CorrectedCache
from ..anchors.edge_scope import EdgeScope
from ..anchors.lowrank import SVD_METHODS, any_rank, bound_count, columns, layer_offset
from ..anchors.persist import TensorTable, move_state_to_model, pools_from_state, pools_to_state
from ..anchors.scope import Scope
from ..anchors.sharded import FollowerDiverged, FollowerShard, Shard, StageShard
from ..anchors.slot_scope import SlotScope
from ..anchors.store import BoundedStore, Stored, check_rank, clamp_ranks
from ..anchors.verify import PLACES, SCALES
from ..budgets import check_byte_budget
from ..method import Method, Placement, register
from ..persistence import state_dims
from ..recompute.stack import DecoderStack
from .prefix_reuse import PrefixReuse

if TYPE_CHECKING:
    from ..session import Session
    from ..turn import Turn

#: what each ``profile`` sets, unless given (``"reference"``: the authors' code; module docstring)
PROFILES: dict[str, dict[str, Any]] = {
    "reuse": {
        "agreement": 0.3,
        "nearest": 0.5,
        "duplicate": 0.05,
        "learn_dense": True,
        "turn_fallback": "span",
        "piecewise": True,
        "trust_agreement": True,
        # off: measured at 0daf0ad, gating the chained question refused every span its consumers'
        # disagreeing corrections touched (rho 0 on four of six workloads); kvcmas:gate_chained=True
        # keeps KL under FullShared's on stress at that price (docs/results/methods.md)
        "gate_chained": False,
        # off until measured: docs/results/methods.md, "A verification probe"
        "verify_tokens": 0,
    },
    "reference": {
        "agreement": 0.0,
        "nearest": 0.0,
        "duplicate": 0.0,
        "learn_dense": False,
        "turn_fallback": "turn",
        "piecewise": False,
        "trust_agreement": False,
        "gate_chained": False,
        "verify_tokens": 0,
    },
}

CHOICES: dict[str, tuple[str, ...]] = {
    "profile": tuple(PROFILES),
    "gate_scope": ("slot", "edge"),
    "output_source": ("producer", "chained", "context_free"),
    "text_source": ("chained", "first", "lead", "context_free"),
    "observation_source": ("lead", "context_free", "question"),
    "gating": ("reference", "paper"),
    "match": ("full", "prefix"),
    "turn_fallback": ("turn", "span"),
    "svd": SVD_METHODS,
    "pool_peak": ("capacity+1", "capacity"),
    "delta_frame": ("writer", "canonical"),
    "key_frame": ("canonical", "reader"),
    "verify_scale": SCALES,
    "verify_rows": PLACES,
}
#: the policy behind each ``gate_scope``
SCOPES: dict[str, type[Scope]] = {"slot": SlotScope, "edge": EdgeScope}


def check_tau(method: str, tau: Any) -> None:
    """``tau`` must be a real number (not a bool) in ``[0, 1]``; the message names the method."""
    real = isinstance(tau, (int, float)) and not isinstance(tau, bool)
    if not real or not math.isfinite(tau):
        raise ValueError(f"{method}: tau must be a real number in [0, 1], got {tau!r} ({type(tau).__name__})")
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"{method}: tau is a normalized entropy threshold in [0, 1], got {tau!r}")


@register
@dataclass(eq=False)
class KVCMAS(PrefixReuse, Method):
    """KVCMAS (chained correction, low-rank anchors). Sources, frames and correction follow the
    authors' reference code; the gate and pools follow ``profile`` (``"reuse"``; ``"reference"``: the
    authors' decisions).

    Args:
        profile: ``"reuse"`` (default: the gate also accepts agreeing corrections, near-duplicate
            anchors refresh, pools learn from every dense span, span fallback, piecewise correction)
            or ``"reference"`` (every rule of the authors' code at once). It sets ``agreement``,
            ``nearest``, ``trust_agreement``, ``gate_chained``, ``duplicate``, ``learn_dense``, ``turn_fallback`` and ``piecewise`` unless
            they are given (module docstring).
        agreement: the gate's agreement rule (``None``: the profile's, 0.3 / 0): where the entropy
            rule rejects, accept when, for every consumer the candidate anchors hold a delta for,
            their deltas' spread (RMS distance from their mean over their RMS size, keys and
            values, the layers corrected: :func:`~hf_kvshare.anchors.lowrank.relative_spread`) and
            the spreads refreshes recorded are at most this. A consumer whose correction was seen
            once is not judged (rejected). 0 turns the rule off. Slot scope only.
        nearest: an accepted gate (by either rule) stands only when the candidate's nearest anchor is
            within this fraction of that anchor's size (gate distance, values, every layer; ``None``:
            the profile's, 0.5 / 0; 0: off): a correction observed on other content (another output of
            the producer) is not applied. The rank-32 base of the same text sits at about 0.3 on the
            embedded model; other text at 1 or more. Slot scope only.
        trust_agreement: a far candidate (``nearest``) is still accepted when the anchors'
            corrections agree (the agreement rule's test, ``agreement``); ``False``: every acceptance
            needs a near candidate (the rule before 2026-12-06). ``None``: the profile's, ``True`` /
            ``False``. Slot scope only; not a state option.
        gate_chained: a chained given text (the question, hop to hop) is gated by each consumer on its
            own source, judging its own corrections (``agreement``), as ``gating="paper"`` gates it;
            a rejection prefills the span (``turn_fallback``) and learns its exact delta. ``False``:
            admitted ungated (the reference). ``None``: the profile's, ``True`` / ``False``. Slot
            scope only; not a state option.
        duplicate: an observation whose base's values are within this fraction of a pooled anchor's
            (same source, same length) refreshes that anchor instead of joining the pool (``None``:
            the profile's, 0.05 / 0; 0: off). Slot scope only.
        learn_dense: every span prefilled with a source stores its exact delta (``None``: the
            profile's, ``True`` / ``False``); the reference stores only rejected spans' and ungated
            given text's. Slot scope only.
        base_rank: rank of the stored source caches (used only for matching); ``None`` keeps them dense.
        delta_rank: rank of the stored corrections; ``None`` keeps them dense. A rank above a
            segment's ``min(L, D)`` stores all ``min(L, D)`` components (exact); one above the
            model's ``D = kv_heads * head_dim`` is clamped to ``D`` with a warning when attached.
        capacity: anchors per pool (V).
        tau: normalized-entropy threshold of the reliability gate, a real number in [0, 1]
            (0 disables reuse). The benchmark's workloads set 0.29 (MMLU), 0.32 (GSM8K) and 0.34
            (HumanEval) unless given.
        temperature: gate softmax temperature T.
        token_temperature: temperature of the token-wise interpolation weights.
        eviction_window: a full pool evicts the least frequently used of this many oldest anchors.
        gate_scope: ``"slot"`` (one decision per (slot, request), consumers obey; reference) or
            ``"edge"`` (every edge gated on its own; earlier reading).
        output_source: ``"producer"`` (reference), ``"chained"`` or ``"context_free"``: where an agent
            output's source cache comes from (module docstring).
        text_source: ``"chained"`` (reference KVCMAS), ``"first"`` (reference ``--no-chained``),
            ``"lead"`` (reference KVComm) or ``"context_free"``: the same for the request's question
            (given text of kind ``"question"``).
        observation_source: given text of kind ``"observation"`` (documents, tool results, feedback):
            ``"lead"`` (reference, both codes' conditions: prefilled once per request after BOS + chat
            header + lead-in, which are dropped; gated once per (slot, request), anchored on rejection,
            corrected on acceptance, never chained; a pool per slot), ``"context_free"`` (the same
            prefilled alone), or ``"question"`` (read exactly as the question: ``text_source`` and its
            gating; the reading before kinds existed, under which KVCMAS's observations were chained
            and never gated: with ``gate_chained=False``).
        gating: ``"reference"`` (the authors' code: outputs and observations gated once per (slot,
            request); the question gated only when its source is a reference prefill, as KVComm's,
            never when chained / first, as KVCMAS's) or ``"paper"`` (the paper's text, A.3: every PH
            span gated, the question included; a chained question by each consumer on its own source;
            fewer than two compatible anchors → dense). Slot scope only (edge scope gates every edge).
        match: ``"full"`` (gate over the full length among anchors at least that long; reference)
            or ``"prefix"`` (over the longest prefix two anchors cover).
        turn_fallback: ``"turn"`` (a consumer obeying a rejection prefills its whole turn;
            reference) or ``"span"`` (only the rejected spans; ``None``: the profile's, ``"span"`` /
            ``"turn"``). Slot scope only.
        piecewise: a span fewer than two anchors cover whole is gated over the longest prefix two
            anchors cover (one anchor: its length) instead of being rejected by the length rule, and
            corrected window by window (:func:`~hf_kvshare.anchors.correction.windows`: each row by
            the anchors covering it), the rows past the longest anchor reused uncorrected
            (``None``: the profile's, ``True`` / ``False``). With ``partial_coverage=False`` the anchors
            shorter than a span correct none of it (reused uncorrected). Slot scope only; not a state option.
        partial_coverage: with no anchor covering the segment, the longest correct their rows
            (reference KVCMAS); ``False``: reuse uncorrected (reference KVComm).
        skip_layer0: leave layer 0 uncorrected (reference; its K/V do not depend on the context).
        weights_cache: reuse token weights per (slot, request, anchor set) across consumers (reference),
            and each anchor's token distances from a source per request (ours: consumers with other
            anchor sets share them; an accepted output's are computed at its producer's record, off
            the consumers' time to first token). ``False``: computed for every placement.
        svd: ``"randomized"`` (``torch.svd_lowrank(q=r, niter=2)``, seeded; reference) or ``"exact"``.
        pool_peak: ``"capacity+1"`` (evict when more than V are held, as the reference) or ``"capacity"``.
        delta_frame: ``"writer"`` (reference: a delta's keys are stored in the absolute positions of
            the consumer that observed it, ``C_j - Align(C_src)`` as Eq. 12 reads, and added unrotated
            wherever the segment lands) or ``"canonical"`` (keys moved to positions ``0 ..`` and
            rotated to the target: the paper's "the corrected keys are then aligned to their target
            positions"; our earlier reading).
        key_frame: where the token weights compare keys: ``"canonical"`` (source and anchor base at
            positions ``0 ..``; reference KVCMAS) or ``"reader"`` (the source where this consumer
            places it, each anchor's base where its last consumer placed it; reference KVComm).
        prefix_delta: correct the PF text right after a corrected PH span (kept by ``prefix_reuse``)
            with the anchors' prefix deltas, weighted per layer and feature (reference KVComm; the
            KVCMAS reference runs with them off, ``--rank-pf 0``). Stored dense, in ``delta_frame``;
            slot scope only (the per-edge reading corrects no PF text).
        guard: ours, beyond the paper and both authors' codes: a correction never worse than no
            correction in the space it checks. Each corrected PH span's correction is shrunk toward
            zero, per layer and for keys and values apart, by a held-out estimate of its reliability
            (:func:`~hf_kvshare.anchors.correction.guard_estimate`): every anchor's delta for this
            consumer is predicted from the other anchors exactly as a source's is, and the served
            scale is the least-squares factor of those predictions clamped to ``[0, 1]`` (0 with
            fewer than two anchors). Over the held-out anchors the error at the served scale is
            never above the uncorrected one. A span served at scale 0 in every layer is reused
            uncorrected (and counted so); ``info["guard"]`` holds the scales. ``False`` (default):
            the authors' correction. Slot scope only.
        lead_in: the text between the chat header and a ``"lead"`` given text; ``None``: the last line
            of the PF segment before it in the first consumer's turn (when it holds no special token).
        prefix_reuse: an agent's PF text, computed on its first use, is placed on its later reuse
            turns re-positioned without correction (the reference's prefix delta off:
            :class:`~hf_kvshare.method.PrefixReuse`). Not on a turn that is dense (``tau = 0``, a gate
            fallback or ``turn_fallback="turn"``), so the exact settings stay exact.
        prefix_scope: ``"agent"`` (reference: kept in the instance across requests, as the authors'
            code keeps an agent's template K/V in class-level memory) or ``"request"`` (kept for one
            request).
        max_pools: pools kept by the instance (one per producing agent or PH slot name); past it the
            least recently used pool (read or written by a recorded turn) is dropped, so a workload
            with a new name per request (``doc{i}``) stays bounded. :meth:`state_summary` reports it.
        max_pool_bytes: bytes the instance's anchor pools may hold (``None``, default: bounded by
            ``max_pools`` and ``capacity`` only). After each record the least recently used pools are
            dropped whole, then the last pool's anchors by its own eviction rule, until the pools' bytes
            are within it; :meth:`state_summary` reports ``pools_bytes``, ``max_pools_bytes`` and
            ``pools_evicted_for_bytes``. ``hf-kvshare serve`` sets it (``--max-anchor-bytes``); the
            kept PF text has its own bound (:meth:`~hf_kvshare.methods.prefix_reuse.PrefixReuse.bound_prefixes`).
            Not a state option (a state loads either way, then is trimmed to it).
        defer_base: the base of an anchor whose source is chained (the question, hop to hop) is
            factorized on its first read, at save, or when the request ends, instead of when the
            anchor is stored: the next consumer's rebase (the reference's ``entry.update``) replaces
            it in the same request, so a replaced base is never factorized (one base per chained slot
            and request instead of one per consumer). The price: the pool holds that source (the
            previous hop's K/V of the slot, which the session no longer does) until then, i.e. during
            the next consumer's turn; the same factors, the saved state the same. ``False`` (default):
            factorized when stored (memory first). Not a state option (a state loads either way).
        defer_factorization: a record stores its anchors' deltas and bases unfactorized, each
            factorized by :meth:`deferred_work`'s callables or on its first read, whichever comes
            first (the same factors: the randomized SVD is seeded). The session runs them at once, in
            the record (no change); the serving host runs them on its background thread when no plan
            waits, so a dense record (the factorizations: most of its time) no longer holds up other
            requests' admission. The price: each holds the consumer's and the source's K/V of the
            span until it runs. ``hf-kvshare serve`` states it; default ``False``. Not a state option.
        verify_tokens: verify each correction on a probe of the span's last ``verify_tokens`` tokens
            before placing it (:mod:`hf_kvshare.anchors.verify`): their exact K/V, computed in one pass
            of those tokens only through every layer, attending to the agent's prefix and the
            corrected span. The correction is placed when its error on them is at most
            ``verify_threshold`` of the uncorrected source's (their exact K/V then replace the
            corrected ones: counted as recomputed); else the span is prefilled (``reason``: "verification
            probe rejected ...") and its exact delta learned. A span the gate rejected is probed too
            when an anchor holds this agent's correction: the probe may accept it. The probe's tokens
            of a rejected correction count as prefilled. 0: off (``None``: the profile's, 0 in both).
            Slot scope with ``turn_fallback="span"`` only; not served (the scheduler runs no model);
            the model's attention must be ``sdpa`` or ``eager``. Not a state option.
        verify_threshold: the largest probe error at which a correction is placed (``verify_tokens``),
            measured as ``verify_scale`` says; default 0.7 of the uncorrected source's error (KL grows
            about with the square of the K/V error, so 0.7 of FullShared's error is about half its KL).
            Not a state option.
        verify_rows: where the probe's tokens sit: ``"last"`` (default: the span's last
            ``verify_tokens``, which attend to all of it) or ``"spread"`` (evenly from its first row to
            its last: the first rows, nearest the new context, are where a correction matters most).
            Not a state option.
        verify_scale: what the probe's error is measured against: ``"source"`` (default: the
            uncorrected source's error on the same tokens; the correction must remove enough of it) or
            ``"exact"`` (the exact K/V's size: the corrected K/V must be within ``verify_threshold`` of
            the exact ones, however close the source already was). Not a state option.

    >>> method = KVCMAS()  # one instance, shared by every request's Session  # doctest: +SKIP
    >>> for query in queries:  # doctest: +SKIP
    ...     run_workflow(Session(model, tok, method), demo_workflow(tok, query))
    >>> method.state_bytes(), method.pools["query"]  # doctest: +SKIP
    """

    name = "kvcmas"
    #: the class's default given-text source chains hop to hop
    chained: ClassVar[bool] = True
    #: the benchmark gives this method its workload's tau (0.29 MMLU, 0.32 GSM8K, 0.34 HumanEval,
    #: as the KVCMAS authors ran them) unless its options set one
    workload_tau: ClassVar[bool] = True
    corrects: ClassVar[bool] = True
    rank_options: ClassVar[tuple[str, ...]] = ("base_rank", "delta_rank")
    state_keys: ClassVar[tuple[str, ...] | None] = ("pools", "next_request", "evicted", "prefixes")
    #: knobs a saved state need not match: the deferred base is factorized at save (same content);
    #: ``piecewise`` is a placement rule over the same pools
    state_fields: ClassVar[tuple[str, ...]] = (
        "defer_base",
        "defer_factorization",
        "piecewise",
        "trust_agreement",
        "gate_chained",
        "max_pool_bytes",
        "verify_tokens",
        "verify_threshold",
        "verify_scale",
        "verify_rows",
    )
    LEGACY_OPTIONS: ClassVar[dict[str, Any]] = {
        "delta_frame": "canonical",
        "key_frame": "canonical",
        "prefix_delta": False,
        # states saved before given text had kinds read every given text as the question
        "observation_source": "question",
        "gating": "reference",
        # states saved before profiles were built with every reference rule
        "profile": "reference",
        "agreement": 0.0,
        "nearest": 0.0,
        "duplicate": 0.0,
        "learn_dense": False,
    }

    base_rank: int | None = 32
    delta_rank: int | None = 32
    capacity: int = 10
    tau: float = 0.3
    temperature: float = 1.0
    token_temperature: float = 1.0
    eviction_window: int = 5
    gate_scope: str = "slot"
    output_source: str = "producer"
    text_source: str = "chained"
    observation_source: str = "lead"
    gating: str = "reference"
    match: str = "full"
    turn_fallback: str | None = None
    partial_coverage: bool = True
    skip_layer0: bool = True
    weights_cache: bool = True
    svd: str = "randomized"
    pool_peak: str = "capacity+1"
    delta_frame: str = "writer"
    key_frame: str = "canonical"
    prefix_delta: bool = False
    guard: bool = False
    lead_in: str | None = None
    prefix_reuse: bool = True
    prefix_scope: str = "agent"
    max_pools: int = 64
    max_pool_bytes: int | None = None
    defer_base: bool = False
    defer_factorization: bool = False
    profile: str = "reuse"
    agreement: float | None = None
    nearest: float | None = None
    duplicate: float | None = None
    learn_dense: bool | None = None
    piecewise: bool | None = None
    trust_agreement: bool | None = None
    gate_chained: bool | None = None
    verify_tokens: int | None = None
    verify_threshold: float = 0.7
    verify_scale: str = "source"
    verify_rows: str = "last"

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(
                f"{self.name}: profile must be one of {', '.join(map(repr, PROFILES))}, got {self.profile!r}"
            )
        for knob, value in PROFILES[self.profile].items():  # what the profile sets, unless given
            if getattr(self, knob) is None:
                setattr(self, knob, value)
        for knob in ("agreement", "nearest", "duplicate"):
            value = getattr(self, knob)
            real = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not real or not math.isfinite(value) or value < 0:
                raise ValueError(f"{self.name}: {knob} must be a finite real number >= 0, got {value!r}")
        self.check_prefix_reuse()
        check_rank("base_rank", self.base_rank)
        check_rank("delta_rank", self.delta_rank)
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 2:
            raise ValueError(
                f"capacity must be an int >= 2 (the gate needs two compatible anchors), got {self.capacity!r}"
            )
        check_tau(self.name, self.tau)
        for knob in ("temperature", "token_temperature"):
            value = getattr(self, knob)
            real = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not real or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"{self.name}: {knob} must be a finite real number > 0, got {value!r} ({type(value).__name__})"
                )
        if (
            isinstance(self.eviction_window, bool)
            or not isinstance(self.eviction_window, int)
            or self.eviction_window < 1
        ):
            raise ValueError(
                f"eviction_window must be an int >= 1, got {self.eviction_window!r} ({type(self.eviction_window).__name__})"
            )
        for knob, choices in CHOICES.items():
            if getattr(self, knob) not in choices:
                raise ValueError(
                    f"{self.name}: {knob} must be one of {', '.join(map(repr, choices))}, got {getattr(self, knob)!r}"
                )
        if self.gating == "paper" and self.gate_scope != "slot":
            raise ValueError(
                f"{self.name}: gating='paper' is a slot-scope reading (gate_scope='edge' already gates every "
                f"edge on its own); got gate_scope={self.gate_scope!r}"
            )
        if not isinstance(self.guard, bool):
            raise ValueError(f"{self.name}: guard must be True or False, got {self.guard!r}")
        if self.guard and self.gate_scope != "slot":
            raise ValueError(
                f"{self.name}: guard=True checks the slot scope's corrections (gate_scope='slot'); "
                f"got gate_scope={self.gate_scope!r}"
            )
        if self.lead_in is not None and not isinstance(self.lead_in, str):
            raise ValueError(f"{self.name}: lead_in must be a string or None, got {self.lead_in!r}")
        for knob in (
            "partial_coverage",
            "skip_layer0",
            "weights_cache",
            "prefix_delta",
            "defer_base",
            "defer_factorization",
            "learn_dense",
            "piecewise",
            "trust_agreement",
            "gate_chained",
        ):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"{self.name}: {knob} must be True or False, got {getattr(self, knob)!r}")
        self.check_verify()
        if isinstance(self.max_pools, bool) or not isinstance(self.max_pools, int) or self.max_pools < 1:
            raise ValueError(f"{self.name}: max_pools must be an int >= 1, got {self.max_pools!r}")
        check_byte_budget(f"{self.name}: max_pool_bytes", self.max_pool_bytes, optional=True)
        self._store = BoundedStore(
            self.name, "pools", self.max_pools, pools_to_state, pools_from_state, self.max_pool_bytes
        )

    def check_verify(self) -> None:
        """``verify_tokens`` an int >= 0, ``verify_threshold`` a real number > 0; a probe needs the slot
        scope and span-level fallback (a probe rejects one span when it is placed, after the plan)."""
        tokens, threshold = self.verify_tokens, self.verify_threshold
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"{self.name}: verify_tokens must be an int >= 0, got {tokens!r}")
        real = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
        if not real or not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(
                f"{self.name}: verify_threshold must be a finite real number > 0, got {threshold!r}"
            )
        if tokens and (self.gate_scope != "slot" or self.turn_fallback != "span"):
            raise ValueError(
                f"{self.name}: verify_tokens={tokens} verifies a placement and prefills that span alone when "
                f"it fails: it needs gate_scope='slot' and turn_fallback='span'; got gate_scope="
                f"{self.gate_scope!r}, turn_fallback={self.turn_fallback!r}"
            )

    @property
    def reads_prefix(self) -> bool:  # type: ignore[override]
        """A verification probe (``verify_tokens``) attends to the cache built so far."""
        return bool(self.verify_tokens)

    @property
    def supports_batch(self) -> bool:  # type: ignore[override]
        """A verification probe runs batch size 1 (:class:`~hf_kvshare.recompute.layers.SegmentRecompute`)."""
        return not self.verify_tokens

    @property
    def uses_sources(self) -> bool:  # type: ignore[override]
        """The session keeps slot caches unless every source is a reference prefill."""
        return self.output_source != "context_free" or self.text_source not in ("lead", "context_free")

    @property
    def scope(self) -> Scope:
        """The gate-scope policy (``anchors/slot_scope.py``, ``anchors/edge_scope.py``) the hooks drive;
        it reads the knobs from this instance."""
        scope = self.__dict__.get("_scope")
        if type(scope) is not SCOPES[self.gate_scope]:
            scope = self.__dict__["_scope"] = SCOPES[self.gate_scope](self.name, self, self._store)
        return scope

    # ------------------------------------------------------------------ state
    #: anchor pools (one per producing agent or PH slot name), least recently used first
    pools = Stored("entries")
    _requests = Stored("requests")

    def run_on_shard(self, shard: Shard | StageShard | FollowerShard | None) -> None:
        """Run the engine on one tensor-parallel rank's KV heads (SPMD, :mod:`~hf_kvshare.anchors.sharded`):
        the model bound next (its config: this rank's KV heads) and every K/V given are the rank's
        heads; each rank of ``shard``'s group runs the same hooks in the same order and decides what
        one rank decides over all heads. A :class:`~hf_kvshare.anchors.sharded.StageShard`: the same
        over one pipeline stage's layers, or with its ``heads`` over the rank's KV heads of them (the
        model's config: its layers and heads; ``verify_tokens`` refused: the probe runs every decoder
        layer in a row). ``None`` (the default): one rank. A
        :class:`~hf_kvshare.anchors.sharded.FollowerShard`: the scheduler's copy (every head, ``meta``
        stand-ins, the leader's values). Set before :meth:`bind` (the rank options are clamped to the
        global ``D`` there)."""
        if self.binding.model is not None:
            raise ValueError(f"{self.name}: run_on_shard must come before the method is bound to a model")
        if isinstance(shard, StageShard) and self.verify_tokens:
            raise ValueError(
                f"{self.name}: verify_tokens={self.verify_tokens} runs a probe through every decoder layer "
                f"in a row, which a pipeline stage (layers [{shard.start}, {shard.stop}) of {shard.layers}) "
                "does not hold; verify_tokens=0 runs on a stage (or worker_replicas: false keeps the "
                "scheduler's engine on every layer)"
            )
        self._store.shard = shard

    @property
    def shard(self) -> Shard | FollowerShard | None:
        """The shard the engine runs on (:meth:`run_on_shard`; ``None``: one rank)."""
        return self._store.shard

    @property
    def follower(self) -> bool:
        """Whether the engine is the scheduler's follower (:class:`~hf_kvshare.anchors.sharded.FollowerShard`):
        ``meta`` stand-ins of every head, every value a decision reads received from the leader."""
        return isinstance(self._store.shard, FollowerShard)

    #: what a host lets through instead of counting it: a follower off its leader's path decides nothing more
    fatal_errors = (FollowerDiverged,)

    def kv_bytes(self, count: Callable[[], int]) -> int:
        """The bytes of K/V a bound compares, as one rank holding every head counts them, the same on every
        member: ``count()`` (this member's heads' bytes) times the shard's column blocks, and on a follower
        the leader's count (:func:`~hf_kvshare.anchors.lowrank.bound_count`; one rank: ``count()``)."""
        shard = self._store.shard
        return bound_count(lambda: columns(count(), shard), shard)

    def prefix_state_bytes(self) -> int:
        """The kept prefixes' bytes as one rank holds them (a tensor-parallel rank's heads count as every
        head's: :func:`~hf_kvshare.anchors.lowrank.columns`; the follower's stand-ins, every head's, by
        their shapes, as its factors' bytes are counted; no communication)."""
        if self.follower:
            kept = self.__dict__.get("_kept_prefixes", {}).values()
            return sum(t.numel() * t.element_size() for kv in kept for t in (*kv.keys, *kv.values))
        return columns(super().prefix_state_bytes(), self._store.shard)

    @property
    def first_layer(self) -> int:
        """The model's index of this member's first layer (a later pipeline stage's: its first)."""
        return layer_offset(self._store.shard)

    def any_rank(self, test: Callable[[], bool]) -> bool:
        """``test`` of this member's K/V (e.g. "they hold NaN or inf"), answered alike by every rank of the
        engine's shard and its follower (:func:`~hf_kvshare.anchors.lowrank.any_rank`; one rank: ``test()``)."""
        return any_rank(test, self._store.shard)

    def attach(self, model: torch.nn.Module) -> None:
        ranks = clamp_ranks(
            model.config, self._store.shard, base_rank=self.base_rank, delta_rank=self.delta_rank
        )
        self.record_clamp(ranks)  # a saved state compares the ranks as given, clamped to the model
        self.base_rank, self.delta_rank = ranks["base_rank"], ranks["delta_rank"]
        if self.verify_tokens:
            DecoderStack(model)  # a probe runs the decoder layers one by one: refused here, not mid-turn

    def clear(self) -> None:
        """Drop every pool, kept prefix and per-request state, and forget the model."""
        self._store.clear()
        self.clear_prefixes()
        self.binding.clear()

    def on_bind(self, model: torch.nn.Module) -> None:
        move_state_to_model(self, model)  # loaded state onto the model's device

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The anchor pools (in order, with LFU counters and serials) and the next request uid."""
        table = TensorTable()
        meta = self._store.export(table)
        kept, kept_meta = self.export_prefixes()  # the agents' kept PF text (prefix_scope="agent")
        return {**table.tensors, **kept}, {**meta, "prefixes": kept_meta}

    def stage_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], model=None):
        """The pools and kept prefixes of a saved state, checked (shapes against each other and the
        saved model, delta frames) and built aside; the swap replaces them (per-request state of live
        sessions is dropped). Refused under a shard (:meth:`run_on_shard`)."""
        if self._store.shard is not None:
            raise ValueError(
                f"{self.name}: a saved state loads on one rank only: its anchors and kept prefixes hold every "
                "KV head, and an engine on a tensor-parallel rank's heads (or the scheduler's follower) would "
                "need its own heads' columns of each (not built); load it into a one-rank instance (TP = 1)"
            )
        kept_names = {k for k in tensors if k.startswith("prefix")}
        pools, next_uid, evicted = self._store.read(
            {k: v for k, v in tensors.items() if k not in kept_names}, meta, state_dims(model)
        )
        frames = {a.frame for pool in pools.values() for a in pool}
        if frames - {self.delta_frame}:
            raise ValueError(
                f"{self.name}: the saved anchors hold deltas in the {', '.join(sorted(frames))} frame but this "
                f"instance has delta_frame={self.delta_frame!r}; load them into {self.name}:delta_frame="
                f"{sorted(frames)[0]} (states saved before delta_frame existed are 'canonical')"
            )
        kept = self.stage_prefixes({k: tensors[k] for k in kept_names}, meta.get("prefixes", []), model)

        def swap() -> None:
            self.adopt_prefixes(kept)
            self._store.replace(pools, next_uid, evicted)

        return swap

    def request_state_bytes(self, session: Session) -> int:
        """The request's reference prefills, the producer caches the session no longer holds and the
        kept PF text (``prefix_reuse``)."""
        return self._requests.nbytes(session) + super().request_state_bytes(session)

    def state_bytes(self) -> int:
        """Exact bytes of all anchor pools (every stored factor / dense tensor) and kept PF text."""
        return self._store.nbytes + self.prefix_state_bytes()

    def state_summary(self) -> dict[str, Any]:
        return {
            "bytes": self.state_bytes(),
            **self._store.summary(),
            "anchors": sum(len(p) for p in self.pools.values()),
            "prefixes": len(self.__dict__.get("_kept_prefixes", {})),
            **self.prefix_summary(),
        }

    def _checked_options(self) -> frozenset[str]:
        """``max_pool_bytes`` assigned later is checked as the constructor checks it, though a saved
        state need not match it (:attr:`state_fields`); it applies from the next record on."""
        return super()._checked_options() | {"max_pool_bytes"}

    def bound_pools(self, max_bytes: int | None) -> None:
        """Keep the anchor pools within ``max_bytes`` from now on (``max_pool_bytes``), trimmed at once;
        a bad value changes nothing."""
        self.max_pool_bytes = max_bytes  # checked (Method.__setattr__)
        self._store.bound_bytes(max_bytes)

    def pool_report(self) -> list[dict[str, Any]]:
        return [pool.describe() for pool in self.pools.values()]

    # ------------------------------------------------------------------ hooks
    def new_cache(self, turn: Turn) -> CorrectedCache:
        return CorrectedCache(turn.model.config, method=self.name)

    def plan(self, turn: Turn) -> None:
        """Slot scope decides every PH span of the turn here; edge scope decides each when placed."""
        self.bind_once(turn.model)
        self.scope.plan(turn)

    def placeholder(self, turn: Turn, span, cache) -> Placement | None:
        reuse = self.scope.place(turn, span, cache)
        if reuse is None:
            return None
        return Placement(
            kv=reuse.kv,
            provenance=reuse.provenance,
            source_agent=reuse.source_agent,
            info=reuse.info,
            corrected_tokens=reuse.corrected_tokens,
            reused_tokens=reuse.reused_tokens,
        )

    def prefix_reuse_allowed(self, turn: Turn) -> bool:
        """Kept PF text is placed only on a reuse turn: ``tau > 0`` and (slot scope) no PH span of the
        turn prefilled because of a gate rejection (the reference's dense mode prefills everything)."""
        return self.tau != 0 and not self.scope.dense_turn(turn)

    def prefix(self, turn: Turn, span, cache) -> Placement | None:
        """Kept PF text (``prefix_reuse``); with ``prefix_delta``, the PF right after a corrected PH span
        gets the anchors' prefix deltas for this agent (:meth:`SlotScope.correct_prefix`)."""
        placement = super().prefix(turn, span, cache)
        corrected = None if placement is None else self.scope.correct_prefix(turn, span, placement.kv)
        if corrected is not None:
            placement.kv, placement.info["prefix_delta"] = corrected
        return placement

    def finish(self, turn: Turn, cache) -> None:
        self.scope.report(turn, cache)

    def reads_latest(self, turn: Turn, slot: str) -> bool:
        """Only a chained source reads a slot's latest K/V (``output_source`` / ``text_source`` /
        ``observation_source="chained"``); the producer's cache of an output and the first given text
        are kept in the request's state, a reference prefill there too: no later turn reads the copies
        the session extracted of those slots."""
        return self.scope.source_kind(turn, slot) == "chained"

    def has_source(self, request: Any, slot: str) -> bool:
        """The slot's source as :meth:`Scope.source <hf_kvshare.anchors.scope.Scope.source>` reads it: a
        chained one is the slot's latest K/V; an output's producer cache and a first given text's are in
        the request's state (the slot's latest is freed after each record: :meth:`reads_latest`); a
        reference prefill is the method's own work, which no record adds to (always there)."""
        held = request.slots.get(slot)
        if held is None:
            return False
        kind = self.scope.slot_source_kind(held)
        if kind == "chained":
            return held.latest is not None
        if kind in ("producer", "first"):
            state = self._requests.find(request)
            return state is not None and slot in state.produced
        return True

    def readers_add_source(self, request: Any, slot: str) -> bool:
        """An output's producer cache is kept by its producer's record alone (the one that made the
        slot): no reader's record adds it. A chained source and a first given text's are kept by the
        records of the turns that read them."""
        held = request.slots.get(slot)
        return held is None or self.scope.slot_source_kind(held) != "producer"

    def why_not_placed(self, turn: Turn, span) -> str | None:
        """The reason of the gate or fallback that left ``span`` dense (its report's); ``None`` where the
        turn had no source to decide on (the first reader: the host knows why)."""
        edge = self.scope.edges(turn).get(span.start)
        if edge is None or edge.source is None or edge.dense is None:
            return None
        return edge.report().get("reason") or None

    def record(self, turn: Turn, cache) -> None:
        """After the first token: keep the producer's cache of the output (and its gate decision),
        then store the observed corrections of the spans that were prefilled because of a rejection
        (accepted corrections are never inserted); then keep the agent's PF text and commit."""
        self.scope.learn(turn, cache)
        super().record(turn, cache)  # PrefixReuse: keep the agent's newly computed PF text
        self.scope.commit(turn)
        self._store.bound_bytes(self.max_pool_bytes)  # the pools' bytes, as set now, after the record

    def deferred_work(self) -> list[Callable[[], None]]:
        """The anchors' factorizations the records left for later (``defer_factorization``)."""
        return self.scope.deferred_work()

"""The method contract and its registry.

A method turns one agent turn (a tokenized trajectory) into a :class:`SharedCache` before
``generate`` and may learn from the turn afterwards. One method per file under
:mod:`hf_kvshare.methods`, each a dataclass whose fields are its options; each registers itself
with :func:`register`. A method *instance* holds what outlives one request (anchor pools,
calibration profiles) and may be shared by many sessions; per-request state (slot contents, the
latest materialized cache of each slot) lives with the request (the
:class:`~hf_kvshare.session.Session`), read through the :class:`~hf_kvshare.turn.Turn`.

The hooks every host drives (:meth:`Method.build` here, the Session, a serving host): ``plan(turn)``,
then ``placeholder`` / ``prefix`` per span, ``finish(turn, cache)``, and after the output
``record(turn, cache)``. Saving and loading the cross-request state is
:class:`~hf_kvshare.persistence.StatePersistence` (a base of :class:`Method`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from . import mrope
from ._compat import is_peft_model
from .cache import CachePart, SegmentKV, SharedCache
from .identity import ModelBinding
from .persistence import STATE_FORMAT, STATE_JSON, STATE_TENSORS, StatePersistence
from .prefill import prefill_parts, recompute_is_cheaper
from .rope import RopeShifter

if TYPE_CHECKING:
    from .session import Session
    from .turn import Turn

__all__ = [
    "METHODS",
    "STATE_FORMAT",
    "STATE_JSON",
    "STATE_TENSORS",
    "Method",
    "Placement",
    "get_method",
    "option_names",
    "register",
]

METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make ``cls`` available as ``METHODS[cls.name]``."""
    if not getattr(cls, "name", None):
        raise ValueError(f"{cls.__name__} needs a `name` class attribute to be registered")
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} is already registered by {METHODS[cls.name].__name__}")
    METHODS[cls.name] = cls
    return cls


def get_method(method: str | Method, **options: Any) -> Method:
    """A method instance from a registry name (with options) or an instance (options refused)."""
    if isinstance(method, Method):
        if options:
            raise ValueError(
                f"options {sorted(options)} were given with a {type(method).__name__} instance; "
                "set them on the instance instead"
            )
        return method
    if not isinstance(method, str):
        raise TypeError(f"method must be a registry name or a Method instance, got {type(method).__name__}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; registered methods: {', '.join(sorted(METHODS))}")
    valid = option_names(METHODS[method])
    unknown = sorted(set(options) - set(valid)) if valid is not None else []
    if unknown:
        raise ValueError(
            f"method {method!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(valid) or 'none'}"
        )
    return METHODS[method](**options)


def option_names(cls: type[Method]) -> list[str] | None:
    """Keyword options a method class accepts (``None`` when it takes ``**kwargs``)."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


@dataclass
class Placement:
    """How a PH segment's K/V is obtained without a dense prefill of the whole segment.

    ``kv`` sits at the segment's target positions, or where its source sat (the builder re-positions it
    layer by layer as it copies it into the cache: :meth:`SegmentedCache.append_kv`,
    :meth:`SegmentedCache.reserve`). ``reused_tokens`` counts the tokens whose K/V
    was not computed by the model for this agent (all of them for reuse and correction; ``None``
    means all). Methods that recompute some layers of a token count token-equivalents: reused
    (token, layer) entries divided by the number of layers, possibly fractional.
    """

    kv: SegmentKV
    provenance: str = "reused"
    source_agent: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    reused_tokens: float | None = None
    #: of the reused tokens, those served through an accepted delta correction (``None``: all of them
    #: when ``provenance == "corrected"``, else none); the rest is reused uncorrected
    corrected_tokens: float | None = None


class Method(StatePersistence):
    """Base class: every PF and PH segment prefilled densely (i.e. NonShared behaviour).

    A method is a ``@dataclass(eq=False)`` subclass whose fields are its options (checked in
    ``__post_init__``, errors naming the expected and the given value; saved states record them and
    refuse an instance with other values). It overrides :meth:`plan`, :meth:`placeholder` (return a
    :class:`Placement` to reuse a PH segment), :meth:`prefix`, :meth:`finish`, or :meth:`build`
    entirely, and :meth:`record` to learn from a finished turn. Method mixins (prefix reuse, boundary
    capture) live in :mod:`hf_kvshare.methods` too; engines hold none.
    """

    name: ClassVar[str] = ""
    #: the session keeps each slot's latest materialized cache (chaining / reuse source)
    uses_sources: ClassVar[bool] = True
    #: ``placeholder`` reads the cache built so far (pending dense work is flushed first)
    reads_prefix: ClassVar[bool] = False
    #: ``build_cache(batch_size > 1)`` is supported
    supports_batch: ClassVar[bool] = True
    #: works only on a ``PeftModel`` whose agents are named adapters (the benchmark runs such a
    #: method only on workloads whose agents name adapters)
    requires_adapters: ClassVar[bool] = False
    #: a correction method (KVCMAS, KVComm, GraphFlow): the paper's rho counts only its corrected
    #: tokens as reused (``TurnResult.paper_reuse_ratio``); serving a run uncorrected is reported
    corrects: ClassVar[bool] = False
    #: moves K/V between positions (a :class:`~hf_kvshare.rope.RopeShifter`): a model whose RoPE cannot
    #: be shifted (dynamic NTK) is refused when the session is created
    repositions: ClassVar[bool] = True
    #: computes an image / video segment (``PH(slot, image=...)``) from its input embeddings
    #: (``CachePart.embeds``, references and recomputation included); ``False`` refuses such segments
    visual_segments: ClassVar[bool] = True

    @property
    def binding(self) -> ModelBinding:
        """The model this instance is bound to (the first one :meth:`bind` saw)."""
        binding = self.__dict__.get("_model_binding")
        if binding is None:
            binding = self.__dict__["_model_binding"] = ModelBinding(type(self).__name__)
        return binding

    def bind(self, model: torch.nn.Module) -> None:
        """Bind this instance to ``model`` (each session calls it on creation): a method instance serves
        one model; another model object is refused with ``ValueError`` before anything changes. Then
        :meth:`attach` checks the model; the binding is recorded only once it accepted."""
        self.binding.check(model)
        if self.repositions:
            RopeShifter.from_model(model)  # a clear ValueError for RoPE that cannot be shifted
        self.attach(model)
        self.bind_once(model)

    def bind_once(self, model: torch.nn.Module) -> None:
        """Record the binding (raises for another model); :meth:`on_bind` runs when it is new."""
        if self.binding.bind(model):
            self.on_bind(model)

    def on_bind(self, model: torch.nn.Module) -> None:
        """Called once, when the instance is first bound to ``model`` (e.g. move loaded state to
        the model's device)."""

    def attach(self, model: torch.nn.Module) -> None:
        """Check ``model`` and set up what the method needs from it (engines); raise ``ValueError`` for
        a model it cannot serve. Called by :meth:`bind` (use that)."""

    # ------------------------------------------------------------ building
    def new_cache(self, turn: Turn) -> SharedCache:
        """The empty cache :meth:`build` fills (a method may return a :class:`SharedCache` subclass)."""
        return turn.new_cache()

    def placeholder(self, turn: Turn, span, cache: SharedCache) -> Placement | None:
        """K/V for PH ``span`` of this turn, or ``None`` to prefill it densely."""
        return None

    def prefix(self, turn: Turn, span, cache: SharedCache) -> Placement | None:
        """K/V for PF ``span`` of this turn (e.g. the agent's own prompt text kept from its earlier turn:
        prefix reuse), or ``None`` to compute it (the default: PF text is always computed)."""
        return None

    def plan(self, turn: Turn) -> None:
        """Decide what the turn will place before any span is placed (e.g. the correction methods'
        gate, taken once for the whole turn). Every host calls it first: :meth:`build` here, the
        serving connector before it asks :meth:`placeholder` / :meth:`prefix` for each span."""

    def finish(self, turn: Turn, cache: SharedCache) -> None:
        """Called with the built cache, before ``generate`` (e.g. report rows of the segment table)."""

    def build(self, turn: Turn) -> SharedCache:
        """Build the turn's cache: :meth:`plan`, place what :meth:`placeholder` / :meth:`prefix`
        return, then compute every token left dense in ONE forward (:func:`~hf_kvshare.prefill.prefill_parts`:
        true positions, a mask built from positions), then :meth:`finish`. The prompt's last token is
        left out for ``generate``; so is the run of computed agent (PF) text after the last placed or
        PH part when every part before it is placed and the caller's forward starts at the cache's end
        (``turn.generate_tail``: :meth:`tail_for_generate`), which then computes that text with the
        last token in one forward instead of two. A method that reads the cache built so far (``reads_prefix``) gets it
        complete up to each PH segment."""
        self.plan(turn)
        cache = self.new_cache(turn)
        parts: list[CachePart] = []

        def flush() -> None:
            if parts:
                turn.stats.tokens_prefilled += sum(p.segment.length for p in parts if p.dense)
                moved = any(not p.dense and p.kv.start != p.segment.start for p in parts)
                prefill_parts(cache, turn.model, parts, turn.shifter if moved else None)
                parts.clear()

        for span in turn.spans:
            if span.kind == "PH":
                if self.reads_prefix:
                    flush()
                placement = self.placeholder(turn, span, cache)
            else:
                placement = self.prefix(turn, span, cache)
            parts.append(turn.part(span, placement))
            turn.stats.count(span, placement)
        last = parts.pop()  # the prompt's last token is generate's
        last.segment.end -= 1
        if not last.dense and last.segment.kind == "PF":
            turn.stats.pf_reused -= 1  # generate computes it (counted in tokens_prefilled), not reused
        if last.segment.length:
            if last.dense:
                last.token_ids = last.token_ids[..., :-1]
            else:
                last.kv = last.kv.prefix(last.segment.length)
            parts.append(last)
        if not cache.get_seq_length():
            _compute_kept_text(turn, parts)
        tail = self.tail_for_generate(turn, parts)
        del parts[len(parts) - len(tail) :]
        turn.tail_segments = [p.segment for p in tail]
        flush()
        self.finish(turn, cache)
        return cache

    def tail_for_generate(self, turn: Turn, parts: list[CachePart]) -> list[CachePart]:
        """The trailing parts of ``parts`` (the prompt minus its last token, in order) that
        :meth:`build` leaves to the caller's forward: the run of computed PF text after the last part
        that is placed, a PH span or an image, when every part before it is placed (so build runs no
        forward: a FullShared or KVCMAS turn with prefix reuse). That forward (``generate``'s first)
        computes the prompt's uncached tokens in one pass with the causal mask, which is exactly their
        attention here (they follow everything in the cache), so the turn runs one forward fewer than
        prefilling them and then feeding the last token. Where build computes other text anyway the
        trailing text stays in that forward: splitting it off measured slower (FullShared without
        prefix reuse, trace at 2,048 tokens: 0.72 s against 0.61 s per reuse turn,
        measured at commit 1e65350).

        Empty unless ``turn.generate_tail`` (``Session.run_turn`` sets it; ``build_cache`` does not),
        and on a multimodal-RoPE model (generate's positions come from the cache's track), for a
        method whose generation differs from its prefill (its own ``generation_context`` or
        ``forward_kwargs``: an adapter selected for generation, layer inputs recorded), and on a PEFT
        model (the LoRA methods are such methods, so every method there prefills the text and
        NonShared stays their exact reference: one forward or two differ by float rounding, by 1e-3
        on a 4-bit base): there the text is prefilled as before."""
        if not turn.generate_tail or mrope.is_mrope(turn.model) or is_peft_model(turn.model):
            return []
        own = type(self)
        if (
            own.generation_context is not Method.generation_context
            or own.forward_kwargs is not Method.forward_kwargs
        ):
            return []
        n = len(parts)
        while n and parts[n - 1].dense and parts[n - 1].segment.kind == "PF":
            p = parts[n - 1]
            if p.embeds is not None or p.rope is not None:
                break
            n -= 1
        if any(p.dense for p in parts[:n]):
            return []  # build runs a forward anyway: the text goes into that one (measured faster)
        return parts[n:]

    # ------------------------------------------------------------ learning
    def record(self, turn: Turn, cache: SharedCache) -> None:
        """Learn from the finished turn (after the session stored the slot caches)."""

    def deferred_work(self) -> list[Callable[[], None]]:
        """Work the records since the last call left for later (e.g. KVCMAS's anchor factorizations
        with ``defer_factorization``), one callable per part, none by default. Nothing reads a result
        before it is there: a turn that needs one first computes it itself. The session runs them
        right after :meth:`record`; the serving host on its background thread when no plan waits."""
        return []

    def reads_latest(self, turn: Turn, slot: str) -> bool:
        """Whether a later turn may read ``slot``'s latest K/V (``Slot.latest``, which this turn just
        replaced); asked by the session after :meth:`record` for this turn's slots, which drops the ones
        no later turn can read (their memory freed now). Default ``True`` (kept: FullShared and the
        recomputation methods read any slot's latest)."""
        return True

    # ------------------------------------------------------------ generation hooks
    def generation_context(self, turn: Turn) -> contextlib.AbstractContextManager:
        """Context entered around ``generate`` (e.g. selecting the agent's LoRA adapter)."""
        return contextlib.nullcontext()

    def generate_kwargs(self, turn: Turn) -> dict[str, Any]:
        """Extra keyword arguments for ``generate`` only (e.g. a logits processor)."""
        return {}

    def forward_kwargs(self, turn: Turn) -> dict[str, Any]:
        """Extra keyword arguments for every model call of the turn: the session's ``generate`` and
        teacher-forced forward (e.g. PEFT's ``adapter_names`` for a mixed-adapter batch)."""
        return {}

    def state_bytes(self) -> int:
        """Bytes held by the method instance across requests (anchor pools, profiles, ...)."""
        return 0

    def state_summary(self) -> dict[str, Any]:
        """What the instance keeps across requests: ``bytes`` (:meth:`state_bytes`) and, for methods
        that keep one entry per name (pools, profiles), their count, bound and evictions."""
        return {"bytes": self.state_bytes()}

    def request_state_bytes(self, session: Session) -> int:
        """Bytes the method keeps for one request (PReCache's shared base and per-agent LR caches in
        ``session.method_state``, non-chained correction's context-free references); the slots' K/V
        the session keeps (:meth:`Session.held_bytes` adds them) are not counted here."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _compute_kept_text(turn: Turn, parts: list[CachePart]) -> None:
    """Give back the agent's own kept text at the start of an empty cache (prefix reuse's placed PF
    parts) when one run of computed parts follows it, with nothing computed after the placed parts
    that may follow that run, and computing the kept text with the run is cheaper
    (:func:`~hf_kvshare.prefill.recompute_is_cheaper`). The run is then one forward from the cache's
    start with the causal mask alone (SDPA keeps its causal kernels, no ``[q, kv]`` mask), the later
    placed parts appended after it, instead of a forward from behind the kept text with an explicit
    mask: a first agent's turn over a new document, whose dense prefill ran about 1.3x slower behind 40
    placed tokens at 2,048 tokens on one CPU thread. The kept K/V are the same tokens at the same
    positions, so only the time changes; the rows become ``dense`` with ``info["prefix_recomputed"]``
    and the turn's counts say so (``pf_reused`` less, ``tokens_prefilled`` more)."""
    n = 0
    while n < len(parts) and not parts[n].dense:
        segment = parts[n].segment
        if segment.kind != "PF" or segment.provenance != "reused" or segment.source_agent != turn.agent:
            return
        n += 1
    end = n
    while end < len(parts) and parts[end].dense:
        end += 1
    if not n or end == n or any(p.dense for p in parts[end:]):
        return
    placed = sum(p.segment.length for p in parts[:n])
    if not recompute_is_cheaper(turn.model, placed, sum(p.segment.length for p in parts[n:end])):
        return
    spans = {s.start: s for s in turn.spans}
    for i in range(n):
        span = spans[parts[i].segment.start]  # never the prompt's last part: computed parts follow
        parts[i] = turn.part(span, None)
        parts[i].segment.info["prefix_recomputed"] = True
        turn.stats.pf_reused -= span.length

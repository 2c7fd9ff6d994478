"""The method contract and its registry.

A method turns one agent turn (a tokenized trajectory) into a :class:`SharedCache` before
``generate`` and may learn from the turn afterwards. One method per file under
:mod:`hf_kvshare.methods`, each a dataclass whose fields are its options; each registers itself
with :func:`register`. A method *instance* holds what outlives one request (anchor pools,
calibration profiles) and may be shared by many sessions; per-request state (slot contents, the
latest materialized cache of each slot) lives with the request (a :class:`~hf_kvshare.request.Request`:
the :class:`~hf_kvshare.session.Session`, a served task), read through the :class:`~hf_kvshare.turn.Turn`.

The hooks every host drives through the one walk (:class:`~hf_kvshare.walk.Walk`: the Session's HF
executor, :mod:`hf_kvshare.executor`, and the serving host): ``plan(turn)``, then ``placeholder`` /
``prefix`` per span, ``finish(turn, cache)``, and after the output ``record(turn, cache)``. This module
defines the contract and runs no model. Saving and loading the cross-request state is
:class:`~hf_kvshare.persistence.StatePersistence` (a base of :class:`Method`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import reprlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .cache import SegmentKV, SharedCache
from .identity import ModelBinding
from .persistence import STATE_FORMAT, STATE_JSON, STATE_TENSORS, StatePersistence
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


class _MethodType(type):
    """The methods' metaclass: an instance's options count as checked once its construction (the
    dataclass ``__init__`` and ``__post_init__``) is done; an option assigned afterwards is checked
    again (:meth:`Method.__setattr__`)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = super().__call__(*args, **kwargs)
        instance.__dict__["_options_checked"] = True
        return instance

    @property
    def __signature__(cls) -> inspect.Signature:
        """The class's signature is its ``__init__``'s (its options), not this ``__call__``'s."""
        init = inspect.signature(cls.__init__)
        return init.replace(parameters=list(init.parameters.values())[1:])


class Method(StatePersistence, metaclass=_MethodType):
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
    #: places a span's K/V from elsewhere at all (NonShared: never; a server then tells its readers
    #: the method shares nothing rather than to wait for another request's record)
    places: ClassVar[bool] = True
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
        """The empty cache the walk fills (a method may return a :class:`SharedCache` subclass)."""
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
        gate, taken once for the whole turn). Every host calls it first (:meth:`hf_kvshare.walk.Walk.plan`),
        before it asks :meth:`placeholder` / :meth:`prefix` for each span."""

    def finish(self, turn: Turn, cache: SharedCache) -> None:
        """Called with the built cache, before ``generate`` (e.g. report rows of the segment table)."""

    def build(self, turn: Turn) -> SharedCache:
        """The turn's cache, built by the executor that runs the turn (``turn.executor``: the HF
        executor's :meth:`~hf_kvshare.executor.HFExecutor.walk`: the walk over this method's
        hooks, every token left dense in ONE forward, the prompt's last token left to ``generate``). A
        method may wrap it (boundary capture records around it) or build its cache itself (PReCache)."""
        if turn.executor is None:
            raise TypeError(
                f"{type(self).__name__}.build runs on the HF executor (hf_kvshare.executor.HFExecutor, "
                "which a Session's turn has); this turn has none (a served turn: the engine computes it)"
            )
        return turn.executor.walk(self, turn)

    def tail_for_generate(self, turn: Turn, parts: list) -> list:
        """Deprecated: the HF executor decides what it leaves to ``generate``
        (:meth:`hf_kvshare.executor.HFExecutor.tail_for_generate`); this calls it. A subclass that
        still overrides it decides in its place."""
        warnings.warn(
            "Method.tail_for_generate is deprecated: use hf_kvshare.executor.HFExecutor.tail_for_generate",
            DeprecationWarning,
            stacklevel=2,
        )
        return [] if turn.executor is None else turn.executor.tail_for_generate(self, turn, parts)

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

    def has_source(self, request: Any, slot: str) -> bool:
        """Whether ``request``'s (a :class:`~hf_kvshare.request.Request`) ``slot`` has now the K/V a
        later turn's placement of it reads (its source); asked by the serving host without a turn: a
        slot without one that an open turn reads is "not recorded yet" (a reader may wait for that
        record), a slot with one is not. Default: the slot holds its latest K/V (``Slot.latest``: what
        FullShared and the recomputation methods read). A method that keeps its sources elsewhere
        answers from there (KVCMAS: its request state). Read only, without the store's lock."""
        held = request.slots.get(slot)
        return held is not None and held.latest is not None

    def readers_add_source(self, request: Any, slot: str) -> bool:
        """Whether the record of a turn that reads ``request``'s ``slot`` gives it the source
        :meth:`has_source` looks for (a reader in flight is then worth waiting for); asked by the serving
        host when the slot has none. Default ``True``: a reader's record keeps the slot's latest K/V. A
        method whose source only the slot's producer records says ``False`` there (KVCMAS's
        ``output_source="producer"``: an output's producer cache, kept when it was recorded or never)."""
        return True

    def why_not_placed(self, turn: Turn, span: Any) -> str | None:
        """Why the method placed nothing at PH ``span`` of ``turn`` (its ``placeholder`` returned
        ``None``), in its own words (KVCMAS: its gate's reason); asked by the serving host at admission
        for the claim's stop and the reply's report. ``None`` (the default): it says nothing, and the
        host names what it knows (no K/V kept, evicted)."""
        return None

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

    def __setattr__(self, name: str, value: Any) -> None:
        """An option (a dataclass field the saved state compares) assigned after construction is checked
        as the constructor checks it (``m.tau = "x"`` raises as ``KVCMAS(tau="x")`` does, and the
        instance keeps its value); the value kept is the one the constructor would keep."""
        if self.__dict__.get("_options_checked") and name in self._checked_options():
            options = {**self.state_options(), name: value}
            try:
                probe = type(self)(**options)  # a throwaway instance: every check of __post_init__
            except (TypeError, ValueError) as error:
                kind = TypeError if isinstance(error, TypeError) else ValueError
                shown = reprlib.repr(value)
                raise kind(f"{type(self).__name__}.{name} = {shown} refused: {error}") from error
            value = getattr(probe, name)
        object.__setattr__(self, name, value)

    def _checked_options(self) -> frozenset[str]:
        if not dataclasses.is_dataclass(self):
            return frozenset()
        return frozenset(
            f.name for f in dataclasses.fields(self) if f.init and f.name not in self.state_fields
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

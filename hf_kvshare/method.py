"""The method interface and its registry.

A method turns one agent turn (a tokenized trajectory) into a :class:`SharedCache` before
``generate`` and may learn from the turn afterwards. One method per file; each registers itself
with :func:`register`. A method *instance* holds what outlives one request (anchor pools,
calibration profiles) and may be shared by many sessions; per-request state (slot contents, the
latest materialized cache of each slot) lives in the :class:`~hf_kvshare.session.Session`.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .cache import SegmentKV, SharedCache
from .identity import ModelBinding
from .rope import RopeShifter

if TYPE_CHECKING:
    from .session import Session
    from .turn import Turn

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

    ``kv`` sits at the segment's target positions. ``reused_tokens`` counts the tokens whose K/V
    was not computed by the model for this agent (all of them for reuse and correction; ``None``
    means all). Methods that recompute some layers of a token count token-equivalents: reused
    (token, layer) entries divided by the number of layers, possibly fractional.
    """

    kv: SegmentKV
    provenance: str = "reused"
    source_agent: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    reused_tokens: float | None = None


class Method:
    """Base class: every PF and PH segment prefilled densely (i.e. NonShared behaviour).

    Subclasses override :meth:`placeholder` (return a :class:`Placement` to reuse a PH segment),
    or :meth:`build` entirely, and :meth:`record` to learn from a finished turn.
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
    #: moves K/V between positions (a :class:`~hf_kvshare.rope.RopeShifter`): a model whose RoPE cannot
    #: be shifted (dynamic NTK) is refused when the session is created
    repositions: ClassVar[bool] = True

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
        self.binding.bind(model)

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

    def build(self, turn: Turn) -> SharedCache:
        """Build the turn's cache: consecutive dense segments run as one forward; the prompt's last
        token is left out for ``generate``."""
        cache = self.new_cache(turn)
        pending: list = []
        last = len(turn.spans) - 1

        def flush(drop_last: bool = False) -> None:
            if not pending:
                return
            ids = torch.cat([s.token_ids for s in pending])
            segments = [turn.segment_for(s, "dense") for s in pending]
            if drop_last:
                ids = ids[:-1]
                segments[-1].end -= 1
                if segments[-1].length == 0:
                    segments.pop()
            turn.stats.tokens_prefilled += ids.numel()
            cache.append_dense(turn.model, turn.batch(ids), segments)
            pending.clear()

        for i, span in enumerate(turn.spans):
            placement = None
            if span.kind == "PH":
                if self.reads_prefix:
                    flush()
                placement = self.placeholder(turn, span, cache)
            if placement is None:
                pending.append(span)
                continue
            flush()
            turn.place(cache, span, placement)
            if i == last:
                cache.crop(-1)
        flush(drop_last=True)
        return cache

    # ------------------------------------------------------------ learning
    def record(self, turn: Turn, cache: SharedCache) -> None:
        """Learn from the finished turn (after the session stored the slot caches)."""

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

"""The method interface and its registry.

A method turns one agent turn (a tokenized trajectory) into a :class:`SharedCache` before
``generate`` and may learn from the turn afterwards. One method per file; each registers itself
with :func:`register`. A method *instance* holds what outlives one request (anchor pools,
calibration profiles) and may be shared by many sessions; per-request state (slot contents, the
latest materialized cache of each slot) lives in the :class:`~hf_kvshare.session.Session`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .cache import CachePart, SegmentKV, SharedCache
from .identity import ModelBinding, ModelFingerprint, model_fingerprint
from .prefill import prefill_parts
from .rope import RopeShifter

if TYPE_CHECKING:
    from .session import Session
    from .turn import Turn

METHODS: dict[str, type[Method]] = {}
#: layout version of what :meth:`Method.save_state` writes
STATE_FORMAT = 1
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"


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
        left out for ``generate``. A method that reads the cache built so far (``reads_prefix``) gets it
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
        last = parts.pop()  # the prompt's last token is generate's
        last.segment.end -= 1
        if last.segment.length:
            if last.dense:
                last.token_ids = last.token_ids[..., :-1]
            else:
                last.kv = last.kv.prefix(last.segment.length)
            parts.append(last)
        flush()
        self.finish(turn, cache)
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

    # ------------------------------------------------------------ saving and loading state
    #: option fields the saved state itself carries (not compared on load)
    state_fields: ClassVar[tuple[str, ...]] = ()

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What the instance keeps across requests as ``(named tensors, JSON-able metadata)``.

        The default is nothing: the method keeps no state across requests (or only per-request
        state, such as the LR methods' per-session caches), and saves an empty state. Methods that
        learn across requests override this, :meth:`import_state` and :meth:`state_model`.
        """
        return {}, {}

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Replace the instance's cross-request state by an exported one (already validated)."""
        if tensors or meta:
            raise ValueError(
                f"{type(self).__name__} keeps no state across requests, but the saved state holds "
                f"{len(tensors)} tensors and metadata keys {sorted(meta)}"
            )

    def state_model(self) -> torch.nn.Module | None:
        """The model the cross-request state was built on (``None``: not bound to one yet)."""
        return self.binding.model

    def expect_model(self, fingerprint: ModelFingerprint | None) -> None:
        """Remember that the loaded state was built on ``fingerprint``: the first model this instance
        is bound to must have it (:class:`~hf_kvshare.identity.ModelBinding`)."""
        if self.binding.model is None:
            self.binding.expected = fingerprint

    def check_expected_model(self, model: torch.nn.Module) -> None:
        """Raise when ``model`` is not the model this instance is bound to or its loaded state was
        built on."""
        self.binding.check(model)

    #: options added after states were first saved -> the value a state saved without them was built
    #: with (such a state loads into an instance with that value)
    LEGACY_OPTIONS: ClassVar[dict[str, Any]] = {}

    def state_options(self) -> dict[str, Any]:
        """The knobs (dataclass fields) that must match for a saved state to be loaded."""
        if not dataclasses.is_dataclass(self):
            return {}
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.init and f.name not in self.state_fields
        }

    def save_state(self, directory: str | os.PathLike, model: torch.nn.Module | None = None) -> Path:
        """Write the cross-request state to ``directory``: ``state.json`` (method, options, model
        fingerprint, metadata) and ``state.safetensors`` (tensors). No pickle. ``model`` is needed
        only when the instance holds state it was not bound to a model for.

        >>> method.save_state("runs/state/kvcmas")  # doctest: +SKIP
        >>> fresh = KVCMAS(); fresh.load_state("runs/state/kvcmas", model)  # doctest: +SKIP
        """
        from safetensors.torch import save_file

        tensors, meta = self.export_state()
        bound = self.state_model()
        if model is not None and bound is not None and model is not bound:
            raise ValueError(
                f"{type(self).__name__}: its state was built on another model object than the model= given"
            )
        model = model if model is not None else bound
        if model is None and (tensors or meta):
            raise ValueError(
                f"{type(self).__name__} holds state but is bound to no model; pass model= (the model it was built on)"
            )
        header = {
            "format": STATE_FORMAT,
            "method": self.name,
            "options": _json_options(self.state_options()),
            "model": None if model is None else model_fingerprint(model).to_dict(),
            "meta": meta,
        }
        text = json.dumps(header, indent=1, allow_nan=False)  # raises on what JSON cannot hold
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / STATE_TENSORS))
        (directory / STATE_JSON).write_text(text)
        return directory

    def load_state(self, directory: str | os.PathLike, model: torch.nn.Module | None = None) -> None:
        """Replace this instance's cross-request state by the one :meth:`save_state` wrote.

        Refused (nothing changes) when the files are missing or damaged, the method or its options
        differ, or the state was built on another model: the model given, the model the instance is
        bound to, else the first model it is attached to afterwards must have the saved fingerprint.
        """
        from safetensors.torch import load_file

        directory = Path(directory)
        header_path, tensor_path = directory / STATE_JSON, directory / STATE_TENSORS
        if not header_path.is_file() or not tensor_path.is_file():
            raise ValueError(
                f"{str(directory)!r} holds no saved method state (expected {STATE_JSON} and {STATE_TENSORS} "
                "written by Method.save_state)"
            )
        try:
            header = json.loads(header_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{header_path}: not a saved method state ({error})") from error
        if not isinstance(header, dict) or header.get("format") != STATE_FORMAT:
            got = header.get("format") if isinstance(header, dict) else header
            raise ValueError(f"{header_path}: state format {STATE_FORMAT} expected, got {got!r}")
        if header.get("method") != self.name:
            raise ValueError(
                f"{header_path} holds the state of method {header.get('method')!r}, not {self.name!r}"
            )
        mine = _json_options(self.state_options())
        saved = {**self.LEGACY_OPTIONS, **(header.get("options") or {})}
        if saved != mine:
            diff = [
                f"{k}: saved {saved.get(k)!r}, this instance {mine.get(k)!r}"
                for k in sorted({*saved, *mine})
                if saved.get(k) != mine.get(k)
            ]
            raise ValueError(f"{header_path}: the state was saved with other options ({'; '.join(diff)})")
        fingerprint = None if header.get("model") is None else ModelFingerprint.from_dict(header["model"])
        target = model if model is not None else self.state_model()
        if fingerprint is not None and target is not None:
            _check_fingerprint(type(self).__name__, fingerprint, model_fingerprint(target), "given")
        device = _model_device(target)
        tensors = load_file(str(tensor_path), device="cpu" if device is None else str(device))
        self.import_state(tensors, header.get("meta") or {})
        self.expect_model(fingerprint)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _json_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options as JSON would give them back (tuples become lists, paths strings)."""
    return json.loads(json.dumps(options, default=str))


def _model_device(model: torch.nn.Module | None) -> torch.device | None:
    if model is None:
        return None
    param = next(model.parameters(), None)
    return None if param is None else param.device


def _check_fingerprint(owner: str, saved: ModelFingerprint, model: ModelFingerprint, how: str) -> None:
    differences = saved.differences(model)
    if differences:
        raise ValueError(
            f"{owner}: the loaded state was built on another model than the one {how} "
            f"({'; '.join(differences)}; saved model: {saved}, this model: {model}). "
            "Load it only with the model it was saved from"
        )


#: key prefix of the per-request prefix store in ``Session.method_state`` (``"<method>:prefixes"``)
PREFIX_STATE = "prefixes"


class PrefixReuse:
    """Method mixin: **per-agent prefix reuse** (the KVCMAS reference's behaviour), options
    ``prefix_reuse`` and ``prefix_scope``.

    An agent's PF text (system prompt, glue before a PH, the turn's tail) is computed the first time
    that agent uses it, kept, and placed on the agent's later turns re-positioned (RoPE rotation only,
    no correction: the reference's prefix delta is off by default). Keyed by (agent, token ids of the
    PF segment); the first computation is kept. ``prefix_scope="agent"`` keeps it in the method
    instance across requests (the reference: ``prepare_prefix_kv_segments`` stores an agent's
    template K/V once, in class-level memory keyed by its node id; here at most
    :attr:`PREFIX_LIMIT` entries, the least recently used dropped, saved by :meth:`save_state`,
    counted in :meth:`state_bytes`); ``"request"`` keeps it for one request (a Session) only. A reused
    PF row of the segment table has provenance ``reused``, the agent as source, and
    ``info["prefix_reuse"]`` = the position it was computed at. Counted in ``TurnResult.prefix_reused``
    (PF tokens), not in rho, which stays over PH tokens as the reference counts it.

    Subclasses declare the ``prefix_reuse: bool`` and ``prefix_scope`` options and may narrow
    :meth:`prefix_reuse_allowed`.
    """

    prefix_reuse: bool = False
    prefix_scope: str = "agent"
    PREFIX_SCOPES: ClassVar[tuple[str, ...]] = ("agent", "request")
    #: PF segments kept per method instance with ``prefix_scope="agent"`` (least recently used dropped)
    PREFIX_LIMIT: ClassVar[int] = 256

    def check_prefix_reuse(self) -> None:
        if not isinstance(self.prefix_reuse, bool):
            raise ValueError(
                f"{self.name}: prefix_reuse must be True or False, got {self.prefix_reuse!r}"  # type: ignore[attr-defined]
            )
        if self.prefix_scope not in self.PREFIX_SCOPES:
            raise ValueError(
                f"{self.name}: prefix_scope must be one of {self.PREFIX_SCOPES}, got {self.prefix_scope!r}"  # type: ignore[attr-defined]
            )

    def _agent_prefixes(self) -> OrderedDict:
        kept = self.__dict__.get("_kept_prefixes")
        if kept is None:
            kept = self.__dict__["_kept_prefixes"] = OrderedDict()
        return kept

    def prefix_store(self, turn: Turn) -> dict[tuple[str, tuple[int, ...]], SegmentKV]:
        """The kept PF K/V, keyed by (agent, token ids): the instance's (``prefix_scope="agent"``)
        or the request's."""
        if self.prefix_scope == "agent":
            return self._agent_prefixes()
        return turn.request_state(f"{self.name}:{PREFIX_STATE}", dict)  # type: ignore[attr-defined]

    def prefix_reuse_allowed(self, turn: Turn) -> bool:
        """Whether this turn may place kept PF text (a method in a dense mode says no)."""
        return True

    def prefix(self, turn: Turn, span, cache: SharedCache) -> Placement | None:
        if not self.prefix_reuse or not self.prefix_reuse_allowed(turn):
            return None
        kept = self.prefix_store(turn).get((turn.agent, tuple(span.token_ids.tolist())))
        if kept is None:
            return None
        return Placement(
            kv=kept.repositioned(turn.shifter, span.start),
            provenance="reused",
            source_agent=turn.agent,
            info={"prefix_reuse": kept.start},
        )

    def record(self, turn: Turn, cache: SharedCache) -> None:
        super().record(turn, cache)  # type: ignore[misc]
        if not self.prefix_reuse:
            return
        store = self.prefix_store(turn)
        computed = {s.start for s in cache.segments if s.kind == "PF" and s.provenance == "dense"}
        for span in turn.spans:  # the segment of the prompt's tail lacks its last token: generate computed it
            if span.kind != "PF":
                continue
            key = (turn.agent, tuple(span.token_ids.tolist()))
            if key in store:
                if isinstance(store, OrderedDict):
                    store.move_to_end(key)  # used again: the most recently used
            elif span.start in computed:
                store[key] = cache.extract(span.start, span.end, agent=turn.agent)
        if isinstance(store, OrderedDict):
            while len(store) > self.PREFIX_LIMIT:
                store.popitem(last=False)

    def prefix_state_bytes(self) -> int:
        """Bytes of the PF K/V kept across requests (``prefix_scope="agent"``)."""
        return sum(kv.nbytes for kv in self.__dict__.get("_kept_prefixes", {}).values())

    def state_bytes(self) -> int:
        return super().state_bytes() + self.prefix_state_bytes()  # type: ignore[misc]

    def clear_prefixes(self) -> None:
        self.__dict__.pop("_kept_prefixes", None)

    def export_prefixes(self) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """The kept PF K/V as tensors ``prefix<i>.<k|v><layer>`` and their metadata (LRU order)."""
        tensors, meta = {}, []
        for i, ((agent, ids), kv) in enumerate(self.__dict__.get("_kept_prefixes", {}).items()):
            for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
                tensors[f"prefix{i}.k{layer}"] = k.detach().contiguous().clone()
                tensors[f"prefix{i}.v{layer}"] = v.detach().contiguous().clone()
            meta.append({"agent": agent, "ids": list(ids), "start": kv.start, "layers": len(kv.keys)})
        return tensors, meta

    def import_prefixes(self, tensors: dict[str, torch.Tensor], meta: Any) -> None:
        """Replace the kept PF K/V by exported ones (:meth:`export_prefixes`)."""
        kept: OrderedDict = OrderedDict()
        try:
            for i, entry in enumerate(meta or []):
                n = int(entry["layers"])
                kept[(entry["agent"], tuple(int(t) for t in entry["ids"]))] = SegmentKV(
                    keys=[tensors[f"prefix{i}.k{layer}"] for layer in range(n)],
                    values=[tensors[f"prefix{i}.v{layer}"] for layer in range(n)],
                    start=int(entry["start"]),
                    agent=entry["agent"],
                )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{self.name}: the saved kept prefixes are damaged ({error!r})") from error  # type: ignore[attr-defined]
        self.__dict__["_kept_prefixes"] = kept

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = super().export_state()  # type: ignore[misc]
        kept, kept_meta = self.export_prefixes()
        return {**tensors, **kept}, ({**meta, "prefixes": kept_meta} if kept_meta else meta)

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        rest = {k: v for k, v in tensors.items() if not k.startswith("prefix")}
        meta = dict(meta)
        kept_meta = meta.pop("prefixes", [])
        super().import_state(rest, meta)  # type: ignore[misc]
        self.import_prefixes({k: v for k, v in tensors.items() if k.startswith("prefix")}, kept_meta)

    def request_state_bytes(self, session: Session) -> int:
        kept = session.method_state.get(f"{self.name}:{PREFIX_STATE}", {})  # type: ignore[attr-defined]
        return super().request_state_bytes(session) + sum(kv.nbytes for kv in kept.values())  # type: ignore[misc]

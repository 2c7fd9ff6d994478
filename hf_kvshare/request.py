"""One request's bookkeeping, the same for every host: the :class:`~hf_kvshare.session.Session` (HF
``generate``) and a served task (:class:`~hf_kvshare.serving.host.ServingHost`) are each a
:class:`Request`.

A request holds its PH slots (token ids, producer, latest K/V), the aliases of given text that is an
output of the request, the method's per-request state and the turn caches its slots' K/V are views
of. It prepares a turn (:meth:`Request.resolve` each PH, :meth:`Request.open_turn`: nothing changes on
error) and records one (:meth:`Request.record_output`, then :meth:`Request.release` after the method's
record). It runs no model: the executors do (:mod:`hf_kvshare.executor`, :mod:`hf_kvshare.serving`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .cache import SegmentKV, SharedCache, compact, storage_bytes
from .matching import parse_piece_name, piece_name
from .rope import RopeShifter
from .segment_kv import is_stand_in
from .trajectory import PH, Span
from .turn import Slot, Turn, check_slot_kind, given_text_slot

if TYPE_CHECKING:
    from .method import Method


@dataclass
class NewSlots:
    """What a turn being prepared adds to its request: given-text slots and aliases (committed by
    :meth:`Request.open_turn`, dropped when the turn is refused)."""

    slots: dict[str, Slot] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)


class Request:
    """One request's slots and state (a :class:`~hf_kvshare.turn.TurnHost`); a subclass says where
    its input ids go (``device``)."""

    #: how errors name the request ("this session", "task 't'")
    described = "this request"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, shifter: RopeShifter | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self._shifter = shifter
        self.slots: dict[str, Slot] = {}
        #: given-text PH names whose text equals an output of this request -> that output's slot name
        #: (:func:`~hf_kvshare.turn.given_text_slot`): the PH is read as the output
        self.aliases: dict[str, str] = {}
        #: per-request state a method keeps between turns, keyed by a name the method owns (e.g. the
        #: PReCache methods' shared base + LR caches); the method instance holds cross-request state only
        self.method_state: dict[str, Any] = {}
        #: output slots of turns prepared and not recorded yet (a served request in flight)
        self.reserved: set[str] = set()
        #: per reserved output, the slots its turn reads (what a host that forgets slots must keep)
        self.reading: dict[str, frozenset[str]] = {}
        #: per recorded turn, its cache's length and weak references to the slot K/V that are views of it
        #: (:meth:`record_output`, re-checked by :meth:`compact_views`)
        self._views: list[tuple[int, list[weakref.ref]]] = []
        #: each slot's latest K/V as a turn under :meth:`rollback` found it (what only the rollback may
        #: still hold: :meth:`compact_views` leaves those views alone)
        self._rolled_back: dict[str, Any] = {}
        #: whether another owner keeps a tensor's storage alive anyway (a served task: the worker's own
        #: store, handed over in-process): views of it cost nothing here, so they are neither copied out
        #: (:meth:`compact_views`) nor copied into a piece (:meth:`piece_slot`) while it does; ``None``: nobody
        self.kept_elsewhere: Callable[[torch.Tensor], bool] | None = None

    @property
    def shifter(self) -> RopeShifter:
        if self._shifter is None:
            self._shifter = RopeShifter.from_model(self.model)
        return self._shifter

    # ------------------------------------------------------------------ preparing
    def next_output_slot(self, agent: str) -> str:
        """Output slot name for ``agent``'s next turn: the agent's name, then ``agent#2``, ``agent#3``..."""
        taken = set(self.slots) | self.reserved
        if agent not in taken:
            return agent
        n = 2
        while f"{agent}#{n}" in taken:
            n += 1
        return f"{agent}#{n}"

    def held_slot(self, name: str, new: NewSlots) -> tuple[Slot | None, str | None]:
        """The slot PH ``name`` reads (an alias read as its output), or ``None``; and the alias' target."""
        alias = self.aliases.get(name) or new.aliases.get(name)
        target = alias or name
        return self.slots.get(target) or new.slots.get(target), alias

    def resolve(self, spec: PH, new: NewSlots, given_ids: Callable[[], torch.Tensor]) -> Slot:
        """The slot PH ``spec`` reads. A slot the request does not hold yet is what
        :func:`~hf_kvshare.turn.given_text_slot` makes of its text (``given_ids()``: its token ids): an
        output of this request given again as text is read as that output (an alias), otherwise given
        text of its stated kind; either is added to ``new``. A PH without text named
        ``"<slot>[s:e]"`` (:func:`~hf_kvshare.matching.piece_name`) of a held slot reads that piece
        (:meth:`piece_slot`). A held slot is checked against ``spec`` (its kind; :meth:`check_held`)."""
        slot, alias = self.held_slot(spec.slot, new)
        piece = parse_piece_name(spec.slot) if slot is None and spec.text is None else None
        if piece is not None and self.held_slot(piece[0], new)[0] is not None:
            slot = self.piece_slot(*piece, new)  # a piece of a held slot, named as piece_name names it
            check_slot_kind(spec, slot)
            return slot
        if slot is None:
            slot = given_text_slot(spec, given_ids(), {**self.slots, **new.slots})
            if slot.name == spec.slot:
                new.slots[spec.slot] = slot
            else:  # the text is an output of this request: read as that output from now on
                new.aliases[spec.slot] = slot.name
            return slot
        check_slot_kind(spec, slot)
        self.check_held(spec, slot, alias)
        return slot

    def piece_slot(self, name: str, start: int, end: int, new: NewSlots) -> Slot:
        """Tokens ``[start, end)`` of the slot ``name`` reads (an alias: its output) as a slot of their
        own, for text found inside a message (:mod:`hf_kvshare.matching`): the whole slot is itself;
        a piece is the slot ``"<name>[start:end]"`` (:func:`~hf_kvshare.matching.piece_name`), added
        to ``new`` the first time (committed by :meth:`open_turn`) and read as any slot afterwards: its
        ids the parent's slice, the same producer and kind, its latest K/V a copy of the slice of the
        parent's latest (``None`` when the parent holds none), from then on its own (each turn that
        reads it records it, as any slot's). An image or video slot is not split (``ValueError``)."""
        parent, _ = self.held_slot(name, new)
        if parent is None:
            raise KeyError(f"no slot {name!r} in {self.described} to take a piece of")
        n = parent.token_ids.numel()
        if not 0 <= start < end <= n:
            raise ValueError(f"slot {name!r}: [{start}, {end}) is not a piece of its {n} tokens")
        if (start, end) == (0, n):
            return parent
        piece = piece_name(parent.name, start, end)
        held = self.slots.get(piece) or new.slots.get(piece)
        if held is not None:
            return held
        if parent.visual is not None:
            raise ValueError(f"slot {name!r} is an image or video: a piece of it cannot be shared")
        ids = parent.token_ids[start:end].clone()
        new.slots[piece] = Slot(
            name=piece,
            token_ids=ids,
            text=self.tokenizer.decode(ids.tolist()) if hasattr(self.tokenizer, "decode") else "",
            producer=parent.producer,
            kind=parent.kind,
            latest=self._piece_latest(parent.latest, start, end),
            piece_of=(parent.name, start, end),
        )
        return new.slots[piece]

    def check_held(self, spec: PH, slot: Slot, alias: str | None) -> None:
        """Refuse ``spec`` when it gives other content than the held ``slot`` (nothing to check here:
        a host that reads a PH's content checks it)."""

    def open_turn(
        self, agent: str, spans: list[Span], output_slot: str | None, new: NewSlots, batch_size: int = 1
    ) -> Turn:
        """Commit a prepared turn: ``new``'s slots and aliases join the request, the output slot
        (default :meth:`next_output_slot`) is reserved; a taken output slot is refused first."""
        name = output_slot or self.next_output_slot(agent)
        taken = (self.slots, new.slots, self.reserved, self.aliases, new.aliases)
        if any(name in names for names in taken):
            raise ValueError(f"output slot {name!r} already exists in {self.described}")
        self.slots.update(new.slots)
        self.aliases.update(new.aliases)
        self.reserved.add(name)
        self.reading[name] = frozenset(s.name for s in spans if s.kind == "PH")
        turn = Turn(host=self, agent=agent, spans=spans, output_slot=name, batch_size=batch_size)
        turn.stats.ph_tokens = sum(s.length for s in spans if s.kind == "PH")
        return turn

    def drop_turn(self, turn: Turn) -> None:
        """A prepared turn that will not be recorded (a cache built for the caller, an aborted request)
        frees its output slot."""
        self.reserved.discard(turn.output_slot)
        self.reading.pop(turn.output_slot, None)

    @contextlib.contextmanager
    def rollback(self) -> Iterator[None]:
        """A block that raises (anything, an interrupt too) leaves the request's slots as they were:
        the slot table (slots it added dropped), the aliases, the reserved outputs and each slot's
        latest K/V."""
        slots, aliases, reserved = dict(self.slots), dict(self.aliases), set(self.reserved)
        reading = dict(self.reading)
        latest = {name: slot.latest for name, slot in slots.items()}
        self._rolled_back = latest
        try:
            yield
        except BaseException:
            self.slots, self.aliases, self.reserved, self.reading = slots, aliases, reserved, reading
            for name, slot in slots.items():
                slot.latest = latest[name]
            raise
        finally:
            self._rolled_back = {}

    # ------------------------------------------------------------------ recording
    def record_output(
        self, turn: Turn, cache: SharedCache, output_ids: torch.Tensor, text: str, *, keep_kv: bool
    ) -> Slot:
        """The turn's output becomes the agent's slot (returned). With ``keep_kv`` (the method reads
        sources: ``Method.uses_sources``) each PH slot's K/V in ``cache`` and the output's (when the
        cache holds all of it) become their ``latest``: views of the turn's cache, no second copy of
        every segment while it is alive; :meth:`release` copies out the ones that hold little of it."""
        P = turn.prompt_length
        slot = Slot(name=turn.output_slot, token_ids=output_ids.cpu(), text=text, producer=turn.agent)
        self.slots[turn.output_slot] = slot
        self.reserved.discard(turn.output_slot)
        self.reading.pop(turn.output_slot, None)
        if not keep_kv:
            return slot
        end = P + output_ids.numel()
        kept: dict[str, Any] = {}
        with cache.sharing_storage():
            for span in turn.spans:
                if span.kind == "PH":
                    kept[span.name] = self.slots[span.name].latest = cache.extract(
                        span.start, span.end, agent=turn.agent
                    )
            if end <= cache.get_seq_length():
                kept[turn.output_slot] = slot.latest = cache.extract(P, end, agent=turn.agent)
        self._views.append((cache.get_seq_length(), [weakref.ref(kv) for kv in kept.values()]))
        return slot

    def release(self, turn: Turn, method: Method) -> None:
        """After the method's record: drop the latest K/V of this turn's slots that no later turn can
        read (:meth:`Method.reads_latest`), so the memory is freed now, not when the request ends; then
        :meth:`compact_views`."""
        if not method.uses_sources:
            return
        for name in dict.fromkeys([*(s.name for s in turn.spans if s.kind == "PH"), turn.output_slot]):
            slot = self.slots.get(name)
            if slot is not None and slot.latest is not None and not method.reads_latest(turn, name):
                slot.latest = None
        self.compact_views()

    def compact_views(self) -> None:
        """Re-check every turn cache the slots' K/V are views of (:meth:`record_output`): the views
        still held by a slot or the method (not the ones only a turn's rollback still holds: replaced)
        are copied out when together they hold less than half of that cache
        (:func:`~hf_kvshare.cache.compact`); a cache no view of which is held any more is forgotten."""
        current = {id(slot.latest) for slot in self.slots.values()}
        replaced = {id(kv) for kv in self._rolled_back.values() if kv is not None} - current
        groups = []
        for length, refs in self._views:
            alive = [kv for kv in (ref() for ref in refs) if kv is not None and id(kv) not in replaced]
            if alive and (self._held_elsewhere(alive[0]) or not compact(alive, length)):
                groups.append((length, refs))  # re-checked at the next record
        self._views = groups

    def _held_elsewhere(self, kv: SegmentKV) -> bool:
        """Whether ``kv``'s tensors are views of a storage another owner keeps (:attr:`kept_elsewhere`)."""
        kv = kv.stored
        return self.kept_elsewhere is not None and bool(kv.keys) and self.kept_elsewhere(kv.keys[0])

    def _piece_latest(self, kv: SegmentKV | None, start: int, end: int) -> SegmentKV | None:
        """A new piece's latest K/V: a copy of positions ``[start, end)`` of its parent's ``kv``
        (:func:`_piece_kv`), or, where ``kv`` views a storage another owner keeps and is one of a recorded
        turn's views, a view joining that turn's views (copied out with them once nobody else keeps it)."""
        if kv is None or kv.deferred or not self._held_elsewhere(kv):
            return _piece_kv(kv, start, end)
        group = next((refs for _, refs in self._views if any(ref() is kv for ref in refs)), None)
        if group is None:
            return _piece_kv(kv, start, end)
        piece = _piece_kv(kv, start, end, copy=False)
        if piece is not None:
            group.append(weakref.ref(piece))
        return piece

    def held_bytes(self) -> int:
        """Exact bytes the slots keep for later turns: each slot's latest K/V (views of one turn's cache
        count that cache's storage once and whole: :func:`~hf_kvshare.cache.storage_bytes`), the
        tensors a method keeps with it (``slot.extras``) and images' pixels / features."""
        total = storage_bytes(
            t
            for slot in self.slots.values()
            if slot.latest is not None
            for t in (*slot.latest.keys, *slot.latest.values)
        )
        total += sum(_tensor_bytes(slot.extras) for slot in self.slots.values())
        return total + sum(slot.visual.nbytes for slot in self.slots.values() if slot.visual is not None)


def _piece_kv(kv: SegmentKV | None, start: int, end: int, copy: bool = True) -> SegmentKV | None:
    """Positions ``[start, end)`` of ``kv`` (keys as they sit there), copied: a piece holds its own
    tokens only, no view of the turn cache its parent's K/V may be (:meth:`Request.compact_views`
    counts those); with ``copy=False`` views (the caller counts them). ``None`` for no K/V, or an
    image's (multimodal RoPE layout)."""
    if kv is None:
        return None
    kv = kv.materialize()
    if kv.rope is not None:
        return None
    own = torch.Tensor.clone if copy and not is_stand_in(kv) else (lambda t: t)  # a stand-in holds nothing
    return SegmentKV(
        keys=[own(k[..., start:end, :]) for k in kv.keys],
        values=[own(v[..., start:end, :]) for v in kv.values],
        start=kv.start + start,
        agent=kv.agent,
    )


def _tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or dicts / lists / tuples holding them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0

"""Sessions: one request's multi-agent workflow.

``Session.run_turn`` prepares the turn (the request: :mod:`hf_kvshare.request`), walks the method
over it (:mod:`hf_kvshare.walk`) on the HF executor (:mod:`hf_kvshare.executor`: the dense parts in
one forward), calls ``model.generate`` unchanged, records the output as a new PH slot (named after
the agent), lets the method learn from the turn, and returns the text, token ids and metrics.
Held text found inside a turn's PF text (a document quoted in an f-string message, a reply pasted
back) is shared as PH slots or pieces of them (:meth:`Session.split_matched_text`,
``match_text=True``), the turn's token ids unchanged. Within a session a PH slot's content is fixed;
a new request is a new session (which may share the method instance).

The session drives the method contract (:mod:`hf_kvshare.method`) and never imports the methods:
the registry is filled by the package (``hf_kvshare/__init__.py`` imports :mod:`hf_kvshare.methods`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from .agents import agent_adapter
from .cache import SharedCache
from .executor import HFExecutor, strip_eos
from .generate_options import check_attention_mask, generate_options
from .matching import MIN_PIECE_TOKENS, match
from .measure import PeakMemory, Phases, TensorPeak, module_bytes, synchronize, timing, turn_phases
from .method import Method, get_method
from .prefill import model_input_device
from .request import NewSlots, Request
from .trajectory import PF, PH, Span, chat, is_messages, tokenize_text, validate_segments
from .turn import Slot, Turn, TurnResult
from .vision import check_same_content, check_spans, check_text_ids, split_processor, visual_slot
from .walk import Walk


class Session(Request):
    """One request's workflow over a shared model: a :class:`~hf_kvshare.request.Request` whose turns
    run on the HF executor (:mod:`hf_kvshare.executor`).

    Args:
        model: a causal LM, or a ``peft.PeftModel`` for LoRA-specialized agents: then an agent's
            name is its adapter's name, and that adapter is active during the agent's turn.
        tokenizer: its tokenizer.
        method: a registry name (options as keyword arguments) or a method instance, which may
            be shared by many sessions.
        processor: a vision-language model's processor, for image / video segments
            (``PH(slot, image=...)``, :mod:`hf_kvshare.vision`); a processor passed as ``tokenizer``
            is split into its tokenizer and itself.
        match_text: find the session's held text slots inside the turn's PF text (an f-string message
            that quotes a document, a reply pasted back) and share them as PH pieces
            (:meth:`split_matched_text`); ``False``: PF text is always the agent's own.
        match_min_tokens: the shortest run of a held slot's tokens that ``match_text`` shares.

    >>> session = Session(model, tok, method="fullshared")  # doctest: +SKIP
    >>> r = session.run_turn("planner", [PF("You plan.\\n"), PH("query", "Sort a list."), PF("\\nPlan:")])  # doctest: +SKIP
    >>> session.run_turn("coder", [PF("You code.\\n"), PH("query"), PF("\\nPlan: "), PH("planner")])  # doctest: +SKIP
    """

    described = "this session"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        method: str | Method = "nonshared",
        *,
        tensor_memory: bool = False,
        processor: Any = None,
        match_text: bool = True,
        match_min_tokens: int = MIN_PIECE_TOKENS,
        **options,
    ):
        if not isinstance(match_text, bool):
            raise TypeError(f"match_text must be True or False; got {match_text!r}")
        if (
            isinstance(match_min_tokens, bool)
            or not isinstance(match_min_tokens, int)
            or match_min_tokens < 1
        ):
            raise ValueError(f"match_min_tokens must be an int >= 1; got {match_min_tokens!r}")
        tokenizer, self.processor = split_processor(tokenizer, processor)
        super().__init__(model, tokenizer)
        self.method = get_method(method, **options)
        self.method.bind(model)
        self.turns: list[TurnResult] = []
        #: measure each turn's peak of torch tensor bytes (:class:`~hf_kvshare.measure.TensorPeak`, the
        #: profiler's allocation events: ``TurnResult.tensor_peak_bytes``); a profiler's overhead, so off
        #: by default and not for timed runs
        self.tensor_memory = tensor_memory
        #: share held text slots found inside PF text (:meth:`split_matched_text`), runs of at least
        #: ``match_min_tokens`` tokens
        self.match_text = match_text
        self.match_min_tokens = match_min_tokens

    @property
    def device(self) -> torch.device:
        """Where the prompt goes: the input embeddings' device (layers may sit elsewhere: device_map)."""
        return model_input_device(self.model)

    # -------------------------------------------------------------- preparing
    def held_bytes(self) -> int:
        """Exact bytes this session keeps for later turns: each slot's latest K/V (the reuse source),
        the tensors a method keeps with it (``slot.extras``: e.g. hidden states to restart from) and
        the method's per-request state (:meth:`Method.request_state_bytes`: PReCache's base + LR
        caches). Turn caches handed to the caller are not included."""
        return super().held_bytes() + self.method.request_state_bytes(self)

    def prepare_turn(
        self, agent: str, segments: Any, output_slot: str | None = None, batch_size: int = 1
    ) -> Turn:
        """Tokenize a turn's segments and check them; nothing in the session changes on error."""
        if not isinstance(agent, str) or not agent:
            raise ValueError(f"agent must be a non-empty string, got {agent!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size must be an int >= 1, got {batch_size!r} ({type(batch_size).__name__})"
            )
        if batch_size > 1 and not self.method.supports_batch:
            raise ValueError(
                f"method {self.method.name!r} supports batch size 1 only; got batch_size={batch_size}"
            )
        if output_slot is not None and (not isinstance(output_slot, str) or not output_slot):
            raise ValueError(
                f"output_slot must be a non-empty string (a PH slot name) or None, got {output_slot!r} "
                f"({type(output_slot).__name__})"
            )
        if is_messages(segments):
            segments = chat(self.tokenizer, segments)
        specs = validate_segments(segments)
        new = NewSlots()
        self._resolve_images(specs, new)
        spans: list[Span] = []
        pos = 0
        pf_count = 0
        for i, spec in enumerate(specs):
            if isinstance(spec, PH):
                slot = self.resolve(spec, new, functools.partial(self._given_ids, spec))
                ids, name = slot.token_ids, slot.name  # an output passed as text is read as the output
            else:
                ids = tokenize_text(self.tokenizer, spec.text)
                name = spec.label or f"pf{pf_count}"
                pf_count += 1
                if ids.numel() == 0:
                    raise ValueError(f"segment {i} (PF {spec.text!r}) tokenizes to zero tokens")
                self._check_ids(ids, f"segment {i} (PF {name!r})")
            visual = slot.visual if isinstance(spec, PH) else None
            spans.append(Span(spec=spec, name=name, token_ids=ids, start=pos, visual=visual))
            pos += ids.numel()
        if self.match_text:
            spans = self.split_matched_text(spans, new)
        check_spans(spans, self.method)
        return self.open_turn(agent, spans, output_slot, new, batch_size)

    def split_matched_text(self, spans: list[Span], new: NewSlots) -> list[Span]:
        """The turn's spans with the held text found inside its PF spans shared: a run of at least
        :attr:`match_min_tokens` tokens of a PF span equal to a run of a slot the session holds
        (:func:`hf_kvshare.matching.match`) becomes a PH span of that slot, or of its piece
        ``"<slot>[s:e]"`` (:meth:`~hf_kvshare.request.Request.piece_slot`), between PF spans of the
        text around it. Explicit PH spans win: a slot (or the parent of a piece) the turn reads is not
        searched. The turn's token ids are unchanged: each part of a cut PF span carries its slice of
        the span's own token ids (what every method computes: NonShared stays exact), and its text is the
        span's text cut at the characters of those token boundaries (a piece whose boundary falls inside
        a character stays the agent's text). A part's text alone may tokenize otherwise at a cut (a
        trailing ``"\\n\\n"`` reads back as one token): its ids, not its text, are the segment."""
        read = set()
        for span in spans:
            if span.kind == "PH":
                slot = self.slots.get(span.name) or new.slots.get(span.name)
                read.add(span.name)
                if slot is not None and slot.piece_of is not None:
                    read.add(slot.piece_of[0])
        sources = {
            name: slot.token_ids.tolist()
            for name, slot in self.slots.items()
            if name not in read
            and slot.visual is None
            and (slot.piece_of is None or slot.piece_of[0] not in self.slots)  # found through its parent
        }
        n = self.match_min_tokens
        if not sources or not any(s.kind == "PF" and s.length >= n for s in spans):
            return spans
        found = match(torch.cat([s.token_ids for s in spans]).tolist(), sources, n).pieces
        out: list[Span] = []
        for span in spans:
            inside = []
            for p in found:  # the piece's run inside this PF span (a piece never crosses a PH: not a source)
                a, b = max(p.prompt_start, span.start), min(p.prompt_end, span.end)
                if span.kind == "PF" and b - a >= n:
                    s = p.slot_start + a - p.prompt_start
                    inside.append((a - span.start, b - span.start, p.slot, s, s + b - a))
            out += self._split_pf(span, inside, new) if inside else [span]
        pos = 0
        for span in out:  # the same ids in the same order: positions only re-counted
            span.start, pos = pos, pos + span.length
        return out

    def _split_pf(self, span: Span, pieces: list[tuple], new: NewSlots) -> list[Span]:
        """PF ``span`` cut around ``pieces`` (``(a, b, slot, s, e)``: its tokens ``[a, b)`` are ``slot``'s
        ``[s, e)``), in order; a piece whose cut the text does not reproduce stays PF text."""
        ids, text = span.token_ids, span.spec.text

        def cut(t: int) -> int | None:  # the character offset of token boundary t, if the text has one
            head = _decoded(self.tokenizer, ids[:t].tolist())
            return len(head) if head is not None and text.startswith(head) else None

        kept = [(*piece, cut(piece[0]), cut(piece[1])) for piece in pieces]  # + (char_a, char_b)
        kept = [piece for piece in kept if piece[5] is not None and piece[6] is not None]
        # a piece carries its parent's K/V, not the method state kept with the whole slot (``extras``:
        # e.g. a recomputing method's hidden states): such a slot is shared whole or not at all
        kept = [piece for piece in kept if not self.slots[piece[2]].extras or self._whole(piece)]
        out: list[Span] = []
        last_t, last_c = 0, 0
        for a, b, name, s, e, ca, cb in kept:
            if a > last_t:
                out.append(self._pf_part(span, text[last_c:ca], ids[last_t:a], len(out)))
            slot = self.piece_slot(name, s, e, new)
            out.append(Span(spec=PH(slot.name), name=slot.name, token_ids=slot.token_ids, start=0))
            last_t, last_c = b, cb
        if last_t < ids.numel():
            out.append(self._pf_part(span, text[last_c:], ids[last_t:], len(out)))
        return out or [span]

    def _whole(self, piece: tuple) -> bool:
        """``(a, b, slot, s, e, ...)`` covers all of ``slot``."""
        return (piece[3], piece[4]) == (0, self.slots[piece[2]].token_ids.numel())

    @staticmethod
    def _pf_part(span: Span, text: str, ids: torch.Tensor, index: int) -> Span:
        """Part ``index`` of a cut PF span: the first keeps its name, the others ``<name>.<index>``."""
        name = span.name if index == 0 else f"{span.name}.{index}"
        return Span(spec=PF(text, label=span.spec.label), name=name, token_ids=ids, start=0)

    def _resolve_images(self, specs: list[Any], new: NewSlots) -> None:
        """The turn's images and videos, resolved once before its spans: a new one becomes a slot of
        ``new`` (:func:`~hf_kvshare.vision.visual_slot`: checks, the processor, no model work); one the
        request holds (or this turn gave already) must be given again as it was."""
        for spec in specs:
            if not isinstance(spec, PH) or spec.visual is None:
                continue
            slot, _ = self.held_slot(spec.slot, new)
            if slot is None:
                slot = visual_slot(self.model, self.processor, spec, {**self.slots, **new.slots})
                new.slots[spec.slot] = slot
            else:
                check_same_content(self.model, self.processor, spec, slot)

    def _given_ids(self, spec: PH) -> torch.Tensor:
        """The token ids of the text a PH the session does not hold yet gives (checked)."""
        if spec.text is None:
            known = ", ".join(sorted(self.slots)) or "none"
            raise ValueError(
                f"PH slot {spec.slot!r} was never recorded in this session and no text was given; "
                f"recorded slots: {known}"
            )
        ids = tokenize_text(self.tokenizer, spec.text)
        if ids.numel() == 0:
            raise ValueError(f"PH slot {spec.slot!r}: text {spec.text!r} tokenizes to zero tokens")
        self._check_ids(ids, f"PH slot {spec.slot!r}")
        return ids

    def check_held(self, spec: PH, slot: Slot, alias: str | None) -> None:
        """A PH naming a slot the session holds gives its content again or none: the same image, the
        same text (an alias: the output's token ids); images were checked before (:meth:`_resolve_images`)."""
        if spec.visual is None:
            check_same_content(self.model, self.processor, spec, slot)  # no text for an image
        if alias is not None:
            if spec.text is not None and not torch.equal(
                tokenize_text(self.tokenizer, spec.text), slot.token_ids
            ):
                raise ValueError(
                    f"PH slot {spec.slot!r} holds the output of {slot.producer!r} in this session; got a different "
                    f"text {_preview(spec.text)}. A slot's content is fixed within a session"
                )
        elif spec.text is not None and spec.text != slot.text:
            raise ValueError(
                f"PH slot {spec.slot!r} already holds {_preview(slot.text)} in this session; got a different text "
                f"{_preview(spec.text)}. A slot's content is fixed within a session (a new request is a new Session)"
            )

    def _vocabulary(self) -> int | None:
        embeddings = (
            self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        )
        weight = getattr(embeddings, "weight", None)
        return None if weight is None else int(weight.shape[0])

    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        """Text's token ids: inside the model's vocabulary (the tokenizer may be another model's), no
        image / video placeholders."""
        vocab = self._vocabulary()
        if vocab is not None and ids.numel() and int(ids.max()) >= vocab:
            bad = sorted({int(t) for t in ids if int(t) >= vocab})
            raise ValueError(
                f"{what}: the tokenizer gives token ids {bad[:5]}{'...' if len(bad) > 5 else ''}, outside the "
                f"model's vocabulary of {vocab} (input embeddings); is the tokenizer the model's?"
            )
        check_text_ids(self.model, ids, what)

    def _check_length(self, turn: Turn, max_new_tokens: int) -> None:
        config = self.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VLM's too
        limit = getattr(text, "max_position_embeddings", None)
        total = turn.prompt_length + max_new_tokens
        if limit is not None and total > limit:
            raise ValueError(
                f"the trajectory needs {turn.prompt_length} prompt + {max_new_tokens} new tokens = {total} positions; "
                f"the model supports {limit} (max_position_embeddings)"
            )

    # ---------------------------------------------------------------- building
    def build_cache(self, agent: str, segments: Any, batch_size: int = 1) -> tuple[SharedCache, torch.Tensor]:
        """Build ``agent``'s cache for ``segments`` and return it with the prompt ids ``[batch, P]``.

        For callers of ``generate`` themselves: pass ``input_ids=prompt_ids`` and the cache (as
        ``past_key_values=`` or ``cache=``); on a multimodal-RoPE model (Qwen2-VL) also
        ``**hf_kvshare.mrope.generate_kwargs(cache, prompt_ids)`` (the prompt's 3D positions). The session records nothing from such a call. On a
        ``PeftModel``, activate the agent's adapter for that call (``model.set_adapter(agent)``).
        """
        with self._exclusive(), self.rollback():
            turn = self.prepare_turn(agent, segments, batch_size=batch_size)
            with agent_adapter(self.model, agent):  # checks the agent's adapter first (on a PeftModel)
                self._check_length(turn, 1)
                cache = HFExecutor().prefill(self.method, turn)
            self.drop_turn(turn)  # nothing is recorded from such a turn
        return cache, turn.batch(turn.prompt_ids).to(self.device)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """A turn holds this Session and its method instance for its thread: a turn of another thread
        on either while it runs is refused with ``RuntimeError`` (neither is thread-safe: the slot table,
        the rollback of a failed turn, and the method's pools / profiles / counters are unlocked)."""
        with _in_use(self, "this Session"), _in_use(self.method, f"method instance {self.method.name!r}"):
            yield

    # ------------------------------------------------------------------ turns
    def run_turn(
        self,
        agent: str,
        segments: Any,
        *,
        max_new_tokens: int | None = None,
        output_slot: str | None = None,
        force_output: torch.Tensor | list[int] | None = None,
        keep_cache: bool = False,
        **generate_kwargs: Any,
    ) -> TurnResult:
        """Run one agent turn and record its output as PH slot ``output_slot`` (default: the agent's name).

        ``force_output``: teacher forcing. Instead of generating, feed these token ids through the
        built cache, return their logits (``result.logits`` ``[T, vocab]``, the prediction made
        *before* each forced token) and record them as the output. Used to measure fidelity; its
        ``ttft_s`` includes the one forward over all T forced tokens, so compare TTFT from
        free-running turns.

        A turn that raises leaves the session's slots as they were.

        ``max_new_tokens`` (default: the ``generation_config``'s, else 64) and ``generate_kwargs`` (a
        ``generation_config``, its fields, ``generate``'s arguments) reach ``generate`` as given, the
        session's default being one greedy sequence; what the session cannot honour (beams, several
        sequences, dict outputs, its own inputs) is refused before any work
        (:func:`~hf_kvshare.generate_options.generate_options`).
        """
        if force_output is not None and generate_kwargs:
            raise ValueError(
                f"run_turn: force_output= teacher-forces the given tokens, so the generation options "
                f"{sorted(generate_kwargs)} would not apply; pass one or the other"
            )
        options = (
            None
            if force_output is not None
            else generate_options(self.model, max_new_tokens, generate_kwargs, self.tokenizer)
        )
        with self._exclusive(), self.rollback():
            turn = self.prepare_turn(agent, segments, output_slot)  # prepare
            turn.keep_cache = keep_cache
            # the HF executor: generate's first forward computes the trailing agent text
            executor = HFExecutor(leave_tail=True)
            with agent_adapter(self.model, agent):  # checks the agent's adapter first (on a PeftModel)
                if force_output is not None:
                    force_output = self._check_forced(force_output)
                    max_new_tokens = force_output.numel()
                else:
                    max_new_tokens = options.max_new_tokens
                    check_attention_mask(options.attention_mask, turn.batch_size, turn.prompt_length)
                self._check_length(turn, max_new_tokens)
                device = self.device
                prompt = turn.prompt_ids.to(device)
                logits = None
                phases = Phases()
                held = (
                    self.held_bytes() + self.method.state_bytes()
                    if self.tensor_memory or device.type == "cuda"
                    else 0
                )
                # on CUDA: the weights and what this session and method hold, plus the turn's own peak
                # (not what other code in the process holds: measure.PeakMemory)
                baseline = module_bytes(self.model, device) + held if device.type == "cuda" else None
                tensors = TensorPeak(device) if self.tensor_memory else contextlib.nullcontext()
                with PeakMemory(device, baseline_bytes=baseline) as memory, tensors:
                    synchronize(device)
                    t0 = time.perf_counter()
                    cache = executor.prefill(self.method, turn)  # the walk over the method's hooks
                    turn.stats.tokens_prefilled += turn.prompt_length - cache.get_seq_length()
                    with self.method.generation_context(turn):
                        if force_output is None:  # generate
                            output_ids, t_first = executor.generate(self.method, turn, prompt, cache, options)
                        else:
                            output_ids, t_first, logits = executor.teacher_force(
                                self.method, turn, prompt, cache, force_output.to(device)
                            )
                        t_decoded = time.perf_counter()
                        with timing(phases):  # record
                            with phases.phase("record"):
                                if self.method.uses_sources:
                                    executor.complete_output(turn, cache, output_ids)
                                text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
                                output = self.record_output(
                                    turn, cache, output_ids, text, keep_kv=self.method.uses_sources
                                )
                            with phases.phase("method_record"):
                                Walk(self.method, turn).record(cache)
                                for work in self.method.deferred_work():  # in the record, as undeferred
                                    work()
                                self.release(turn, self.method)
                            synchronize(device)  # the session's own sync: queued work lands in bookkeeping
                    t_end = time.perf_counter()
                # after the first token: decode + the phases of the record (+ the sync, in bookkeeping)
                breakdown = turn_phases(phases, phases.get("method_record"))
                breakdown["decode"] = t_decoded - t_first
                breakdown["bookkeeping"] += (t_end - t_decoded) - sum(phases.times.values())
        for segment in cache.segments:  # a piece names its parent slot
            slot = self.slots.get(segment.name) if segment.kind == "PH" else None
            if slot is not None and slot.piece_of is not None:
                segment.info.setdefault("piece_of", slot.piece_of)
        result = TurnResult(
            agent=agent,
            method=self.method.name,
            output_slot=turn.output_slot,
            text=output.text,
            output_ids=output_ids.cpu(),
            prompt_ids=turn.prompt_ids,
            ttft_s=t_first - t0,
            e2e_s=t_end - t0,
            tokens_prefilled=turn.stats.tokens_prefilled,
            tokens_reused=turn.stats.ph_reused,
            ph_tokens=turn.stats.ph_tokens,
            prefix_reused=turn.stats.pf_reused,
            tokens_corrected=turn.stats.ph_corrected,
            tokens_recomputed=turn.stats.ph_recomputed,
            corrects=self.method.corrects,
            peak_memory_bytes=memory.peak_bytes,
            tensor_peak_bytes=held + tensors.peak_bytes if self.tensor_memory else None,
            phases=breakdown,
            segments=list(cache.segments),
            logits=logits,
            cache=cache if keep_cache else None,
        )
        self.turns.append(result)
        return result

    def _check_forced(self, force_output: Any) -> torch.Tensor:
        try:
            ids = torch.as_tensor(force_output)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"force_output must be token ids (ints); got {force_output!r}") from error
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"force_output must be integer token ids; got dtype {ids.dtype}")
        if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(
                f"force_output must be one sequence of token ids ([T] or [1, T]); got shape {list(ids.shape)}"
            )
        ids = ids.to(torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("force_output must hold at least one token")
        vocab = (
            self.model.get_output_embeddings().weight.shape[0] if self.model.get_output_embeddings() else None
        )
        vocab = vocab or getattr(self.model.config, "vocab_size", None)
        if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = [int(i) for i in ids if not 0 <= int(i) < vocab][:5]
            raise ValueError(f"force_output ids must be in [0, {vocab}) (the model's vocabulary); got {bad}")
        return ids

    def _strip_eos(self, generated: torch.Tensor) -> torch.Tensor:
        """Drop trailing EOS/pad tokens (:func:`hf_kvshare.executor.strip_eos`)."""
        return strip_eos(self.model, generated)


_IN_USE_LOCK = threading.Lock()
#: id of a Session / method instance -> (thread ident, depth) of the turn running on it; keyed by id, not
#: the object (a user's method may be an unhashable dataclass); an entry lives only while a turn, which
#: holds the object, runs on it
_IN_USE: dict[int, tuple[int, int]] = {}


@contextlib.contextmanager
def _in_use(owner: Any, what: str) -> Iterator[None]:
    """Mark ``owner`` in use by this thread (re-entrant within it); another thread's turn is refused."""
    me = threading.get_ident()
    with _IN_USE_LOCK:
        thread, depth = _IN_USE.get(id(owner), (me, 0))
        if thread != me:
            raise RuntimeError(
                f"{what} is in use by a turn in another thread (thread {thread}); a Session and a method "
                "instance cannot run concurrently: give each thread its own Session and method instance "
                "(they may share the model), or run the turns one after another"
            )
        _IN_USE[id(owner)] = (me, depth + 1)
    try:
        yield
    finally:
        with _IN_USE_LOCK:
            if depth == 0:
                _IN_USE.pop(id(owner), None)
            else:
                _IN_USE[id(owner)] = (me, depth)


def _decoded(tokenizer: Any, ids: list[int]) -> str | None:
    """The text of ``ids`` as the tokenizer writes it back (no clean-up of spaces), or ``None`` when it
    cannot (a tokenizer without ``decode``)."""
    if not hasattr(tokenizer, "decode"):
        return None
    try:
        return tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    except TypeError:  # a tokenizer without that option
        return tokenizer.decode(ids)


def _preview(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")

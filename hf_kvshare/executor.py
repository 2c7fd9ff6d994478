"""The HF executor: runs the model of one turn of a :class:`~hf_kvshare.session.Session`.

It walks the method (:class:`~hf_kvshare.walk.Walk`), computes every token the method left dense in
ONE forward (:func:`~hf_kvshare.prefill.prefill_parts`: true positions, a mask built from positions),
leaves the prompt's last token (and, where that saves a forward, the agent text before it) to
``generate``, runs ``generate`` unchanged (or a teacher-forced forward), and completes the output's K/V
for the record. The serving side's executor is vLLM's own forward, with the claims of
:mod:`hf_kvshare.serving.host`.

A method's ``build`` hook (:meth:`~hf_kvshare.method.Method.build`) is where the executor asks for the
turn's cache: its default runs :meth:`HFExecutor.walk`; a method may wrap it (boundary capture)
or build the cache itself (PReCache).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from . import mrope
from ._compat import cache_kwargs, is_peft_model
from .cache import CachePart, SharedCache
from .generate_options import GenerateOptions
from .measure import FirstTokenTimer, synchronize
from .method import Method
from .prefill import prefill_dense, prefill_parts, recompute_is_cheaper
from .walk import Walk

if TYPE_CHECKING:
    from .cache import Segment
    from .turn import Turn


class HFExecutor:
    """Runs one turn on an HF model (one instance per turn).

    ``leave_tail``: the caller runs ``generate`` (or a teacher-forced forward) over the built cache from
    its end, so the trailing run of computed agent text may be left to that forward
    (:meth:`tail_for_generate`; ``Session.run_turn``, not ``build_cache``, whose cache ends at the
    prompt's last token). The segments of that run are :attr:`tail_segments` until :meth:`generate` /
    :meth:`teacher_force` wrote their K/V."""

    def __init__(self, *, leave_tail: bool = False):
        self.leave_tail = leave_tail
        #: the trailing run's segments, left out of the cache by :meth:`walk`; added to the
        #: cache's table once the caller's forward has written their K/V
        self.tail_segments: list[Segment] = []

    # ------------------------------------------------------------------ the cache
    def prefill(self, method: Method, turn: Turn) -> SharedCache:
        """The turn's cache from ``method.build(turn)`` (whose default is :meth:`walk`), bound to
        the model and sealed over the prompt (``generate`` over other ids is refused)."""
        turn.executor = self
        cache = method.build(turn)
        cache.bind_model(turn.model)  # a cache refuses any other model (see SegmentedCache.check_model)
        cache.seal(turn.prompt_length, token_ids=turn.prompt_ids)
        return cache

    def walk(self, method: Method, turn: Turn) -> SharedCache:
        """The walk (:class:`~hf_kvshare.walk.Walk`: plan, place what ``placeholder`` / ``prefix``
        return), then every token left dense in ONE forward, then ``finish``. The prompt's last token is
        left out for ``generate``; so is the run of computed agent (PF) text after the last placed or
        PH part when every part before it is placed and :attr:`leave_tail` (:meth:`tail_for_generate`),
        which then computes that text with the last token in one forward instead of two. A method that
        reads the cache built so far (``reads_prefix``) gets it complete up to each PH segment."""
        walk = Walk(method, turn)
        cache = walk.plan()
        parts: list[CachePart] = []

        def flush() -> None:
            if parts:
                turn.stats.tokens_prefilled += sum(p.segment.length for p in parts if p.dense)
                moved = any(not p.dense and p.kv.start != p.segment.start for p in parts)
                prefill_parts(cache, turn.model, parts, turn.shifter if moved else None)
                parts.clear()

        for span, placement in walk.place(cache, before_read=flush):
            parts.append(turn.part(span, placement))
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
            compute_kept_text(turn, parts)
        if type(method).tail_for_generate is not Method.tail_for_generate:  # the deprecated hook, overridden
            tail = method.tail_for_generate(turn, parts)
        else:
            tail = self.tail_for_generate(method, turn, parts)
        del parts[len(parts) - len(tail) :]
        self.tail_segments = [p.segment for p in tail]
        flush()
        walk.finish(cache)
        return cache

    def tail_for_generate(self, method: Method, turn: Turn, parts: list[CachePart]) -> list[CachePart]:
        """The trailing parts of ``parts`` (the prompt minus its last token, in order) that
        :meth:`walk` leaves to the caller's forward: the run of computed PF text after the last
        part that is placed, a PH span or an image, when every part before it is placed (so the build
        runs no forward: a FullShared or KVCMAS turn with prefix reuse). That forward (``generate``'s
        first) computes the prompt's uncached tokens in one pass with the causal mask, which is exactly
        their attention here (they follow everything in the cache), so the turn runs one forward fewer
        than prefilling them and then feeding the last token. Where the build computes other text anyway
        the trailing text stays in that forward: splitting it off measured slower (FullShared without
        prefix reuse, trace at 2,048 tokens: 0.72 s against 0.61 s per reuse turn, measured at commit
        1e65350).

        Empty unless :attr:`leave_tail`, and on a multimodal-RoPE model (generate's positions come from
        the cache's track), for a method whose generation differs from its prefill (its own
        ``generation_context`` or ``forward_kwargs``: an adapter selected for generation, layer inputs
        recorded), and on a PEFT model (the LoRA methods are such methods, so every method there
        prefills the text and NonShared stays their exact reference: one forward or two differ by float
        rounding, by 1e-3 on a 4-bit base): there the text is prefilled as before."""
        if not self.leave_tail or mrope.is_mrope(turn.model) or is_peft_model(turn.model):
            return []
        own = type(method)
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
            return []  # the build runs a forward anyway: the text goes into that one (measured faster)
        return parts[n:]

    # ------------------------------------------------------------------ the output
    def generate(
        self, method: Method, turn: Turn, prompt: torch.Tensor, cache: SharedCache, options: GenerateOptions
    ) -> tuple[torch.Tensor, float]:
        """``model.generate`` unchanged over the built cache: the output ids (trailing EOS / pad dropped:
        :func:`strip_eos`) and the time of the first token."""
        timer = FirstTokenTimer(prompt.device)
        method_kwargs = {**method.forward_kwargs(turn), **method.generate_kwargs(turn)}
        processors = options.processors + list(method_kwargs.pop("logits_processor", None) or []) + [timer]
        inputs = turn.batch(prompt).contiguous()
        method_kwargs.update(mrope.generate_kwargs(cache, inputs))  # multimodal RoPE: the prompt's positions
        with torch.no_grad():
            out = turn.model.generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                logits_processor=processors,
                **cache_kwargs(cache),
                **{**options.kwargs, **method_kwargs},
            )
        self._tail_written(cache)
        generated = out[0, prompt.numel() :]
        return strip_eos(turn.model, generated), timer.first_call

    def teacher_force(
        self, method: Method, turn: Turn, prompt: torch.Tensor, cache: SharedCache, forced: torch.Tensor
    ) -> tuple[torch.Tensor, float, torch.Tensor]:
        """Feed ``forced`` through the built cache (after the prompt's uncached tokens) in one forward:
        the forced ids, the time the logits were there and the logits ``[T, vocab]`` predicting them."""
        start = cache.get_seq_length()  # the prompt's tokens from here (at least its last) come first
        inputs = torch.cat([prompt[start:], forced[:-1]])
        positions = torch.arange(start, start + inputs.numel(), device=prompt.device)[None]
        with torch.no_grad():
            out = turn.model(
                input_ids=turn.batch(inputs),
                position_ids=mrope.forward_positions(cache, positions.expand(turn.batch_size, -1)),
                use_cache=True,
                **cache_kwargs(cache),
                **method.forward_kwargs(turn),
            )
        synchronize(prompt.device)
        self._tail_written(cache)
        return forced, time.perf_counter(), out.logits[0, -forced.numel() :].float()

    def _tail_written(self, cache: SharedCache) -> None:
        cache.segments.extend(self.tail_segments)  # their K/V written by the caller's forward
        self.tail_segments = []

    def complete_output(self, turn: Turn, cache: SharedCache, output_ids: torch.Tensor) -> None:
        """``generate`` does not feed its last token: compute the output's missing K/V (one dense step)
        so that the record can keep the whole output's."""
        missing = turn.prompt_length + output_ids.numel() - cache.get_seq_length()
        if missing > 0:
            tail = output_ids[output_ids.numel() - missing :].to(turn.device)
            with cache.unsealed():
                prefill_dense(cache, turn.model, turn.batch(tail))


def strip_eos(model: torch.nn.Module, generated: torch.Tensor) -> torch.Tensor:
    """Drop trailing EOS/pad tokens (kept when the output is nothing else, so the slot is never empty)."""
    config = model.generation_config
    stop = set()
    for tok in (config.eos_token_id, config.pad_token_id):
        if tok is None:
            continue
        stop.update(tok if isinstance(tok, (list, tuple)) else [tok])
    end = generated.numel()
    while end > 0 and int(generated[end - 1]) in stop:
        end -= 1
    return generated[: max(end, 1)]


def compute_kept_text(turn: Turn, parts: list[CachePart]) -> None:
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

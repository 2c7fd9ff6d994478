"""The ``limit`` row of the benchmark: how fast a reuse turn can possibly be.

For every reuse turn of a request, in the same run as the methods (after them, request by request):
the time of ONE model forward over only the turn's non-reused tokens (its PF text, the PH segments
no earlier turn read or produced, and the prompt's last token, whose logits give the first token)
over a cache that already holds the reusable PH segments' K/V at their positions. That cache is
built untimed from NonShared's exact K/V of the same prompt (the teacher-forced pass's cache when
fidelity is measured, else an untimed prefill), with the same one-forward placement the methods use
(:func:`~hf_kvshare.prefill.prefill_parts`); only the model forward is timed (forward
hooks, device synchronized), so no method can beat it. The row is a pseudo-method ``limit``
(``<config>/limit/turns.jsonl`` and ``summary.json``): ``ttft_ratio`` = NonShared / limit, beside
every method's, in the summary tables and the sweep plots.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch

from .._compat import is_peft_model
from ..agents import agent_adapter
from ..cache import CachePart, Segment, SegmentedCache
from ..evaluation.protocol import ttft_summary
from ..measure import synchronize
from ..prefill import prefill_dense, prefill_parts
from ..turn import TurnResult

#: the pseudo-method's label and directory name (not a registered method)
LIMIT = "limit"


def limit_ttft(
    model: torch.nn.Module, turn: TurnResult, reusable: set[str], exact: SegmentedCache | None = None
) -> float | None:
    """Seconds of one forward over ``turn``'s non-reused tokens on top of its reusable PH segments'
    K/V (``None`` when the turn reuses nothing). ``turn``: NonShared's result for the turn (its
    segment table gives the spans); ``exact``: a cache holding NonShared's K/V of at least the prompt
    minus its last token (``None``: prefilled here, untimed)."""
    ids = turn.prompt_ids.flatten()
    last = ids.numel() - 1
    rows = [s for s in turn.segments if s.end <= last]
    if not any(s.kind == "PH" and s.name in reusable for s in rows):
        return None
    device = next(model.parameters()).device
    adapter = agent_adapter(model, turn.agent) if is_peft_model(model) else nullcontext()
    with adapter, torch.no_grad():
        if exact is None:
            exact = SegmentedCache(model.config)
            prefill_dense(exact, model, ids[None, :last].to(device))
        parts = []
        for s in rows:
            if s.kind == "PH" and s.name in reusable:
                segment = Segment(s.name, s.kind, s.start, s.end, "reused")
                parts.append(CachePart(segment, kv=exact.extract(s.start, s.end)))
            else:
                segment = Segment(s.name, s.kind, s.start, s.end, "dense")
                parts.append(CachePart(segment, token_ids=ids[None, s.start : s.end]))
        parts.append(CachePart(Segment("prompt_tail", "PF", last, last + 1), token_ids=ids[None, last:]))
        cache = SegmentedCache(model.config)
        times: list[float] = []

        def before(module, args, kwargs):
            synchronize(device)
            times.append(time.perf_counter())

        def after(module, args, kwargs, output):
            synchronize(device)
            times.append(time.perf_counter())

        handles = [
            model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True),
        ]
        try:
            prefill_parts(cache, model, parts)
        finally:
            for handle in handles:
                handle.remove()
    return times[-1] - times[0]


def limit_records(
    model: torch.nn.Module,
    reference: list[TurnResult],
    reusable: list[set[str]],
    forced: list[TurnResult] | None = None,
) -> list[dict[str, Any]]:
    """One record per reuse turn of a request: ``ttft_s`` (the limit) and ``ref_ttft_s`` (NonShared's
    TTFT of the same turn in the same run)."""
    records = []
    for k, (turn, slots) in enumerate(zip(reference, reusable)):
        exact = forced[k].cache if forced is not None and forced[k].cache is not None else None
        seconds = limit_ttft(model, turn, slots, exact)
        if seconds is None:
            continue
        records.append(
            {
                "position": k,
                "agent": turn.agent,
                "method": LIMIT,
                "reuse_turn": True,
                "ttft_s": seconds,
                "ref_ttft_s": turn.ttft_s,
                "prompt_tokens": int(turn.prompt_ids.numel()),
                "reused_tokens": sum(s.length for s in turn.segments if s.kind == "PH" and s.name in slots),
            }
        )
    return records


def summarize_limit(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``limit`` row: TTFT statistics over reuse turns and NonShared / limit."""
    return {
        "method": LIMIT,
        "tag": LIMIT,
        "turns": len(turns),
        "reuse_turns": len(turns),
        **ttft_summary(turns),
    }

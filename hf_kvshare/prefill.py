"""Prefill: run the model over token ids on top of a :class:`~hf_kvshare.cache.SegmentedCache`.

The cache stores (K/V, the segment table, the guards); this module runs the model. Two entry points,
each taking ``(cache, model)``:

- :func:`prefill_dense`: one forward over ``input_ids`` at the positions after the cache's end (the
  model's cache updates append its K/V) and the segment rows that tile them;
- :func:`prefill_parts`: a turn's parts in positional order, placed K/V (reused / corrected) as they
  are and every dense part's tokens in **one** forward at their true positions, with a 4D mask built
  from positions alone (:func:`position_masks`); the per-segment path where that cannot run.

>>> cache = SegmentedCache(model.config)  # doctest: +SKIP
>>> prefill_dense(cache, model, ids_of_system_prompt, [Segment("sys", "PF", 0, n)])  # doctest: +SKIP
>>> prefill_parts(cache, model, parts, RopeShifter.from_model(model))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from . import _compat, mrope
from ._compat import cache_kwargs
from .cache import CachePart, Segment, SegmentedCache, check_tiling
from .mrope import part_ropes
from .rope import RopeShifter


def model_input_device(model: torch.nn.Module) -> torch.device:
    """Where a model's ``input_ids`` go: the device of its input embeddings (with an accelerate
    ``device_map`` the layers may sit on other devices, or on ``meta`` when offloaded to disk; per-layer
    tensors stay on their layer's device). Falls back to ``model.device`` / the first parameter."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    try:
        device = model.device
    except AttributeError:
        device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def prefill_dense(
    cache: SegmentedCache,
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    segments: Iterable[Segment] = (),
    *,
    inputs_embeds: torch.Tensor | None = None,
    rope: list[tuple[int, Any]] | None = None,
    **model_kwargs: Any,
) -> torch.Tensor | None:
    """Run ``model`` over ``input_ids`` ``[batch, n]`` on top of ``cache`` (positions continue).

    ``segments`` (positions relative to the whole cache) are appended to the table; they must tile the
    new positions. The cache is bound to ``model`` (:meth:`SegmentedCache.bind_model`: it refuses
    another). ``inputs_embeds`` ``[batch, n, hidden]``: the tokens' input embeddings, fed instead of
    the ids (an image's projected features; :func:`dense_embeds`). ``rope``: on a multimodal-RoPE model,
    ``(offset in input_ids, mrope.VisualRope)`` of each image among them (:mod:`hf_kvshare.mrope`: the
    forward then takes ``[4, batch, n]`` position ids). ``model_kwargs`` go to the model call
    (e.g. PEFT's ``adapter_names``). Returns the logits of the last token ``[batch, vocab]`` (``None``
    for no tokens).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    start = cache.get_seq_length()
    n = input_ids.shape[-1]
    segments = list(segments)
    check_tiling(segments, start, start + n)
    if inputs_embeds is not None and tuple(inputs_embeds.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"inputs_embeds must be [batch, n, hidden] for input ids {tuple(input_ids.shape)}; "
            f"got shape {tuple(inputs_embeds.shape)}"
        )
    cache.bind_model(model)
    track = mrope.track(cache, model)
    if n == 0:
        return None
    device = model_input_device(model)
    positions = torch.arange(start, start + n, device=device)[None].expand(input_ids.shape[0], -1)
    if track is not None:
        positions = mrope.position_ids(positions, mrope.lay_out_ids(model, track, start, input_ids, rope))
    inputs = (
        {"input_ids": input_ids.to(device)}
        if inputs_embeds is None
        else {"inputs_embeds": inputs_embeds.to(device)}
    )
    try:
        with torch.no_grad():
            out = model(
                **inputs,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(cache),
                **model_kwargs,
            )
    except BaseException:
        if track is not None:
            cache.crop_to(start)
        raise
    cache.segments.extend(segments)
    return out.logits[:, -1]


def prefill_parts(
    cache: SegmentedCache,
    model: torch.nn.Module,
    parts: Iterable[CachePart],
    shifter: RopeShifter | None = None,
    **model_kwargs: Any,
) -> None:
    """Append ``parts`` (in positional order, tiling the positions after the cache's end) to ``cache``:
    placed K/V as they are (consecutive placed parts with each layer written once:
    :meth:`SegmentedCache.append_placed`), and every dense part's tokens in **one** model forward.

    That forward feeds the dense tokens at their true ``position_ids`` with an explicit 4D mask built
    from positions alone (:func:`position_masks`): the query at position ``q`` sees the cache slot
    holding position ``k`` iff ``k <= q`` (and ``q - k < W`` on a sliding-window layer), so no token can
    see a later position, whatever order the parts were computed or placed in. The placed K/V are
    written into their slots first and the dense slots reserved (:meth:`SegmentedCache.reserve`); the
    model writes through the returned :class:`~hf_kvshare.cache.SlotWriter`, which puts each layer's new
    K/V into the reserved slots (in place, before that layer attends), so the cache ends in positional
    order.

    No explicit mask where the causal one is all a forward needs (one ordinary forward, SDPA keeps its
    fused kernels, no ``[q, kv]`` mask is built here): only dense parts, dense parts all before the
    placed ones (a forward from the cache's start: transformers passes no mask to SDPA at all), or dense
    parts all after them (the placed K/V appended first, then one forward from the cache's end). Same
    K/V. A model that cannot take an explicit mask (flash / flex attention, a
    mixture of layer types its forward cannot take as a mapping; see
    ``_compat.explicit_attention_mask``) or a cache that cannot reserve slots (offloaded, or with
    layers other than plain ``DynamicLayer``) runs each run of consecutive dense parts as its own
    forward over the cache built so far (the per-segment path).

    ``model_kwargs`` go to every model call (e.g. PEFT's ``adapter_names``). On error nothing is
    appended.
    """
    parts = list(parts)
    if not parts:
        return
    start = cache.get_seq_length()
    check_tiling([p.segment for p in parts], start, parts[-1].segment.end)
    _check_parts(parts, shifter)
    cache.bind_model(model)
    mrope.track(cache, model)
    dense = [p for p in parts if p.dense]
    first_placed = next((i for i, p in enumerate(parts) if not p.dense), len(parts))
    if len(dense) == first_placed:  # no dense token follows a placed one: no mask needed
        if dense:
            ids = torch.cat([p.token_ids for p in dense], dim=-1)
            embeds = dense_embeds(model, dense)
            prefill_dense(
                cache,
                model,
                ids,
                [p.segment for p in dense],
                inputs_embeds=embeds,
                rope=part_ropes(dense),
                **model_kwargs,
            )
        try:
            cache.append_placed(parts[first_placed:], shifter)
        except BaseException:
            cache.crop_to(start)
            raise
        return
    last_placed = max(i for i, p in enumerate(parts) if not p.dense)
    if len(dense) == len(parts) - 1 - last_placed:  # one dense run from the cache's end: causal only
        try:
            cache.append_placed(parts[: last_placed + 1], shifter)
            ids = torch.cat([p.token_ids for p in dense], dim=-1)
            embeds = dense_embeds(model, dense)
            prefill_dense(
                cache,
                model,
                ids,
                [p.segment for p in dense],
                inputs_embeds=embeds,
                rope=part_ropes(dense),
                **model_kwargs,
            )
        except BaseException:
            cache.crop_to(start)
            raise
        return
    if not _one_forward(cache, model, parts, shifter, model_kwargs):
        _per_segment(cache, model, parts, shifter, model_kwargs)


def recompute_is_cheaper(model: torch.nn.Module, placed: int, dense: int) -> bool:
    """Whether computing ``placed`` leading tokens again, with the ``dense`` tokens after them in one
    forward from an empty cache, costs less than computing only the ``dense`` tokens on top of the
    placed K/V.

    The second is a forward from the cache's end, and there transformers gives SDPA (or eager
    attention) an explicit ``[q, kv]`` mask (bottom-right causal is no ``is_causal`` call): the kernel
    then computes every query-key pair of the ``dense x (placed + dense)`` rectangle, about
    ``dense^2 / 2`` pairs more than the causal triangle it computes from an empty cache, and the mask
    itself is ``dense x (placed + dense)`` bytes (1 GiB at 32K). Recomputing costs about ``placed``
    tokens of the whole model. With ``2 x`` the non-embedding parameters per token (the output
    projection runs for the last token only) and ``4 x layers x heads x head_dim`` per query-key pair,
    recomputing is cheaper when ``dense^2 / 2 x pair > placed x token`` (on the embedded SmolLM2-135M
    at 40 placed tokens: beyond ~500 dense tokens; measured on one CPU thread, about where the two
    forwards cost the same). ``False`` for an attention implementation that builds no such mask
    (flash / flex attention keep their own causal alignment) and where the model's shape is unknown."""
    if placed <= 0 or dense <= 0:
        return False
    config = getattr(model, "config", None)
    if (
        config is None
        or _compat.attention_implementation(config) not in _compat.EXPLICIT_MASK_IMPLEMENTATIONS
    ):
        return False
    text = _compat.text_config(config)
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    count = getattr(model, "num_parameters", None)
    if not (layers and heads and hidden and callable(count)):
        return False
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    weights = count(exclude_embeddings=True)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if output is not None and getattr(output, "weight", None) is not None:
        if inputs is None or output.weight is not getattr(inputs, "weight", None):  # untied: counted above
            weights -= output.weight.numel()
    per_token = 2 * max(weights, 1)
    per_pair = 4 * layers * heads * head_dim
    return dense * dense * per_pair / 2 > placed * per_token


def dense_embeds(
    model: torch.nn.Module, dense: list[CachePart], batch: int | None = None
) -> torch.Tensor | None:
    """The input embeddings ``[batch, n, hidden]`` of dense parts' tokens in order, where one of them
    carries its own (``CachePart.embeds``: an image's features); ``None`` when the ids alone give
    them all (the model embeds its ids itself). The other parts' rows are the model's input
    embeddings of their ids (``get_input_embeddings``), as the model's own forward computes them."""
    return input_embeds(model, [(p.token_ids, p.embeds) for p in dense], batch)


def input_embeds(
    model: torch.nn.Module, pieces: list[tuple[torch.Tensor, torch.Tensor | None]], batch: int | None = None
) -> torch.Tensor | None:
    """``inputs_embeds`` ``[batch, n, hidden]`` for pieces ``(token_ids [b, n] or [n], embeds or None)``
    in order: a piece's own embeddings where it has them, else the model's input embeddings of its
    ids; ``None`` when no piece has its own (feed the ids)."""
    if all(embeds is None for _, embeds in pieces):
        return None
    embedding = model.get_input_embeddings()
    device = model_input_device(model)
    rows = []
    with torch.no_grad():
        for ids, embeds in pieces:
            ids = ids[None] if ids.dim() == 1 else ids
            width = batch or ids.shape[0]
            row = embedding(ids.to(device)) if embeds is None else embeds.to(device)
            rows.append(row.to(embedding.weight.dtype).expand(width, -1, -1))
    return torch.cat(rows, dim=1)


def _check_parts(parts: list[CachePart], shifter: RopeShifter | None) -> None:
    for p in parts:
        if (p.kv is None) == (p.token_ids is None):
            raise ValueError(f"part {p.segment.name!r} needs exactly one of kv= or token_ids=")
        if p.token_ids is not None and p.token_ids.dim() != 2:
            raise ValueError(
                f"part {p.segment.name!r}: token_ids must be [batch, n]; got shape {tuple(p.token_ids.shape)}"
            )
        if p.embeds is not None and (
            p.token_ids is None or p.embeds.dim() != 3 or p.embeds.shape[1] != p.token_ids.shape[-1]
        ):
            raise ValueError(
                f"part {p.segment.name!r}: embeds must be [batch, n, hidden] beside its token_ids [batch, n]; "
                f"got embeds {tuple(p.embeds.shape)}, token_ids "
                f"{None if p.token_ids is None else tuple(p.token_ids.shape)}"
            )
        have = p.kv.length if p.kv is not None else p.token_ids.shape[-1]
        if have != p.segment.length:
            raise ValueError(
                f"part {p.segment.name!r} says [{p.segment.start}, {p.segment.end}) but holds {have} tokens"
            )
        if p.kv is not None and p.kv.start != p.segment.start and shifter is None:
            raise ValueError(
                f"K/V of {p.segment.name!r} sits at position {p.kv.start}, not {p.segment.start}: "
                "pass a RopeShifter to move it"
            )


def _per_segment(cache: SegmentedCache, model, parts: list[CachePart], shifter, model_kwargs) -> None:
    """Each run of consecutive dense parts as one forward over the cache built so far."""
    start = cache.get_seq_length()
    try:
        i = 0
        while i < len(parts):
            j = i
            if not parts[i].dense:
                while j < len(parts) and not parts[j].dense:
                    j += 1
                cache.append_placed(parts[i:j], shifter)
                i = j
                continue
            while j < len(parts) and parts[j].dense:
                j += 1
            ids = torch.cat([p.token_ids for p in parts[i:j]], dim=-1)
            embeds = dense_embeds(model, parts[i:j])
            prefill_dense(
                cache,
                model,
                ids,
                [p.segment for p in parts[i:j]],
                inputs_embeds=embeds,
                rope=part_ropes(parts[i:j]),
                **model_kwargs,
            )
            i = j
    except BaseException:
        cache.crop_to(start)
        raise


def position_masks(
    model: torch.nn.Module, queries: torch.Tensor, length: int, batch: int, dtype: torch.dtype
) -> Any:
    """The ``attention_mask`` for queries at positions ``queries`` ``[q]`` over cache slots
    ``0 .. length - 1`` (slot ``k`` holds position ``k``): ``k <= q``, and ``q - k < W`` on the
    sliding-window layers; in the form ``model`` applies as it is (``_compat.explicit_attention_mask``),
    or ``None`` when it cannot take an explicit mask."""
    keys = torch.arange(length, device=queries.device)
    causal = keys[None, :] <= queries[:, None]  # [q, kv]: position k seen from position q
    allowed = {"full_attention": causal}
    window = _compat.sliding_window(model.config)
    if window is not None:
        allowed["sliding_attention"] = causal & (keys[None, :] > queries[:, None] - window)
    return _compat.explicit_attention_mask(
        model, {t: m[None, None].expand(batch, 1, -1, -1) for t, m in allowed.items()}, dtype
    )


def _one_forward(cache: SegmentedCache, model, parts: list[CachePart], shifter, model_kwargs) -> bool:
    """The one-forward path of :func:`prefill_parts`; ``False`` (nothing done) when it cannot run."""
    if not cache.can_reserve:
        return False
    start = cache.get_seq_length()
    end = parts[-1].segment.end
    device = model_input_device(model)
    batch = max(p.token_ids.shape[0] for p in parts if p.dense)
    reference = next(p.kv for p in parts if not p.dense)
    for p in parts:  # before a multimodal-RoPE track is extended below
        if not p.dense:
            cache.check_placeable(p.kv, p.segment, shifter, layers=cache.signature[0] is not None)
    queries = torch.cat([torch.arange(p.segment.start, p.segment.end) for p in parts if p.dense]).to(device)
    mask = position_masks(model, queries, end, batch, reference.stored.keys[0].dtype)
    if mask is None:
        return False
    positions = queries[None].expand(batch, -1)
    track = cache.rope_track
    if track is not None:  # multimodal RoPE: placed K/V re-positioned, then to their rope positions
        parts, positions = mrope.lay_out_parts(model, track, start, parts, positions, shifter)
    ids = torch.cat([p.token_ids.expand(batch, -1) for p in parts if p.dense], dim=-1).to(device)
    embeds = dense_embeds(model, [p for p in parts if p.dense], batch)
    inputs = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds.to(device)}
    try:
        writer = cache.reserve(parts, queries, shifter)  # placed K/V re-positioned there, layer by layer
        with torch.no_grad():
            model(
                **inputs,
                position_ids=positions,
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(writer),
                **model_kwargs,
            )
    except BaseException:
        cache.crop_to(start)
        raise
    cache.segments.extend(p.segment for p in parts)
    return True

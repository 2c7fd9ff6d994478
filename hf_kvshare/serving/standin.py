"""An HF stand-in for the engine: what vLLM does with a :class:`~hf_kvshare.serving.host.Plan`, run
through the model's own ``generate``, so the serving contract (plan -> claim -> record) can be driven
without vLLM (``tests/test_serving.py``)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .._compat import cache_kwargs
from .host import Plan


def engine(
    model: torch.nn.Module, plan: Plan, max_new_tokens: int = 8, min_new_tokens: int | None = None
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Positions ``[0, local_hit)`` from a prefix cache (here a plain prefill), the claimed K/V written,
    every other token computed; greedy. Returns the output ids and the K/V used,
    ``[layers, n, kv_heads, head_dim]`` each (prompt + output but its last token), as :meth:`Sharing.record
    <hf_kvshare.serving.host.Sharing.record>` takes them."""
    prompt = torch.tensor(plan.prompt)[None]
    cache = DynamicCache()
    with torch.no_grad():
        if plan.local_hit:
            model(input_ids=prompt[:, : plan.local_hit], use_cache=True, **cache_kwargs(cache))
        for layer, (k, v) in enumerate(zip(plan.keys, plan.values)):
            cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], layer)
        extra = {} if min_new_tokens is None else {"min_new_tokens": min_new_tokens}
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **extra,
            **cache_kwargs(cache),
        )
    ids = out[0, prompt.shape[1] :].tolist()
    # one [layers, n, kv_heads, head_dim] tensor per K and V, as the connector's worker reads them back
    keys = torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers])
    values = torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers])
    return ids, keys, values

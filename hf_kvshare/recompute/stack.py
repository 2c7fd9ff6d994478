"""The one place that knows a decoder's structure: embeddings, decoder layers, rotary module, query path.

Selective recomputation calls each decoder layer of the model itself (its own projections, norms,
RoPE layout, soft-capping, MLP), so any decoder whose ``get_decoder()`` holds ``layers`` and a
rotary module works: Llama, Qwen2/3, Gemma 1/2/3, Phi/Phi3, OLMo2, Granite, SmolLM3, Cohere,
Mistral, Starcoder2, StableLM, GPT-NeoX, GLM4. What this class supplies per layer is what the model's
forward would have passed it: the layer-0 input (read from the model's own forward, so embedding
scales and multipliers are the model's), ``position_embeddings`` for the layer's type, and whether
the layer attends through a sliding window. Attention must be ``sdpa`` or ``eager`` (a float mask
is passed to each layer).
"""

from __future__ import annotations

import inspect

import torch

from .._compat import attention_implementation, layer_types, sliding_window, text_config
from ..hooks import thread_hook
from ..rope import RopeShifter, find_rotary_module

SUPPORTED_ATTENTION = ("sdpa", "eager")


class _LayerInput(Exception):
    """Raised by the pre-hook on layer 0 once it has captured the layer's input (stops the forward)."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden


class DecoderStack:
    """Structure access for layer-by-layer execution of a decoder-only model.

    Args:
        model: a causal LM whose ``get_decoder()`` has ``layers`` and a rotary embedding module.

    >>> stack = DecoderStack(model)  # doctest: +SKIP
    >>> stack.num_layers, stack.hidden_size  # doctest: +SKIP
    (30, 576)
    """

    def __init__(self, model: torch.nn.Module):
        config = text_config(model.config)
        attention = attention_implementation(model.config)
        if attention not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"selective recomputation passes a float attention mask, which needs attention implementation "
                f"{' or '.join(SUPPORTED_ATTENTION)}; the model uses {attention!r} "
                "(load it with attn_implementation='sdpa')"
            )
        decoder = model.get_decoder()
        if not hasattr(decoder, "layers"):
            raise ValueError(
                f"selective recomputation runs the model's decoder layers one by one; {type(decoder).__name__} "
                "has no `layers`"
            )
        self.model = model
        self.config = config
        self.decoder = decoder
        self.layers = decoder.layers
        self.rotary = find_rotary_module(decoder)
        self.shifter = RopeShifter.from_model(model)  # the RoPE layout (and a clear error for dynamic NTK)
        self.embedding = decoder.get_input_embeddings()
        self.num_layers = len(self.layers)
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layer_types = layer_types(config)
        unsupported = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if unsupported:
            raise ValueError(
                f"selective recomputation supports full and sliding-window attention layers; this model has {unsupported}"
            )
        self.sliding_window = sliding_window(config)
        self._rotary_by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "sliding_attention"

    def embed(self, token_ids: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Input of layer 0 ``[1, n, hidden]`` for token ids ``[n]``, as the model's forward computes it
        (embedding scales such as Gemma's ``sqrt(hidden)`` or Granite's multiplier included); from
        ``embeds`` ``[1, n, hidden]`` (the decoder's ``inputs_embeds``) where given."""

        def capture(module, args, kwargs):
            raise _LayerInput(args[0] if args else kwargs["hidden_states"])

        handle = self.layers[0].register_forward_pre_hook(thread_hook(capture), with_kwargs=True)
        try:
            with torch.no_grad():
                if embeds is None:
                    self.decoder(input_ids=token_ids.to(self.device)[None], use_cache=False)
                else:
                    self.decoder(inputs_embeds=embeds.to(self.device), use_cache=False)
        except _LayerInput as captured:
            return captured.hidden
        finally:
            handle.remove()
        raise RuntimeError(f"{type(self.decoder).__name__} never called its first layer")

    def rope(
        self, hidden: torch.Tensor, positions: torch.Tensor, layer_idx: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's ``position_embeddings`` (``cos``, ``sin``) for ``layer_idx`` at absolute ``positions`` ``[1, q]``."""
        with torch.no_grad():
            if self._rotary_by_type:
                return self.rotary(hidden, positions, self.layer_types[layer_idx])
            return self.rotary(hidden, position_ids=positions)

    def query_source(self, layer_idx: int) -> torch.nn.Module:
        """The module whose output holds the layer's projected queries: ``q_proj`` ``[1, q, heads * head_dim]``,
        or Phi3's fused ``qkv_proj`` (queries first). Raises ``ValueError`` for other layouts (GPT-NeoX's
        per-head interleaved ``query_key_value``)."""
        attn = self.layers[layer_idx].self_attn if hasattr(self.layers[layer_idx], "self_attn") else None
        for name in ("q_proj", "qkv_proj"):
            module = getattr(attn, name, None)
            if module is not None:
                return module
        raise ValueError(
            f"{type(self.layers[layer_idx]).__name__} has no query projection (`self_attn.q_proj` or "
            "`self_attn.qkv_proj`); attention-based selection needs the layer's queries"
        )

    def query_projection(self, layer_idx: int) -> torch.nn.Module:  # earlier name
        return self.query_source(layer_idx)

    def rotated_queries(
        self, projected: torch.Tensor, positions: torch.Tensor, layer_idx: int
    ) -> torch.Tensor:
        """Post-RoPE queries ``[1, heads, q, head_dim]`` from the output of :meth:`query_source`
        ``[1, q, *]`` at absolute ``positions`` ``[q]``: the layer's query norm (Qwen3, OLMo2, Gemma 3,
        Cohere), then RoPE in the model's layout (partial, interleaved, per layer)."""
        b, q = projected.shape[:2]
        width = self.num_heads * self.head_dim
        flat = projected[..., :width]  # a fused qkv projection holds the queries first
        attn = self.layers[layer_idx].self_attn
        norm = getattr(attn, "q_norm", None) or getattr(attn, "q_layernorm", None)
        heads = flat.reshape(b, q, self.num_heads, self.head_dim)
        if norm is not None:
            weight = getattr(norm, "weight", None)
            if weight is not None and weight.dim() == 1 and weight.numel() == width:
                heads = norm(flat).reshape(b, q, self.num_heads, self.head_dim)  # OLMo2: over all heads
            else:
                heads = norm(heads)  # per head (Qwen3, Gemma 3, Cohere)
        heads = heads.transpose(1, 2).float()
        positions = positions.flatten()  # on the queries' device: no host round trip per layer
        rotation = self.shifter.rotation(torch.zeros_like(positions), positions, q)
        rotated = self.shifter.apply(heads, rotation, layer=layer_idx)
        scale = self._attention_scaling_of_rope(layer_idx)
        if scale != 1.0:
            rd = self.shifter.rotary_dim
            rotated = torch.cat((rotated[..., :rd] * scale, rotated[..., rd:]), dim=-1)
        return rotated

    def _attention_scaling_of_rope(self, layer_idx: int) -> float:
        if self._rotary_by_type:
            return float(getattr(self.rotary, f"{self.layer_types[layer_idx]}_attention_scaling", 1.0))
        return float(getattr(self.rotary, "attention_scaling", 1.0))

    def attention_scaling(self, layer_idx: int) -> float:
        return float(getattr(self.layers[layer_idx].self_attn, "scaling", self.head_dim**-0.5))

    def check_layer(self, layer_idx: int, what: str = "layer") -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"{what} must be a layer index in [0, {self.num_layers}); got {layer_idx!r}")

"""The one place that knows a decoder's structure: embeddings, decoder layers, rotary module, query projection.

Supported: Llama-style decoders (``llama``, ``qwen2``, ``mistral``) with ``sdpa`` or ``eager``
attention (selective recomputation passes its own float attention mask to each layer).
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import attention_implementation
from ..rope import rotate_half

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ATTENTION = ("sdpa", "eager")


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


class DecoderStack:
    """Structure access for layer-by-layer execution of a decoder-only model.

    Args:
        model: a causal LM whose ``get_decoder()`` has ``layers``, ``rotary_emb`` and input
            embeddings (Llama, Qwen2, Mistral).

    >>> stack = DecoderStack(model)  # doctest: +SKIP
    >>> stack.num_layers, stack.hidden_size  # doctest: +SKIP
    (30, 576)
    """

    def __init__(self, model: torch.nn.Module):
        config = _text_config(model.config)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                "selective recomputation runs the model's decoder layers one by one and supports model types "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}; got {model_type!r}"
            )
        attention = attention_implementation(model.config)
        if attention not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"selective recomputation passes a float attention mask, which needs attention implementation "
                f"{' or '.join(SUPPORTED_ATTENTION)}; the model uses {attention!r} "
                "(load it with attn_implementation='sdpa')"
            )
        decoder = model.get_decoder()
        for attr in ("layers", "rotary_emb"):
            if not hasattr(decoder, attr):
                raise ValueError(f"{type(decoder).__name__} has no `{attr}`; expected a Llama-style decoder")
        self.model = model
        self.config = config
        self.layers = decoder.layers
        self.rotary = decoder.rotary_emb
        self.embedding = decoder.get_input_embeddings()
        self.num_layers = len(self.layers)
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[1, n, hidden]`` of token ids ``[n]``."""
        with torch.no_grad():
            return self.embedding(token_ids.to(self.device)[None])

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's ``(cos, sin)`` ``[1, q, head_dim]`` for absolute ``positions`` ``[1, q]``."""
        with torch.no_grad():
            return self.rotary(hidden, position_ids=positions)

    def query_projection(self, layer_idx: int) -> torch.nn.Module:
        return self.layers[layer_idx].self_attn.q_proj

    def rotated_queries(self, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Post-RoPE queries ``[1, heads, q, head_dim]`` from a ``q_proj`` output ``[1, q, heads * head_dim]``
        and the layer's ``(cos, sin)`` ``[1, q, head_dim]`` (Llama's half-rotation convention)."""
        q = projected.view(projected.shape[0], projected.shape[1], self.num_heads, self.head_dim).transpose(
            1, 2
        )
        return q * cos[:, None] + rotate_half(q) * sin[:, None]

    def attention_scaling(self, layer_idx: int) -> float:
        return float(getattr(self.layers[layer_idx].self_attn, "scaling", self.head_dim**-0.5))

    def check_layer(self, layer_idx: int, what: str = "layer") -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"{what} must be a layer index in [0, {self.num_layers}); got {layer_idx!r}")

"""Every transformers / PEFT version branch of hf_kvshare lives here, and nowhere else.

Supported: transformers >=5.16,<6 (see pyproject.toml); CI runs the whole suite on the newest
release it installs (5.24) and the fast lane on 5.16. What differs before 5.24, handled below:

- 5.24 renamed the model/generate keyword ``past_key_values`` to ``cache`` (old name accepted
  with a ``FutureWarning`` until 5.40 for forward and 6.0 for generate); outputs expose ``.cache``.
  Before 5.24 only ``past_key_values=`` exists (``generate`` rejects ``cache=``; a model forward
  silently ignores it): use ``cache_kwargs`` / ``output_cache``.
- 5.24 added a trailing ``kwargs`` argument to ``Cache.update`` (the attention kwargs, with the
  ``position_ids``); our override accepts and forwards ``*args, **kwargs`` so both call shapes
  work, and ``update_position_ids`` reads the position ids from the attention's ``forward`` frame
  before 5.24.
- ``Cache.crop(n)``: a negative ``n`` removes ``-n`` tokens on every 5.x release; 5.24 refuses a
  positive ``n`` (older releases read it as the absolute length to keep, with a deprecation warning).
- ``Cache.reset()``: 5.24 drops the layers' states; before, it zeroes them in place and the length
  stays (``drop_layer_states``).
- Before 5.24 ``generate(prefill_chunk_size=...)`` and assisted decoding over a prefilled cache are
  wrong upstream (``PREFILL_CHUNKS_REFEED_CACHED_PROMPT``, ``ASSISTED_DECODING_EXACT_WITH_NEW_TOKENS``).
- 5.4 changed ``get_mask_sizes`` from ``(cache_position, layer_idx)`` to
  ``(query_length, layer_idx)``; our caches inherit it unchanged.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(transformers.__version__)

#: The keyword that model forward and ``generate`` take for the KV cache.
CACHE_KWARG = "cache" if TRANSFORMERS_VERSION >= Version("5.24.0") else "past_key_values"

#: Whether ``crop`` reads a positive argument as "length to keep" (pre-5.24) or refuses it.
CROP_ACCEPTS_ABSOLUTE_LENGTH = TRANSFORMERS_VERSION < Version("5.24.0")


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """The keyword argument that passes ``cache`` to forward/generate on this transformers.

    >>> model.generate(input_ids=ids, **cache_kwargs(shared_cache))  # doctest: +SKIP
    """
    return {CACHE_KWARG: cache}


def output_cache(outputs: Any) -> Any:
    """The cache object of a model output (``.cache`` on >=5.24, ``.past_key_values`` before)."""
    if CACHE_KWARG == "cache":
        return outputs.cache
    return outputs.past_key_values


def crop_target_length(current_length: int, tokens_to_remove: int) -> int:
    """Length a cache of ``current_length`` has after ``crop(tokens_to_remove)``.

    A negative argument removes that many tokens on every version; a positive one is the
    absolute length to keep on transformers < 5.24 and an error from 5.24 on.
    """
    if tokens_to_remove < 0:
        return max(current_length + tokens_to_remove, 0)
    if tokens_to_remove == 0:
        return current_length
    if CROP_ACCEPTS_ABSOLUTE_LENGTH:
        return min(tokens_to_remove, current_length)
    raise ValueError(
        f"crop expects a negative number of tokens to remove on transformers {TRANSFORMERS_VERSION}; "
        f"got {tokens_to_remove}"
    )


def crop_argument(current_length: int, keep: int) -> int:
    """The argument to pass to ``Cache.crop`` so that ``keep`` tokens remain (any version)."""
    return keep - current_length  # negative (or 0): "remove this many" is understood everywhere


#: Whether ``Cache.reset`` / ``DynamicLayer.reset`` drop the stored states (5.24) or zero them in place
#: and keep their length (earlier 5.x: ``get_seq_length`` still reports the old length after a reset).
RESET_DROPS_STATES = TRANSFORMERS_VERSION >= Version("5.24.0")


def drop_layer_states(layers: Any) -> None:
    """Make the following ``reset()`` of these cache layers (or of their cache) leave them empty on every
    version: before 5.24 the dynamic layers' reset zeroes keys/values in place (same length); call this
    first to drop them as 5.24 does. A no-op from 5.24 on."""
    if RESET_DROPS_STATES:
        return
    for layer in layers:
        if getattr(layer, "is_initialized", False) and hasattr(layer, "keys"):
            layer.keys = layer.values = None
            layer.is_initialized = False


def adopt_layer_states(layer: Any, keys: Any, values: Any) -> bool:
    """Make an empty plain ``DynamicLayer`` hold ``keys`` / ``values`` themselves, as its first
    ``update`` would hold a copy of them (it concatenates them onto an empty tensor: the whole layer
    copied once more, into fresh memory). For tensors the caller owns (just built, not read by anyone
    else). Returns ``False`` and does nothing for any other layer (initialized, sliding, quantized,
    offloaded): update it. The same ``lazy_initialization`` then states on 5.16-5.24."""
    from transformers.cache_utils import DynamicLayer

    if type(layer) is not DynamicLayer or layer.is_initialized:
        return False
    hold_layer_states(layer, keys, values)
    return True


def hold_layer_states(layer: Any, keys: Any, values: Any) -> None:
    """Make an empty ``DynamicLayer`` (or a subclass that appends as it does: the cache's
    ``SegmentLayer``) hold ``keys`` / ``values`` themselves (:func:`adopt_layer_states` without its
    check of the class)."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def peft_lora_layer_types() -> tuple[type, ...]:
    """PEFT's LoRA layer classes (``peft.tuners.lora.LoraLayer``)."""
    from peft.tuners.lora import LoraLayer

    return (LoraLayer,)


def attention_implementation(config: Any) -> str:
    """The attention implementation a model was loaded with (``config._attn_implementation``, a
    private transformers attribute; ``"eager"`` when unset)."""
    return getattr(config, "_attn_implementation", None) or "eager"


def config_name_or_path(config: Any) -> str:
    """The model id or path a config was loaded from (``config._name_or_path``; ``""`` when unset)."""
    return getattr(config, "_name_or_path", "") or ""


def longrope_inverse_frequencies(config: Any, seq_len: int) -> Any:
    """The long-context inverse frequencies of a ``longrope`` config at ``seq_len`` (transformers'
    ``modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"]``, on CPU)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    return inv_freq


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE parameter dict of a text config (``rope_parameters`` on 5.x)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # 4.x configs used `rope_scaling` (+ `rope_theta`)
        params = dict(getattr(config, "rope_scaling", None) or {"rope_type": "default"})
    return dict(params)


def text_config(config: Any) -> Any:
    """The decoder's text config (``get_text_config(decoder=True)`` where a config nests one)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_types(config: Any) -> list[str]:
    """Attention type of each decoder layer (``"full_attention"``, ``"sliding_attention"``, ...), as
    ``DynamicCache(config=...)`` reads them (transformers' ``cache_utils.get_layer_types_and_kwargs``:
    ``config.layer_types``, else ``sliding_window`` / ``attention_chunk_size`` per layer)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(text_config(config))
    return list(types)


def sliding_window(config: Any) -> int | None:
    """The sliding-window length of a config's local layers (``None`` when it has none)."""
    return getattr(text_config(config), "sliding_window", None)


def layers_without_rope(config: Any) -> list[bool] | None:
    """Per layer, whether it applies no RoPE (SmolLM3's ``no_rope_layers``: 1 = RoPE, 0 = none), or ``None``."""
    flags = getattr(text_config(config), "no_rope_layers", None)
    if flags is None:
        return None
    return [not bool(flag) for flag in flags]


def per_layer_type_rotary(rotary: Any) -> dict[str, tuple[str, Any]] | None:
    """``{layer type: (rope type, inverse frequencies)}`` of a rotary module with frequencies per layer
    type (Gemma 3: buffers ``<type>_original_inv_freq``, ``rope_type`` a dict), else ``None``."""
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, dict):
        return None
    out = {}
    for layer_type, kind in rope_type.items():
        inv_freq = getattr(rotary, f"{layer_type}_original_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, f"{layer_type}_inv_freq")
        out[layer_type] = (kind, inv_freq)
    return out


def rotary_pairs_interleaved(rotary: Any) -> bool:
    """Whether the model pairs rotary dimensions as neighbours ``(2i, 2i + 1)`` (Cohere, GLM) rather than
    as halves ``(i, i + d/2)`` (Llama): read from the ``rotate_half`` of the modeling module that defines
    the rotary class (each family's ``modeling_<family>.py`` has its own)."""
    import sys

    import torch

    module = sys.modules.get(type(rotary).__module__)
    fn = getattr(module, "rotate_half", None)
    if fn is None:
        return False
    probe = fn(torch.arange(1.0, 5.0))
    if probe.tolist() == [-3.0, -4.0, 1.0, 2.0]:
        return False
    if probe.tolist() == [-2.0, 1.0, -4.0, 3.0]:
        return True
    raise ValueError(
        f"{type(rotary).__module__}.rotate_half has an unknown layout ({probe.tolist()} for [1, 2, 3, 4]); "
        "re-positioning supports Llama's halves and interleaved pairs"
    )


def decoder_layer_cache_kwarg(layer: Any) -> str:
    """The keyword a decoder layer takes its cache under: ``layer_past`` (GPT-NeoX), else the model
    keyword of this transformers (``cache`` on >= 5.24, ``past_key_values`` before)."""
    import inspect

    params = inspect.signature(layer.forward).parameters
    for name in ("layer_past", CACHE_KWARG, "past_key_values", "past_key_value"):
        if name in params:
            return name
    return CACHE_KWARG


# ----------------------------------------------------------------------------- explicit attention masks
#: Attention implementations that apply a given 4D mask as it is (``masking_utils`` returns a 4D
#: ``attention_mask`` unchanged, "it was already prepared, or it is custom"): ``sdpa`` takes a boolean
#: mask (True = attend), ``eager`` an additive float one. Flash / flex attention build their own.
EXPLICIT_MASK_IMPLEMENTATIONS = ("sdpa", "eager")


def explicit_attention_mask(model: Any, allowed: dict[str, Any], dtype: Any) -> Any:
    """The ``attention_mask`` argument that makes ``model`` apply ``allowed`` as it is, or ``None`` when
    this model cannot take an explicit mask (the caller then keeps its per-segment path).

    ``allowed``: ``{layer type: bool tensor [batch, 1, q, kv]}`` (True = the query sees the key), one per
    attention type the model has (``"full_attention"``, ``"sliding_attention"``). A model whose layers
    are all of one type gets that tensor; one with several types gets the ``{type: mask}`` mapping its
    forward accepts in place of building its masks (Gemma 2 / 3, Qwen2 / 3, SmolLM3 ... on 5.x), or
    ``None`` when its forward takes no mapping. ``eager`` gets the additive form (0 / dtype minimum),
    as ``masking_utils.eager_mask`` builds it.
    """
    import torch

    config = getattr(model, "config", None)
    if config is None or attention_implementation(config) not in EXPLICIT_MASK_IMPLEMENTATIONS:
        return None
    types = list(dict.fromkeys(layer_types(config)))
    if not types or any(t not in allowed for t in types):
        return None

    def form(mask: Any) -> Any:
        if attention_implementation(config) == "sdpa":
            return mask
        return torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)

    if len(types) == 1:
        return form(allowed[types[0]])
    if not _forward_takes_mask_mapping(model):
        return None
    return {t: form(allowed[t]) for t in types}


def _forward_takes_mask_mapping(model: Any) -> bool:
    """Whether the decoder's ``forward`` accepts a ``{layer type: mask}`` mapping as ``attention_mask``
    (read from its source: ``isinstance(... attention_mask, dict)``, how 5.x models skip building masks)."""
    import inspect

    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in source


# ----------------------------------------------------------------------------- PEFT
# Supported: peft >= 0.17 (see pyproject.toml); tested on 0.21.
# - ``LoraLayer.lora_variant`` (a dict adapter -> variant object: DoRA, aLoRA, ...) replaced the
#   per-adapter ``use_dora`` flags (still kept for backward compatibility) in 0.15/0.16.
# - ``PeftModel.set_adapter(name, inference_mode=...)`` gained ``inference_mode`` in 0.17;
#   without it, ``set_adapter`` marks the adapter trainable.


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (without importing PEFT when it is not loaded: no
    ``PeftModel`` exists then, and importing PEFT costs ~1.7 CPU-s on every turn's first call)."""
    import sys

    peft = sys.modules.get("peft")
    peft_model = getattr(peft, "PeftModel", None)
    return peft_model is not None and isinstance(model, peft_model)


def active_tuner_adapters(model: Any) -> list[str]:
    """The PEFT adapters that act in ``model``'s forward although ``model`` is not the ``PeftModel``
    (the inner model of one: its tuner layers, ``peft.tuners.tuners_utils.BaseTunerLayer``, enabled
    with active or merged adapters); empty when PEFT is not loaded or none acts."""
    import sys

    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    acting: set[str] = set()
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            acting.update(getattr(module, "merged_adapters", None) or [])
            if not getattr(module, "disable_adapters", False):
                acting.update(getattr(module, "active_adapters", None) or [])
    return sorted(acting)


def lora_variant_name(layer: Any, adapter: str) -> str | None:
    """Name of the LoRA variant ``adapter`` uses on ``layer`` (``"dora"``, ...) or ``None`` for plain LoRA."""
    if getattr(layer, "use_dora", {}).get(adapter, False):
        return "dora"
    variant = getattr(layer, "lora_variant", {}).get(adapter)
    if variant is None:
        return None
    name = type(variant).__name__
    return name[: -len("LinearVariant")].lower() if name.endswith("LinearVariant") else name


def set_active_adapter(model: Any, adapter: str) -> None:
    """``model.set_adapter(adapter)`` without changing which parameters require grad."""
    import inspect

    if "inference_mode" in inspect.signature(model.set_adapter).parameters:
        model.set_adapter(adapter, inference_mode=True)
    else:  # pragma: no cover - peft < 0.17
        model.set_adapter(adapter)


def restore_active_adapters(model: Any, adapters: list[str]) -> None:
    """Make ``adapters`` (as returned by ``model.active_adapters``) active again."""
    if len(adapters) == 1:
        set_active_adapter(model, adapters[0])
    else:
        model.base_model.set_adapter(list(adapters))


@contextmanager
def peft_wrapping_warnings_silenced():
    """Wrap a model with PEFT without the ``FutureWarning`` transformers >= 5.24 raises when PEFT <= 0.21
    reads ``model.is_gradient_checkpointing`` in ``PeftModel.__init__`` (not our call; nothing to fix on our side).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


# ----------------------------------------------------------------------------- caches inside generate
#: transformers 5.24's assisted decoding (``assistant_model=``, ``prompt_lookup_num_tokens=``, every
#: candidate-generator mode) feeds the whole ``input_ids`` on its first verification step even when
#: the given cache already holds part of them (``next_sequence_length=None`` on the first iteration of
#: ``GenerationMixin._assisted_decoding``): the prompt is cached twice and positions restart at 0, so
#: the output differs from greedy. Our caches refuse that step (see ``SegmentedCache.update``);
#: ``tests/test_generate_modes.py::test_upstream_assisted_decoding_with_prefilled_cache`` (strict
#: xfail) fails the day transformers fixes it.
ASSISTED_DECODING_REFEEDS_CACHED_PROMPT = True

#: Before 5.24 (seen on 5.16) assisted decoding and prompt lookup over a prefilled cache are wrong even
#: when ``input_ids`` holds only the new tokens (the 5.24 way above): same cache updates and crops as
#: 5.24, different tokens, on a plain ``DynamicCache`` too. Not detectable from the cache: documented,
#: and ``tests/test_generate_modes.py`` checks the 5.24 behaviour only where this is True.
ASSISTED_DECODING_EXACT_WITH_NEW_TOKENS = TRANSFORMERS_VERSION >= Version("5.24.0")

#: Before 5.24 (seen on 5.16) ``generate(prefill_chunk_size=...)`` over a prefilled cache feeds the
#: whole ``input_ids`` again from position 0 (a ``DynamicCache`` silently doubles the prompt); our
#: caches refuse the first chunk (``PositionMismatchError``) before anything is written.
PREFILL_CHUNKS_REFEED_CACHED_PROMPT = TRANSFORMERS_VERSION < Version("5.24.0")


#: Whether attention layers hand ``Cache.update`` the forward's attention kwargs (5.24:
#: ``update(k, v, layer_idx, kwargs=...)`` with ``position_ids``); earlier 5.x pass only ``layer_idx``.
UPDATE_RECEIVES_ATTENTION_KWARGS = TRANSFORMERS_VERSION >= Version("5.24.0")


def update_position_ids(args: tuple, kwargs: dict[str, Any]) -> Any:
    """Position ids ``[batch, seq]`` of the tokens a model forward hands to ``Cache.update``, or ``None``.

    5.24 attention layers call ``cache.update(k, v, layer_idx, kwargs=attention_kwargs)``; the
    attention kwargs carry the forward's ``position_ids``. Earlier 5.x call ``update(k, v, layer_idx)``
    from an attention ``forward(..., **kwargs)`` whose ``kwargs`` hold the ``position_ids`` the decoder
    layer passed it: read there (the nearest ``forward`` frame up the stack; ``None`` if it has none).
    """
    extra = kwargs.get("kwargs")
    if isinstance(extra, dict):
        return extra.get("position_ids")
    if UPDATE_RECEIVES_ATTENTION_KWARGS:
        return None
    import sys

    frame = sys._getframe(1)
    for _ in range(12):  # update_position_ids <- our checks <- Cache.update chain <- attention.forward
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "forward":
            local = frame.f_locals
            attention_kwargs = local.get("kwargs")
            if isinstance(attention_kwargs, dict) and "position_ids" in attention_kwargs:
                return attention_kwargs["position_ids"]
            return local.get("position_ids")
    return None


def is_tracing() -> bool:
    """Whether the code runs under ``torch.compile`` / ``torch.export`` (no data-dependent checks there)."""
    import torch

    compiler = getattr(torch, "compiler", None)
    if compiler is None:  # pragma: no cover - torch < 2.1
        return False
    exporting = getattr(compiler, "is_exporting", lambda: False)
    return bool(compiler.is_compiling() or exporting())


def register_pytree_node(cls: type, flatten, unflatten, flatten_with_keys, flatten_spec) -> None:
    """Register ``cls`` as a pytree node the way transformers registers ``DynamicCache`` for ``torch.export``
    (``transformers.integrations.executorch.register_dynamic_cache_export_support``): ``torch.utils._pytree``
    and ``torch.fx._pytree`` are private torch modules. Registering twice is a no-op."""
    import torch.fx._pytree as fx_pytree
    import torch.utils._pytree as pytree

    try:
        pytree.register_pytree_node(
            cls,
            flatten,
            unflatten,
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
            flatten_with_keys_fn=flatten_with_keys,
        )
        fx_pytree.register_pytree_flatten_spec(cls, flatten_spec)
    except ValueError as e:
        if "already registered" not in str(e):
            raise


def pytree_dict_flatten(values: dict, with_keys: bool = False):
    """``torch.utils._pytree``'s dict flattening (values, keys) / (keyed values, keys)."""
    import torch.utils._pytree as pytree

    return pytree._dict_flatten_with_keys(values) if with_keys else pytree._dict_flatten(values)


def pytree_dict_unflatten(values: list, keys: Any) -> dict:
    import torch.utils._pytree as pytree

    return pytree._dict_unflatten(values, keys)


def calling_decoder(max_depth: int = 40) -> Any:
    """The decoder module (an ``nn.Module`` with ``config`` and ``get_input_embeddings``) whose forward
    is on the call stack of the caller, innermost first; ``None`` when none is found (e.g. compiled or
    exported code). Lets a cache's ``update`` see which model writes into it without any hook."""
    import sys

    import torch

    frame = sys._getframe(1)
    depth = 0
    while frame is not None and depth < max_depth:
        owner = frame.f_locals.get("self")
        if (
            isinstance(owner, torch.nn.Module)
            and hasattr(owner, "config")
            and hasattr(owner, "get_input_embeddings")
        ):
            return owner
        frame = frame.f_back
        depth += 1
    return None


def generating_input_ids(min_length: int, max_depth: int = 60) -> Any:
    """The full ``input_ids`` ``[batch, length >= min_length]`` of the ``generate`` call on the call
    stack: the innermost frame of a model with ``generate`` (its decoding loop or prefill, which hold
    the whole sequence while the forward below sees only the uncached tail) whose local ``input_ids``
    is an integer tensor that long; ``None`` when none is found (inputs_embeds, only new tokens fed,
    compiled code). Lets a cache check on its first forward which prompt it is used with."""
    import inspect
    import sys

    import torch

    frame = sys._getframe(1)
    depth = 0
    while frame is not None and depth < max_depth:
        owner = frame.f_locals.get("self")
        ids = frame.f_locals.get("input_ids")
        if (
            isinstance(owner, torch.nn.Module)
            and callable(getattr(owner, "generate", None))
            # the model's own forward holds only what it is fed (a direct call, e.g. a teacher-forced
            # pass, is no generate call at all): only generate's frames hold the whole sequence
            and frame.f_code is not getattr(inspect.unwrap(type(owner).forward), "__code__", None)
            and isinstance(ids, torch.Tensor)
            and ids.dim() == 2
            and not ids.is_floating_point()
            and ids.shape[-1] >= min_length
        ):
            return ids
        frame = frame.f_back
        depth += 1
    return None


def mask_query_length(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The query length a ``Cache.get_mask_sizes`` call is for: its first argument is the query length
    (transformers >= 5.4) or the ``cache_position`` tensor (before)."""
    value = args[0] if args else kwargs.get("query_length", kwargs.get("cache_position"))
    if value is None:
        return None
    if hasattr(value, "numel"):
        return int(value.numel()) if value.dim() > 0 else int(value)
    return int(value)


def skipped_weight_init():
    """transformers' own ``no_init_weights`` block (modules built with uninitialized weights, the
    ``from_pretrained`` fast path): ``transformers.initialization`` on 5.x, ``modeling_utils`` before."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older layout
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode`` (a private torch module; the documented way to
    see every aten op a thread runs), the base of :class:`hf_kvshare.measure.TensorPeak`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def fresh_outputs(func, n: int) -> list[bool]:
    """Per result of the aten op ``func`` (an ``OpOverload``): ``True`` when it aliases no input (its
    schema's ``alias_info`` is ``None``: a new tensor), ``False`` for views, in-place and ``out=``
    results. ``OpOverload._schema`` is private; an op without a schema counts every result as new."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return [True] * n
    returns = [r.alias_info is None for r in schema.returns]
    return (returns + [True] * n)[:n]


# ------------------------------------------------------------------ vision-language models
def vision_tower(model: Any) -> Any:
    """A vision-language model's vision encoder module (LLaVA-OneVision: ``model.model.vision_tower``;
    the attribute is the model's own name, not an API), or ``None`` for a text-only model."""
    for owner in (model, getattr(model, "model", None)):
        # Qwen2-VL / Qwen2.5-VL: ``model.model.visual``; Idefics3 / SmolVLM: ``model.model.vision_model``
        for name in ("vision_tower", "visual", "vision_model"):
            tower = getattr(owner, name, None) if owner is not None else None
            if isinstance(tower, torch.nn.Module):
                return tower
    return None


def mrope_section(model: Any) -> list[int] | None:
    """The multimodal-RoPE sections ``[t, h, w]`` of a model whose rotary module reads three position
    components per token (Qwen2-VL / Qwen2.5-VL: the rotary module's ``mrope_section``, from the text
    config's rope parameters), or ``None`` for 1D RoPE."""
    for module in model.modules():
        section = getattr(module, "mrope_section", None)
        if section is not None and hasattr(module, "inv_freq"):
            return list(section)
    # transformers < 5.17 or so: the rotary module returns cos/sin per component and the attention
    # interleaves them by the text config's ``rope_parameters["mrope_section"]``
    owner = model if hasattr(model, "get_rope_index") else getattr(model, "model", None)
    if owner is None or not hasattr(owner, "get_rope_index"):
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    section = params.get("mrope_section") if isinstance(params, dict) else None
    return None if section is None else list(section)


def mrope_index(model: Any, kind: str, token_ids: Any, grid_thw: Any, **extra: Any) -> Any:
    """``[3, n + 1]`` rope positions of one image / video's placeholders ``token_ids`` ``[n]`` and one
    text token after them, from the model's own ``get_rope_index`` (transformers 5.24: on the inner
    model, taking ``mm_token_type_ids`` (1 image, 2 video) and the ``[1, 3]`` grid; Qwen2.5-VL also
    ``second_per_grid_ts`` for a video)."""
    owner = model if hasattr(model, "get_rope_index") else getattr(model, "model", None)
    index = getattr(owner, "get_rope_index", None)
    if index is None:
        raise ValueError(f"{type(model).__name__} has no get_rope_index for its multimodal RoPE")
    ids = torch.cat([token_ids.flatten().long().cpu(), torch.zeros(1, dtype=torch.long)])[None]
    types = torch.full_like(ids, 1 if kind == "image" else 2)
    types[0, -1] = 0
    grid = {f"{kind}_grid_thw": torch.as_tensor(grid_thw).reshape(1, 3).cpu()}
    positions, _ = index(ids, mm_token_type_ids=types, **grid, **extra)
    return positions[:, 0]


def visual_token_ids(model: Any) -> list[int]:
    """The image / video placeholder token ids in the model's config (none for a text-only model)."""
    config = model.config
    found = []
    for kind in ("image", "video"):
        for name in (f"{kind}_token_id", f"{kind}_token_index"):
            token = getattr(config, name, None)
            if isinstance(token, int):
                found.append(token)
                break
    return found


def visual_features(
    model: Any,
    kind: str,
    pixel_values: Any,
    image_sizes: Any,
    grid_thw: Any = None,
    pixel_attention_mask: Any = None,
) -> Any:
    """The projected features ``[n, hidden]`` of ONE image or video through the model's public
    ``get_image_features`` / ``get_video_features`` (``grid_thw``: Qwen2-VL's ``[1, 3]`` patch grid;
    ``pixel_attention_mask``: Idefics3 / SmolVLM's mask of the tiles' padding). The output:
    transformers 5.24: one whose ``pooler_output`` holds them, a list of per-image tensors for images
    (Idefics3 / SmolVLM: one ``[tiles * n, hidden]`` per image), ``[1, n, hidden]`` for a video;
    5.16: Idefics3 / SmolVLM's ``pooler_output`` is ``[tiles, n, hidden]``, flattened here in tile
    order (the order the model's own merge scatters them in); a bare tensor or list accepted too."""
    grid = {} if grid_thw is None else {f"{kind}_grid_thw": grid_thw}
    if kind == "image":
        sizes = {} if image_sizes is None else {"image_sizes": image_sizes}
        if pixel_attention_mask is not None:
            sizes["pixel_attention_mask"] = pixel_attention_mask
        out = model.get_image_features(pixel_values=pixel_values, **sizes, **grid)
    else:
        out = model.get_video_features(pixel_values_videos=pixel_values, **grid)
    features = getattr(out, "pooler_output", out)
    if isinstance(features, (list, tuple)):
        features = features[0]
    elif features.dim() == 3:
        features = features.reshape(-1, features.shape[-1])
    return features


def tiled_image_ids(processor: Any, rows: int, cols: int) -> list[int]:
    """The token ids an Idefics3 / SmolVLM processor expands one image split into ``rows x cols``
    tiles (and its global view; ``0, 0``: the global view alone) into: its ``replace_image_token``
    (the rule its ``__call__`` applies, the same signature on 5.16 and 5.24), tokenized as its
    ``__call__`` tokenizes the expanded text."""
    text = processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
    return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])


def processor_placeholders(processor: Any, kind: str, size: tuple[int, ...]) -> int:
    """How many placeholder tokens the processor expands one image (``size`` = ``(height, width)``) or
    video (``(frames, height, width)``) into: its ``_get_num_multimodal_tokens`` (a private name; the
    rule its ``__call__`` applies)."""
    if kind == "image":
        data = processor._get_num_multimodal_tokens(image_sizes=[list(size)])
        return int(data["num_image_tokens"][0])
    data = processor._get_num_multimodal_tokens(video_sizes=[list(size)])
    counts = getattr(data, "num_video_tokens", None)
    if counts is None:  # transformers 5.16's processors count image tokens only
        import transformers

        raise ValueError(
            f"{type(processor).__name__} (transformers {transformers.__version__}) does not say how many "
            "placeholder tokens a video expands into; video segments need a transformers whose processor "
            "does (5.24 is tested)"
        )
    return int(counts[0])


def grid_placeholders(model: Any, processor: Any, kind: str, grid_thw: Any) -> int:
    """Placeholders of one Qwen2-VL-style image / video of patch grid ``grid_thw`` ``[1, 3]``: the
    processor's rule (``_get_num_multimodal_tokens``, a private name) for an image of the grid's pixel
    size, else (a video, whose count 5.24's processor leaves to its video processor) the count the
    model's ``get_*_features`` splits its features by, ``t * h * w / spatial_merge_size**2``."""
    t, h, w = (int(x) for x in torch.as_tensor(grid_thw).reshape(3))
    vision = model.config.vision_config
    if kind == "image":
        patch = int(vision.patch_size)
        data = processor._get_num_multimodal_tokens(image_sizes=[[h * patch, w * patch]])
        return int(data["num_image_tokens"][0])
    return t * h * w // int(vision.spatial_merge_size) ** 2


def image_only_processor(name_or_path: str, **kwargs: Any) -> Any:
    """A vision-language model's processor without its video processor, for when
    ``AutoProcessor.from_pretrained`` cannot build the full one (transformers' video processors need
    torchvision): the class its ``processor_config.json`` names, subclassed with an ``__init__`` that
    takes no video processor (``ProcessorMixin`` reads its sub-processors from the ``__init__``
    signature), given the folder's image processor, tokenizer and processor options. The expansion
    rule is the class's own; video segments are then refused (no video processor). A class that
    takes no video processor (Idefics3) is built as it is, from the folder's image processor on its
    PIL backend where ``AutoImageProcessor`` needs torchvision. ``ValueError`` when the folder names
    no processor class transformers has."""
    import inspect
    import json
    from pathlib import Path

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.utils import cached_file

    path = cached_file(
        name_or_path, "processor_config.json", _raise_exceptions_for_missing_entries=False, **kwargs
    )
    options = json.loads(Path(path).read_text()) if path else {}
    saved = dict(options)
    name = options.pop("processor_class", None)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    taken = inspect.signature(cls.__init__).parameters if cls is not None else {}
    if cls is None or "image_processor" not in taken:
        raise ValueError(
            f"{name_or_path}: processor_config.json names processor class {name!r}; expected a transformers "
            "vision-language processor (e.g. LlavaOnevisionProcessor)"
        )
    options = {k: v for k, v in options.items() if k in taken and k not in ("image_processor", "tokenizer")}

    if "video_processor" in taken:

        class ImageOnlyProcessor(cls):
            def __init__(self, image_processor=None, tokenizer=None, **options):
                super().__init__(
                    image_processor=image_processor, tokenizer=tokenizer, video_processor=None, **options
                )

        ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{cls.__name__}"
    else:  # an image-only processor class (Idefics3Processor)
        ImageOnlyProcessor = cls
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    try:
        images = AutoImageProcessor.from_pretrained(name_or_path, **kwargs)
    except ImportError:  # transformers < 5.24 resolves it to the torchvision backend: take the PIL one
        images = pil_image_processor(name_or_path, saved, **kwargs)
    chat_template = getattr(tokenizer, "chat_template", None)
    processor = ImageOnlyProcessor(images, tokenizer, chat_template=chat_template, **options)
    # the folder's video processor options, for video frames prepared without it
    # (:func:`hf_kvshare.vision.pil_video_pixels`)
    video = cached_file(
        name_or_path, "video_preprocessor_config.json", _raise_exceptions_for_missing_entries=False, **kwargs
    )
    processor.video_options = json.loads(Path(video).read_text()) if video else None
    return processor


def pil_image_processor(name_or_path: str, processor_options: dict, **kwargs: Any) -> Any:
    """The folder's image processor on its PIL backend (``<ImageProcessorType>Pil``, which transformers
    ships beside the torchvision one), for transformers versions whose ``AutoImageProcessor`` insists
    on torchvision (5.16). The type comes from ``processor_config.json``'s ``image_processor`` entry
    (or ``preprocessor_config.json``); ``ImportError`` when there is no PIL backend for it."""
    import json
    from pathlib import Path

    import transformers
    from transformers.utils import cached_file

    entry = processor_options.get("image_processor") if isinstance(processor_options, dict) else None
    if not isinstance(entry, dict):
        path = cached_file(
            name_or_path, "preprocessor_config.json", _raise_exceptions_for_missing_entries=False, **kwargs
        )
        entry = json.loads(Path(path).read_text()) if path else {}
    name = str(entry.get("image_processor_type", "")).removesuffix("Fast")
    from transformers.image_processing_utils import BaseImageProcessor

    cls = getattr(transformers, f"{name}Pil", None) if name else None
    if isinstance(cls, type) and not issubclass(cls, BaseImageProcessor):
        # transformers 5.16's top-level Idefics3 / SmolVLM PIL names are placeholders that demand
        # torchvision; the class itself, in the module the placeholder names, needs none
        import importlib

        cls = getattr(importlib.import_module(cls.__module__), f"{name}Pil", None)
    if not (isinstance(cls, type) and issubclass(cls, BaseImageProcessor)):
        raise ImportError(
            f"{name_or_path}: image processor {name!r} needs torchvision and has no PIL backend"
        )
    return cls.from_pretrained(name_or_path, **kwargs)

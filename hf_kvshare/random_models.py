"""Real model shapes with random weights: ``load_model("random:NAME")``.

The configs ship as JSON in ``hf_kvshare/configs/`` and carry the numbers of the published model
cards' ``config.json`` (layers, hidden and intermediate sizes, heads, KV heads, head dim, RoPE theta,
type and scaling, vocabulary, sliding windows / layer types, RMS eps, tied embeddings). Weights are
drawn by the model's own initializer (``from_config``) under a fixed seed, so timings and memory
are those of the real architecture; **outputs and fidelity are meaningless** (the bench drops its
fidelity pass and columns for these models).

The tokenizer is built in code (no file, no download, no ``gguf``): byte-level, one token per UTF-8
byte (ids 0..255) plus three special tokens ``<|im_end|>`` (eos), ``<|endoftext|>`` (pad) and ``<|im_start|>`` (256..258), with a
ChatML chat template. Every id it produces is far below each model's vocabulary, so prompts are
valid inputs; ids the random model generates beyond 258 decode to nothing (they still flow to the
next agent as token ids, which is what the workflow passes on). A shared context of ``n`` tokens is
``n`` bytes of text.

Vision-language models (``random:qwen2-vl-7b``, ``random:qwen2.5-vl-7b``, ``random:llava-onevision-0.5b``,
``random:llava-onevision-7b``:
a ``vision_config`` in their JSON) build with ``AutoModelForImageTextToText``; their tokenizer is the
byte tokenizer plus the vision markers (Qwen's four, ids 259..262; LLaVA-OneVision's ``<image>`` /
``<video>``, ids 259, 260; written into the config in place of the card's ids) and
``models.load_processor("random:NAME")`` gives their processor (that tokenizer and the family's PIL
image processor: :func:`vision_processor`); ``num_layers`` cuts the language model only (the vision tower keeps
its depth).

Dtype: bfloat16 on CUDA, float32 on CPU unless given (bfloat16 matmuls are ~3x slower than fp32 on
the CPUs here). Full depth in fp32 is 4 bytes per parameter (an 8B model: 32 GB); on CPU shrink the
depth with ``num_layers`` (the embedding and LM head stay full width: ``random:llama-3.1-8b`` with 2
layers is ~1.5B parameters, ~6 GB in fp32).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

import torch

from ._compat import skipped_weight_init

PREFIX = "random:"
CONFIG_PACKAGE = "hf_kvshare.configs"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def random_model_names() -> list[str]:
    """Names accepted after ``random:`` (one JSON config each)."""
    files = resources.files(CONFIG_PACKAGE).iterdir()
    return sorted(f.name[: -len(".json")] for f in files if f.name.endswith(".json"))


def is_random(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def card_config(name: str) -> dict[str, Any]:
    """The shipped config of ``name`` (without ``random:``) as a dict, exactly as in its JSON file."""
    names = random_model_names()
    if name not in names:
        raise ValueError(
            f"unknown random model {name!r}; expected one of {', '.join(names)} (as random:NAME)"
        )
    return json.loads(resources.files(CONFIG_PACKAGE).joinpath(f"{name}.json").read_text())


def random_config(name: str, num_layers: int | None = None):
    """The transformers config of ``name``, its depth cut to the first ``num_layers`` layers (their
    layer types kept: a Gemma 3 model keeps its 5 sliding : 1 full pattern from layer 0)."""
    from transformers import AutoConfig

    data = {k: v for k, v in card_config(name).items() if not k.startswith("_")}
    model_type = data.pop("model_type")
    if "vision_config" in data:  # a vision-language model: the depth is its language model's
        return _vision_config(name, model_type, data, num_layers)
    config = AutoConfig.for_model(model_type, **data)
    if num_layers is None:
        return config
    total = config.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be an int in [1, {total}] for {name}; got {num_layers!r}")
    data["num_hidden_layers"] = num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        data["layer_types"] = list(layer_types[:num_layers])
    if "max_window_layers" in data:
        data["max_window_layers"] = min(data["max_window_layers"], num_layers)
    return AutoConfig.for_model(model_type, **data)


#: the vision-language models' markers, added to the byte tokenizer (ids 259..262) and written into
#: their configs in place of the cards' ids (which the byte tokenizer cannot produce)
VISION_MARKERS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def _vision_config(name: str, model_type: str, data: dict[str, Any], num_layers: int | None):
    from transformers import AutoConfig

    text = dict(data.pop("text_config"))
    total = text["num_hidden_layers"]
    if num_layers is not None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be an int in [1, {total}] for {name}; got {num_layers!r}")
        text["num_hidden_layers"] = num_layers
    first = len(SPECIAL_TOKENS) + 256
    if model_type == "llava_onevision":  # its markers <image>, <video> (ids 259, 260)
        ids = {"image_token_index": first, "video_token_index": first + 1}
    else:
        names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        ids = dict(zip(names, range(first, first + len(VISION_MARKERS))))
    return AutoConfig.for_model(model_type, text_config=text, **data, **ids)


def is_vision_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


#: LLaVA-OneVision's markers, added to the byte tokenizer (ids 259, 260)
LLAVA_MARKERS = ("<image>", "<video>")


def vision_processor(config):
    """The processor of a ``random:`` vision-language model: the byte tokenizer with the vision
    markers, and the model family's PIL image processor at its patch and merge sizes (no video
    processor: transformers' need torchvision)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    if config.model_type == "llava_onevision":
        return _llava_onevision_processor(config)
    base = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}.get(config.model_type)
    if base is None:
        raise ValueError(f"no random: processor for a {config.model_type} model")

    class ImageOnlyProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS, *VISION_MARKERS]})
    if tok.convert_tokens_to_ids(VISION_MARKERS[0]) != config.image_token_id:
        raise ValueError("the byte tokenizer's image marker is not the config's image token")
    vision = config.vision_config
    images = Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
    )
    return ImageOnlyProcessor(images, tok, chat_template=tok.chat_template)


def parameter_count(config) -> int:
    """Parameters of a model built from ``config`` (counted on the meta device: nothing allocated)."""

    with torch.device("meta"):
        model = _model_class(config).from_config(config)
    return sum(p.numel() for p in model.parameters())


def _llava_onevision_processor(config):
    """LLaVA-OneVision's processor for ``random:llava-onevision-*``: its PIL image processor at the
    vision tower's size with the config's anyres grid and SigLIP's mean / std (0.5, as the card's
    preprocessor config has them), the byte tokenizer with ``<image>`` / ``<video>``, the card's
    processor options (729 tokens per 384-pixel tile, the full feature strategy, anyres_max_9); no
    video processor (frames are prepared in PIL: :func:`hf_kvshare.vision.pil_video_pixels`)."""
    from transformers import LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

    class ImageOnlyLlavaOnevisionProcessor(LlavaOnevisionProcessor):
        def __init__(self, image_processor=None, tokenizer=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, **kwargs)

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS, *LLAVA_MARKERS]})
    if tok.convert_tokens_to_ids(LLAVA_MARKERS[0]) != config.image_token_index:
        raise ValueError("the byte tokenizer's image marker is not the config's image token")
    vision = config.vision_config
    size = int(vision.image_size)
    images = LlavaOnevisionImageProcessorPil(
        size={"height": size, "width": size},
        image_grid_pinpoints=config.image_grid_pinpoints,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return ImageOnlyLlavaOnevisionProcessor(
        images,
        tok,
        num_image_tokens=(size // int(vision.patch_size)) ** 2,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        vision_aspect_ratio=config.vision_aspect_ratio,
        chat_template=tok.chat_template,
    )


def byte_tokenizer():
    """The built-in byte-level tokenizer with a ChatML template (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tok.chat_template = CHATML_TEMPLATE
    return tok


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_random_model(
    name: str,
    *,
    num_layers: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    attn_implementation: str = "sdpa",
):
    """``(model, tokenizer)`` for ``random:NAME``: built directly on ``device`` (default CPU) in
    ``dtype`` (default bf16 on CUDA, fp32 on CPU) with weights drawn under ``seed``
    (:func:`fill_random_weights`); eval mode. ``device="meta"`` builds the shapes only (no memory)."""

    short = name[len(PREFIX) :] if is_random(name) else name
    config = random_config(short, num_layers)
    device = torch.device(device if device is not None else "cpu")
    dtype = dtype or default_dtype(device)
    if device.type == "cpu":  # meta: shapes only, nothing allocated
        _check_fits_in_memory(short, config, dtype, num_layers)
    with skipped_weight_init(), torch.device(device):  # buffers (RoPE frequencies) are still computed
        model = _model_class(config).from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if device.type != "meta":
        std = getattr(config.get_text_config(), "initializer_range", 0.02)
        fill_random_weights(model, std=std, seed=seed)
    model.config.name_or_path = f"{PREFIX}{short}"
    if is_vision_config(config):  # the tokenizer with the vision markers (its processor: load_processor)
        return model.eval(), vision_processor(config).tokenizer
    return model.eval(), byte_tokenizer()


def _model_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


#: length of the seeded normal block tiled into weights on CPU (a prime: rows never repeat exactly)
CPU_BLOCK = 1_048_573


@torch.no_grad()
def fill_random_weights(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Give every ``Linear`` / ``Embedding`` / convolution weight N(0, std) values and their biases zeros,
    ``LayerNorm`` weights ones and biases zeros (a vision tower's; the skipped initializer would have
    set them); other norm weights keep the values their constructors set (ones, or zeros for Gemma's
    ``1 + w``).

    On CUDA each weight is drawn in full (fast there). On CPU drawing billions of normals takes
    minutes, so a seeded block of ``CPU_BLOCK`` normals is tiled through each weight from a
    per-weight offset: as valid for timing (dense kernels do not look at values), built in seconds.
    """
    seen: set[int] = set()
    block: torch.Tensor | None = None
    for index, module in enumerate(model.modules()):
        if isinstance(module, torch.nn.LayerNorm) and module.elementwise_affine:  # vision towers: the
            module.weight.fill_(1.0)  # initializer skipped, so its constructor's ones / zeros never came
            if module.bias is not None:
                module.bias.zero_()
            continue
        if isinstance(module, torch.nn.modules.conv._ConvNd):  # a vision tower's patch embedding
            gen = torch.Generator(device=module.weight.device).manual_seed(seed * 1_000_003 + index)
            module.weight.copy_(
                torch.randn(module.weight.shape, generator=gen, device=module.weight.device) * std
            )
            if module.bias is not None:
                module.bias.zero_()
            continue
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            module.bias.zero_()
        weight = module.weight
        if id(weight) in seen:  # tied embedding / LM head
            continue
        seen.add(id(weight))
        gen = torch.Generator(device=weight.device).manual_seed(seed * 1_000_003 + index)
        if weight.device.type != "cpu":
            weight.normal_(0.0, std, generator=gen)
            continue
        if block is None:
            block = torch.randn(2 * CPU_BLOCK, generator=gen).mul_(std).to(weight.dtype)
        flat = weight.view(-1)
        offset = (index * 7919) % CPU_BLOCK
        for start in range(0, flat.numel(), CPU_BLOCK):
            n = min(CPU_BLOCK, flat.numel() - start)
            flat[start : start + n].copy_(block[offset : offset + n])


def _check_fits_in_memory(name: str, config, dtype: torch.dtype, num_layers: int | None) -> None:
    need = parameter_count(config) * torch.empty((), dtype=dtype).element_size()
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > 0.8 * have:
        raise MemoryError(
            f"random:{name} with {config.num_hidden_layers} layers in {dtype} needs ~{need / 2**30:.1f} GiB of "
            f"weights; this machine has {have / 2**30:.1f} GiB. Shrink the depth (num_layers= / --num-layers; "
            f"given {num_layers}) or build it on a GPU"
        )

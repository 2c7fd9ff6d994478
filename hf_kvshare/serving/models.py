"""The HF model folder vLLM serves: an HF folder given as is, or an embedded model or a ``random:NAME``
model written as one.

The embedded models' converted copy (``$HF_KVSHARE_CACHE/<name>-fp32``) keeps a tied embedding under
``lm_head.weight`` only, which vLLM does not read as the input embedding; :func:`served_model_dir`
writes a complete folder (``model.embed_tokens.weight``, config, generation config, tokenizer and
chat template) once under ``$HF_KVSHARE_CACHE/serve/<name>``. A ``random:NAME`` model
(:mod:`hf_kvshare.random_models`: a shipped config, seeded random weights, the byte tokenizer and its
ChatML template) is written the same way under ``serve/random-<NAME>``: a served shape for timing and
for the tensor-parallel set-ups (``random:small-llama``: 8 heads / 4 KV heads of size 64, which vLLM's
CPU attention serves and 2 or 4 ranks split), its tokens meaningless but deterministic.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..models import EMBEDDED_MODELS, _cache_root
from ..random_models import PREFIX as RANDOM_PREFIX
from ..random_models import is_random, random_model_names

MARKER = "hf_kvshare-serving.json"
#: the folder's format (in the marker): a folder written by an earlier format is written again
#: (format 1 kept a first load's GGUF ``quantization_config`` and named no ``architectures``)
FORMAT = 2


def _current(target: Path) -> bool:
    try:
        return json.loads((target / MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def served_model_dir(name_or_path: str) -> Path:
    """An HF model folder for vLLM: ``name_or_path`` itself when it is a folder with a ``config.json``,
    else an embedded model (``smollm2-135m``, ...) or a ``random:NAME`` model written once as a complete
    folder."""
    path = Path(os.path.expanduser(name_or_path))
    if (path / "config.json").is_file():
        return path
    if is_random(name_or_path):
        if name_or_path[len(RANDOM_PREFIX) :] not in random_model_names():
            raise ValueError(
                f"unknown random model {name_or_path!r}; expected one of "
                f"{', '.join(RANDOM_PREFIX + n for n in random_model_names())}"
            )
    elif name_or_path not in EMBEDDED_MODELS:
        raise ValueError(
            f"{name_or_path!r} is neither an HF model folder (with config.json), an embedded model "
            f"({', '.join(EMBEDDED_MODELS)}) nor a random:NAME model; a Hub id: download it first "
            "(e.g. huggingface-cli download)"
        )
    target = _cache_root() / "serve" / name_or_path.replace(":", "-")
    if _current(target):
        return target
    from safetensors.torch import save_file

    from ..models import load_model, plain_config

    model, tokenizer = load_model(name_or_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain_config(model).save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {
            name: tensor.detach().contiguous().clone()
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight")
        }
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / MARKER).write_text(
            json.dumps({"model": name_or_path, "tensors": len(state), "format": FORMAT})
        )
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target

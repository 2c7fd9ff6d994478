"""Images and video frames as shared segments on a vision-language model.

An image is a PH slot: ``PH("chart", image=PIL.Image.open("chart.png"))`` (or the file's path, or the
model's processor output for it); a video is ``PH("clip", video=[frame, ...])`` (or processor output).
The session's processor (``Session(model, tokenizer, processor=AutoProcessor.from_pretrained(...))``)
turns it into the placeholder tokens it expands one image into and the pixel values; the slot's
token ids are those placeholders, so the span is exact and the same in every agent's prompt.

Where a method computes the segment (dense), the pixel values go through the model's vision tower
once per request (:meth:`Visual.features`, kept with the slot: every agent reading the image shares
that encoding) and the projected features enter the language model as the segment's input
embeddings (``CachePart.embeds`` -> :func:`hf_kvshare.prefill.dense_embeds`: the forward takes
``inputs_embeds``); where a method places K/V, nothing visual runs. The K/V of an image segment are
ordinary K/V: re-positioning, correction and selective recomputation treat them as any segment's.

Supported: LLaVA-OneVision (Qwen2 language model, 1D RoPE; image features are position-free
inputs, so a re-positioned image segment is exact up to fp rounding), Qwen2-VL and Qwen2.5-VL
(multimodal RoPE: three position components ``(t, h, w)`` per token; pixel values as patches with
their ``[1, 3]`` grid). On the latter an image's rope positions come from the model's own
``get_rope_index`` (:class:`Visual.rope`, :mod:`hf_kvshare.mrope`), the text after it continues from
the model's rule, every forward takes ``[4, batch, n]`` position ids (the slots, then the three
components) and ``generate`` is given the prompt's; the cache keeps K/V in the *slot frame*, so
moving a segment is a uniform shift of all three components, i.e. the 1D rotation. Put an image
between Qwen's ``<|vision_start|>`` / ``<|vision_end|>`` markers (text), as its chat template does.
Idefics3 and SmolVLM (a Llama language model, 1D RoPE): the processor splits an image into tiles
plus a global view and expands it into ``<fake_token_around_image>`` / ``<row_i_col_j>`` /
``<global-img>`` marker tokens (text) around each tile's ``<image>`` placeholders; the slot's token
ids are that whole expansion, the markers embedded as text and the tiles' features (pixel-shuffled
by the connector, ``pixel_attention_mask`` marking the padding) scattered over the placeholders, as
the model's own merge does (:meth:`Visual.embeds`). Their videos are refused (SmolVLM's come as
frames through its video processor, which needs torchvision; Idefics3 has none).
Refused: Gemma 3 (its image tokens attend to each other bidirectionally: a dense forward would need
that mask, not the causal one built here).

Everything is checked before any model work (the model's own processor rule for the placeholder
count, the pixel values' dtype and device against the vision tower's, a readable image file, a
video with frames), and nothing in the session changes on error.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import _compat, mrope
from .prefill import model_input_device
from .trajectory import PH
from .turn import Slot, given_text_slot

#: model types whose image / video segments are built and tested here (``config.model_type``)
SUPPORTED_VISION_MODELS = ("llava_onevision", "qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm")

#: the environment variable that sets the most pixels (width x height) an image file may have; unset,
#: Pillow's own ``PIL.Image.MAX_IMAGE_PIXELS`` (its decompression-bomb threshold, 89,478,485) is the limit
MAX_PIXELS_ENV = "HF_KVSHARE_MAX_IMAGE_PIXELS"

#: of those, the models whose pixel values come as patches with a ``[1, 3]`` grid (``image_grid_thw``)
GRID_VISION_MODELS = ("qwen2_vl", "qwen2_5_vl")

#: of those, the models whose processor splits an image into tiles and expands it into marker text
#: tokens around each tile's placeholders (``pixel_values`` ``[1, tiles, 3, size, size]``, a
#: ``pixel_attention_mask``); images only
TILED_VISION_MODELS = ("idefics3", "smolvlm")

#: families refused, and why (``config.model_type``)
UNSUPPORTED_VISION_MODELS = {
    "gemma3": (
        "its image tokens attend to each other bidirectionally (token_type_ids), and the dense forwards "
        "here (position-built causal masks, selective recomputation, reference prefills) do not build that "
        "mask yet"
    ),
}

VISUAL_KINDS = ("image", "video")


def split_processor(tokenizer: Any, processor: Any) -> tuple[Any, Any]:
    """``(tokenizer, processor)`` for a Session: a multimodal processor passed as the tokenizer is
    split into its tokenizer and itself."""
    if processor is None and hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer"):
        return tokenizer.tokenizer, tokenizer
    return tokenizer, processor


def placeholder_ids(model: torch.nn.Module) -> dict[int, str]:
    """The model's image / video placeholder token ids -> ``"image"`` / ``"video"`` (none for a
    text-only model)."""
    config = model.config
    if getattr(config, "vision_config", None) is None:
        return {}
    found = {}
    for kind in VISUAL_KINDS:
        token = getattr(config, f"{kind}_token_id", None)
        if token is None:
            token = getattr(config, f"{kind}_token_index", None)
        if isinstance(token, int):
            found[token] = kind
    return found


def check_text_ids(model: torch.nn.Module, ids: torch.Tensor, what: str) -> None:
    """Text whose tokens hold the model's image / video placeholders is refused: an image enters as
    ``PH(slot, image=...)``, whose placeholders the processor expands (and whose features exist)."""
    marks = placeholder_ids(model)
    if not marks or ids.numel() == 0:
        return
    for token, kind in marks.items():
        count = int((ids == token).sum())
        if count:
            raise ValueError(
                f"{what} holds {count} {kind} placeholder token(s) (id {token}) in its text; an {kind} "
                f"enters as PH(slot, {kind}=...), whose placeholders the model's processor expands"
            )


def check_vision_model(model: torch.nn.Module, kind: str, slot: str) -> None:
    """``model`` must be a supported vision-language model for an image / video segment."""
    config = model.config
    model_type = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "vision_config", None) is None or _compat.vision_tower(model) is None:
        raise ValueError(
            f"PH {slot!r} is an {kind}, but {type(model).__name__} ({model_type}) is a text-only model "
            f"(no vision tower); {kind} segments need a vision-language model "
            f"({', '.join(SUPPORTED_VISION_MODELS)})"
        )
    if model_type not in SUPPORTED_VISION_MODELS:
        why = UNSUPPORTED_VISION_MODELS.get(model_type)
        raise ValueError(
            f"PH {slot!r}: {kind} segments are supported on {', '.join(SUPPORTED_VISION_MODELS)}; "
            f"got a {model_type} model ({type(model).__name__})" + (f": {why}" if why else "")
        )
    if kind == "video" and model_type in TILED_VISION_MODELS:
        raise ValueError(
            f"PH {slot!r}: video segments are not supported on {model_type} (SmolVLM's videos come as "
            "frames through its video processor, which needs torchvision, and a timestamped layout not "
            "built here; Idefics3 has no video input); pass the frames as images, one PH(slot, image=...) each"
        )
    if kind not in placeholder_ids(model).values():
        raise ValueError(f"PH {slot!r}: the {model_type} model has no {kind} placeholder token")


@dataclass(eq=False)
class Visual:
    """One image or video of a request, as the model's processor prepared it: its placeholder token
    ids ``[n]``, the pixel values (on the vision tower's device and dtype) and, for an image, its
    size; :meth:`features` runs the vision tower once and keeps the projected features."""

    kind: str
    token_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_sizes: torch.Tensor | None = None
    #: Qwen2-VL / Qwen2.5-VL: the ``[1, 3]`` (t, h, w) patch grid (``image_grid_thw`` / ``video_grid_thw``)
    grid_thw: torch.Tensor | None = None
    #: multimodal RoPE: the image's rope positions by the model's rule (:class:`mrope.VisualRope`)
    rope: mrope.VisualRope | None = None
    #: Idefics3 / SmolVLM: the placeholder token id; the segment's other ids are the processor's
    #: marker text tokens (``None``: every id is a placeholder)
    placeholder: int | None = None
    #: Idefics3 / SmolVLM: the tiles' pixel mask ``[1, tiles, size, size]`` (the processor's padding)
    pixel_attention_mask: torch.Tensor | None = None
    #: vision-tower runs this object made (one, once the features exist)
    encodes: int = 0
    _features: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.token_ids.numel()

    @property
    def feature_count(self) -> int:
        """How many features the vision tower must give: one per placeholder token."""
        if self.placeholder is None:
            return self.length
        return int((self.token_ids == self.placeholder).sum())

    @property
    def nbytes(self) -> int:
        held = [self.pixel_values, self._features, self.pixel_attention_mask]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def features(self, model: torch.nn.Module) -> torch.Tensor:
        """The projected features ``[n, hidden]`` (the vision tower runs on the first call only)."""
        if self._features is None:
            with torch.no_grad():
                features = _compat.visual_features(
                    model,
                    self.kind,
                    self.pixel_values,
                    self.image_sizes,
                    self.grid_thw,
                    self.pixel_attention_mask,
                )
            self.encodes += 1
            if features.dim() != 2 or features.shape[0] != self.feature_count:
                raise ValueError(
                    f"the model's vision tower gives {tuple(features.shape)} {self.kind} features for "
                    f"{self.feature_count} placeholder tokens (the processor's count): the processor does "
                    "not match the model (image size, patch size or feature strategy)"
                )
            self._features = features.detach()
        return self._features

    def embeds(self, model: torch.nn.Module, batch: int = 1) -> torch.Tensor:
        """The segment's input embeddings ``[batch, n, hidden]`` on the input embeddings' device and
        dtype (the model's own cast of its features). Idefics3 / SmolVLM: the marker tokens' input
        embeddings with the features scattered over the placeholders, in order (the model's merge)."""
        embedding = model.get_input_embeddings()
        device = model_input_device(model)
        features = self.features(model).to(device, embedding.weight.dtype)
        if self.placeholder is not None:
            ids = self.token_ids.to(device)
            with torch.no_grad():
                rows = embedding(ids)
            features = rows.masked_scatter((ids == self.placeholder)[:, None], features)
        return features[None].expand(batch, -1, -1)

    def same_content(self, other: Visual) -> bool:
        return (
            self.kind == other.kind
            and torch.equal(self.token_ids, other.token_ids)
            and self.pixel_values.shape == other.pixel_values.shape
            and torch.equal(self.pixel_values.cpu(), other.pixel_values.cpu())
            and (self.grid_thw is None) == (other.grid_thw is None)
            and (self.grid_thw is None or torch.equal(self.grid_thw, other.grid_thw))
            and _same_optional(self.pixel_attention_mask, other.pixel_attention_mask)
        )


def _same_optional(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


# ----------------------------------------------------------------------------- preparing
def prepare_visual(model: torch.nn.Module, processor: Any, spec: PH) -> Visual:
    """Check and process ``spec``'s image or video (no model work)."""
    kind, value = spec.visual
    check_vision_model(model, kind, spec.slot)
    if processor is None:
        raise ValueError(
            f"PH {spec.slot!r} is an {kind}: the session needs the model's processor "
            "(Session(model, tokenizer, processor=AutoProcessor.from_pretrained(...)))"
        )
    token = _processor_token(model, processor, kind, spec.slot)
    tower = next(_compat.vision_tower(model).parameters())
    tiled = model.config.model_type in TILED_VISION_MODELS
    if tiled:
        _check_tile_length(model, processor, spec.slot)
    if isinstance(value, Mapping):
        return _with_rope(
            model, _from_processed(model, processor, spec.slot, kind, value, token, tower), value
        )
    if kind == "image":
        batch = _processor_call(processor, spec.slot, kind, images=[_load_image(value, spec.slot)])
        if tiled:
            return _tiled_visual(model, processor, spec.slot, batch, token, tower)
        pixels, sizes = batch["pixel_values"], batch.get("image_sizes")
    else:
        frames = _frames(value, spec.slot)
        if getattr(processor, "video_processor", None) is None:
            if model.config.model_type in GRID_VISION_MODELS:
                raise ValueError(
                    f"PH {spec.slot!r}: the processor {type(processor).__name__} has no video processor "
                    "(transformers' video processors need torchvision); pass the processed video instead: "
                    "PH(slot, video={'pixel_values_videos': ..., 'video_grid_thw': ...})"
                )
            pixels = pil_video_pixels(processor, frames, spec.slot)[None].to(tower.device, tower.dtype)
            given = {"pixel_values_videos": pixels}
            return _with_rope(
                model, _from_processed(model, processor, spec.slot, kind, given, token, tower), given
            )
        batch = _processor_call(processor, spec.slot, kind, videos=[frames])
        pixels, sizes = batch["pixel_values_videos"], None
    ids = torch.as_tensor(batch["input_ids"]).flatten()
    if ids.numel() == 0 or not bool((ids == token).all()):
        raise ValueError(
            f"PH {spec.slot!r}: the processor expanded the {kind} into {ids.tolist()[:8]}...; expected "
            f"only its placeholder token {token}"
        )
    _check_pixel_size(model, spec.slot, pixels)
    grid = batch.get(f"{kind}_grid_thw")
    grid = None if grid is None else torch.as_tensor(grid).reshape(1, 3).long()
    visual = Visual(kind, ids.long(), pixels.to(tower.device, tower.dtype), sizes, grid)
    return _with_rope(model, visual, batch)


def _with_rope(model: torch.nn.Module, visual: Visual, inputs: Mapping[str, Any]) -> Visual:
    """On a multimodal-RoPE model: the visual's rope positions (the model's ``get_rope_index``)."""
    visual.rope = mrope.visual_layout(model, visual.kind, visual.token_ids, visual.grid_thw, inputs)
    return visual


def model_tile_length(model: torch.nn.Module) -> int:
    """Idefics3 / SmolVLM: the placeholders per tile, the model's rule (its vision tower's patches,
    pixel-shuffled by ``scale_factor`` in each direction)."""
    vision = model.config.vision_config
    return int((vision.image_size // vision.patch_size) ** 2 / model.config.scale_factor**2)


def _check_tile_length(model: torch.nn.Module, processor: Any, slot: str) -> None:
    expected = model_tile_length(model)
    got = getattr(processor, "image_seq_len", None)
    if got != expected:
        raise ValueError(
            f"PH {slot!r}: the processor expands each image tile into {got!r} placeholders "
            f"(image_seq_len); the model's tiles give {expected} features ((image_size / patch_size)^2 / "
            "scale_factor^2): the processor is not this model's"
        )


def _tiled_visual(
    model: torch.nn.Module, processor: Any, slot: str, batch: Mapping[str, Any], token: int, tower
) -> Visual:
    """Idefics3 / SmolVLM: the processor's expansion (markers and placeholders), the tiles and their mask."""
    ids = torch.as_tensor(batch["input_ids"]).flatten().long()
    pixels = batch["pixel_values"]
    count = int((ids == token).sum())
    if count == 0 or count != pixels.shape[1] * processor.image_seq_len:
        raise ValueError(
            f"PH {slot!r}: the processor expanded the image into {count} placeholders for "
            f"{pixels.shape[1]} tiles of {processor.image_seq_len}; expected one image"
        )
    _check_pixel_size(model, slot, pixels)
    mask = batch.get("pixel_attention_mask")
    mask = None if mask is None else torch.as_tensor(mask).to(tower.device)
    return Visual(
        "image", ids, pixels.to(tower.device, tower.dtype), None, placeholder=token, pixel_attention_mask=mask
    )


def _check_patch_count(
    model: torch.nn.Module, slot: str, pixels: torch.Tensor, size: tuple[int, int]
) -> None:
    """LLaVA-OneVision: an image of ``size`` takes as many patches as its grid pinpoints give (the
    model reads the first that many); fewer is refused."""
    pinpoints = getattr(model.config, "image_grid_pinpoints", None)
    tile = getattr(model.config.vision_config, "image_size", None)
    if not pinpoints or not isinstance(tile, int):
        return
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    needed = image_size_to_num_patches(size, pinpoints, tile)
    if pixels.shape[1] < needed:
        raise ValueError(
            f"PH {slot!r}: an image of image_sizes {list(size)} takes {needed} patches (the base view and its "
            f"grid of {tile}x{tile} tiles); pixel_values has {pixels.shape[1]} (shape {tuple(pixels.shape)})"
        )


def _check_pixel_size(model: torch.nn.Module, slot: str, pixels: torch.Tensor) -> None:
    size = getattr(model.config.vision_config, "image_size", None)
    if isinstance(size, int) and tuple(pixels.shape[-2:]) != (size, size):
        raise ValueError(
            f"PH {slot!r}: pixel values of {tuple(pixels.shape[-2:])} pixels; the vision tower takes "
            f"{size}x{size} (vision_config.image_size): the processor is not this model's"
        )


def _processor_token(model: torch.nn.Module, processor: Any, kind: str, slot: str) -> int:
    token = getattr(processor, f"{kind}_token_id", None)
    expected = next(t for t, k in placeholder_ids(model).items() if k == kind)
    if token != expected:
        raise ValueError(
            f"PH {slot!r}: the processor's {kind} token id is {token!r}, the model's {expected}: "
            "the processor is not this model's"
        )
    return token


def _processor_call(processor: Any, slot: str, kind: str, **inputs: Any) -> Mapping[str, Any]:
    text = getattr(processor, f"{kind}_token")
    try:
        return processor(text=text, return_tensors="pt", add_special_tokens=False, **inputs)
    except (ValueError, TypeError, OSError) as error:
        raise ValueError(f"PH {slot!r}: the processor could not read the {kind}: {error}") from error


def max_image_pixels() -> int | None:
    """The most pixels (width x height) an image file may have: ``HF_KVSHARE_MAX_IMAGE_PIXELS`` where
    set, else Pillow's ``PIL.Image.MAX_IMAGE_PIXELS`` (``None``: no limit)."""
    from PIL import Image

    given = os.environ.get(MAX_PIXELS_ENV)
    if given is None or not given.strip():
        return Image.MAX_IMAGE_PIXELS
    try:
        limit = int(given)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise ValueError(f"{MAX_PIXELS_ENV} must be a positive number of pixels; got {given!r}")
    return limit


def open_image(path: str | os.PathLike) -> Any:
    """The image in file ``path``, decoded (a ``PIL.Image``); its size, read from the file's header, is
    checked against :func:`max_image_pixels` before anything is decoded (a decompression bomb is an
    :class:`ImageTooLarge` naming the file, its size and the limit; an unreadable file a ``ValueError``).
    The one place images are opened (the Python API's paths and the bench's task files)."""
    from PIL import Image, UnidentifiedImageError

    path, limit = Path(path), max_image_pixels()
    raise_it = f"set {MAX_PIXELS_ENV} (or PIL.Image.MAX_IMAGE_PIXELS) to a larger number of pixels to read it"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the limit is checked here
            with Image.open(path) as image:
                width, height = image.size
                if limit is not None and width * height > limit:
                    raise ImageTooLarge(
                        f"image file {str(path)!r} is {width}x{height} = {width * height:,} pixels, "
                        f"over the limit of {limit:,} pixels (refused before decoding); {raise_it}"
                    )
                image.load()
                return image.copy()
    except Image.DecompressionBombError as error:  # over twice Pillow's limit: refused by Image.open
        found = re.search(r"\((\d+) pixels\)", str(error))
        size = f"{int(found.group(1)):,} pixels" if found else f"over {2 * Image.MAX_IMAGE_PIXELS:,} pixels"
        beyond = limit is None or limit >= 2 * Image.MAX_IMAGE_PIXELS
        raise ImageTooLarge(
            f"image file {str(path)!r} is {size}, over the limit of "
            f"{2 * Image.MAX_IMAGE_PIXELS if beyond else limit:,} pixels (refused before decoding); "
            + (
                "Pillow refuses twice PIL.Image.MAX_IMAGE_PIXELS: raise that to read it"
                if beyond
                else raise_it
            )
        ) from error
    except ImageTooLarge:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ValueError(
            f"could not read image file {str(path)!r} ({type(error).__name__}: {error})"
        ) from error


class ImageTooLarge(ValueError):
    """An image file over the pixel limit (:func:`max_image_pixels`): refused before it is decoded."""


def _load_image(value: Any, slot: str) -> Any:
    from PIL import Image

    if isinstance(value, Image.Image):
        limit = max_image_pixels()
        if limit is not None and value.width * value.height > limit:
            raise ImageTooLarge(
                f"PH {slot!r}: the image is {value.width}x{value.height} = {value.width * value.height:,} "
                f"pixels, over the limit of {limit:,} pixels; set {MAX_PIXELS_ENV} to a larger number to use it"
            )
        return value
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"PH {slot!r}: no image file at {str(path)!r}")
        try:
            return open_image(path)
        except ValueError as error:
            raise type(error)(f"PH {slot!r}: {error}") from error
    raise TypeError(
        f"PH {slot!r}: image must be a PIL.Image, an image file's path or the processor's output "
        f"(a mapping with pixel_values and image_sizes); got {type(value).__name__}"
    )


def _frames(value: Any, slot: str) -> list[Any]:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(
            f"PH {slot!r}: video must be a list of frames (PIL images or arrays) or the processor's "
            f"output (a mapping with pixel_values_videos); got {type(value).__name__}"
        )
    if len(value) == 0:
        raise ValueError(f"PH {slot!r}: a video needs at least one frame; got 0")
    return [_load_image(f, slot) if isinstance(f, (str, os.PathLike)) else f for f in value]


def pil_video_pixels(processor: Any, frames: Sequence[Any], slot: str = "video") -> torch.Tensor:
    """``[frames, 3, height, width]`` pixel values of a video's frames without transformers' video
    processor (it needs torchvision): each frame as LLaVA-OneVision's video processor prepares it
    (RGB, resized to its square size, rescaled, normalized), in PIL and numpy. The options are the
    folder's video processor's (``processor.video_options``: its ``video_preprocessor_config.json``,
    which :func:`hf_kvshare.models.load_processor` keeps) where given, else the image processor's
    (``size``, ``resample``, ``rescale_factor``, ``image_mean``, ``image_std``). PIL's resampling is
    not torchvision's: the values are close to, not bit-equal with, the torchvision processor's."""
    import numpy as np
    from PIL import Image

    images = getattr(processor, "image_processor", None)
    options = dict(getattr(processor, "video_options", None) or {})

    def option(name: str, default: Any = None) -> Any:
        value = options.get(name)
        return value if value is not None else getattr(images, name, default)

    size = option("size") or {}
    height, width = (
        size.get("height", size.get("shortest_edge")),
        size.get("width", size.get("shortest_edge")),
    )
    if not isinstance(height, int) or not isinstance(width, int):
        raise ValueError(
            f"PH {slot!r}: the processor's video size must give height and width (or shortest_edge); got {size}"
        )
    resample = option("resample", Image.Resampling.BICUBIC)
    scale = float(option("rescale_factor", 1 / 255))
    mean = np.asarray(option("image_mean", (0.5, 0.5, 0.5)), dtype=np.float32).reshape(3, 1, 1)
    std = np.asarray(option("image_std", (0.5, 0.5, 0.5)), dtype=np.float32).reshape(3, 1, 1)
    out = []
    for i, frame in enumerate(frames):
        if not isinstance(frame, Image.Image):
            try:
                frame = Image.fromarray(np.asarray(frame, dtype=np.uint8))
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"PH {slot!r}: frame {i} is not an image (a PIL image or an [height, width, 3] "
                    f"uint8 array); got {type(frame).__name__}: {error}"
                ) from error
        frame = frame.convert("RGB").resize((width, height), resample=Image.Resampling(int(resample)))
        array = np.asarray(frame, dtype=np.float32).transpose(2, 0, 1) * scale
        out.append(torch.from_numpy((array - mean) / std))
    return torch.stack(out)


def _from_processed(
    model: torch.nn.Module, processor: Any, slot: str, kind: str, given: Mapping[str, Any], token: int, tower
) -> Visual:
    """Processor output given as the image / video: checked, used as it is (no conversion)."""
    key = "pixel_values" if kind == "image" else "pixel_values_videos"
    pixels = given.get(key)
    if not isinstance(pixels, torch.Tensor):
        raise ValueError(
            f"PH {slot!r}: processed {kind} input needs {key!r} (a tensor); got keys {sorted(given)}"
        )
    if pixels.is_floating_point() and pixels.device.type != "meta" and not bool(torch.isfinite(pixels).all()):
        bad = int((~torch.isfinite(pixels)).sum())
        raise ValueError(
            f"PH {slot!r}: {key} must be finite; {bad} of {pixels.numel()} values are NaN or infinite"
        )
    if model.config.model_type in GRID_VISION_MODELS:
        return _from_processed_grid(model, processor, slot, kind, given, token, tower, key, pixels)
    if model.config.model_type in TILED_VISION_MODELS:
        return _from_processed_tiles(model, processor, slot, given, token, tower, pixels)
    if pixels.dim() == 4:
        pixels = pixels[None]
    if pixels.dim() != 5 or pixels.shape[0] != 1:
        raise ValueError(
            f"PH {slot!r}: {key} must be one {kind}, [1, {'patches' if kind == 'image' else 'frames'}, "
            f"channels, height, width]; got shape {tuple(pixels.shape)}"
        )
    if pixels.shape[1] == 0:
        what = "a video needs at least one frame" if kind == "video" else "an image needs at least one patch"
        raise ValueError(f"PH {slot!r}: {what}; got {key} of shape {tuple(pixels.shape)}")
    _check_pixel_size(model, slot, pixels)
    if pixels.dtype != tower.dtype or pixels.device != tower.device:
        raise ValueError(
            f"PH {slot!r}: {key} must be {tower.dtype} on {tower.device} (the vision tower's); got "
            f"{pixels.dtype} on {pixels.device}"
        )
    sizes = None
    if kind == "image":
        sizes = given.get("image_sizes")
        sizes = None if sizes is None else torch.as_tensor(sizes).reshape(-1)
        if sizes is None or sizes.numel() != 2 or sizes.is_floating_point() or sizes.is_complex():
            raise ValueError(
                f"PH {slot!r}: processed image input needs image_sizes (height, width) of one image, integers"
            )
        size = (int(sizes[0]), int(sizes[1]))
        limit = max_image_pixels()
        if min(size) <= 0 or (limit is not None and size[0] * size[1] > limit):
            raise ValueError(
                f"PH {slot!r}: image_sizes {list(size)} must be a positive height and width of at most "
                f"{limit} pixels in all ({MAX_PIXELS_ENV})"
            )
        sizes = sizes.reshape(1, 2)
        _check_patch_count(model, slot, pixels, size)
    else:
        size = (int(pixels.shape[1]), int(pixels.shape[-2]), int(pixels.shape[-1]))
    expected = _compat.processor_placeholders(processor, kind, size)
    ids = _placeholder_ids(given, token, expected, slot, kind, f"size {size}")
    return Visual(kind, ids, pixels, sizes)


def _from_processed_grid(
    model: torch.nn.Module,
    processor: Any,
    slot: str,
    kind: str,
    given: Mapping[str, Any],
    token: int,
    tower,
    key: str,
    pixels: torch.Tensor,
) -> Visual:
    """Qwen2-VL-style processed input: patches ``[patches, channels * t * p * p]`` and a ``[1, 3]`` grid."""
    grid_key = f"{kind}_grid_thw"
    grid = given.get(grid_key)
    grid = None if grid is None else torch.as_tensor(grid).long()
    if grid is None or grid.numel() != 3:
        raise ValueError(
            f"PH {slot!r}: processed {kind} input needs {grid_key!r}, the (t, h, w) grid of one {kind}"
        )
    grid = grid.reshape(1, 3)
    if pixels.dim() != 2 or pixels.shape[0] != int(grid.prod()):
        raise ValueError(
            f"PH {slot!r}: {key} must be [{int(grid.prod())} patches (the grid {grid[0].tolist()}), features]; "
            f"got shape {tuple(pixels.shape)}"
        )
    if int(grid.min()) <= 0:
        what = "a video needs at least one frame" if kind == "video" else "an image needs at least one patch"
        raise ValueError(f"PH {slot!r}: {what}; got {grid_key} {grid[0].tolist()}")
    vision = model.config.vision_config
    channels = getattr(vision, "in_channels", getattr(vision, "in_chans", None))
    sides = (channels, getattr(vision, "temporal_patch_size", None), getattr(vision, "patch_size", None))
    if all(isinstance(n, int) for n in sides):
        features = sides[0] * sides[1] * sides[2] ** 2
        if pixels.shape[1] != features:
            raise ValueError(
                f"PH {slot!r}: {key} must have {features} features per patch (channels x temporal_patch_size "
                f"x patch_size^2 of the vision tower); got shape {tuple(pixels.shape)}"
            )
    if pixels.dtype != tower.dtype or pixels.device != tower.device:
        raise ValueError(
            f"PH {slot!r}: {key} must be {tower.dtype} on {tower.device} (the vision tower's); got "
            f"{pixels.dtype} on {pixels.device}"
        )
    expected = _compat.grid_placeholders(model, processor, kind, grid)
    ids = _placeholder_ids(given, token, expected, slot, kind, f"grid {grid[0].tolist()}")
    return Visual(kind, ids, pixels, None, grid)


def _from_processed_tiles(
    model: torch.nn.Module,
    processor: Any,
    slot: str,
    given: Mapping[str, Any],
    token: int,
    tower,
    pixels: torch.Tensor,
) -> Visual:
    """Idefics3 / SmolVLM processed input: tiles ``[1, tiles, 3, size, size]``, their
    ``pixel_attention_mask`` (optional: all pixels then) and the ``input_ids`` the processor expanded
    the image into (required: the tiles' row / column layout is in them), checked against the
    processor's rule for every ``rows x cols`` layout of that many tiles."""
    if pixels.dim() == 4:
        pixels = pixels[None]
    if pixels.dim() != 5 or pixels.shape[0] != 1:
        raise ValueError(
            f"PH {slot!r}: pixel_values must be one image's tiles, [1, tiles, channels, height, width]; "
            f"got shape {tuple(pixels.shape)}"
        )
    tiles = int(pixels.shape[1])
    if tiles == 0:
        raise ValueError(
            f"PH {slot!r}: an image needs at least one tile; got pixel_values of shape {tuple(pixels.shape)}"
        )
    _check_pixel_size(model, slot, pixels)
    if pixels.dtype != tower.dtype or pixels.device != tower.device:
        raise ValueError(
            f"PH {slot!r}: pixel_values must be {tower.dtype} on {tower.device} (the vision tower's); got "
            f"{pixels.dtype} on {pixels.device}"
        )
    mask = given.get("pixel_attention_mask")
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.dim() == 3:
            mask = mask[None]
        if tuple(mask.shape) != (1, tiles, *pixels.shape[-2:]):
            raise ValueError(
                f"PH {slot!r}: pixel_attention_mask must be [1, {tiles}, {pixels.shape[-2]}, "
                f"{pixels.shape[-1]}] (one per tile pixel); got shape {tuple(mask.shape)}"
            )
        if mask.dtype.is_floating_point or mask.device != tower.device:
            raise ValueError(
                f"PH {slot!r}: pixel_attention_mask must be a bool / integer mask on {tower.device}; got "
                f"{mask.dtype} on {mask.device}"
            )
    if given.get("input_ids") is None:
        raise ValueError(
            f"PH {slot!r}: processed {model.config.model_type} image input needs the 'input_ids' the "
            "processor expanded it into (the tiles' row / column markers and placeholders)"
        )
    ids = torch.as_tensor(given["input_ids"]).flatten().long()
    layouts = (
        [(0, 0)] if tiles == 1 else [(r, (tiles - 1) // r) for r in range(1, tiles) if (tiles - 1) % r == 0]
    )
    expanded = {layout: _compat.tiled_image_ids(processor, *layout) for layout in layouts}
    if not any(ids.tolist() == want for want in expanded.values()):
        count, expected = int((ids == token).sum()), tiles * processor.image_seq_len
        if count != expected:
            raise ValueError(
                f"PH {slot!r}: {count} image placeholder tokens given; the processor expands this image "
                f"({tiles} tiles) into {expected}"
            )
        shown = ", ".join(f"{r}x{c}" if r else "the global view alone" for r, c in layouts)
        raise ValueError(
            f"PH {slot!r}: the image's input_ids are not the processor's expansion of {tiles} tiles "
            f"(as {shown} tiles and a global view): markers or placeholders out of place"
        )
    return Visual("image", ids, pixels, None, placeholder=token, pixel_attention_mask=mask)


def visual_slot(model: torch.nn.Module, processor: Any, spec: PH, slots: Mapping[str, Slot]) -> Slot:
    """The new slot of an image / video PH (given content of ``spec.kind``, by default an
    observation); checked, no model work."""
    visual = prepare_visual(model, processor, spec)
    slot = given_text_slot(replace(spec, kind=spec.kind or "observation"), visual.token_ids, slots)
    slot.text = ""
    slot.visual = visual
    return slot


def check_same_content(model: torch.nn.Module, processor: Any, spec: PH, slot: Slot) -> None:
    """A PH naming a slot already held: an image / video given again must be the slot's."""
    if spec.visual is None and slot.visual is None:
        return
    if spec.visual is None:
        if spec.text is not None:
            raise ValueError(f"PH slot {spec.slot!r} holds an {slot.visual.kind} in this session; got text")
        return
    if slot.visual is None:
        raise ValueError(f"PH slot {spec.slot!r} holds text in this session; got an {spec.visual[0]}")
    if not prepare_visual(model, processor, spec).same_content(slot.visual):
        raise ValueError(
            f"PH slot {spec.slot!r} already holds another {slot.visual.kind} in this session; a slot's "
            "content is fixed within a session (a new request is a new Session)"
        )


def check_spans(spans: Sequence[Any], method: Any) -> None:
    """A method that cannot compute image / video segments (``Method.visual_segments``) is refused
    one; the prompt's last token is ``generate``'s input id: an image / video cannot end the prompt."""
    visual = next((s for s in spans if s.visual is not None), None)
    if visual is not None and not getattr(method, "visual_segments", True):
        raise ValueError(
            f"method {method.name!r} cannot compute {visual.visual.kind} segments (PH {visual.name!r}): "
            "it prefills token ids only"
        )
    if spans and spans[-1].visual is not None:
        raise ValueError(
            f"the prompt ends with the {spans[-1].visual.kind} segment {spans[-1].name!r}; end it with text "
            "(the last prompt token is generate's input id), e.g. PF('\\nAnswer:')"
        )


def _placeholder_ids(
    given: Mapping, token: int, expected: int, slot: str, kind: str, shape: str
) -> torch.Tensor:
    """The segment's placeholder ids (``given["input_ids"]``, or ``expected`` placeholders): only the
    ``token`` placeholder, as many as the processor expands this image / video into (``shape`` names it)."""
    ids = given.get("input_ids")
    if ids is None:
        ids = torch.full((expected,), token, dtype=torch.long)
    ids = torch.as_tensor(ids).flatten().long()
    count = int((ids == token).sum())
    if count != ids.numel():
        raise ValueError(
            f"PH {slot!r}: the {kind}'s input_ids must be its placeholder tokens (id {token}) only; "
            f"{ids.numel() - count} of {ids.numel()} are other tokens"
        )
    if count != expected:
        raise ValueError(
            f"PH {slot!r}: {count} {kind} placeholder tokens given; the processor expands this {kind} "
            f"({shape}) into {expected}"
        )
    return ids

"""``random:llava-onevision-0.5b``: the shape of llava-hf/llava-onevision-qwen2-0.5b-ov-hf (Qwen2-0.5B
language model, SigLIP so400m/14 at 384 without its head), 0.89B parameters as its card says (counted
on the meta device), the depth cut on the language model only, and a processor (PIL, offline) whose
markers are the config's token ids and whose image / video placeholder counts are the family's rule."""

from __future__ import annotations

import pytest
from tiny import random_image

from hf_kvshare import load_model
from hf_kvshare.bench import make_workload
from hf_kvshare.models import load_processor
from hf_kvshare.random_models import parameter_count, random_config
from hf_kvshare.vision import pil_video_pixels

NAME = "random:llava-onevision-0.5b"


def test_the_config_is_the_cards_shape():
    config = random_config("llava-onevision-0.5b")
    text, vision = config.text_config, config.vision_config
    assert config.model_type == "llava_onevision" and text.model_type == "qwen2"
    assert (text.num_hidden_layers, text.hidden_size, text.intermediate_size) == (24, 896, 4864)
    assert (text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (14, 2, 152000)
    assert text.tie_word_embeddings and text.rope_parameters["rope_theta"] == 1e6
    assert vision.model_type == "siglip_vision_model" and not vision.vision_use_head
    assert (vision.num_hidden_layers, vision.hidden_size, vision.image_size, vision.patch_size) == (
        26,
        1152,
        384,
        14,
    )
    assert config.vision_feature_select_strategy == "full" and config.vision_aspect_ratio == "anyres_max_9"
    assert len(config.image_grid_pinpoints) == 36
    assert parameter_count(config) / 1e9 == pytest.approx(0.89, abs=0.01)  # the card: 0.89B
    with pytest.raises(ValueError, match=r"num_layers must be an int in \[1, 24\]"):
        random_config("llava-onevision-0.5b", 25)


def test_it_builds_cut_on_the_language_model_only():
    model, tokenizer = load_model(NAME, num_layers=1, device_map="meta")
    assert type(model).__name__ == "LlavaOnevisionForConditionalGeneration"
    assert len(model.model.language_model.layers) == 1
    assert len(model.model.vision_tower.encoder.layers) == 26
    assert tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_index
    assert tokenizer.convert_tokens_to_ids("<video>") == model.config.video_token_index


def test_its_processor_expands_images_and_videos_by_the_familys_rule():
    processor = load_processor(NAME)
    config = random_config("llava-onevision-0.5b")
    assert processor.image_token_id == config.image_token_index
    assert processor.video_token_id == config.video_token_index
    batch = processor(images=random_image(0, 384, 384), text="<image>", return_tensors="pt")
    # a 384-pixel square: the base tile (27 x 27) and one grid tile with a newline per row
    assert batch["input_ids"].numel() == 729 + 27 * 28
    assert tuple(batch["pixel_values"].shape) == (1, 2, 3, 384, 384)
    chart = make_workload("mathvista", limit=1).tasks(None)[0].slots[0].image
    counted = processor._get_num_multimodal_tokens(image_sizes=[[chart.height, chart.width]])
    expanded = processor(images=chart, text="<image>", return_tensors="pt")["input_ids"].numel()
    assert expanded == counted["num_image_tokens"][0]
    frames = make_workload("videomme", limit=1, frames=4, frame_size=96).tasks(None)[0].slots[0].video
    assert tuple(pil_video_pixels(processor, frames).shape) == (4, 3, 384, 384)
    videos = getattr(
        processor._get_num_multimodal_tokens(video_sizes=[[4, 384, 384]]), "num_video_tokens", None
    )
    if videos is not None:  # transformers 5.16's processors do not count video tokens
        assert videos == [4 * 14 * 14 + 1]  # 27 x 27 pooled to 14 x 14 a frame, and a newline


def test_the_seeds_7b_shape_for_gpu_timing():
    """``random:llava-onevision-7b``: llava-hf/llava-onevision-qwen2-7b-ov-hf's shape (the model KVCMAS
    ran), 8.03B parameters as its card says, the same tower and processor rule as the 0.5B."""
    config = random_config("llava-onevision-7b")
    text, vision = config.text_config, config.vision_config
    assert (text.num_hidden_layers, text.hidden_size, text.intermediate_size) == (28, 3584, 18944)
    assert (text.num_attention_heads, text.num_key_value_heads) == (28, 4) and not text.tie_word_embeddings
    small = random_config("llava-onevision-0.5b").vision_config
    assert vision.to_dict() == small.to_dict()
    assert parameter_count(config) / 1e9 == pytest.approx(8.03, abs=0.01)  # the card: 8.03B
    model, tokenizer = load_model("random:llava-onevision-7b", num_layers=1, device_map="meta")
    assert len(model.model.language_model.layers) == 1
    assert tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_index
    assert load_processor("random:llava-onevision-7b").image_token_id == config.image_token_index

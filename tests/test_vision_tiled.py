"""Images as shared segments on Idefics3 and SmolVLM (hf_kvshare.vision, the tiled families).

Tiny random models built offline (``tests/tiny.py``: ``tiny_idefics3``, ``tiny_idefics3_processor``).
The processor splits an image into tiles plus a global view and expands it into marker tokens
(``<fake_token_around_image>``, ``<row_i_col_j>``, ``<global-img>``, newlines) around each tile's
``<image>`` placeholders; the segment is that whole expansion, the markers embedded as text, the
tiles' features scattered over the placeholders. NonShared through the shared cache equals plain
``generate`` with the same pixel values token for token; FullShared exact where the image lands at
the same positions; re-positioned image K/V equal to recomputation at the new positions; the vision
tower once per image per request; every prompt method runs; bad input refused before model work.
"""

from __future__ import annotations

import pytest
import torch
from tiny import random_image, save_tiny_idefics3, tiny_idefics3, tiny_idefics3_processor, tiny_model
from transformers import DynamicCache
from vision_helpers import (
    QUESTION,
    Calls,
    assert_full_recomputation_equals_nonshared,
    assert_fullshared_exact_at_the_same_positions,
    kv_error,
    plain_generate,
    refused,
    run_request,
    strip,
)

from hf_kvshare import PF, PH, Session
from hf_kvshare._compat import cache_kwargs
from hf_kvshare.method import METHODS

FAMILIES = ["idefics3", "smolvlm"]
MARKERS = ("<fake_token_around_image>", "<global-img>", "<row_1_col_1>", "<row_2_col_2>")


def _processor(family):
    if family == "smolvlm":
        pytest.importorskip("num2words", reason="transformers' SmolVLMProcessor needs the num2words package")
    return tiny_idefics3_processor(family=family)


@pytest.fixture(scope="module", params=FAMILIES)
def vl(request):
    family = request.param
    processor = _processor(family)
    return tiny_idefics3(seed=FAMILIES.index(family), family=family), processor


@pytest.fixture(scope="module")
def image():
    return random_image(0)  # 40x50: 2x2 tiles and the global view


def tower(model):
    return model.model.vision_model


def language(model):
    return model.model.text_model


def pixels_of(batch):
    return {"pixel_values": batch["pixel_values"], "pixel_attention_mask": batch["pixel_attention_mask"]}


def one_image(processor, image):
    return dict(processor(images=image, text="<image>", return_tensors="pt", add_special_tokens=False))


# ---------------------------------------------------------------------------- exactness
def test_nonshared_equals_plain_generate_with_pixel_values(vl, image):
    """The segment is the processor's expansion (markers and placeholders), the tiles' features enter
    over the placeholders: every NonShared turn equals plain generate with the same pixel values and
    pixel mask; the same prompt with another image's pixels gives another output (the image matters)."""
    model, processor = vl
    _, turns = run_request(model, processor, "nonshared", image, new_tokens=8)
    batch = processor(
        images=image,
        text="You solve.\n<image>\n" + QUESTION + "\nAnswer:",
        return_tensors="pt",
        add_special_tokens=False,
    )
    assert torch.equal(batch["input_ids"][0], turns[0].prompt_ids)  # the processor's expansion
    for turn in turns:
        plain = plain_generate(model, turn.prompt_ids, pixels_of(batch), 8)
        assert turn.output_ids.tolist() == strip(plain, model), turn.agent
    other = pixels_of(processor(images=random_image(3), text="<image>", return_tensors="pt"))
    assert any(
        turn.output_ids.tolist() != strip(plain_generate(model, turn.prompt_ids, other, 8), model)
        for turn in turns
    )


def test_the_segment_holds_the_processors_markers(vl, image):
    model, processor = vl
    session, _ = run_request(model, processor, "nonshared", image, new_tokens=2)
    visual = session.slots["chart"].visual
    tokens = processor.tokenizer.convert_ids_to_tokens(visual.token_ids.tolist())
    assert all(marker in tokens for marker in MARKERS)
    assert visual.pixel_values.shape[:2] == (1, 5)  # 2x2 tiles and the global view
    assert visual.feature_count == 5 * processor.image_seq_len < visual.length
    assert visual.features(model).shape == (visual.feature_count, model.config.text_config.hidden_size)
    # the markers' rows are the model's input embeddings of their ids; the placeholders' the features
    embeds = visual.embeds(model)[0]
    marks = visual.token_ids != model.config.image_token_id
    assert torch.equal(embeds[marks], model.get_input_embeddings()(visual.token_ids[marks]))
    assert torch.equal(embeds[~marks], visual.features(model))


def test_two_images_of_other_tilings_equal_plain_generate(vl):
    """Two images, 2x2 and 1x2 tiles: generate's pixel values pad the second with empty tiles (which
    the model drops); each image here is encoded alone."""
    model, processor = vl
    first, second = random_image(1), random_image(2, height=20, width=60)
    segments = [
        PF("Compare.\n"),
        PH("left", image=first),
        PF(" and "),
        PH("right", image=second),
        PF("\nSame?"),
    ]
    session = Session(model, processor.tokenizer, processor=processor)
    turn = session.run_turn("a", segments, max_new_tokens=8)
    assert [session.slots[s].visual.pixel_values.shape[1] for s in ("left", "right")] == [5, 3]
    batch = processor(
        images=[first, second],
        text="Compare.\n<image> and <image>\nSame?",
        return_tensors="pt",
        add_special_tokens=False,
    )
    assert torch.equal(batch["input_ids"][0], turn.prompt_ids)
    plain = plain_generate(model, turn.prompt_ids, pixels_of(batch), 8)
    assert turn.output_ids.tolist() == strip(plain, model)


def test_vision_tower_runs_once_per_image_per_request(vl, image):
    model, processor = vl
    for method in ("nonshared", "fullshared", "kvcomm"):
        with Calls(tower(model)) as calls:
            session, _ = run_request(model, processor, method, image)
        assert calls.n == 1, method  # three agents read the image: one encoding of its 5 tiles
        assert session.slots["chart"].visual.encodes == 1
    with Calls(tower(model)) as calls:  # a second image in a new request: encoded for it
        run_request(model, processor, "nonshared", image)
        run_request(model, processor, "nonshared", random_image(3))
    assert calls.n == 2


def test_fullshared_is_exact_where_the_image_lands_at_the_same_positions(vl, image):
    model, processor = vl
    assert_fullshared_exact_at_the_same_positions(model, processor, image)


def test_repositioned_image_equals_recomputation_at_the_new_positions(vl, image):
    """FullShared moves the image K/V (computed at 0 .. n-1) to a new offset: equal, to fp tolerance,
    to the segment's embeddings (markers and features) prefilled alone at the new positions (1D RoPE)."""
    model, processor = vl
    session = Session(model, processor.tokenizer, "fullshared", processor=processor)
    session.run_turn("a", [PH("chart", image=image), PF("\nColours?")], max_new_tokens=3)
    moved = session.run_turn(
        "b", [PF("A longer preamble first.\n"), PH("chart"), PF("\nBars?")], max_new_tokens=3, keep_cache=True
    )
    seg = moved.cache.segment("chart")
    assert seg.start > 0 and seg.provenance == "reused"
    embeds = session.slots["chart"].visual.embeds(model)

    def alone_at(offset):
        cache = DynamicCache(config=model.config)
        positions = torch.arange(offset, offset + seg.length)[None]
        with torch.no_grad():
            model(inputs_embeds=embeds, position_ids=positions, use_cache=True, **cache_kwargs(cache))
        return [(layer.keys, layer.values) for layer in cache.layers]

    got, want = moved.cache.extract(seg.start, seg.end), alone_at(seg.start)
    for layer, (keys, values) in enumerate(want):
        assert torch.allclose(got.keys[layer], keys, atol=1e-5)
        assert torch.allclose(got.values[layer], values, atol=1e-6)
    assert (alone_at(0)[1][0] - want[1][0]).abs().max() > 1e-2  # the shift is what made them equal


def test_full_recomputation_of_the_image_equals_nonshared(vl, image):
    """CacheBlend at rho = 0 recomputes every image token (markers and features) from layer 0."""
    model, processor = vl
    assert_full_recomputation_equals_nonshared(model, processor, image)


@pytest.mark.parametrize("name", ["kvcmas", "kvcomm"])
def test_identical_image_requests_are_corrected_exactly(vl, image, name):
    model, processor = vl
    _, free = run_request(model, processor, "nonshared", image)
    forced = [t.output_ids for t in free]
    _, exact = run_request(model, processor, "nonshared", image, forced=forced, keep_cache=True)
    method = METHODS[name](tau=1.0)
    for _ in range(2):
        run_request(model, processor, method, image, forced=forced)
    _, got = run_request(model, processor, method, image, forced=forced, keep_cache=True)
    corrected = 0
    for turn, ref in zip(got, exact):
        seg = turn.cache.segment("chart")
        assert kv_error(turn.cache, ref.cache, seg.start, seg.end) < 1e-4, (turn.agent, seg)
        corrected += seg.provenance == "corrected"
        assert torch.allclose(turn.logits, ref.logits, atol=1e-3)
    assert corrected >= 2
    assert sum(t.tokens_corrected for t in got) > 0


METHODS_RUN = sorted(name for name, cls in METHODS.items() if cls.visual_segments and name != "droidspeak")
OPTIONS = {"relaycaching": {"band": (0.0, 1.0)}}


@pytest.mark.parametrize("name", METHODS_RUN)
def test_every_prompt_method_runs_on_an_image_request(vl, image, name):
    model, processor = vl
    method = METHODS[name](**OPTIONS.get(name, {}))
    for _ in range(2):  # the second request reads what the first left (pools, profiles)
        session, turns = run_request(model, processor, method, image, new_tokens=3)
        assert all(t.output_ids.numel() >= 1 for t in turns)
        assert turns[1].ph_tokens >= session.slots["chart"].token_ids.numel()


def test_droidspeak_runs_with_a_layer_profile(vl, image):
    model, processor = vl
    L = model.config.get_text_config().num_hidden_layers
    method = METHODS["droidspeak"](rho=0.5, layer_profile=[float(i) for i in range(L)])
    _, turns = run_request(model, processor, method, image, new_tokens=3)
    assert turns[2].tokens_recomputed > 0


def test_processed_image_input_equals_the_pil_image(vl, image):
    model, processor = vl
    batch = one_image(processor, image)
    segments = lambda img: [PF("See.\n"), PH("chart", image=img), PF("\nSo?")]  # noqa: E731
    a = Session(model, processor.tokenizer, processor=processor).run_turn(
        "a", segments(image), max_new_tokens=6
    )
    b = Session(model, processor.tokenizer, processor=processor).run_turn(
        "a", segments(batch), max_new_tokens=6
    )
    assert a.output_ids.tolist() == b.output_ids.tolist() and torch.equal(a.prompt_ids, b.prompt_ids)
    no_mask = {k: v for k, v in batch.items() if k != "pixel_attention_mask"}  # all pixels: the same here
    c = Session(model, processor.tokenizer, processor=processor).run_turn(
        "a", segments(no_mask), max_new_tokens=6
    )
    assert c.output_ids.tolist() == a.output_ids.tolist()


def test_image_file_path_and_processor_as_the_tokenizer(vl, image, tmp_path):
    model, processor = vl
    path = tmp_path / "chart.png"
    image.save(path)
    segments = lambda img: [PF("See.\n"), PH("chart", image=img), PF("\nSo?")]  # noqa: E731
    a = Session(model, processor.tokenizer, processor=processor).run_turn(
        "a", segments(image), max_new_tokens=6
    )
    session = Session(model, processor)
    assert session.tokenizer is processor.tokenizer and session.processor is processor
    b = session.run_turn("a", segments(str(path)), max_new_tokens=6)
    assert a.output_ids.tolist() == b.output_ids.tolist()


def test_a_saved_folder_loads_through_load_model_and_load_processor(vl, image, tmp_path):
    """``load_model`` / ``load_processor`` on a folder as the hub holds these families (SmolVLM's
    processor without its video processor, which needs torchvision; the PIL image processor where
    ``AutoImageProcessor`` needs torchvision): the same expansion and output as the objects saved."""
    from hf_kvshare.models import load_model, load_processor

    model, processor = vl
    family = model.config.model_type
    directory = save_tiny_idefics3(tmp_path / family, family, seed=FAMILIES.index(family))
    loaded, _ = load_model(str(directory))
    loaded_processor = load_processor(str(directory))
    assert loaded_processor.image_seq_len == processor.image_seq_len
    segments = [PF("See.\n"), PH("chart", image=image), PF("\nSo?")]
    a = Session(model, processor.tokenizer, processor=processor).run_turn("a", segments, max_new_tokens=6)
    b = Session(loaded, loaded_processor).run_turn("a", segments, max_new_tokens=6)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and a.output_ids.tolist() == b.output_ids.tolist()


def test_held_bytes_count_the_image(vl, image):
    model, processor = vl
    session, _ = run_request(model, processor, "nonshared", image, new_tokens=2)
    visual = session.slots["chart"].visual
    held = [visual.pixel_values, visual.features(model), visual.pixel_attention_mask]
    assert visual.nbytes == sum(t.numel() * t.element_size() for t in held)
    assert session.held_bytes() >= visual.nbytes


# ---------------------------------------------------------------------------- bad input
def test_image_for_a_text_only_model(vl, image):
    _, processor = vl
    model = tiny_model("llama")
    refused(
        Session(model, processor.tokenizer), [PH("c", image=image), PF("\nSo?")], "text-only model", model
    )


def test_placeholder_count_and_markers_disagreeing_with_the_processor(vl, image):
    model, processor = vl
    batch = one_image(processor, image)
    ids = batch["input_ids"]
    n = int((ids == processor.image_token_id).sum())
    session = Session(model, processor.tokenizer, processor=processor)
    short = {**batch, "input_ids": ids[:, :-3]}  # drops the global view's last placeholders
    refused(
        session,
        [PH("c", image=short), PF("\nSo?")],
        f"{n - 2} image placeholder tokens given; .* into {n}",
        model,
    )
    swapped = ids.clone()
    row = processor.tokenizer.convert_tokens_to_ids
    swapped[swapped == row("<row_1_col_2>")] = row("<row_2_col_1>")
    refused(
        session,
        [PH("c", image={**batch, "input_ids": swapped}), PF("\nSo?")],
        "not the processor's expansion of 5 tiles",
        model,
    )
    no_ids = {k: v for k, v in batch.items() if k != "input_ids"}
    refused(
        session, [PH("c", image=no_ids), PF("\nSo?")], "needs the 'input_ids' the processor expanded", model
    )
    text = [PF("See <image> here.\n"), PH("c", image=image), PF("\nSo?")]
    refused(session, text, "image placeholder token", model)


def test_pixel_values_and_mask_of_the_wrong_dtype_device_or_shape(vl, image):
    model, processor = vl
    batch = one_image(processor, image)
    session = Session(model, processor.tokenizer, processor=processor)
    cases = [
        ({"pixel_values": batch["pixel_values"].double()}, "torch.float32 on cpu .* got torch.float64"),
        ({"pixel_values": batch["pixel_values"].to("meta")}, "on cpu .* got torch.float32 on meta"),
        ({"pixel_values": batch["pixel_values"][:, :0]}, "at least one tile"),
        ({"pixel_values": batch["pixel_values"][:, :, :, :16]}, "the vision tower takes 32x32"),
        (
            {"pixel_attention_mask": batch["pixel_attention_mask"][:, :2]},
            "pixel_attention_mask must be \\[1, 5",
        ),
        ({"pixel_attention_mask": batch["pixel_attention_mask"].float()}, "a bool / integer mask on cpu"),
    ]
    for change, match in cases:
        refused(session, [PH("c", image={**batch, **change}), PF("\nSo?")], match, model)


def test_processor_not_matching_the_model(vl, image):
    """A processor whose tiles expand into another placeholder count (16-pixel tiles: 1 each) is
    refused before any model work."""
    model, processor = vl
    small = tiny_idefics3_processor(family=model.config.model_type, tile=16, longest_edge=32)
    session = Session(model, small.tokenizer, processor=small)
    refused(
        session, [PH("c", image=image), PF("\nSo?")], "into 1 placeholders .* model's tiles give 4", model
    )
    refused(
        Session(model, processor.tokenizer),
        [PH("c", image=image), PF("?")],
        "needs the model's processor",
        model,
    )


def test_video_and_other_bad_segments(vl, image, tmp_path):
    model, processor = vl
    session = Session(model, processor.tokenizer, processor=processor)
    refused(
        session, [PH("clip", video=[image, image]), PF("\nSo?")], "video segments are not supported", model
    )
    bad = tmp_path / "chart.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    refused(session, [PH("c", image=str(bad)), PF("\nSo?")], "could not read image file", model)
    refused(session, [PF("See.\n"), PH("c", image=image)], "ends with the image segment", model)
    session.run_turn("a", [PH("c", image=image), PF("\nSo?")], max_new_tokens=2)
    refused(session, [PH("c", image=random_image(5)), PF("\nSo?")], "already holds another image", model)

"""Images as shared segments on multimodal-RoPE models (Qwen2-VL, Qwen2.5-VL; hf_kvshare.mrope).

Tiny random models built offline (``tests/tiny.py``: ``tiny_qwen_vl``, ``tiny_qwen_vl_processor``).
NonShared through the shared cache equals plain ``generate`` with the same pixel values token for
token (the model's own 3D positions, ``rope_deltas`` after the image); the cache's rope layout is the
model's ``get_rope_index``; a uniform shift of the three components is the 1D rotation (checked on
the model's own rotary module); re-positioned image and text K/V equal recomputation at the new
positions; the vision tower once per image per request; every prompt method runs; bad input refused.
"""

from __future__ import annotations

import pytest
import torch
from tiny import random_image, tiny_qwen_vl, tiny_qwen_vl_processor
from vision_helpers import (
    QUESTION,
    assert_full_recomputation_equals_nonshared,
    assert_fullshared_exact_at_the_same_positions,
    kv_error,
    strip,
)
from vision_helpers import run_request as _run_request

from hf_kvshare import PF, PH, Session, _compat
from hf_kvshare._compat import cache_kwargs
from hf_kvshare.method import METHODS
from hf_kvshare.mrope import is_mrope
from hf_kvshare.rope import RopeShifter, rotate_half

VERSIONS = ["2", "2.5"]


@pytest.fixture(scope="module", params=VERSIONS, ids=lambda v: f"qwen{v}-vl")
def vl(request):
    return tiny_qwen_vl(version=request.param), tiny_qwen_vl_processor(version=request.param)


@pytest.fixture(scope="module")
def image():
    return random_image(0)


def agents(image):
    """Two solvers read the image and the question, a reflector reads both and their answers; the
    image sits between Qwen's vision markers, as its chat template puts it."""
    img = PH("chart", image=image)
    return [
        (
            "solver",
            [
                PF("You solve.\n<|vision_start|>"),
                img,
                PF("<|vision_end|>\n"),
                PH("question", QUESTION),
                PF("\nAnswer:"),
            ],
        ),
        (
            "checker",
            [
                PF("You check the chart.\n<|vision_start|>"),
                PH("chart"),
                PF("<|vision_end|>\n"),
                PH("question"),
                PF("\nAnswer:"),
            ],
        ),
        (
            "reflector",
            [
                PF("You reflect.\nQ: "),
                PH("question"),
                PF("\nA1: "),
                PH("solver"),
                PF("\nA2: "),
                PH("checker"),
                PF("\n<|vision_start|>"),
                PH("chart"),
                PF("<|vision_end|>\nFinal:"),
            ],
        ),
    ]


def run_request(model, processor, method, image, **kwargs):
    """One request laid out as Qwen's chat template puts images (``agents`` above)."""
    return _run_request(model, processor, method, image, layout=agents, **kwargs)


def pixel_inputs(model, processor, ids, images):
    """What the processor gives plain ``generate`` for a prompt ``ids`` holding ``images``."""
    out = {"mm_token_type_ids": (ids == model.config.image_token_id).long()[None]}
    if images:
        batches = [processor(images=im, text=processor.image_token, return_tensors="pt") for im in images]
        out["pixel_values"] = torch.cat([b["pixel_values"] for b in batches])
        out["image_grid_thw"] = torch.cat([b["image_grid_thw"] for b in batches])
    return out


def plain_generate(model, ids, inputs, new_tokens):
    model.model.rope_deltas = None  # the model keeps the last call's; a new prompt starts without
    with torch.no_grad():
        out = model.generate(input_ids=ids[None], **inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.numel() :]


def full_positions(model, processor, ids, images):
    """The model's own 3D positions of a whole prompt (``get_rope_index``)."""
    inputs = pixel_inputs(model, processor, ids, images)
    positions, _ = model.model.get_rope_index(
        ids[None], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw")
    )
    return positions[:, 0]


# ---------------------------------------------------------------------------- exactness
def test_the_models_are_multimodal_rope(vl):
    model, _ = vl
    assert is_mrope(model)


def test_nonshared_equals_plain_generate_with_pixel_values(vl, image):
    model, processor = vl
    _, turns = run_request(model, processor, "nonshared", image, new_tokens=8)
    text = "You solve.\n<|vision_start|><|image_pad|><|vision_end|>\n" + QUESTION + "\nAnswer:"
    batch = processor(images=image, text=text, return_tensors="pt", add_special_tokens=False)
    assert torch.equal(batch["input_ids"][0], turns[0].prompt_ids)  # the processor's placeholders
    for turn in turns:
        plain = plain_generate(
            model, turn.prompt_ids, pixel_inputs(model, processor, turn.prompt_ids, [image]), 8
        )
        assert turn.output_ids.tolist() == strip(plain, model), turn.agent
    # the image moves the text after it (rope_deltas): not the 1D positions
    positions = full_positions(model, processor, turns[0].prompt_ids, [image])
    assert int(positions[0, -1]) < turns[0].prompt_ids.numel() - 1


def test_the_cache_layout_is_the_models_rope_index(vl, image):
    """Two images and text between them: the cache's rope track gives each slot the 3D position the
    model's get_rope_index gives the whole prompt."""
    model, processor = vl
    second = random_image(2, height=30, width=60)
    segments = [
        PF("Compare <|vision_start|>"),
        PH("left", image=image),
        PF("<|vision_end|> and <|vision_start|>"),
        PH("right", image=second),
        PF("<|vision_end|>\nSame?"),
    ]
    turn = Session(model, processor.tokenizer, processor=processor).run_turn(
        "a", segments, max_new_tokens=6, keep_cache=True
    )
    P = turn.prompt_ids.numel()
    want = full_positions(model, processor, turn.prompt_ids, [image, second])
    assert torch.equal(turn.cache.rope_track.positions(0, P), want)
    plain = plain_generate(
        model, turn.prompt_ids, pixel_inputs(model, processor, turn.prompt_ids, [image, second]), 6
    )
    assert turn.output_ids.tolist() == strip(plain, model)


def test_uniform_shift_is_the_1d_rotation_on_the_models_rotary(vl):
    """Keys rotated by the model's own rotary module (its mrope_section) at 3D positions P, moved by
    the 1D shifter by d, equal the keys rotated at P + d (all three components); a shift of one
    component only is not a 1D rotation."""
    model, _ = vl
    rotary = model.model.language_model.rotary_emb
    head_dim = (
        model.config.get_text_config().hidden_size // model.config.get_text_config().num_attention_heads
    )
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 12, head_dim)
    P = torch.stack(
        [torch.full((12,), 5), torch.arange(12) // 4 + 5, torch.arange(12) % 4 + 5]
    )  # an image's grid

    def rotated(positions):
        cos, sin = rotary(keys, positions[:, None])  # [1, seq, head_dim]
        if (
            cos.dim() == 4
        ):  # transformers 5.16: per component [3, 1, seq, head_dim]; the attention interleaves
            section = _compat.mrope_section(model) * 2
            cos, sin = (
                torch.cat([m[i % 3] for i, m in enumerate(c.split(section, dim=-1))], dim=-1)
                for c in (cos, sin)
            )
        return keys * cos[:, None] + rotate_half(keys) * sin[:, None]

    shifter = RopeShifter.from_model(model)
    d = 37
    moved = shifter.reposition(rotated(P), 5, 5 + d)
    assert torch.allclose(moved, rotated(P + d), atol=1e-5)
    only_t = P.clone()
    only_t[0] += d
    assert (moved - rotated(only_t)).abs().max() > 1e-1


def test_vision_tower_runs_once_per_image_per_request(vl, image):
    model, processor = vl
    counted = []
    handle = model.model.visual.register_forward_hook(lambda *_: counted.append(1))
    try:
        for method in ("nonshared", "fullshared", "kvcomm"):
            counted.clear()
            session, _ = run_request(model, processor, method, image)
            assert len(counted) == 1, method
            assert session.slots["chart"].visual.encodes == 1
    finally:
        handle.remove()


def test_fullshared_is_exact_where_the_image_lands_at_the_same_positions(vl, image):
    model, processor = vl
    assert_fullshared_exact_at_the_same_positions(
        model, processor, image, before="You solve.\n<|vision_start|>", after="<|vision_end|>\n"
    )


def test_repositioned_segments_equal_recomputation_at_the_new_positions(vl, image):
    """FullShared moves the image to other slots (text only before it in both prompts) and the
    question from before the image (rope shift 0) to after it (the image's rope span is not its slot
    count: another shift): their layer-0 K/V (a function of the token and its 3D positions only) equal,
    to fp tolerance, NonShared's at the new place. Unmoved keys differ (the shift was needed)."""
    model, processor = vl
    first = [
        PF("Q: "),
        PH("question", QUESTION),
        PF("\n<|vision_start|>"),
        PH("chart", image=image),
        PF("<|vision_end|>\nColours?"),
    ]
    second = [
        PF("A longer preamble first.\n<|vision_start|>"),
        PH("chart"),
        PF("<|vision_end|>\nQ: "),
        PH("question"),
        PF("\nBars?"),
    ]

    def request(method):
        session = Session(model, processor.tokenizer, method, processor=processor)
        a = session.run_turn("a", first, force_output=[5, 6], keep_cache=True)
        b = session.run_turn("b", second, force_output=[7], keep_cache=True)
        return a, b

    a, moved = request("fullshared")
    _, exact = request("nonshared")
    track = moved.cache.rope_track
    for name in ("chart", "question"):
        seg, src = moved.cache.segment(name), a.cache.segment(name)
        assert seg.provenance == "reused" and seg.start != src.start, name
        got, want = moved.cache.extract(seg.start, seg.end), exact.cache.extract(seg.start, seg.end)
        assert torch.allclose(got.keys[0], want.keys[0], atol=1e-4), name
        assert torch.allclose(got.values[0], want.values[0], atol=1e-5), name
        # in the cache's own frame too: the keys the model attends to are the keys at the 3D positions
        k_got = moved.cache.layer_kv(0)[0][..., seg.start : seg.end, :]
        k_want = exact.cache.layer_kv(0)[0][..., seg.start : seg.end, :]
        assert torch.allclose(k_got, k_want, atol=1e-4), name
        unmoved = a.cache.layer_kv(0)[0][..., src.start : src.end, :]
        assert (unmoved - k_want).abs().max() > 1e-2, name  # the move was needed
    question = moved.cache.segment("question")
    rope_start = int(track.positions(question.start, question.start + 1)[0, 0])
    slot_shift = question.start - a.cache.segment("question").start
    assert rope_start - a.cache.segment("question").start != slot_shift  # rope moved by another amount


def test_full_recomputation_of_the_image_equals_nonshared(vl, image):
    """CacheBlend at rho = 0 recomputes every image token from its features at their 3D positions."""
    model, processor = vl
    assert_full_recomputation_equals_nonshared(model, processor, image, layout=agents)


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
    for turn, ref in zip(got, exact):
        seg = turn.cache.segment("chart")
        assert kv_error(turn.cache, ref.cache, seg.start, seg.end) < 1e-3, (turn.agent, seg)
        assert torch.allclose(turn.logits, ref.logits, atol=1e-2)
    assert sum(t.tokens_corrected for t in got) > 0


METHODS_RUN = sorted(name for name, cls in METHODS.items() if cls.visual_segments and name != "droidspeak")
OPTIONS = {"relaycaching": {"band": (0.0, 1.0)}}


@pytest.mark.parametrize("name", METHODS_RUN)
def test_every_prompt_method_runs_on_an_image_request(vl, image, name):
    model, processor = vl
    method = METHODS[name](**OPTIONS.get(name, {}))
    for _ in range(2):
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
    batch = processor(images=image, text=processor.image_token, return_tensors="pt")
    given = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
    turns = []
    for value in (image, given):
        session = Session(model, processor.tokenizer, processor=processor)
        turns.append(
            session.run_turn(
                "a", [PF("<|vision_start|>"), PH("c", image=value), PF("<|vision_end|>?")], max_new_tokens=5
            )
        )
    assert turns[0].output_ids.tolist() == turns[1].output_ids.tolist()


def test_processed_video_equals_plain_generate(vl):
    """A processed video (patches and its grid; no video processor without torchvision) through
    get_video_features, at the model's video positions."""
    model, processor = vl
    grid = torch.tensor([[2, 4, 4]])
    torch.manual_seed(0)
    patches = torch.randn(32, 3 * 2 * 4 * 4)
    video = {"pixel_values_videos": patches, "video_grid_thw": grid}
    if model.config.model_type == "qwen2_5_vl":
        video["second_per_grid_ts"] = torch.tensor([1.0])
    turn = Session(model, processor.tokenizer, processor=processor).run_turn(
        "a",
        [PF("Watch <|vision_start|>"), PH("clip", video=video), PF("<|vision_end|>\nWhat moves?")],
        max_new_tokens=6,
    )
    ids = turn.prompt_ids
    assert int((ids == model.config.video_token_id).sum()) == 2 * 4 * 4 // 4
    inputs = {
        "mm_token_type_ids": (ids == model.config.video_token_id).long()[None] * 2,
        "pixel_values_videos": patches,
        "video_grid_thw": grid,
    }
    if "second_per_grid_ts" in video:
        inputs["second_per_grid_ts"] = video["second_per_grid_ts"]
    assert turn.output_ids.tolist() == strip(plain_generate(model, ids, inputs, 6), model)


# ---------------------------------------------------------------------------- bad input
def test_placeholder_count_disagreeing_with_the_processor(vl, image):
    model, processor = vl
    batch = processor(images=image, text=processor.image_token, return_tensors="pt")
    n = int(batch["input_ids"].numel())
    session = Session(model, processor.tokenizer, processor=processor)
    bad = {
        "pixel_values": batch["pixel_values"],
        "image_grid_thw": batch["image_grid_thw"],
        "input_ids": torch.full((n - 1,), model.config.image_token_id),
    }
    with pytest.raises(ValueError, match=f"{n - 1} image placeholder tokens given; the processor expands"):
        session.run_turn("a", [PF("<|vision_start|>"), PH("c", image=bad), PF("<|vision_end|>?")])
    grid = {"pixel_values": batch["pixel_values"], "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match="pixel_values must be \\[16 patches"):
        session.run_turn("a", [PF("<|vision_start|>"), PH("c", image=grid), PF("<|vision_end|>?")])
    with pytest.raises(ValueError, match="needs 'image_grid_thw'"):
        session.run_turn("a", [PF("x"), PH("c", image={"pixel_values": batch["pixel_values"]}), PF("?")])
    assert not session.slots and not session.turns


def test_pixel_values_of_the_wrong_dtype(vl, image):
    model, processor = vl
    batch = processor(images=image, text=processor.image_token, return_tensors="pt")
    session = Session(model, processor.tokenizer, processor=processor)
    bad = {"pixel_values": batch["pixel_values"].double(), "image_grid_thw": batch["image_grid_thw"]}
    with pytest.raises(ValueError, match="must be torch.float32 on cpu"):
        session.run_turn("a", [PF("x"), PH("c", image=bad), PF("?")])
    assert not session.slots


def test_placeholder_tokens_in_text_and_an_image_ending_the_prompt(vl, image):
    model, processor = vl
    session = Session(model, processor.tokenizer, processor=processor)
    with pytest.raises(ValueError, match="image placeholder token"):
        session.run_turn("a", [PF("look <|image_pad|> here")])
    with pytest.raises(ValueError, match="ends with the image segment"):
        session.run_turn("a", [PF("<|vision_start|>"), PH("c", image=image)])
    assert not session.slots and not session.turns


def test_image_placeholders_without_their_layout_are_refused(vl):
    """A forward of placeholder ids on a multimodal-RoPE model without the image's layout: refused
    (their positions are not text's), nothing appended."""
    from hf_kvshare.cache import SegmentedCache
    from hf_kvshare.prefill import prefill_dense

    model, _ = vl
    cache = SegmentedCache(model.config)
    ids = torch.tensor([[1, 2, model.config.image_token_id, 3]])
    with pytest.raises(ValueError, match="without their image's layout"):
        prefill_dense(cache, model, ids)
    assert cache.get_seq_length() == 0


def test_build_cache_then_generate_with_the_prompts_positions(vl, image):
    """A caller of generate over build_cache's cache passes mrope.generate_kwargs (the prompt's 3D
    positions): equal to the session's own turn; batch rows identical."""
    from hf_kvshare.mrope import generate_kwargs

    model, processor = vl
    segments = [PF("See <|vision_start|>"), PH("chart", image=image), PF("<|vision_end|>\nSo?")]
    cache, ids = Session(model, processor.tokenizer, processor=processor).build_cache(
        "a", segments, batch_size=2
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            **cache_kwargs(cache),
            **generate_kwargs(cache, ids),
            max_new_tokens=6,
            do_sample=False,
        )
    turn = Session(model, processor.tokenizer, processor=processor).run_turn("a", segments, max_new_tokens=6)
    assert strip(out[0, ids.shape[1] :], model) == turn.output_ids.tolist()
    assert torch.equal(out[0], out[1])
    assert generate_kwargs(cache, ids)["position_ids"].shape == (4, 2, ids.shape[1])


# ---------------------------------------------------------------------------- random: real shapes
@pytest.mark.parametrize("name", ["qwen2-vl-7b", "qwen2.5-vl-7b"])
def test_random_real_shape_vlm_configs(name):
    """``random:qwen2-vl-7b`` / ``random:qwen2.5-vl-7b``: the cards' shapes (8.29B parameters, counted
    on the meta device), depth cut on the language model only, and a processor whose markers are the
    config's token ids (the byte tokenizer's) and whose placeholder count is the grid's."""
    from hf_kvshare import load_model
    from hf_kvshare.models import load_processor
    from hf_kvshare.random_models import parameter_count, random_config

    config = random_config(name)
    text, vision = config.text_config, config.vision_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_key_value_heads) == (28, 3584, 4)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and vision.patch_size == 14
    assert parameter_count(config) / 1e9 == pytest.approx(8.29, abs=0.01)
    model, tokenizer = load_model(f"random:{name}", num_layers=1, device_map="meta")
    assert len(model.model.language_model.layers) == 1 and is_mrope(model)
    processor = load_processor(f"random:{name}")
    assert processor.image_token_id == model.config.image_token_id
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    batch = processor(images=random_image(0, 56, 84), text=processor.image_token, return_tensors="pt")
    grid = batch["image_grid_thw"][0]
    # the placeholder count is the grid's (56x84 px: 4x6 patches of 14 merged 2x2 on 5.24; the 5.16
    # processor resizes to its own minimum first)
    assert batch["input_ids"].numel() == int(grid.prod()) // 4 > 0
    with pytest.raises(ValueError, match=r"num_layers must be an int in \[1, 28\]"):
        random_config(name, 0)

"""Images and videos as shared segments (hf_kvshare.vision) on a tiny random LLaVA-OneVision.

The key test: NonShared through the shared cache equals plain ``model.generate(input_ids,
pixel_values, ...)`` token for token. Then FullShared exact where the image lands at the same
positions behind the same prefix, the re-positioned image K/V equal to recomputation at the new
positions, KVCMAS / KVComm corrections exact on identical requests, every method running, the
vision tower once per image per request, and bad input refused before any model work.
"""

from __future__ import annotations

import pytest
import torch
from tiny import random_image, tiny_model, tiny_vlm, tiny_vlm_processor
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
from hf_kvshare.methods.kvcmas import KVCMAS
from hf_kvshare.methods.kvcomm import KVComm


@pytest.fixture(scope="module")
def vlm():
    return tiny_vlm()


@pytest.fixture(scope="module")
def processor():
    return tiny_vlm_processor()


@pytest.fixture(scope="module")
def image():
    return random_image(0)


def tower(model):
    return model.model.vision_tower


def language(model):
    return model.model.language_model


# ---------------------------------------------------------------------------- exactness
def test_nonshared_equals_plain_generate_with_pixel_values(vlm, processor, image):
    """The image's placeholders are the processor's, its features enter as the segment's
    embeddings: every NonShared turn equals plain generate with the same pixel values."""
    _, turns = run_request(vlm, processor, "nonshared", image, new_tokens=8)
    batch = processor(
        images=image,
        text="You solve.\n<image>\n" + QUESTION + "\nAnswer:",
        return_tensors="pt",
        add_special_tokens=False,
    )
    assert torch.equal(
        batch["input_ids"][0], turns[0].prompt_ids
    )  # placeholders as the processor expands them
    pixels = {"pixel_values": batch["pixel_values"], "image_sizes": batch["image_sizes"]}
    for turn in turns:
        plain = plain_generate(vlm, turn.prompt_ids, pixels, 8)
        assert turn.output_ids.tolist() == strip(plain, vlm), turn.agent
    image_tokens = int((batch["input_ids"] == processor.image_token_id).sum())
    assert turns[0].ph_tokens == image_tokens + len(processor.tokenizer(QUESTION)["input_ids"])


def test_two_images_in_one_prompt_equal_plain_generate(vlm, processor):
    first, second = random_image(1), random_image(2)  # same size: one pixel tensor for generate
    segments = [
        PF("Compare.\n"),
        PH("left", image=first),
        PF(" and "),
        PH("right", image=second),
        PF("\nSame?"),
    ]
    turn = Session(vlm, processor.tokenizer, processor=processor).run_turn("a", segments, max_new_tokens=8)
    one = [processor(images=im, text="<image>", return_tensors="pt") for im in (first, second)]
    pixels = {
        "pixel_values": torch.cat([b["pixel_values"] for b in one]),
        "image_sizes": torch.cat([b["image_sizes"] for b in one]),
    }
    assert turn.output_ids.tolist() == strip(plain_generate(vlm, turn.prompt_ids, pixels, 8), vlm)


def test_vision_tower_runs_once_per_image_per_request(vlm, processor, image):
    for method in ("nonshared", "fullshared", "kvcomm"):
        with Calls(tower(vlm)) as calls:
            session, _ = run_request(vlm, processor, method, image)
        assert calls.n == 1, method  # three agents read the image: one encoding
        assert session.slots["chart"].visual.encodes == 1
    with Calls(tower(vlm)) as calls:  # a second image in a new request: encoded for it
        run_request(vlm, processor, "nonshared", image)
        run_request(vlm, processor, "nonshared", random_image(3))
    assert calls.n == 2


def test_fullshared_is_exact_where_the_image_lands_at_the_same_positions(vlm, processor, image):
    """The same prefix before the image in both agents: FullShared's reused image K/V is the exact
    K/V, so its second agent equals NonShared's token for token."""
    assert_fullshared_exact_at_the_same_positions(vlm, processor, image)


def test_repositioned_image_equals_recomputation_at_the_new_positions(vlm, processor, image):
    """FullShared moves the image K/V (computed at 0 .. n-1, nothing before it) to a new offset: equal,
    to fp tolerance, to the image's features prefilled alone at the new positions (1D RoPE; image
    features are position-free inputs)."""
    session = Session(vlm, processor.tokenizer, "fullshared", processor=processor)
    session.run_turn("a", [PH("chart", image=image), PF("\nColours?")], max_new_tokens=3)
    moved = session.run_turn(
        "b", [PF("A longer preamble first.\n"), PH("chart"), PF("\nBars?")], max_new_tokens=3, keep_cache=True
    )
    seg = moved.cache.segment("chart")
    assert seg.start > 0 and seg.provenance == "reused"
    features = session.slots["chart"].visual.embeds(vlm)

    def alone_at(offset):  # the image's features prefilled with nothing before them, at offset ..
        cache = DynamicCache(config=vlm.config)
        positions = torch.arange(offset, offset + seg.length)[None]
        with torch.no_grad():
            vlm(inputs_embeds=features, position_ids=positions, use_cache=True, **cache_kwargs(cache))
        return [(layer.keys, layer.values) for layer in cache.layers]

    got, want = moved.cache.extract(seg.start, seg.end), alone_at(seg.start)
    for layer, (keys, values) in enumerate(want):
        assert torch.allclose(got.keys[layer], keys, atol=1e-5)
        assert torch.allclose(got.values[layer], values, atol=1e-6)
    # the shift is what made them equal: the keys at 0 .. n-1 are not those at the new positions
    assert (alone_at(0)[1][0] - want[1][0]).abs().max() > 1e-2


def test_full_recomputation_of_the_image_equals_nonshared(vlm, processor, image):
    """CacheBlend at rho = 0 recomputes every image token from its features (layer 0 input): NonShared."""
    assert_full_recomputation_equals_nonshared(vlm, processor, image)


@pytest.mark.parametrize("cls", [KVCMAS, KVComm])
def test_identical_image_requests_are_corrected_exactly(vlm, processor, image, cls):
    """Two earlier requests with the same image and question give identical anchors: the third
    request's corrected image segments are the exact K/V (NonShared's), to fp tolerance. KVComm's
    reference prefill of the image runs on its features."""
    _, free = run_request(vlm, processor, "nonshared", image)
    forced = [t.output_ids for t in free]
    _, exact = run_request(vlm, processor, "nonshared", image, forced=forced, keep_cache=True)
    method = cls(tau=1.0)
    for _ in range(2):
        run_request(vlm, processor, method, image, forced=forced)
    _, got = run_request(vlm, processor, method, image, forced=forced, keep_cache=True)
    corrected = 0
    for turn, ref in zip(got, exact):
        seg = turn.cache.segment("chart")
        assert kv_error(turn.cache, ref.cache, seg.start, seg.end) < 1e-4, (turn.agent, seg)
        corrected += seg.provenance == "corrected"
        assert torch.allclose(turn.logits, ref.logits, atol=1e-3)
    assert corrected >= 2  # the checker's and the reflector's image (KVComm: the solver's too)
    assert sum(t.tokens_corrected for t in got) > 0


METHODS_RUN = sorted(
    name for name, cls in METHODS.items() if cls.visual_segments and name not in ("droidspeak",)
)


#: knobs the 3-layer model needs (a band of at least two layers)
OPTIONS = {"relaycaching": {"band": (0.0, 1.0)}}


@pytest.mark.parametrize("name", METHODS_RUN)
def test_every_prompt_method_runs_on_an_image_request(vlm, processor, image, name):
    method = METHODS[name](**OPTIONS.get(name, {}))
    for _ in range(2):  # the second request reads what the first left (pools, profiles)
        session, turns = run_request(vlm, processor, method, image, new_tokens=3)
        assert all(t.output_ids.numel() >= 1 for t in turns)
        assert turns[1].ph_tokens >= session.slots["chart"].token_ids.numel()


def test_droidspeak_runs_with_a_layer_profile(vlm, processor, image):
    L = vlm.config.get_text_config().num_hidden_layers
    method = METHODS["droidspeak"](rho=0.5, layer_profile=[float(i) for i in range(L)])
    _, turns = run_request(vlm, processor, method, image, new_tokens=3)
    assert turns[2].tokens_recomputed > 0


def test_video_frames_equal_plain_generate(vlm, processor):
    """A processed video (the processor's ``pixel_values_videos``) through ``get_video_features``:
    NonShared equals plain generate with the same pixel values."""
    torch.manual_seed(0)
    frames = torch.randn(1, 3, 3, 32, 32)
    if (
        getattr(processor._get_num_multimodal_tokens(video_sizes=[[3, 32, 32]]), "num_video_tokens", None)
        is None
    ):
        session = Session(vlm, processor.tokenizer, processor=processor)
        with pytest.raises(ValueError, match="video segments need a transformers"):
            session.run_turn("a", [PF("W.\n"), PH("clip", video={"pixel_values_videos": frames}), PF("\n?")])
        assert not session.slots
        pytest.skip("this transformers' processor does not count video tokens (refused clearly above)")
    turn = Session(vlm, processor.tokenizer, processor=processor).run_turn(
        "a",
        [PF("Watch.\n"), PH("clip", video={"pixel_values_videos": frames}), PF("\nWhat moves?")],
        max_new_tokens=8,
    )
    count = int((turn.prompt_ids == processor.video_token_id).sum())
    assert count == 3 * 4 + 1  # frames x pooled 2x2 + the newline, the processor's rule
    plain = plain_generate(vlm, turn.prompt_ids, {"pixel_values_videos": frames}, 8)
    assert turn.output_ids.tolist() == strip(plain, vlm)


def test_processed_image_input_equals_the_pil_image(vlm, processor, image):
    batch = processor(images=image, text="<image>", return_tensors="pt", add_special_tokens=False)
    segments = lambda img: [PF("See.\n"), PH("chart", image=img), PF("\nSo?")]  # noqa: E731
    a = Session(vlm, processor.tokenizer, processor=processor).run_turn(
        "a", segments(image), max_new_tokens=6
    )
    b = Session(vlm, processor.tokenizer, processor=processor).run_turn(
        "a", segments(dict(batch)), max_new_tokens=6
    )
    assert a.output_ids.tolist() == b.output_ids.tolist() and torch.equal(a.prompt_ids, b.prompt_ids)


def test_image_file_path(vlm, processor, image, tmp_path):
    path = tmp_path / "chart.png"
    image.save(path)
    segments = lambda img: [PF("See.\n"), PH("chart", image=img), PF("\nSo?")]  # noqa: E731
    a = Session(vlm, processor.tokenizer, processor=processor).run_turn(
        "a", segments(image), max_new_tokens=6
    )
    b = Session(vlm, processor.tokenizer, processor=processor).run_turn(
        "a", segments(str(path)), max_new_tokens=6
    )
    assert a.output_ids.tolist() == b.output_ids.tolist()


def test_processor_passed_as_the_tokenizer(vlm, processor, image):
    session = Session(vlm, processor)
    assert session.tokenizer is processor.tokenizer and session.processor is processor
    session.run_turn("a", [PH("chart", image=image), PF("\nSo?")], max_new_tokens=2)


def test_image_slot_kind_leaves_the_question_to_the_text(vlm, processor, image):
    session, _ = run_request(vlm, processor, "nonshared", image, new_tokens=2)
    assert session.slots["chart"].kind == "observation"
    assert session.slots["question"].kind == "question"


# ---------------------------------------------------------------------------- bad input
def test_image_for_a_text_only_model(processor, image):
    model = tiny_model("qwen2")
    session = Session(model, processor.tokenizer)
    refused(session, [PH("chart", image=image), PF("\nSo?")], "text-only model", model)


def test_image_without_a_processor(vlm, image):
    session = Session(vlm, tiny_vlm_processor().tokenizer)
    refused(session, [PH("chart", image=image), PF("\nSo?")], "needs the model's processor", vlm)


def test_placeholder_count_disagreeing_with_the_processor(vlm, processor, image):
    batch = dict(processor(images=image, text="<image>", return_tensors="pt", add_special_tokens=False))
    n = batch["input_ids"].shape[-1]
    session = Session(vlm, processor.tokenizer, processor=processor)
    short = {**batch, "input_ids": batch["input_ids"][:, : n - 3]}
    refused(
        session,
        [PH("chart", image=short), PF("\nSo?")],
        f"{n - 3} image placeholder tokens given; .* into {n}",
        vlm,
    )
    text = [PF("See <image> here.\n"), PH("chart", image=image), PF("\nSo?")]
    refused(session, text, "image placeholder token", vlm)


def test_processor_not_matching_the_model(vlm, image):
    """A processor for another image size is refused before any model work; one whose feature strategy
    drops a token per image ("default": a CLS token the SigLIP tower does not have) expands fewer
    placeholders than the tower gives features: found when the vision tower has run, before the
    language model; nothing kept."""
    small = tiny_vlm_processor(image_size=16)
    session = Session(vlm, small.tokenizer, processor=small)
    refused(session, [PH("chart", image=image), PF("\nSo?")], "the vision tower takes 32x32", vlm)
    cls = tiny_vlm_processor()
    cls.vision_feature_select_strategy = "default"
    session = Session(vlm, cls.tokenizer, processor=cls)
    with Calls(language(vlm)) as calls, pytest.raises(ValueError, match="processor does not match the model"):
        session.run_turn("a", [PH("chart", image=image), PF("\nSo?")], max_new_tokens=2)
    assert calls.n == 0 and session.slots == {}


def test_corrupt_and_missing_image_files(vlm, processor, tmp_path):
    bad = tmp_path / "chart.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    session = Session(vlm, processor.tokenizer, processor=processor)
    refused(session, [PH("chart", image=str(bad)), PF("\nSo?")], "could not read image file", vlm)
    refused(session, [PH("chart", image=tmp_path / "none.png"), PF("\nSo?")], "no image file", vlm)
    refused(session, [PH("chart", image=42), PF("\nSo?")], "image must be a PIL.Image", vlm, TypeError)


def test_an_image_over_the_pixel_limit_is_refused_before_decoding(vlm, processor, tmp_path, monkeypatch):
    """Issue 52 (inputs): a 20000x20000 PNG (a decompression bomb) is refused from its header, naming
    the file, its size and the limit; ``HF_KVSHARE_MAX_IMAGE_PIXELS`` moves the limit both ways."""
    from vision_helpers import bomb_png

    from hf_kvshare.vision import MAX_PIXELS_ENV, ImageTooLarge

    bomb = bomb_png(tmp_path / "bomb.png")
    session = Session(vlm, processor.tokenizer, processor=processor)
    message = (
        r"PH 'chart': image file '.*bomb\.png' is 400,000,000 pixels, over the limit of 89,478,485 pixels"
    )
    refused(session, [PH("chart", image=bomb), PF("\nSo?")], message, vlm, ImageTooLarge)
    refused(session, [PH("clip", video=[str(bomb)]), PF("\nSo?")], "400,000,000 pixels", vlm, ImageTooLarge)
    bomb = bomb_png(tmp_path / "warned.png", 10000, 10000)  # over Pillow's limit, under twice it (a warning)
    message = r"is 10000x10000 = 100,000,000 pixels, over the limit of 89,478,485 pixels \(refused before"
    refused(session, [PH("chart", image=bomb), PF("\nSo?")], message, vlm, ImageTooLarge)
    random_image(0).save(tmp_path / "small.png")  # 50 x 40 = 2,000 pixels
    monkeypatch.setenv(MAX_PIXELS_ENV, "1999")
    refused(session, [PH("chart", image=tmp_path / "small.png"), PF("\nSo?")], "limit of 1,999 pixels", vlm)
    refused(
        session, [PH("chart", image=random_image(0)), PF("\nSo?")], "50x40 = 2,000 pixels", vlm, ImageTooLarge
    )
    monkeypatch.setenv(MAX_PIXELS_ENV, "lots")
    refused(session, [PH("chart", image=tmp_path / "small.png"), PF("\nSo?")], "must be a positive", vlm)
    monkeypatch.setenv(MAX_PIXELS_ENV, "2000")
    session.run_turn("a", [PH("chart", image=tmp_path / "small.png"), PF("\nSo?")], max_new_tokens=1)


def test_processed_pixel_values_must_be_finite_and_whole(vlm, processor, image):
    """Issue 52 (inputs): NaN / infinite pixel values, fewer patches than the image's size takes (one
    patch of five) and an impossible ``image_sizes`` are refused before the vision tower runs."""
    batch = dict(processor(images=image, text="<image>", return_tensors="pt", add_special_tokens=False))
    session = Session(vlm, processor.tokenizer, processor=processor)
    for value in (float("nan"), float("inf")):
        poisoned = batch["pixel_values"].clone()
        poisoned[0, 1, 0, 3, 4] = value
        bad = {**batch, "pixel_values": poisoned}
        refused(
            session, [PH("chart", image=bad), PF("\nSo?")], "must be finite; 1 of .* NaN or infinite", vlm
        )
    one_patch = {**batch, "pixel_values": batch["pixel_values"][:, :1]}
    one_patch.pop("input_ids"), one_patch.pop("attention_mask")
    refused(session, [PH("chart", image=one_patch), PF("\nSo?")], r"takes 5 patches.*has 1", vlm)
    for sizes in ([[0, 40]], [[-40, 50]], [[10**6, 10**6]], [[40.5, 50.0]]):
        bad = {"pixel_values": batch["pixel_values"], "image_sizes": torch.tensor(sizes)}
        refused(session, [PH("chart", image=bad), PF("\nSo?")], "image_sizes", vlm)
    frames = torch.full((1, 2, 3, 32, 32), float("nan"))
    refused(session, [PH("clip", video={"pixel_values_videos": frames}), PF("\nSo?")], "finite", vlm)


def test_video_with_zero_frames(vlm, processor):
    with pytest.raises(ValueError, match="at least one frame; got an empty list"):
        PH("clip", video=[])
    session = Session(vlm, processor.tokenizer, processor=processor)
    empty = {"pixel_values_videos": torch.zeros(1, 0, 3, 32, 32)}
    refused(session, [PH("clip", video=empty), PF("\nSo?")], "a video needs at least one frame", vlm)
    # frames without a video processor (none without torchvision) are prepared in PIL: each must be an image
    frames = [random_image(0), "not a frame"]
    refused(session, [PH("clip", video=frames), PF("\nSo?")], "no image file at 'not a frame'", vlm)
    refused(
        session, [PH("clip", video=[random_image(0), object()]), PF("\nSo?")], "frame 1 is not an image", vlm
    )


def test_pixel_values_on_the_wrong_dtype_or_device(vlm, processor, image):
    batch = dict(processor(images=image, text="<image>", return_tensors="pt", add_special_tokens=False))
    session = Session(vlm, processor.tokenizer, processor=processor)
    wrong_dtype = {**batch, "pixel_values": batch["pixel_values"].double()}
    refused(
        session,
        [PH("chart", image=wrong_dtype), PF("\nSo?")],
        "torch.float32 on cpu .* got torch.float64",
        vlm,
    )
    wrong_device = {**batch, "pixel_values": batch["pixel_values"].to("meta")}
    refused(
        session, [PH("chart", image=wrong_device), PF("\nSo?")], "on cpu .* got torch.float32 on meta", vlm
    )


def test_other_bad_image_segments(vlm, processor, image):
    with pytest.raises(ValueError, match="give one of text, image or video"):
        PH("chart", "text", image=image)
    session = Session(vlm, processor.tokenizer, processor=processor)
    refused(session, [PF("See.\n"), PH("chart", image=image)], "ends with the image segment", vlm)
    session.run_turn("a", [PH("chart", image=image), PF("\nSo?")], max_new_tokens=2)
    refused(session, [PH("chart", image=random_image(5)), PF("\nSo?")], "already holds another image", vlm)
    refused(session, [PH("chart", "some text"), PF("\nSo?")], "holds an image in this session; got text", vlm)
    refused(session, [PH("a", image=image), PF("\nSo?")], "holds text in this session; got an image", vlm)


def test_readme_vision_example_runs(vlm, processor, image, tmp_path, monkeypatch):
    """The README's image example, as written but for the hub model: the tiny VLM and its processor."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "image=Image.open" in b)
    lines = block.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("model = "):
            lines[i] = "model = _model"
        elif line.startswith("processor = "):
            lines[i] = "processor = _processor"
    image.save(tmp_path / "chart.png")
    monkeypatch.chdir(tmp_path)
    namespace = {"_model": vlm, "_processor": processor}
    exec(compile("\n".join(lines), "README.md (images)", "exec"), namespace)
    s, r = namespace["s"], namespace["r"]
    assert s.slots["chart"].visual.encodes == 1 and r.output_ids.numel() >= 1
    assert s.slots["question"].kind == "question"


def test_held_bytes_count_the_image(vlm, processor, image):
    session, _ = run_request(vlm, processor, "nonshared", image, new_tokens=2)
    visual = session.slots["chart"].visual
    pixels = visual.pixel_values.numel() * 4
    features = visual.features(vlm).numel() * 4
    assert visual.nbytes == pixels + features and session.held_bytes() >= visual.nbytes


def test_batch_of_rows_with_an_image(vlm, processor, image):
    """build_cache(batch_size=2): the image's features widened to both rows, as the ids are."""
    session = Session(vlm, processor.tokenizer, processor=processor)
    segments = [PF("See.\n"), PH("chart", image=image), PF("\nSo?")]
    cache, ids = session.build_cache("a", segments, batch_size=2)
    single, _ = Session(vlm, processor.tokenizer, processor=processor).build_cache("a", segments)
    assert ids.shape[0] == 2
    for layer in range(cache.num_layers):
        k = cache.extract(0, ids.shape[1] - 1).keys[layer]
        assert torch.allclose(k[0], k[1]) and torch.allclose(
            k[:1], single.extract(0, ids.shape[1] - 1).keys[layer]
        )


def test_prompt_longer_than_the_language_model_is_refused(vlm, processor, image):
    session = Session(vlm, processor.tokenizer, processor=processor)
    limit = vlm.config.get_text_config().max_position_embeddings
    long = [PF("word " * limit), PH("chart", image=image), PF("\nSo?")]
    refused(session, long, "max_position_embeddings", vlm)


def test_gemma3_vlm_is_refused_with_the_reason(processor, image):
    """Gemma 3's image tokens attend to each other bidirectionally: not the causal masks built here,
    so its images are refused clearly before any model work (not silently computed causally)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=49216,
            sliding_window=16,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
        image_token_index=processor.image_token_id,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    session = Session(model, processor.tokenizer, processor=processor)
    with pytest.raises(ValueError, match="gemma3 model .*bidirectionally"):
        session.run_turn("a", [PF("x"), PH("c", image=image), PF("?")])
    assert not session.slots and not session.turns
    # why: the model's own forward, given token_type_ids (as its processor and generate give them),
    # lets the image tokens see each other; a causal forward (the position-built masks here, which
    # the model applies as given) computes other image K/V. Should this ever be equal, Gemma 3
    # could be supported as the other 1D-RoPE families are.
    image_id = processor.image_token_id
    ids = torch.tensor([[5, 6, 7] + [image_id] * 4 + [8, 9]])
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        block = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == image_id).long()).logits
        causal = model(input_ids=ids, pixel_values=pixels).logits
    assert (block[0, 3] - causal[0, 3]).abs().max() > 1e-3  # the first image token sees the later ones

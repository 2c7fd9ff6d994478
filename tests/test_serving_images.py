"""Images on the server (issue 50, item 5): each image of a vision-language request is a PH span found
by vLLM's multimodal hash (``Request.mm_features``), never by its placeholder token ids, and shared
across the task's agents as the Python API shares ``PH(slot, image=...)``.

Fast lane: the layout's image spans (the hash -> slot mapping, two different images never one slot, a
repeated image one slot, the placeholders invisible to the text layout), the served / refused families,
and FullShared through the serving contract on a tiny random LLaVA-OneVision against the Session, with
an HF stand-in for vLLM that feeds the image's features as vLLM does. The serving lane (marker
``serving``) serves the tiny LLaVA-OneVision folder on vLLM's CPU wheel where vLLM can load the family.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from tiny import random_image, tiny_vlm, tiny_vlm_processor, tiny_vlm_tokenizer

from hf_kvshare import PF, PH, Session
from hf_kvshare._compat import cache_kwargs
from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.host import (
    NO_KV_KEPT,
    REFUSED_VISION_MODELS,
    EngineImage,
    ServingError,
    Sharing,
    check_serving_vision,
    skeleton_model,
)
from hf_kvshare.vision import prepare_visual

SYS = "You look closely."
Q1 = "\nWhat is it?"
Q2 = "\nColours:"
IMAGE = 49152  # the tiny tokenizer's <image>


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def image_entry(hash_, start, n, modality="image"):
    return {"hash": hash_, "start": start, "end": start + n, "modality": modality}


def params(task, agent, images, segments=None):
    raw = {"task": task, "agent": agent, lay.IMAGES: images}
    if segments is not None:
        raw["segments"] = segments
    return {lay.KEY: raw}


# ------------------------------------------------------------------ the layout's image spans (no model)
def test_images_of_reads_vllms_features_by_hash_and_place():
    position = SimpleNamespace(offset=3, length=5)
    features = [
        SimpleNamespace(modality="image", identifier="abc", mm_hash="abc", mm_position=position),
        SimpleNamespace(modality="audio", identifier="snd", mm_hash="snd", mm_position=position),
        SimpleNamespace(
            modality="video", identifier="", mm_hash="vid", mm_position=SimpleNamespace(offset=9, length=2)
        ),
    ]
    assert lay.images_of(features) == [image_entry("abc", 3, 5), image_entry("vid", 9, 2, "video")]
    assert lay.images_of(None) == []


def test_an_image_is_one_slot_per_hash_and_never_text(tokenizer):
    tokens = lay.TokenInfo(tokenizer)
    text = ids_of(tokenizer, "Look at this picture of the harbour at dawn, with its boats and cranes.")
    pic = [IMAGE] * 8
    prompt = text + pic + text + pic
    request = lay.parse(
        params("t", "a", [image_entry("h1", len(text), 8), image_entry("h2", 2 * len(text) + 8, 8)])
    )
    resolved = lay.resolve(request, prompt, tokens, known={})
    images = [s for s in resolved.segments if s.image is not None]
    # two images with the same placeholder ids: two slots, each named by its own hash
    assert [s.slot for s in images] == ["image:h1", "image:h2"]
    assert [(s.start, s.end, s.kind) for s in images] == [(len(text), len(text) + 8, "observation")] + [
        (2 * len(text) + 8, 2 * len(text) + 16, "observation")
    ]
    # the text layout never reads the placeholders: a held image slot's ids (and a text slot made of
    # placeholder ids) match nothing; the held text is found, the image spans stay the images'
    known = {"image:h0": pic, "a.m0": text}
    again = lay.resolve(request, prompt, tokens, known=known)
    text_spans = [s for s in again.segments if s.image is None]
    assert all(not (s.start < i.end and i.start < s.end) for s in text_spans for i in request.images)
    # (a source's tokens are matched once: the second copy is a new slot of its own)
    assert [(s.slot, s.new) for s in text_spans] == [("a.m0", False), ("a.m1", True)]
    # the same image in another request of the task is the same slot
    other = lay.resolve(
        lay.parse(params("t", "b", [image_entry("h1", 0, 8)])), pic + text, tokens, known=known
    )
    assert [s.slot for s in other.segments if s.image is not None] == ["image:h1"]


def test_explicit_layouts_and_images(tokenizer):
    tokens = lay.TokenInfo(tokenizer)
    doc = ids_of(tokenizer, "A short report on the harbour.")
    prompt = doc + [IMAGE] * 4 + doc
    images = [image_entry("h1", len(doc), 4)]
    # a text segment is found around the image, the image span merged in prompt order
    resolved = lay.resolve(
        lay.parse(params("t", "a", images, [{"slot": "doc", "text": "A short report on the harbour."}])),
        prompt,
        tokens,
        known={},
    )
    assert [(s.slot, s.start) for s in resolved.segments] == [("doc", 0), ("image:h1", len(doc))]
    # positions that overlap an image are refused
    with pytest.raises(lay.LayoutError, match="overlaps an image"):
        lay.resolve(
            lay.parse(params("t", "a", images, [{"slot": "x", "start": 1, "end": len(doc) + 2}])),
            prompt,
            tokens,
            known={},
        )
    # a client cannot name an image's slot
    with pytest.raises(lay.LayoutError, match="server's"):
        lay.parse({lay.KEY: {"segments": [{"slot": "image:h1", "start": 0, "end": 2}]}})


@pytest.mark.parametrize(
    "images, message",
    [
        ("x", "must be a list"),
        ([{"hash": "", "start": 0, "end": 2}], "non-empty string"),
        ([{"hash": "h", "start": 2, "end": 2}], "token positions"),
        ([{"hash": "h", "start": 0, "end": 2, "modality": "audio"}], "modality"),
        ([image_entry("a", 0, 4), image_entry("b", 2, 4)], "overlap"),
    ],
)
def test_bad_image_entries_are_refused(images, message):
    with pytest.raises(lay.LayoutError, match=message):
        lay.parse({lay.KEY: {lay.IMAGES: images}})


def test_an_image_beyond_the_prompt_is_refused(tokenizer):
    request = lay.parse(params("t", "a", [image_entry("h", 2, 8)]))
    with pytest.raises(lay.LayoutError, match="beyond the prompt"):
        lay.resolve(request, [5, 6, 7], lay.TokenInfo(tokenizer), known={})


def test_images_are_the_servers_to_state(tokenizer):
    from hf_kvshare.serving.middleware import LayoutCheck

    model = tiny_vlm()
    sharing = Sharing(model, tiny_vlm_tokenizer(), "fullshared")
    client = {lay.KEY: {"task": "t", lay.IMAGES: [image_entry("forged", 0, 4)]}}
    admitted = sharing.admit(client, sharing.salt, images=[image_entry("real", 2, 4)])
    assert admitted[lay.KEY][lay.IMAGES] == [image_entry("real", 2, 4)]
    assert lay.IMAGES not in sharing.admit(client, sharing.salt)[lay.KEY]
    check = LayoutCheck(app=None)
    check.method, check.salt, check._tokens = "fullshared", sharing.salt, lay.TokenInfo(tokenizer)
    with pytest.raises(lay.LayoutError, match="set by the server"):
        check.check({"prompt": "hi", "kv_transfer_params": client}, "/v1/completions")
    # a chat request with an image part: its token positions are vLLM's (the image expanded), checked
    # when the request is planned, not here
    chat = {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        "kv_transfer_params": {lay.KEY: {"segments": [{"slot": "q", "start": 500, "end": 600}]}},
    }
    check.check(chat, "/v1/chat/completions")


# ------------------------------------------------------------------ families
def test_llava_onevision_is_served_and_mrope_families_are_refused_with_the_reason(tmp_path):
    tiny_vlm().config.save_pretrained(tmp_path)
    skeleton = skeleton_model(tmp_path)  # the VLM on meta, its rotary module on CPU
    Sharing(skeleton, tiny_vlm_tokenizer(), "fullshared")
    for family in ("qwen2_vl", "qwen2_5_vl"):
        with pytest.raises(ServingError, match="multimodal RoPE") as refused:
            check_serving_vision(family)
        assert "Session" in str(refused.value) and "llava_onevision" in str(refused.value)
    assert set(REFUSED_VISION_MODELS) >= {"qwen2_vl", "qwen2_5_vl"}
    with pytest.raises(ServingError, match="bidirectionally"):
        check_serving_vision("gemma3")
    with pytest.raises(ServingError, match="not built for serving"):
        check_serving_vision("some_new_vlm")


# ------------------------------------------------------------------ FullShared through the contract
def engine_with_images(model, plan, images, max_new_tokens=8):
    """vLLM with images, in HF: the claimed K/V written (no prefix-cache hit here), every other token
    computed from input embeddings with each image's features over its placeholders (``images``:
    start -> :class:`hf_kvshare.vision.Visual`); greedy, stopping after EOS. Returns the output ids and
    the K/V used (``[layers, n, kv_heads, head_dim]``), as :func:`hf_kvshare.serving.standin.engine`."""
    from transformers import DynamicCache

    assert plan.local_hit == 0
    ids = torch.tensor(plan.prompt)
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)[None].clone()
        for start, visual in images.items():
            embeds[:, start : start + visual.length] = visual.embeds(model)
        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(plan.keys, plan.values)):
            cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], layer)
        logits = model(
            inputs_embeds=embeds[:, plan.claim_end :], use_cache=True, **cache_kwargs(cache)
        ).logits
        out = []
        while True:
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token == eos or len(out) == max_new_tokens:
                break
            logits = model(input_ids=torch.tensor([[token]]), use_cache=True, **cache_kwargs(cache)).logits
    keys = torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers])
    values = torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers])
    return out, keys, values


def test_fullshared_shares_an_image_by_its_hash_as_the_session_does():
    model, processor = tiny_vlm(), tiny_vlm_processor()
    tok = processor.tokenizer
    image, other_image = random_image(0), random_image(1)
    sys1, q1, q2 = ids_of(tok, SYS), ids_of(tok, Q1), ids_of(tok, Q2)
    visual = prepare_visual(model, processor, PH("img", image=image))
    other = prepare_visual(model, processor, PH("img2", image=other_image))
    pic = visual.token_ids.tolist()
    n = len(pic)
    assert other.token_ids.tolist() == pic  # two images, the same placeholder ids

    session = Session(model, tok, processor=processor, method="fullshared")
    hf1 = session.run_turn("a1", [PF(SYS), PH("img", image=image), PF(Q1)], max_new_tokens=8)
    hf2 = session.run_turn("a2", [PH("img"), PF(Q2)], max_new_tokens=8)

    sharing = Sharing(model, tok, "fullshared")
    p1 = sharing.plan("r1", sys1 + pic + q1, params("t", "a1", [image_entry("h0", len(sys1), n)]), 0)
    assert p1.error is None and p1.claimed == 0  # the first agent computes the image
    out1, k, v = engine_with_images(model, p1, {len(sys1): visual})
    assert out1 == hf1.output_ids.tolist()
    sharing.record(p1, k, v, out1, set())
    host = sharing.hosts["t"]
    slot = host.slots["image:h0"]
    assert isinstance(slot.visual, EngineImage) and slot.kind == "observation" and slot.latest is not None

    # the second agent reads the same image (the same hash) elsewhere: its K/V re-positioned, supplied
    p2 = sharing.plan("r2", pic + q2, params("t", "a2", [image_entry("h0", 0, n)]), 0)
    assert (p2.claim_start, p2.claim_end) == (0, n), p2.report()
    report = p2.report()
    assert report["supplied_ph_tokens"] == n == report["ph_tokens"]
    out2, k, v = engine_with_images(model, p2, {0: visual})
    assert out2 == hf2.output_ids.tolist()
    sharing.record(p2, k, v, out2, set())
    assert [name for name in host.slots if lay.is_image_slot(name)] == [
        "image:h0"
    ]  # a repeated image: one slot

    # another image with the same placeholder ids (another hash) never reads the first one's K/V
    p3 = sharing.plan("r3", pic + q2, params("t", "a3", [image_entry("h1", 0, n)]), 0)
    assert p3.claimed == 0 and p3.placements[0] is None and p3.unplaced["image:h1"] == NO_KV_KEPT
    out3, k, v = engine_with_images(model, p3, {0: other})
    sharing.record(p3, k, v, out3, set())
    assert {name for name in host.slots if lay.is_image_slot(name)} == {"image:h0", "image:h1"}
    assert not torch.equal(host.slots["image:h0"].latest.keys[0], host.slots["image:h1"].latest.keys[0])


def test_nonshared_with_an_image_is_plain():
    """Exact mode with an image: the same request again claims the K/V the engine computed and gives
    its tokens (the image's K/V recorded under its hash, written back at the same place)."""
    model, processor = tiny_vlm(), tiny_vlm_processor()
    tok = processor.tokenizer
    visual = prepare_visual(model, processor, PH("img", image=random_image(0)))
    pic, sys1, q1 = visual.token_ids.tolist(), ids_of(tok, SYS), ids_of(tok, Q1)
    prompt, images = sys1 + pic + q1, [image_entry("h0", len(sys1), len(pic))]
    sharing = Sharing(model, tok, "fullshared", prefix_reuse=True)
    p1 = sharing.plan("r1", prompt, params("t", "a1", images), 0)
    plain, k, v = engine_with_images(model, p1, {len(sys1): visual})
    sharing.record(p1, k, v, plain, set())
    p2 = sharing.plan("r2", prompt, params("t", "a1", images), 0)
    assert p2.claim_end >= len(sys1) + len(pic), p2.report()
    again, _, _ = engine_with_images(model, p2, {len(sys1): visual})
    assert again == plain


def test_kvcmas_reads_an_image_slot_through_the_same_contract():
    """KVCMAS gates an image's slot as any observation's (its pools keyed by the image's hash): every
    request planned and recorded without error, each unplaced image span with the gate's reason."""
    model, processor = tiny_vlm(), tiny_vlm_processor()
    tok = processor.tokenizer
    visual = prepare_visual(model, processor, PH("img", image=random_image(0)))
    pic, q1, q2 = visual.token_ids.tolist(), ids_of(tok, Q1), ids_of(tok, Q2)
    sharing = Sharing(model, tok, "kvcmas")
    for i, (agent, lead) in enumerate([("a1", ids_of(tok, SYS)), ("a2", []), ("a3", q1)]):
        plan = sharing.plan(
            f"r{i}", lead + pic + q2, params("t", agent, [image_entry("h0", len(lead), len(pic))]), 0
        )
        assert plan.error is None, plan.error
        out, k, v = engine_with_images(model, plan, {len(lead): visual})
        sharing.record(plan, k, v, out, set())
        assert plan.error is None, plan.error
        image = next(s for s in plan.report()["segments"] if s["name"] == "image:h0")
        assert image["placed"] or image["gate"]["reason"], image
    assert sharing.hosts["t"].slots["image:h0"].latest is not None and sharing.errors == 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the scheduler side imports vLLM")
def test_the_scheduler_side_states_the_images_vllm_placed():
    """vLLM's own feature class (``MultiModalFeatureSpec``, ``PlaceholderRange``) read by the scheduler
    side: each image's place and hash under the server's key of the layout the request is planned under."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler

    model = tiny_vlm()
    sharing = Sharing(model, tiny_vlm_tokenizer(), "fullshared")
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
        cache_config=SimpleNamespace(block_size=16),
    )
    scheduler = HFKVShareScheduler(config, sharing)
    try:
        feature = MultiModalFeatureSpec(
            data=None, modality="image", identifier="h0", mm_position=PlaceholderRange(offset=3, length=5)
        )
        request = SimpleNamespace(
            kv_transfer_params={lay.KEY: {"task": "t"}}, cache_salt=sharing.salt, mm_features=[feature]
        )
        admitted = scheduler._admitted(request)
        assert admitted[lay.KEY][lay.IMAGES] == [image_entry("h0", 3, 5)]
        assert lay.parse(admitted).images == [lay.ImageSpan("h0", 3, 8)]
    finally:
        scheduler.shutdown()


# ------------------------------------------------------------------ the serving lane
def _vllm_cannot_serve(folder) -> str | None:
    """Why vLLM here cannot serve the LLaVA-OneVision ``folder`` (``None``: it can). vLLM 0.32's CPU
    wheel: its model module imports transformers' Pixtral image processor, which needs torchvision
    (removed from the serving venv: it breaks ``import vllm`` on CPU), and the folder's processor needs a
    video processor, which needs torchvision too."""
    try:
        importlib.import_module("vllm.model_executor.models.llava_onevision")
    except Exception as error:  # noqa: BLE001 - the reason is the skip's
        return f"vLLM cannot import its LLaVA-OneVision model here ({type(error).__name__}: {error})"
    from transformers import AutoProcessor

    try:
        AutoProcessor.from_pretrained(str(folder))
    except Exception as error:  # noqa: BLE001 - the reason is the skip's
        return f"the LLaVA-OneVision processor does not load here ({type(error).__name__}: {error})"
    return None


@pytest.mark.serving
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")
def test_serving_the_tiny_llava_onevision_shares_its_image(tmp_path):
    import base64
    import io
    import json
    import os
    import urllib.request

    from tiny import save_tiny_vlm

    from hf_kvshare.serving.server import Server

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    folder = save_tiny_vlm(tmp_path / "llava")
    why = _vllm_cannot_serve(folder)
    if why is not None:
        pytest.skip(why)
    buffer = io.BytesIO()
    random_image(0).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    args = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "2", "--enforce-eager"]
    args += ["--limit-mm-per-prompt", json.dumps({"image": 2, "video": 0})]

    def chat(srv, agent, text, method=None, image=True):
        layout = {"task": "t", "agent": agent, **({"method": method} if method else {})}
        parts = [{"type": "image_url", "image_url": {"url": url}}] if image else []
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
        body = {"model": srv.model_dir, "messages": messages, "max_tokens": 8, "temperature": 0}
        body |= {"return_token_ids": True, "kv_transfer_params": {lay.KEY: layout}}
        request = urllib.request.Request(
            f"http://127.0.0.1:{srv.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            out = json.loads(reply.read())
        return out["choices"][0]["token_ids"], (out.get("kv_transfer_params") or {}).get(lay.KEY)

    with Server(
        folder, "fullshared", {"prefix_reuse": True}, vllm_args=args, log=tmp_path / "vllm.log"
    ) as srv:
        srv.wait_ready(timeout=480)
        plain, _ = chat(srv, "a1", Q1, method="nonshared")
        first, report = chat(srv, "a1", Q1)
        assert first == plain and report["supplied_tokens"] == 0  # exact: the first agent computes all
        chat(srv, "a2", "Hello.", image=False)  # a2's own leading text (the template's) kept: prefix_reuse
        _, report = chat(srv, "a2", Q2)
        images = [s for s in report["segments"] if s["name"].startswith("image:")]
        # the image a1's request computed, found by its hash: placed for a2 (FullShared, re-positioned)
        assert len(images) == 1 and images[0]["placed"], report
        print(
            "image supplied to a2:",
            images[0]["supplied"],
            "supplied_ph_tokens:",
            report["supplied_ph_tokens"],
        )

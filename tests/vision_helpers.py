"""Helpers the image tests share (tests/test_vision.py, test_vision_tiled.py, test_vision_mrope.py): a
MathVista-like three-agent request over one image, running it through a Session, plain ``generate``
for reference, comparing K/V, and the checks every image family passes alike. The tiny models and
processors themselves live in tiny.py."""

from __future__ import annotations

import pytest
import torch

from hf_kvshare import PF, PH, Session
from hf_kvshare.methods.cacheblend import CacheBlend

QUESTION = "How many red bars are there?"


class Calls:
    """Counts a module's forward calls (a public forward hook)."""

    def __init__(self, module):
        self.n = 0
        self.handle = module.register_forward_hook(self.hook)

    def hook(self, *_):
        self.n += 1

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.handle.remove()


def agents(image):
    """A MathVista-like request: two solvers read the image and the question, a reflector reads both
    and the solvers' answers."""
    img = PH("chart", image=image)
    return [
        ("solver", [PF("You solve.\n"), img, PF("\n"), PH("question", QUESTION), PF("\nAnswer:")]),
        ("checker", [PF("You check.\n"), PH("chart"), PF("\n"), PH("question"), PF("\nAnswer:")]),
        (
            "reflector",
            [
                PF("You reflect.\n"),
                PH("chart"),
                PF("\nQ: "),
                PH("question"),
                PF("\nA1: "),
                PH("solver"),
                PF("\nA2: "),
                PH("checker"),
                PF("\nFinal:"),
            ],
        ),
    ]


def run_request(model, processor, method, image, new_tokens=5, forced=None, keep_cache=False, layout=agents):
    """One request (``layout(image)``: the agents' turns) in a fresh Session; ``forced``: each turn's
    output to teacher-force instead of generating ``new_tokens``."""
    session = Session(model, processor.tokenizer, method, processor=processor)
    results = []
    for i, (agent, segments) in enumerate(layout(image)):
        kwargs = {"force_output": forced[i]} if forced is not None else {"max_new_tokens": new_tokens}
        results.append(session.run_turn(agent, segments, keep_cache=keep_cache, **kwargs))
    return session, results


def plain_generate(model, ids, pixels, new_tokens, **inputs):
    """Plain greedy ``generate`` over the prompt ``ids`` with the processor's ``pixels``: the new ids."""
    with torch.no_grad():
        out = model.generate(
            input_ids=ids[None], **pixels, **inputs, max_new_tokens=new_tokens, do_sample=False
        )
    return out[0, ids.numel() :]


def strip(ids, model):
    """``ids`` as a list without trailing EOS / pad ids (as the session returns an output)."""
    stop = {model.generation_config.eos_token_id, model.generation_config.pad_token_id}
    ids = ids.tolist()
    while len(ids) > 1 and ids[-1] in stop:
        ids.pop()
    return ids


def kv_error(cache, exact, start, end):
    """The largest absolute K or V difference between two caches over ``[start, end)``."""
    a, b = cache.extract(start, end), exact.extract(start, end)
    return max(
        max((x - y).abs().max().item() for x, y in zip(a.keys, b.keys)),
        max((x - y).abs().max().item() for x, y in zip(a.values, b.values)),
    )


def vision_tower(model):
    """The vision tower of a tiny VLM (LLaVA-OneVision: ``vision_tower``; Idefics3, SmolVLM:
    ``vision_model``), or ``None`` for a text-only model."""
    inner = getattr(model, "model", None)
    for name in ("vision_tower", "vision_model"):
        if getattr(inner, name, None) is not None:
            return getattr(inner, name)
    return None


def refused(session, segments, match, model, exc=ValueError):
    """The turn is refused with ``match`` before any model work (no forward of the model or of its
    vision tower); nothing in the session changes."""
    slots = dict(session.slots)
    modules = [model] + [m for m in [vision_tower(model)] if m is not None]
    counters = [Calls(m) for m in modules]  # the language model's and the vision tower's forwards
    try:
        with pytest.raises(exc, match=match):
            session.run_turn("z", segments, max_new_tokens=2)
    finally:
        for c in counters:
            c.handle.remove()
    assert [c.n for c in counters] == [0] * len(modules)
    assert session.slots == slots


# ------------------------------------------------------------- checks every image family passes alike
def assert_fullshared_exact_at_the_same_positions(model, processor, image, before="You solve.\n", after="\n"):
    """The same prefix before the image in both agents (``before`` / ``after`` the image: the family's
    markers): FullShared's reused image K/V is the exact K/V, so its second agent equals NonShared's
    token for token."""

    def request(method):
        session = Session(model, processor.tokenizer, method, processor=processor)
        head = [PF(before), PH("chart", image=image), PF(after)]
        session.run_turn("a", [*head, PF("Colours?")], max_new_tokens=6)
        return session.run_turn("b", [*head, PF("Bars?")], max_new_tokens=6, keep_cache=True)

    exact, shared = request("nonshared"), request("fullshared")
    assert shared.output_ids.tolist() == exact.output_ids.tolist()
    seg = shared.cache.segment("chart")
    assert seg.provenance == "reused" and shared.tokens_reused == seg.length
    assert kv_error(shared.cache, exact.cache, seg.start, seg.end) < 1e-5


def assert_full_recomputation_equals_nonshared(model, processor, image, layout=agents):
    """CacheBlend at rho = 0 recomputes every image token: the request's outputs are NonShared's."""
    _, exact = run_request(model, processor, "nonshared", image, layout=layout)
    _, got = run_request(model, processor, CacheBlend(rho=0.0), image, layout=layout)
    assert [t.output_ids.tolist() for t in got] == [t.output_ids.tolist() for t in exact]
    assert got[1].tokens_recomputed > 0


def bomb_png(path, width: int = 20000, height: int = 20000):
    """A PNG whose header claims ``width`` x ``height`` grayscale pixels (a decompression bomb's size)
    over a few bytes of data: only a reader that decodes before checking the size would notice the rest
    is missing."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    data = zlib.compress(b"\0" * (width + 1) * 4)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )
    return path

"""Saving and loading a method's cross-request state (issue 13, item 9): safetensors + JSON, no
pickle, a model fingerprint checked on load, and a restored instance that continues exactly as the
original would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from hf_kvshare import METHODS, PF, PH, Session
from hf_kvshare.identity import model_fingerprint
from hf_kvshare.persistence import CHECKSUM, state_checksum

AGENTS = ["planner", "designer", "coder"]
QUERIES = [
    "Sort a list of numbers and explain the complexity of the algorithm.",
    "Compute the sum of all prime numbers below fifty, step by step.",
    "Write a short poem about the sea, the moon and a lighthouse.",
    "Explain how a hash table handles collisions, with an example.",
    "List three differences between a process and a thread.",
]


def segments(i: int, query: str | None):
    out = [PF(f"You are the {AGENTS[i]}; role number {i}.\n"), PH("query", query)]
    for earlier in AGENTS[:i]:
        out += [PF(f"\nNotes from the {earlier}: "), PH(earlier)]
    return out + [PF("\nAnswer:")]


def request(model, tok, method, query):
    """(output ids, provenance and gate report of every segment) of each turn of one request."""
    session = Session(model, tok, method)
    got = []
    for i, agent in enumerate(AGENTS):
        r = session.run_turn(agent, segments(i, query), max_new_tokens=3)
        got.append(
            (
                r.output_ids.tolist(),
                [(s.name, s.provenance, s.source_agent, dict(s.info)) for s in r.segments],
            )
        )
    return got


def read_saved(directory):
    """(header, tensors) of a saved state, as written."""
    from safetensors.torch import load_file

    return json.loads((directory / "state.json").read_text()), load_file(str(directory / "state.safetensors"))


def write_saved(directory, header, tensors, reseal=True):
    """Write a state's files as given. ``reseal``: with a checksum computed over them (what a forger
    who recomputes the sha256 writes: the checks behind the checksum must refuse it); else as format
    1, written before checksums existed (no checksum in either file)."""
    from safetensors.torch import save_file

    header = {k: v for k, v in header.items() if k != CHECKSUM}
    if reseal:
        header[CHECKSUM] = state_checksum(header, tensors)
        save_file(tensors, str(directory / "state.safetensors"), metadata={CHECKSUM: header[CHECKSUM]})
    else:
        header["format"] = 1
        save_file(tensors, str(directory / "state.safetensors"))
    (directory / "state.json").write_text(json.dumps(header))


STATEFUL = {
    "kvcmas": dict(tau=1.0, capacity=2),  # accepts what it can and evicts within 5 requests
    "kvcmas-default": dict(),
    "kvcomm": dict(tau=1.0, capacity=2),
    "kvcmas-nonchained": dict(tau=1.0),
    "graphflow": dict(calibration_requests=4),  # saved while calibrating, frozen after
}


@pytest.mark.parametrize("tag", list(STATEFUL))
def test_a_loaded_instance_continues_exactly_as_the_original(tiny_llama, tokenizer, tmp_path, tag):
    name = tag.removesuffix("-default")
    original = METHODS[name](**STATEFUL[tag])
    for query in QUERIES[:3]:
        request(tiny_llama, tokenizer, original, query)
    assert original.state_bytes() > 0
    original.save_state(tmp_path / "state")
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["state.json", "state.safetensors"]
    restored = METHODS[name](**STATEFUL[tag])
    restored.load_state(tmp_path / "state")  # not bound yet: the fingerprint is checked on attach
    assert restored.state_bytes() == original.state_bytes()
    saved, _ = original.export_state()
    loaded, _ = restored.export_state()
    assert saved.keys() == loaded.keys()
    assert all(saved[k].dtype == loaded[k].dtype and torch.equal(saved[k], loaded[k]) for k in saved)
    gates = set()
    for query in QUERIES[3:]:
        expected = request(tiny_llama, tokenizer, original, query)
        assert request(tiny_llama, tokenizer, restored, query) == expected
        assert restored.state_bytes() == original.state_bytes()
        gates |= {info.get("gate") for turn in expected for _, _, _, info in turn[1]}
    if name == "graphflow":
        assert "profile" in gates  # the saved calibration froze and was applied
    elif tag != "kvcmas-default":
        assert "accepted" in gates or "ungated" in gates


def test_another_model_is_refused(tiny_llama, tokenizer, tmp_path):
    method = METHODS["kvcmas"](tau=1.0)
    request(tiny_llama, tokenizer, method, QUERIES[0])
    method.save_state(tmp_path)
    same_shape = tiny_model("llama", seed=1)  # same config, other weights
    assert model_fingerprint(same_shape).differences(model_fingerprint(tiny_llama)) != []
    fresh = METHODS["kvcmas"](tau=1.0)
    with pytest.raises(ValueError, match="another model.*weights"):
        fresh.load_state(tmp_path, model=same_shape)
    assert fresh.pools == {}  # nothing changed
    fresh.load_state(tmp_path)  # unbound: checked when a model is attached
    with pytest.raises(ValueError, match="loaded state built on another model"):
        Session(same_shape, tokenizer, fresh)
    with pytest.raises(ValueError, match="layers"):
        METHODS["kvcmas"](tau=1.0).load_state(tmp_path, model=tiny_model("llama", num_hidden_layers=2))
    Session(tiny_llama, tokenizer, fresh)  # the model it was saved from is accepted


def test_refusals_are_clear_and_change_nothing(tiny_llama, tokenizer, tmp_path):
    method = METHODS["kvcmas"](tau=1.0)
    request(tiny_llama, tokenizer, method, QUERIES[0])
    method.save_state(tmp_path / "s")
    with pytest.raises(ValueError, match="other options.*capacity: saved 10, this instance 3"):
        METHODS["kvcmas"](tau=1.0, capacity=3).load_state(tmp_path / "s")
    with pytest.raises(ValueError, match="state of method 'kvcmas', not 'kvcomm'"):
        METHODS["kvcomm"](tau=1.0).load_state(tmp_path / "s")
    with pytest.raises(ValueError, match="holds no saved method state"):
        method.load_state(tmp_path / "missing")
    before = method.state_bytes()
    header, tensors = read_saved(tmp_path / "s")
    header["meta"]["pools"][0]["anchors"][0]["base"]["keys"][0] = ["t999999"]
    (tmp_path / "s" / "state.json").write_text(json.dumps(header))
    with pytest.raises(ValueError, match="does not match its checksum"):
        method.load_state(tmp_path / "s")
    write_saved(tmp_path / "s", header, tensors)  # the checksum recomputed: the content check refuses it
    with pytest.raises(ValueError, match="t999999"):
        method.load_state(tmp_path / "s")
    assert method.state_bytes() == before
    unbound = METHODS["kvcmas"](tau=1.0)
    unbound.pools = method.pools
    with pytest.raises(ValueError, match="pass model="):
        unbound.save_state(tmp_path / "u")


def test_states_saved_before_delta_frames_load_only_into_the_canonical_frame(tiny_llama, tokenizer, tmp_path):
    """A state written before ``delta_frame`` existed holds canonical deltas: the writer-frame default
    refuses it (naming the option), nothing changes; ``delta_frame=canonical`` takes it; a header that
    says writer over canonical anchors is refused by the frame check."""
    old = METHODS["kvcmas"](tau=1.0, delta_frame="canonical")
    request(tiny_llama, tokenizer, old, QUERIES[0])
    old.save_state(tmp_path / "s")
    header, tensors = read_saved(tmp_path / "s")
    for pool in header["meta"]["pools"]:
        for anchor in pool["anchors"]:
            for key in ("frame", "base_start", "prefix_deltas"):
                del anchor[key]
    del header["options"]["delta_frame"], header["options"]["key_frame"], header["options"]["prefix_delta"]
    write_saved(tmp_path / "s", header, tensors, reseal=False)  # as written before delta frames (format 1)
    method = METHODS["kvcmas"](tau=1.0)
    request(tiny_llama, tokenizer, method, QUERIES[1])
    before = (method.state_bytes(), method.state_summary())
    with pytest.raises(ValueError, match="delta_frame: saved 'canonical', this instance 'writer'"):
        method.load_state(tmp_path / "s", allow_legacy=True)
    assert (method.state_bytes(), method.state_summary()) == before
    restored = METHODS["kvcmas"](tau=1.0, delta_frame="canonical")
    restored.load_state(tmp_path / "s", allow_legacy=True)
    assert restored.state_bytes() == old.state_bytes()
    header["options"].update(delta_frame="writer", key_frame="canonical", prefix_delta=False)
    write_saved(tmp_path / "s", header, tensors, reseal=False)
    with pytest.raises(ValueError, match="deltas in the canonical frame.*kvcmas:delta_frame=canonical"):
        method.load_state(tmp_path / "s", allow_legacy=True)
    assert (method.state_bytes(), method.state_summary()) == before


@pytest.mark.parametrize("name", ["nonshared", "fullshared", "cacheblend", "prelrshared"])
def test_stateless_methods_save_an_empty_state(tmp_path, name):
    method = METHODS[name]()
    method.save_state(tmp_path)
    header = json.loads((tmp_path / "state.json").read_text())
    assert header["method"] == name and header["meta"] == {} and header["model"] is None
    METHODS[name]().load_state(tmp_path)


def test_droidspeak_profile_round_trip(tiny_llama, tokenizer, tmp_path):
    method = METHODS["droidspeak"](rho=0.5, layer_profile=[0.1, 0.7, 0.3])
    Session(tiny_llama, tokenizer, method)
    method.save_state(tmp_path)
    fresh = METHODS["droidspeak"](rho=0.5)
    fresh.load_state(tmp_path)
    assert fresh.layer_profile == [0.1, 0.7, 0.3]
    with pytest.raises(ValueError, match="another model"):
        Session(tiny_model("llama", seed=3), tokenizer, fresh)
    Session(tiny_llama, tokenizer, fresh)
    assert fresh.layer_groups() == method.layer_groups()


#: per registered method: an option and a value other than its default (every method with options)
OTHER_OPTION = {
    "fullshared": ("prefix_reuse", True),
    "kvcmas": ("capacity", 3),
    "kvcmas-nonchained": ("capacity", 3),
    "kvcomm": ("capacity", 3),
    "graphflow": ("calibration_requests", 3),
    "baseshared": ("materialize", "lazy"),
    "baselrshared": ("materialize", "lazy"),
    "prelrshared": ("materialize", "lazy"),
    "rebaseshared-lp": ("own_lr", "neutral"),
    "rebaseshared-db": ("materialize", "lazy"),
    "cacheblend": ("rho", 0.5),
    "droidspeak": ("rho", 0.5),
    "relaycaching": ("rho", 0.5),
}


def _observable(method):
    tensors, meta = method.export_state()
    return (
        {k: v.tolist() for k, v in tensors.items()},
        json.dumps(meta, sort_keys=True, default=str),
        method.state_bytes(),
        method.state_options(),
        method.binding.expected,
    )


def test_every_registered_method_is_a_dataclass_whose_options_are_its_saved_options():
    import dataclasses

    from hf_kvshare.method import option_names

    for name, cls in METHODS.items():
        assert dataclasses.is_dataclass(cls), f"{name}: {cls.__name__} is not a dataclass"
        options = cls().state_options()
        assert set(options) <= set(option_names(cls)), name
        if name in OTHER_OPTION:
            assert OTHER_OPTION[name][0] in options, name
        else:
            assert options == {} and option_names(cls) == [], f"{name} has options; add it to OTHER_OPTION"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_state_saved_with_one_option_value_is_refused_by_another(tiny_llama, tmp_path, name):
    """Every registered method: a saved state records its options, and an instance with another value
    of one of them is refused with a ValueError naming the option (saved vs this instance), nothing
    changed; the same options take it."""
    if name not in OTHER_OPTION:
        assert METHODS[name]().state_options() == {}  # no options: nothing to refuse
        return
    option, value = OTHER_OPTION[name]
    saved = METHODS[name]()
    saved.save_state(tmp_path / "s", model=tiny_llama)
    header = json.loads((tmp_path / "s" / "state.json").read_text())
    assert option in header["options"]
    other = METHODS[name](**{option: value})
    before = _observable(other)
    expected = f"{option}: saved {saved.state_options()[option]!r}, this instance {value!r}"
    with pytest.raises(
        ValueError, match="other options.*" + expected.replace("(", r"\(").replace(")", r"\)")
    ):
        other.load_state(tmp_path / "s")
    assert _observable(other) == before
    METHODS[name]().load_state(tmp_path / "s")


def test_states_saved_before_fullshared_recorded_its_options_still_load(tiny_llama, tokenizer, tmp_path):
    """A FullShared state written while FullShared recorded no options (``"options": {}``): kept
    prefixes exist only with ``prefix_reuse=True, prefix_scope="agent"``, so such a state loads into
    that instance and is refused (by name) by another; an empty one loads into any instance. The LR
    methods' states (always empty) load into any instance."""
    original = METHODS["fullshared"](prefix_reuse=True)
    for query in QUERIES[:2]:
        request(tiny_llama, tokenizer, original, query)
    assert original.state_bytes() > 0
    original.save_state(tmp_path / "kept")
    header, tensors = read_saved(tmp_path / "kept")
    header["options"] = {}
    write_saved(tmp_path / "kept", header, tensors, reseal=False)  # as written then (format 1)
    restored = METHODS["fullshared"](prefix_reuse=True)
    restored.load_state(tmp_path / "kept", allow_legacy=True)
    assert restored.state_bytes() == original.state_bytes()
    default = METHODS["fullshared"]()
    with pytest.raises(ValueError, match="prefix_reuse: saved True, this instance False"):
        default.load_state(tmp_path / "kept", allow_legacy=True)
    assert default.state_bytes() == 0
    for name, options in [
        ("fullshared", {"prefix_scope": "request"}),
        ("prelrshared", {"materialize": "lazy"}),
    ]:
        METHODS[name]().save_state(tmp_path / name)
        header, tensors = read_saved(tmp_path / name)
        header["options"] = {}
        write_saved(tmp_path / name, header, tensors, reseal=False)
        METHODS[name](**options).load_state(tmp_path / name, allow_legacy=True)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("fullshared", {"prefix_reuse": "yes"}, "prefix_reuse must be True or False, got 'yes'"),
        ("fullshared", {"prefix_scope": "global"}, "prefix_scope must be one of .*got 'global'"),
        ("prelrshared", {"materialize": "eager"}, "materialize must be one of .*got 'eager'"),
        ("prelrshared", {"own_lr": "neutral"}, "own_lr applies to rebaseshared only.*got 'neutral'"),
        ("rebaseshared-lp", {"own_lr": "mine"}, "own_lr must be one of .*got 'mine'"),
        ("baseshared", {"lr_keys": 1}, "lr_keys must be True or False; got 1"),
    ],
)
def test_options_are_checked_on_creation(name, options, message):
    with pytest.raises(ValueError, match=message):
        METHODS[name](**options)


# ------------------------------------------------------------------ issue 26, item 2: verified state
def _kvcmas_with_state(model, tokenizer, queries=QUERIES[:2], **options):
    method = METHODS["kvcmas"](tau=1.0, **options)
    for query in queries:
        request(model, tokenizer, method, query)
    assert method.pools and method.__dict__["_kept_prefixes"]
    return method


def _other_text_ids(ids):
    return [(t + 1) % 49152 for t in ids]  # the same length, another text


EDITS = {
    "kept-prefix ids for another text": lambda h, t: h["meta"]["prefixes"][0].update(
        ids=_other_text_ids(h["meta"]["prefixes"][0]["ids"])
    ),
    "anchor layers swapped": lambda h, t: h["meta"]["pools"][0]["anchors"][0]["base"].update(
        keys=h["meta"]["pools"][0]["anchors"][0]["base"]["keys"][::-1]
    ),
    "prefix shifted": lambda h, t: h["meta"]["prefixes"][0].update(
        start=h["meta"]["prefixes"][0]["start"] + 3
    ),
    "a same-shape corrupted tensor": lambda h, t: t["prefix0.k0"].mul_(-1.0),
    "the model fingerprint removed": lambda h, t: h.update(model=None),
    "the checksum removed": lambda h, t: h.pop("checksum"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_state_is_refused_and_changes_nothing(tiny_llama, tokenizer, tmp_path, edit):
    """An edit of state.json or of a tensor (without recomputing the checksum) is refused by the
    checksum; the instance it was loaded into keeps its pools and prefixes exactly."""
    _kvcmas_with_state(tiny_llama, tokenizer).save_state(tmp_path / "s")
    header, tensors = read_saved(tmp_path / "s")
    EDITS[edit](header, tensors)
    if edit == "a same-shape corrupted tensor":
        from safetensors.torch import save_file

        save_file(tensors, str(tmp_path / "s" / "state.safetensors"), metadata={CHECKSUM: header[CHECKSUM]})
    else:
        (tmp_path / "s" / "state.json").write_text(json.dumps(header))
    target = _kvcmas_with_state(tiny_llama, tokenizer, QUERIES[2:3])
    before = _observable(target)
    with pytest.raises(ValueError, match="checksum"):
        target.load_state(tmp_path / "s", model=tiny_llama)
    assert _observable(target) == before


def test_a_state_without_checksums_is_refused_unless_legacy_is_asked_for(tiny_llama, tokenizer, tmp_path):
    """Issue 52 (inputs): a state edited to format 1 with both checksums removed (and a tensor edited) is
    refused, naming the keyword that takes it; nothing changes. ``allow_legacy=True`` takes a format-1
    state (checked by content only); a state written today loads without it."""
    original = _kvcmas_with_state(tiny_llama, tokenizer)
    original.save_state(tmp_path / "s")
    METHODS["kvcmas"](tau=1.0).load_state(tmp_path / "s", model=tiny_llama)  # today's state: no keyword
    header, tensors = read_saved(tmp_path / "s")
    next(iter(tensors.values())).mul_(-1.0)
    write_saved(tmp_path / "s", header, tensors, reseal=False)
    target = _kvcmas_with_state(tiny_llama, tokenizer, QUERIES[2:3])
    before = _observable(target)
    with pytest.raises(ValueError, match=r"format 1, without checksums.*allow_legacy=True"):
        target.load_state(tmp_path / "s", model=tiny_llama)
    with pytest.raises(TypeError, match="allow_legacy must be True or False, got 'yes'"):
        target.load_state(tmp_path / "s", model=tiny_llama, allow_legacy="yes")
    assert _observable(target) == before
    header["format"] = 2  # today's format with both checksums removed: refused whatever is asked
    write_saved(tmp_path / "s", header, tensors, reseal=False)
    header_2 = json.loads((tmp_path / "s" / "state.json").read_text())
    header_2["format"] = 2
    (tmp_path / "s" / "state.json").write_text(json.dumps(header_2))
    with pytest.raises(ValueError, match="neither state.json nor state.safetensors carries a checksum"):
        target.load_state(tmp_path / "s", model=tiny_llama, allow_legacy=True)
    assert _observable(target) == before
    write_saved(tmp_path / "s", header, tensors, reseal=False)
    legacy = METHODS["kvcmas"](tau=1.0)
    legacy.load_state(tmp_path / "s", model=tiny_llama, allow_legacy=True)
    assert legacy.state_bytes() == original.state_bytes()


def test_a_corrupted_byte_of_the_tensor_file_is_refused(tiny_llama, tokenizer, tmp_path):
    _kvcmas_with_state(tiny_llama, tokenizer).save_state(tmp_path)
    path = tmp_path / "state.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's data: same shapes, other values
    path.write_bytes(bytes(data))
    fresh = METHODS["kvcmas"](tau=1.0)
    with pytest.raises(ValueError, match="does not match its checksum"):
        fresh.load_state(tmp_path)
    assert fresh.pools == {} and fresh.state_bytes() == 0


def _mismatch_prefix_ids(h, t):
    h["meta"]["prefixes"][0]["ids"] = h["meta"]["prefixes"][0]["ids"][:-1]


def _drop_a_prefix_layer(h, t):
    h["meta"]["prefixes"][0]["layers"] -= 1
    t.pop("prefix0.k2"), t.pop("prefix0.v2")


def _nan_in_an_anchor(h, t):
    name = h["meta"]["pools"][0]["anchors"][0]["base"]["keys"][1][0]
    t[name].view(-1)[0] = float("nan")


def _inf_in_a_prefix(h, t):
    t["prefix1.v0"].view(-1)[-1] = float("inf")


def _other_kv_heads(h, t):
    h["meta"]["pools"][0]["anchors"][0]["base"]["kv_heads"] = 4


def _bad_evicted(h, t):  # the last field read: everything before it already parsed
    h["meta"]["evicted"] = "x"


def _prefix_for_another_model(h, t):  # kv heads x head dim of another model, all layers alike
    for name in [n for n in t if n.startswith("prefix0.")]:
        t[name] = t[name].reshape(1, 1, t[name].shape[2], -1).contiguous()


CHECKED = {
    "kept-prefix ids shorter than its K/V": (_mismatch_prefix_ids, "expected .*token ids"),
    "a kept prefix with a layer missing": (_drop_a_prefix_layer, "2 layers, the saved model 3"),
    "NaN in a saved anchor": (_nan_in_an_anchor, "holds NaN or inf"),
    "inf in a kept prefix": (_inf_in_a_prefix, "holds NaN or inf"),
    "anchor kv heads against its factors": (_other_kv_heads, "4 kv heads, the saved model 3 layers x 2"),
    "a damaged last field": (_bad_evicted, "evicted must be an int >= 0, got 'x'"),
    "prefix K/V of another shape": (_prefix_for_another_model, "1 kv heads x 32; the saved model has 2 x 16"),
}


@pytest.mark.parametrize("case", list(CHECKED))
def test_a_resealed_state_is_still_checked_before_anything_changes(tiny_llama, tokenizer, tmp_path, case):
    """What the checksum cannot tell (the sha256 recomputed over an inconsistent state, or NaN saved
    by another writer): ids against K/V lengths, layers and heads against the saved model, every
    tensor finite, every field well-formed; all before any field of the instance changes."""
    edit, message = CHECKED[case]
    _kvcmas_with_state(tiny_llama, tokenizer).save_state(tmp_path / "s")
    header, tensors = read_saved(tmp_path / "s")
    edit(header, tensors)
    write_saved(tmp_path / "s", header, tensors)
    target = _kvcmas_with_state(tiny_llama, tokenizer, QUERIES[2:3])
    before = _observable(target)
    with pytest.raises(ValueError, match=message):
        target.load_state(tmp_path / "s", model=tiny_llama)
    assert _observable(target) == before


def test_a_state_that_names_no_model_is_refused(tiny_llama, tokenizer, tmp_path):
    _kvcmas_with_state(tiny_llama, tokenizer).save_state(tmp_path)
    header, tensors = read_saved(tmp_path)
    header["model"] = None
    write_saved(tmp_path, header, tensors)
    for model in (None, tiny_llama, tiny_model("llama", seed=5)):
        fresh = METHODS["kvcmas"](tau=1.0)
        with pytest.raises(ValueError, match="names no model"):
            fresh.load_state(tmp_path, model=model)
        assert fresh.pools == {} and fresh.binding.expected is None


def test_load_with_another_model_into_a_bound_instance_is_refused(tiny_llama, tokenizer, tmp_path):
    other = tiny_model("llama", seed=7)
    _kvcmas_with_state(other, tokenizer).save_state(tmp_path)  # B's state, saved from B
    bound = _kvcmas_with_state(tiny_llama, tokenizer)  # an instance bound to A
    before = _observable(bound)
    with pytest.raises(ValueError, match="bound to .*another model object"):
        bound.load_state(tmp_path, model=other)
    assert _observable(bound) == before and bound.binding.model is tiny_llama
    METHODS["kvcmas"](tau=1.0).load_state(tmp_path, model=other)  # a fresh instance takes it


def test_saving_non_finite_state_is_refused(tiny_llama, tokenizer, tmp_path):
    method = _kvcmas_with_state(tiny_llama, tokenizer)
    method.save_state(tmp_path)
    first = (tmp_path / "state.json").read_text()
    next(iter(method.pools.values())).anchors[0].base.keys[0].a.view(-1)[0] = float("inf")
    with pytest.raises(ValueError, match="holds NaN or inf; refusing to save it"):
        method.save_state(tmp_path)
    assert (tmp_path / "state.json").read_text() == first


def test_a_save_that_fails_midway_keeps_the_old_state(tiny_llama, tokenizer, tmp_path, monkeypatch):
    """A save that fails while writing the tensors (disk full) leaves the previous state.json and
    state.safetensors as they were (they still load, to the first state) and no temporary file."""
    import errno

    import safetensors.torch

    method = _kvcmas_with_state(tiny_llama, tokenizer)
    method.save_state(tmp_path)
    first = read_saved(tmp_path)
    request(tiny_llama, tokenizer, method, QUERIES[3])  # more state, a larger save
    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as handle:
            handle.truncate(len(handle.read()) // 2)  # half written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        method.save_state(tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.safetensors"]
    header, tensors = read_saved(tmp_path)
    assert header == first[0] and tensors.keys() == first[1].keys()
    assert all(torch.equal(tensors[k], first[1][k]) for k in tensors)
    fresh = METHODS["kvcmas"](tau=1.0)
    fresh.load_state(tmp_path, model=tiny_llama)
    assert fresh.state_summary()["anchors"] == sum(len(p["anchors"]) for p in first[0]["meta"]["pools"])


@pytest.mark.parametrize(
    "name, options",
    [
        ("kvcmas", dict(tau=1.0, base_rank=100, delta_rank=64)),
        ("graphflow", dict(calibration_requests=1, rank=100)),
    ],
)
def test_a_rank_above_the_kv_dimension_round_trips(tiny_llama, tokenizer, tmp_path, name, options):
    """The tiny model's K/V dimension is 2 kv heads x 16 = 32: a larger rank is clamped when the
    instance is bound (with a warning); its saved state loads into an instance with the rank as
    given (or the clamped one: the same method on this model), not into one with another rank."""
    original = METHODS[name](**options)
    with pytest.warns(UserWarning, match="clamped to 32"):
        request(tiny_llama, tokenizer, original, QUERIES[0])
    request(tiny_llama, tokenizer, original, QUERIES[1])
    original.save_state(tmp_path)
    restored = METHODS[name](**options)
    restored.load_state(tmp_path)
    clamped = {k: (32 if k.endswith("rank") else v) for k, v in options.items()}
    METHODS[name](**clamped).load_state(tmp_path, model=tiny_llama)
    with pytest.raises(ValueError, match="rank: saved 32, this instance 16"):
        METHODS[name](**{**options, ("base_rank" if name == "kvcmas" else "rank"): 16}).load_state(tmp_path)
    with pytest.warns(UserWarning, match="clamped to 32"):
        got = request(tiny_llama, tokenizer, restored, QUERIES[2])
    assert got == request(tiny_llama, tokenizer, original, QUERIES[2])
    restored.save_state(tmp_path / "again")  # a loaded, clamped instance saves and loads again
    METHODS[name](**options).load_state(tmp_path / "again", model=tiny_llama)


# ------------------------------------------------------------------ issue 26: the adversarial re-run
# Fresh cases (not the examples), classified by tests/adversarial.py; the table of a run:
#   OMP_NUM_THREADS=1 PYTHONPATH=.:tests python tests/adversarial.py "saved method state"
import functools  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

from adversarial import Case, assert_holds  # noqa: E402

_ROOT = Path(tempfile.mkdtemp(prefix="hfkv-adversarial-state-"))
_TRAINED_OPTIONS = {
    "kvcmas": dict(tau=1.0, capacity=2),
    "kvcomm": dict(tau=1.0, capacity=2),
    "kvcmas-nonchained": dict(tau=1.0),
    "graphflow": dict(calibration_requests=4),
    "droidspeak": dict(rho=0.5, layer_profile=[0.1, 0.7, 0.3]),
    "fullshared": dict(prefix_reuse=True),
}


@functools.cache
def _tok():
    from tiny import embedded_tokenizer

    return embedded_tokenizer()


@functools.cache
def _model(seed: int = 0, layers: int = 3):
    return tiny_model("llama", seed=seed, num_hidden_layers=layers)


def _trained(name: str, queries=QUERIES[:2]):
    method = METHODS[name](**_TRAINED_OPTIONS.get(name, {}))
    if name == "droidspeak":
        Session(_model(), _tok(), method)
    else:
        for query in queries:
            request(_model(), _tok(), method, query)
    return method


@functools.cache
def _saved(name: str) -> Path:
    """A saved state of ``name`` (trained on two requests), written once."""
    directory = _ROOT / f"saved-{name}"
    _trained(name).save_state(directory)
    return directory


def _copy(name: str) -> Path:
    directory = Path(tempfile.mkdtemp(dir=_ROOT))
    shutil.copytree(_saved(name), directory, dirs_exist_ok=True)
    return directory


def _edited(name: str, edit, reseal: bool | None = True) -> Path:
    """A copy of ``name``'s saved state with ``edit(header, tensors)`` applied; written resealed (the
    checksum recomputed, a forger's), ``False``: the tensors rewritten with the old checksum, the
    header as edited; ``None``: only the header rewritten."""
    from safetensors.torch import save_file

    directory = _copy(name)
    header, tensors = read_saved(directory)
    edit(header, tensors)
    if reseal:
        write_saved(directory, header, tensors)
    elif reseal is False:
        save_file(
            tensors, str(directory / "state.safetensors"), metadata={CHECKSUM: header.get(CHECKSUM, "")}
        )
        (directory / "state.json").write_text(json.dumps(header))
    else:
        (directory / "state.json").write_text(json.dumps(header))
    return directory


def _load_case(label, name, make_dir, match, target=None, model="same", check=None):
    """Load ``make_dir()`` into a victim (an instance of ``target`` holding its own loaded state);
    refused: the victim's state must be as it was. ``check``: a legitimate input (the loaded state
    must equal the saved one)."""
    target = target or name
    box = {}

    def run():
        victim = METHODS[target](**_TRAINED_OPTIONS.get(target, {}))
        if target in ("kvcmas", "kvcomm", "graphflow", "kvcmas-nonchained"):
            victim.load_state(_saved(target), model=_model())
        box["victim"], box["before"] = victim, _observable(victim)
        directory = make_dir()
        victim.load_state(directory, model=_model() if model == "same" else model() if model else None)
        return victim

    def after():
        return "victim" not in box or _observable(box["victim"]) == box["before"]

    return Case("saved method state", label, run, match, check, after)


def _same_as_saved(name):
    def check(victim):
        expected = METHODS[name](**_TRAINED_OPTIONS.get(name, {}))
        expected.load_state(_saved(name), model=_model())
        return _observable(victim)[:4] == _observable(expected)[:4]

    return check


def _anchor(h, i=0):
    return h["meta"]["pools"][0]["anchors"][i]


def _first_tensor(h, t):
    return _anchor(h)["base"]["keys"][0][0]


def _set(path, value):
    def edit(h, t):
        *parents, last = path
        node = h
        for key in parents:
            node = node[key]
        node[last] = value

    return edit


def _tensor_edit(fn):
    def edit(h, t):
        name = _first_tensor(h, t)
        t[name] = fn(t[name])

    return edit


def _rename(h, t):
    name = _first_tensor(h, t)
    t[name + "x"] = t.pop(name)


def _swap_tensors(h, t):
    a, b = _anchor(h)["base"]["keys"][0][0], _anchor(h)["base"]["values"][0][0]
    t[a], t[b] = t[b], t[a]


def _nested(depth):
    def edit(h, t):
        node = h["meta"]
        for _ in range(depth):
            node["x"] = {}
            node = node["x"]

    return edit


def _raw_header(text_or_bytes):
    def make():
        directory = _copy("kvcmas")
        path = directory / "state.json"
        path.write_bytes(text_or_bytes if isinstance(text_or_bytes, bytes) else text_or_bytes.encode())
        return directory

    return make


def _truncated(file, keep):
    def make():
        directory = _copy("kvcmas")
        path = directory / file
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])
        return directory

    return make


def _file_instead_of_dir():
    path = Path(tempfile.mkdtemp(dir=_ROOT)) / "state"
    path.write_text("not a directory")
    return path


def _symlinked_dir():
    link = Path(tempfile.mkdtemp(dir=_ROOT)) / "link"
    link.symlink_to(_saved("kvcmas"), target_is_directory=True)
    return link


def _json_from_another_state():
    directory = _copy("kvcmas")
    (directory / "state.json").unlink()
    other = _ROOT / "other-kvcmas"
    if not other.exists():
        _trained("kvcmas", QUERIES[2:4]).save_state(other)
    (directory / "state.json").symlink_to(other / "state.json")
    return directory


def _json_is_a_directory():
    directory = _copy("kvcmas")
    (directory / "state.json").unlink()
    (directory / "state.json").mkdir()
    return directory


def _with_leftover_temporaries():
    directory = _copy("kvcmas")
    (directory / ".state.json.abc.tmp").write_text("{")
    (directory / ".state.safetensors.abc.tmp").write_bytes(b"\0" * 10)
    return directory


def _dev_zero_tensors():
    directory = _copy("kvcmas")
    (directory / "state.safetensors").unlink()
    (directory / "state.safetensors").symlink_to("/dev/zero")
    return directory


def _fifo_header():
    directory = _copy("kvcmas")
    (directory / "state.json").unlink()
    os.mkfifo(directory / "state.json")
    return directory


def _huge_header():
    directory = _edited("kvcmas", _set(("meta", "comment"), "x" * (64 << 20)))
    return directory


def _save_case(label, make_method, make_dir, match, check=None, after=None):
    def run():
        return make_method().save_state(make_dir())

    return Case("saved method state", label, run, match, check, after)


def _saved_again_intact(directory_box):
    def check(_):
        return True

    return check


def _read_only_dir():
    directory = Path(tempfile.mkdtemp(dir=_ROOT)) / "ro"
    directory.mkdir()
    return directory


def _failing_save():
    """A save that fails midway (the tensor writer raises after writing part of its file): the old
    state is kept, loadable, no temporary file left."""
    import hf_kvshare.persistence as persistence

    directory = _copy("kvcmas")
    original = persistence._write_tensors

    def failing(tensors, path, metadata):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    persistence._write_tensors = failing
    try:
        _trained("kvcmas", QUERIES[2:3]).save_state(directory)
    except OSError:
        pass
    finally:
        persistence._write_tensors = original
    fresh = METHODS["kvcmas"](**_TRAINED_OPTIONS["kvcmas"])
    fresh.load_state(directory, model=_model())
    return fresh, sorted(p.name for p in directory.iterdir())


_STATE_MODEL = r"another model|bound to|layers|fingerprint|model"
ADVERSARIAL_STATE = [
    # -- edited without recomputing the checksum
    *[
        _load_case(f"{name}: {label}", name, functools.partial(_edited, name, edit, None), "checksum")
        for name, edits in {
            "kvcmas": {
                "anchor uses edited": _set(("meta", "pools", 0, "anchors", 0, "uses"), 99),
                "base_start shifted": lambda h, t: _anchor(h).update(base_start=_anchor(h)["base_start"] + 1),
                "an option edited": _set(("options", "tau"), 0.5),
                "requested ranks edited": _set(("requested", "base_rank"), 7),
                "next_request edited": _set(("meta", "next_request"), 0),
                "pools reordered": lambda h, t: h["meta"]["pools"].reverse(),
            },
            "graphflow": {
                "profile requests edited": _set(("meta", "profiles", 0, "requests"), [0, 1, 2, 3]),
                "profile target renamed": _set(("meta", "profiles", 0, "target"), "someone"),
            },
            "kvcomm": {
                "prefix delta ids edited": lambda h, t: _anchor(h)["prefix_deltas"][0][1].reverse(),
            },
            "droidspeak": {
                "layer profile edited": _set(("meta", "layer_profile"), [0.7, 0.1, 0.3]),
            },
        }.items()
        for label, edit in edits.items()
    ],
    *[
        _load_case(
            f"kvcmas: {label}", "kvcmas", functools.partial(_edited, "kvcmas", edit, False), "checksum"
        )
        for label, edit in {
            "a tensor negated": _tensor_edit(lambda x: -x),
            "a tensor renamed": _rename,
            "an extra tensor": lambda h, t: t.update(extra=torch.zeros(3)),
            "a tensor missing": lambda h, t: t.pop(_first_tensor(h, t)),
            "a tensor in float16": _tensor_edit(lambda x: x.half()),
            "a tensor in float64": _tensor_edit(lambda x: x.double()),
            "two tensors swapped": _swap_tensors,
            "NaN in a tensor": _tensor_edit(lambda x: x.index_fill(-1, torch.tensor([0]), float("nan"))),
        }.items()
    ],
    # -- resealed (a forger recomputes the sha256): the content checks
    *[
        _load_case(f"resealed {name}: {label}", name, functools.partial(_edited, name, edit), match)
        for name, label, edit, match in [
            (
                "kvcmas",
                "inf in a tensor",
                _tensor_edit(lambda x: x.index_fill(-1, torch.tensor([1]), float("inf"))),
                "NaN or inf",
            ),
            (
                "kvcmas",
                "a tensor in float16",
                _tensor_edit(lambda x: x.half()),
                r"dtype|float16.*float32|float32.*float16",
            ),
            ("kvcmas", "a tensor in int64", _tensor_edit(lambda x: x.long()), r"dtype|int64"),
            ("kvcmas", "a tensor missing", lambda h, t: t.pop(_first_tensor(h, t)), r"t\d+|missing|names"),
            ("kvcmas", "an extra tensor", lambda h, t: t.update(extra=torch.zeros(3)), r"extra"),
            ("kvcmas", "a tensor renamed", _rename, r"t\d+"),
            (
                "kvcmas",
                "a tensor one token short",
                _tensor_edit(lambda x: x[:-1].contiguous()),
                r"shape|length|token",
            ),
            ("kvcmas", "a scalar tensor", _tensor_edit(lambda x: x.sum()), r"shape|dimension|rank"),
            (
                "kvcmas",
                "an anchor length edited",
                lambda h, t: _anchor(h)["base"].update(length=_anchor(h)["base"]["length"] + 1),
                r"length|shape|token",
            ),
            (
                "kvcmas",
                "a layer dropped",
                lambda h, t: _anchor(h)["base"].update(keys=_anchor(h)["base"]["keys"][:-1]),
                r"layers",
            ),
            (
                "kvcmas",
                "anchor uses negative",
                _set(("meta", "pools", 0, "anchors", 0, "uses"), -1),
                r"uses.*-1",
            ),
            (
                "kvcmas",
                "anchor serial a string",
                _set(("meta", "pools", 0, "anchors", 0, "serial"), "0"),
                r"serial.*'0'",
            ),
            (
                "kvcmas",
                "pool capacity other than the option",
                _set(("meta", "pools", 0, "capacity"), 7),
                r"capacity.*7",
            ),
            (
                "kvcmas",
                "more anchors than the capacity",
                lambda h, t: h["meta"]["pools"][0]["anchors"].extend(h["meta"]["pools"][0]["anchors"]),
                r"anchor|capacity|serial",
            ),
            ("kvcmas", "pools a string", _set(("meta", "pools"), "x"), r"pools.*'x'|pools.*str"),
            ("kvcmas", "meta a list", _set(("meta",), []), r"metadata must be an object.*list"),
            (
                "kvcmas",
                "an unknown meta key",
                _set(("meta", "surprise"), 1),
                r"does not save: \['surprise'\]",
            ),
            ("kvcmas", "next_request negative", _set(("meta", "next_request"), -5), r"next_request.*-5"),
            (
                "kvcmas",
                "an anchor frame unknown",
                lambda h, t: _anchor(h).update(frame="bogus"),
                r"frame.*bogus",
            ),
            (
                "kvcmas",
                "a delta agent not a string",
                lambda h, t: _anchor(h)["deltas"][0].__setitem__(0, 5),
                r"agent|5",
            ),
            ("kvcmas", "a deeply nested meta", _nested(500), r"nested|deep|does not save: \['x'\]"),
            ("kvcmas", "format from the future", _set(("format",), 3), r"format.*3"),
            ("kvcmas", "method renamed", _set(("method",), "kvcomm"), r"'kvcomm', not 'kvcmas'"),
            ("kvcmas", "an option removed", lambda h, t: h["options"].pop("tau"), r"tau"),
            ("kvcmas", "an unknown option", _set(("options", "colour"), "red"), r"colour"),
            ("kvcmas", "the model fingerprint's layers edited", _set(("model", "layers"), 2), _STATE_MODEL),
            ("kvcmas", "the model fingerprint damaged", _set(("model",), "abc"), r"fingerprint"),
            (
                "graphflow",
                "profile counts of another length",
                lambda h, t: t.update({h["meta"]["profiles"][0]["counts"]: torch.ones(3)}),
                r"shape|length|count",
            ),
            (
                "graphflow",
                "profile kv_heads edited",
                _set(("meta", "profiles", 0, "kv_heads"), 4),
                r"kv heads|kv_heads",
            ),
            (
                "graphflow",
                "profile requests not a list",
                _set(("meta", "profiles", 0, "requests"), 3),
                r"requests",
            ),
            (
                "graphflow",
                "two profiles with one key",
                lambda h, t: h["meta"]["profiles"].__setitem__(1, dict(h["meta"]["profiles"][0])),
                r"twice|duplicate|same|key",
            ),
            (
                "droidspeak",
                "layer profile NaN",
                _set(("meta", "layer_profile"), [0.1, None, 0.3]),
                r"profile",
            ),
            (
                "droidspeak",
                "layer profile of two layers",
                _set(("meta", "layer_profile"), [0.1, 0.7]),
                r"2 entries.*3 layers",
            ),
            (
                "droidspeak",
                "layer profile strings",
                _set(("meta", "layer_profile"), ["a", "b", "c"]),
                r"profile",
            ),
            (
                "fullshared",
                "kept prefix ids not ints",
                lambda h, t: h["meta"]["prefixes"][0].update(
                    ids=["a"] * len(h["meta"]["prefixes"][0]["ids"])
                ),
                r"ids|int",
            ),
        ]
    ],
    _load_case(
        "a nonshared state holding metadata",
        "nonshared",
        lambda: _edited("nonshared", _set(("meta", "pools"), [])),
        r"keeps no state|names no model",
    ),
    # -- files
    _load_case("the state dir is a file", "kvcmas", _file_instead_of_dir, r"holds no saved method state"),
    _load_case("state.json truncated", "kvcmas", _truncated("state.json", 0.5), r"not a saved method state"),
    _load_case(
        "state.safetensors truncated",
        "kvcmas",
        _truncated("state.safetensors", 0.7),
        r"not a readable safetensors",
    ),
    _load_case(
        "state.safetensors empty", "kvcmas", _truncated("state.safetensors", 0), r"not a readable safetensors"
    ),
    _load_case("state.json not UTF-8", "kvcmas", _raw_header(b"\xff\xfe{"), r"not a saved method state"),
    _load_case("state.json a list", "kvcmas", _raw_header("[1, 2]"), r"format 2 expected, got \[1, 2\]"),
    _load_case("state.json with NaN", "kvcmas", _raw_header('{"format": NaN}'), r"format|NaN"),
    _load_case(
        "state.json nested 100000 deep",
        "kvcmas",
        _raw_header("[" * 100000 + "]" * 100000),
        r"not a saved method state|nested|deep",
    ),
    _load_case(
        "state.json from another save (symlink)", "kvcmas", _json_from_another_state, r"not from one save"
    ),
    _load_case("state.json a directory", "kvcmas", _json_is_a_directory, r"holds no saved method state"),
    _load_case("state.json a FIFO", "kvcmas", _fifo_header, r"holds no saved method state"),
    _load_case(
        "state.safetensors -> /dev/zero",
        "kvcmas",
        _dev_zero_tensors,
        r"holds no saved method state|not a readable",
    ),
    _load_case(
        "64 MiB of metadata",
        "kvcmas",
        _huge_header,
        r"not a saved method state.*more than the 67108864 accepted",
    ),
    _load_case(
        "the state dir a symlink to a state", "kvcmas", _symlinked_dir, None, check=_same_as_saved("kvcmas")
    ),
    _load_case(
        "leftover temporary files", "kvcmas", _with_leftover_temporaries, None, check=_same_as_saved("kvcmas")
    ),
    # -- models, methods, options
    _load_case(
        "model= with other weights",
        "kvcmas",
        lambda: _saved("kvcmas"),
        _STATE_MODEL,
        model=lambda: _model(seed=1),
    ),
    _load_case(
        "model= with fewer layers",
        "kvcmas",
        lambda: _saved("kvcmas"),
        _STATE_MODEL,
        model=lambda: _model(layers=2),
    ),
    _load_case(
        "model= not a model",
        "kvcmas",
        lambda: _saved("kvcmas"),
        r"model.*str|nn\.Module",
        model=lambda: "model",
    ),
    *[
        _load_case(
            f"{source} state into {target}",
            source,
            functools.partial(_saved, source),
            rf"state of method '{source}', not '{target}'",
            target=target,
        )
        for source, target in [
            ("kvcmas", "kvcomm"),
            ("kvcmas", "kvcmas-nonchained"),
            ("kvcmas", "graphflow"),
            ("graphflow", "kvcmas"),
            ("droidspeak", "cacheblend"),
            ("nonshared", "fullshared"),
        ]
    ],
    Case(
        "saved method state",
        "into an instance bound to another model",
        lambda: (lambda m: (Session(_model(seed=1), _tok(), m), m.load_state(_saved("kvcmas"))))(
            METHODS["kvcmas"](**_TRAINED_OPTIONS["kvcmas"])
        ),
        _STATE_MODEL,
    ),
    Case(
        "saved method state",
        "saved with capacity 2, loaded with capacity 3",
        lambda: METHODS["kvcmas"](tau=1.0, capacity=3).load_state(_saved("kvcmas")),
        r"capacity: saved 2, this instance 3",
    ),
    Case(
        "saved method state",
        "saved with tau 1, loaded with tau 0.5",
        lambda: METHODS["kvcmas"](tau=0.5, capacity=2).load_state(_saved("kvcmas")),
        r"tau: saved 1.0, this instance 0.5",
    ),
    Case(
        "saved method state",
        "graphflow rank 1000 round trip",
        lambda: (
            lambda m: (
                request(_model(), _tok(), m, QUERIES[0]),
                m.save_state(_ROOT / "rank1000"),
                METHODS["graphflow"](calibration_requests=4, rank=1000).load_state(
                    _ROOT / "rank1000", model=_model()
                ),
            )
        )(METHODS["graphflow"](calibration_requests=4, rank=1000)),
        None,
        check=lambda _: True,
    ),
    # -- saving
    _save_case(
        "save into a file",
        lambda: _trained("kvcmas", QUERIES[:1]),
        _file_instead_of_dir,
        r"exists and is not a directory",
    ),
    _save_case(
        "save under a file",
        lambda: _trained("kvcmas", QUERIES[:1]),
        lambda: _file_instead_of_dir() / "sub",
        r"not a directory|cannot save",
    ),
    Case(
        "saved method state",
        "save with model= another model",
        lambda: _trained("kvcmas", QUERIES[:1]).save_state(_ROOT / "x", model=_model(seed=1)),
        r"another model object",
    ),
    Case(
        "saved method state",
        "a save failing midway keeps the old state",
        _failing_save,
        None,
        check=lambda got: got[1] == ["state.json", "state.safetensors"] and got[0].state_bytes() > 0,
    ),
    *[
        Case(
            "saved method state",
            f"round trip of {name}",
            functools.partial(
                lambda name: (
                    (
                        _trained(name).save_state(_ROOT / f"rt-{name}"),
                        METHODS[name](**_TRAINED_OPTIONS.get(name, {})).load_state(
                            _ROOT / f"rt-{name}", model=_model()
                        ),
                    )
                    if name in _TRAINED_OPTIONS
                    else (
                        METHODS[name]().save_state(_ROOT / f"rt-{name}"),
                        METHODS[name]().load_state(_ROOT / f"rt-{name}", model=_model()),
                    )
                ),
                name,
            ),
            None,
            check=lambda _: True,
        )
        for name in sorted(METHODS)
        if not METHODS[name].requires_adapters and name not in ("droidspeak",)
    ],
]


@pytest.mark.parametrize("case", ADVERSARIAL_STATE, ids=lambda c: c.name)
def test_adversarial_saved_state(case):
    assert_holds(case)


ADVERSARIAL = ADVERSARIAL_STATE


def test_a_state_json_that_is_no_small_regular_file_is_refused_unread(tiny_llama, tokenizer, tmp_path):
    """``load_state`` reads ``state.json`` as one bounded read: a FIFO in its place is refused without
    waiting on it, a (sparse) 2 GiB one without reading it; the method is left as it was."""
    import os
    import time

    saved = METHODS["kvcmas"](tau=1.0)
    request(tiny_llama, tokenizer, saved, QUERIES[0])
    saved.save_state(tmp_path / "s")
    method = METHODS["kvcmas"](tau=1.0)
    before = (method.state_bytes(), method.state_summary())
    header = tmp_path / "s" / "state.json"
    header.unlink()
    os.mkfifo(header)
    start = time.monotonic()
    with pytest.raises(ValueError, match="holds no saved method state"):
        method.load_state(tmp_path / "s")
    header.unlink()
    with open(header, "wb") as file:
        file.truncate(2 << 30)
    with pytest.raises(ValueError, match="not a saved method state.*more than the 67108864 accepted"):
        method.load_state(tmp_path / "s")
    assert time.monotonic() - start < 10
    assert (method.state_bytes(), method.state_summary()) == before

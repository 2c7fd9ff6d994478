"""Saving and loading a method's cross-request state (issue 13, item 9): safetensors + JSON, no
pickle, a model fingerprint checked on load, and a restored instance that continues exactly as the
original would."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model

from hf_kvshare import METHODS, PF, PH, Session
from hf_kvshare.identity import model_fingerprint

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
    header = json.loads((tmp_path / "s" / "state.json").read_text())
    header["meta"]["pools"][0]["anchors"][0]["base"]["keys"][0] = ["t999999"]
    (tmp_path / "s" / "state.json").write_text(json.dumps(header))
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
    header = json.loads((tmp_path / "s" / "state.json").read_text())
    for pool in header["meta"]["pools"]:
        for anchor in pool["anchors"]:
            for key in ("frame", "base_start", "prefix_deltas"):
                del anchor[key]
    del header["options"]["delta_frame"], header["options"]["key_frame"], header["options"]["prefix_delta"]
    (tmp_path / "s" / "state.json").write_text(json.dumps(header))
    method = METHODS["kvcmas"](tau=1.0)
    request(tiny_llama, tokenizer, method, QUERIES[1])
    before = (method.state_bytes(), method.state_summary())
    with pytest.raises(ValueError, match="delta_frame: saved 'canonical', this instance 'writer'"):
        method.load_state(tmp_path / "s")
    assert (method.state_bytes(), method.state_summary()) == before
    restored = METHODS["kvcmas"](tau=1.0, delta_frame="canonical")
    restored.load_state(tmp_path / "s")
    assert restored.state_bytes() == old.state_bytes()
    header["options"].update(delta_frame="writer", key_frame="canonical", prefix_delta=False)
    (tmp_path / "s" / "state.json").write_text(json.dumps(header))
    with pytest.raises(ValueError, match="deltas in the canonical frame.*kvcmas:delta_frame=canonical"):
        method.load_state(tmp_path / "s")
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
    header = json.loads((tmp_path / "kept" / "state.json").read_text())
    header["options"] = {}
    (tmp_path / "kept" / "state.json").write_text(json.dumps(header))
    restored = METHODS["fullshared"](prefix_reuse=True)
    restored.load_state(tmp_path / "kept")
    assert restored.state_bytes() == original.state_bytes()
    default = METHODS["fullshared"]()
    with pytest.raises(ValueError, match="prefix_reuse: saved True, this instance False"):
        default.load_state(tmp_path / "kept")
    assert default.state_bytes() == 0
    for name, options in [
        ("fullshared", {"prefix_scope": "request"}),
        ("prelrshared", {"materialize": "lazy"}),
    ]:
        METHODS[name]().save_state(tmp_path / name)
        header = json.loads((tmp_path / name / "state.json").read_text())
        header["options"] = {}
        (tmp_path / name / "state.json").write_text(json.dumps(header))
        METHODS[name](**options).load_state(tmp_path / name)


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

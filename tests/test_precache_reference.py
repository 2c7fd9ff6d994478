"""PReCache / LRAgent as the authors' code runs them: value-only low-rank caches (keys from the shared
base, LoRA on k_proj refused unless ``lr_keys=True``) and ``baselrshared`` (one LR cache shared by all
agents, adapters with one shared ``v_proj`` ``lora_A``). Tiny random models, q/v adapters."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import QUERY, QV, lora_config, lora_model, run_trajectory, share_value_down

from hf_kvshare import METHODS, PH, Session
from hf_kvshare.lora import SHARED_LR, LoraBank

LORA_METHODS = ["baseshared", "baselrshared", "prelrshared", "rebaseshared-lp", "rebaseshared-db"]
SAME_RANK = {"plan": 4, "act": 4, "reflect": 4}
AGENTS = ["plan", "act", "reflect", "act", "plan"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def qv_model(request):
    """q/v adapters of equal rank whose v_proj lora_A is shared (every method accepts them)."""
    model = lora_model(request.param, roles=SAME_RANK, targets=QV, seed=7)
    share_value_down(model)
    return model


def _state(model) -> tuple:
    """What a refused Session or turn must leave unchanged on the model."""
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    grads = tuple(p.requires_grad for p in model.parameters())
    return list(model.active_adapters), hooks, grads, list(model.peft_config)


def _assert_caches_close(got, ref, n: int, layers=None) -> None:
    for layer in range(ref.cache.num_layers) if layers is None else layers:
        k, v = got.cache.layer_kv(layer)
        ek, ev = ref.cache.layer_kv(layer)
        torch.testing.assert_close(k[:1, :, :n], ek[..., :n, :], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(v[:1, :, :n], ev[..., :n, :], atol=2e-6, rtol=1e-5)


def test_registry_has_baselrshared():
    assert set(LORA_METHODS) <= set(METHODS)
    assert METHODS["baselrshared"].requires_adapters and METHODS["baselrshared"]().lr_keys is False


# ------------------------------------------------------------------ exactness, value-only default
@pytest.mark.parametrize("method", LORA_METHODS)
def test_value_only_exact_single_agent(qv_model, tokenizer, method):
    """One agent wrote every token: its K is the base (k_proj of its own pass), its V is V_base + its LR
    term = its v_proj. PreLRShared, BaseShared and BaseLRShared equal NonShared at every layer.
    ReBaseShared's base is adapter-free by design: it equals NonShared at layer 0 (same input for
    every pass), and its keys everywhere are the neutral base's, with no per-agent key term."""
    agents = ["act"] * 3
    exact = run_trajectory(Session(qv_model, tokenizer, "nonshared"), agents, keep_cache=True)
    forced = [r.output_ids for r in exact]
    session = Session(qv_model, tokenizer, method)
    got = run_trajectory(session, agents, forced=forced, keep_cache=True)
    for g, e in zip(got[1:], exact[1:]):
        n = max(s.end for s in g.segments if s.provenance in ("reused", "recomputed"))
        assert n > 0
        if method.startswith("rebaseshared"):
            _assert_caches_close(g, e, n, layers=[0])
            store = session.method_state[method]
            for layer in range(store.num_layers):
                assert torch.equal(g.cache.layer_kv(layer)[0][:1, :, : g.cache.view.length],
                                   store.base(layer, 0, g.cache.view.length)[0])  # fmt: skip
        else:
            _assert_caches_close(g, e, n)
    if not method.startswith("rebaseshared"):
        free = run_trajectory(Session(qv_model, tokenizer, method), agents)
        assert [r.output_ids.tolist() for r in free] == [r.output_ids.tolist() for r in exact]
    store = session.method_state[method]
    assert all(k is None for lr in store.lr.values() for k in lr.keys)  # no key LR cache


@pytest.mark.parametrize("method", LORA_METHODS)
def test_value_only_exact_when_hidden_states_do_not_depend_on_the_adapter(tokenizer, method):
    """q/v adapters on the last layer only: every layer's k/v projections see adapter-free hidden
    states, so with several agents every method (ReBaseShared included) reproduces NonShared's caches:
    keys from the shared base, values V_base + s_a B_a A x from the LR caches."""
    model = lora_model("llama", roles=SAME_RANK, targets=QV, seed=11, layers_to_transform=[2])
    share_value_down(model)
    exact = run_trajectory(Session(model, tokenizer, "nonshared"), AGENTS, keep_cache=True)
    got = run_trajectory(
        Session(model, tokenizer, method), AGENTS, forced=[r.output_ids for r in exact], keep_cache=True
    )
    for g, e in zip(got[1:], exact[1:]):
        _assert_caches_close(g, e, g.cache.view.length)
    last_v = got[-1].cache.layer_kv(2)[1][:1, :, : got[-1].cache.view.length]
    base_v = got[-1].cache.view.store.base(2, 0, got[-1].cache.view.length)[1]
    assert (last_v - base_v).abs().max() > 1e-3  # the value LR term matters


def test_value_only_memory_is_values_only(tokenizer):
    model = lora_model("llama", targets=QV, seed=2)  # ranks 4, 2, 3
    session = Session(model, tokenizer, "prelrshared")
    run_trajectory(session, ["plan", "act"])
    memory = session.method.session_memory(session)
    layers, L = 3, memory["tokens"]
    assert memory["lr_bytes"] == {
        a: layers * L * r * 4 for a, r in {"plan": 4, "act": 2, "reflect": 3}.items()
    }


# ------------------------------------------------------------------ k_proj refused, lr_keys option
@pytest.mark.parametrize("method", LORA_METHODS)
def test_k_proj_refused_by_default(tokenizer, method):
    model = lora_model("llama", roles={"plan": 2, "act": 2}, targets=["q_proj", "k_proj", "v_proj"])
    before = _state(model)
    with pytest.raises(ValueError, match=r"\['plan', 'act'\] have a LoRA on k_proj.*lr_keys=True") as info:
        Session(model, tokenizer, method)
    assert "--targets q_proj v_proj" in str(info.value)
    assert _state(model) == before


def test_k_proj_adapter_added_later_refused_before_the_turn_mutates_anything(tokenizer):
    model = lora_model("llama", roles={"plan": 2}, targets=QV)
    session = Session(model, tokenizer, "prelrshared")
    run_trajectory(session, ["plan"])
    model.add_adapter("critic", lora_config(2, ["k_proj", "v_proj"]))
    try:
        before = (dict(session.slots), session.method_state["prelrshared"].length, len(session.turns))
        state = _state(model)
        with pytest.raises(ValueError, match=r"\['critic'\] have a LoRA on k_proj.*lr_keys=True"):
            session.run_turn(
                "plan", [PH("query"), PH("instruction0"), PH("plan"), PH("x", "go")], max_new_tokens=2
            )
        assert (dict(session.slots), session.method_state["prelrshared"].length, len(session.turns)) == before
        assert _state(model) == state
    finally:
        model.delete_adapter("critic")


def test_adapter_without_v_proj_refused_by_default(tokenizer):
    model = lora_model("llama", roles={"plan": 2}, targets=QV)
    model.add_adapter("asker", lora_config(2, ["q_proj"]))
    with pytest.raises(ValueError, match=r"\['asker'\] have no LoRA on any v_proj.*lr_keys=True"):
        Session(model, tokenizer, "prelrshared")
    with pytest.warns(UserWarning, match="'asker' has no LoRA on any k_proj/v_proj"):
        Session(model, tokenizer, "prelrshared", lr_keys=True)


def test_lr_keys_option_enables_the_key_extension(tokenizer):
    """With lr_keys=True a k_proj LoRA is accepted and gives each agent a low-rank key term."""
    model = lora_model("llama", roles={"plan": 2, "act": 3}, targets=["q_proj", "k_proj", "v_proj"])
    with pytest.raises(ValueError, match="k_proj"):
        LoraBank(model)
    assert LoraBank(model, lr_keys=True).keys[0].adapters == ("plan", "act")
    exact = run_trajectory(Session(model, tokenizer, "nonshared"), ["plan", "act"], keep_cache=True)
    session = Session(model, tokenizer, "prelrshared", lr_keys=True)
    got = run_trajectory(session, ["plan", "act"], forced=[r.output_ids for r in exact], keep_cache=True)
    n = got[1].cache.view.length
    _assert_caches_close(got[1], exact[1], n, layers=[0])  # layer 0 exact, keys included
    store = session.method_state["prelrshared"]
    assert store.lr["act"].keys[0] is not None
    assert (got[1].cache.layer_kv(0)[0][:1, :, :n] - store.base(0, 0, n)[0]).abs().max() > 1e-3
    assert "lr_keys=True" in repr(session.method)


def test_bad_lr_keys_option():
    with pytest.raises(ValueError, match="lr_keys must be True or False"):
        METHODS["prelrshared"](lr_keys="yes")


# ------------------------------------------------------------------ baselrshared
def test_baselrshared_equals_prelrshared_with_shared_lora_a(qv_model, tokenizer):
    """Shared v_proj lora_A: every agent's A x is the same, so one LR cache gives PreLRShared's K/V."""
    ref = run_trajectory(Session(qv_model, tokenizer, "nonshared"), AGENTS)
    forced = [r.output_ids for r in ref]
    sessions = {m: Session(qv_model, tokenizer, m) for m in ("prelrshared", "baselrshared")}
    results = {m: run_trajectory(s, AGENTS, forced=forced, keep_cache=True) for m, s in sessions.items()}
    for a, b in zip(results["prelrshared"][1:], results["baselrshared"][1:]):
        assert a.cache.view.length == b.cache.view.length > 0
        assert a.tokens_prefilled == b.tokens_prefilled
        for layer in range(a.cache.num_layers):
            for x, y in zip(a.cache.layer_kv(layer), b.cache.layer_kv(layer)):
                torch.testing.assert_close(x, y, atol=2e-6, rtol=1e-5)
    pre = sessions["prelrshared"].method.session_memory(sessions["prelrshared"])
    one = sessions["baselrshared"].method.session_memory(sessions["baselrshared"])
    assert list(one["lr_bytes"]) == [SHARED_LR] and one["base_bytes"] == pre["base_bytes"]
    assert one["lr_bytes"][SHARED_LR] == pre["lr_bytes"]["plan"]
    assert one["total_bytes"] < pre["total_bytes"]


def test_baselrshared_refuses_unshared_lora_a(tokenizer):
    model = lora_model("llama", roles=SAME_RANK, targets=QV, seed=3)  # independent lora_A per adapter
    before = _state(model)
    with pytest.raises(ValueError, match=r"adapter 'act' has a lora_A there that differs from 'plan'.*"
                       r"layers\.0\.self_attn\.v_proj.*--shared-lora-a"):  # fmt: skip
        Session(model, tokenizer, "baselrshared")
    assert _state(model) == before
    Session(model, tokenizer, "prelrshared")  # the per-agent variants accept them
    share_value_down(model)
    Session(model, tokenizer, "baselrshared")
    other = lora_model("llama", roles={"plan": 4, "act": 2}, targets=QV)
    with pytest.raises(ValueError, match=r"'act' has rank 2 there, 'plan' rank 4"):
        Session(other, tokenizer, "baselrshared")


def test_baselrshared_refuses_an_unshared_adapter_added_later(tokenizer):
    model = lora_model("llama", roles=SAME_RANK, targets=QV)
    share_value_down(model)
    session = Session(model, tokenizer, "baselrshared")
    run_trajectory(session, ["plan"])
    model.add_adapter("critic", lora_config(4, QV))
    try:
        length = session.method_state["baselrshared"].length
        with pytest.raises(ValueError, match="'critic'.*--shared-lora-a"):
            session.run_turn("act", [PH("query", QUERY), PH("x", "go")], max_new_tokens=2)
        assert session.method_state["baselrshared"].length == length and len(session.turns) == 1
    finally:
        model.delete_adapter("critic")

"""PReCache on tiny random Llama / Qwen2 models with random LoRA adapters: exactness of the base +
low-rank decomposition, the neutral base, LP == DB, and clear errors.

These adapters are on q, k, v and o (some also on the MLP), so the methods run with ``lr_keys=True``,
our key extension beyond the reference code (``KEYS``). The reference's value-only default (q/v
adapters, k_proj refused) and ``baselrshared`` are in ``test_precache_reference.py``."""

from __future__ import annotations

import warnings

import pytest
import torch
from lora_helpers import ATTENTION_AND_MLP, QUERY, lora_config, lora_model, run_trajectory

from hf_kvshare import METHODS, PF, PH, BaseLRCache, Session, cache_kwargs
from hf_kvshare.lora import AbsoluteRope, LoraBank, LowRankStore
from hf_kvshare.lora.view import split_heads

PRECACHE = ["baseshared", "prelrshared", "rebaseshared-lp", "rebaseshared-db"]
KEYS = {"lr_keys": True}  # these tests' adapters have a LoRA on k_proj (beyond the reference)
LOOP = ["plan", "act", "plan", "reflect", "act"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def peft_pair(request):
    """(PeftModel with plan/act/reflect adapters on attention, the bare model before wrapping)."""
    return lora_model(request.param, keep_base=True)


@pytest.fixture(scope="module")
def peft_llama():
    return lora_model("llama")


def test_registry_has_precache_methods():
    assert set(PRECACHE) <= set(METHODS)


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("method", ["prelrshared", "baseshared"])
def test_one_agent_equals_nonshared(peft_pair, tokenizer, method):
    """With one agent the shared base is the agent's own: sharing is exact, only new tokens are computed.
    (ReBaseShared is not: its base is the adapter-free one by design.)"""
    model, _ = peft_pair
    exact = run_trajectory(Session(model, tokenizer, "nonshared"), ["plan"] * 4)
    shared = run_trajectory(Session(model, tokenizer, method, **KEYS), ["plan"] * 4)
    assert [r.output_ids.tolist() for r in shared] == [r.output_ids.tolist() for r in exact]
    assert all(s.tokens_prefilled < e.tokens_prefilled for s, e in zip(shared[1:], exact[1:]))
    assert all(r.reuse_ratio > 0.5 for r in shared[1:])


@pytest.mark.parametrize("method", ["prelrshared", "rebaseshared-lp", "rebaseshared-db", "baseshared"])
def test_layer0_base_plus_lowrank_equals_adapted_keys(peft_pair, tokenizer, method):
    """Layer 0 sees the same input for every agent, so K_base + rope(s B A x) must be the agent's own key."""
    model, _ = peft_pair
    agents = ["plan", "act", "reflect", "act"]
    exact = run_trajectory(Session(model, tokenizer, "nonshared"), agents, keep_cache=True)
    forced = [r.output_ids for r in exact]
    shared = run_trajectory(Session(model, tokenizer, method, **KEYS), agents, forced=forced, keep_cache=True)
    for got, ref in zip(shared[1:], exact[1:]):
        assert isinstance(got.cache, BaseLRCache)
        # everything the store held: read from it, or (baseshared) re-processed on top of the shared base
        n = max(s.end for s in got.segments if s.provenance in ("reused", "recomputed"))
        assert n >= got.cache.view.length and n > 0
        k, v = got.cache.layer_kv(0)
        ek, ev = ref.cache.layer_kv(0)
        torch.testing.assert_close(k[:1, :, :n], ek[..., :n, :], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(v[:1, :, :n], ev[..., :n, :], atol=2e-6, rtol=1e-5)


def test_layer0_decomposition_by_hand(peft_llama, tokenizer):
    """K_base + rope(s_b B_b (A_b x)) from the store, computed here by hand, equals agent b's layer-0 key."""
    model = peft_llama
    session = Session(model, tokenizer, "prelrshared", **KEYS)
    run_trajectory(session, ["plan", "act"])
    store: LowRankStore = session.method_state["prelrshared"]
    bank, rope = LoraBank(model, lr_keys=True), AbsoluteRope(model)
    ids = store.ids
    for agent in ["plan", "act", "reflect"]:
        base_k, base_v = store.base(0, 0, store.length)
        ak, av = store.agent_lr(agent, 0, 0, store.length)
        lr_k = split_heads(bank.keys[0].up(agent, ak), bank.head_dim)
        cos, sin = rope.cos_sin(0, store.length, lr_k.dtype, lr_k.device)
        k = base_k + AbsoluteRope.apply(lr_k, cos, sin)
        v = base_v + split_heads(bank.values[0].up(agent, av), bank.head_dim)
        model.set_adapter(agent)
        ek, ev = _dense_cache(model, ids)
        torch.testing.assert_close(k, ek, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(v, ev, atol=2e-6, rtol=1e-5)
        assert (k - base_k).abs().max() > 1e-3  # the LR part matters
    model.set_adapter("plan")


def _dense_cache(model, ids, layer=0):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[None], use_cache=True, **cache_kwargs(cache))
    return cache.layers[layer].keys, cache.layers[layer].values


def test_neutral_base_equals_base_model_cache(peft_pair, tokenizer):
    """rebaseshared's base is the adapter-free model's own cache, whichever agents ran."""
    model, plain = peft_pair
    agents = ["plan", "act", "reflect", "plan"]
    first = run_trajectory(Session(model, tokenizer, "rebaseshared-lp", **KEYS), agents)
    session = Session(model, tokenizer, "rebaseshared-lp", **KEYS)
    run_trajectory(session, ["act"] * 4, forced=[r.output_ids for r in first])
    store = session.method_state["rebaseshared-lp"]
    # the same chunks the store was built from (each turn's new tokens), run by the bare model
    from transformers import DynamicCache

    chunked = DynamicCache(config=plain.config)
    starts = _turn_starts(session)
    with torch.no_grad():
        for lo, hi in zip(starts, [*starts[1:], store.length]):
            plain(
                input_ids=store.ids[None, lo:hi],
                position_ids=torch.arange(lo, hi)[None],
                use_cache=True,
                **cache_kwargs(chunked),
            )
    one_shot = DynamicCache(config=plain.config)
    with torch.no_grad():
        plain(input_ids=store.ids[None], use_cache=True, **cache_kwargs(one_shot))
    for layer in range(plain.config.num_hidden_layers):
        k, v = store.base(layer, 0, store.length)
        assert torch.equal(k, chunked.layers[layer].keys) and torch.equal(v, chunked.layers[layer].values)
        torch.testing.assert_close(k, one_shot.layers[layer].keys, atol=1e-5, rtol=1e-4)


def _turn_starts(session) -> list[int]:
    """Where each recorded turn's new tokens began in the stored trajectory."""
    starts = []
    for turn in session.turns:
        dense = [s for s in turn.segments if s.provenance == "dense"]
        starts.append(dense[0].start)
    return starts


@pytest.mark.parametrize("own_lr", ["adapted", "neutral"])
def test_lazy_prefill_and_double_batching_build_the_same_caches(peft_pair, tokenizer, own_lr):
    model, _ = peft_pair
    agents = ["plan", "act", "reflect", "plan"]
    free = run_trajectory(Session(model, tokenizer, "rebaseshared-lp", own_lr=own_lr, **KEYS), agents)
    forced = [r.output_ids for r in free]
    sessions = {}
    for method in ("rebaseshared-lp", "rebaseshared-db"):
        sessions[method] = Session(model, tokenizer, method, own_lr=own_lr, **KEYS)
        run_trajectory(sessions[method], agents, forced=forced)
    lp = sessions["rebaseshared-lp"].method_state["rebaseshared-lp"]
    db = sessions["rebaseshared-db"].method_state["rebaseshared-db"]
    assert torch.equal(lp.ids, db.ids) and lp.length > 40
    for layer in range(lp.num_layers):
        for a, b in zip(lp.base(layer, 0, lp.length), db.base(layer, 0, db.length)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert set(lp.lr) == set(db.lr) == {"plan", "act", "reflect"}
    for agent in lp.lr:
        assert lp.coverage(agent) == db.coverage(agent) == lp.length
        for layer in range(lp.num_layers):
            for a, b in zip(lp.agent_lr(agent, layer, 0, lp.length), db.agent_lr(agent, layer, 0, lp.length)):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # and DB's free-running outputs are LP's (row 0 of the double batch is the agent)
    db_free = run_trajectory(Session(model, tokenizer, "rebaseshared-db", own_lr=own_lr, **KEYS), agents)
    assert [r.output_ids.tolist() for r in db_free] == [r.output_ids.tolist() for r in free]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_attention_and_mlp_lora_with_rslora(tokenizer, arch):
    """LoRA on attention and MLP, rsLoRA scaling (alpha / sqrt(r)), and (Qwen2) k/v biases."""
    model = lora_model(arch, targets=ATTENTION_AND_MLP, use_rslora=True, seed=3)
    kproj = model.get_submodule("base_model.model.model.layers.0.self_attn.k_proj")
    assert kproj.scaling["plan"] == pytest.approx(2 * 4 / 4**0.5)
    assert (kproj.get_base_layer().bias is not None) == (arch == "qwen2")
    exact = run_trajectory(Session(model, tokenizer, "nonshared"), ["act"] * 3)
    shared = run_trajectory(Session(model, tokenizer, "prelrshared", **KEYS), ["act"] * 3)
    assert [r.output_ids.tolist() for r in shared] == [r.output_ids.tolist() for r in exact]
    # several agents: layer 0 is exact, deeper layers are not (the MLP LoRA changes hidden states)
    agents = ["plan", "act", "reflect"]
    ref = run_trajectory(Session(model, tokenizer, "nonshared"), agents, keep_cache=True)
    got = run_trajectory(
        Session(model, tokenizer, "prelrshared", **KEYS),
        agents,
        forced=[r.output_ids for r in ref],
        keep_cache=True,
    )
    n = got[-1].cache.view.length
    torch.testing.assert_close(
        got[-1].cache.layer_kv(0)[0][..., :n, :], ref[-1].cache.layer_kv(0)[0][..., :n, :]
    )
    deep = got[-1].cache.layer_kv(2)[0][..., :n, :] - ref[-1].cache.layer_kv(2)[0][..., :n, :]
    assert deep.abs().max() > 1e-4


def test_adapters_on_some_layers_only(tokenizer):
    """LoRA on layers 1-2 only (``layers_to_transform``): layer 0 has no LR part for anyone."""
    model = lora_model("llama", roles={"plan": 2}, layers_to_transform=[1, 2])
    model.add_adapter("act", lora_config(3, layers_to_transform=[2]))
    bank = LoraBank(model, lr_keys=True)
    assert bank.keys[0].adapters == () and bank.keys[2].adapters == ("plan", "act")
    exact = run_trajectory(Session(model, tokenizer, "nonshared"), ["act"] * 3)
    for method in ("prelrshared", "baseshared"):
        got = run_trajectory(Session(model, tokenizer, method, **KEYS), ["act"] * 3)
        assert [r.output_ids.tolist() for r in got] == [r.output_ids.tolist() for r in exact]
    session = Session(model, tokenizer, "rebaseshared-lp", **KEYS)
    run_trajectory(session, ["plan", "act", "plan"])
    memory = session.method.session_memory(session)
    assert memory["lr_bytes"]["act"] == 2 * 1 * memory["tokens"] * 3 * 4  # one layer, k and v, rank 3


@pytest.mark.parametrize("method", ["prelrshared", "baseshared", "rebaseshared-lp", "rebaseshared-db"])
def test_lazy_materialization_matches_turn(peft_llama, tokenizer, method):
    turn = Session(peft_llama, tokenizer, method, **KEYS)
    lazy = Session(peft_llama, tokenizer, method, materialize="lazy", **KEYS)
    a = run_trajectory(turn, LOOP)
    b = run_trajectory(lazy, LOOP, keep_cache=True)
    assert [r.output_ids.tolist() for r in a] == [r.output_ids.tolist() for r in b]
    assert b[-1].cache.materialize == "lazy"
    # a lazy cache holds only what the turn appended, the prefix stays in the store; a kept one of a
    # method that rebuilds the base after the turn (ReBaseShared) copies out what it read
    rebuilds = METHODS[method]().neutral is not None
    assert (b[-1].cache.nbytes < b[-1].cache.memory()["base_bytes"]) != rebuilds
    assert b[-1].cache.copy().get_seq_length() == b[-1].cache.get_seq_length()
    # every kept turn's full K/V can be read back, the first turn's (no stored prefix) included
    for r, ref in zip(
        b, run_trajectory(Session(peft_llama, tokenizer, method, **KEYS), LOOP, keep_cache=True)
    ):
        for layer in range(len(r.cache.layers)):
            for x, y in zip(r.cache.layer_kv(layer), ref.cache.layer_kv(layer)):
                torch.testing.assert_close(x, y)


def test_baseshared_reprocesses_only_unseen_context(peft_llama, tokenizer):
    exact = run_trajectory(Session(peft_llama, tokenizer, "nonshared"), LOOP)
    base = run_trajectory(Session(peft_llama, tokenizer, "baseshared", **KEYS), LOOP)
    prelr = run_trajectory(Session(peft_llama, tokenizer, "prelrshared", **KEYS), LOOP)
    # act's first turn: nothing seen, so it runs the whole prompt like NonShared
    assert base[1].tokens_prefilled == exact[1].tokens_prefilled
    # plan's second turn re-processes only what came after its first turn
    assert prelr[2].tokens_prefilled < base[2].tokens_prefilled < exact[2].tokens_prefilled
    segments = {s.provenance for s in base[2].segments}
    assert {"reused", "recomputed", "dense"} <= segments


def test_memory_is_base_once_plus_small_lr_caches(peft_llama, tokenizer):
    session = Session(peft_llama, tokenizer, "prelrshared", **KEYS)
    results = run_trajectory(session, LOOP, keep_cache=True)
    memory = session.method.session_memory(session)
    layers, kv_heads, head_dim = 3, 2, 16
    L = memory["tokens"]
    assert memory["base_bytes"] == 2 * layers * L * kv_heads * head_dim * 4
    # rank r on k_proj and v_proj of each layer, float32
    assert memory["lr_bytes"] == {
        a: 2 * layers * L * r * 4 for a, r in {"plan": 4, "act": 2, "reflect": 3}.items()
    }
    assert memory["total_bytes"] == memory["base_bytes"] + sum(memory["lr_bytes"].values())
    assert results[-1].cache.memory()["total_bytes"] == memory["total_bytes"]


def test_diverging_trajectory_truncates_the_store(peft_llama, tokenizer):
    session = Session(peft_llama, tokenizer, "prelrshared", **KEYS)
    exact = Session(peft_llama, tokenizer, "nonshared")
    for s in (session, exact):
        run_trajectory(s, ["plan", "plan"])
    long_length = session.method_state["prelrshared"].length
    branch = [PH("query"), PH("instruction0"), PH("plan"), PF("\nA different second step:")]
    got = session.run_turn("plan", branch, max_new_tokens=6)
    ref = exact.run_turn("plan", branch, max_new_tokens=6)
    assert got.output_ids.tolist() == ref.output_ids.tolist()
    store = session.method_state["prelrshared"]
    assert store.length < long_length + got.output_ids.numel()
    assert store.length == got.prompt_ids.numel() + got.output_ids.numel() - 1
    assert torch.equal(store.ids, torch.cat([got.prompt_ids, got.output_ids])[: store.length])


# ------------------------------------------------------------------ LoRA on a PeftModel, foundation methods
@pytest.mark.parametrize("method", ["nonshared", "fullshared"])
def test_foundation_methods_select_the_agents_adapter(peft_llama, tokenizer, method):
    model = peft_llama
    session = Session(model, tokenizer, method)
    r = session.run_turn("act", [PF("You act.\n"), PH("query", QUERY)], max_new_tokens=6)
    model.set_adapter("act")
    with torch.no_grad():
        out = model.generate(
            input_ids=r.prompt_ids[None],
            attention_mask=torch.ones_like(r.prompt_ids)[None],
            max_new_tokens=6,
            do_sample=False,
        )
    model.set_adapter("plan")
    assert r.output_ids.tolist() == session._strip_eos(out[0, r.prompt_ids.numel() :]).tolist()
    assert model.active_adapters == ["plan"]  # restored after the turn


def test_turns_leave_the_model_as_they_found_it(peft_llama, tokenizer):
    model = peft_llama
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    run_trajectory(Session(model, tokenizer, "rebaseshared-db", **KEYS), ["act", "reflect"])
    assert model.active_adapters == ["plan"]
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    hooks = [m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks]
    assert hooks == []


# ------------------------------------------------------------------ clear errors
def test_unknown_adapter_name_mutates_nothing(peft_llama, tokenizer):
    session = Session(peft_llama, tokenizer, "prelrshared", **KEYS)
    run_trajectory(session, ["plan"])
    before = (dict(session.slots), session.method_state["prelrshared"].length)
    with pytest.raises(ValueError, match=r"agent 'critic' is not an adapter.*plan, act, reflect"):
        session.run_turn("critic", [PH("query"), PH("new", "more")], max_new_tokens=2)
    assert (dict(session.slots), session.method_state["prelrshared"].length) == before
    with pytest.raises(ValueError, match="not an adapter"):
        Session(peft_llama, tokenizer, "nonshared").run_turn("critic", [PH("query", QUERY)], max_new_tokens=2)


def test_merged_adapter_refused(tokenizer):
    model = lora_model("llama", roles={"plan": 2, "act": 2})
    model.merge_adapter(["plan"])
    with pytest.raises(ValueError, match=r"merged.*unmerge_adapter"):
        Session(model, tokenizer, "prelrshared")
    with pytest.raises(ValueError, match=r"merged.*unmerge_adapter"):
        Session(model, tokenizer, "nonshared").run_turn("act", [PH("query", QUERY)], max_new_tokens=2)
    model.unmerge_adapter()
    Session(model, tokenizer, "prelrshared", **KEYS).run_turn("act", [PH("query", QUERY)], max_new_tokens=2)


def test_dora_refused(tokenizer):
    model = lora_model("llama", roles={"plan": 2, "act": 2}, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        Session(model, tokenizer, "prelrshared")


def test_adapter_without_kv_lora_is_rank_zero(tokenizer):
    model = lora_model("llama", roles={"plan": 2})
    model.add_adapter("mlp_only", lora_config(3, ["up_proj", "down_proj"]))
    with pytest.warns(UserWarning, match=r"'mlp_only' has no LoRA on any k_proj/v_proj.*rank 0"):
        session = Session(model, tokenizer, "prelrshared", **KEYS)
    results = run_trajectory(session, ["plan", "mlp_only", "plan"])
    memory = session.method.session_memory(session)
    assert memory["lr_bytes"]["mlp_only"] == 0 and memory["lr_bytes"]["plan"] > 0
    assert results[1].reuse_ratio > 0.5
    # its cache over the shared context is exactly the shared base
    ref = run_trajectory(
        Session(model, tokenizer, "prelrshared", **KEYS), ["plan", "mlp_only"], keep_cache=True
    )
    n = ref[1].cache.view.length
    k0 = ref[1].cache.layer_kv(1)[0][..., :n, :]
    assert torch.equal(k0, ref[1].cache.view.store.base(1, 0, n)[0])


def test_model_without_peft_or_in_training_mode(tiny_llama, tokenizer):
    with pytest.raises(ValueError, match=r"need a peft.PeftModel.*get_peft_model"):
        Session(tiny_llama, tokenizer, "prelrshared")
    model = lora_model("llama", roles={"plan": 2})
    session = Session(model, tokenizer, "prelrshared", **KEYS)
    model.train()
    try:
        with pytest.raises(ValueError, match="eval mode"):
            session.run_turn("plan", [PH("query", QUERY)], max_new_tokens=2)
    finally:
        model.eval()


def test_double_batching_with_sampling_falls_back_to_lazy_prefill(peft_llama, tokenizer):
    """Sampled rows drift apart; DB then rebuilds the neutral base like LP (warned), never a corrupt one."""
    session = Session(peft_llama, tokenizer, "rebaseshared-db", **KEYS)
    run_trajectory(session, ["plan"])
    torch.manual_seed(0)
    segments = [PH("query"), PH("instruction0"), PH("plan"), PH("x", "go")]
    with pytest.warns(UserWarning, match="lazy prefill"):
        r = session.run_turn("act", segments, max_new_tokens=8, do_sample=True, top_k=0)
    assert [m for m in peft_llama.modules() if m._forward_pre_hooks] == []
    lp = Session(peft_llama, tokenizer, "rebaseshared-lp", **KEYS)
    run_trajectory(lp, ["plan"], forced=[session.turns[0].output_ids])
    lp.run_turn("act", segments, force_output=r.output_ids)
    a, b = session.method_state["rebaseshared-db"], lp.method_state["rebaseshared-lp"]
    assert torch.equal(a.ids, b.ids)
    for layer in range(a.num_layers):
        torch.testing.assert_close(
            a.base(layer, 0, a.length), b.base(layer, 0, b.length), atol=1e-5, rtol=1e-4
        )


def test_bad_options():
    with pytest.raises(ValueError, match="materialize"):
        METHODS["prelrshared"](materialize="eager")
    with pytest.raises(ValueError, match="own_lr applies to rebaseshared"):
        METHODS["prelrshared"](own_lr="neutral")


def test_no_deprecation_warnings(peft_llama, tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for method in PRECACHE:
            run_trajectory(Session(peft_llama, tokenizer, method, **KEYS), ["plan", "act"], max_new_tokens=3)

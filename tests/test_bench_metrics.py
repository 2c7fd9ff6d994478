"""Metric functions on hand-built inputs: statistics, KV error and effective rank, fidelity, answers, sandbox."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_config

from hf_kvshare.bench import checkers
from hf_kvshare.bench.sandbox import run_python
from hf_kvshare.cache import SegmentedCache
from hf_kvshare.evaluation import metrics, protocol


def test_percentiles_and_latency_stats():
    assert metrics.percentile([3, 1, 2], 50) == 2
    assert metrics.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # numpy's linear interpolation
    stats = metrics.latency_stats([0.5, 1.5, 1.0, 4.0])
    assert stats == {"mean": 1.75, "p50": 1.25, "p90": pytest.approx(3.25), "n": 4}
    assert math.isnan(metrics.latency_stats([])["mean"])
    with pytest.raises(ValueError):
        metrics.percentile([1], 101)
    assert metrics.throughput(300, 2.0) == 150 and math.isnan(metrics.throughput(3, 0))
    assert metrics.ratio(2.0, 0.5) == 4.0 and math.isnan(metrics.ratio(1.0, 0.0))
    assert metrics.reuse_ratio(30, 40) == 0.75 and metrics.reuse_ratio(0, 0) == 0.0


def _cache(keys, values):
    config = tiny_config("llama", num_hidden_layers=len(keys))
    cache = SegmentedCache(config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache


def test_kv_error_terms_by_layer_and_over_segments():
    torch.manual_seed(0)
    exact_k = [torch.randn(1, 2, 6, 16) for _ in range(2)]
    exact_v = [torch.randn(1, 2, 6, 16) for _ in range(2)]
    approx_k = [exact_k[0] * 1.1, exact_k[1].clone()]  # layer 0 keys off by 10%, layer 1 exact
    approx_v = [exact_v[0].clone(), exact_v[1] * 0.5]  # layer 1 values off by 50%
    exact, approx = _cache(exact_k, exact_v), _cache(approx_k, approx_v)
    terms = metrics.kv_error_terms(approx, exact, 0, 6)
    layer0, layer1 = metrics.relative_from_terms([terms[0]]), metrics.relative_from_terms([terms[1]])
    assert layer0["key"] == pytest.approx(0.1) and layer0["value"] == 0.0
    assert layer1["key"] == 0.0 and layer1["value"] == pytest.approx(0.5)
    both = metrics.relative_from_terms(terms)["kv"]
    num = 0.01 * exact_k[0].pow(2).sum() + 0.25 * exact_v[1].pow(2).sum()
    den = sum(t.pow(2).sum() for t in exact_k + exact_v)
    assert both == pytest.approx((num / den).sqrt().item())
    # a span: only positions [2, 4) count
    approx_k2 = [exact_k[0].clone(), exact_k[1].clone()]
    approx_k2[0][..., 0, :] += 100.0  # outside the span
    assert (
        metrics.relative_from_terms(metrics.kv_error_terms(_cache(approx_k2, exact_v), exact, 2, 4))["kv"]
        == 0.0
    )


def test_effective_rank():
    u, v = torch.randn(40, 3, dtype=torch.float64), torch.randn(3, 24, dtype=torch.float64)
    assert metrics.effective_rank(u @ v, energy=0.999999) == 3
    diag = torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.0]))  # energies 9, 4, 1 of 14
    assert metrics.effective_rank(diag, 0.6) == 1 and metrics.effective_rank(diag, 0.9) == 2
    assert metrics.effective_rank(diag, 0.95) == 3 and metrics.effective_rank(torch.zeros(4, 4)) == 0
    with pytest.raises(ValueError):
        metrics.effective_rank(diag, 0)
    kv = torch.randn(1, 2, 5, 8)
    m = metrics.kv_matrix(kv)
    assert m.shape == (5, 16) and torch.equal(m[3, 8:], kv[0, 1, 3].double())


def test_erank_by_layer_of_a_rank_one_residual():
    torch.manual_seed(1)
    exact_k = [torch.randn(1, 2, 8, 16)]
    exact_v = [torch.randn(1, 2, 8, 16)]
    bump = torch.outer(torch.randn(8), torch.randn(32)).reshape(8, 2, 16).permute(1, 0, 2)[None]
    approx = _cache([exact_k[0] + bump], [exact_v[0].clone()])
    row = metrics.erank_by_layer(approx, _cache(exact_k, exact_v), 0, 8, energy=0.99)[0]
    assert row["delta_key"] == 1 and row["delta_value"] == 0 and row["base_key"] > 4
    noisy = _cache([exact_k[0] * (1 + 1e-7)], [exact_v[0] + 1e-8 * torch.randn_like(exact_v[0])])
    row = metrics.erank_by_layer(noisy, _cache(exact_k, exact_v), 0, 8)[0]
    assert row["delta_key"] == 0 and row["delta_value"] == 0  # floating-point noise is not a correction


def test_fidelity_helpers():
    ref = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    same_first = torch.tensor([[0.0, 2.0, 1.0], [0.0, 0.0, 3.0]])
    assert metrics.first_token_agreement(ref, same_first) == 1.0
    assert metrics.first_token_agreement(ref, same_first.flip(0)) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        metrics.first_token_agreement(ref, ref[:1])
    assert metrics.exact_match([1, 2, 3], torch.tensor([1, 2, 3])) and not metrics.exact_match(
        [1, 2], [1, 2, 3]
    )
    assert metrics.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and metrics.common_prefix([], [1]) == 0


def test_answer_extraction_and_matching():
    assert checkers.gsm8k_gold("Some steps.\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="no number"):
        checkers.gsm8k_gold("#### many")
    assert checkers.extract_number("3 + 4 = 7. So the answer is 12 apples, not 7") == 12
    assert checkers.extract_number("We get 5, then 8.5.") == 8.5 and checkers.extract_number("none") is None
    assert checkers.numeric_match("The answer is $1,200.", "1200") and not checkers.numeric_match(
        "The answer is 12", "1200"
    )
    assert checkers.numeric_match("answer: -3.0", "-3")
    assert (
        checkers.extract_letter("C") == "C" and checkers.extract_letter("I think the answer is (B).") == "B"
    )
    assert (
        checkers.extract_letter("A farmer would say\nD\nbecause") == "D"
    )  # a line holding only the letter wins
    assert checkers.extract_letter("D. Because ...") == "D" and checkers.extract_letter("no idea") is None
    assert checkers.letter_match("B", "b") and not checkers.letter_match("A", "B")
    assert (
        checkers.extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone")
        == "def f():\n    return 1"
    )
    assert checkers.extract_code("    return x") == "    return x"


PROBLEM = {
    "task_id": "toy/0",
    "prompt": 'from typing import List\n\n\ndef add(a: int, b: int) -> int:\n    """Add two numbers."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}


def test_humaneval_programs_and_sandbox():
    full = "```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```"
    program = checkers.humaneval_program(PROBLEM, full)
    assert program.startswith("from typing import List\ndef add") and program.rstrip().endswith("check(add)")
    body = checkers.humaneval_program(PROBLEM, "    return a + b\n")
    assert body.startswith(PROBLEM["prompt"] + "    return a + b")
    assert run_python(program).passed and run_python(body).passed
    wrong = run_python(checkers.humaneval_program(PROBLEM, "    return a - b\n"))
    assert not wrong.passed and wrong.status == "failed" and "AssertionError" in wrong.detail
    hang = run_python("while True:\n    pass\n", timeout=1.0)
    assert hang.status == "timeout" and not hang.passed
    guarded = run_python("import os\nos.remove('x')\n")  # destructive calls are disabled
    assert guarded.status == "failed" and "NoneType" in guarded.detail


def test_check_answer_dispatch():
    from hf_kvshare.bench.workloads import AgentSpec, StepSpec, TaskSpec

    def task(checker, answer=None, meta=None):
        return TaskSpec(
            id="t",
            agents=[AgentSpec(name="a")],
            slots=[],
            schedule=[StepSpec(agent="a")],
            answer=answer,
            checker=checker,
            meta=meta or {},
        )

    assert checkers.check_answer(task(None), "x")["correct"] is None
    assert checkers.check_answer(task("numeric", "7"), "The answer is 7")["correct"] is True
    assert checkers.check_answer(task("letter", "A"), "B")["correct"] is False
    assert checkers.check_answer(task("exact", "yes"), " yes\n")["correct"] is True
    final = "Reflection: Vosa was founded in 1201 on the Lirose. Answer: lirose.<|im_end|>"
    assert checkers.check_answer(task("answer", "Lirose"), final) == {
        "correct": True,
        "extracted": "lirose",
        "status": "checked",
    }
    assert (
        checkers.check_answer(task("answer", "Lirose"), "Answer: Duar. Lirose is a river.")["correct"]
        is False
    )
    assert checkers.check_answer(task("answer", "Lirose"), "the Lirose")["correct"] is False  # no "Answer:"
    assert checkers.extract_answer("answer: 1200.5 years. More") == "1200.5 years"
    he = task("humaneval", meta=PROBLEM)
    assert checkers.check_answer(he, "    return a + b")["correct"] is None  # execution is opt-in
    assert checkers.check_answer(he, "    return a + b", execute=True)["correct"] is True


def test_pareto_front():
    points = [(1.0, 0.5), (2.0, 0.9), (3.0, 0.8), (0.5, 0.2), (2.0, 0.7), (float("nan"), 1.0)]
    assert metrics.pareto_front(points) == [3, 0, 1]  # sorted by time; (3, .8) and (2, .7) are dominated
    assert metrics.pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [0, 1]  # equal points do not dominate each other


def _turn(position, reuse, ttft, ref_ttft, reused, reusable, **extra):
    return {
        "position": position,
        "agent": f"a{position}",
        "reuse_turn": reuse,
        "ttft_s": ttft,
        "ref_ttft_s": ref_ttft,
        "tokens_reused": reused,
        "reusable_ph_tokens": reusable,
        "ph_tokens": reusable + 10,
        "reuse_ratio": reused / reusable if reusable else None,
        "exact_match": extra.pop("exact", True),
        **extra,
    }


def test_summarize_method_on_hand_built_records():
    fid = dict(first_token_agreement=1.0, kl=0.1)
    turns = [
        _turn(0, False, 4.0, 4.0, 0, 0, agreement=1.0, kv_error=0.0, **fid),
        _turn(
            1,
            True,
            1.0,
            4.0,
            80,
            100,
            agreement=0.8,
            kv_error=0.2,
            kv_error_by_layer=[[0.1, 0.3], [0.2, 0.4]],
            **fid,
        ),
        _turn(
            2,
            True,
            3.0,
            4.0,
            100,
            100,
            agreement=0.6,
            kv_error=0.4,
            kv_error_by_layer=[[0.3, 0.5], [0.4, 0.6]],
            exact=False,
            **fid,
        ),
    ]
    requests = [
        {
            "e2e_s": 10.0,
            "ref_e2e_s": 20.0,
            "trajectory_tokens": 500,
            "ref_trajectory_tokens": 500,
            "peak_memory_bytes": 2**20 * 100,
            "ref_peak_memory_bytes": 2**20 * 120,
            "method_state_bytes": 2**20,
            "final_exact_match": False,
            "correct": True,
            "ref_correct": False,
        }
    ]
    s = protocol.summarize_method(turns, requests)
    assert (
        s["reuse_turns"] == 2
        and s["ttft_mean_s"] == 2.0
        and s["ref_ttft_mean_s"] == 4.0
        and s["ttft_ratio"] == 2.0
    )
    assert s["ttft_p90_s"] == pytest.approx(2.8) and s["ttft_all_mean_s"] == pytest.approx(8 / 3)
    assert s["reuse_ratio"] == 0.9  # 180 of 200 reusable tokens
    assert s["reuse_ratio_all_ph"] == pytest.approx(180 / 230)
    assert s["agreement"] == pytest.approx(0.7) and s["kv_error"] == pytest.approx(
        0.3
    )  # over reuse turns only
    assert s["exact_match"] == pytest.approx(2 / 3) and s["final_exact_match"] == 0.0
    assert s["throughput_tok_s"] == 50 and s["ref_throughput_tok_s"] == 25 and s["throughput_ratio"] == 2.0
    assert s["e2e_ratio"] == 2.0 and s["peak_memory_mb"] == 100 and s["method_state_mb"] == 1.0
    assert s["accuracy"] == 1.0 and s["ref_accuracy"] == 0.0 and s["checked"] == 1
    assert s["kv_error_by_layer"] == [
        {"layer": 0, "key": pytest.approx(0.2), "value": pytest.approx(0.4)},
        {"layer": 1, "key": pytest.approx(0.3), "value": pytest.approx(0.5)},
    ]
    assert [p["agreement"] for p in s["by_position"]] == [1.0, 0.8, 0.6]
    with pytest.raises(ValueError):
        protocol.summarize_method([], [])


def test_fidelity_over_all_turns_counts_an_approximated_first_read():
    """A turn that reads nothing an earlier turn read (not a reuse turn) can still be approximated
    (KVComm corrects the first reader of an observation from a reference prefill): the reuse-turn
    means leave it out, the all-turn means and the count do not."""
    requests = [
        {
            "e2e_s": 1.0,
            "ref_e2e_s": 1.0,
            "trajectory_tokens": 10,
            "ref_trajectory_tokens": 10,
            "peak_memory_bytes": 0,
            "ref_peak_memory_bytes": 0,
            "final_exact_match": True,
        }
    ]
    first = dict(first_token_agreement=1.0, kl=0.3, agreement=0.5, kv_error=0.6, tokens_corrected=8)
    later = dict(first_token_agreement=1.0, kl=0.1, agreement=0.9, kv_error=0.2, tokens_corrected=8)
    turns = [_turn(0, False, 1.0, 1.0, 0, 0, **first), _turn(1, True, 1.0, 1.0, 8, 8, **later)]
    s = protocol.summarize_method(turns, requests)
    assert s["kl"] == pytest.approx(0.1) and s["kv_error"] == pytest.approx(0.2)  # reuse turns only
    assert s["kl_all_turns"] == pytest.approx(0.2) and s["kv_error_all_turns"] == pytest.approx(0.4)
    assert s["agreement_all_turns"] == pytest.approx(0.7) and s["approximated_first_reads"] == 1
    exact_first = dict(first, kl=0.0, agreement=1.0, kv_error=0.0, tokens_corrected=0)
    s = protocol.summarize_method([_turn(0, False, 1.0, 1.0, 0, 0, **exact_first), turns[1]], requests)
    assert s["approximated_first_reads"] == 0 and s["kl_all_turns"] == pytest.approx(0.05)


def test_hop_matrix_lays_methods_by_hop():
    from hf_kvshare.bench.report import hop_matrix

    methods = [
        {"method": "nonshared", "by_position": [{"position": 0, "agent": "a", "kv_error": 0.0}]},
        {
            "method": "droidspeak:layer_profile=runs/calibration/p.json",
            "by_position": [
                {"position": 0, "agent": "a", "kv_error": 0.0},
                {"position": 1, "agent": "b", "kv_error": 0.25},
            ],
        },
    ]
    lines = hop_matrix(methods, "kv_error").splitlines()
    assert lines[0] == "| method | 0 a | 1 b |"
    assert lines[2] == "| nonshared | 0.0000 | - |"  # a hop the method has no record of
    assert lines[3] == "| droidspeak:layer_profile=p.json | 0.0000 | 0.2500 |"  # file options by name
    with pytest.raises(ValueError, match="no per-hop metric 'ttft'"):
        hop_matrix(methods, "ttft")

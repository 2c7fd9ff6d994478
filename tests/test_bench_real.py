"""The stress workload on the embedded model: FullShared degrades where it should (marked: real_model)."""

from __future__ import annotations

import pytest

from hf_kvshare.bench import BenchRunner, MethodSpec, RunConfig, make_workload

pytestmark = pytest.mark.real_model


def test_stress_chain_separates_fullshared_from_nonshared(real, tmp_path):
    model, tok = real
    workload = make_workload("stress", hops=3, output_tokens=8, requests=1)
    config = RunConfig(
        workload="stress", workload_params=workload.params(), model="smollm2-135m", erank=False
    )
    summaries = BenchRunner(model, tok, workload, config, tmp_path, progress=False).run(
        [MethodSpec("fullshared")]
    )
    ref, full = summaries["nonshared"], summaries["fullshared"]
    assert ref["agreement"] == 1.0 and ref["kv_error"] == 0.0 and ref["kl"] == 0.0
    assert full["reuse_ratio"] == 1.0
    # the reused query / previous output carry another agent's long persona: a large cache deviation
    # that reaches the next-token distribution hop after hop (measured: KV error ~0.2, KL 0.03-0.3)
    hops = [p for p in full["by_position"] if p["position"] > 0]
    assert all(p["kv_error"] > 0.1 for p in hops), hops
    assert all(p["kl"] > 0.01 for p in hops), hops

"""The main paths on CUDA (tiny fp32 models): NonShared equals plain generate, FullShared and KVCMAS
run their reuse/correction paths on the device and stay exact where the math is exact."""

from __future__ import annotations

import pytest
import torch

from hf_kvshare import PF, PH, Session, load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

QUERY = "Shared notes: the council reviewed the bridge before winter and approved a new roof."
AGENTS = ["planner", "critic", "writer"]


def segments(i: int):
    parts = [PF(f"You are the {AGENTS[i]}.\n"), PH("query", QUERY if i == 0 else None)]
    for earlier in AGENTS[:i]:
        parts += [PF(f"\nFrom the {earlier}: "), PH(earlier)]
    return parts + [PF("\nAnswer:")]


@pytest.fixture(scope="module")
def cuda_model():
    return load_model("random:tiny-llama", device_map="cuda", dtype="float32", seed=0)


def run(model, tok, method, forced=None):
    session = Session(model, tok, method)
    return [
        session.run_turn(a, segments(i), max_new_tokens=6, force_output=None if forced is None else forced[i])
        for i, a in enumerate(AGENTS)
    ]


def plain_generate(model, prompt_ids):
    prompt = prompt_ids.reshape(1, -1).to("cuda")
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False
        )
    return out[0, prompt.shape[1] :].cpu()


@pytest.mark.parametrize("method", ["nonshared", "fullshared", "kvcmas"])
def test_methods_run_on_cuda(cuda_model, method):
    model, tok = cuda_model
    turns = run(model, tok, method)
    for t in turns:
        assert t.output_ids.numel() >= 1 and t.peak_memory_bytes > 0 and t.ttft_s > 0
    # the first agent reuses nothing: every method equals plain generate there
    assert torch.equal(turns[0].output_ids.cpu(), plain_generate(model, turns[0].prompt_ids))
    if method == "nonshared":
        for t in turns:
            assert torch.equal(t.output_ids.cpu(), plain_generate(model, t.prompt_ids)), t.agent
    if method == "fullshared":
        assert turns[1].reuse_ratio == 1.0


def test_kvcmas_corrects_on_cuda_and_tau0_is_nonshared(cuda_model):
    model, tok = cuda_model
    from hf_kvshare.methods.kvcmas import KVCMAS

    ref = run(model, tok, "nonshared")
    forced = [t.output_ids for t in ref]
    method = KVCMAS(tau=1.0)
    for _ in range(2):
        run(model, tok, method, forced)
    turns = run(model, tok, method, forced)
    assert turns[2].reuse_ratio > 0  # corrected on the device
    exact = run(model, tok, KVCMAS(tau=0.0))
    for a, b in zip(exact, ref):
        assert torch.equal(a.output_ids.cpu(), b.output_ids.cpu())


def test_a_turns_cuda_peak_does_not_count_what_other_code_holds(cuda_model):
    """Another method's pools alive in the same process (a benchmark running methods side by side)
    are not part of this session's peak; the weights and what this session holds are."""
    model, tok = cuda_model
    from hf_kvshare.measure import module_bytes

    alone = run(model, tok, "nonshared")
    other = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB held elsewhere
    beside = run(model, tok, "nonshared")
    del other
    weights = module_bytes(model, "cuda")
    for a, b in zip(alone, beside):
        assert weights < b.peak_memory_bytes < weights + (64 << 20)
        assert abs(a.peak_memory_bytes - b.peak_memory_bytes) < (4 << 20), (a.agent, a.peak_memory_bytes)

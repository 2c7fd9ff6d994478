"""Quantized (bitsandbytes 8-bit / 4-bit) and offloaded (accelerate ``device_map`` with disk entries) bases,
on CPU: a tiny random Llama saved to a directory and loaded back through ``load_model``.

- nonshared through ``SharedCache`` equals plain ``generate`` of the same quantized model token for token;
- the reuse methods run and report their provenance; caches, anchors (bases and deltas: the corrections)
  and the corrected K/V are in the compute dtype;
- QLoRA agents: PEFT LoRA adapters (q/v) on a 4-bit base with every PReCache method, exact in the exact
  cases of ``test_precache_reference.py``; LR caches are in the adapters' dtype;
- a ``device_map`` offloading layers to disk: nonshared and fullshared equal plain ``generate``.

The whole module is skipped, with the reason, where bitsandbytes is missing or cannot run on this CPU.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from families import METHOD_CASES, plain_generate
from lora_helpers import QV, lora_config, run_trajectory
from tiny import STEPS, tiny_model

from hf_kvshare import PF, PH, Session, load_model
from hf_kvshare._compat import peft_wrapping_warnings_silenced
from hf_kvshare.methods.kvcmas import KVCMAS
from hf_kvshare.methods.kvcomm import KVComm


@functools.cache
def bitsandbytes_problem() -> str | None:
    """Why bitsandbytes cannot be tested here, or None; asked when a test first needs it, not at collection
    (importing bitsandbytes and running a 4-bit layer cost ~1.3 CPU-s in each test process)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 'bitsandbytes is not installed (pip install "bitsandbytes>=0.46.1"; it is in the dev extra)'
    try:  # a 4-bit and an 8-bit layer forward on this machine's device (CPU here)
        layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, quant_type="nf4")
        layer.load_state_dict(torch.nn.Linear(64, 64).state_dict())
        layer = layer.to("cpu")
        layer(torch.randn(2, 64))
    except Exception as e:  # noqa: BLE001 - any failure means: cannot test here
        return f"bitsandbytes {bnb.__version__} cannot run 4-bit layers on CPU here: {type(e).__name__}: {e}"
    return None


# bitsandbytes logs "MatMul8bitLt: inputs will be cast ... to float16" at every 8-bit matmul on CPU
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


@pytest.fixture(scope="session")  # session: before the module's quantized models are loaded
def bitsandbytes_runs():
    """Skips the test, with the reason, where bitsandbytes is missing or cannot run on this CPU."""
    if bitsandbytes_problem() is not None:
        pytest.skip(bitsandbytes_problem())


needs_bnb = pytest.mark.usefixtures("bitsandbytes_runs")

#: name -> load_model keywords; the compute dtype is dtype (float32 when absent)
QUANTIZED = {
    "8bit": dict(load_in_8bit=True),
    "nf4-fp32": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4-fp32": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "nf4-bf16": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", dtype="bfloat16"),
    "fp4-bf16": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", dtype="bfloat16"),
}
N = 6  # new tokens per turn


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama (hidden 64: a multiple of bitsandbytes' blocks) with the embedded tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", seed=3).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=list(QUANTIZED))
def quantized(request, tiny_dir):
    model, tok = load_model(tiny_dir, **QUANTIZED[request.param])
    return request.param, model, tok


def compute_dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name.endswith("bf16") else torch.float32


def _cache_dtypes(cache) -> set[torch.dtype]:
    dtypes = set()
    for layer in range(cache.num_layers):
        k, v = cache.layer_kv(layer)
        dtypes |= {k.dtype, v.dtype}
    return dtypes


def _factor_dtypes(kv) -> set[torch.dtype]:
    return {t.dtype for f in (*kv.keys, *kv.values) for t in (f.a, f.b) if t is not None}


# ------------------------------------------------------------------ loading
@needs_bnb
def test_load_model_quantizes_the_linear_layers(quantized):
    import bitsandbytes as bnb

    name, model, _ = quantized
    kind = bnb.nn.Linear8bitLt if name == "8bit" else bnb.nn.Linear4bit
    proj = model.model.layers[0].self_attn.v_proj
    assert isinstance(proj, kind)
    if name != "8bit":
        assert model.config.quantization_config.bnb_4bit_quant_type == name[:3]
        assert proj.compute_dtype == compute_dtype(name)
    assert model.model.embed_tokens.weight.dtype == compute_dtype(name)


def test_load_model_quantization_options_are_checked_before_loading(tmp_path):
    missing = str(tmp_path / "nothing-here")  # any loading would fail with OSError
    with pytest.raises(ValueError, match="not both"):
        load_model(missing, load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ValueError, match="bnb_4bit_quant_type must be one of"):
        load_model(missing, load_in_4bit=True, bnb_4bit_quant_type="int4")
    with pytest.raises(ValueError, match="need load_in_4bit"):
        load_model(missing, bnb_4bit_quant_type="fp4")
    with pytest.raises(ValueError, match="apply to load_in_4bit"):
        load_model(missing, load_in_8bit=True, bnb_4bit_compute_dtype="bfloat16")
    with pytest.raises(ValueError, match="one or the other"):
        load_model(missing, load_in_4bit=True, quantization_config=object())


def test_missing_bitsandbytes_is_a_clear_import_error(monkeypatch, tmp_path):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a),
    )
    with pytest.raises(ImportError, match=r"load_in_4bit needs the bitsandbytes package.*pip install"):
        load_model(str(tmp_path), load_in_4bit=True)
    with pytest.raises(ImportError, match=r"load_in_8bit needs the bitsandbytes package"):
        load_model("smollm2-135m", load_in_8bit=True)


# ------------------------------------------------------------------ exactness and provenance
@needs_bnb
def test_nonshared_equals_plain_generate_of_the_quantized_model(quantized):
    name, model, tok = quantized
    session = Session(model, tok, "nonshared")
    for agent, segments in STEPS:
        r = session.run_turn(agent, segments, max_new_tokens=N, keep_cache=True)
        expected = session._strip_eos(plain_generate(model, r.prompt_ids, N))
        assert r.output_ids.tolist() == expected.tolist(), (name, agent)
        assert _cache_dtypes(r.cache) == {compute_dtype(name)}


@needs_bnb
def test_fullshared_reuses_and_reports_on_a_quantized_model(quantized):
    name, model, tok = quantized
    session = Session(model, tok, "fullshared")
    results = [
        session.run_turn(agent, segments, max_new_tokens=N, keep_cache=True) for agent, segments in STEPS
    ]
    third = results[-1].cache
    placeholders = [s for s in third.segments if s.kind == "PH"]
    assert {s.provenance for s in placeholders} == {"reused"}
    assert {s.source_agent for s in placeholders} <= {"first", "second"}  # who materialized each slot last
    assert results[-1].reuse_ratio > 0 and _cache_dtypes(third) == {compute_dtype(name)}
    _assert_exact_case(model, tok, "fullshared")  # a slot re-read behind the same prefix


def _assert_exact_case(model, tok, method: str) -> None:
    """``method`` at its exact setting (tests/families.py) equals plain ``generate`` token for token."""
    name, options, steps = METHOD_CASES[method]
    session = Session(model, tok, name, **options)
    for agent, segments in steps:
        r = session.run_turn(agent, segments, max_new_tokens=N)
        expected = session._strip_eos(plain_generate(model, r.prompt_ids, N))
        assert r.output_ids.tolist() == expected.tolist(), (method, agent)
    return r


def _request(model, tok, method, query: str, keep_cache=False):
    session = Session(model, tok, method)
    agents = ["planner", "designer", "coder"]
    out = []
    for i, agent in enumerate(agents):
        segments = [PF(f"You are the {agent}.\n"), PH("query", query)]
        for earlier in agents[:i]:
            segments += [PF(f"\nNotes from the {earlier}: "), PH(earlier)]
        out.append(
            session.run_turn(agent, [*segments, PF("\nAnswer:")], max_new_tokens=3, keep_cache=keep_cache)
        )
    return out


@needs_bnb
@pytest.mark.parametrize("cls", [KVCMAS, KVComm])
def test_correction_methods_run_on_a_quantized_model_in_the_compute_dtype(quantized, cls):
    """Identical requests: the pools fill on the first two (dense turns, deltas recorded), the third is
    corrected. Anchor bases, their deltas (the corrections) and the corrected caches stay in the compute
    dtype."""
    name, model, tok = quantized
    method = cls(tau=1.0)
    query = "Sort a list of numbers and explain the complexity."
    for _ in range(2):
        _request(model, tok, method, query)
    got = _request(model, tok, method, query, keep_cache=True)
    corrected = [s for t in got for s in t.cache.placeholders() if s.provenance == "corrected"]
    assert corrected and all(s.source_agent for s in corrected)
    assert "corrected" in str(got[-1].cache)
    anchors = [a for pool in method.pools.values() for a in pool]
    assert anchors and any(a.deltas for a in anchors)
    dtype = compute_dtype(name)
    for anchor in anchors:
        assert _factor_dtypes(anchor.base) == {dtype}
        for delta in anchor.deltas.values():
            assert _factor_dtypes(delta) == {dtype}
    for turn in got:
        assert _cache_dtypes(turn.cache) == {dtype}


# ------------------------------------------------------------------ QLoRA agents
LORA_METHODS = ["baseshared", "baselrshared", "prelrshared", "rebaseshared-lp", "rebaseshared-db"]
SAME_RANK = {"plan": 4, "act": 4, "reflect": 4}


def _qlora(tiny_dir, quant: str, seed: int, **cfg):
    """q/v LoRA adapters of equal rank (shared ``v_proj`` ``lora_A``: every method accepts them) on a
    4-bit base: PEFT's bitsandbytes LoRA layers."""
    from lora_helpers import share_value_down
    from peft import get_peft_model

    base, tok = load_model(tiny_dir, **QUANTIZED[quant])
    torch.manual_seed(seed)
    names = list(SAME_RANK)
    with peft_wrapping_warnings_silenced():
        model = get_peft_model(base, lora_config(4, QV, **cfg), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora_config(4, QV, **cfg))
    share_value_down(model)
    return model.eval(), tok


@pytest.fixture(scope="module", params=["nf4-fp32", "nf4-bf16"])
def qlora(request, tiny_dir):
    if bitsandbytes_problem() is not None:
        pytest.skip(bitsandbytes_problem())
    quant, (model, tok) = request.param, _qlora(tiny_dir, request.param, seed=7)
    # NonShared's trajectory, the reference of every method below: computed once per base, read only
    exact = run_trajectory(Session(model, tok, "nonshared"), ["act"] * 3, keep_cache=True)
    return quant, model, tok, exact


def _rounds_inputs(model) -> bool:
    """Whether the base's 4-bit projections compute below float32 on this CPU (measured, not assumed):
    an input moved by ~1e-5 of its scale moves a float32 kernel's outputs by about as much, while one
    that rounds its inputs to bfloat16 (bitsandbytes' CPU path on an AVX512-BF16 AMD EPYC, 2026-12-02)
    leaves most unchanged and flips some by ~1e-3. Two methods whose float32 rounding differs by 4e-7
    before such a layer then differ by ~1e-3 after it, which is that kernel's precision, not theirs."""
    proj = model.get_base_model().model.layers[0].self_attn.v_proj
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, proj.in_features, generator=generator)
    with torch.no_grad():
        moved = proj(x * (1 + 1e-5 * torch.randn(x.shape, generator=generator))) - proj(x)
    return bool(moved.abs().max() > 2e-4)  # measured: float32 nn.Linear 2.3e-5, this nf4 layer 2.0e-3


def _close(got, ref, n: int, dtype, layers=None, model=None) -> None:
    exact = dtype == torch.float32 and not (model is not None and _rounds_inputs(model))
    tol = dict(atol=2e-6, rtol=1e-5) if exact else dict(atol=1e-2, rtol=1e-2)
    for layer in range(ref.cache.num_layers) if layers is None else layers:
        k, v = got.cache.layer_kv(layer)
        ek, ev = ref.cache.layer_kv(layer)
        torch.testing.assert_close(k[:1, :, :n], ek[..., :n, :], **tol)
        torch.testing.assert_close(v[:1, :, :n], ev[..., :n, :], **tol)


@needs_bnb
@pytest.mark.parametrize("method", LORA_METHODS)
def test_qlora_exact_single_agent(qlora, method):
    """One agent wrote every token (test_precache_reference's first exact case) through PEFT's
    bitsandbytes LoRA layers: PreLRShared / BaseShared / BaseLRShared equal NonShared at every layer
    (and token for token free-running); ReBaseShared at layer 0."""
    import bitsandbytes as bnb

    quant, model, tok, exact = qlora
    assert isinstance(model.base_model.model.model.layers[0].self_attn.v_proj.base_layer, bnb.nn.Linear4bit)
    dtype = compute_dtype(quant)
    agents = ["act"] * 3
    session = Session(model, tok, method)
    got = run_trajectory(session, agents, forced=[r.output_ids for r in exact], keep_cache=True)
    for g, e in zip(got[1:], exact[1:]):
        n = max(s.end for s in g.segments if s.provenance in ("reused", "recomputed"))
        assert n > 0
        _close(g, e, n, dtype, layers=[0] if method.startswith("rebaseshared") else None, model=model)
        assert _cache_dtypes(g.cache) == {dtype}
    if not method.startswith("rebaseshared") and dtype == torch.float32:
        free = run_trajectory(Session(model, tok, method), agents)
        assert [r.output_ids.tolist() for r in free] == [r.output_ids.tolist() for r in exact]
    store = session.method_state[method]
    lr = [v for cache in store.lr.values() for v in cache.values if v is not None]
    assert lr and {v.dtype for v in lr} == {torch.float32}  # A x in the adapters' dtype (PEFT: float32)
    assert store.base(0, 0, 1)[0].dtype == dtype


LAST_LAYER_AGENTS = ["plan", "act", "reflect", "act", "plan"]


@pytest.fixture(scope="module")
def last_layer_qlora(tiny_dir):
    """Adapters on the last layer only, and NonShared's trajectory on them (read only by the tests)."""
    if bitsandbytes_problem() is not None:
        pytest.skip(bitsandbytes_problem())
    model, tok = _qlora(tiny_dir, "nf4-fp32", seed=11, layers_to_transform=[2])
    return model, tok, run_trajectory(Session(model, tok, "nonshared"), LAST_LAYER_AGENTS, keep_cache=True)


@needs_bnb
@pytest.mark.parametrize("method", LORA_METHODS)
def test_qlora_exact_when_hidden_states_do_not_depend_on_the_adapter(last_layer_qlora, method):
    """Adapters on the last layer only (test_precache_reference's second exact case), several agents."""
    model, tok, exact = last_layer_qlora
    agents = LAST_LAYER_AGENTS
    got = run_trajectory(
        Session(model, tok, method), agents, forced=[r.output_ids for r in exact], keep_cache=True
    )
    for g, e in zip(got[1:], exact[1:]):
        _close(g, e, g.cache.view.length, torch.float32, model=model)


# ------------------------------------------------------------------ accelerate device_map with disk offload
def _device_map(disk: list[str]) -> dict[str, str]:
    modules = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.layers.2"]
    return {**{m: "disk" if m in disk else "cpu" for m in modules}, "model.norm": "cpu", "lm_head": "cpu"}


@pytest.mark.parametrize(
    "disk",
    [["model.layers.1", "model.layers.2"], ["model.embed_tokens", "model.layers.0"]],
    ids=["layers-on-disk", "embeddings-on-disk"],
)
def test_device_map_with_disk_offload_equals_plain_generate(tiny_dir, tmp_path, disk):
    """Layers offloaded to disk (their parameters on ``meta`` until accelerate's hooks load them; with
    the embeddings offloaded, the model's first parameter is on ``meta`` too: inputs still go to the
    CPU). NonShared, FullShared and KVCMAS at their exact settings equal plain ``generate``."""
    model, tok = load_model(tiny_dir, device_map=_device_map(disk), offload_folder=str(tmp_path / "offload"))
    assert {model.hf_device_map[m] for m in disk} == {"disk"}
    assert next(model.parameters()).device.type == ("meta" if "model.embed_tokens" in disk else "cpu")
    for method in ("nonshared", "fullshared", "kvcmas"):
        last = _assert_exact_case(model, tok, method)
        if method == "fullshared":
            assert last.reuse_ratio > 0


# ------------------------------------------------------------------ command line (bench, demo)
def _bench(*argv) -> int:
    from hf_kvshare.bench.__main__ import main

    return main([str(a) for a in argv])


@needs_bnb
def test_bench_runs_the_autoact_workload_on_a_4bit_base(tmp_path, tokenizer):
    """QLoRA agents in the bench: the AutoAct role adapters on a 4-bit base; the quantization is in
    config.json and in the configuration's directory name."""
    import json

    from bench_helpers import save_random_adapters, save_tiny

    model_dir = save_tiny(tmp_path / "tiny", tokenizer)
    adapters = save_random_adapters(tmp_path / "adapters")
    rc = _bench(
        "run", "--workload", "autoact", "--limit", "1", "--max-new-tokens", "3",
        "--methods", "nonshared", "prelrshared", "--model", model_dir, "--load-in-4bit",
        *[f"--adapter={name}={path}" for name, path in adapters.items()],
        "--out", tmp_path / "out", "--no-progress", "--no-plots", "--no-erank",
    )  # fmt: skip
    assert rc == 0
    (config_dir,) = [d for d in (tmp_path / "out").iterdir() if (d / "config.json").exists()]
    assert "-default-4bit-nf4-cpu-seed0" in config_dir.name
    summary = json.loads((config_dir / "prelrshared" / "summary.json").read_text())
    assert summary["config"]["quantization"] == "4bit-nf4" and "device_map" not in summary["config"]
    assert summary["turns"] == 8 and summary["agreement"] > 0


def test_bench_model_options_are_checked_before_loading(tmp_path, capsys, monkeypatch):
    import torch

    # --device cuda passes argparse's device check here, so the conflict with --device-map is what fails
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    common = ["run", "--workload", "trace", "--model", tmp_path / "no-model", "--out", tmp_path]
    for extra, message in (
        (["--load-in-4bit", "--load-in-8bit"], "not both"),
        (["--bnb-4bit-quant-type", "fp4"], "needs --load-in-4bit"),
        (["--device", "cuda", "--device-map", "auto"], "give one of them"),
        (["--device-map", "{not json"], "not a JSON object"),
    ):
        with pytest.raises(SystemExit) as e:
            _bench(*common, *extra)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_model_arguments_and_run_config_name(tmp_path):
    import argparse

    from hf_kvshare.bench.runner import RunConfig
    from hf_kvshare.bench.workloads import make_workload
    from hf_kvshare.models import add_model_arguments, model_arguments, quantization_tag

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--load-in-4bit", "--bnb-4bit-quant-type", "fp4", "--dtype", "bfloat16"])
    if bitsandbytes_problem() is None or "not installed" not in bitsandbytes_problem():
        kwargs = model_arguments(args)
        assert kwargs == dict(dtype=torch.bfloat16, load_in_4bit=True, bnb_4bit_quant_type="fp4")
        assert quantization_tag(kwargs) == "4bit-fp4"
    placed = model_arguments(parser.parse_args(["--device-map", '{"model": "cpu", "lm_head": "disk"}']))
    assert placed["device_map"] == {"model": "cpu", "lm_head": "disk"} and placed["offload_folder"]
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        model_arguments(parser.parse_args(["--dtype", "int4"]))
    workload = make_workload("trace")
    plain = RunConfig(workload.name, workload.params(), model="m")
    quant = RunConfig(workload.name, workload.params(), model="m", quantization="8bit", device_map="auto")
    assert "quantization" not in plain.to_dict() and quant.to_dict()["quantization"] == "8bit"
    assert plain.directory_name(workload).endswith("__m-default-cpu-seed0")
    assert quant.directory_name(workload).endswith("__m-default-8bit-cpu-dm_auto-seed0")

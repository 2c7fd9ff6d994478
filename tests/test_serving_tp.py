"""Tensor parallel on vLLM: each worker rank holds its slice of the KV heads.

Fast lane (no vLLM): which heads a rank holds (:func:`kv_head_range`: split, replicated, refused) and
the ranks' read-backs assembled into all heads (:class:`RankAssembly`).

Serving lane (marker ``serving``, vLLM's CPU wheel): ``random:small-llama`` (8 heads / 4 KV heads of
size 64: vLLM's CPU attention serves it and 2 ranks split it; SmolLM2-135M's 3 KV heads do not split,
tiny-llama's head size 16 the CPU backend refuses) on a server at ``--tensor-parallel-size 2``:
exact mode (K/V read back from both ranks, assembled, written back as each rank's slice) gives plain
vLLM's tokens and log-probabilities at TP = 2, and FullShared gives the same tokens and supplied
counts as at TP = 1. Each server starts in ~2 min on 2 CPUs.

Pipeline parallel in the same file (the ranks are numbered stage by stage, :func:`worker_rank`): fast
lane, the stages' read-backs joined in layer order (and each stage's heads first under PP x TP), the
layers each stage announces checked and a claim's K/V routed by them; serving lane, a server at
``--pipeline-parallel-size 2`` (each stage 8 of the 16 layers): exact mode == plain vLLM at PP = 2 and
FullShared's tokens and supplied counts == TP = 1's. And both at once, PP x TP (``--tensor-parallel-size
2 --pipeline-parallel-size 2``: four worker processes, ~1.5 min to start on 2 CPUs): each rank its 2 KV
heads of its stage's 8 layers, the same two checks. The module's servers run one at a time, the shapes
(``PARALLEL_SHAPES``) parametrizing one module fixture.
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch
from live_server import post, reset_prefix_cache, start_server, stopped_after

from hf_kvshare.serving.tensor_parallel import PENDING, RankAssembly, kv_head_range, worker_rank

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def serving(test):
    """A serving-lane test: marker ``serving``, skipped where vLLM is not installed."""
    skip = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here; the serving lane runs it")
    return pytest.mark.serving(skip(test))


def test_each_rank_holds_its_share_of_the_kv_heads():
    assert [kv_head_range(r, 2, 4) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(r, 4, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # fewer KV heads than ranks: each head replicated on tp / heads ranks (vLLM's linear layers' rule)
    assert [kv_head_range(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert kv_head_range(0, 1, 3) == (0, 3)
    with pytest.raises(ValueError, match="do not split"):
        kv_head_range(0, 2, 3)  # SmolLM2-135M's 3 KV heads over 2 ranks
    with pytest.raises(ValueError, match="do not replicate"):
        kv_head_range(0, 4, 3)
    with pytest.raises(ValueError, match="not one of"):
        kv_head_range(2, 2, 4)


def _kv(layers=3, n=5, heads=4, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, n, heads, dim, generator=gen), torch.randn(
        layers, n, heads, dim, generator=gen
    )


def test_the_ranks_read_backs_assemble_into_all_heads_in_any_order():
    keys, values = _kv()
    assembly = RankAssembly(2, 4)
    # rank 1 first: kept, nothing recorded yet; then rank 0: all heads, in the heads' order
    assert assembly.add("r", 1, (keys[:, :, 2:], values[:, :, 2:])) is PENDING
    assert assembly.has("r", {1}) and not assembly.has("r", {0, 1})
    k, v = assembly.add("r", 0, (keys[:, :, :2], values[:, :, :2]))
    assert torch.equal(k, keys) and torch.equal(v, values)
    assert not assembly.has("r", {0})  # done: nothing kept
    # two requests interleaved never mix
    other = _kv(seed=1)
    assert assembly.add("a", 0, (keys[:, :, :2], values[:, :, :2])) is PENDING
    assert assembly.add("b", 1, (other[0][:, :, 2:], other[1][:, :, 2:])) is PENDING
    assert torch.equal(assembly.add("b", 0, (other[0][:, :, :2], other[1][:, :, :2]))[0], other[0])
    assert torch.equal(assembly.add("a", 1, (keys[:, :, 2:], values[:, :, 2:]))[1], values)


def test_replicated_heads_are_taken_once_and_a_failed_rank_releases_the_request():
    keys, values = _kv(heads=2)
    assembly = RankAssembly(4, 2)  # ranks 0, 1 hold head 0; ranks 2, 3 head 1
    assert assembly.add("r", 2, (keys[:, :, 1:], values[:, :, 1:])) is PENDING
    k, v = assembly.add("r", 0, (keys[:, :, :1], values[:, :, :1]))  # ranks 1, 3: copies, not waited for
    assert torch.equal(k, keys) and torch.equal(v, values)
    # one rank's read failed: the request is released (None) at once, its other pieces dropped
    assert assembly.add("x", 0, (keys[:, :, :1], values[:, :, :1])) is PENDING
    assert assembly.add("x", 2, None) is None and not assembly.has("x", {0})
    # one rank: the read-back as it came
    single = RankAssembly()
    assert single.add("r", 0, (keys, values))[0] is keys and single.add("r", 0, None) is None
    with pytest.raises(ValueError, match="rank 2"):
        RankAssembly(2, 4).add("r", 2, (keys, values))


def test_the_stages_read_backs_assemble_into_all_layers_in_stage_order():
    keys, values = _kv(layers=5)
    assembly = RankAssembly(1, 4, pp_size=2)  # stage 0: layers 0-2, stage 1: layers 3-4
    assert assembly.size == 2 and worker_rank(0, 1, 1) == 1
    assert assembly.add("r", 1, (keys[3:], values[3:])) is PENDING  # the last stage first
    k, v = assembly.add("r", 0, (keys[:3], values[:3]))
    assert torch.equal(k, keys) and torch.equal(v, values)
    # a failed stage releases the request; a rank past the workers is refused
    assert assembly.add("x", 0, (keys[:3], values[:3])) is PENDING
    assert assembly.add("x", 1, None) is None and not assembly.has("x", {0})
    with pytest.raises(ValueError, match="rank 2; this server has 2 ranks"):
        assembly.add("r", 2, (keys, values))


def test_pipeline_times_tensor_parallel_joins_each_stages_heads_then_the_stages_layers():
    keys, values = _kv(layers=4, heads=4)
    assembly = RankAssembly(2, 4, pp_size=2)  # ranks 0, 1: layers 0-1; ranks 2, 3: layers 2-3
    assert [worker_rank(t, p, 2) for p in (0, 1) for t in (0, 1)] == [0, 1, 2, 3]
    pieces = {
        rank: (keys[layers][:, :, heads], values[layers][:, :, heads])
        for rank, layers, heads in [
            (0, slice(0, 2), slice(0, 2)),
            (1, slice(0, 2), slice(2, 4)),
            (2, slice(2, 4), slice(0, 2)),
            (3, slice(2, 4), slice(2, 4)),
        ]
    }
    for rank in (3, 0, 2):
        assert assembly.add("r", rank, pieces[rank]) is PENDING
    assert assembly.has("r", {0, 2, 3}) and not assembly.has("r", {1})
    k, v = assembly.add("r", 1, pieces[1])
    assert torch.equal(k, keys) and torch.equal(v, values)
    # heads replicated within each stage: one copy per stage is waited for
    two = _kv(layers=4, heads=1)
    replicated = RankAssembly(2, 1, pp_size=2)
    assert replicated.add("r", 2, (two[0][2:], two[1][2:])) is PENDING
    assert torch.equal(replicated.add("r", 0, (two[0][:2], two[1][:2]))[0], two[0])


def test_each_stage_announces_its_layers_and_a_claim_is_routed_to_the_ranks_by_them():
    from types import SimpleNamespace

    from hf_kvshare.serving.connector_scheduler import HFKVShareScheduler

    assembly = RankAssembly(2, 4, pp_size=2)
    assert assembly.layers(0) is None  # not announced yet: nothing can be routed
    assert RankAssembly().layers(0) == slice(None)  # one stage: every layer
    for rank, layers in [(0, [0, 1, 2]), (1, [0, 1, 2]), (2, [3, 4]), (3, [3, 4])]:
        assembly.announce(rank, layers)
    assert assembly.layers(1) == slice(0, 3) and assembly.layers(3) == slice(3, 5)
    with pytest.raises(ValueError, match="not a run of consecutive layers"):
        RankAssembly(1, 1, 2).announce(0, [0, 2])
    mixed = RankAssembly(2, 4, 2)
    mixed.announce(0, [0, 1])
    with pytest.raises(ValueError, match="another rank of stage 0 holds \\(0, 2\\)"):
        mixed.announce(1, [0, 1, 2])
    with pytest.raises(ValueError, match="not in stage order"):
        mixed.announce(2, [1, 2])

    class Sender:  # an order channel's stand-in: what each rank was sent
        def __init__(self):
            self.got = []

        def send(self, request_id, keys, values, via):
            self.got.append((request_id, keys, values, via))
            return True

    keys, values = _kv(layers=5)
    senders = {rank: Sender() for rank in range(4)}
    scheduler = SimpleNamespace(_order_senders=senders, _assembly=assembly)
    assert HFKVShareScheduler._send_claim(scheduler, "r", keys, values)
    for rank, layers in [(0, slice(0, 3)), (1, slice(0, 3)), (2, slice(3, 5)), (3, slice(3, 5))]:
        ((request_id, k, v, via),) = senders[rank].got  # all heads: each rank takes its own
        assert request_id == "r" and via == "load"
        assert torch.equal(k, keys[layers]) and torch.equal(v, values[layers])
    # a rank whose stage has not announced its layers is sent nothing: the claim is not sent
    late = SimpleNamespace(_order_senders={0: Sender()}, _assembly=RankAssembly(1, 1, 2))
    assert not HFKVShareScheduler._send_claim(late, "r", keys, values) and not late._order_senders[0].got


def test_the_workers_outputs_keep_each_ranks_layers_apart():
    from hf_kvshare.serving.connector_common import Captured

    keys, values = _kv(layers=5)
    last = Captured(kv={"r": (keys[3:], values[3:])}, orders="tcp://b", layers=[3, 4], rank=1)
    first = Captured(kv={"r": (keys[:3], values[:3])}, orders="tcp://a", layers=[0, 1, 2], rank=0)
    parts = first.aggregate(last).by_rank()
    assert {rank: part.layers for rank, part in parts.items()} == {0: [0, 1, 2], 1: [3, 4]}
    assert parts[1].orders == "tcp://b" and torch.equal(parts[1].kv["r"][0], keys[3:])


def test_a_random_model_is_served_by_its_shipped_name_only():
    from hf_kvshare.serving.models import served_model_dir

    with pytest.raises(ValueError, match="unknown random model 'random:nope'.*random:small-llama"):
        served_model_dir("random:nope")
    with pytest.raises(ValueError, match="nor a random:NAME model"):
        served_model_dir("no-such-model")


def test_the_launcher_refuses_parallel_set_ups_the_connector_cannot_serve_before_vllm_starts(tmp_path):
    from hf_kvshare.serving.server import Server, check_parallel_args

    shape = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 1}
    config = {"model_type": "llama", "intermediate_size": 64, "vocab_size": 64, **shape}  # SmolLM2's heads
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_parallel_args(["--tensor-parallel-size", "3"], tmp_path)
    check_parallel_args(["--tensor-parallel-size=6"], tmp_path)  # each head on 2 ranks
    with pytest.raises(ValueError, match="3 KV heads do not split over 2 ranks; what works"):
        check_parallel_args(["-tp", "2"], tmp_path)
    check_parallel_args(["--pipeline-parallel-size=2"])  # pipeline parallel: the layers split over stages
    check_parallel_args(["-pp", "2", "-tp", "3"], tmp_path)
    with pytest.raises(ValueError, match="context parallel .*what works: .*--pipeline-parallel-size"):
        check_parallel_args(["--decode-context-parallel-size", "2"])
    with pytest.raises(ValueError, match="data parallel .*what works: --replicas N"):
        check_parallel_args(["--data-parallel-size", "2"])
    with pytest.raises(ValueError, match="data parallel"):
        check_parallel_args(["-dp=2"])
    with pytest.raises(ValueError, match="a number of ranks"):
        check_parallel_args(["--tensor-parallel-size", "two"])
    with pytest.raises(ValueError, match="context parallel"):  # the connector's server, before it starts
        Server(tmp_path, "fullshared", vllm_args=["-dcp", "2"])
    Server(tmp_path, None, vllm_args=["-dcp", "2"])  # plain vLLM: vLLM's own business
    Server(tmp_path, "fullshared", vllm_args=["-pp", "2"])
    # pipeline parallel with --enforce-eager: vLLM's CPU wheel fails the first request; said, with the fix
    (note,) = [
        n for n in Server(tmp_path, None, vllm_args=["-pp=2", "--enforce-eager"]).notes if "pipeline" in n
    ]
    assert "--compilation-config" in note
    assert not [n for n in Server(tmp_path, None, vllm_args=["--enforce-eager"]).notes if "pipeline" in n]


@serving
def test_what_the_connector_cannot_serve_is_refused_at_start_up_with_what_works():
    from types import SimpleNamespace

    from hf_kvshare.serving.connector_common import check_supported
    from hf_kvshare.serving.host import ServingError

    def config(tp=1, pp=1, kv_heads=4, **parallel):
        parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, **parallel)
        return SimpleNamespace(
            parallel_config=parallel, model_config=SimpleNamespace(get_total_num_kv_heads=lambda: kv_heads)
        )

    check_supported(config(), None)
    check_supported(config(tp=2), None)
    check_supported(config(tp=4, kv_heads=2), None)  # heads replicated over ranks
    check_supported(config(pp=2), None)  # the layers split over stages
    check_supported(config(tp=2, pp=2), None)
    with pytest.raises(ServingError, match="3 KV heads do not split over 2 ranks.*pipeline_parallel_size"):
        check_supported(config(tp=2, pp=2, kv_heads=3), None)
    with pytest.raises(ServingError, match="data parallel .*data_parallel_size 2.*session affinity"):
        check_supported(config(data_parallel_size=2), None)
    with pytest.raises(ServingError, match="context parallel .*decode_context_parallel_size 2"):
        check_supported(config(decode_context_parallel_size=2), None)
    with pytest.raises(ServingError, match="3 KV heads do not split over 2 ranks; what works"):
        check_supported(config(tp=2, kv_heads=3), None)
    with pytest.raises(ServingError, match="one KV cache group"):
        check_supported(config(), SimpleNamespace(kv_cache_groups=[0, 1]))


# ---------------------------------------------------------------------------------- serving lane
MODEL = "random:small-llama"
SYS1 = "You are a careful planner. "
DOC = (
    "The river Lune flows through Lancaster and reaches the sea at Plover Scar near Glasson, "
    "after passing under the old aqueduct that carries the canal. "
) * 6
Q1 = " Question: where does it reach the sea? Answer:"
Q2 = " Summary in five words:"
PLAIN = {"hf_kvshare": {"method": "nonshared"}}


#: vLLM's CPU wheel at pipeline parallel: not ``--enforce-eager`` (its CPU worker then skips the warm-up
#: run that makes a later stage's buffer for the hidden states it receives, and the first request fails
#: on vLLM's ``assert self.intermediate_tensors is not None``); Dynamo's trace run eagerly instead (no
#: Inductor compile, the same kernels as eager mode)
PP_CPU_ARGS = ["--compilation-config", json.dumps({"mode": 2, "backend": "eager"})]


def _start(tp: int, folder, pp: int = 1):
    """A FullShared server at ``tp`` x ``pp`` ranks, started and ready."""
    args = []
    if tp > 1 or pp > 1:
        args += ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
        args += ["--distributed-executor-backend", "mp"]
    args += PP_CPU_ARGS if pp > 1 else []
    name = f"tp{tp}" + (f"-pp{pp}" if pp > 1 else "")
    options = {"prefix_reuse": True}
    return start_server(
        folder, MODEL, "fullshared", options, max_bytes=64 << 20, vllm_args=args, eager=pp == 1, name=name
    )


def _complete(server, ids, params, max_tokens=12):
    body = {"model": server.model_dir, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    body.update(return_token_ids=True, logprobs=1, kv_transfer_params=params)
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    report = (out.get("kv_transfer_params") or {}).get("hf_kvshare")
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], report


def _layout(task, agent, start, n):
    segments = [{"slot": "doc", "start": start, "end": start + n}]
    return {"hf_kvshare": {"task": task, "agent": agent, "segments": segments}}


def _ids(server, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir)(text, add_special_tokens=False)["input_ids"]


def _fullshared_run(server):
    """Two agents of one task: a1 computes the document, a2 reads it at another position (claimed)."""
    sys1, doc, q1, q2 = (_ids(server, t) for t in (SYS1, DOC, Q1, Q2))
    first, _, report1 = _complete(server, sys1 + doc + q1, _layout("t1", "a1", len(sys1), len(doc)))
    deadline = time.monotonic() + 60  # a2 waits for a1's record (the read-backs of every rank)
    shared, _, report2 = _complete(server, doc + q2, _layout("t1", "a2", 0, len(doc)))
    assert time.monotonic() < deadline
    counts = [(r["claimed"], r["supplied_tokens"]) for r in (report1, report2)]
    return first, shared, counts


@pytest.fixture(scope="module")
def fullshared_at_tp1(tmp_path_factory):
    """FullShared's tokens and supplied counts on a one-rank server (started, run, stopped)."""
    srv = _start(1, tmp_path_factory.mktemp("tp1"))
    try:
        return _fullshared_run(srv)
    finally:
        srv.stop()


#: the parallel shapes the serving lane runs live, ``(tp, pp)``: a server each, one at a time
PARALLEL_SHAPES = [(2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module", params=PARALLEL_SHAPES, ids=lambda shape: "tp{}-pp{}".format(*shape))
def parallel_server(request, tmp_path_factory):
    """The module's server at ``(tp, pp)`` ranks. A parametrized module fixture: pytest runs every test of
    one shape, stops its server, then starts the next shape's, so one server group lives at a time (two
    would share the machine's 2 CPUs)."""
    tp, pp = request.param
    yield from stopped_after(_start(tp, tmp_path_factory.mktemp(f"tp{tp}-pp{pp}"), pp=pp))


@serving
def test_fullshared_over_parallel_ranks_gives_the_tokens_of_one_rank(fullshared_at_tp1, parallel_server):
    # the one-rank server runs and stops first (its fixture first): one server at a time. Each rank
    # reads back, keeps and re-positions its own heads of its own stage's layers; the scheduler joins
    # the heads, then the stages' layers in order
    first, shared, counts = _fullshared_run(parallel_server)
    assert counts[1][0] is not None and counts[1][1] > 0, counts  # a2 was supplied the document
    assert (first, shared, counts) == fullshared_at_tp1


@serving
def test_exact_mode_over_parallel_ranks_is_plain_vllm(parallel_server):
    srv = parallel_server
    sys1, doc, q1 = (_ids(srv, t) for t in (SYS1, DOC, Q1))
    a = sys1 + doc + q1
    plain, plain_logprobs, _ = _complete(srv, a, PLAIN)
    first, _, report = _complete(srv, a, _layout("t0", "x1", len(sys1), len(doc)))
    assert first == plain and report["supplied_tokens"] == 0
    # exact mode: vLLM's prefix cache emptied, every token but the last from the K/V every rank read
    # back (assembled into all heads and layers on the scheduler) and wrote back (each rank its part)
    _, reset = reset_prefix_cache(srv)  # retried while blocks are held
    assert reset.get("success"), reset
    again, logprobs, report = _complete(srv, a, _layout("t0", "x1", len(sys1), len(doc)))
    assert report["prefix_cache_hit"] == 0 and report["claimed"] == [0, len(a) - 1], report
    assert again == plain
    assert max(abs(x - y) for x, y in zip(logprobs, plain_logprobs)) < 1e-3, (logprobs, plain_logprobs)

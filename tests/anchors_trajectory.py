"""Test helper: one KVCMAS / KVComm task trajectory driven through
:class:`~hf_kvshare.serving.host.Sharing` on one rank, on 2 gloo ranks (each its KV heads, SPMD) and on
the follower (meta stand-ins of every read-back, every reduced value replayed from rank 0's
publication: :func:`follow`), for ``tests/test_anchors_spmd.py``, ``tests/test_anchors_follower.py`` and
``tests/test_anchors_stages.py``.

The gloo ranks are spawned ONCE per test run (:func:`rank_runs`): both modules share that spawn, on one
xdist worker where ``pytest.mark.xdist_group(GROUP)`` holds and, where it does not (xdist 3.8 under
pytest 9.2 groups nothing: it renames ``item._nodeid``, which pytest 9 no longer reads), through a file
the first worker writes under the run's shared temporary folder while the other waits for its lock.
Rank 0 runs as the leader: its :class:`~hf_kvshare.anchors.sharded.Shard` publishes every reduced value
into a list, returned with its results per case."""

from __future__ import annotations

import fcntl
import os
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from tiny import embedded_tokenizer, tiny_model

from hf_kvshare.anchors.corrected import CorrectedKV
from hf_kvshare.anchors.lowrank import any_rank, relative_distance, relative_spread, row_energy
from hf_kvshare.anchors.pool import correction_agreement
from hf_kvshare.anchors.sharded import COLLECTIVES, FollowerShard, Shard
from hf_kvshare.method import get_method
from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.host import Sharing, serving_options
from hf_kvshare.serving.standin import engine
from hf_kvshare.serving.tensor_parallel import kv_head_range

#: the xdist group of every test using the ranks' runs (one worker: one spawn)
GROUP = "test_anchors_spmd"
WORLD = 2
#: the served methods and their options (``base_rank=4``: KVCMAS's anchors factorized, D = 2 heads x 16;
#: KVComm's are dense)
CASES = {
    "kvcmas": ("kvcmas", {"tau": 0.99, "base_rank": 4, "delta_rank": 4}),
    # rank 24: above a rank's 16 columns, clamped to the global D = 32 only (not to 16)
    "kvcmas-guard": (
        "kvcmas",
        {"tau": 0.99, "base_rank": 24, "delta_rank": 24, "guard": True, "svd": "exact"},
    ),
    "kvcomm": ("kvcomm", {"tau": 0.99, "text_source": "chained", "observation_source": "question"}),
    # one KV head replicated on both ranks (vLLM's rule with fewer KV heads than ranks): counted once
    "kvcmas-replicated": ("kvcmas", {"tau": 0.99, "base_rank": 4, "delta_rank": 4}),
    # small byte budgets: tasks, kept prefixes and anchors evicted by bytes (BUDGETS)
    "kvcmas-small": ("kvcmas", {"tau": 0.99, "base_rank": 4, "delta_rank": 4}),
}
#: the model's KV heads per case (2 unless said)
KV_HEADS = {"kvcmas-replicated": 1}
#: the :class:`Sharing` budgets per case (the defaults unless said)
BUDGETS: dict[str, dict[str, int]] = {
    "kvcmas-small": {"max_bytes": 50_000, "max_prefix_bytes": 20_000, "max_anchor_bytes": 100_000}
}
SYSTEMS = {"planner": "You plan.\n", "critic": "You criticise.\n", "writer": "You write it up.\n"}
DOCS = [f"Report {t}: the river Lune reaches the sea at Plover Scar, site {t}." for t in range(5)]
QUESTION = " What should we do next?"


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def served(case: str):
    name, options = CASES[case][:2]
    options, _ = serving_options(name, options)
    return get_method(name, **options)


def sharing_for(case: str, model, tokenizer, method) -> Sharing:
    return Sharing(model, tokenizer, method, min_segment_tokens=4, **BUDGETS.get(case, {}))


def as_layers(kv) -> torch.Tensor | None:
    """A plan's claimed K/V as one ``[layers, m, heads, head_dim]`` tensor (``None``: nothing claimed)."""
    if isinstance(kv, torch.Tensor):
        return kv
    return torch.stack(list(kv)) if len(kv) else None


#: a member's run of a planned request: ``(plan, claimed keys, claimed values, request index)`` ->
#: ``(output ids, read-back keys, read-back values)`` (``[layers, n, heads, head_dim]``, its heads)
Run = Callable[
    [object, torch.Tensor | None, torch.Tensor | None, int], tuple[list[int], torch.Tensor, torch.Tensor]
]


def engine_run(model, heads: slice, gather, layers: slice = slice(None)) -> Run:
    """The engine's run over every head and layer (a rank gathers its claimed heads, a pipeline stage its
    claimed layers: ``gather``), read back as this member's ``heads`` of its ``layers`` (its own storage,
    as a tensor-parallel or pipeline-parallel worker reads back its own)."""

    def run(plan, keys, values, index):
        every = SimpleNamespace(
            prompt=plan.prompt,
            local_hit=plan.local_hit,
            keys=[] if keys is None else gather(keys),
            values=[] if values is None else gather(values),
        )
        out, k, v = engine(model, every, max_new_tokens=4)
        if layers != slice(None):  # a stage's layers in storage of their own
            k, v = k[layers].clone(), v[layers].clone()
        return out, k[:, :, heads].contiguous(), v[:, :, heads].contiguous()

    return run


def request_of(sharing: Sharing, tokenizer, t: int, doc: str, agent: str) -> tuple[list[int], dict]:
    """Task ``t``'s request of ``agent``: its system text, the document, the notes of the agents before
    it (their outputs, read from the task's slots) and the question, with its explicit layout."""
    host = sharing.hosts.get(f"t{t}")
    ids = ids_of(tokenizer, SYSTEMS[agent]) + ids_of(tokenizer, doc)
    segments = [{"slot": "doc", "text": doc}]
    for reader in list(SYSTEMS)[: list(SYSTEMS).index(agent)]:
        ids += ids_of(tokenizer, "\nNotes:") + host.slots[reader].token_ids.tolist()
        segments.append({"slot": reader})
    ids += ids_of(tokenizer, QUESTION)
    return ids, {lay.KEY: {"task": f"t{t}", "agent": agent, "segments": segments, "output": agent}}


def trajectory(
    sharing: Sharing, tokenizer, run: Run, requests: int | None = None, until_refused: bool = False
) -> list[dict]:
    """Every request of the trajectory (the first ``requests``) planned, run (``run``) and recorded; per
    request what it claimed, placed, gated, the claimed K/V (this member's heads) and what the stores hold
    and evicted after it. A record refused is the step's ``error`` (the whole trajectory: none); a plan
    refused ends the trajectory with its step when ``until_refused`` (else it fails the test)."""
    steps = []
    for t, doc in enumerate(DOCS):
        for agent in SYSTEMS:
            if requests is not None and len(steps) == requests:
                return steps
            ids, meta = request_of(sharing, tokenizer, t, doc, agent)
            plan = sharing.plan(f"{t}-{agent}", ids, meta, 0)
            if until_refused and plan.error is not None:
                return [*steps, {"error": plan.error, "stores": stores(sharing)}]
            assert plan.error is None, plan.error
            keys, values = as_layers(plan.keys), as_layers(plan.values)
            out, k, v = run(plan, keys, values, len(steps))
            sharing.record(plan, k, v, out, set())
            assert requests is not None or plan.error is None, plan.error
            report = plan.report()
            steps.append(
                {
                    "claim": (plan.claim_start, plan.claim_end, plan.claimed),
                    "placed": [
                        None if p is None else (p.provenance, p.source_agent) for p in plan.placements
                    ],
                    "gates": [s.get("gate") for s in report["segments"] if s["kind"] == "PH"],
                    "keys": keys,
                    "values": values,
                    "out": out,
                    "stores": stores(sharing),
                    "error": plan.error,
                }
            )
    return steps


def assert_same_gates(got: list, want: list, where: str) -> None:
    """A member's gate outcomes of one request against one rank's: the same spans gated, the same keys
    and decisions, the numbers to round-off."""
    assert len(got) == len(want), where
    for mine, one in zip(got, want):
        assert (mine is None) == (one is None), where
        if one is None:
            continue
        assert set(mine) == set(one), where
        for key, value in one.items():
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (where, key)
            else:
                assert mine[key] == value, (where, key)


def assert_same_steps(got: list[dict], want: list[dict], who: str, part: tuple[slice, ...]) -> None:
    """A member's trajectory against one rank's, request by request: the same claims, placements, outputs,
    stores, errors and gates, and its K/V the part of one rank's it holds (``part``, the index of its
    layers and heads in ``[layers, rows, heads, head_dim]``) to 1e-5 (``who``: the member, in a failure's
    message)."""
    assert len(got) == len(want), who
    for step, (mine, one) in enumerate(zip(got, want)):
        where = f"{who}, request {step}"
        for key in ("claim", "placed", "out", "stores", "error"):
            assert mine[key] == one[key], (where, key)
        assert_same_gates(mine["gates"], one["gates"], where)
        for side in ("keys", "values"):
            if one[side] is None:
                assert mine[side] is None, where
                continue
            expected = one[side][part]
            assert mine[side].shape == expected.shape, (where, side)
            assert relative(mine[side], expected) <= 1e-5, (where, side)


def assert_same_pools(got: dict, want: dict, rank: int) -> None:
    """A member's pools and their numbers (:func:`pool_numbers`) against one rank's: the same anchors, the
    numbers to round-off."""
    assert list(got) == list(want)
    for key, one_pool in want.items():
        pool = got[key]
        assert pool["anchors"] == one_pool["anchors"], (rank, key)
        for mine, one in zip(pool["energy"], one_pool["energy"]):
            assert mine == pytest.approx(one, rel=1e-5), (rank, key, "energy")
        for number in ("agreement", "distance", "spread"):
            mine, one = pool.get(number), one_pool.get(number)
            assert (mine is None) == (one is None), (rank, key, number)
            if one is not None:  # pytest >= 9.2 refuses approx(None) with a tolerance
                assert mine == pytest.approx(one, rel=1e-4, abs=1e-6), (rank, key, number)


def relative(x: torch.Tensor, y: torch.Tensor) -> float:
    """``x``'s distance from ``y`` relative to ``y``'s norm (float64)."""
    return float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30))


def nan_on_rank_1(rank: int, run: Run) -> Run:
    """``run`` whose read-back holds a NaN in rank 1's part (its first layer's first value) only."""

    def poisoned(plan, keys, values, index):
        out, k, v = run(plan, keys, values, index)
        if rank == 1:
            v[0, 0, 0, 0] = float("nan")
        return out, k, v

    return poisoned


def stores(sharing: Sharing) -> dict:
    """What the stores hold (tasks, slots with K/V, anchors) and evicted so far: every member the same."""
    method = sharing.method
    summary = method.state_summary()
    return {
        "tasks": list(sharing.hosts),
        "slots": {
            task: sorted(n for n, s in h.slots.items() if s.latest is not None)
            for task, h in sharing.hosts.items()
        },
        "evicted": (sharing.evicted_tasks, sharing.dropped_slots),
        "anchors": {repr(key): [(a.serial, a.source) for a in pool] for key, pool in method.pools.items()},
        "pool_evictions": (summary.get("evicted_pools"), summary.get("pools_evicted_for_bytes")),
        "prefixes": (summary["prefixes"], summary["prefixes_evicted"]),
    }


def counted(sharing: Sharing) -> tuple[int, int, int]:
    """The bytes the bounds count: the slots', the kept prefixes' and the anchor pools' (one rank's)."""
    summary = sharing.method.state_summary()
    return sharing.held_bytes(), summary["prefix_bytes"], summary["pools_bytes"]


def pool_numbers(method, shard) -> dict:
    """What the pools hold after the trajectory and the numbers the gate's rules compute from them over
    every head (each a reduction over ``D``): the anchors' row energies (the nearness rule), the
    corrections' agreement spread, two bases' relative distance (the duplicate rule) and spread."""
    out = {}
    for key, pool in method.pools.items():
        anchors = list(pool)
        entry = {
            "anchors": [(a.serial, a.source, a.length, sorted(a.deltas)) for a in anchors],
            "energy": [row_energy(a.base, shard) for a in anchors],
        }
        if len(anchors) >= 2:
            rows = min(a.length for a in anchors)
            bases = [anchors[0].base, anchors[1].base]
            entry["agreement"] = correction_agreement(anchors, rows, 1, None, shard)[0]
            entry["distance"] = relative_distance(*bases, shard=shard)
            entry["spread"] = relative_spread(bases, rows, 0, shard)
        out[repr(key)] = entry
    return out


def _gather_heads(replicas: int):
    """Every rank's heads of a ``[layers, m, heads, head_dim]`` tensor joined (a replicated head once)."""

    def gather(x: torch.Tensor) -> torch.Tensor:
        blocks = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(blocks, x.contiguous())
        return torch.cat(blocks[::replicas], dim=2)

    return gather


def _rank_main(rank: int) -> dict:
    tokenizer = embedded_tokenizer()
    config = tiny_model("llama").config
    head_dim = config.hidden_size // config.num_attention_heads
    # a test of one rank's heads (its K/V non-finite: the turn refused) answered alike on every rank
    results = {"any": [any_rank(rank == r, Shard(None, head_dim)) for r in range(WORLD)]}
    for case in CASES:
        kv_heads = KV_HEADS.get(case, 2)
        model = tiny_model("llama", num_key_value_heads=kv_heads)
        first, last = kv_head_range(rank, WORLD, kv_heads)
        own = tiny_model("llama", num_key_value_heads=last - first)  # this rank's skeleton: its KV heads
        replicas = max(1, WORLD // kv_heads)
        method = served(case)
        published: list[torch.Tensor] = []  # the leader's (rank 0's) reduced values, in call order
        shard = Shard(
            None, (last - first) * head_dim, replicas, publish=published.append if rank == 0 else None
        )
        method.run_on_shard(shard)
        sharing = sharing_for(case, own, tokenizer, method)
        before = COLLECTIVES.snapshot()
        run = engine_run(model, slice(first, last), _gather_heads(replicas))
        steps = trajectory(sharing, tokenizer, run)
        results[case] = {
            "steps": steps,
            "collectives": COLLECTIVES.since(before),
            "heads": (first, last),
            "pools": pool_numbers(method, shard),
            "ranks": (method.base_rank, method.delta_rank),
            "published": published,
            "counted": counted(sharing),
        }
    results["nan"] = _non_finite_on_one_rank(rank, tokenizer, head_dim)
    results["nan-correction"] = _correction_non_finite_on_one_rank(rank, tokenizer, head_dim)
    return results


def _non_finite_on_one_rank(rank: int, tokenizer, head_dim: int) -> dict:
    """KVCMAS's first request, its read-back NaN in rank 1's heads only: refused on every rank."""
    model = tiny_model("llama")
    first, last = kv_head_range(rank, WORLD, 2)
    published: list[torch.Tensor] = []
    method = served("kvcmas")
    method.run_on_shard(
        Shard(None, (last - first) * head_dim, publish=published.append if rank == 0 else None)
    )
    sharing = sharing_for("kvcmas", tiny_model("llama", num_key_value_heads=last - first), tokenizer, method)
    run = engine_run(model, slice(first, last), _gather_heads(1))

    step = trajectory(sharing, tokenizer, nan_on_rank_1(rank, run), requests=1)[0]
    return {"error": step["error"], "errors": sharing.errors, "out": step["out"], "published": published}


def _correction_non_finite_on_one_rank(rank: int, tokenizer, head_dim: int) -> dict:
    """KVCMAS's trajectory with every correction rank 1 computes non-finite (its heads only): the first
    plan that computes one is refused on every rank, whose collectives still pair (``paired``)."""
    first, last = kv_head_range(rank, WORLD, 2)
    published: list[torch.Tensor] = []
    method = served("kvcmas")
    shard = Shard(None, (last - first) * head_dim, publish=published.append if rank == 0 else None)
    method.run_on_shard(shard)
    sharing = sharing_for("kvcmas", tiny_model("llama", num_key_value_heads=last - first), tokenizer, method)
    run = engine_run(tiny_model("llama"), slice(first, last), _gather_heads(1))
    return {**corrections_non_finite_on_rank_1(rank, shard, sharing, tokenizer, run), "published": published}


def corrections_non_finite_on_rank_1(rank: int, shard: Any, sharing: Sharing, tokenizer, run: Run) -> dict:
    """``sharing``'s KVCMAS trajectory on ``shard`` until a plan is refused, every correction rank 1
    computes non-finite (its part of the K/V only); ``paired``: whether one more collective after it
    pairs up (only if every rank made the same ones before it)."""
    write_layer = CorrectedKV.write_layer

    def poisoned(self, layer, keys_out, values_out):
        write_layer(self, layer, keys_out, values_out)
        values_out[..., : self.rows, :] = float("nan")

    if rank == 1:
        CorrectedKV.write_layer = poisoned
    try:
        steps = trajectory(sharing, tokenizer, run, until_refused=True)
    finally:
        CorrectedKV.write_layer = write_layer
    return {"steps": steps, "errors": sharing.errors, "paired": any_rank(rank == 1, shard)}


# ------------------------------------------------------------------------------------ the follower
def follow(
    case: str, leader: dict, published: list[torch.Tensor] | None = None, requests: int | None = None
) -> dict:
    """The trajectory on the follower: a full-width skeleton, the case's method on a
    :class:`~hf_kvshare.anchors.sharded.FollowerShard` replaying ``published`` (rank 0's, by default), ``meta`` stand-ins of every
    read-back (the output ids are the engine's, here the leader's)."""
    model = tiny_model("llama", num_key_value_heads=KV_HEADS.get(case, 2))
    queue = deque(leader["published"] if published is None else published)
    method = served(case)
    method.run_on_shard(FollowerShard(queue.popleft))
    sharing = sharing_for(case, model, embedded_tokenizer(), method)
    steps = trajectory(sharing, embedded_tokenizer(), stand_ins(model.config, leader), requests)
    return {
        "steps": steps,
        "pools": pool_numbers(method, method.shard),
        "left": len(queue),
        "held": held_storage(sharing),
        "counted": counted(sharing),
    }


def stand_ins(config, leader: dict):
    """The follower's run of a request: the leader's output ids, ``meta`` stand-ins of every head's
    read-back."""
    head_dim = config.hidden_size // config.num_attention_heads

    def run(plan, keys, values, index):
        out = leader["steps"][index]["out"]
        shape = (
            config.num_hidden_layers,
            len(plan.prompt) + len(out) - 1,
            config.num_key_value_heads,
            head_dim,
        )
        return out, torch.empty(shape, device="meta"), torch.empty(shape, device="meta")

    return run


def held_storage(sharing) -> int:
    """Bytes the follower's slots and pools hold in memory (the bounds count one rank's instead)."""
    held = sum(host.held_bytes() for host in sharing.hosts.values())  # storages: a stand-in holds none
    for pool in sharing.method.pools.values():
        for anchor in pool:
            factors = [*anchor.base.keys, *anchor.base.values]
            factors += [f for delta in anchor.deltas.values() for f in (*delta.keys, *delta.values)]
            held += sum(
                t.numel() * t.element_size()
                for f in factors
                for t in (f.a, f.b)
                if t is not None and not t.is_meta
            )
    return held


def once_per_run(name: str, produce: Callable[[], Any], tmp_path_factory) -> Any:
    """``produce()``'s result, computed once per test run: kept in this process, and shared with the
    run's other xdist workers through ``<name>.pt`` in the run's temporary folder (the first to take
    ``<name>.lock`` computes it, the others wait and load it)."""
    if name not in _ONCE:
        base = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            base = base.parent  # the run's folder, every worker's
        path = base / f"{name}.pt"
        with open(base / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                torch.save(produce(), path)
        _ONCE[name] = torch.load(path, weights_only=False)
    return _ONCE[name]


_ONCE: dict[str, Any] = {}


def rank_runs(tmp_path_factory) -> list[dict]:
    """Every rank's results (:func:`_rank_main`), the ranks spawned once per test run."""

    def spawn() -> list[dict]:
        return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("anchors-trajectory"))

    return once_per_run("anchors-trajectory-ranks", spawn, tmp_path_factory)


def one_rank_runs(tmp_path_factory) -> dict:
    """The trajectory on one rank over every KV head, per case (once per test run)."""
    return once_per_run("anchors-trajectory-one-rank", _one_rank, tmp_path_factory)


def _one_rank() -> dict:
    tokenizer = embedded_tokenizer()
    out = {}
    for case in CASES:
        model = tiny_model("llama", num_key_value_heads=KV_HEADS.get(case, 2))
        sharing = sharing_for(case, model, tokenizer, served(case))
        steps = trajectory(sharing, tokenizer, engine_run(model, slice(None), lambda x: x))
        out[case] = {
            "steps": steps,
            "pools": pool_numbers(sharing.method, None),
            "ranks": (sharing.method.base_rank, sharing.method.delta_rank),
            "counted": counted(sharing),
        }
    return out

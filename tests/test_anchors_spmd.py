"""The served KVCMAS / KVComm engine run on one tensor-parallel rank's KV heads (SPMD, issue 51 item 2).

One task trajectory (five documents, three agents each reading the document and the agents before it)
is driven through :class:`~hf_kvshare.serving.host.Sharing` as the serving host drives it (plan, the
engine's run by :func:`~hf_kvshare.serving.standin.engine`, record): once on one rank over all KV heads,
and on 2 gloo ranks where each rank's Sharing holds a skeleton model whose config has its KV heads,
its method runs on a :class:`~hf_kvshare.anchors.sharded.Shard` (``run_on_shard``) and it gets only its
heads of every read-back (``kv_head_range``). The engine's forward needs every head: the ranks gather
their claimed K/V for it (as vLLM's attention layers use each rank's heads). Every rank's plans claim
what one rank claims, place the same spans from the same sources, take the same gate decisions
(entropies the same on every rank, bit for bit) and its claimed K/V are its heads of the one-rank K/V
to float32 round-off; the pools hold the same anchors and the numbers the gate's rules reduce over the
heads from them are the one-rank numbers. Cases: KVCMAS (factorized anchors, randomized SVD), KVCMAS with
the guard (exact SVD, a rank above a rank's columns), KVComm (dense anchors, prefix deltas) on 2 KV
heads, one per rank, and KVCMAS on 1 KV head replicated on both ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from tiny import embedded_tokenizer, tiny_model

from hf_kvshare.anchors.lowrank import any_rank, relative_distance, relative_spread, row_energy
from hf_kvshare.anchors.pool import correction_agreement
from hf_kvshare.anchors.sharded import COLLECTIVES, Shard
from hf_kvshare.method import get_method
from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.host import Sharing, serving_options
from hf_kvshare.serving.standin import engine
from hf_kvshare.serving.tensor_parallel import kv_head_range

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
}
#: the model's KV heads per case (2 unless said)
KV_HEADS = {"kvcmas-replicated": 1}
SYSTEMS = {"planner": "You plan.\n", "critic": "You criticise.\n", "writer": "You write it up.\n"}
DOCS = [f"Report {t}: the river Lune reaches the sea at Plover Scar, site {t}." for t in range(5)]
QUESTION = " What should we do next?"


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def served(case: str):
    name, options = CASES[case][:2]
    options, _ = serving_options(name, options)
    return get_method(name, **options)


def as_layers(kv) -> torch.Tensor | None:
    """A plan's claimed K/V as one ``[layers, m, heads, head_dim]`` tensor (``None``: nothing claimed)."""
    if isinstance(kv, torch.Tensor):
        return kv
    return torch.stack(list(kv)) if len(kv) else None


def trajectory(sharing: Sharing, model, tokenizer, heads: slice, gather) -> list[dict]:
    """Every request of the trajectory planned, run and recorded; per request what it claimed, placed,
    gated and the claimed K/V (this rank's heads). ``gather``: a rank's heads of a ``[layers, m, heads,
    head_dim]`` tensor -> every head's."""
    steps = []
    for t, doc in enumerate(DOCS):
        for position, agent in enumerate(SYSTEMS):
            host = sharing.hosts.get(f"t{t}")
            ids = ids_of(tokenizer, SYSTEMS[agent]) + ids_of(tokenizer, doc)
            segments = [{"slot": "doc", "text": doc}]
            for reader in list(SYSTEMS)[:position]:
                ids += ids_of(tokenizer, "\nNotes:") + host.slots[reader].token_ids.tolist()
                segments.append({"slot": reader})
            ids += ids_of(tokenizer, QUESTION)
            meta = {lay.KEY: {"task": f"t{t}", "agent": agent, "segments": segments, "output": agent}}
            plan = sharing.plan(f"{t}-{agent}", ids, meta, 0)
            assert plan.error is None
            keys, values = as_layers(plan.keys), as_layers(plan.values)
            every = SimpleNamespace(
                prompt=plan.prompt,
                local_hit=plan.local_hit,
                keys=[] if keys is None else gather(keys),
                values=[] if values is None else gather(values),
            )
            out, k, v = engine(model, every, max_new_tokens=4)
            sharing.record(plan, k[:, :, heads], v[:, :, heads], out, set())
            assert plan.error is None
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
                }
            )
    return steps


def pool_numbers(method, shard: Shard | None) -> dict:
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
        shard = Shard(None, (last - first) * head_dim, replicas)
        method.run_on_shard(shard)
        sharing = Sharing(own, tokenizer, method, min_segment_tokens=4)
        before = COLLECTIVES.snapshot()
        steps = trajectory(sharing, model, tokenizer, slice(first, last), _gather_heads(replicas))
        results[case] = {
            "steps": steps,
            "collectives": COLLECTIVES.since(before),
            "heads": (first, last),
            "pools": pool_numbers(method, shard),
            "ranks": (method.base_rank, method.delta_rank),
        }
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("spmd"))


@pytest.fixture(scope="module")
def one_rank(tokenizer) -> dict:
    out = {}
    for case in CASES:
        model = tiny_model("llama", num_key_value_heads=KV_HEADS.get(case, 2))
        sharing = Sharing(model, tokenizer, served(case), min_segment_tokens=4)
        steps = trajectory(sharing, model, tokenizer, slice(None), lambda x: x)
        out[case] = {
            "steps": steps,
            "pools": pool_numbers(sharing.method, None),
            "ranks": (sharing.method.base_rank, sharing.method.delta_rank),
        }
    return out


def _relative(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_decides_and_claims_what_one_rank_does(ranks, one_rank, case):
    reference = one_rank[case]["steps"]
    outcomes = [g.get("gate") for step in reference for g in step["gates"] if g]
    provenances = [p[0] for step in reference for p in step["placed"] if p]
    # the trajectory exercises the gate both ways and corrections (else it checks little)
    assert "accepted" in outcomes and "fallback" in outcomes and "corrected" in provenances, (
        outcomes,
        provenances,
    )
    for rank in range(WORLD):
        mine = ranks[rank][case]
        first, last = mine["heads"]
        assert mine["collectives"]["all_reduces"] > 0
        assert mine["ranks"] == one_rank[case]["ranks"]  # the rank options clamped to the global D
        assert len(mine["steps"]) == len(reference)
        for step, (got, want) in enumerate(zip(mine["steps"], reference)):
            where = f"{case}, rank {rank}, request {step}"
            assert got["claim"] == want["claim"], where
            assert got["placed"] == want["placed"], where
            assert got["out"] == want["out"], where
            assert len(got["gates"]) == len(want["gates"]), where
            for mine_gate, one_gate in zip(got["gates"], want["gates"]):
                assert (mine_gate is None) == (one_gate is None), where
                if one_gate is None:
                    continue
                assert set(mine_gate) == set(one_gate), where
                for key, value in one_gate.items():
                    if isinstance(value, float):
                        assert mine_gate[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (where, key)
                    else:
                        assert mine_gate[key] == value, (where, key)
            for side in ("keys", "values"):
                if want[side] is None:
                    assert got[side] is None, where
                    continue
                assert _relative(got[side], want[side][:, :, first:last]) <= 1e-5, (where, side)
    # every rank took its decisions on the same numbers, bit for bit
    gates = [[step["gates"] for step in ranks[rank][case]["steps"]] for rank in range(WORLD)]
    assert all(g == gates[0] for g in gates)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_holds_the_one_rank_pools_and_measures_them_alike(ranks, one_rank, case):
    """The pools after the trajectory: the same anchors (serials, sources, lengths, consumers) on every
    rank as on one rank, and what the gate's rules reduce over ``D`` from them is the one-rank number."""
    reference = one_rank[case]["pools"]
    assert any("agreement" in entry for entry in reference.values())
    for rank in range(WORLD):
        pools = ranks[rank][case]["pools"]
        assert list(pools) == list(reference)
        for key, want in reference.items():
            got = pools[key]
            assert got["anchors"] == want["anchors"], (rank, key)
            for mine, one in zip(got["energy"], want["energy"]):
                assert mine == pytest.approx(one, rel=1e-5), (rank, key, "energy")
            for number in ("agreement", "distance", "spread"):
                mine, one = got.get(number), want.get(number)
                assert (mine is None) == (one is None), (rank, key, number)
                if one is not None:  # pytest >= 9.2 refuses approx(None) with a tolerance
                    assert mine == pytest.approx(one, rel=1e-4, abs=1e-6), (rank, key, number)


def test_a_test_of_one_ranks_heads_is_answered_alike_on_every_rank(ranks):
    assert all(ranks[rank]["any"] == [True] * WORLD for rank in range(WORLD))


def test_kvcmas_factorizes_across_the_ranks(ranks):
    """KVCMAS's anchors (rank 4 of D = 32) are factorized by the sharded randomized SVD: all-gathers ran."""
    assert all(ranks[rank]["kvcmas"]["collectives"]["all_gathers"] > 0 for rank in range(WORLD))


def test_the_shard_is_set_before_the_method_is_bound(tiny_llama):
    """The rank options are clamped to the global ``D`` when the method is bound: a shard set after
    that is refused."""
    method = served("kvcmas")
    method.bind(tiny_llama)
    with pytest.raises(ValueError, match="before the method is bound"):
        method.run_on_shard(None)

"""KVCMAS / KVComm ``defer_factorization``: a record stores its anchors' deltas and bases unfactorized;
``Method.deferred_work`` (run by the session in the record, by the serving host when no plan waits) or
the first reader factorizes them, with the same factors as factorizing at once."""

from __future__ import annotations

import gc

import pytest
import torch
from kvcmas_workflow import PREVIOUS, QUERIES, run_request

from hf_kvshare.anchors.lowrank import FACTORIZATIONS, DeferredFactoredKV, FactoredKV
from hf_kvshare.anchors.pool import Anchor, Deltas
from hf_kvshare.methods.kvcmas import KVCMAS
from hf_kvshare.methods.kvcomm import KVComm

#: ranks under the tiny model's width, so that the anchors run truncated SVDs
RANKS = dict(base_rank=4, delta_rank=4)


def factors(method):
    """Every anchor's base and delta factors, as plain tensors (reading them factorizes)."""
    out = []
    for name, pool in sorted(method.pools.items()):
        for anchor in pool:
            parts = [anchor.base] + [anchor.deltas[t] for t in sorted(anchor.deltas)]
            for part in parts:
                for f in (*part.keys, *part.values):
                    out.append((name, anchor.serial, f.a, f.b))
    return out


def assert_same_factors(a, b):
    assert len(a) == len(b) and a
    for (na, sa, aa, ba), (nb, sb, ab, bb) in zip(a, b):
        assert (na, sa) == (nb, sb)
        for x, y in ((aa, ab), (ba, bb)):
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(x, y)


@pytest.mark.parametrize(
    "cls, options", [(KVCMAS, {}), (KVComm, PREVIOUS[KVComm])], ids=["kvcmas", "kvcomm-edge"]
)
def test_a_session_factorizes_in_the_record_the_same_anchors_and_tokens(tiny_llama, tokenizer, cls, options):
    runs = []
    for defer in (False, True):
        method = cls(tau=1.0, defer_factorization=defer, **RANKS, **options)
        results = [run_request(tiny_llama, tokenizer, method, q, keep_cache=True) for q in QUERIES[:3]]
        assert not any(
            isinstance(v, DeferredFactoredKV) and not v.resolved
            for pool in method.pools.values()
            for a in pool
            for v in (a.__dict__["base"], *a.deltas.held())
        ), "the session left a factorization for later"
        assert method.deferred_work() == []
        runs.append((method, results))
    (eager, a), (deferred, b) = runs
    assert any(s.provenance == "corrected" for r in a for t in r for s in t.cache.segments)
    for ra, rb in zip(a, b):
        for x, y in zip(ra, rb):
            assert x.output_ids.tolist() == y.output_ids.tolist()
    assert_same_factors(factors(eager), factors(deferred))


def test_a_record_left_alone_factorizes_nothing_and_the_work_gives_the_eager_factors(tiny_llama, tokenizer):
    """Without the session's settling (the serving host's path): the record factorizes nothing; the
    work's callables run at most what the eager record did and give the same factors."""
    eager = KVCMAS(tau=1.0, **RANKS)
    deferred = KVCMAS(tau=1.0, defer_factorization=True, **RANKS)
    left = []
    deferred.deferred_work = lambda: []  # what the session runs: nothing here, the work is kept below
    before = FACTORIZATIONS.snapshot()
    run_request(tiny_llama, tokenizer, eager, QUERIES[0])
    eager_count = FACTORIZATIONS.since(before)
    assert eager_count["svds"] > 0
    before = FACTORIZATIONS.snapshot()
    run_request(tiny_llama, tokenizer, deferred, QUERIES[0])
    assert FACTORIZATIONS.since(before)["matrices"] == 0
    del deferred.deferred_work
    left = deferred.deferred_work()
    assert left
    held = [a for pool in deferred.pools.values() for a in pool]
    assert all(a.base_deferred and a.deltas.deferred() for a in held)
    before = FACTORIZATIONS.snapshot()
    for work in left:
        work()
    ran = FACTORIZATIONS.since(before)
    # a chained question's base replaced by the next consumer's rebase before its turn came: never run
    assert 0 < ran["svds"] <= eager_count["svds"] and ran["matrices"] <= eager_count["matrices"]
    assert not any(a.base_deferred or a.deltas.deferred() for a in held)
    before = FACTORIZATIONS.snapshot()
    for work in left:  # done: no-ops
        work()
    assert FACTORIZATIONS.since(before)["matrices"] == 0
    assert_same_factors(factors(eager), factors(deferred))


def test_a_reader_factorizes_a_deferred_delta_first_and_the_work_is_then_a_no_op():
    torch.manual_seed(0)
    keys = [torch.randn(1, 2, 12, 4) for _ in range(2)]
    values = [torch.randn(1, 2, 12, 4) for _ in range(2)]
    eager = FactoredKV.from_kv(keys, values, 3, "randomized")
    deferred = DeferredFactoredKV(
        lambda: zip(keys, values),
        lambda: (*keys, *values),
        3,
        "randomized",
        length=12,
        kv_heads=2,
        num_layers=2,
    )
    anchor = Anchor(base=eager, source="a", origin=0, deltas={"b": deferred})
    assert isinstance(anchor.deltas, Deltas) and anchor.deltas.deferred()
    assert anchor.nbytes == eager.nbytes + sum(t.untyped_storage().nbytes() for t in (*keys, *values))
    got = anchor.deltas["b"]
    assert isinstance(got, FactoredKV) and not anchor.deltas.deferred()
    for x, y in zip((*got.keys, *got.values), (*eager.keys, *eager.values)):
        assert torch.equal(x.a, y.a) and torch.equal(x.b, y.b)
    assert anchor.nbytes == 2 * eager.nbytes
    before = FACTORIZATIONS.snapshot()
    deferred.resolve()
    assert FACTORIZATIONS.since(before)["matrices"] == 0
    assert [type(v) for v in anchor.deltas.values()] == [FactoredKV]
    assert [k for k, _ in anchor.deltas.items()] == ["b"] and anchor.deltas.get("c") is None


def test_work_of_an_anchor_dropped_before_it_ran_is_a_no_op(tiny_llama, tokenizer):
    method = KVCMAS(tau=1.0, defer_factorization=True, **RANKS)
    method.deferred_work = lambda: []
    run_request(tiny_llama, tokenizer, method, QUERIES[0])
    del method.deferred_work
    left = method.deferred_work()
    assert left
    for pool in method.pools.values():
        pool.anchors.clear()
    gc.collect()
    before = FACTORIZATIONS.snapshot()
    for work in left:
        work()
    assert FACTORIZATIONS.since(before)["matrices"] == 0

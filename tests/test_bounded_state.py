"""Cross-request state is bounded: the LRU dictionary keeps the most recently used entries, KVCMAS's
anchor pools and GraphFlow's profiles stay within their instance's limit (the evictions counted)."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from hf_kvshare import METHODS, Session


def test_lru_dict_keeps_the_most_recently_used_entries():
    from hf_kvshare.anchors import LRUDict

    pools = LRUDict(8)
    for i in range(500):
        pools[f"doc{i}"] = i
        pools.touch("doc0")  # used on every request: never evicted
        assert len(pools) <= 8
    assert "doc0" in pools and list(pools)[-7:] == [f"doc{i}" for i in range(493, 500)][-6:] + ["doc0"]
    assert pools.evicted == 500 - 8
    _ = pools["doc495"]  # reading does not reorder
    assert list(pools)[-1] == "doc0"
    with pytest.raises(ValueError, match="int >= 1"):
        LRUDict(0)


@pytest.mark.parametrize(
    "name, options, key",
    [("kvcmas", {"max_pools": 3}, "pools"), ("graphflow", {"max_profiles": 4}, "profiles")],
)
def test_pools_and_profiles_per_instance_are_bounded(name, options, key, tokenizer):
    from hf_kvshare import PF, PH

    model = tiny_model("llama", seed=3, num_hidden_layers=2)
    method = METHODS[name](**options)
    for i in range(12):  # a new slot and agent name per request
        session = Session(model, tokenizer, method)
        session.run_turn(
            f"writer{i}", [PF("Write.\n"), PH(f"doc{i}", f"text number {i}"), PF(":")], max_new_tokens=1
        )
        session.run_turn(
            "reader", [PF("Read.\n"), PH(f"writer{i}"), PF(" and "), PH(f"doc{i}")], max_new_tokens=1
        )
    summary = method.state_summary()
    bound = next(iter(options.values()))
    assert summary[key] == len(getattr(method, key)) <= bound
    assert summary[f"max_{key}"] == bound and summary[f"evicted_{key}"] > 0
    assert summary["bytes"] == method.state_bytes()

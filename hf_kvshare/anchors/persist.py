"""Anchor pools and relation profiles as flat named tensors plus JSON-able metadata (no pickle).

``pools_to_state(pools)`` / ``pools_from_state(tensors, meta)`` and the same for profiles give back
objects equal bit for bit (tensors, dtypes, devices aside, LFU counters, insertion serials,
eviction counts, dict order): a method restored from them takes the same decisions on its next
requests. :meth:`hf_kvshare.method.Method.save_state` writes the tensors as safetensors and the
metadata as JSON.
"""

from __future__ import annotations

from typing import Any

import torch

from .lowrank import FactoredKV, MatrixFactors
from .pool import Anchor, AnchorPool
from .profile import RelationProfile


class TensorTable:
    """Names tensors ``t0, t1, ...`` for one safetensors file; a tensor sharing storage with one
    already stored is copied (safetensors refuses shared storage)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def add(self, tensor: torch.Tensor) -> str:
        tensor = tensor.detach()
        storage = tensor.untyped_storage().data_ptr()
        if storage in self._storages or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()
        self._storages.add(tensor.untyped_storage().data_ptr())
        name = f"t{len(self.tensors)}"
        self.tensors[name] = tensor
        return name


def _get(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(
            f"saved method state is incomplete: tensor {name!r} is missing from the safetensors file"
        )
    return tensors[name]


def _factors_out(f: MatrixFactors, table: TensorTable) -> list[str]:
    return [table.add(f.a)] if f.b is None else [table.add(f.a), table.add(f.b)]


def _factors_in(names: list[str], tensors) -> MatrixFactors:
    return MatrixFactors(a=_get(tensors, names[0]), b=_get(tensors, names[1]) if len(names) > 1 else None)


def factored_out(kv: FactoredKV, table: TensorTable) -> dict[str, Any]:
    return {
        "length": kv.length,
        "kv_heads": kv.kv_heads,
        "keys": [_factors_out(f, table) for f in kv.keys],
        "values": [_factors_out(f, table) for f in kv.values],
    }


def factored_in(meta: dict[str, Any], tensors) -> FactoredKV:
    return FactoredKV(
        keys=[_factors_in(n, tensors) for n in meta["keys"]],
        values=[_factors_in(n, tensors) for n in meta["values"]],
        length=meta["length"],
        kv_heads=meta["kv_heads"],
    )


def to_json_key(value: Any) -> Any:
    """Tuples (anchor origins, profile keys) as lists; other JSON values unchanged."""
    if isinstance(value, tuple):
        return [to_json_key(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ValueError(f"cannot save {value!r} ({type(value).__name__}) as JSON")


def from_json_key(value: Any) -> Any:
    return tuple(from_json_key(v) for v in value) if isinstance(value, list) else value


def pools_to_state(pools: dict[str, AnchorPool], table: TensorTable) -> list[dict[str, Any]]:
    """Metadata of ``pools`` (in order); their tensors go to ``table``."""
    return [
        {
            "key": key,
            "slot": pool.slot,
            "capacity": pool.capacity,
            "peak": pool.peak,
            "eviction_window": pool.eviction_window,
            "serial": pool._serial,
            "evicted": pool.evicted,
            "anchors": [
                {
                    "source": anchor.source,
                    "origin": to_json_key(anchor.origin),
                    "uses": anchor.uses,
                    "serial": anchor.serial,
                    "base": factored_out(anchor.base, table),
                    "deltas": [
                        [target, factored_out(delta, table)] for target, delta in anchor.deltas.items()
                    ],
                    "frame": anchor.frame,
                    "base_start": anchor.base_start,
                    "prefix_deltas": [
                        [target, list(ids), factored_out(delta, table)]
                        for target, (ids, delta) in anchor.prefix_deltas.items()
                    ],
                }
                for anchor in pool.anchors
            ],
        }
        for key, pool in pools.items()
    ]


def pools_from_state(meta: list[dict[str, Any]], tensors: dict[str, torch.Tensor]) -> dict[str, AnchorPool]:
    pools: dict[str, AnchorPool] = {}
    for entry in meta:
        pool = AnchorPool(entry["slot"], entry["capacity"], entry["eviction_window"], peak=entry["peak"])
        for a in entry["anchors"]:
            anchor = Anchor(
                base=factored_in(a["base"], tensors),
                source=a["source"],
                origin=from_json_key(a["origin"]),
                deltas={target: factored_in(d, tensors) for target, d in a["deltas"]},
                uses=a["uses"],
                serial=a["serial"],
                frame=a.get("frame", "canonical"),
                base_start=int(a.get("base_start", 0)),
                prefix_deltas={
                    target: (tuple(int(t) for t in ids), factored_in(d, tensors))
                    for target, ids, d in a.get("prefix_deltas", [])
                },
            )
            pool.anchors.append(anchor)
        pool._serial, pool.evicted = entry["serial"], entry["evicted"]
        pools[entry["key"]] = pool
    return pools


def profiles_to_state(
    profiles: dict[tuple[str, str], RelationProfile], table: TensorTable
) -> list[dict[str, Any]]:
    out = []
    for key, p in profiles.items():
        out.append(
            {
                "key": to_json_key(key),
                "slot": p.slot,
                "target": p.target,
                "calibration_requests": p.calibration_requests,
                "rank": p.rank,
                "requests": sorted(p.requests),
                "kv_heads": p._kv_heads,
                "key_sums": [table.add(t) for t in p._key_sums],
                "value_sums": [table.add(t) for t in p._value_sums],
                "counts": None if p._counts is None else table.add(p._counts),
                "frozen": None if p.frozen is None else factored_out(p.frozen, table),
            }
        )
    return out


def profiles_from_state(meta: list[dict[str, Any]], tensors) -> dict[tuple[str, str], RelationProfile]:
    profiles = {}
    for e in meta:
        p = RelationProfile(e["slot"], e["target"], e["calibration_requests"], e["rank"])
        p.requests = set(e["requests"])
        p._kv_heads = e["kv_heads"]
        p._key_sums = [_get(tensors, n) for n in e["key_sums"]]
        p._value_sums = [_get(tensors, n) for n in e["value_sums"]]
        p._counts = None if e["counts"] is None else _get(tensors, e["counts"])
        p.frozen = None if e["frozen"] is None else factored_in(e["frozen"], tensors)
        profiles[from_json_key(e["key"])] = p
    return profiles


def move_state_to_model(method: Any, model: torch.nn.Module) -> None:
    """Move a method's loaded state onto ``model``'s device (state loaded before any model was bound
    lives on the CPU); nothing happens when it is there already."""
    param = next(model.parameters(), None)
    tensors, meta = method.export_state()
    if param is None or all(t.device == param.device for t in tensors.values()):
        return
    method.import_state({k: t.to(param.device) for k, t in tensors.items()}, meta)

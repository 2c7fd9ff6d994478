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


Dims = "tuple[int, int, int] | None"  # (layers, kv heads, head dim) of the saved model, when known


class _Reader:
    """Reads a saved state's tensors by name, checking each is present, a 2-D float matrix where a
    factor is expected, and remembering the names used (a tensor no entry names is refused)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dims):
        self.tensors, self.dims, self.used = tensors, dims, set()

    def get(self, name: Any) -> torch.Tensor:
        if not isinstance(name, str) or name not in self.tensors:
            raise ValueError(
                f"saved method state is incomplete: tensor {name!r} is missing from the safetensors file"
            )
        self.used.add(name)
        return self.tensors[name]

    def factors(self, names: Any, length: int, dim: int, what: str) -> MatrixFactors:
        if not isinstance(names, list) or len(names) not in (1, 2):
            raise ValueError(f"{what}: one or two tensor names expected, got {names!r}")
        a = self.get(names[0])
        b = self.get(names[1]) if len(names) > 1 else None
        shapes = [tuple(a.shape)] + ([] if b is None else [tuple(b.shape)])
        if b is None:
            ok = a.dim() == 2 and tuple(a.shape) == (length, dim)
        else:
            ok = a.dim() == 2 and b.dim() == 2 and a.shape[0] == length and a.shape[1] == b.shape[0]
            ok = ok and b.shape[1] == dim and 1 <= a.shape[1] <= min(length, dim)
        if not ok or not a.is_floating_point() or (b is not None and b.dtype != a.dtype):
            raise ValueError(
                f"{what}: factors of shapes {shapes} ({a.dtype}) do not form a [{length}, {dim}] matrix "
                "(dense [L, D], or [L, r] @ [r, D] with r <= min(L, D))"
            )
        return MatrixFactors(a=a, b=b)

    def count(self, value: Any, what: str, low: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
        return value


def _factors_out(f: MatrixFactors, table: TensorTable) -> list[str]:
    return [table.add(f.a)] if f.b is None else [table.add(f.a), table.add(f.b)]


def factored_out(kv: FactoredKV, table: TensorTable) -> dict[str, Any]:
    return {
        "length": kv.length,
        "kv_heads": kv.kv_heads,
        "keys": [_factors_out(f, table) for f in kv.keys],
        "values": [_factors_out(f, table) for f in kv.values],
    }


def factored_in(meta: dict[str, Any], reader: _Reader, what: str, length: int | None = None) -> FactoredKV:
    """A saved :class:`FactoredKV`, its layers, length, kv heads and factor shapes checked against
    each other, ``length`` (when the caller knows it) and the saved model's dims."""
    n = reader.count(meta["length"], f"{what}: length", 1)
    heads = reader.count(meta["kv_heads"], f"{what}: kv_heads", 1)
    if length is not None and n != length:
        raise ValueError(f"{what}: length {n}, but it is for {length} tokens")
    keys, values = meta["keys"], meta["values"]
    if not isinstance(keys, list) or not isinstance(values, list) or not keys or len(keys) != len(values):
        raise ValueError(f"{what}: {len(keys)} key and {len(values)} value layers")
    dims = reader.dims
    if dims is not None and (len(keys), heads) != (dims[0], dims[1]):
        raise ValueError(
            f"{what}: {len(keys)} layers x {heads} kv heads, the saved model {dims[0]} layers x {dims[1]}"
        )
    if dims is not None:
        dim = heads * dims[2]
    else:  # the first layer's keys tell it: dense [L, D] or [L, r] @ [r, D]
        first = keys[0] if isinstance(keys[0], list) and keys[0] else [None]
        dim = reader.get(first[-1]).shape[-1]
    if dim % heads:
        raise ValueError(f"{what}: a K/V dimension of {dim} is not a multiple of {heads} kv heads")
    return FactoredKV(
        keys=[reader.factors(f, n, dim, f"{what} layer {i} keys") for i, f in enumerate(keys)],
        values=[reader.factors(f, n, dim, f"{what} layer {i} values") for i, f in enumerate(values)],
        length=n,
        kv_heads=heads,
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
                    # refresh evidence (KVCMAS ``profile="reuse"``); absent when none, as before it existed
                    **({"agreement": dict(anchor.agreement)} if anchor.agreement else {}),
                }
                for anchor in pool.anchors
            ],
        }
        for key, pool in pools.items()
    ]


def _check_agent(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a non-empty string (a name), got {name!r}")


def _agreement(saved: Any, what: str) -> dict[str, float]:
    """An anchor's saved refresh evidence: agent -> spread (a real number >= 0)."""
    if not isinstance(saved, dict):
        raise ValueError(f"{what}: agreement must be a mapping of agent -> spread, got {saved!r}")
    for agent, spread in saved.items():
        _check_agent(agent, f"{what}: an agreement's agent")
        if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not spread >= 0:
            raise ValueError(f"{what}: the agreement of {agent!r} must be a real number >= 0, got {spread!r}")
    return {agent: float(spread) for agent, spread in saved.items()}


def pools_from_state(
    meta: list[dict[str, Any]], tensors: dict[str, torch.Tensor], dims=None
) -> tuple[dict[str, AnchorPool], set[str]]:
    """The pools of :func:`pools_to_state` and the tensor names they use, every anchor's base,
    deltas and prefix deltas checked against each other and ``dims`` (raises ``ValueError``)."""
    reader = _Reader(tensors, dims)
    pools: dict[str, AnchorPool] = {}
    if not isinstance(meta, list):
        raise ValueError(f"pools must be a list, got {type(meta).__name__}")
    for p, entry in enumerate(meta):
        pool = AnchorPool(
            entry["slot"],
            reader.count(entry["capacity"], f"pool {p}: capacity", 1),
            reader.count(entry["eviction_window"], f"pool {p}: eviction_window", 1),
            peak=reader.count(entry["peak"], f"pool {p}: peak", 1),
        )
        if not isinstance(entry["slot"], str) or not isinstance(entry["key"], str):
            raise ValueError(f"pool {p}: key {entry['key']!r} and slot {entry['slot']!r} must be strings")
        anchors = entry["anchors"]
        if not isinstance(anchors, list) or len(anchors) > pool.peak:
            raise ValueError(f"pool {p}: {anchors!r:.80} is not a list of at most {pool.peak} anchors")
        for i, a in enumerate(anchors):
            what = f"pool {entry['key']!r} anchor {i}"
            base = factored_in(a["base"], reader, f"{what} base")
            deltas = {}
            if not isinstance(a["source"], str):
                raise ValueError(f"{what}: source must be an agent name (a string), got {a['source']!r}")
            for target, d in a["deltas"]:
                _check_agent(target, f"{what}: a delta's agent")
                deltas[target] = factored_in(d, reader, f"{what} delta for {target!r}", base.length)
            prefix_deltas = {}
            for target, ids, d in a.get("prefix_deltas", []):
                _check_agent(target, f"{what}: a prefix delta's agent")
                if not isinstance(ids, list) or any(
                    isinstance(t, bool) or not isinstance(t, int) for t in ids
                ):
                    raise ValueError(f"{what}: prefix delta ids for {target!r} must be a list of ints")
                prefix_deltas[target] = (
                    tuple(ids),
                    factored_in(d, reader, f"{what} prefix delta for {target!r}", len(ids)),
                )
            anchor = Anchor(
                base=base,
                source=a["source"],
                origin=from_json_key(a["origin"]),
                deltas=deltas,
                uses=reader.count(a["uses"], f"{what}: uses"),
                serial=a["serial"],
                frame=a.get("frame", "canonical"),
                base_start=reader.count(a.get("base_start", 0), f"{what}: base_start"),
                prefix_deltas=prefix_deltas,
                agreement=_agreement(a.get("agreement", {}), what),
            )
            if anchor.frame not in ("canonical", "writer") or not isinstance(anchor.serial, int):
                raise ValueError(f"{what}: frame {anchor.frame!r}, serial {anchor.serial!r}")
            if any(x.serial == anchor.serial or x.origin == anchor.origin for x in pool.anchors):
                raise ValueError(f"{what}: serial {anchor.serial} or origin {anchor.origin!r} appears twice")
            pool.anchors.append(anchor)
        pool._serial = reader.count(entry["serial"], f"pool {p}: serial")
        pool.evicted = reader.count(entry["evicted"], f"pool {p}: evicted")
        if entry["key"] in pools:
            raise ValueError(f"pool key {entry['key']!r} appears twice")
        pools[entry["key"]] = pool
    return pools, reader.used


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


def profiles_from_state(meta: list[dict[str, Any]], tensors, dims=None):
    """The profiles of :func:`profiles_to_state` and the tensor names they use, running sums and
    frozen corrections checked against each other and ``dims`` (raises ``ValueError``)."""
    reader = _Reader(tensors, dims)
    profiles = {}
    if not isinstance(meta, list):
        raise ValueError(f"profiles must be a list, got {type(meta).__name__}")
    for i, e in enumerate(meta):
        what = f"profile {i}"
        p = RelationProfile(
            e["slot"],
            e["target"],
            reader.count(e["calibration_requests"], f"{what}: calibration_requests", 1),
            e["rank"],
        )
        if e["rank"] is not None:
            reader.count(e["rank"], f"{what}: rank", 1)
        requests = e["requests"]
        if not isinstance(requests, list) or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in requests
        ):
            raise ValueError(
                f"{what}: requests must be a list of request uids (ints >= 0), got {requests!r:.80}"
            )
        for field in ("slot", "target"):
            _check_agent(e[field], f"{what}: {field}")
        if from_json_key(e["key"]) != (e["slot"], e["target"]):
            raise ValueError(
                f"{what}: key {e['key']!r} is not [slot, target] = [{e['slot']!r}, {e['target']!r}]"
            )
        p.requests = set(requests)
        p._kv_heads = reader.count(e["kv_heads"], f"{what}: kv_heads")
        p._key_sums = [reader.get(n) for n in e["key_sums"]]
        p._value_sums = [reader.get(n) for n in e["value_sums"]]
        p._counts = None if e["counts"] is None else reader.get(e["counts"])
        sums = [*p._key_sums, *p._value_sums]
        if p._counts is None:
            if sums:
                raise ValueError(f"{what}: running sums without counts")
        else:
            rows = p._counts.shape[0] if p._counts.dim() == 1 else -1
            shapes = {tuple(t.shape) for t in sums}
            layers = len(p._key_sums)
            ok = rows >= 1 and len(shapes) == 1 and len(p._value_sums) == layers and p._kv_heads >= 1
            ok = ok and len(next(iter(shapes))) == 2 and next(iter(shapes))[0] == rows
            if ok and dims is not None:
                ok = (layers, p._kv_heads, next(iter(shapes))[1]) == (dims[0], dims[1], dims[1] * dims[2])
            if not ok:
                raise ValueError(
                    f"{what}: running sums of shapes {sorted(shapes)} ({layers} key / {len(p._value_sums)} value "
                    f"layers), counts {tuple(p._counts.shape)}, kv_heads {p._kv_heads} disagree"
                    + (
                        ""
                        if dims is None
                        else f" (saved model: {dims[0]} layers x {dims[1]} kv heads x {dims[2]})"
                    )
                )
        p.frozen = None if e["frozen"] is None else factored_in(e["frozen"], reader, f"{what} frozen")
        key = from_json_key(e["key"])
        if key in profiles:
            raise ValueError(f"profile key {key!r} appears twice")
        profiles[key] = p
    return profiles, reader.used


def move_state_to_model(method: Any, model: torch.nn.Module) -> None:
    """Move a method's loaded state onto ``model``'s device (state loaded before any model was bound
    lives on the CPU); nothing happens when it is there already."""
    param = next(model.parameters(), None)
    tensors, meta = method.export_state()
    if param is None or all(t.device == param.device for t in tensors.values()):
        return
    method.import_state({k: t.to(param.device) for k, t in tensors.items()}, meta)

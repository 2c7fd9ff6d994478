"""KVCMAS study: the correction methods side by side on the 4-agent HumanEval workload.

    python -m hf_kvshare.bench study kvcmas --out runs/studies --threads 1

3 warm-up requests put anchor pools and GraphFlow's profiles in steady state; collectors:
:class:`DeltaRanks`, :class:`AnchorBytes` and :class:`Pools`.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from ...anchors import FactoredKV, canonical_keys, context_free_reference, effective_rank, to_matrix
from ...cache import SegmentedCache
from ...evaluation.metrics import relative_error
from ...prefill import model_input_device, prefill_dense
from ...rope import RopeShifter
from ..report import write_csv
from . import TableCollector, run_study, study_options

#: the workload when none is given (``--workload ...`` replaces all of these)
WORKLOAD = {"workload": "humaneval", "limit": 13, "warmup": 3, "max_new_tokens": 48}
METHODS = [
    "nonshared",
    "fullshared",
    "kvcomm",
    "kvcmas-nonchained",
    "kvcmas",
    "graphflow",
    "kvcmas:tau=0.1",
    "kvcmas:tau=0.5",
]


def _delta_rank(target, source, rtol: float = 1e-4) -> int:
    """Effective rank of ``target - source``; 0 when the difference is rounding noise (layer 0's
    K/V depend on the token alone, so its delta is zero up to float error)."""
    delta = to_matrix(target - source)
    if delta.norm() <= rtol * to_matrix(target).norm():
        return 0
    return effective_rank(delta)


class DeltaRanks(TableCollector):
    """Effective rank (90% energy) by layer of the exact cache of a shared segment and of its deltas
    between consecutive consumers (and against a context-free prefill), on NonShared's exact
    teacher-forced caches, averaged over the recorded requests' consumer pairs."""

    name, title = "rank", "Effective rank of shared segments and of their deltas, by layer (90% energy)"
    columns = [
        ("layer", "layer", "d"),
        ("base_key", "base K", ".1f"),
        ("base_value", "base V", ".1f"),
        ("delta_key", "delta K", ".1f"),
        ("delta_value", "delta V", ".1f"),
        ("pf_delta_key", "PF delta K", ".1f"),
        ("pf_delta_value", "PF delta V", ".1f"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[dict[str, Any]] = []

    def collect(self, runner, task, index, run) -> None:
        exact = run.forced.get(run.reference)
        if not exact:
            return
        model, shifter = runner.model, RopeShifter.from_model(runner.model)
        consumers: dict[str, list[tuple[str, Any, Any]]] = defaultdict(list)
        for turn in exact:
            for seg in turn.cache.segments:
                if seg.kind == "PH":
                    ids = turn.prompt_ids[seg.start : seg.end]
                    consumers[seg.name].append((turn.agent, turn.cache.extract(seg.start, seg.end), ids))
        for slot, seen in consumers.items():
            reference = context_free_reference(model, seen[0][2])
            ref_k = canonical_keys(reference, shifter)
            for (src_agent, src, _), (dst_agent, dst, _) in zip(seen, seen[1:]):
                src_k, dst_k = canonical_keys(src, shifter), canonical_keys(dst, shifter)
                for layer in range(src.num_layers):
                    self.pairs.append(
                        {
                            "request": task.id,
                            "slot": slot,
                            "edge": f"{src_agent}->{dst_agent}",
                            "length": src.length,
                            "layer": layer,
                            "base_key": effective_rank(to_matrix(src_k[layer])),
                            "base_value": effective_rank(to_matrix(src.values[layer])),
                            "delta_key": _delta_rank(dst_k[layer], src_k[layer]),
                            "delta_value": _delta_rank(dst.values[layer], src.values[layer]),
                            "pf_delta_key": _delta_rank(dst_k[layer], ref_k[layer]),
                            "pf_delta_value": _delta_rank(dst.values[layer], reference.values[layer]),
                        }
                    )

    def finish(self, runner) -> None:
        by_layer: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for row in self.pairs:
            by_layer[row["layer"]].append(row)
        keys = [c for c, _, _ in self.columns[1:]]
        self.rows = [
            {"layer": layer, **{k: sum(r[k] for r in rows) / len(rows) for k in keys}, "pairs": len(rows)}
            for layer, rows in sorted(by_layer.items())
        ]
        if self.pairs:
            write_csv(runner.dir / "rank_pairs.csv", self.pairs)
        super().finish(runner)


class AnchorBytes(TableCollector):
    """Exact bytes of one stored cache (all layers, K and V) dense vs rank ``rank``, by length, with
    the rank-``rank`` reconstruction error."""

    name, title = "anchor_bytes", "Bytes of one stored cache: dense vs low rank"

    def __init__(self, rank: int = 32, lengths: Sequence[int] = (16, 32, 64, 128, 256, 512, 1024)) -> None:
        super().__init__()
        self.rank, self.lengths = rank, tuple(lengths)
        self.columns = [
            ("length", "tokens", "d"),
            ("dense_bytes", "dense bytes", "d"),
            (f"rank{rank}_bytes", f"rank-{rank} bytes", "d"),
            ("ratio", "dense / low rank", ".2f"),
            (f"rank{rank}_rel_error", f"rank-{rank} rel. error", ".4f"),
        ]
        self.text = ""

    def collect(self, runner, task, index, run) -> None:  # the text the caches are measured on
        if len(self.text) < 8 * max(self.lengths):
            self.text += " ".join(t.text for t in run.free[run.reference]) + " "

    def finish(self, runner) -> None:
        ids = runner.tokenizer(self.text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        if ids.numel() == 0:
            return
        ids = ids[: max(self.lengths)]
        cache = SegmentedCache(runner.model.config)
        prefill_dense(cache, runner.model, ids[None].to(model_input_device(runner.model)))
        for length in (n for n in self.lengths if n <= ids.numel()):
            kv = cache.extract(0, length)
            dense = FactoredKV.from_kv(kv.keys, kv.values, None)
            low = FactoredKV.from_kv(kv.keys, kv.values, self.rank)
            exact, approx = ([f.reconstruct().flatten() for f in (*c.keys, *c.values)] for c in (dense, low))
            self.rows.append(
                {
                    "length": length,
                    "dense_bytes": dense.nbytes,
                    f"rank{self.rank}_bytes": low.nbytes,
                    "ratio": dense.nbytes / low.nbytes,
                    f"rank{self.rank}_rel_error": relative_error(torch.cat(approx), torch.cat(exact)),
                }
            )
        super().finish(runner)


class Pools(TableCollector):
    """Each correction method's anchor pools after the run (the timed pass's instance)."""

    name, title = "pools", "Anchor pools at the end of the run (timed pass)"
    columns = [
        ("method", "method", ""),
        ("slot", "slot", ""),
        ("anchors", "anchors", "d"),
        ("capacity", "capacity", "d"),
        ("deltas", "deltas", "d"),
        ("evicted", "evicted", "d"),
        ("bytes", "bytes", "d"),
    ]

    def finish(self, runner) -> None:
        for pair in runner.pairs:
            report = getattr(pair.free, "pool_report", None)
            for pool in report() if report else []:
                self.rows.append({"method": pair.label, **pool})
        super().finish(runner)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = {**({} if "--workload" in argv else WORKLOAD), "methods": METHODS}
    options = study_options("kvcmas", argv, defaults)
    collectors = [DeltaRanks(), AnchorBytes(), Pools()]
    return run_study("kvcmas", options, collectors, __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())

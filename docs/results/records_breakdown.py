"""Per hop / per segment / per layer breakdown of a bench run's turns.jsonl (teacher-forced fidelity)."""

import json
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

root = Path(sys.argv[1])
only = sys.argv[2:] or None


def mean(x):
    x = [v for v in x if v is not None]
    return st.mean(x) if x else float("nan")


for d in sorted(p for p in root.iterdir() if (p / "turns.jsonl").exists()):
    recs = [json.loads(line) for line in open(d / "turns.jsonl")]
    if not recs:
        continue
    label = recs[0]["method"]
    if only and label not in only:
        continue
    print(
        f"== {label}  turns={len(recs)}  KL={mean(r.get('kl') for r in recs):.4f}  kv={mean(r.get('kv_error') for r in recs):.4f}"
    )
    hops = defaultdict(list)
    for r in recs:
        hops[r["position"]].append(r)
    for k, rs in sorted(hops.items()):
        segs = defaultdict(list)
        gates = defaultdict(int)
        for r in rs:
            for s in r.get("kv_error_by_segment", []):
                segs[(s["kind"], s["name"] if s["kind"] == "PH" else "PF", s["provenance"])].append(
                    s["kv_error"]
                )
            for s in r["segments"]:
                if s["kind"] == "PH":
                    gates[(s["name"], s["provenance"], s["info"].get("gate"))] += 1
        seg = "  ".join(f"{n}/{p}:{mean(v):.3f}" for (kind, n, p), v in sorted(segs.items()) if kind == "PH")
        pf = "  ".join(
            f"PF/{p}:{mean(v):.3f}(n={len(v)})" for (kind, n, p), v in sorted(segs.items()) if kind == "PF"
        )
        print(
            f"  hop {k} {rs[0]['agent']:<10} KL {mean(r.get('kl') for r in rs):.4f} agree {mean(r.get('agreement') for r in rs):.3f} kv {mean(r.get('kv_error') for r in rs):.4f} | {seg} | {pf} | gates {dict(gates)}"
        )
    layered = [r["kv_error_by_layer"] for r in recs if r.get("kv_error_by_layer")]
    if layered:
        L = len(layered[0])
        row = (
            [mean(x[i][0] for x in layered) for i in range(L)],
            [mean(x[i][1] for x in layered) for i in range(L)],
        )
        print("  layer K:", " ".join(f"{v:.2f}" for v in row[0]))
        print("  layer V:", " ".join(f"{v:.2f}" for v in row[1]))
    g = [
        s["info"]["guard"]
        for r in recs
        for s in r["segments"]
        if s["kind"] == "PH" and "guard" in s.get("info", {})
    ]
    if g:
        ks = [mean(x["key_scales"][1:]) for x in g]
        vs = [mean(x["value_scales"][1:]) for x in g]
        print(
            f"  guard: {len(g)} spans, mean key scale {mean(ks):.3f}, value scale {mean(vs):.3f}, all-zero {sum(1 for a, b in zip(ks, vs) if a == 0 and b == 0)}"
        )

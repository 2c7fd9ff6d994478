"""A fidelity table from a run's turns.jsonl (reuse turns of the recorded requests; no timing)."""

import json
import statistics as st
import sys
from pathlib import Path

root = Path(sys.argv[1])


def mean(x):
    x = [v for v in x if v is not None]
    return st.mean(x) if x else float("nan")


print(
    "| method | requests | top-1 agree | 1st token | KL | KV err | rho | paper rho | corrected | reused uncorr. | recomputed | prefilled |"
)
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
order = sys.argv[2:]
rows = {}
for d in sorted(p for p in root.iterdir() if (p / "turns.jsonl").exists()):
    recs = [json.loads(line) for line in open(d / "turns.jsonl")]
    if not recs:
        continue
    m = recs[0]["method"]
    reuse = [r for r in recs if r["reuse_turn"]]
    tot = {
        k: sum(r.get(k) or 0 for r in reuse)
        for k in ("tokens_corrected", "tokens_reused_uncorrected", "tokens_recomputed", "ph_prefilled")
    }
    ph = sum(tot.values()) or 1
    nreq = len({r.get("request") or r.get("request_index") for r in recs})
    rows[m] = (
        f"| {m} | {nreq} | {mean(r.get('agreement') for r in recs):.3f} | {mean(r.get('first_token_agreement') for r in recs):.2f} | "
        f"{mean(r.get('kl') for r in recs):.4f} | {mean(r.get('kv_error') for r in recs):.4f} | {mean(r.get('reuse_ratio') for r in reuse):.2f} | "
        f"{mean(r.get('paper_reuse_ratio') for r in reuse):.2f} | "
        + " | ".join(f"{tot[k] / ph:.2f}" for k in tot)
        + " |"
    )
for m in order + [m for m in rows if m not in order]:
    if m in rows:
        print(rows[m])

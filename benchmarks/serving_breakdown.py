"""Where a served request's time to first token went, per method and rate, from a `bench serve` run.

Reads the run's ``requests.jsonl`` (each request's client TTFT and the connector's report: its queue
in vLLM, the plan's queue on the connector's thread and what it waited behind, the plan, the claim,
the "not decided yet" answers) and prints one markdown row per (method, QPS): medians over the
requests after each task's first agent (the ones that can reuse), and how many of them a gate sent
partly dense. Usage::

    python benchmarks/serving_breakdown.py RUN/requests.jsonl
"""

from __future__ import annotations

import json
import sys
from statistics import median


def _p50(values):
    values = [v for v in values if v is not None]
    return median(values) if values else None


def rows(path: str) -> list[dict]:
    records = [json.loads(line) for line in open(path) if line.strip()]
    out = []
    for method in dict.fromkeys(r["method"] for r in records):
        for qps in sorted({r["qps"] for r in records if r["method"] == method}):
            reuse = [
                r
                for r in records
                if r["method"] == method
                and r["qps"] == qps
                and r.get("ok")
                and r.get("position", 0) > 0
                and r.get("connector")
            ]
            if not reuse:
                continue
            reps = [r["connector"] for r in reuse]

            def behind(kind, reps=reps):
                return _p50([(rep.get("plan_behind") or {}).get(kind, 0.0) for rep in reps])

            after = [
                r["ttft_s"] - (r["connector"].get("queued_s") or 0.0) - r["connector"]["admission_wait_s"]
                for r in reuse
                if r["connector"].get("admission_wait_s") is not None
            ]
            out.append(
                {
                    "method": method,
                    "qps": qps,
                    "requests": len(reuse),
                    "gate_dense": sum(1 for rep in reps if rep.get("gate_rejected")),
                    "ttft": _p50([r["ttft_s"] for r in reuse]),
                    "queued": _p50([rep.get("queued_s") for rep in reps]),
                    "admission_wait": _p50([rep.get("admission_wait_s") for rep in reps]),
                    "plan_queue": _p50([rep.get("plan_queue_s") for rep in reps]),
                    "behind_task_record": behind("task record"),
                    "behind_other": _p50(
                        [
                            sum(v for k, v in (rep.get("plan_behind") or {}).items() if k != "task record")
                            for rep in reps
                        ]
                    ),
                    "plan": _p50([rep.get("plan_s") for rep in reps]),
                    "claim": _p50([rep.get("claim_s") for rep in reps]),
                    "taken_after": _p50([rep.get("taken_after_s") for rep in reps]),
                    "not_ready": sum(1 for rep in reps if (rep.get("not_ready") or 0) > 0),
                    "after_admission": _p50(after),
                    "record_wait": _p50([rep.get("record_wait_s") or 0.0 for rep in reps]),
                }
            )
    return out


COLUMNS = (
    ("method", "method"),
    ("qps", "QPS"),
    ("requests", "requests"),
    ("gate_dense", "gate-dense"),
    ("ttft", "TTFT"),
    ("queued", "vLLM queue"),
    ("admission_wait", "admission wait"),
    ("record_wait", "record wait"),
    ("plan_queue", "plan queue"),
    ("behind_task_record", "behind task record"),
    ("behind_other", "behind other"),
    ("plan", "plan"),
    ("taken_after", "taken after"),
    ("claim", "claim"),
    ("not_ready", "not-ready requests"),
    ("after_admission", "after admission"),
)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    print("| " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|---|" + "---:|" * (len(COLUMNS) - 1))
    for row in rows(argv[0]):
        cells = []
        for key, _ in COLUMNS:
            value = row[key]
            cells.append(f"{value:.3f}" if isinstance(value, float) else str(value))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])

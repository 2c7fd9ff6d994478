"""A run's fidelity table re-aggregated from its records (``turns.jsonl`` / ``requests.jsonl``) by the
current ``summarize_method``: the reuse-turn means, the all-turn means and the reuse split side by side.

    python docs/results/resummarize.py RUN_DIR [METHOD ...]
"""

import json
import sys
from pathlib import Path

from hf_kvshare.bench.report import markdown_table
from hf_kvshare.evaluation import summarize_method

COLUMNS = [
    ("method", "method", ""),
    ("agreement", "top-1 agree", ".3f"),
    ("kl", "KL", ".4f"),
    ("kv_error", "KV err", ".4f"),
    ("kl_all_turns", "KL (all turns)", ".4f"),
    ("kv_error_all_turns", "KV err (all turns)", ".4f"),
    ("approximated_first_reads", "approx. first reads", "d"),
    ("reuse_ratio", "rho", ".2f"),
    ("paper_reuse_ratio", "paper rho", ".2f"),
    ("corrected_share", "corrected", ".2f"),
    ("uncorrected_share", "reused uncorr.", ".2f"),
    ("recomputed_share", "recomputed", ".2f"),
    ("prefilled_share", "prefilled", ".2f"),
]


def rows(root: Path) -> dict[str, dict]:
    out = {}
    for d in sorted(
        p for p in root.iterdir() if (p / "turns.jsonl").is_file() and (p / "requests.jsonl").is_file()
    ):
        turns = [json.loads(line) for line in open(d / "turns.jsonl")]
        requests = [json.loads(line) for line in open(d / "requests.jsonl")]
        if turns and requests and "agreement" in turns[0]:
            out[turns[0]["method"]] = {"method": turns[0]["method"], **summarize_method(turns, requests)}
    return out


if __name__ == "__main__":
    found = rows(Path(sys.argv[1]))
    order = [m for m in sys.argv[2:] if m in found] + [m for m in found if m not in sys.argv[2:]]
    print(markdown_table([found[m] for m in order], COLUMNS))

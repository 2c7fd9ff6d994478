"""Text reports of benchmark runs: the console table of ``run`` and the markdown tables of ``report``."""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .methods import short_label

CONSOLE_COLUMNS = [
    ("method", "method", "", 22),
    ("ttft_mean_s", "TTFT s", ".3f", 8),
    ("ttft_ratio", "NS/TTFT", ".2f", 8),
    ("e2e_ratio", "NS/E2E", ".2f", 7),
    ("throughput_tok_s", "tok/s", ".1f", 7),
    ("reuse_ratio", "rho", ".2f", 5),
    ("paper_reuse_ratio", "rho*", ".2f", 5),
    ("corrected_share", "corr", ".2f", 5),
    ("uncorrected_share", "uncorr", ".2f", 6),
    ("agreement", "agree", ".3f", 6),
    ("kl", "KL", ".4f", 7),
    ("kv_error", "KV err", ".4f", 7),
    ("exact_match", "same out", ".2f", 8),
    ("accuracy", "acc", ".2f", 5),
    ("peak_memory_mb", "peak MB", ".0f", 8),
]

#: the console table of a run without fidelity (random weights): speed and memory only
SPEED_COLUMNS = [
    c for c in CONSOLE_COLUMNS if c[0] not in ("agreement", "kl", "kv_error", "exact_match", "accuracy")
]


def format_table(
    summaries: list[dict[str, Any]], columns: list[tuple[str, str, str, int]] = CONSOLE_COLUMNS
) -> str:
    """One line per method: ``columns`` (key, title, format, width) of its summary; the first
    column left-aligned, missing values as ``-``."""
    rows = [[title for _, title, _, _ in columns]]
    rows += [[_cell(s, key, fmt) for key, _, fmt, _ in columns] for s in summaries]
    aligned = [("<" if i == 0 else ">", width) for i, (*_, width) in enumerate(columns)]
    return "\n".join("  ".join(f"{c:{a}{w}}" for c, (a, w) in zip(row, aligned)) for row in rows)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    """A value as the tables show it: a method by its short label, a missing value as ``-``."""
    value = row.get(key)
    if key == "method" and value is not None:
        value = short_label(value)
    return "-" if value is None else format(value, fmt)


#: the split of the shared tokens (shares of the PH tokens) and the paper's rho beside ours
SPLIT_COLUMNS = [
    ("paper_reuse_ratio", "rho (paper)", ".2f"),
    ("corrected_share", "corrected", ".2f"),
    ("uncorrected_share", "reused uncorr.", ".2f"),
    ("recomputed_share", "recomputed", ".2f"),
    ("prefilled_share", "prefilled", ".2f"),
]

REPORT_COLUMNS = {
    "speed": [
        ("method", "method", ""),
        ("ttft_mean_s", "TTFT s (mean)", ".3f"),
        ("ttft_p50_s", "p50", ".3f"),
        ("ttft_p90_s", "p90", ".3f"),
        ("ttft_ratio", "NonShared/TTFT", ".2f"),
        ("throughput_tok_s", "tok/s", ".1f"),
        ("throughput_ratio", "tok/s vs NonShared", ".2f"),
        ("peak_memory_mb", "peak MB", ".0f"),
        ("tensor_peak_mb", "tensor peak MB", ".0f"),
        ("method_state_mb", "state MB", ".2f"),
        ("request_state_mb", "request MB", ".2f"),
        ("reuse_ratio", "rho", ".2f"),
    ],
    #: where the time after the first token goes (mean seconds per turn, measure.PHASES)
    "phases": [
        ("method", "method", ""),
        ("e2e_mean_s", "E2E s", ".3f"),
        ("e2e_ratio", "NonShared/E2E", ".2f"),
        ("decode_mean_s", "decode", ".4f"),
        ("record_mean_s", "record", ".4f"),
        ("gate_mean_s", "gate", ".4f"),
        ("factorize_mean_s", "factorize", ".4f"),
        ("anchor_store_mean_s", "anchor store", ".4f"),
        ("bookkeeping_mean_s", "bookkeeping", ".4f"),
    ],
    "fidelity": [
        ("method", "method", ""),
        ("agreement", "top-1 agree", ".3f"),
        ("first_token_agreement", "1st token", ".2f"),
        ("kl", "KL", ".4f"),
        ("kv_error", "KV err", ".4f"),
        ("kl_all_turns", "KL (all turns)", ".4f"),
        ("kv_error_all_turns", "KV err (all turns)", ".4f"),
        ("approximated_first_reads", "approx. first reads", "d"),
        ("exact_match", "same output", ".2f"),
        ("accuracy", "accuracy", ".2f"),
        ("ttft_mean_s", "TTFT s", ".3f"),
        ("ttft_ratio", "NonShared/TTFT", ".2f"),
        ("e2e_ratio", "NonShared/E2E", ".2f"),
        ("peak_memory_mb", "peak MB", ".0f"),
        ("method_state_mb", "state MB", ".2f"),
        ("request_state_mb", "request MB", ".2f"),
        ("reuse_ratio", "rho", ".2f"),
        *SPLIT_COLUMNS,
    ],
}


REPORT_COLUMNS["sweep"] = [("shared_tokens", "shared tokens", "d"), *REPORT_COLUMNS["speed"]]

#: why the shared tokens were not shared: each method's most frequent causes (hf_kvshare.reasons), after
#: every configuration's table (and alone with ``--kind reasons``)
REPORT_COLUMNS["reasons"] = [
    ("method", "method", ""),
    ("reuse_ratio", "rho", ".2f"),
    ("prefilled_share", "prefilled", ".2f"),
    ("not_shared_top", "not shared: most frequent causes (PH tokens)", ""),
]


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |"]
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|")
    lines += ["| " + " | ".join(_cell(r, key, fmt) for key, _, fmt in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> Path:
    """``rows`` as CSV: the ``columns`` given (default: every key, in order of appearance)."""
    columns = list(dict.fromkeys(k for row in rows for k in row)) if columns is None else columns
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    try:  # the previous file, if any, is kept until the new one is complete
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_configuration_summary(config_dir: str | Path) -> dict[str, Any]:
    """A configuration's ``summary.json`` (``{"config": {...}, "methods": [...]}``), read as a bounded
    regular file; :class:`~hf_kvshare.bench.inputs.InputFileError` (a ``ValueError``) saying what is
    wrong with it otherwise."""
    from .inputs import InputFileError, read_json_object

    path = Path(config_dir) / "summary.json"
    data = read_json_object(path, "summary")
    if data.get("complete") is False:  # a bench serve run still going, interrupted or failed
        raise InputFileError(
            f"summary {str(path)!r} is an incomplete run ({data.get('stopped') or 'not finished'}): not read"
        )
    methods, config = data.get("methods"), data.get("config")
    if not isinstance(methods, list) or not all(isinstance(m, dict) and "method" in m for m in methods):
        raise InputFileError(
            f"summary {str(path)!r}: expected 'methods', a list of method rows (written by bench run)"
        )
    if not isinstance(config, dict):
        raise InputFileError(f"summary {str(path)!r}: expected 'config', an object (written by bench run)")
    return data


def find_configurations(dirs: list[str | Path]) -> list[Path]:
    """Configuration directories (holding a ``summary.json``) among ``dirs`` or directly under them."""
    configs: list[Path] = []
    for d in map(Path, dirs):
        configs += (
            [d]
            if (d / "summary.json").exists()
            else sorted(c.parent for c in d.glob("*/summary.json") if not c.parent.name.startswith("."))
        )  # a hidden folder is a run being written (or one a killed run left): never read
    if not configs:
        raise FileNotFoundError("no configuration directory (with a summary.json) found")
    return sorted(configs, key=_natural)


def hop_matrix(methods: list[dict[str, Any]], metric: str) -> str:
    """One row per method, one column per hop (``<position> <agent>``): ``metric`` of that hop."""
    fmt = next((f for key, _, f in HOP_COLUMNS if key == metric), None)
    if fmt is None:
        raise ValueError(
            f"no per-hop metric {metric!r}; one of {', '.join(k for k, _, f in HOP_COLUMNS if f != '')}"
        )
    hops = {
        r["position"]: f"{r['position']} {r['agent']}" for m in methods for r in m.get("by_position") or []
    }
    columns = [("method", "method", "")] + [(str(p), hops[p], fmt) for p in sorted(hops)]
    rows = [
        {"method": m["method"], **{str(r["position"]): r.get(metric) for r in m.get("by_position") or []}}
        for m in methods
    ]
    return markdown_table(rows, columns)


def report(
    dirs: list[str | Path], kind: str = "fidelity", hops: bool = False, by_hop: Sequence[str] = ()
) -> str:
    """Markdown tables of the summaries in ``dirs``: one per configuration, or one over a
    ``shared_tokens`` sweep (``kind="sweep"``); ``hops`` adds fidelity hop by hop per method;
    ``by_hop`` adds, per metric, a method x hop table."""
    configs = find_configurations(dirs)
    out: list[str] = []
    if kind == "sweep":
        rows = []
        for c in configs:
            data = read_configuration_summary(c)
            length = (data["config"].get("workload_params") or {}).get("shared_tokens")
            rows += [{"shared_tokens": length, **m} for m in data["methods"] if length is not None]
        return markdown_table(rows, REPORT_COLUMNS["sweep"])
    for c in configs:
        data = read_configuration_summary(c)
        out += [f"\n**{c.name}**\n", markdown_table(data["methods"], REPORT_COLUMNS[kind])]
        if kind != "reasons" and any(m.get("not_shared_top") for m in data["methods"]):
            out += ["\nnot shared, by cause:\n", markdown_table(data["methods"], REPORT_COLUMNS["reasons"])]
        for metric in by_hop:
            out += [f"\n{metric} by hop:\n", hop_matrix(data["methods"], metric)]
        for m in data["methods"] if hops else []:
            if m["method"] != "nonshared":
                table = markdown_table(m.get("by_position") or [], HOP_COLUMNS)
                out += [f"\n{m['method']}, hop by hop:\n", table]
    return "\n".join(out)


HOP_COLUMNS = [
    ("position", "hop", "d"),
    ("agent", "agent", ""),
    ("agreement", "top-1 agree", ".3f"),
    ("first_token_agreement", "1st token", ".2f"),
    ("kl", "KL", ".4f"),
    ("kv_error", "KV err", ".4f"),
    ("exact_match", "same output", ".2f"),
]


def _natural(path: Path) -> list:
    """Sort key: numbers inside the name compare as numbers (S256 before S1024)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]

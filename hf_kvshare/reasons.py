"""Why a shared (PH) span was not shared: a small vocabulary of causes.

Each span a method did not share carries its cause where it was decided: a :class:`TurnResult`
segment's ``info`` (``gate``, ``reason``: KVCMAS's gate and fallbacks), a server report's segment
(``placed``, ``supplied``, ``gate``) and its ``missing`` / ``error``. :func:`cause` maps one such
row to a stable category of :data:`CAUSES` (a producer may state it outright as ``info["cause"]``);
the free-text reason is kept beside it as the detail. :func:`turn_causes` and :func:`report_causes`
count the tokens not shared per cause (a turn's counts add up to its ``ph_prefilled``);
:func:`merge`, :func:`top` and :func:`describe` sum and print them (the demo's table, the bench's
summaries and report, the server's ``GET /v1/hf_kvshare/reports``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

#: every cause, by its stable name, with what it means
CAUSES: dict[str, str] = {
    "first": "first reader of the slot: no cache of it to reuse yet",
    "not_recorded_yet": "another request of the task is computing it: its K/V come with that request's record",
    "no_anchors": "too few anchors: the gate's pool is still filling",
    "length_rule": "the span is longer than the anchors the pool holds (an anchor corrects no longer span)",
    "gate_entropy": "the gate's normalized entropy is above tau",
    "gate_far": "the candidate is far from every anchor (the nearest rule)",
    "no_correction": "no anchor holds a correction for this agent",
    "verify_failed": "a verification probe found the correction too far from the exact K/V (verify_tokens)",
    "verify_whole": "the verification probe covers the whole span (verify_tokens >= its length): prefilled",
    "turn_fallback": "the turn is dense because another of its spans was rejected",
    "missing": "not found in the prompt (the text differs from the slot's)",
    "evicted": "its cache was evicted before this request",
    "not_claimed": "placed, but the server's claim stopped before it (the engine computed it)",
    "method_off": "the method shares nothing here (nonshared, tau = 0, an opted-out request)",
    "refused": "the request's layout was refused (no claim)",
    "not_placed": "the method placed nothing here and gave no reason",
    "other": "a reason this vocabulary does not name (see its detail)",
}

#: (pattern of a free-text reason, cause), first match wins; the producers' texts (anchors/)
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"evict"), "evicted"),
    (re.compile(r"tau = 0|the method shares nothing"), "method_off"),
    (re.compile(r"first agent to see|first request to read it"), "first"),
    (re.compile(r"not recorded yet"), "not_recorded_yet"),
    (re.compile(r"the turn is dense"), "turn_fallback"),
    (re.compile(r"verification probe rejected"), "verify_failed"),
    (re.compile(r"verification probe covers the whole span"), "verify_whole"),
    (re.compile(r"far from every anchor"), "gate_far"),
    (re.compile(r"entropy [^ ]+ > tau"), "gate_entropy"),
    (re.compile(r"anchors disagree"), "gate_entropy"),
    (re.compile(r"no anchor holds a correction"), "no_correction"),
    (re.compile(r"not (found )?in the prompt|missing"), "missing"),
]
#: "fewer than 2 anchors at least L tokens long (eligible of pooled)": the length rule when the pool
#: holds two anchors or more, else a pool still filling
_TOO_FEW = re.compile(
    r"fewer than 2 (?:compatible )?anchors(?: at least \d+ tokens long \((\d+) of (\d+)\))?"
)


def cause_of_reason(reason: str) -> str:
    """The cause a free-text reason names (``"other"`` where none matches)."""
    found = _TOO_FEW.search(reason)
    if found:
        pooled = found.group(2)
        return "length_rule" if pooled is not None and int(pooled) >= 2 else "no_anchors"
    for pattern, name in _PATTERNS:
        if pattern.search(reason):
            return name
    return "other"


def cause(info: Mapping[str, Any] | None, method: str | None = None) -> tuple[str, str]:
    """``(cause, detail)`` of a span not shared, from its ``info`` (a segment's, or a server report's
    ``gate``): the producer's own ``cause`` first, then its gate outcome and reason; a span the method
    said nothing about is ``method_off`` under NonShared, ``first`` where the turn found no cache of
    the slot (``info["slot_cached"] is False``), else ``not_placed``."""
    info = info or {}
    reason = str(info.get("reason") or "")
    stated = info.get("cause")
    if isinstance(stated, str) and stated in CAUSES:
        return stated, reason or CAUSES[stated]
    gate = info.get("gate")
    if gate == "first":
        return "first", reason or CAUSES["first"]
    if gate == "turn":
        return "turn_fallback", reason or CAUSES["turn_fallback"]
    if reason:
        return cause_of_reason(reason), reason
    if method == "nonshared":
        return "method_off", "the method shares nothing (nonshared)"
    if info.get("slot_cached") is False:
        return "first", CAUSES["first"]
    return "not_placed", CAUSES["not_placed"]


def _add(counts: dict[str, dict[str, Any]], name: str, tokens: float, detail: str) -> None:
    row = counts.setdefault(name, {"tokens": 0, "spans": 0, "detail": detail})
    row["tokens"] += tokens
    row["spans"] += 1


def turn_causes(turn: Any) -> dict[str, dict[str, Any]]:
    """The PH tokens a :class:`~hf_kvshare.turn.TurnResult` computed densely, per cause:
    ``{cause: {"tokens", "spans", "detail"}}`` (``detail``: the first span's reason). The tokens add
    up to ``turn.ph_prefilled``."""
    rows = ((s.kind, s.provenance, s.info, s.end - s.start) for s in turn.segments)
    return _dense_causes(rows, turn.ph_prefilled, turn.method)


def record_causes(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """:func:`turn_causes` of a turn record (``evaluation.protocol.turn_records``: its ``segments``,
    ``ph_prefilled`` and ``method``); empty for a record written before the split existed."""
    if "ph_prefilled" not in record:
        return {}
    rows = (
        (s.get("kind"), s.get("provenance"), s.get("info"), s.get("end", 0) - s.get("start", 0))
        for s in record.get("segments") or []
    )
    return _dense_causes(rows, record["ph_prefilled"], str(record.get("method", "")).split(":")[0])


def _dense_causes(
    rows: Iterable[tuple], ph_prefilled: float, method: str | None
) -> dict[str, dict[str, Any]]:
    counts: dict[str, dict[str, Any]] = {}
    name = "not_placed"
    for kind, provenance, info, length in rows:
        if kind == "PH" and provenance == "dense":
            name, detail = cause(info, method)
            _add(counts, name, length, detail)
    # the prompt's last token is generate's (its segment one short): counted with the last dense span
    rest = ph_prefilled - sum(row["tokens"] for row in counts.values())
    if rest > 1e-9:
        if name in counts:
            counts[name]["tokens"] += rest
        else:
            _add(counts, name, rest, CAUSES[name])
    return counts


def report_causes(report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The PH tokens of a server report (the reply's ``kv_transfer_params["hf_kvshare"]``, a report
    file line) the engine computed, per cause: a placed span outside the claim is ``not_claimed``, an
    unplaced one its gate's cause; each slot of ``missing`` one span of ``missing`` (its tokens are the
    prompt's plain text, not counted: 0); a refused request ``refused``."""
    counts: dict[str, dict[str, Any]] = {}
    segments = [s for s in report.get("segments") or [] if isinstance(s, Mapping) and s.get("kind") == "PH"]
    if report.get("error"):
        tokens = report.get("ph_tokens") or sum(_length(s) for s in segments)
        _add(counts, "refused", tokens, str(report["error"]))
        return counts
    for seg in segments:
        if seg.get("supplied"):
            continue
        if seg.get("placed"):
            _add(counts, "not_claimed", _length(seg), CAUSES["not_claimed"])
        else:
            gate = seg.get("gate") if isinstance(seg.get("gate"), Mapping) else None
            why = seg.get("unplaced")  # what admission knew (serving.host: not recorded yet, no K/V kept)
            if gate:
                name, detail = cause(gate)
            elif isinstance(why, str) and cause_of_reason(why) != "other":
                name, detail = cause_of_reason(why), why
            else:
                name, detail = "not_placed", _UNPLACED
            _add(counts, name, _length(seg), detail)
    for slot in report.get("missing") or []:
        _add(counts, "missing", 0, f"slot {slot!r} not found in the prompt")
    return counts


#: a server report's span the method did not place and whose report says nothing more
_UNPLACED = (
    "the method placed nothing here: no cache of the slot was recorded when the request was planned (its "
    "first reader, one arriving while it is still computed, or dropped by the store's bound), or a gate "
    "rejected it (a reply's report is the admission's; the recorded one, in the report file, has the gate)"
)


def _length(seg: Mapping[str, Any]) -> int:
    span = seg.get("span") or [0, 0]
    return int(span[1]) - int(span[0])


def merge(many: Iterable[Mapping[str, Mapping[str, Any]] | None]) -> dict[str, dict[str, Any]]:
    """Per-cause counts summed (each cause's first detail kept); ``None`` entries skipped."""
    out: dict[str, dict[str, Any]] = {}
    for counts in many:
        for name, row in (counts or {}).items():
            mine = out.setdefault(name, {"tokens": 0, "spans": 0, "detail": row.get("detail", "")})
            mine["tokens"] += row.get("tokens", 0)
            mine["spans"] += row.get("spans", 0)
    return out


def top(counts: Mapping[str, Mapping[str, Any]], n: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The causes by tokens, then spans, most first (``n`` of them)."""
    order = sorted(counts.items(), key=lambda kv: (-kv[1].get("tokens", 0), -kv[1].get("spans", 0), kv[0]))
    return [(name, dict(row)) for name, row in order[:n]]


def describe(counts: Mapping[str, Mapping[str, Any]], n: int = 3) -> str:
    """The ``n`` most frequent causes in one line: ``"gate_entropy 379 tok in 3 spans, first 120 tok in
    1 span"``."""
    return ", ".join(
        f"{name} {_tokens(row['tokens'])} tok in {row['spans']} span{'' if row['spans'] == 1 else 's'}"
        for name, row in top(counts, n)
    )


def _tokens(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"

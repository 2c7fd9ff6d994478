"""The cache the anchor-correction methods build (KVCMAS, KVComm, GraphFlow)."""

from __future__ import annotations

from typing import Any

from ..cache import Segment, SharedCache


class CorrectedCache(SharedCache):
    """A :class:`SharedCache` whose PH segments may be corrected rather than computed.

    Each PH row of the segment table carries its provenance: ``dense`` (computed for this agent:
    the first agent to see the slot, or a gate fallback), ``corrected`` (the source cache
    re-positioned plus an estimated correction) or ``reused``; the source agent (``reference``
    for a context-free reference); and in ``info`` what the method decided: ``gate``
    (accepted / fallback), ``entropy`` and ``tau``, the ``anchors`` used and their ``weights``, the
    corrected ``rows`` out of the segment's length, and for a fallback its ``reason``.
    ``print(cache)`` shows the table and a one-line summary.

    >>> cache, ids = Session(model, tok, method=kvcmas).build_cache("coder", segments)  # doctest: +SKIP
    >>> print(cache)  # doctest: +SKIP
    CorrectedCache (kvcmas): 212 cached tokens, 0.15 MiB
      PH segments: 2 corrected, 0 reused, 1 gate fallback, 0 other dense; rho = 0.71
      segment         kind span          provenance  source      info
      ...
      query           PH   [28,91)       corrected   planner     gate=accepted, entropy=2.1e-05, ...
    """

    _PYTREE_STATE = (*SharedCache._PYTREE_STATE, "method")

    def __init__(self, config: Any = None, method: str = ""):
        super().__init__(config)
        self.method = method

    def placeholders(self) -> list[Segment]:
        """The PH rows of the segment table."""
        return [s for s in self.segments if s.kind == "PH"]

    def summary(self) -> dict[str, int]:
        """Counts of PH segments by outcome (``fallback``: dense because the gate refused; ``dense``:
        dense for another reason, e.g. the first agent to see the slot) and PH / reused tokens."""
        out = {"corrected": 0, "fallback": 0, "dense": 0, "reused": 0, "ph_tokens": 0, "reused_tokens": 0}
        for seg in self.placeholders():
            out["ph_tokens"] += seg.length
            if seg.provenance == "dense":
                out["fallback" if seg.info.get("gate") == "fallback" else "dense"] += 1
            else:
                out[seg.provenance if seg.provenance in ("corrected", "reused") else "reused"] += 1
                out["reused_tokens"] += seg.length
        return out

    def report(self) -> str:
        s = self.summary()
        table = super().report().split("\n", 1)
        head = table[0].replace(
            type(self).__name__,
            f"{type(self).__name__} ({self.method})" if self.method else type(self).__name__,
            1,
        )
        rho = s["reused_tokens"] / s["ph_tokens"] if s["ph_tokens"] else 0.0
        summary = (
            f"  PH segments: {s['corrected']} corrected, {s['reused']} reused, {s['fallback']} gate fallback, "
            f"{s['dense']} other dense; rho = {rho:.2f}"
        )
        return "\n".join([head, summary, *table[1:]])

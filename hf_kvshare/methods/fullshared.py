"""FullShared: a PH segment's latest cache reused as is, only re-positioned."""

from __future__ import annotations

from ..method import Method, Placement, register


@register
class FullShared(Method):
    """Reuse the most recent materialized cache of each PH slot (from whichever agent produced
    it), moved to where the segment lands. The first agent to see a slot computes it densely."""

    name = "fullshared"

    def placeholder(self, turn, span, cache):
        source = turn.session.slots[span.name].latest
        if source is None:
            return None
        return Placement(
            kv=source.repositioned(turn.shifter, span.start),
            provenance="reused",
            source_agent=source.agent,
        )

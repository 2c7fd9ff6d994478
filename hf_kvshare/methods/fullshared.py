"""FullShared: a PH segment's latest cache reused as is, only re-positioned."""

from __future__ import annotations

from ..method import Method, Placement, PrefixReuse, register


@register
class FullShared(PrefixReuse, Method):
    """Reuse the most recent materialized cache of each PH slot (from whichever agent produced
    it), moved to where the segment lands. The first agent to see a slot computes it densely.

    Args:
        prefix_reuse: also place the agent's own PF text kept from its earlier turns, re-positioned
            (:class:`~hf_kvshare.method.PrefixReuse`); off by default (PF text computed).
        prefix_scope: ``"agent"`` (kept across requests, in the instance) or ``"request"``.
    """

    name = "fullshared"

    def __init__(self, prefix_reuse: bool = False, prefix_scope: str = "agent"):
        self.prefix_reuse = prefix_reuse
        self.prefix_scope = prefix_scope
        self.check_prefix_reuse()

    def __repr__(self) -> str:
        return f"FullShared(prefix_reuse={self.prefix_reuse}, prefix_scope={self.prefix_scope!r})"

    def placeholder(self, turn, span, cache):
        source = turn.slot(span.name).latest
        if source is None:
            return None
        return Placement(
            kv=source.repositioned(turn.shifter, span.start),
            provenance="reused",
            source_agent=source.agent,
        )

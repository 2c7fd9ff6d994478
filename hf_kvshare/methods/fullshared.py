"""FullShared: a PH segment's latest cache reused as is, only re-positioned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..method import Method, Placement, register
from .prefix_reuse import PrefixReuse


@register
@dataclass(eq=False)
class FullShared(PrefixReuse, Method):
    """Reuse the most recent materialized cache of each PH slot (from whichever agent produced
    it), moved to where the segment lands. The first agent to see a slot computes it densely.

    Args:
        prefix_reuse: also place the agent's own PF text kept from its earlier turns, re-positioned
            (:class:`~hf_kvshare.methods.prefix_reuse.PrefixReuse`); off by default (PF text computed).
        prefix_scope: ``"agent"`` (kept across requests, in the instance) or ``"request"``.
    """

    name = "fullshared"

    prefix_reuse: bool = False
    prefix_scope: str = "agent"
    #: kept text placed where it was computed, re-positioned by its writer (as ``placeholder``'s)
    PREFIX_PLACED_UNMOVED: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.check_prefix_reuse()

    def legacy_options(self, meta: dict[str, Any]) -> dict[str, Any]:
        # states saved before FullShared recorded its options: kept prefixes exist only with
        # prefix_reuse=True and prefix_scope="agent"; a state that keeps none holds nothing options
        # could change, so it loads into any instance (as it did)
        if meta.get("prefixes"):
            return {"prefix_reuse": True, "prefix_scope": "agent"}
        return self.state_options()

    def placeholder(self, turn, span, cache):
        source = turn.slot(span.name).latest
        if source is None:
            return None
        # left where it sits: the cache re-positions it layer by layer as it copies it in (no whole
        # rotated copy of the segment beside the source and the cache)
        return Placement(kv=source, provenance="reused", source_agent=source.agent)

"""The one walk over a method's hooks for one turn, whichever executor runs the model.

::

    plan(turn) -> new_cache(turn) -> placeholder / prefix per span, in order
      -> [the executor computes what is left: the HF executor's one forward (hf_kvshare.executor),
          or vLLM's own forward (hf_kvshare.serving)]
      -> finish(turn, cache) -> [the output] -> record(turn, cache)

The :class:`~hf_kvshare.session.Session` (through the HF executor) and the serving host
(:class:`~hf_kvshare.serving.host.Sharing`) both walk a method with :class:`Walk`; neither calls the
hooks in another order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import SharedCache
    from .method import Method, Placement
    from .trajectory import Span
    from .turn import Turn


class Walk:
    """``method``'s hooks over ``turn``, in the contract's order (module docstring)."""

    def __init__(self, method: Method, turn: Turn):
        self.method = method
        self.turn = turn

    def plan(self) -> SharedCache:
        """``method.plan``: what the turn will place, decided before any span is; then the empty cache
        the turn's K/V go into (``method.new_cache``)."""
        self.method.plan(self.turn)
        return self.method.new_cache(self.turn)

    def place(
        self, cache: SharedCache, before_read: Callable[[], None] | None = None
    ) -> Iterator[tuple[Span, Placement | None]]:
        """Each span with what the method places there (``placeholder`` for a PH span, ``prefix`` for a
        PF one; ``None``: computed), counted in ``turn.stats``. A method that reads the cache built so far
        (``reads_prefix``) gets it complete up to each PH span: ``before_read()`` runs first."""
        method, turn = self.method, self.turn
        for span in turn.spans:
            if span.kind == "PH":
                if method.reads_prefix and before_read is not None:
                    before_read()
                placement = method.placeholder(turn, span, cache)
            else:
                placement = method.prefix(turn, span, cache)
            turn.stats.count(span, placement)
            yield span, placement

    def finish(self, cache: SharedCache) -> None:
        """``method.finish`` with the turn's cache as the model will read it (the segment table whole)."""
        self.method.finish(self.turn, cache)

    def record(self, cache: SharedCache) -> None:
        """``method.record`` after the output (the request has recorded its slots)."""
        self.method.record(self.turn, cache)

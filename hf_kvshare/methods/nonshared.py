"""NonShared: every agent prefills its whole prompt under its own prefix (the exact reference)."""

from __future__ import annotations

from ..method import Method, register


@register
class NonShared(Method):
    """No sharing: each turn densely prefills every segment (one forward over the prompt)."""

    name = "nonshared"
    uses_sources = False
    repositions = False

"""NonShared: every agent prefills its whole prompt under its own prefix (the exact reference)."""

from __future__ import annotations

from dataclasses import dataclass

from ..method import Method, register


@register
@dataclass(eq=False)
class NonShared(Method):
    """No sharing: each turn densely prefills every segment (one forward over the prompt). No options."""

    name = "nonshared"
    uses_sources = False
    places = False
    repositions = False

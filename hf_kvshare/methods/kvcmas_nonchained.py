"""KVCMAS's non-chained ablation: the same low-rank pools, the given text's source taken once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..method import register
from .kvcmas import KVCMAS


@register
@dataclass(eq=False)
class KVCMASNonChained(KVCMAS):
    """The ablation of KVCMAS: the same low-rank pools, the given text's source taken once from its
    first consumer (a star, as the reference code's ``--no-chained``) instead of hop to hop. Outputs
    stay producer-sourced. ``text_source="context_free", output_source="context_free"`` with the
    edge-scope options (module docstring) is the earlier reading (context-free references)."""

    name = "kvcmas-nonchained"
    chained: ClassVar[bool] = False

    text_source: str = "first"

"""Anchor pools for online KV correction (KVCMAS, KVComm) and preconstructed profiles (GraphFlow).

- :mod:`.lowrank`: per-layer storage, truncated-SVD factors (or dense), effective rank.
- :mod:`.pool`: anchors and one bounded pool per PH slot with LFU-among-oldest eviction.
- :mod:`.gate`: the normalized-entropy reliability gate.
- :mod:`.correction`: matching a source cache to anchors and materializing the corrected cache.
- :mod:`.profile`: recurring-relation corrections calibrated once (GraphFlow, paper A.2).
- :mod:`.state`: model binding, per-request references.
- :mod:`.cache`: :class:`CorrectedCache`, the cache whose PH rows carry the correction's outcome.
"""

from .cache import CorrectedCache
from .correction import Match, apply_correction, canonical_keys, comparison_prefix, match, token_weights
from .gate import GateDecision, gate_weights, normalized_entropy, reliability_gate
from .lowrank import FactoredKV, MatrixFactors, effective_rank, to_heads, to_matrix
from .pool import REFERENCE, Anchor, AnchorPool
from .profile import RelationProfile
from .state import ModelBinding, RequestState, RequestStates, context_free_reference

__all__ = [
    "REFERENCE",
    "Anchor",
    "AnchorPool",
    "CorrectedCache",
    "FactoredKV",
    "GateDecision",
    "Match",
    "MatrixFactors",
    "ModelBinding",
    "RelationProfile",
    "RequestState",
    "RequestStates",
    "apply_correction",
    "canonical_keys",
    "comparison_prefix",
    "context_free_reference",
    "effective_rank",
    "gate_weights",
    "match",
    "normalized_entropy",
    "reliability_gate",
    "to_heads",
    "to_matrix",
    "token_weights",
]

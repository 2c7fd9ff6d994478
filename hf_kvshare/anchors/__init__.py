"""Anchor pools for online KV correction (KVCMAS, KVComm) and preconstructed profiles (GraphFlow).

- :mod:`.lowrank`: per-layer storage, truncated-SVD factors (or dense), effective rank.
- :mod:`.pool`: anchors and one bounded pool per PH slot with LFU-among-oldest eviction.
- :mod:`.gate`: the normalized-entropy reliability gate.
- :mod:`.correction`: matching a source cache to anchors and materializing the corrected cache.
- :mod:`.corrected`: :class:`~.corrected.CorrectedKV`, a corrected segment computed where it is written.
- :mod:`.profile`: recurring-relation corrections calibrated once (GraphFlow, paper A.2).
- :mod:`.state`: model binding, per-request state (references, producer caches, gate decisions,
  token weights), KVComm's reference prefill.
- :mod:`.cache`: :class:`CorrectedCache`, the cache whose PH rows carry the correction's outcome.
- :mod:`.scope`, :mod:`.slot_scope`, :mod:`.edge_scope`: the two gate scopes of KVCMAS / KVComm as
  policies (plan / place / learn / commit) a method drives from its hooks; their common part
  (sources, pending changes, observed deltas).
- :mod:`.store`: :class:`~.store.BoundedStore`, what a correction method keeps across requests
  (pools or profiles, LRU-bounded, saved and loaded; the per-request states), and the rank
  option's check and clamp.
- :mod:`.persist`: pools and profiles as named tensors plus JSON metadata.
- :mod:`.sharded`: the per-rank factors and gate distances under tensor parallel (each rank its own
  heads, exact to one rank; the only module that calls ``torch.distributed`` collectives).
"""

from .cache import CorrectedCache
from .correction import (
    Match,
    apply_correction,
    apply_piecewise,
    canonical_keys,
    comparison_prefix,
    covering,
    gate_distances,
    match,
    piecewise_sum,
    prefix_correction,
    prefix_weights,
    token_distances,
    token_weights,
    windows,
)
from .gate import (
    GateDecision,
    gate_weights,
    normalized_entropy,
    reliability_gate,
    usage_crossing,
    usage_reference,
)
from .lowrank import FactoredKV, MatrixFactors, effective_rank, to_heads, to_matrix
from .pool import REFERENCE, Anchor, AnchorPool, LRUDict
from .profile import RelationProfile
from .sharded import communication_bytes, sharded_factored_kv, sharded_factors, sharded_gate_distances
from .state import (
    ModelBinding,
    RequestState,
    RequestStates,
    chat_markers,
    context_free_reference,
    reference_lead,
    reference_prefill,
)

__all__ = [
    "REFERENCE",
    "Anchor",
    "AnchorPool",
    "LRUDict",
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
    "apply_piecewise",
    "canonical_keys",
    "chat_markers",
    "comparison_prefix",
    "context_free_reference",
    "covering",
    "piecewise_sum",
    "effective_rank",
    "gate_distances",
    "gate_weights",
    "match",
    "normalized_entropy",
    "reference_lead",
    "reference_prefill",
    "reliability_gate",
    "to_heads",
    "to_matrix",
    "prefix_correction",
    "prefix_weights",
    "token_distances",
    "token_weights",
    "windows",
    "usage_crossing",
    "usage_reference",
    "communication_bytes",
    "sharded_factored_kv",
    "sharded_factors",
    "sharded_gate_distances",
]

"""Evaluation: drivers that run sessions to measure or calibrate methods (above the session).

- :mod:`.transitions`: the reuse transitions of a workload (what FullShared would reuse against
  what NonShared computes), :func:`collect_transitions`; :func:`calibrate_droidspeak` fits an
  offline-profiled method (DroidSpeak's layer profile) on them.
- :mod:`.coverage`: reconstruction coverage of selective recomputation (the KVCMAS paper's
  Appendix A.1): how much of the reuse error each selection criterion removes.
"""

from .coverage import CRITERIA, CoverageReport, CriterionCoverage, entry_errors, reconstruction_coverage
from .transitions import ReuseTransition, calibrate_droidspeak, collect_transitions, has_offline_profile

__all__ = [
    "CRITERIA",
    "CoverageReport",
    "CriterionCoverage",
    "ReuseTransition",
    "calibrate_droidspeak",
    "collect_transitions",
    "entry_errors",
    "has_offline_profile",
    "reconstruction_coverage",
]

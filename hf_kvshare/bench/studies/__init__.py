"""Runnable studies behind the figures in ``docs/results/``, each a module with ``main(argv)``:
``python -m hf_kvshare.bench.studies.<name>`` (or ``python -m hf_kvshare.bench study <name>``).

- :mod:`~hf_kvshare.bench.studies.coverage`: reconstruction coverage of selective recomputation
  (KVCMAS Table 2) and the recomputation methods' fidelity to NonShared.
- :mod:`~hf_kvshare.bench.studies.kvcmas`: KVCMAS vs KVComm / GraphFlow / FullShared, hop-by-hop
  error chained vs non-chained, tau sweep, effective rank by layer.
- :mod:`~hf_kvshare.bench.studies.precache`: PReCache methods on a plan -> act -> reflect loop with
  role adapters: TTFT, E2E, memory, fidelity, shared-base error.
"""

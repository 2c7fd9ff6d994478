"""Focused studies, each a module with ``main(argv)``: ``python -m hf_kvshare.bench.studies.<name>``.

- :mod:`~hf_kvshare.bench.studies.coverage`: reconstruction coverage of selective recomputation
  (KVCMAS Table 2) and the recomputation methods' fidelity to NonShared.
"""

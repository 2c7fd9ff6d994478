"""Runnable studies behind the figures in ``docs/results/`` (each one ``python -m hf_kvshare.bench.studies.<name>``)."""

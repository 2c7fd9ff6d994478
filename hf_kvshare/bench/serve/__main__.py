"""``python -m hf_kvshare.bench.serve``: ``hf-kvshare bench serve``."""

from .cli import main

raise SystemExit(main())

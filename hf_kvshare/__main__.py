"""``python -m hf_kvshare``: the ``hf-kvshare`` command (``demo``, ``bench ...``, ``train-roles``)."""

from __future__ import annotations

from .cli import DEMO_COLUMNS, demo, main

__all__ = ["DEMO_COLUMNS", "demo", "main"]

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m hf_kvshare"))

"""Test helper: what every gloo rank of the tests needs, made once per test process in the forkserver
that :func:`gloo_ranks.run_ranks` starts (its ``preload``), so that each rank forked from it starts
with it: the package's sharded engine and serving replica, the tiny models' transformers classes, the
trajectory helpers and the embedded tokenizer read (each rank's ``tiny.embedded_tokenizer()`` a copy
of it). Without it every rank imported and read all of it again (~2 CPU-s a rank on transformers 5.16)."""

from __future__ import annotations

import anchors_trajectory  # noqa: F401
import lockstep_trajectory  # noqa: F401
import pytest  # noqa: F401  (the ranks' modules import it)
from tiny import embedded_tokenizer, tiny_model

import hf_kvshare.anchors.sharded  # noqa: F401
import hf_kvshare.serving.replica  # noqa: F401

embedded_tokenizer()
tiny_model("llama")  # the model classes' first build (lazy parts of transformers)

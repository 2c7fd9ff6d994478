"""Shared fixtures: tiny random Llama / Qwen2 models (seconds), the embedded tokenizer and the embedded
real model (tests using `real` are marked `real_model`). Helpers live in tiny.py, not here."""

from __future__ import annotations

import pytest
import torch
from tiny import embedded_tokenizer, tiny_model

from hf_kvshare.models import load_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct (fp32, CPU)."""
    return load_model()


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded tokenizer, built without loading the model's weights (see tiny.embedded_tokenizer)."""
    return embedded_tokenizer()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_model("llama")


def _uses_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """A test using the embedded model is `real_model` even if its file forgot the mark (so that
    `-m "not real_model"` never loads it); GPU-only tests are skipped where CUDA is unavailable.

    Under ``pytest -n 2 --dist loadgroup`` (.ci/run) the tests of a module that use one of its
    module-scoped fixtures (a bench run, a tiny VLM) go to one worker, so that the fixture is built
    once; every other test goes to whichever worker is free."""
    for item in items:
        if "real" in getattr(item, "fixturenames", ()) and "real_model" not in item.keywords:
            item.add_marker(pytest.mark.real_model)
    if getattr(config.option, "loadgroup", False):
        for item in items:
            if _uses_a_module_fixture(item):
                item.add_marker(pytest.mark.xdist_group(item.path.stem))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

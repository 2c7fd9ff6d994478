"""Shared fixtures: tiny random Llama / Qwen2 models (seconds), the embedded tokenizer and the embedded
real model (tests using `real` are marked `real_model`). Helpers live in tiny.py, not here.

torch, transformers and the package are imported where a test process needs them, not at this module's
import: xdist's controller (`-n 2`) loads this file too and runs no test (~5 CPU-s per run saved)."""

from __future__ import annotations

import copy
import gc
from collections import OrderedDict
from pathlib import Path

import pytest
from xdist_groups import carry_the_group_in_the_node_id


def pytest_sessionstart(session):
    """A process that runs tests (not xdist's controller) uses one torch thread: two workers, two cores."""
    if not session.config.pluginmanager.has_plugin("dsession"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct (fp32, CPU)."""
    from hf_kvshare.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded tokenizer, built without loading the model's weights (see tiny.embedded_tokenizer)."""
    from tiny import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request):
    from tiny import tiny_model

    return tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    from tiny import tiny_model

    return tiny_model("llama")


#: keywords of ``load_model`` under which a folder's model and tokenizer are read the same way every time
_PLAIN_LOAD = frozenset({"dtype", "attn_implementation"})


def _folder_state(path: Path) -> tuple:
    return tuple(
        sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir() if f.is_file())
    )


#: how many folders ``folders_read_once`` keeps read (the most recent: a module's tests load one folder)
_FOLDERS_KEPT = 2


@pytest.fixture(scope="session")
def _folders_read():
    return OrderedDict()


@pytest.fixture
def folders_read_once(monkeypatch, _folders_read):
    """``load_model`` of a local model folder (the tests' saved tiny models) reads the folder once per
    session: a later load of the unchanged folder with the same plain options gets a deep copy of the
    model and the same tokenizer (the session's tokenizers are shared likewise: nothing mutates one).
    Reading the embedded tokenizer back is half of a small ``bench run`` (~0.25 CPU-s), and the bench
    CLI tests run ~60 of them on the same folder. Quantized, placed or hub loads go through as they are."""
    from hf_kvshare import models

    read = models.load_model

    def load_model(name_or_path=models.DEFAULT_MODEL, **kwargs):
        folder = Path(str(name_or_path))
        if set(kwargs) - _PLAIN_LOAD or not folder.is_dir():
            return read(name_or_path, **kwargs)
        key = (str(folder.resolve()), repr(sorted(kwargs.items())), _folder_state(folder))
        if key not in _folders_read:
            _folders_read[key] = read(name_or_path, **kwargs)
            while len(_folders_read) > _FOLDERS_KEPT:
                _folders_read.popitem(last=False)
        _folders_read.move_to_end(key)
        model, tokenizer = _folders_read[key]
        return copy.deepcopy(model), tokenizer

    monkeypatch.setattr(models, "load_model", load_model)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker sends the collected node ids to its scheduler
def pytest_collection_finish(session):
    """What is alive once the tests are collected (torch, transformers, the package, the test modules:
    ~400k objects) stays alive to the end: frozen, the garbage collector's full passes skip it instead
    of walking it again each time (~8 % of a test process's CPU on the model tests).

    On an xdist worker under ``--dist loadgroup`` each grouped test's node id carries its group, where
    xdist's scheduler reads it (xdist_groups.py)."""
    gc.freeze()
    if getattr(session.config.option, "loadgroup", False):
        for item in session.items:
            carry_the_group_in_the_node_id(item)


def _spawns_ranks(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(
        getattr(defs[-1].func, "spawns_ranks", False) for defs in info.name2fixturedefs.values()
    )


def _uses_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """A test using the embedded model is `real_model` even if its file forgot the mark (so that
    `-m "not real_model"` never loads it); a test using a fixture that spawns gloo ranks
    (``gloo_ranks.spawns_ranks``) is `gloo_ranks`; GPU-only tests are skipped where CUDA is unavailable.

    Under ``pytest -n 2 --dist loadgroup`` (.ci/run) the tests of a module that use one of its
    module-scoped fixtures (a bench run, a tiny VLM) go to one worker, so that the fixture is built
    once (a module that names its own ``xdist_group`` keeps it); every other test goes to whichever
    worker is free."""
    for item in items:
        if "real" in getattr(item, "fixturenames", ()) and "real_model" not in item.keywords:
            item.add_marker(pytest.mark.real_model)
        if _spawns_ranks(item):
            item.add_marker(pytest.mark.gloo_ranks)
    if getattr(config.option, "loadgroup", False):
        for item in items:
            if _uses_a_module_fixture(item) and item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(item.path.stem))
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

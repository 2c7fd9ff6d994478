"""Test helper: run a function on ``world`` gloo ranks on CPU and collect what each returned.

``run_ranks(main, world, folder, *args)`` starts ``world`` processes (forkserver: the modules in
``preload`` imported once, in the server, which this test process starts once and every later spawn
reuses; by default ``gloo_preload.py``: the package, the helpers, the tokenizer read), each joins one gloo group (a file store under ``folder``),
runs ``main(rank, *args)`` on one thread and saves its return value; the caller gets every rank's, in
rank order. ``main`` must be a module-level function (the ranks import its module)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp


def spawns_ranks(fixture_function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a fixture function that spawns gloo ranks (:func:`run_ranks`, under ``@pytest.fixture``): every
    test using it, directly or through another fixture, is marked ``gloo_ranks`` (tests/conftest.py),
    which the fast lane leaves to the full suite."""
    fixture_function.spawns_ranks = True
    return fixture_function


def _rank(rank: int, main: Callable[..., Any], world: int, folder: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results = main(rank, *args)
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(folder) / f"rank{rank}.pt")


def _start_forkserver(preload: tuple[str, ...]) -> None:
    """Start this process's forkserver with ``preload`` imported, unless it runs. The server imports its
    ``preload`` on Python's default path (3.11 drops the ``sys_path`` it is handed): the tests' folder is
    put on its ``PYTHONPATH`` (this process's environment left as it was); the ranks forked from it take
    this process's ``sys.path`` as they start."""
    multiprocessing.set_forkserver_preload(list(preload))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), *filter(None, [before])]
    )
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def run_ranks(
    main: Callable[..., Any],
    world: int,
    folder: Path,
    *args: Any,
    preload: tuple[str, ...] = ("gloo_preload",),
    timeout: float = 240,
) -> list[Any]:
    """Every rank's ``main(rank, *args)``, in rank order (the test fails past ``timeout`` seconds)."""
    _start_forkserver(preload)
    context = tmp.start_processes(
        _rank, args=(main, world, str(folder), args), nprocs=world, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the gloo ranks did not finish in {timeout:.0f} s")
    return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(world)]

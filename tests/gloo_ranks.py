"""Test helper: run a function on ``world`` gloo ranks on CPU and collect what each returned.

``run_ranks(main, world, folder, *args)`` starts ``world`` processes (forkserver: the modules in
``preload`` imported once, in the server), each joins one gloo group (a file store under ``folder``),
runs ``main(rank, *args)`` on one thread and saves its return value; the caller gets every rank's, in
rank order. ``main`` must be a module-level function (the ranks import its module)."""

from __future__ import annotations

import datetime
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp


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


def run_ranks(
    main: Callable[..., Any],
    world: int,
    folder: Path,
    *args: Any,
    preload: tuple[str, ...] = ("hf_kvshare.anchors.sharded",),
    timeout: float = 240,
) -> list[Any]:
    """Every rank's ``main(rank, *args)``, in rank order (the test fails past ``timeout`` seconds)."""
    multiprocessing.set_forkserver_preload(list(preload))
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

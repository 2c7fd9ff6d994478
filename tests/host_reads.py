"""Test helper: count the ways a tensor's value reaches the host (``test_host_syncs.py``,
``test_worker_store.py``)."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch

HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__")


@contextlib.contextmanager
def counting_host_reads():
    """Count tensor -> host reads (test-only wrapping of torch.Tensor methods)."""
    counts: dict[str, int] = dict.fromkeys(HOST_READS, 0)

    def wrap(name):
        original = getattr(torch.Tensor, name)

        @functools.wraps(original)
        def counted(self, *args, **kwargs):
            # integer tensors read here are token ids, which live on the host (the tokenizer's output)
            if self.dtype.is_floating_point or self.dtype == torch.bool:
                counts[name] += 1
            return original(self, *args, **kwargs)

        return counted

    with contextlib.ExitStack() as stack:
        for name in HOST_READS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, wrap(name)))
        yield counts

"""Timing and memory measurement for turns: time to first token and peak memory.

TTFT of a turn runs from the start of building its cache to the first generated token's logits
(a logits processor records its first call). Peak memory is the maximum allocated CUDA memory on
GPU, or the peak resident set size sampled during the turn on CPU.
"""

from __future__ import annotations

import os
import threading
import time

import torch
from transformers import LogitsProcessor


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


class FirstTokenTimer(LogitsProcessor):
    """A no-op logits processor that records when ``generate`` first produced logits."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.first_call: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.first_call is None:
            synchronize(self.device)
            self.first_call = time.perf_counter()
        return scores


def current_rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PeakMemory:
    """Context manager measuring peak memory over its body.

    ``peak_bytes``: max CUDA allocation when ``device`` is CUDA, else peak RSS sampled every
    ``interval_s`` seconds by a background thread.
    """

    def __init__(self, device: torch.device | str | None = None, interval_s: float = 0.002):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak_bytes = current_rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

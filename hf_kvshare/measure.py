"""Timing and memory measurement for turns: time to first token, where the time after it goes,
and peak memory.

TTFT of a turn runs from the start of building its cache to the first generated token's logits
(a logits processor records its first call). Peak memory is the maximum allocated CUDA memory on
GPU, or the peak resident set size sampled during the turn on CPU; :class:`TensorPeak` (opt-in)
counts torch tensors instead (the profiler's allocation events), on any device.

**Phases** (:class:`Phases`, :func:`phase`): the session times the turn's phases after the first token
(``decode``: generate after its first logits; ``record``: the output's K/V completed and the slots'
K/V extracted; ``method_record``: the method's ``record``) with ``time.perf_counter``, and engine code
marks its own phases inside (``gate``, ``factorize``, ``anchor_store``). Times are exclusive: a phase
nested in another is subtracted from it, so the phases of a turn add up to its wall time after the
first token (``bookkeeping``: what the method's record spent outside its named phases). No phase
synchronises the device: on a GPU a phase's time is what its host code waited for, and work it only
queued lands in the next phase that waits (the gate's one host read, or the session's
synchronisation at the end of the turn, counted in ``bookkeeping``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
import weakref
from collections.abc import Iterator

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


def module_bytes(module: torch.nn.Module, device: torch.device | str) -> int:
    """Bytes of ``module``'s parameters and buffers on ``device`` (each storage once: tied weights
    count once): what its weights take there before anything runs."""
    device = torch.device(device)
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type == device.type and (device.index is None or t.device.index in (None, device.index)):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class PeakMemory:
    """Context manager measuring peak memory over its body.

    ``peak_bytes``: on CUDA, the device's peak allocation over the body; given ``baseline_bytes``
    (what the body's owner holds when it starts: its model's weights, its session's and method's
    state), that baseline plus the body's peak *above what was allocated when it started*, so what
    other code in the process holds meanwhile (another method's anchor pools, in a benchmark that runs
    methods side by side) is not counted: the peak a process running only the owner would reach.
    Elsewhere, the process's peak RSS sampled every ``interval_s`` seconds by a background thread
    (``baseline_bytes`` unused: the tensor-level count is :class:`TensorPeak`).
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        interval_s: float = 0.002,
        baseline_bytes: int | None = None,
    ):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.interval_s = interval_s
        self.baseline_bytes = baseline_bytes
        self.peak_bytes = 0
        self._start_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.peak_bytes = current_rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            if self.baseline_bytes is not None:
                peak = self.baseline_bytes + max(0, peak - self._start_bytes)
            self.peak_bytes = peak
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())


#: the phases of a turn after its first token, in the order the summaries show them
PHASES = ("decode", "record", "gate", "factorize", "anchor_store", "bookkeeping")


class Phases:
    """Exclusive wall time per phase name (seconds): :meth:`phase` blocks nest; a nested block's time is
    subtracted from the enclosing one. ``times`` holds every name seen."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._stack: list[list] = []  # [name, start, time spent in nested blocks]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            spent = time.perf_counter() - frame[1]
            self.times[name] = self.times.get(name, 0.0) + spent - frame[2]
            if self._stack:
                self._stack[-1][2] += spent

    def get(self, name: str) -> float:
        return self.times.get(name, 0.0)


_ACTIVE: contextvars.ContextVar[Phases | None] = contextvars.ContextVar("hf_kvshare_phases", default=None)


@contextlib.contextmanager
def timing(phases: Phases) -> Iterator[Phases]:
    """Make ``phases`` the one :func:`phase` blocks of this thread / context report to."""
    token = _ACTIVE.set(phases)
    try:
        yield phases
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase ``name`` of the active :class:`Phases` (:func:`timing`); a no-op outside."""
    phases = _ACTIVE.get()
    if phases is None:
        yield
        return
    with phases.phase(name):
        yield


def turn_phases(phases: Phases, method_record: float) -> dict[str, float]:
    """The breakdown of :data:`PHASES` from a turn's :class:`Phases`: ``bookkeeping`` = the exclusive
    time of ``method_record`` and of anything unnamed (``method_record``: the method's record, nested
    phases excluded)."""
    out = {name: phases.get(name) for name in PHASES if name != "bookkeeping"}
    named = set(PHASES) | {"method_record"}
    out["bookkeeping"] = method_record + sum(t for n, t in phases.times.items() if n not in named)
    return out


class TensorPeak:
    """Context manager: the peak of torch tensor bytes allocated in its body on ``device``'s type and
    alive at once (``peak_bytes``, above what was alive when it started), not the process RSS.

    Every tensor an aten op allocates in this thread (a result that aliases no input: not a view, an
    in-place or an ``out=`` result) is seen through a ``TorchDispatchMode``
    (:func:`hf_kvshare._compat.dispatch_mode_class`); its storage is counted once
    until the storage is freed (a ``weakref.finalize`` on the storage). What it holds is one entry per
    *live* storage, so its own memory stays bounded by what the body holds (the ``torch.profiler``
    memory timeline it replaces kept every event: 21 GB of RSS on a 2K-token trace turn). Scratch a
    fused kernel allocates inside one op (and frees before returning) is not seen. Costs a Python call
    per op: opt-in, not for timed runs.

    >>> with TensorPeak() as peak:  # doctest: +SKIP
    ...     x = torch.empty(1 << 20); del x
    >>> peak.peak_bytes >= 4 << 20  # doctest: +SKIP
    True
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.peak_bytes = 0
        self.live_bytes = 0
        self._live: dict[int, int] = {}  # storage id -> bytes, while the storage lives
        self._mode = None
        self._lock = threading.Lock()

    def _free(self, key: int) -> None:
        with self._lock:
            self.live_bytes -= self._live.pop(key, 0)

    def _see(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device.type or tensor.is_meta:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, functional wrappers)
            return
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._live or nbytes == 0:
                return
            self._live[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key)

    def __enter__(self) -> TensorPeak:
        from ._compat import dispatch_mode_class, fresh_outputs

        tracker = self

        class _Track(dispatch_mode_class()):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                leaves = out if isinstance(out, (tuple, list)) else (out,)
                # views, in-place and out= results alias an input (weights, the cache): not allocations
                for leaf, fresh in zip(leaves, fresh_outputs(func, len(leaves))):
                    if fresh and isinstance(leaf, torch.Tensor):
                        tracker._see(leaf)
                return out

        self._mode = _Track()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)

"""Shared text found by content: which runs of a prompt's token ids repeat token sequences a request
already holds (its slots: documents, earlier messages, agents' outputs).

Pure token ids, no model. The sources' ``k``-token windows are indexed by their hashes (as LMCache's
blend matcher indexes chunks), every ``stride``-th one: with ``k + stride - 1 = min_tokens`` every
common run of ``min_tokens`` holds an indexed window, so the index is ``stride`` times smaller than the
sources; the prompt's windows (all of them) are looked up in one pass, and each hit is verified and
extended to its maximal common run (one per source *diagonal*: a run already found on the same
alignment is not searched again). The candidates are then placed longest first, each prompt
token covered at most once and each source token used at most once (a text the prompt repeats is
placed where its longest match is; the other copies stay the agent's own text), a candidate that
overlaps a placed piece clipped to its free remainder (kept when it is still ``min_tokens`` long).

So a document quoted inside a larger message, a reply pasted into an f-string, or a reply whose text
re-tokenizes differently at one place (a generated ``"\\n\\n"`` token read back as two ``"\\n"``) are
found as one or more :class:`Piece`\\ s instead of being lost: a re-tokenized place splits the match,
the runs on either side of it are still pieces. A source shorter than ``min_tokens`` is matched only
whole (its exact token ids).

The work is bounded: hashing is linear in the prompt and the sources (one C-level hash of a window's
bytes each), and the lookups and extensions
stop after ``max_work`` steps (default :data:`WORK_PER_TOKEN` per prompt and source token); what was
found by then is returned, with :attr:`Matches.exhausted` set.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: default minimum length of a piece (tokens): shorter common runs are the agent's own text
MIN_PIECE_TOKENS = 16
#: the index's window is about half of ``min_tokens``, clipped to this (every piece holds an indexed one)
MAX_WINDOW = 32
#: default work bound per prompt and source token (index hits examined + tokens compared)
WORK_PER_TOKEN = 16
#: index entries kept per window hash (a window repeated more often in the sources is looked up in
#: its first occurrences only: repetitive text cannot make a lookup quadratic)
MAX_OCCURRENCES = 8

_WORD = 8  # bytes per token id in the hashed buffer


@dataclass(frozen=True, order=True)
class Piece:
    """Tokens ``[slot_start, slot_end)`` of source ``slot`` sit at ``[prompt_start, prompt_end)`` of
    the prompt."""

    prompt_start: int
    slot: str
    slot_start: int
    slot_end: int

    @property
    def length(self) -> int:
        return self.slot_end - self.slot_start

    @property
    def prompt_end(self) -> int:
        return self.prompt_start + self.length


@dataclass
class Matches:
    """What :func:`match` found: the placed pieces in prompt order, the work spent, and whether the work
    bound stopped the search early."""

    pieces: list[Piece] = field(default_factory=list)
    work: int = 0
    exhausted: bool = False

    def covered(self) -> int:
        return sum(p.length for p in self.pieces)


def piece_name(slot: str, start: int, end: int) -> str:
    """The name of the slot that is tokens ``[start, end)`` of ``slot``
    (:meth:`hf_kvshare.request.Request.piece_slot`)."""
    return f"{slot}[{start}:{end}]"


def parse_piece_name(name: str) -> tuple[str, int, int] | None:
    """``(slot, start, end)`` of a name :func:`piece_name` made, or ``None``."""
    if not name.endswith("]") or "[" not in name:
        return None
    slot, _, rest = name[:-1].rpartition("[")
    start, _, end = rest.partition(":")
    if not (slot and start.isdigit() and end.isdigit()) or piece_name(slot, int(start), int(end)) != name:
        return None
    return slot, int(start), int(end)


def window_hashes(ids: Sequence[int], k: int, stride: int = 1) -> list[int]:
    """The hash of every ``stride``-th ``k``-token window of ``ids`` (windows at ``0, stride, ...``); equal
    windows hash equal (within one process). Linear: one hash of the window's bytes each."""
    n = len(ids)
    if n < k or k < 1:
        return []
    buf = array("q", ids).tobytes()
    w = _WORD * k
    return [hash(buf[_WORD * i : _WORD * i + w]) for i in range(0, n - k + 1, stride)]


def match(
    prompt: Sequence[int],
    sources: Mapping[str, Sequence[int]],
    min_tokens: int = MIN_PIECE_TOKENS,
    max_work: int | None = None,
) -> Matches:
    """The pieces of ``prompt`` that repeat runs of ``sources`` (name -> token ids, in the order ties
    are broken: earlier sources first), at least ``min_tokens`` long (a source shorter than that:
    whole), longest first, non-overlapping in the prompt and in each source (module docstring)."""
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    prompt = list(prompt)
    order = {name: i for i, name in enumerate(sources)}
    srcs = {name: list(ids) for name, ids in sources.items() if len(ids)}
    if max_work is None:
        max_work = WORK_PER_TOKEN * (len(prompt) + sum(len(ids) for ids in srcs.values()))
    result = Matches()
    budget = [max_work]

    def spend(n: int) -> bool:
        budget[0] -= n
        result.work += n
        if budget[0] < 0:
            result.exhausted = True
        return not result.exhausted

    candidates: list[tuple[int, int, str, int]] = []  # (length, prompt_start, slot, slot_start)
    k = min((min_tokens + 1) // 2, MAX_WINDOW)
    long = {name: ids for name, ids in srcs.items() if len(ids) >= min_tokens}
    _long_runs(prompt, long, k, min_tokens - k + 1, min_tokens, spend, candidates)
    _whole_short(
        prompt, {name: ids for name, ids in srcs.items() if len(ids) < min_tokens}, spend, candidates
    )
    result.pieces = _place(candidates, srcs, order, min_tokens)
    return result


def _long_runs(prompt, srcs, k, stride, min_tokens, spend, candidates) -> None:
    """Maximal common runs (at least ``min_tokens``) of the prompt and each source, one per (source,
    diagonal), found through the sources' every ``stride``-th ``k``-token window."""
    index: dict[int, list[tuple[str, int]]] = {}
    for name, ids in srcs.items():
        for j, h in enumerate(window_hashes(ids, k, stride)):
            hits = index.setdefault(h, [])
            if len(hits) < MAX_OCCURRENCES:
                hits.append((name, j * stride))
    if not index:
        return
    n = len(prompt)
    reach: dict[tuple[str, int], int] = {}  # (source, diagonal) -> end of the run found on it
    for i, h in enumerate(window_hashes(prompt, k)):
        hits = index.get(h)
        if not hits:
            continue
        if not spend(len(hits)):
            return
        for name, j in hits:
            d = i - j
            if reach.get((name, d), -1) > i:
                continue  # inside a run found on this alignment already
            ids = srcs[name]
            m = len(ids)
            i1, j1 = i, j
            while i1 < n and j1 < m and prompt[i1] == ids[j1]:
                i1, j1 = i1 + 1, j1 + 1
            i0, j0 = i, j
            while i0 > 0 and j0 > 0 and prompt[i0 - 1] == ids[j0 - 1]:
                i0, j0 = i0 - 1, j0 - 1
            reach[(name, d)] = max(i1, i + 1)
            if not spend(i1 - i0 + 1):
                return
            if i1 - i >= k and i1 - i0 >= min_tokens:  # (a hash collision extends less than a window)
                candidates.append((i1 - i0, i0, name, j0))


def _whole_short(prompt, srcs, spend, candidates) -> None:
    """Every exact occurrence of a source shorter than the minimum, found by its length's hashes."""
    by_length: dict[int, dict[int, list[str]]] = {}
    for name, ids in srcs.items():
        by_length.setdefault(len(ids), {}).setdefault(window_hashes(ids, len(ids))[0], []).append(name)
    for length, table in by_length.items():
        if not spend(len(prompt)):
            return
        for i, h in enumerate(window_hashes(prompt, length)):
            for name in table.get(h, ()):
                if not spend(length):
                    return
                if prompt[i : i + length] == srcs[name]:
                    candidates.append((length, i, name, 0))


def _place(candidates, srcs, order, min_tokens) -> list[Piece]:
    """Longest first; a candidate overlapping placed pieces (in the prompt or in its source) is clipped
    to its free runs, each kept while it is still a piece (>= ``min_tokens``; a short source whole)."""
    heap = [(-length, start, order[name], name, j) for length, start, name, j in candidates]
    heapq.heapify(heap)
    prompt_taken: set[int] = set()
    slot_taken: dict[str, set[int]] = {}
    placed: list[Piece] = []
    while heap:
        neg, start, rank, name, j = heapq.heappop(heap)
        length = -neg
        used = slot_taken.setdefault(name, set())
        free = [start + t not in prompt_taken and j + t not in used for t in range(length)]
        if all(free):
            placed.append(Piece(start, name, j, j + length))
            prompt_taken.update(range(start, start + length))
            used.update(range(j, j + length))
            continue
        if length < min_tokens:  # a short source is matched whole or not at all
            continue
        t = 0
        while t < length:  # the free runs, back into the queue
            if not free[t]:
                t += 1
                continue
            u = t
            while u < length and free[u]:
                u += 1
            if u - t >= min_tokens:
                heapq.heappush(heap, (-(u - t), start + t, rank, name, j + t))
            t = u
    return sorted(placed)

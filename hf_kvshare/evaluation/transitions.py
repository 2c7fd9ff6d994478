"""Reuse transitions of a workload: what FullShared would reuse against what NonShared computes.

A *transition* is a PH segment an agent reads after an earlier turn of the same session
materialized it (as a PH segment or as its output). FullShared would reuse that earlier K/V, moved
to the new positions; NonShared computes the agent's own exact K/V. :func:`collect_transitions`
runs workflows with dense prefill everywhere and records both sides, plus what the selection
criteria need (the agent's dense prefix cache, the hidden states the earlier turn fed into given
layers). Used by DroidSpeak's offline profiling (:func:`~hf_kvshare.evaluation.calibrate_droidspeak`)
and by the reconstruction-coverage analysis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..cache import SegmentKV, SharedCache
from ..method import Method
from ..methods.boundary_capture import BoundaryCapture
from ..recompute.boundary import BOUNDARY_KEY
from ..recompute.stack import DecoderStack
from ..session import Session
from .workflow import run_workflow

if TYPE_CHECKING:
    from ..turn import Turn


@dataclass
class ReuseTransition:
    """One reusable PH segment of a workload.

    ``reused`` and ``exact`` are ``[1, kv_heads, S, head_dim]`` per layer at the agent's positions
    ``start .. start + S - 1``; ``prefix`` is the agent's dense cache (positions ``[0, start)``
    are the segment's prefix); ``source_hidden[layer]`` ``[1, S, hidden]`` the input of ``layer``
    when the reused K/V was made.
    """

    workflow: int
    turn: int
    slot: str
    source_agent: str | None
    target_agent: str
    token_ids: torch.Tensor
    reused: SegmentKV
    exact: SegmentKV
    prefix: SharedCache
    source_hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def start(self) -> int:
        return self.exact.start

    @property
    def length(self) -> int:
        return self.exact.length


class _DenseRecorder(BoundaryCapture, Method):
    """Dense prefill everywhere (NonShared's cache) that keeps each slot's latest K/V and hidden
    states and records the reuse transitions of every turn."""

    name = "dense-transition-recorder"  # not registered
    uses_sources = True
    supports_batch = False

    def __init__(self, hidden_layers: Sequence[int] = ()):
        self.hidden_layers = tuple(hidden_layers)
        self.stack: DecoderStack | None = None
        self.transitions: list[ReuseTransition] = []
        self.workflow = 0
        self.turn_index = 0

    def attach(self, model: torch.nn.Module) -> None:
        if self.hidden_layers and (self.stack is None or self.stack.model is not model):
            self.stack = DecoderStack(model)

    def boundary_layers(self) -> tuple[int, ...]:
        return self.hidden_layers

    def placeholder(self, turn: Turn, span, cache):
        slot = turn.slot(span.name)
        if slot.latest is not None:  # snapshot the source before this turn replaces it
            turn.scratch.setdefault("transition_sources", {})[span.name] = (
                slot.latest,
                dict(slot.extras.get(BOUNDARY_KEY, {})),
            )
        return None  # dense

    def record(self, turn: Turn, cache: SharedCache) -> None:
        super().record(turn, cache)
        for span in turn.spans:
            source = turn.scratch.get("transition_sources", {}).get(span.name)
            if span.kind != "PH" or source is None:
                continue
            latest, hidden = source
            self.transitions.append(
                ReuseTransition(
                    workflow=self.workflow,
                    turn=self.turn_index,
                    slot=span.name,
                    source_agent=latest.agent,
                    target_agent=turn.agent,
                    token_ids=span.token_ids,
                    reused=latest.repositioned(turn.shifter, span.start),
                    exact=cache.extract(span.start, span.end, agent=turn.agent),
                    prefix=cache,
                    source_hidden=hidden,
                )
            )
        self.turn_index += 1


def collect_transitions(
    model: torch.nn.Module,
    tokenizer: Any,
    workflows: Sequence[Any],
    hidden_layers: Sequence[int] = (),
    progress: bool = False,
) -> list[ReuseTransition]:
    """Run each workflow (a :class:`~hf_kvshare.evaluation.Workflow`) with dense prefill and return its reuse transitions.

    Args:
        hidden_layers: decoder layers whose input hidden states to keep with each transition's source.

    Each workflow runs in its own session (free-running greedy generation, as NonShared would).
    """
    recorder = _DenseRecorder(hidden_layers)
    for index, workflow in enumerate(tqdm(workflows, desc="workflows", disable=not progress)):
        recorder.workflow, recorder.turn_index = index, 0
        run_workflow(Session(model, tokenizer, recorder), workflow)
    return recorder.transitions


def calibrate_droidspeak(
    method: Any, model: torch.nn.Module, tokenizer: Any, workflows: Sequence[Any], progress: bool = False
) -> list[float]:
    """Profile an offline-profiled method on ``workflows`` run with NonShared; return the profile.

    Every PH segment an agent reads after an earlier turn materialized it is one transition: the
    earlier K/V (moved to the new positions) against the agent's own dense K/V. The method (a
    :class:`~hf_kvshare.methods.droidspeak.DroidSpeak`, or any method with ``fit_profile(transitions)``)
    sets its profile from them (DroidSpeak: ``layer_profile``, the mean relative squared deviation
    per layer) and the profile is returned.

    >>> method = DroidSpeak(rho=0.9)  # doctest: +SKIP
    >>> calibrate_droidspeak(method, model, tok, [demo_workflow(tok, query=q) for q in queries])  # doctest: +SKIP
    """
    if not has_offline_profile(method):
        raise TypeError(
            f"{type(method).__name__} has no offline profile (no `fit_profile(transitions)` method)"
        )
    transitions = collect_transitions(model, tokenizer, workflows, progress=progress)
    return method.fit_profile(transitions)


def has_offline_profile(method: Any) -> bool:
    """Whether a method (class or instance) is profiled offline: it has ``fit_profile(transitions)``."""
    return callable(getattr(method, "fit_profile", None))

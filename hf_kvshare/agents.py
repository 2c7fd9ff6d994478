"""Agents are PEFT adapters: on a ``PeftModel`` an agent's name is its adapter's name.

The one place that checks an agent's adapter and makes it the active one, always through
:mod:`hf_kvshare._compat` (PEFT's public ``set_adapter``, without changing which parameters
require grad):

- :func:`check_agent_adapter`: a clear error unless the agent names an unmerged adapter;
- :func:`agent_adapter`: the agent's adapter is active within a block, everything restored after;
- :func:`activate_adapter`: make an adapter the active one (the bench's per-step ``adapter``);
- :func:`load_adapters`: wrap a model with PEFT adapters, each under its agent's name.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ._compat import (
    active_tuner_adapters,
    is_peft_model,
    peft_wrapping_warnings_silenced,
    restore_active_adapters,
    set_active_adapter,
)

#: PEFT's name for the adapter-free rows of a mixed-adapter batch (``adapter_names=[..., "__base__"]``).
BASE_ROW = "__base__"


def adapter_names(model: nn.Module) -> list[str]:
    """The adapters of a ``PeftModel`` in load order."""
    return list(getattr(model, "peft_config", {}))


def load_adapters(model: nn.Module, adapters: dict[str, Any]) -> Any:
    """``model`` wrapped in a ``PeftModel`` with each adapter of ``adapters`` (name -> PEFT adapter
    directory or hub id) under its name, in eval mode."""
    from peft import PeftModel

    (first, path), *rest = adapters.items()
    with peft_wrapping_warnings_silenced():  # raised inside PEFT (not by our calls) on transformers 5.x
        model = PeftModel.from_pretrained(model, str(path), adapter_name=first)
        for name, path in rest:
            model.load_adapter(str(path), adapter_name=name)
    return model.eval()


def merged_adapters(model: nn.Module) -> list[str]:
    """Adapters merged into the base weights anywhere in ``model``."""
    merged: set[str] = set()
    for module in model.modules():
        merged.update(getattr(module, "merged_adapters", None) or [])
    return sorted(merged)


def check_agent_adapter(model: nn.Module, agent: str) -> None:
    """Raise a clear error unless ``agent`` names an unmerged adapter of the ``PeftModel`` ``model``."""
    names = adapter_names(model)
    if agent == BASE_ROW:
        raise ValueError(
            f"{BASE_ROW!r} is PEFT's name for the adapter-free model, not an agent; agents are the adapters "
            f"{names}"
        )
    if agent not in names:
        raise ValueError(
            f"agent {agent!r} is not an adapter of this PeftModel (on a PeftModel an agent's name is its "
            f"adapter's name); adapters: {', '.join(names) or 'none'}. Load it with "
            "`model.load_adapter(path, adapter_name=...)` or `model.add_adapter(name, config)`"
        )
    merged = merged_adapters(model)
    if merged:
        raise ValueError(
            f"adapter(s) {merged} are merged into the base weights, so the model no longer has one shared "
            "backbone that agents' adapters are added to; call `model.unmerge_adapter()` first"
        )


@contextmanager
def agent_adapter(model: nn.Module, agent: str) -> Iterator[None]:
    """Within the block ``agent``'s adapter is the active one; a no-op for models without PEFT.

    The previously active adapter(s) and every LoRA parameter's ``requires_grad`` are restored
    afterwards, so the caller's model is left as it was.

    >>> with agent_adapter(peft_model, "planner"):  # doctest: +SKIP
    ...     peft_model.generate(...)
    """
    if not is_peft_model(model):
        acting = active_tuner_adapters(model)
        if acting:
            raise ValueError(
                f"this {type(model).__name__} holds PEFT adapter layers with adapter(s) {acting} acting (the "
                f"inner model of a PeftModel), so agent {agent!r} would run with them, not as a prompt-only "
                "agent. Pass the PeftModel itself (agents are its adapters), or run inside "
                "`with peft_model.disable_adapter():` for the base model"
            )
        yield
        return
    check_agent_adapter(model, agent)
    with _one_thread(model):
        previous = list(model.active_adapters)
        if previous == [agent]:
            yield
            return
        grads = {name: p.requires_grad for name, p in model.named_parameters() if "lora_" in name}
        set_active_adapter(model, agent)
        try:
            yield
        finally:
            restore_active_adapters(model, previous)
            for name, p in model.named_parameters():
                if name in grads and p.requires_grad != grads[name]:
                    p.requires_grad_(grads[name])


_USERS_LOCK = threading.Lock()
#: PeftModel -> (thread ident, depth) of the agent block running on it
_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextmanager
def _one_thread(model: nn.Module) -> Iterator[None]:
    """Refuse a second thread's agent block on a PeftModel while one runs: the active adapter is one
    model-wide setting, so two threads' agents would run with each other's adapters."""
    me = threading.get_ident()
    with _USERS_LOCK:
        owner, depth = _USERS.get(model, (me, 0))
        if owner != me:
            raise RuntimeError(
                f"this PeftModel is running an agent's turn in another thread (thread {owner}); its active adapter "
                "is one setting for the whole model, so agents on one PeftModel cannot run concurrently: run "
                "them one after another, or give each thread its own model"
            )
        _USERS[model] = (me, depth + 1)
    try:
        yield
    finally:
        with _USERS_LOCK:
            if depth == 0:
                _USERS.pop(model, None)
            else:
                _USERS[model] = (me, depth)


def activate_adapter(model: Any, adapter: str) -> None:
    """Make ``adapter`` the active PEFT adapter (methods may still choose adapters themselves)."""
    config = getattr(model, "peft_config", None)
    if config is None:
        raise ValueError(
            f"an agent runs with adapter {adapter!r} but the model is not a PeftModel; load adapters with --adapter NAME=PATH"
        )
    if adapter not in config:
        raise ValueError(f"adapter {adapter!r} is not loaded; loaded adapters: {', '.join(sorted(config))}")
    set_active_adapter(model, adapter)

"""Module hooks that act only in the thread that registered them.

The library adds short-lived forward (pre-)hooks to the *shared* model's modules while a turn runs
(boundary hidden states, the layer-0 input, a layer's queries, PEFT down-projections). Another
thread running the same model meanwhile goes through those modules too; :func:`thread_hook` makes
such a hook a no-op there, so sessions on one model in several threads do not see each other's
calls. The wrapper also accepts being called without the ``kwargs`` argument: torch looks up
whether a hook takes kwargs separately from the hook itself, so a hook removed by its owner while
another thread is between the two look-ups is called with ``(module, args)`` only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def thread_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a hook ``fn(module, args, ...)`` so that it runs only in the calling (registering) thread."""
    owner = threading.get_ident()

    def hook(module: Any, args: Any, *rest: Any) -> Any:
        if threading.get_ident() != owner:
            return None
        return fn(module, args, *rest)

    return hook

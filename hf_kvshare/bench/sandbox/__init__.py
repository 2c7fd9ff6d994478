"""The HumanEval sandbox: untrusted generated Python run in a separate process tree with a timeout,
resource limits and, where the machine allows it, namespaces (opt-in with ``bench run --execute``).

- :mod:`.execute`: :func:`run_python` (the pass token, the tree kill, the limits, the isolation probe);
- :mod:`.launcher`: started by path as root under ``unshare``: mounts, then drops to ``nobody``;
- :mod:`.runner`: copied into each run's directory, runs the program and writes the pass token.

The launcher and the runner are stdlib-only scripts run with ``python -I``, never imported.
"""

from .execute import TAG_VARIABLE, ExecutionResult, isolation_unavailable, run_python

__all__ = ["TAG_VARIABLE", "ExecutionResult", "isolation_unavailable", "run_python"]

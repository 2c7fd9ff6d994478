"""``hf-kvshare bench serve``: the seeds' concurrent-serving benchmark on vLLM's OpenAI server.

The trace workload (N agents reading one shared document of exactly ``--shared-tokens`` tokens and
every earlier agent's reply, fixed-length outputs) as streaming chat requests with Poisson
arrivals at each ``--qps``; per method and QPS: p50/p90 TTFT at the client, throughput,
vLLM's prefix-cache hits (``/metrics``), the connector's supplied tokens and rho where the server
reports them, teacher-forced agreement with NonShared (``--agreement``). Two plain-vLLM rows frame
the methods: ``plain`` (the real layout, each agent's own system prompt first: vLLM's prefix cache
shares nothing across agents) and ``document-first`` (the shared document moved to the front of
every prompt, so vLLM's own prefix cache hits: it changes the prompt, an upper bound for reuse).

Every run (one method at one QPS) gets fresh seeded documents, so no run is served from an earlier
run's cache; the requests of a run are task-major (one task's agents, then the next task's: the
authors' serving traces; ``--order agent``: every task's first agent, then every task's second, ...)
and a request whose input is another agent's reply is sent at its arrival time or
when that reply is complete, whichever is later (``dependency_wait_s`` in its record). A run is
bounded in count (``--tasks`` x ``--agents`` requests) and in time (no request is sent after
``--max-duration`` seconds; each request is cut at ``--request-timeout``). One vLLM server per
server configuration (the two plain rows share one), on 127.0.0.1 only, started and stopped by
the bench; ``--repeats`` interleaves them ABBA with fresh documents. Command and output layout:
``docs/serving-bench.md``.

The package, by job: ``trace`` (the requests and their arrivals), ``client`` (sending and timing
them), ``columns`` (rows, summaries, the figure), ``runs`` (servers, by the serving package's launcher,
and the sweep), ``cli`` (options, checks, ``main``).
"""

from __future__ import annotations

import warnings
from typing import Any

from ...serving.server import HOST, Server, free_port
from . import runs
from .cli import (
    VLLM_PYTHON_ENV,
    build_parser,
    main,
    validate,
)
from .client import (
    RunSpec,
    forced_body,
    forced_pass,
    forced_step,
    get,
    metrics_snapshot,
    parse_metrics,
    post_json,
    read_reports,
    run_once,
    stream_chat,
    warm_up,
)
from .columns import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    SUMMARY_COLUMNS,
    agreement,
    agreement_columns,
    compact_report,
    connector_columns,
    console_line,
    curves,
    exact_match,
    fill_exact,
    gate_rejected,
    gate_unfilled,
    iter_rows,
    json_safe,
    metric_delta,
    summarize_run,
    summary_complete,
    ttft_plot,
    write_outputs,
)
from .runs import (
    REPORTS,
    Plan,
    ServerGroup,
    ServerLaunch,
    connector_group,
    group_server,
    partial_dir,
    remove_stale_partials,
    run_spec,
    running,
    served_model_path,
    server_env,
    sweep,
)
from .trace import (
    BASELINES,
    DEFAULT_METHODS,
    DOC_FIRST,
    MAX_REQUESTS,
    ORDERS,
    PLAIN,
    PlannedRequest,
    ServeTrace,
    document_first,
    plan_run,
    poisson_schedule,
    request_place,
    run_seed,
    warmup_tasks,
)

__all__ = [
    "BASELINES",
    "DEFAULT_METHODS",
    "DOC_FIRST",
    "HOST",
    "MAX_REQUESTS",
    "ORDERS",
    "PLAIN",
    "PREFIX_HITS",
    "PREFIX_QUERIES",
    "Plan",
    "PlannedRequest",
    "REPORTS",
    "RunSpec",
    "SUMMARY_COLUMNS",
    "ServeTrace",
    "ServerGroup",
    "ServerLaunch",
    "VLLM_PYTHON_ENV",
    "agreement",
    "agreement_columns",
    "build_parser",
    "compact_report",
    "connector_columns",
    "connector_group",
    "console_line",
    "curves",
    "document_first",
    "exact_match",
    "fill_exact",
    "forced_body",
    "forced_pass",
    "forced_step",
    "free_port",
    "gate_rejected",
    "gate_unfilled",
    "get",
    "group_server",
    "iter_rows",
    "json_safe",
    "main",
    "metric_delta",
    "metrics_snapshot",
    "parse_metrics",
    "partial_dir",
    "plan_run",
    "poisson_schedule",
    "post_json",
    "read_reports",
    "remove_stale_partials",
    "request_place",
    "run_once",
    "run_seed",
    "run_spec",
    "running",
    "served_model_path",
    "server_env",
    "stream_chat",
    "summarize_run",
    "summary_complete",
    "sweep",
    "ttft_plot",
    "validate",
    "warm_up",
    "warmup_tasks",
    "write_outputs",
]


def _connector_server_class() -> type[Server]:
    warnings.warn(
        "hf_kvshare.bench.serve.connector_server_class is deprecated: use hf_kvshare.serving.server.Server",
        DeprecationWarning,
        stacklevel=2,
    )
    return Server


def __getattr__(name: str) -> Any:
    """Deprecated names: ``VLLMServer`` (the bench's own vLLM launcher, now the serving package's
    ``Server``) and ``connector_server_class`` (that ``Server``, always part of hf_kvshare)."""
    deprecated = {
        "VLLMServer": runs.vllm_server_deprecated,
        "connector_server_class": _connector_server_class,
    }
    if name in deprecated:
        return deprecated[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

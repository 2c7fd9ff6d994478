"""vLLM KV connector: agents of one multi-agent task share K/V of common segments inside a stock vLLM.

Loaded out of tree (no patch of vLLM)::

    KVTransferConfig(
        kv_connector="HFKVShareConnector",
        kv_connector_module_path="hf_kvshare.serving.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"method": "fullshared", "options": {"prefix_reuse": True},
                                   "max_bytes": 2 << 30, "max_tasks": 1024},
    )

``hf-kvshare serve`` sets this up (:mod:`.server`). vLLM makes one connector in its scheduler (role
``SCHEDULER``) and one in its worker (role ``WORKER``), in two processes; as vLLM's own connectors,
:class:`HFKVShareConnector` is a facade that hands each hook to the side its role made:

- :class:`~.connector_scheduler.HFKVShareScheduler` (:mod:`.connector_scheduler`): admission (the
  method's plan and the claim from vLLM's prefix-cache hit, decided on the admission thread,
  :mod:`.admission`), the claims and read-backs in the step's metadata, each finished request's
  record and report;
- :class:`~.connector_worker.HFKVShareWorker` (:mod:`.connector_worker`): claimed K/V written into the
  paged cache before the forward, a finished request's K/V read back (:mod:`.paged`);
- what they send each other through vLLM: :mod:`.connector_common`; beside vLLM, the side channels
  (:mod:`.channel`: orders scheduler -> worker, read-backs worker -> scheduler).

Tensor and pipeline parallel are supported, and both at once (each worker rank writes and reads its
own KV heads of its stage's layers; the scheduler side assembles them and routes each claim's K/V by
layers: :mod:`.tensor_parallel`); data or context parallel and more than one KV cache group are refused
at start-up, as is a cache :mod:`.paged` cannot read (MLA, quantized).

Each finished request's report (what admission decided: the claim, its PH / PF tokens, each span's
placement; :meth:`Plan.report <hf_kvshare.serving.host.Plan.report>`) is the reply's
``kv_transfer_params["hf_kvshare"]`` (non-streaming replies: vLLM's streaming chat path drops
``kv_transfer_params``) and, with ``report_path`` in ``kv_connector_extra_config`` (or the environment
variable :data:`REPORTS_ENV`), one JSON line of that file, written once the request is recorded, with
vLLM's request ids (``request_id``, and ``external_id``: the id the OpenAI server made from the
client's ``request_id``), which is how ``hf-kvshare bench serve`` reads them for streamed requests.

The per-method ``cache_salt`` (``hf_kvshare.serving.host.salt``) is set on each request by the server's
middleware (:mod:`.middleware`): injected blocks enter vLLM's prefix cache under the plain token hashes
of their salt, so approximate K/V never serve another method or a plain request.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from .connector_common import Capture, Captured, HFKVShareMetadata, Load, check_supported
from .connector_scheduler import READ_BACK_WAIT_S, REPORTS_ENV, STORE_COUNTS, HFKVShareScheduler
from .connector_worker import STORE_DEVICE, TAKEN_MAX, HFKVShareWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .host import Sharing

__all__ = [
    "READ_BACK_WAIT_S",
    "REPORTS_ENV",
    "STORE_COUNTS",
    "STORE_DEVICE",
    "TAKEN_MAX",
    "Capture",
    "Captured",
    "HFKVShareConnector",
    "HFKVShareMetadata",
    "HFKVShareScheduler",
    "HFKVShareWorker",
    "Load",
    "current_sharing",
]


def current_sharing() -> Sharing | None:
    """Deprecated: the engine's :class:`Sharing` is no longer kept in a module-global registry; it is
    the scheduler-side connector's own (``HFKVShareConnector.sharing``). Returns ``None``."""
    warnings.warn(
        "hf_kvshare.serving.connector.current_sharing() is deprecated and returns None: the Sharing "
        "service is the scheduler-side connector's own, HFKVShareConnector.sharing",
        DeprecationWarning,
        stacklevel=2,
    )
    return None


class HFKVShareConnector(KVConnectorBase_V1):
    """The class vLLM loads: each hook goes to the side ``role`` made (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        self.connector_scheduler: HFKVShareScheduler | None = None
        self.connector_worker: HFKVShareWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = HFKVShareScheduler(vllm_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = HFKVShareWorker(vllm_config)

    @property
    def sharing(self) -> Sharing | None:
        """The scheduler side's :class:`Sharing` service (``None`` in the worker)."""
        return self.connector_scheduler.sharing if self.connector_scheduler is not None else None

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, HFKVShareMetadata):
            self.connector_worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, HFKVShareMetadata):
            self.connector_worker.wait_for_save(metadata)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.build_connector_worker_meta()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.get_block_ids_with_load_errors() if self.connector_worker else set()

    # ============================================================= scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self.connector_scheduler.on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    def shutdown(self) -> None:
        for side in (self.connector_scheduler, self.connector_worker):
            if side is not None:
                side.shutdown()
        super().shutdown()

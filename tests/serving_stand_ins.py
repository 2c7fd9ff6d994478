"""Stand-ins for vLLM's side of the connector, written once for the channel, worker-store and tensor
parallel tests (no vLLM process): a FlashAttention-style cache writer, a worker over stand-in paged
caches, what a worker's first step output announces to the scheduler, and a ``deliver`` callback that
records what a channel delivered."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from hf_kvshare.serving import channel


def flash_update(layer, key, value, kv_cache, slot_mapping):
    """A ``do_kv_cache_update`` with the semantics of vLLM's CUDA backends (FlashAttention-style: each
    slot's last axis is ``[K | V]``; tests/test_serving_paged.py)."""
    dim = kv_cache.shape[3] // 2
    key_cache, value_cache = kv_cache.transpose(1, 2).split(dim, dim=-1)
    block = kv_cache.shape[2]
    key_cache[slot_mapping // block, slot_mapping % block] = key
    value_cache[slot_mapping // block, slot_mapping % block] = value


def stand_in_worker(layers, heads, dim, block=16, blocks=8, extra=None):
    """The connector's worker side (vLLM's layer names, needs vLLM's parser) over ``layers`` zeroed
    paged caches of ``blocks`` blocks, written by :func:`flash_update`; ``extra``: the connector's
    ``kv_connector_extra_config``. Returns the worker and its layers' names."""
    from hf_kvshare.serving.connector_worker import HFKVShareWorker

    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    impl = SimpleNamespace(do_kv_cache_update=flash_update)
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block),
        compilation_config=SimpleNamespace(
            static_forward_context={n: SimpleNamespace(impl=impl) for n in names}
        ),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=dict(extra or {})),
    )
    worker = HFKVShareWorker(config)
    worker.register_kv_caches({n: torch.zeros(blocks, heads, block, 2 * dim) for n in names})
    return worker, names


def bytes_per_position(config) -> int:
    """What one position of float32 K/V takes over all layers of a model of ``config``."""
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4


class Delivered:
    """A channel's ``deliver`` stand-in: each request's K/V (the first delivered), the path it came by,
    the thread it was delivered on and the order of arrival; :meth:`wait` for some to arrive."""

    def __init__(self):
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.via: dict[str, str] = {}
        self.threads: dict[str, str] = {}
        self.order: list[str] = []
        self._arrived = threading.Condition()

    def __call__(self, request_id, keys, values, via, rank):
        with self._arrived:
            self.kv.setdefault(request_id, (keys, values))
            self.via.setdefault(request_id, via)
            self.threads.setdefault(request_id, threading.current_thread().name)
            self.order.append(request_id)
            self._arrived.notify_all()

    def wait(self, *request_ids: str, count: int = 0, timeout: float = 10.0) -> bool:
        """Whether every one of ``request_ids`` (and at least ``count`` deliveries) arrived in time."""
        with self._arrived:
            return self._arrived.wait_for(
                lambda: len(self.order) >= count and all(r in self.kv for r in request_ids), timeout
            )


def announce_worker(scheduler, bytes_per_token=None, rank=0, deliver=None, address=None) -> Any:
    """What rank ``rank``'s worker tells the scheduler in its first step output: its order channel (a
    listener that keeps nothing, or hands claims' K/V to ``deliver``; or a real worker's, at ``address``)
    and, given, what one position of K/V takes in its device store. Returns the listener it made (close
    it; ``None`` with ``address``)."""
    from hf_kvshare.serving.connector_common import Captured

    orders = None if address else channel.Orders(lambda order: None, deliver or (lambda *kv: None))
    announced = Captured(orders=address or orders.address, bytes_per_token=bytes_per_token, rank=rank)
    scheduler.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=announced, finished_sending=None)
    )
    return orders


def admitted(scheduler, request, timeout: float = 30.0) -> int:
    """The tokens the connector's scheduler side claims for ``request`` once its plan is decided (it
    answers ``None``, "not decided yet", until then); ``AssertionError`` when it never is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        claimed, _ = scheduler.get_num_new_matched_tokens(request, 0)
        if claimed is not None:
            return claimed
        time.sleep(0.01)
    raise AssertionError(f"{request.request_id} was never planned")


def vllm_request(request_id, prompt, params, output=(), cache_salt=None, max_tokens=None):
    """What the connector's scheduler side reads of a vLLM ``Request`` (a finished one: ``output``;
    ``cache_salt``: what the middleware set, the method's salt for a request it checked;
    ``max_tokens``: its sampling parameters' bound, ``None``: not stated)."""
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(
        request_id=request_id,
        external_req_id=None,
        prompt_token_ids=list(prompt),
        kv_transfer_params=params,
        cache_salt=cache_salt,
        status=RequestStatus.FINISHED_STOPPED,
        sampling_params=SimpleNamespace(all_stop_token_ids=[], eos_token_id=None, max_tokens=max_tokens),
        output_token_ids=list(output),
        num_computed_tokens=len(prompt) + len(output) - 1,
    )

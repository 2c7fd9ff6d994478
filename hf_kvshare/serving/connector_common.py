"""What the connector's scheduler side (:mod:`.connector_scheduler`) and worker side
(:mod:`.connector_worker`) send each other through vLLM (its step's metadata, the workers' step
output), and the set-up both refuse (:func:`check_supported`); the tensor- and pipeline-parallel
ranks' share of the KV heads and layers is :mod:`.tensor_parallel`'s (no vLLM import: the fast lane
tests it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # without vLLM (the fast test lane): the same messages, as plain dataclasses

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vLLM's base of a connector's step metadata (stand-in where vLLM is not installed)."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """vLLM's base of a worker's step output (stand-in where vLLM is not installed)."""

        def aggregate(self, other):  # pragma: no cover - vLLM's own calls it
            return self


from .host import BUDGETS, ServingError, Sharing, serving_options, skeleton_model
from .tensor_parallel import kv_head_range, tensor_parallel_size

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("hf_kvshare.serving")


#: a text config's per-layer lists (one entry per decoder layer), sliced to a pipeline stage's layers
PER_LAYER_LISTS = ("layer_types", "no_rope_layers")


def stage_overrides(model_dir: str, start: int, stop: int) -> dict[str, Any]:
    """The config attributes of a pipeline stage's skeleton holding layers ``[start, stop)``: its layer
    count and every per-layer list (:data:`PER_LAYER_LISTS`: the attention kind and the layers without
    RoPE per layer) sliced to them; a list of another length than the layers is refused."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config()
    layers = text.num_hidden_layers
    if not 0 <= start < stop <= layers:
        raise ServingError(
            f"hf_kvshare: a pipeline stage holds layers [start, stop) of the model's {layers} with "
            f"0 <= start < stop <= {layers}; got [{start}, {stop})"
        )
    overrides: dict[str, Any] = {"num_hidden_layers": stop - start}
    for name in PER_LAYER_LISTS:
        value = getattr(text, name, None)
        if value is None:
            continue
        if len(value) != layers:
            raise ServingError(
                f"hf_kvshare: {type(config).__name__}.{name} has {len(value)} entries, not one per each of "
                f"its {layers} layers: a pipeline stage's replica cannot take its layers' share "
                "(worker_replicas: false keeps the scheduler's engine)"
            )
        overrides[name] = list(value)[start:stop]
    return overrides


def make_sharing(
    vllm_config: VllmConfig,
    *,
    shard: Any = None,
    kv_heads: int | None = None,
    layers: tuple[int, int] | None = None,
) -> Sharing:
    """The :class:`Sharing` service ``kv_connector_extra_config`` describes, for the served model: the
    scheduler side's (with ``shard``, a ``FollowerShard``: the follower of the workers' replicas), or
    (``shard``: a :class:`~hf_kvshare.anchors.sharded.Shard`, ``kv_heads``: the rank's KV heads) a worker
    rank's replica (:mod:`.replica`), its method run on the shard before it is bound to a skeleton whose
    config has the rank's KV heads; or (``shard``: a :class:`~hf_kvshare.anchors.sharded.StageShard`,
    ``layers``: the stage's ``[start, stop)``) a pipeline stage's replica, its skeleton's config the
    stage's layers (:func:`stage_overrides`)."""
    from transformers import AutoTokenizer

    from ..method import get_method

    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    model_config = vllm_config.model_config
    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer or model_config.model)
    method, options = extra.get("method", "nonshared"), dict(extra.get("options") or {})
    overrides: dict[str, Any] = {} if kv_heads is None else {"num_key_value_heads": kv_heads}
    if layers is not None:
        overrides.update(stage_overrides(model_config.model, *layers))
    if shard is not None:
        options, _ = serving_options(method, options)
        method, options = get_method(method, **options), {}
        method.run_on_shard(shard)
    model = skeleton_model(model_config.model, **overrides)
    text = model.config.get_text_config()
    if layers is not None and [getattr(text, k, None) for k in overrides] != list(overrides.values()):
        raise ServingError(
            f"hf_kvshare: a pipeline stage's replica of {type(model).__name__} could not be given its layers "
            f"{list(layers)} (worker replicas serve text models; worker_replicas: false in "
            "kv_connector_extra_config keeps the scheduler's engine)"
        )
    if kv_heads is not None and text.num_key_value_heads != kv_heads:
        raise ServingError(
            f"hf_kvshare: a worker replica of {type(model).__name__} could not be given its {kv_heads} KV "
            "heads (worker replicas serve text models; worker_replicas: false in kv_connector_extra_config "
            "keeps the scheduler's engine)"
        )
    sharing = Sharing(
        model,
        tokenizer,
        method,
        max_bytes=int(extra.get("max_bytes", 2 << 30)),
        max_tasks=int(extra.get("max_tasks", 1024)),
        min_segment_tokens=int(extra.get("min_segment_tokens", 16)),
        # the other stores' byte budgets (None: Sharing's defaults); a bad value refused by Sharing
        **{name: extra.get(name) for name in BUDGETS if name != "max_bytes"},
        **options,
    )
    logger.info("hf_kvshare: serving method %r (cache_salt %r)", sharing.method, sharing.salt)
    return sharing


@dataclass
class Correction:
    """A :class:`Source`'s low-rank delta (a KVCMAS corrected span, :class:`~.worker_store.CorrectedOrigin`):
    its first ``rows`` rows get ``a @ b`` per layer, the factors being the tensors ``first ..`` of the
    request's ``"factors"`` message on the order channel (``a_k, b_k, a_v, b_v`` per layer for its
    ``layers`` layers, empty for a layer left uncorrected), the keys' delta rotated from positions ``delta_from ..`` to the
    source's ``dst_start`` (``None``: added as is)."""

    first: int
    layers: int
    rows: int
    delta_from: int | None


@dataclass
class Source:
    """Claimed positions whose K/V are rows of a request the worker keeps (:mod:`.worker_store`): its rows
    ``[row, row + n)`` written at claim offset ``offset``, the keys re-positioned (RoPE) from position
    ``src_start`` to ``dst_start`` on the worker's device (no move when equal); with ``correction``, a
    delta added to them there (:class:`Correction`)."""

    request_id: str
    row: int
    n: int
    offset: int
    src_start: int
    dst_start: int
    correction: Correction | None = None


@dataclass
class Load:
    """Claimed K/V to write before the request's first forward: positions ``[start, start + tokens)``.
    No tensor: each piece is a :class:`Source` (rows the worker keeps) or a ``payload`` range (claim
    offsets ``[lo, hi)``) whose K/V came on the order channel under the request id (:mod:`.channel`;
    all ranges' rows in one message, in order), or, ``from_replica``, the claim of each rank's replica."""

    request_id: str
    block_ids: list[int]
    start: int
    tokens: int
    sources: list[Source] = field(default_factory=list)
    payload: list[tuple[int, int]] = field(default_factory=list)
    #: the whole claim from each rank's own replica (:mod:`.replica`: its plan's K/V of its heads), no
    #: source or payload; a rank whose replica claims other positions reports the blocks failed
    from_replica: bool = False


@dataclass
class Capture:
    """A finished request's K/V to read back: positions ``[0, tokens)`` of its blocks. ``keep``: the
    worker also keeps them in its store (the scheduler's :class:`~.worker_store.StoreMirror` decided),
    after dropping the requests ``drop`` names. ``ship``: the K/V go back to the scheduler; without it
    (a value-free method's record: :data:`~hf_kvshare.serving.host.VALUE_FREE`) only stand-ins of
    them (:func:`~.worker_store.stand_ins`: their shapes and dtypes), unless the worker could not keep
    them or they hold NaN / inf (then the K/V, and the scheduler's record refuses them as before)."""

    request_id: str
    block_ids: list[int]
    tokens: int
    keep: bool = False
    drop: list[str] = field(default_factory=list)
    ship: bool = True


@dataclass
class HFKVShareMetadata(KVConnectorMetadata):
    """One step's orders to the worker: small, no tensor (tests/test_layout.py checks the fields)."""

    loads: list[Load] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)
    #: the scheduler's read-back channel (:mod:`.channel`), ``None`` without one: the worker connects
    #: to it when it first sees it and sends each capture through it
    read_back: str | None = None
    #: kept requests the worker drops after this step's loads (the scheduler will not reference them)
    drops: list[str] = field(default_factory=list)


@dataclass
class Captured(KVConnectorWorkerMetadata):
    """K/V read back by one worker (``rank``: :func:`~.tensor_parallel.worker_rank`): request id ->
    (keys, values), ``[the rank's layers, n, its kv_heads, head_dim]`` each (one buffer apiece back
    to the scheduler; ``None`` when reading failed). vLLM merges its workers' outputs with
    :meth:`aggregate`: the other ranks' go under ``ranks``, never over this one's (:meth:`by_rank`)."""

    kv: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=dict)
    #: requests whose K/V went through the read-back channel instead (the scheduler waits for them)
    sent: set[str] = field(default_factory=set)
    #: the worker's order channel (:mod:`.channel`), once: the scheduler orders read-backs there
    orders: str | None = None
    #: bytes one position's K/V take in the worker's store (every layer's keys and values), once
    bytes_per_token: int | None = None
    #: the worker's rank (its share of the KV heads: :func:`kv_head_range`; its stage's layers)
    rank: int = 0
    #: the layers (indices in the model) the worker holds, announced with its order channel
    layers: list[int] | None = None
    #: the rank's replica's counts (:class:`~.replica.Replica`: ops run, checks agreeing and differing)
    replica: dict[str, Any] | None = None
    #: the other ranks' outputs of the same step, merged in by :meth:`aggregate`
    ranks: dict[int, Captured] = field(default_factory=dict)

    def by_rank(self) -> dict[int, Captured]:
        """Each rank's output, this one's included."""
        own = Captured(
            kv=self.kv,
            sent=self.sent,
            orders=self.orders,
            bytes_per_token=self.bytes_per_token,
            rank=self.rank,
            layers=self.layers,
            replica=self.replica,
        )
        return {**self.ranks, self.rank: own}

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, Captured):
            return self
        for rank, part in other.by_rank().items():
            if rank == self.rank:  # one worker's outputs of two steps: one rank's, merged
                self.kv.update(part.kv)
                self.sent |= part.sent
                self.orders = self.orders or part.orders
                self.bytes_per_token = self.bytes_per_token or part.bytes_per_token
                self.layers = self.layers or part.layers
                self.replica = part.replica or self.replica
            elif rank in self.ranks:
                self.ranks[rank].aggregate(part)
            else:
                self.ranks[rank] = part
        return self


def check_supported(vllm_config: VllmConfig, kv_cache_config: Any) -> None:
    """Refuse, at start-up, with the reason and what works, what the connector does not support:
    data parallel (an engine and a store per rank; a task's requests spread over them), context
    parallel (a request's tokens split over ranks), KV heads that do not split over the
    tensor-parallel ranks, more than one KV cache group (sliding-window / hybrid layers). Tensor and
    pipeline parallel are supported, and both at once: each worker rank writes and reads its own KV
    heads (:func:`kv_head_range`) of its own stage's layers, and the scheduler assembles them
    (:class:`~.tensor_parallel.RankAssembly`). A cache :mod:`.paged` cannot read or write (a quantized
    ``--kv-cache-dtype``, MLA) is refused by the worker when vLLM registers it."""
    parallel = vllm_config.parallel_config
    works = (
        "what works: tensor_parallel_size N (--tensor-parallel-size; the KV heads split over the ranks), "
        "pipeline_parallel_size N (--pipeline-parallel-size; the layers split over the stages), context "
        "parallel size 1, and --replicas N for more servers"
    )
    if getattr(parallel, "data_parallel_size", 1) != 1:
        raise ServingError(
            "hf_kvshare's connector does not support data parallel (each data-parallel rank is an engine "
            "with a store of its own, and vLLM spreads a task's requests over them, so its agents would "
            f"miss each other's K/V); got data_parallel_size {parallel.data_parallel_size}; {works} behind "
            "vLLM's router, with session affinity keyed by the task"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if size != 1:
            raise ServingError(
                f"hf_kvshare's connector does not support context parallel (a request's K/V split by tokens "
                f"over ranks); got {name} {size}; {works}"
            )
    size = tensor_parallel_size(vllm_config)
    if size > 1:
        total = vllm_config.model_config.get_total_num_kv_heads()
        try:
            kv_head_range(0, size, total)
        except ValueError as error:
            raise ServingError(
                f"hf_kvshare's connector at tensor_parallel_size {size}: {error}; what works: a size that "
                f"divides the model's {total} KV heads (or a multiple of them), with any "
                "pipeline_parallel_size"
            ) from error
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ServingError(
            "hf_kvshare's connector supports models whose layers share one KV cache group (one block "
            f"table per request); this model has {len(groups)} (sliding-window / hybrid layers)"
        )

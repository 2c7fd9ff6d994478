"""Per-agent prefix reuse: a method mixin (FullShared, KVCMAS and its variants).

:class:`PrefixReuse` keeps an agent's computed PF text and places it on the agent's later turns,
re-positioned; it implements the contract's ``prefix`` and extends ``record``, ``state_bytes``,
``export_state`` / ``stage_state`` and ``request_state_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..budgets import check_byte_budget
from ..cache import SegmentKV, SharedCache
from ..method import Placement
from ..persistence import check_segment_kv, state_dims

if TYPE_CHECKING:
    from ..session import Session
    from ..turn import Turn


#: key prefix of the per-request prefix store in ``Session.method_state`` (``"<method>:prefixes"``)
PREFIX_STATE = "prefixes"


class PrefixReuse:
    """Method mixin: **per-agent prefix reuse** (the KVCMAS reference's behaviour), options
    ``prefix_reuse`` and ``prefix_scope``.

    An agent's PF text (system prompt, glue before a PH, the turn's tail) is computed the first time
    that agent uses it, kept, and placed on the agent's later turns re-positioned (RoPE rotation only,
    no correction: the reference's prefix delta is off by default). Keyed by (agent, token ids of the
    PF segment); the first computation is kept. ``prefix_scope="agent"`` keeps it in the method
    instance across requests (the reference: ``prepare_prefix_kv_segments`` stores an agent's
    template K/V once, in class-level memory keyed by its node id; here at most
    :attr:`PREFIX_LIMIT` entries, the least recently used dropped, saved by :meth:`save_state`,
    counted in :meth:`state_bytes`); ``"request"`` keeps it for one request (a Session) only. A reused
    PF row of the segment table has provenance ``reused``, the agent as source, and
    ``info["prefix_reuse"]`` = the position it was computed at. Counted in ``TurnResult.prefix_reused``
    (PF tokens), not in rho, which stays over PH tokens as the reference counts it. In a Session,
    ``Method.build`` computes kept text at the cache's start again where only computed text follows
    it and that is cheaper than the masked forward behind it (``info["prefix_recomputed"]``).

    Subclasses declare the ``prefix_reuse: bool`` and ``prefix_scope`` options and may narrow
    :meth:`prefix_reuse_allowed`.
    """

    prefix_reuse: bool = False
    prefix_scope: str = "agent"
    PREFIX_SCOPES: ClassVar[tuple[str, ...]] = ("agent", "request")
    #: PF segments kept per method instance with ``prefix_scope="agent"`` (least recently used dropped)
    PREFIX_LIMIT: ClassVar[int] = 256
    #: and their bytes (one-message prompts make an agent's "prefix" its whole prompt: hundreds of MB
    #: within the count); a host with its own budget lowers it with :meth:`bound_prefixes`
    PREFIX_MAX_BYTES: ClassVar[int] = 256 << 20
    #: whether :meth:`prefix` places the kept K/V where it was computed, the writer re-positioning it as
    #: it places it (the cache layer by layer; the serving worker from the rows it keeps), as FullShared's
    #: ``placeholder`` does; ``False``: placed re-positioned (a method that corrects the placed text, as
    #: KVCMAS's prefix delta, reads it at the span's position)
    PREFIX_PLACED_UNMOVED: ClassVar[bool] = False

    def check_prefix_reuse(self) -> None:
        if not isinstance(self.prefix_reuse, bool):
            raise ValueError(
                f"{self.name}: prefix_reuse must be True or False, got {self.prefix_reuse!r}"  # type: ignore[attr-defined]
            )
        if self.prefix_scope not in self.PREFIX_SCOPES:
            raise ValueError(
                f"{self.name}: prefix_scope must be one of {self.PREFIX_SCOPES}, got {self.prefix_scope!r}"  # type: ignore[attr-defined]
            )

    def _agent_prefixes(self) -> OrderedDict:
        kept = self.__dict__.get("_kept_prefixes")
        if kept is None:
            kept = self.__dict__["_kept_prefixes"] = OrderedDict()
        return kept

    def prefix_store(self, turn: Turn) -> dict[tuple[str, tuple[int, ...]], SegmentKV]:
        """The kept PF K/V, keyed by (agent, token ids): the instance's (``prefix_scope="agent"``)
        or the request's."""
        if self.prefix_scope == "agent":
            return self._agent_prefixes()
        return turn.request_state(f"{self.name}:{PREFIX_STATE}", dict)  # type: ignore[attr-defined]

    def prefix_reuse_allowed(self, turn: Turn) -> bool:
        """Whether this turn may place kept PF text (a method in a dense mode says no)."""
        return True

    def prefix(self, turn: Turn, span, cache: SharedCache) -> Placement | None:
        if not self.prefix_reuse or not self.prefix_reuse_allowed(turn):
            return None
        kept = self.prefix_store(turn).get((turn.agent, tuple(span.token_ids.tolist())))
        if kept is None:
            return None
        return Placement(
            kv=kept if self.PREFIX_PLACED_UNMOVED else kept.repositioned(turn.shifter, span.start),
            provenance="reused",
            source_agent=turn.agent,
            info={"prefix_reuse": kept.start},
        )

    def record(self, turn: Turn, cache: SharedCache) -> None:
        super().record(turn, cache)  # type: ignore[misc]
        if not self.prefix_reuse:
            return
        store = self.prefix_store(turn)
        computed = {s.start for s in cache.segments if s.kind == "PF" and s.provenance == "dense"}
        for span in turn.spans:  # the segment of the prompt's tail lacks its last token: generate computed it
            if span.kind != "PF":
                continue
            key = (turn.agent, tuple(span.token_ids.tolist()))
            if key in store:
                if isinstance(store, OrderedDict):
                    store.move_to_end(key)  # used again: the most recently used
            elif span.start in computed:
                store[key] = cache.extract(span.start, span.end, agent=turn.agent)
        if isinstance(store, OrderedDict):
            self._trim_prefixes(store)

    def bound_prefixes(self, max_bytes: int) -> None:
        """Keep the PF K/V kept across requests within ``max_bytes`` from now on (least recently used
        dropped first); a serving host gives it a share of its store's budget."""
        check_byte_budget(f"{self.name}: the kept prefixes' max_bytes", max_bytes)  # type: ignore[attr-defined]
        self.__dict__["_prefix_max_bytes"] = max_bytes
        self._trim_prefixes(self._agent_prefixes())

    def kv_bytes(self, count: Callable[[], int]) -> int:
        """The bytes of K/V a bound compares, from ``count()`` (this instance's): as counted here; a
        method whose engine runs on tensor-parallel shards counts one rank's (``KVCMAS.kv_bytes``)."""
        return count()

    def _trim_prefixes(self, store: OrderedDict) -> None:
        if not store:  # empty on every member alike: nothing to count (no reduction under a shard)
            return
        budget = self.__dict__.get("_prefix_max_bytes", self.PREFIX_MAX_BYTES)
        own = sum(kv.nbytes for kv in store.values())
        held = self.kv_bytes(lambda: own)
        while store and (len(store) > self.PREFIX_LIMIT or held > budget):
            own -= store.popitem(last=False)[1].nbytes
            held = self.kv_bytes(lambda own=own: own)
            self.__dict__["_prefixes_evicted"] = self.__dict__.get("_prefixes_evicted", 0) + 1

    def prefix_summary(self) -> dict[str, int]:
        """The kept PF text across requests: ``prefix_bytes`` held, ``max_prefix_bytes`` (its budget)
        and ``prefixes_evicted`` (least recently used entries dropped, by count or bytes)."""
        return {
            "prefix_bytes": self.prefix_state_bytes(),
            "max_prefix_bytes": self.__dict__.get("_prefix_max_bytes", self.PREFIX_MAX_BYTES),
            "prefixes_evicted": self.__dict__.get("_prefixes_evicted", 0),
        }

    def prefix_state_bytes(self) -> int:
        """Bytes of the PF K/V kept across requests (``prefix_scope="agent"``)."""
        return sum(kv.nbytes for kv in self.__dict__.get("_kept_prefixes", {}).values())

    def state_bytes(self) -> int:
        return super().state_bytes() + self.prefix_state_bytes()  # type: ignore[misc]

    def clear_prefixes(self) -> None:
        self.__dict__.pop("_kept_prefixes", None)

    def export_prefixes(self) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """The kept PF K/V as tensors ``prefix<i>.<k|v><layer>`` and their metadata (LRU order)."""
        tensors, meta = {}, []
        for i, ((agent, ids), kv) in enumerate(self.__dict__.get("_kept_prefixes", {}).items()):
            for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
                tensors[f"prefix{i}.k{layer}"] = k.detach().contiguous().clone()
                tensors[f"prefix{i}.v{layer}"] = v.detach().contiguous().clone()
            meta.append({"agent": agent, "ids": list(ids), "start": kv.start, "layers": len(kv.keys)})
        return tensors, meta

    def stage_prefixes(self, tensors: dict[str, torch.Tensor], meta: Any, model=None) -> OrderedDict:
        """The kept PF K/V of an exported state (:meth:`export_prefixes`), checked and built aside:
        each entry's layers, K/V shapes and token ids agree (and agree with ``model``, the saved
        model's fingerprint), every tensor is used once. Nothing of the instance changes."""
        owner = self.name  # type: ignore[attr-defined]
        dims = state_dims(model)
        kept: OrderedDict = OrderedDict()
        if meta is None:
            meta = []
        if not isinstance(meta, list):
            raise ValueError(f"{owner}: the saved kept prefixes must be a list, got {type(meta).__name__}")
        used: set[str] = set()
        try:
            for i, entry in enumerate(meta):
                n, start, agent = entry["layers"], entry["start"], entry["agent"]
                ids = entry["ids"]
                if not isinstance(agent, str) or not isinstance(ids, list):
                    raise ValueError(f"entry {i}: agent {agent!r}, ids {ids!r}")
                if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (n, start, *ids)):
                    raise ValueError(f"entry {i}: layers {n!r}, start {start!r} and ids must be ints >= 0")
                names = [f"prefix{i}.{kind}{layer}" for kind in "kv" for layer in range(n)]
                keys = [tensors[f"prefix{i}.k{layer}"] for layer in range(n)]
                values = [tensors[f"prefix{i}.v{layer}"] for layer in range(n)]
                check_segment_kv(owner, f"kept prefix {i} (agent {agent!r})", keys, values, len(ids), dims)
                key = (agent, tuple(ids))
                if key in kept:
                    raise ValueError(f"entry {i}: agent {agent!r} and its token ids appear twice")
                used.update(names)
                kept[key] = SegmentKV(keys=keys, values=values, start=start, agent=agent)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{owner}: the saved kept prefixes are damaged ({error})") from error
        extra = sorted(set(tensors) - used)
        if extra:
            raise ValueError(f"{owner}: the saved kept prefixes hold tensors no entry names: {extra[:5]}")
        return kept

    def adopt_prefixes(self, kept: OrderedDict) -> None:
        self.__dict__["_kept_prefixes"] = kept

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = super().export_state()  # type: ignore[misc]
        kept, kept_meta = self.export_prefixes()
        return {**tensors, **kept}, ({**meta, "prefixes": kept_meta} if kept_meta else meta)

    def stage_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], model=None):
        rest = {k: v for k, v in tensors.items() if not k.startswith("prefix")}
        meta = dict(meta)
        kept_meta = meta.pop("prefixes", [])
        commit = super().stage_state(rest, meta, model)  # type: ignore[misc]
        kept = self.stage_prefixes(
            {k: v for k, v in tensors.items() if k.startswith("prefix")}, kept_meta, model
        )

        def swap() -> None:
            commit()
            self.adopt_prefixes(kept)

        return swap

    def request_state_bytes(self, session: Session) -> int:
        kept = session.method_state.get(f"{self.name}:{PREFIX_STATE}", {})  # type: ignore[attr-defined]
        return super().request_state_bytes(session) + sum(kv.nbytes for kv in kept.values())  # type: ignore[misc]

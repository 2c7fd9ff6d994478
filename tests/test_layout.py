"""The package's layout rules, checked on the source (AST only: no model, no import of the modules).

- every registered method's class lives in a module under ``hf_kvshare.methods``;
- the engines (``anchors``, ``recompute``, ``lora``) import neither the methods, the session,
  the evaluation nor the bench, not even inside a function;
- ``session.py`` imports no engine package, and not the methods (the package's ``__init__`` fills
  the registry);
- the method contract lives in ``methods/`` and the contract modules (``method.py``,
  ``persistence.py``): a class elsewhere that defines ``build`` / ``record`` for a turn is a whole
  method (subclasses ``Method``, e.g. the evaluation's recorder), never a mixin, and none is in an
  engine; no registered method shadows a contract hook with another signature;
- the import graph (function-level imports included, ``if TYPE_CHECKING:`` imports excluded)
  has no cycle;
- a method file is knobs and wiring: no module under ``hf_kvshare.methods`` calls the anchors
  engine's gate or pool decisions (:data:`ENGINE_DECISIONS`: the gate, the agreement rule, the
  near-duplicate test, the distances they read, the length rule and its piecewise windows); its
  hooks drive a scope that does;
- results (``docs/architecture.md``, "Results and benchmarks"): no module under ``hf_kvshare`` cites a
  ``docs/results/...py`` script; ``docs/results`` stays a few pages and small summaries (at most
  :data:`RESULTS_MAX_FILES` files, none over :data:`RESULTS_MAX_BYTES`); the scripts in ``benchmarks/``
  use the public API only (no private ``hf_kvshare`` name, no ``setattr``).
- one vLLM launcher: only ``serving/server.py`` names vLLM's server in a command line and, besides
  the sandbox and the router's module, calls ``subprocess.Popen``; only ``serving/replicas.py`` names
  vLLM's router (``vllm-router``) and starts it, over replicas that are the launcher's ``Server``; ``bench serve`` is a package of one job per module (trace,
  client, columns, runs, cli: each job's calls in its module only) and no bench module is longer
  than 700 lines.
- serving: no module keeps mutable state at its top level (a container, lock or thread; no
  ``global``): state lives on instances; ``serving/connector.py`` is a facade (one
  ``KVConnectorBase_V1`` class that sets only its two sides and whose hooks delegate; no thread,
  lock or channel), the scheduler and worker sides in their own modules; the step metadata the
  scheduler sends the worker (``connector_common``'s ``HFKVShareMetadata``, ``Load``, ``Source``,
  ``Capture``) has no tensor field (K/V stay in the worker: ``serving/worker_store.py``); a value-free
  method's records are stand-ins (``meta``) of the worker's K/V, made in ``worker_store`` only (and
  rebuilt by ``channel``), for served methods only (``host.VALUE_FREE``).
- the in-process handoff in one place: only ``serving/channel.py`` parks tensors by reference in the
  process-local handoff table (``_HANDOFF``, its one instance of ``_Handoff``: the one process-wide
  object of the serving modules, where one process's worker and scheduler sides meet at one rank); every
  other module reaches it through ``channel.Sender`` and the listeners.
- one request, one walk, two executors: the contract modules, ``request.py`` and ``walk.py`` import
  neither ``prefill`` nor the HF ``executor``; the Session and the serving host are each a ``Request``
  and define none of its bookkeeping; only ``walk.py`` (and ``methods/``) calls a method's span hooks.
- serving never waits in the store: ``serving/host.py`` (plan, claim, record) makes no blocking call
  (sleep, wait, join, a future's result); a request waiting for another's record is answered "not
  decided yet" by the connector's scheduler side, which asks the store again.
- the cache stores as transformers' caches do: ``cache.py`` (the table, its guards, dispatch) writes no
  tensor itself, its layer class ``cache_layer.SegmentLayer`` derives from ``DynamicLayer``, and
  ``SegmentedCache`` stays under a method budget; the cache's modules import no engine and every
  ``DeferredKV`` kind (``CorrectedKV``) lives in an engine; multimodal-RoPE internals are named only in
  ``mrope.py`` (and ``_compat.py``).
- images are opened in one place: only ``vision.open_image`` (the pixel limit checked from the file's
  header before decoding) calls ``Image.open``.
- a file given by path is read in one place: only ``bounded_read.read_input`` opens a file without
  blocking (``O_NONBLOCK``: a FIFO never hangs, the type and size checked on the descriptor before a
  read); ``bounded_read`` is a leaf.
- a method's options are checked where they are set: no method overrides ``Method.__setattr__``,
  which re-runs the constructor's checks for an option assigned after construction.
- why a span was not shared is classified in one place: ``reasons.py`` (the vocabulary of causes) is a
  leaf, importing no hf_kvshare module, and no other module matches a reason's text; every reason the
  serving host gives an unplaced span (what ``Sharing._why_unplaced`` returns) names a cause of
  ``reasons.CAUSES``, none falls to ``other``.
- one content matcher: ``matching.py`` (text found inside messages by token ids) is a leaf that imports
  no ``hf_kvshare`` module and no tensor library; the serving layout finds its pieces through it
  (``matching.match``), and only ``request.py`` builds a piece of a slot (``Slot(..., piece_of=...)``,
  :meth:`hf_kvshare.request.Request.piece_slot`), which neither host redefines.
- vLLM's multimodal features are read in one place: only ``serving/layout.py`` (``images_of``) names
  their fields (``mm_position``, ``mm_hash``): images are spans found by vLLM's hash, never by tokens.
- agent frameworks: the examples that drive ``hf-kvshare serve`` through the OpenAI Agents SDK and
  LangGraph are plain clients (no ``hf_kvshare`` import, no layout field).
- every store is bounded by bytes: each budget of ``serving.host.BUDGETS`` is a keyword of
  ``Sharing.__init__`` and of the launcher's ``Server``, an ``hf-kvshare serve`` flag, and reaches the
  connector (``make_sharing`` reads ``BUDGETS``); ``Sharing.stores`` reports each store's ``bytes``,
  ``max_bytes`` and evictions.
- the connector's own byte budgets are documented: each ``*_bytes`` key a serving module reads from
  ``kv_connector_extra_config`` (``extra.get("..._bytes")``: ``device_store_bytes``, the worker's
  ``payload_bytes``, the admission's ``planned_bytes``) is named in ``docs/architecture.md``.
- one selective-recompute engine: only ``recompute/layers.py`` hands a decoder layer a cache; in the
  anchors engine only the verification probe (``anchors/verify.py``) runs tokens through the layers,
  through ``SegmentRecompute``; every KVCMAS rule beyond the reference (``verify_tokens`` too) is a knob
  of both profiles that ``profile="reference"`` turns off.
- tensor parallel in one place: which KV heads a worker rank holds and the ranks' read-backs
  assembled into all heads are defined only in ``serving/tensor_parallel.py``, a leaf without vLLM
  (the fast lane tests it), which both connector sides use.
- pipeline parallel in the same place: a worker's rank (``worker_rank``: stage by stage), the layers
  each stage announces and a claim's K/V routed by them, and the stages' read-backs joined in layer
  order are ``serving/tensor_parallel.py``'s too (``RankAssembly``); the worker announces its layers
  (``Captured.layers``) and the scheduler routes by them (``RankAssembly.layers``), nowhere else.
- the derived layout reads no client's wording: ``serving/layout.py``'s ``derive`` decodes no text and
  compares none with a string (it decides by token ids, message boundaries and roles); a whole message
  is a slot from ``MIN_MESSAGE_TOKENS``, at most ``MIN_SEGMENT_TOKENS`` (a run inside a message).
- ``import hf_kvshare`` stays light: the package and the modules a fresh interpreter starts from
  (:data:`STARTING_MODULES`: ``python -m hf_kvshare``, ``python -m hf_kvshare.bench``, the serving
  wrapper) load torch and transformers' base, never an optional heavy dependency
  (:data:`NOT_AT_IMPORT`: transformers' generation module with accelerate and boto3, PEFT,
  bitsandbytes, matplotlib, datasets, gguf, vLLM); the paths that need one import it inside the
  function (checked in a fresh interpreter).
- serving reads no method's turn scratch: what a method decided for a span reaches the serving host
  through the contract only (``placeholder``'s placement, ``Method.why_not_placed`` for a span it did
  not place): no module of ``serving/`` reads a ``.scratch`` attribute.
- serving asks the method whether a slot has the K/V a placement reads (``Method.has_source`` through
  ``Sharing.has_kv``: KVCMAS keeps an output's source in its request state, not in the slot), never the
  slot's ``latest``: in ``serving/`` only the store's own bookkeeping (:data:`LATEST_READERS`: its bound
  drops, its eviction marks) reads a ``.latest`` attribute, so no wait decides from an empty slot.
- the anchors engine across tensor-parallel ranks in one place: ``anchors/sharded.py`` (the per-rank
  factors and gate distances, exact to one rank) imports neither vLLM nor a serving module (a worker
  passes it vLLM's process group), and it is the only module of the package that uses
  ``torch.distributed`` or calls a collective (``all_reduce``, ``all_gather``, ...: :data:`COLLECTIVE_CALLS`).
- the anchors engine runs on one tensor-parallel rank's heads through one shard context: each reduction
  over the feature dimension ``D`` on the served path and each factorization (:data:`SHARD_AWARE`) takes
  a ``shard`` parameter (``None``: one rank) and goes through one hook of ``anchors/lowrank.py``
  (``column_sum``, ``any_rank``, ``columns``, ``factorize``: under a shard the ``Shard``'s methods, whose
  collectives are ``anchors/sharded.py``'s); nothing else in ``anchors/`` factorizes a matrix itself
  (``from_matrix``: :data:`OWN_FACTORIZATIONS`). On a pipeline stage (``StageShard``) the same hooks sum
  over layers; the served scopes pass a correction's layer-0 rule as ``Scope.skips_layer0`` (the model's
  layer 0, held by the first stage only: :data:`LAYER_SCOPES`).
- worker replicas (issue 51 items 1+2): a worker rank's Sharing replica is driven by ``serving/replica.py``
  alone, in the op stream's order (the worker side calls no ``plan`` / ``claim`` / ``release`` / ``record``
  / ``settle`` of a Sharing and builds none itself: ``make_sharing`` does), every op carries metadata
  fields only (:data:`OP_FIELDS`; ``OpStream.op`` refuses what is not JSON: no tensor), and
  ``serving/replica.py`` is the one serving module that reaches into the anchors engine (the rank's
  ``Shard`` and group, the scheduler's ``FollowerShard``: :data:`REPLICA_SHARD`).
- the scheduler's follower (``FollowerShard``: ``meta`` stand-ins, every reduced value the leader's) runs
  the engine's one code path: in ``anchors/`` only ``sharded.py`` makes or tests a ``meta`` tensor (the
  follower's factors: no ``is_meta`` and no ``"meta"`` elsewhere), and the anchor pools' byte bound
  counts through ``lowrank.bound_count`` (``LRUDict.trim`` takes the shard).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import hf_kvshare

PACKAGE = Path(hf_kvshare.__file__).resolve().parent
ROOT = "hf_kvshare"
ENGINES = ("anchors", "recompute", "lora")
ABOVE_ENGINES = ("methods", "session", "evaluation", "bench")
#: modules holding the method contract (besides ``methods/``): the hooks, the registry, persistence
CONTRACT = ("method", "persistence")
#: what a host calls on a method, and what a method overrides
HOOKS = (
    "plan",
    "placeholder",
    "prefix",
    "finish",
    "build",
    "record",
    "new_cache",
    "generation_context",
    "generate_kwargs",
    "forward_kwargs",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = modules()


@functools.cache
def parsed(path: Path) -> ast.Module:
    """The syntax tree of the package's module at ``path``, parsed once per process (the fast lane's
    budget: the rules below read every module's tree, none changes one)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    _WALKED[id(tree)] = tuple(ast.walk(tree))  # kept alive by the cache: its id is never reused
    return tree


#: the nodes of each tree :func:`parsed` returned, in ``ast.walk``'s order: the rules walk the whole
#: package ~20 times per process, ~0.3 s each with ``ast.walk``, ~20 ms over a kept list
_WALKED: dict[int, tuple[ast.AST, ...]] = {}


def walk(tree: ast.AST) -> Iterable[ast.AST]:
    """``ast.walk(tree)``, listed once for a module's tree from :func:`parsed`."""
    nodes = _WALKED.get(id(tree))
    return ast.walk(tree) if nodes is None else nodes


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str) -> str | None:
    """The hf_kvshare module that ``name`` (dotted) denotes, or its closest existing parent."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str) -> set[str]:
    """hf_kvshare modules imported by module ``name`` (a package import is an edge to its ``__init__``)."""
    return set(_imports_of(name))


@functools.cache
def _imports_of(name: str) -> frozenset[str]:
    """:func:`imports_of`, walked once per process (the import graph is read by several rules)."""
    tree = parsed(MODULES[name])
    package = name if is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts)
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # ``from pkg import sub`` imports the submodule when one exists, else a name of pkg
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
            ]
        for target in targets:
            if target == ROOT or target.startswith(ROOT + "."):
                resolved = _resolve(target)
                if resolved is not None and resolved != name:
                    found.add(resolved)
    return frozenset(found)


def graph() -> dict[str, set[str]]:
    return {name: imports_of(name) for name in MODULES}


def _inside(module: str, area: str) -> bool:
    full = f"{ROOT}.{area}"
    return module == full or module.startswith(full + ".")


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` as a list of modules (first == last), or ``None``."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


#: the anchors engine's gate and pool decisions, called only inside the engine (never by a method file)
ENGINE_DECISIONS = frozenset(
    {
        "reliability_gate",
        "normalized_entropy",
        "gate_weights",
        "correction_agreement",
        "near_duplicate",
        "relative_spread",
        "relative_distance",
        "squared_spread",
        "gate_distances",
        "gate_distance_terms",
        "sharded_gate_distances",
        "token_distances",
        "usage_reference",
        "usage_crossing",
        # the length rule and its piecewise replacement: which anchors correct which rows
        "comparison_prefix",
        "covering",
        "windows",
        "piecewise_rows",
    }
)


def _decision_calls(tree: ast.AST) -> list[str]:
    """The names in :data:`ENGINE_DECISIONS` that ``tree`` calls (``f(...)`` or ``x.f(...)``)."""
    found = []
    for node in walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in ENGINE_DECISIONS:
                found.append(name)
    return found


def test_method_files_take_no_gate_or_pool_decision():
    calls = {
        name: found
        for name, path in MODULES.items()
        if _inside(name, "methods") and (found := _decision_calls(parsed(path)))
    }
    assert not calls, f"method files calling the anchors engine's gate / pool decisions: {calls}"


def test_the_decision_call_finder_finds_them():
    tree = ast.parse("a = reliability_gate(d, tau)\nb = pool.near_duplicate(x, 'p', 0.1)\nc = other(d)")
    assert _decision_calls(tree) == ["reliability_gate", "near_duplicate"]


def test_every_registered_method_lives_in_methods():
    import hf_kvshare.methods  # noqa: F401  (registration)
    from hf_kvshare.method import METHODS

    assert METHODS
    outside = {
        name: cls.__module__ for name, cls in METHODS.items() if not _inside(cls.__module__, "methods")
    }
    assert not outside, f"registered methods defined outside hf_kvshare.methods: {outside}"
    modules: dict[str, list[str]] = {}
    for name, cls in METHODS.items():
        modules.setdefault(cls.__module__, []).append(name)
    shared = {m: names for m, names in modules.items() if len(names) > 1}
    assert not shared, f"one registered method per file; these files define several: {shared}"


def test_engines_import_nothing_above_them():
    edges = graph()
    bad = [
        f"{module} imports {target}"
        for module, targets in sorted(edges.items())
        if any(_inside(module, engine) for engine in ENGINES)
        for target in sorted(targets)
        if any(_inside(target, area) for area in ABOVE_ENGINES)
    ]
    assert not bad, "engine modules importing methods/session/evaluation/bench:\n" + "\n".join(bad)


def test_session_imports_no_engine():
    bad = sorted(t for t in imports_of(f"{ROOT}.session") if any(_inside(t, e) for e in ENGINES))
    assert not bad, f"hf_kvshare.session imports engine modules: {bad}"


def test_import_graph_has_no_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _attribute_reads(tree: ast.AST, owner: str, attrs: set[str]) -> list[int]:
    """Line numbers of ``<owner>.<attr>`` for ``attr`` in ``attrs``."""
    return [
        node.lineno
        for node in walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in attrs
        and isinstance(node.value, ast.Name)
        and node.value.id == owner
    ]


def test_methods_and_engines_read_the_request_through_the_turn_only():
    """``turn.session`` / ``turn.host`` appear only in ``turn.py`` and ``session.py``: methods, engines
    and drivers read a request's slots and state through the Turn's read API (so the serving host and
    the Session drive one method contract)."""
    allowed = {f"{ROOT}.turn", f"{ROOT}.session"}
    bad = []
    for name, path in MODULES.items():
        if name in allowed:
            continue
        tree = parsed(path)
        bad += [f"{name}:{line}" for line in _attribute_reads(tree, "turn", {"session", "host"})]
    assert not bad, "turn.session / turn.host read outside turn.py and session.py: " + ", ".join(bad)


def test_attribute_read_finder_finds_one():
    tree = ast.parse("x = turn.session.slots\ny = turn.slot('a')\nz = other.session")
    assert _attribute_reads(tree, "turn", {"session", "host"}) == [1]


def test_session_does_not_import_the_methods():
    bad = sorted(t for t in imports_of(f"{ROOT}.session") if _inside(t, "methods"))
    assert not bad, f"hf_kvshare.session imports {bad}; the package's __init__ fills the registry"


def test_the_package_fills_the_registry():
    assert any(_inside(t, "methods") for t in imports_of(ROOT)), "hf_kvshare/__init__.py must import .methods"


def _turn_hooks(cls: ast.ClassDef) -> list[str]:
    """``build`` / ``record`` defined by ``cls`` for a turn (a ``turn`` parameter)."""
    return [
        node.name
        for node in cls.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name in ("build", "record")
        and any(arg.arg == "turn" for arg in node.args.args)
    ]


def _base_names(cls: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases}


def test_the_method_contract_lives_in_methods_and_the_contract_modules():
    """Engines hold no method mixins; outside ``methods/`` a class overriding ``build`` / ``record`` is
    a whole method (``Method`` among its bases), not a mixin a method inherits."""
    bad = []
    for name, path in MODULES.items():
        if _inside(name, "methods") or name in {f"{ROOT}.{m}" for m in CONTRACT}:
            continue
        tree = parsed(path)
        for node in walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            in_engine = any(_inside(name, engine) for engine in ENGINES)
            if in_engine and "Method" in _base_names(node):
                bad.append(f"{name}.{node.name}: a method in an engine")
            hooks = _turn_hooks(node)
            if hooks and (in_engine or "Method" not in _base_names(node)):
                bad.append(f"{name}.{node.name} overrides {hooks} (a method mixin outside methods/)")
    assert not bad, "method contract outside methods/ and the contract modules:\n" + "\n".join(bad)


def test_the_hook_finder_finds_a_mixin():
    tree = ast.parse(
        "class Mixin:\n    def build(self, turn):\n        pass\n    def record(self, x):\n        pass\n"
    )
    assert _turn_hooks(tree.body[0]) == ["build"]


def test_no_method_shadows_a_contract_hook():
    """Every registered method's hooks take what ``Method``'s take: a host (the Session, a serving
    host) calls ``method.plan(turn)`` etc. on any method."""
    import inspect

    import hf_kvshare.methods  # noqa: F401  (registration)
    from hf_kvshare.method import METHODS, Method

    def shape(fn) -> list[str]:
        return [p.kind.name for p in inspect.signature(fn).parameters.values()]

    bad = [
        f"{name}.{hook}{inspect.signature(getattr(cls, hook))} (Method.{hook}{inspect.signature(getattr(Method, hook))})"
        for name, cls in sorted(METHODS.items())
        for hook in HOOKS
        if shape(getattr(cls, hook)) != shape(getattr(Method, hook))
    ]
    assert not bad, "methods whose contract hooks take other arguments:\n" + "\n".join(bad)


# ----------------------------------------------------------------------- the cache stores; the prefill runs
#: transformers' cache classes: a class deriving from one (or from one of ours that does) stores K/V
STORAGE_BASES = frozenset({"Cache", "DynamicCache", "DynamicLayer", "CacheLayerMixin", "StaticCache"})
#: callees that run a model: a name / attribute ``model`` or ``decoder`` called (``model(...)``,
#: ``self.model(...)``), any ``.forward(...)`` / ``.generate(...)``, and ``cache_kwargs(...)`` (which only
#: serves to hand a cache to a model call)
MODEL_CALLEES = frozenset({"model", "decoder"})
RUNNING_ATTRIBUTES = frozenset({"forward", "generate"})
RUNNING_HELPERS = frozenset({"cache_kwargs"})


def _name_of(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def storage_classes(trees: dict[str, ast.AST]) -> dict[str, list[str]]:
    """``{module: [class names]}`` of the classes that store K/V: deriving, directly or through other
    such classes of these modules, from one of :data:`STORAGE_BASES`."""
    return subclasses_of(trees, STORAGE_BASES)


def subclasses_of(trees: dict[str, ast.AST], bases: str | Iterable[str]) -> dict[str, list[str]]:
    """``{module: [class names]}`` of the classes deriving, directly or through others, from ``bases``
    (a class name, or several)."""
    classes = [(m, n) for m, tree in trees.items() for n in walk(tree) if isinstance(n, ast.ClassDef)]
    known, found, changed = {bases} if isinstance(bases, str) else set(bases), {}, True
    while changed:
        changed = False
        for module, node in classes:
            if node.name not in found.get(module, []) and any(_name_of(b) in known for b in node.bases):
                found.setdefault(module, []).append(node.name)
                known.add(node.name)
                changed = True
    return found


def model_runs(tree: ast.AST) -> list[int]:
    """Line numbers of the calls in ``tree`` that run a model (see :data:`MODEL_CALLEES`)."""
    lines = []
    for node in walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _name_of(node.func)
        attribute = isinstance(node.func, ast.Attribute)
        if name in MODEL_CALLEES or name in RUNNING_HELPERS or (attribute and name in RUNNING_ATTRIBUTES):
            lines.append(node.lineno)
    return lines


def test_no_module_both_stores_kv_and_runs_the_model():
    """The caches store (K/V, the segment table, the guards); the prefill (``hf_kvshare.prefill``), the
    methods and ``generate`` run the model over them. No module that defines a cache class calls a
    model, a ``.forward`` / ``.generate`` or ``cache_kwargs``."""
    trees = {name: parsed(path) for name, path in MODULES.items()}
    storage = storage_classes(trees)
    assert {"SegmentedCache", "SharedCache", "SlotWriter"} <= set(storage.get(f"{ROOT}.cache", []))
    assert model_runs(trees[f"{ROOT}.prefill"]), "the finder sees no model call in the prefill"
    bad = [
        f"{module}:{line} (defines {', '.join(classes)})"
        for module, classes in sorted(storage.items())
        for line in model_runs(trees[module])
    ]
    assert not bad, "modules that store K/V and run the model:\n" + "\n".join(bad)


def test_storage_and_model_run_finders_find_them():
    source = (
        "class A(DynamicCache):\n"
        "    def fill(self, model, ids):\n"
        "        return model(input_ids=ids)\n"
        "class B(A):\n"
        "    def go(self):\n"
        "        self.decoder.forward(1)\n"
        "        return cache_kwargs(self)\n"
        "class C:\n"
        "    def update(self, k):\n"
        "        return self.view.layer(k), generate(k)\n"
    )
    tree = ast.parse(source)
    assert storage_classes({"m": tree, "n": ast.parse("class D(B): pass")}) == {"m": ["A", "B"], "n": ["D"]}
    assert model_runs(tree) == [3, 6, 7]  # model(...); .forward(...) (not reported twice); cache_kwargs(...)


SERVING = "serving"
#: serving modules that may import vLLM (the connector, its two sides and their messages, and its
#: paged-cache access); the others (layout,
#: host, middleware, server, models) import without vLLM, so the main suite tests them
SERVING_VLLM = {
    f"{ROOT}.serving.{name}"
    for name in ("connector", "connector_common", "connector_scheduler", "connector_worker", "paged")
}


def _top_imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in _import_nodes(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if isinstance(node, ast.ImportFrom) and node.level:
            continue
        found.update(n.split(".")[0] for n in names)
    return found


#: the one serving module that reaches into an engine: a worker rank's replica takes the anchors engine's
#: shard of its KV heads and its tensor-parallel group (``serving/replica.py``: ``rank_shard``)
REPLICA_SHARD = {f"{ROOT}.serving.replica": f"{ROOT}.anchors.sharded"}


def test_serving_drives_the_method_contract_only():
    """``hf_kvshare.serving`` is a host like the Session: it imports no engine package, no session,
    evaluation or bench; only the drivers above it (the CLI, the bench: ``bench serve``) import it; only
    its connector / paged modules import vLLM."""
    edges = graph()
    serving = [m for m in edges if _inside(m, SERVING)]
    assert serving, "hf_kvshare.serving is missing"
    bad = [
        f"{module} imports {target}"
        for module in serving
        for target in sorted(edges[module])
        if any(_inside(target, area) for area in (*ENGINES, "session", "evaluation", "bench"))
        and REPLICA_SHARD.get(module) != target
    ]
    assert not bad, "serving modules importing engines / session / evaluation / bench:\n" + "\n".join(bad)
    users = sorted(
        m
        for m, targets in edges.items()
        if not _inside(m, SERVING) and any(_inside(t, SERVING) for t in targets)
    )
    drivers = [m for m in users if m != f"{ROOT}.cli" and not _inside(m, "bench")]
    assert not drivers, f"modules outside serving importing it (only the CLI and the bench may): {drivers}"
    vllm = sorted(m for m in serving if m not in SERVING_VLLM and "vllm" in _top_imports(parsed(MODULES[m])))
    assert not vllm, f"serving modules importing vLLM (only {sorted(SERVING_VLLM)} may): {vllm}"


# ----------------------------------------------------------------------------------- results and benchmarks
REPO = PACKAGE.parent
RESULTS = REPO / "docs" / "results"
BENCHMARKS = REPO / "benchmarks"
#: ``docs/results`` is a few pages by topic plus per-table summary CSVs, not run files
RESULTS_MAX_FILES = 40
RESULTS_MAX_BYTES = 200_000
#: a path to a script under docs/results (package code cites no doc script)
DOC_SCRIPT = re.compile(r"docs/results/[\w./-]*\.py\b")


def doc_script_citations(text: str) -> list[str]:
    return DOC_SCRIPT.findall(text)


def test_package_code_cites_no_doc_script():
    bad = [
        f"{name}: {cited}"
        for name, path in MODULES.items()
        for cited in doc_script_citations(path.read_text())
    ]
    assert not bad, "package modules citing a script under docs/results:\n" + "\n".join(bad)


def test_the_doc_script_finder_finds_one():
    assert doc_script_citations("measured (``docs/results/profile_x.py``).") == ["docs/results/profile_x.py"]
    assert doc_script_citations("see docs/results/memory.md and --out docs/results/runs") == []


def test_docs_results_holds_pages_and_small_summaries():
    if not RESULTS.is_dir():  # an installed package without its repository
        return
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= RESULTS_MAX_FILES, (
        f"docs/results holds {len(files)} files (at most {RESULTS_MAX_FILES}): raw run files stay out of the "
        "repository, keep a small summary CSV per table"
    )
    big = sorted(
        f"{p.relative_to(REPO)} ({p.stat().st_size} bytes)"
        for p in files
        if p.stat().st_size > RESULTS_MAX_BYTES
    )
    assert not big, f"files over {RESULTS_MAX_BYTES} bytes in docs/results: {big}"


def private_uses(tree: ast.AST) -> list[str]:
    """What a benchmark script reaches past the public API with: a private name imported from
    ``hf_kvshare`` (``from hf_kvshare.x import _y``, ``import hf_kvshare._x``), and any ``setattr``."""
    found = []
    for node in walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == ROOT:
            parts = (node.module or "").split(".") + [a.name for a in node.names]
            found += [
                f"from {node.module} import {a.name}"
                for a in node.names
                if any(p.startswith("_") for p in parts)
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == ROOT and any(p.startswith("_") for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append(f"setattr (line {node.lineno})")
    return found


def test_benchmark_scripts_use_the_public_api_only():
    if not BENCHMARKS.is_dir():
        return
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert scripts, "benchmarks/ holds no script"
    bad = [f"{path.name}: {use}" for path in scripts for use in private_uses(parsed(path))]
    assert not bad, "benchmark scripts reaching past the public API:\n" + "\n".join(bad)


def test_the_private_use_finder_finds_them():
    tree = ast.parse(
        "from hf_kvshare._compat import cache_kwargs\nfrom hf_kvshare import Session\n"
        "import hf_kvshare.anchors._x\nfrom torch import _C\nsetattr(m, 'f', g)\n"
    )
    assert private_uses(tree) == [
        "from hf_kvshare._compat import cache_kwargs",
        "import hf_kvshare.anchors._x",
        "setattr (line 5)",
    ]


# ------------------------------------------------------------ one vLLM launcher; the bench's serve by job
#: vLLM's OpenAI server module, as a launcher names it in its command line (``python -m ...``)
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: the one module that starts vLLM (``hf-kvshare serve`` and ``hf-kvshare bench serve`` both use it)
LAUNCHER = f"{ROOT}.serving.server"
#: the other modules that start a process with ``subprocess.Popen`` (none of them vLLM), and why
OTHER_PROCESSES = {
    f"{ROOT}.bench.sandbox.execute": "a task's generated program, in the sandbox",
    f"{ROOT}.serving.replicas": "vLLM's router (vllm-router) in front of replicas the launcher starts",
}
#: the one module that starts vLLM's router, and the router's executable as it names it
REPLICAS = f"{ROOT}.serving.replicas"
ROUTER_EXECUTABLE = "vllm-router"
#: the modules of ``bench serve``, one job each, told by what they call (a job's callees are called in
#: its module only): the requests and their arrivals; HTTP to the server; the tables and the figure;
#: starting the servers (the launcher's ``Server``); the command line
SERVE = f"{ROOT}.bench.serve"
SERVE_JOBS = {
    "trace": {"expovariate", "TraceWorkload"},
    "client": {"HTTPConnection"},
    "columns": {"write_csv", "write_json", "subplots"},
    "runs": {"Server"},
    "cli": {"ArgumentParser"},
}
#: no module of the bench is longer (lines): the bench's serve command was one module of 1,709
BENCH_MODULE_LINES = 700


def _callees(tree: ast.AST) -> set[str]:
    """Names of what ``tree`` calls (``f(...)``: ``f``; ``a.b.f(...)``: ``f``)."""
    return {_name_of(node.func) for node in walk(tree) if isinstance(node, ast.Call)} - {None}


def _string_constants(tree: ast.AST) -> set[str]:
    return {n.value for n in walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_one_module_starts_vllm():
    """Only ``serving/server.py`` names vLLM's server in a command line, and it is the only module
    besides the sandbox's that calls ``subprocess.Popen``: the bench starts vLLM through its ``Server``."""
    trees = {name: parsed(path) for name, path in MODULES.items()}
    popen = sorted(name for name, tree in trees.items() if "Popen" in _callees(tree))
    assert popen == sorted([LAUNCHER, *OTHER_PROCESSES]), f"modules calling subprocess.Popen: {popen}"
    naming = sorted(name for name, tree in trees.items() if VLLM_SERVER_MODULE in _string_constants(tree))
    assert naming == [LAUNCHER], f"modules with vLLM's server in a command line (only {LAUNCHER}): {naming}"


def test_one_module_starts_the_router_over_the_launchers_servers():
    """Only ``serving/replicas.py`` names vLLM's router as an executable, and its replicas are the
    launcher's ``Server`` (it names no vLLM server module itself: the test above)."""
    trees = {name: parsed(path) for name, path in MODULES.items()}
    naming = sorted(name for name, tree in trees.items() if ROUTER_EXECUTABLE in _string_constants(tree))
    assert naming == [REPLICAS], f"modules naming {ROUTER_EXECUTABLE} (only {REPLICAS}): {naming}"
    assert "Server" in _callees(trees[REPLICAS]), f"{REPLICAS} starts its replicas as the launcher's Server"


def test_the_bench_serve_modules_hold_one_job_each():
    modules = {name for name in MODULES if name.startswith(SERVE + ".")}
    assert modules, f"{SERVE} is not a package"
    jobs = {f"{SERVE}.{job}" for job in SERVE_JOBS}
    extra = sorted(modules - jobs - {f"{SERVE}.__main__"})
    assert not extra, f"modules of {SERVE} without a job in SERVE_JOBS: {extra}"
    bad = []
    for job, callees in SERVE_JOBS.items():
        calling = sorted(name for name in modules | {SERVE} if _callees(parsed(MODULES[name])) & callees)
        if calling != [f"{SERVE}.{job}"]:
            bad.append(f"{sorted(callees)} called in {calling} (the {job} module's job only)")
    assert not bad, f"{SERVE}: a job in another module:\n" + "\n".join(bad)


def test_no_bench_module_is_longer_than_the_bound():
    long = {
        name: n
        for name, path in MODULES.items()
        if _inside(name, "bench") and (n := len(path.read_text().splitlines())) > BENCH_MODULE_LINES
    }
    assert not long, f"bench modules over {BENCH_MODULE_LINES} lines (split them by job): {long}"


def test_the_callee_and_constant_finders():
    tree = ast.parse("import subprocess\nsubprocess.Popen(['python', '-m', 'x.y'])\nServer(1).start()\n")
    assert _callees(tree) == {"Popen", "Server", "start"}
    assert _string_constants(tree) == {"python", "-m", "x.y"}


# ------------------------------------------------------------- serving: no module state; the connector a facade
#: calls that build mutable state (containers, locks, threads): not at a serving module's top level
MUTABLE_FACTORIES = frozenset(
    {
        "dict",
        "list",
        "set",
        "OrderedDict",
        "defaultdict",
        "deque",
        "Counter",
        "WeakValueDictionary",
        "WeakKeyDictionary",
        "Queue",
        "Lock",
        "RLock",
        "Condition",
        "Event",
        "Semaphore",
        "Thread",
    }
)
#: the connector facade's module: the class vLLM loads, delegating each hook to a side
CONNECTOR = f"{ROOT}.serving.connector"
#: what only the two sides touch (the facade imports none of them)
CONNECTOR_MACHINERY = frozenset({"threading", "channel", "paged", "admission"})
#: the attributes the facade's class sets: its two sides (vLLM's base class keeps the step's metadata)
FACADE_ATTRIBUTES = frozenset({"connector_scheduler", "connector_worker"})
#: statements in one delegating hook of the facade (its ``__init__`` excepted)
FACADE_HOOK_STATEMENTS = 3


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """The module's own statements, through top-level ``if`` / ``try`` / ``with`` blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            stack[:0] = [
                *node.body,
                *getattr(node, "orelse", []),
                *getattr(node, "finalbody", []),
                *(s for h in getattr(node, "handlers", []) for s in h.body),
            ]
        else:
            yield node


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and _name_of(value.func) in MUTABLE_FACTORIES


def _dunder(target: ast.expr) -> bool:
    return isinstance(target, ast.Name) and target.id.startswith("__") and target.id.endswith("__")


def module_state(tree: ast.Module) -> list[str]:
    """``name:line`` of each mutable object a module keeps at its top level (a container, a lock, a
    thread; not the module's own ``__all__``), and of each ``global`` statement (a function rebinding
    module state)."""
    found = []
    for node in _top_level(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and _mutable(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{ast.unparse(t)}:{node.lineno}" for t in targets if not _dunder(t)]
    found += [f"global {', '.join(n.names)}:{n.lineno}" for n in walk(tree) if isinstance(n, ast.Global)]
    return found


def test_serving_modules_keep_no_module_state():
    """State lives on instances (the connector's sides, the Sharing service, the server): no serving
    module keeps a mutable container, lock or thread at its top level, nor rebinds a global (constants
    are tuples, frozensets, read-only mappings)."""
    bad = [
        f"{name}: {found}"
        for name, path in sorted(MODULES.items())
        if _inside(name, SERVING)
        for found in module_state(parsed(path))
    ]
    assert not bad, "mutable module-level state in hf_kvshare.serving:\n" + "\n".join(bad)


#: the fields of vLLM's ``MultiModalFeatureSpec`` the server reads (an image's place and hash)
MM_FIELDS = ("mm_position", "mm_hash")


def test_vllms_multimodal_features_are_read_in_one_place():
    """Only ``serving/layout.py`` (``images_of``) names a multimodal feature's fields, as an attribute
    or a string: every image the server plans is a span found by vLLM's hash, not by its tokens."""
    readers = set()
    for name, path in MODULES.items():
        for node in walk(parsed(path)):
            field = node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)
            if isinstance(node, (ast.Attribute, ast.Constant)) and field in MM_FIELDS:
                readers.add(name)
    assert readers == {"hf_kvshare.serving.layout"}, readers


def test_the_module_state_finder_finds_it():
    tree = ast.parse(
        "__all__ = ['f']\nA = (1, 2)\nB = frozenset({1})\n_R: dict[str, int] = {}\nif True:\n    L = threading.Lock()\n"
        "C = {k: 1 for k in A}\ndef f():\n    global B\n    B = 2\n"
    )
    assert module_state(tree) == ["_R:4", "L:6", "C:7", "global B:9"]


#: the channel module and its process-local handoff table (one process's worker and scheduler sides meet
#: there at one rank: K/V parked by reference, never copied)
HANDOFF_MODULE, HANDOFF_TABLE, HANDOFF_CLASS = f"{ROOT}.serving.channel", "_HANDOFF", "_Handoff"


def test_only_the_channel_parks_tensors_in_the_process_local_handoff():
    """The handoff table is built once, at ``serving/channel.py``'s top level (``_HANDOFF``), and no other
    module of the package names it or its class: tensors are parked and taken by the channel's senders
    and listeners only."""
    users = set()
    for name, path in MODULES.items():
        for node in walk(parsed(path)):
            word = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
            if word in (HANDOFF_TABLE, HANDOFF_CLASS):
                users.add(name)
    assert users == {HANDOFF_MODULE}, f"the handoff table named outside the channel: {sorted(users)}"
    built = [
        ast.unparse(target)
        for node in walk(parsed(MODULES[HANDOFF_MODULE]))
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and _name_of(node.value.func) == HANDOFF_CLASS
        for target in node.targets
    ]
    assert built == [HANDOFF_TABLE], f"the handoff table built as {built}"
    assert [
        t
        for t in _top_level(parsed(MODULES[HANDOFF_MODULE]))
        if isinstance(t, ast.Assign) and HANDOFF_TABLE in {ast.unparse(x) for x in t.targets}
    ], "the handoff table is not at the top level"


def facade_faults(tree: ast.Module) -> list[str]:
    """Why the connector module is not a facade: it imports the sides' machinery, its connector class
    (the one deriving from ``KVConnectorBase_V1``) sets attributes other than its two sides, or a
    hook does more than delegate (over :data:`FACADE_HOOK_STATEMENTS` statements)."""
    faults = [
        f"imports {name}"
        for node in _import_nodes(tree)
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
        if name.split(".")[0] in CONNECTOR_MACHINERY or name.rpartition(".")[2] in CONNECTOR_MACHINERY
    ]
    faults += [
        f"imports {alias.name}"
        for node in _import_nodes(tree)
        if isinstance(node, ast.ImportFrom) and node.level and not node.module
        for alias in node.names
        if alias.name in CONNECTOR_MACHINERY
    ]
    classes = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and "KVConnectorBase_V1" in _base_names(node)
    ]
    if len(classes) != 1:
        return [*faults, f"{len(classes)} KVConnectorBase_V1 classes (one facade expected)"]
    for fn in classes[0].body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        attributes = {
            target.attr
            for node in walk(fn)
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        }
        faults += [f"{fn.name} sets self.{a}" for a in sorted(attributes - FACADE_ATTRIBUTES)]
        body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
        if fn.name != "__init__" and len(body) > FACADE_HOOK_STATEMENTS:
            faults.append(f"{fn.name} has {len(body)} statements (a hook delegates)")
    return faults


def test_the_connector_is_a_facade_over_its_two_sides():
    """``serving/connector.py`` is the class vLLM loads and nothing more: each hook goes to the
    scheduler side (``connector_scheduler``) or the worker side (``connector_worker``), each in its own
    module, as vLLM's in-tree connectors are laid out; threads, locks and channels live there."""
    tree = parsed(MODULES[CONNECTOR])
    assert not facade_faults(tree), "the connector is not a facade:\n" + "\n".join(facade_faults(tree))
    sides = {f"{ROOT}.serving.connector_scheduler", f"{ROOT}.serving.connector_worker"}
    assert sides <= imports_of(CONNECTOR), f"the facade must delegate to {sorted(sides)}"
    assert f"{ROOT}.serving.connector_worker" not in imports_of(f"{ROOT}.serving.connector_scheduler")
    assert f"{ROOT}.serving.connector_scheduler" not in imports_of(f"{ROOT}.serving.connector_worker")


def test_the_facade_checker_finds_faults():
    source = (
        "import threading\nfrom . import channel\n"
        "class C(KVConnectorBase_V1):\n"
        "    def __init__(self):\n        self.connector_worker = 1\n        self._lock = threading.Lock()\n"
        "    def hook(self):\n        a = 1\n        b = 2\n        c = 3\n        return a + b + c\n"
    )
    assert facade_faults(ast.parse(source)) == [
        "imports threading",
        "imports channel",
        "__init__ sets self._lock",
        "hook has 4 statements (a hook delegates)",
    ]


#: connector_common's classes vLLM carries from the scheduler to the worker each step
STEP_METADATA = ("HFKVShareMetadata", "Load", "Source", "Correction", "Capture")


def tensor_fields(tree: ast.Module, classes: tuple[str, ...]) -> list[str]:
    """``Class.field`` for each annotated field of ``classes`` whose annotation names a tensor."""
    faults = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if re.search(r"\b(torch|Tensor)\b", ast.unparse(item.annotation)):
                        faults.append(f"{node.name}.{item.target.id}")
    return faults


def test_the_step_metadata_carries_no_tensor():
    """K/V stay where vLLM computed them (``serving/worker_store.py``): the connector's step metadata
    (``connector_common``'s :data:`STEP_METADATA` classes) has no tensor field; a claim is references to
    rows the worker keeps and ranges whose K/V go on the order channel."""
    tree = parsed(MODULES[f"{ROOT}.serving.connector_common"])
    names = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert set(STEP_METADATA) <= names, f"connector_common lacks {sorted(set(STEP_METADATA) - names)}"
    assert not tensor_fields(tree, STEP_METADATA), tensor_fields(tree, STEP_METADATA)


def test_the_tensor_field_finder_finds_one():
    source = "class Load:\n    keys: torch.Tensor\n    start: int\n    kv: dict[str, Tensor] = None\n"
    assert tensor_fields(ast.parse(source), ("Load",)) == ["Load.keys", "Load.kv"]


#: the serving worker's side: it writes claims from kept rows, sent K/V and correction factors
WORKER_SIDE = (f"{ROOT}.serving.connector_worker", f"{ROOT}.serving.worker_store")


def test_the_worker_corrects_from_factors_without_the_anchors():
    """A KVCMAS correction of rows the worker keeps reaches it as low-rank factors (a ``Correction`` in the
    step metadata, the factors on the order channel) and is added there by ``worker_store.add_delta``:
    the worker's side imports neither the anchors nor the methods (their state stays on the scheduler)."""
    for name in WORKER_SIDE:
        bad = sorted(m for m in imports_of(name) if m.startswith((f"{ROOT}.anchors", f"{ROOT}.methods")))
        assert not bad, f"{name} imports {bad}"
    tree = parsed(MODULES[f"{ROOT}.serving.worker_store"])
    assert "add_delta" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


#: where serving makes a stand-in of K/V (``meta`` tensors: the worker's :func:`stand_ins`, and the
#: channel rebuilding one from its header)
STAND_IN_MAKERS = (f"{ROOT}.serving.worker_store", f"{ROOT}.serving.channel")


def meta_tensor_calls(tree: ast.AST) -> int:
    """Calls that put a tensor on ``meta`` by keyword (``device="meta"``)."""
    return sum(
        1
        for node in walk(tree)
        if isinstance(node, ast.Call)
        and any(
            k.arg == "device" and isinstance(k.value, ast.Constant) and k.value.value == "meta"
            for k in node.keywords
        )
    )


def test_stand_in_records_are_made_in_the_worker_store_for_value_free_methods_only():
    """A value-free method's record holds stand-ins of the K/V the worker keeps (no read-back shipped to
    the scheduler): they are made in one place (``worker_store.stand_ins``; ``channel`` rebuilds the
    worker's from a message's header), no other serving module puts a tensor on ``meta``, and every
    value-free method (``serving/host.py``'s ``VALUE_FREE``) is a served method."""
    from hf_kvshare.serving.host import SERVED, VALUE_FREE

    makers = {
        name
        for name in MODULES
        if name.startswith(f"{ROOT}.serving.") and meta_tensor_calls(parsed(MODULES[name]))
    }
    assert makers == set(STAND_IN_MAKERS), f"stand-ins made in {sorted(makers)}"
    assert set(VALUE_FREE) <= set(SERVED), f"value-free methods not served: {set(VALUE_FREE) - set(SERVED)}"
    assert meta_tensor_calls(ast.parse("torch.empty(2, device='meta')\ntorch.empty(2, device='cpu')")) == 1


# ----------------------------------------------------------------------- one request, one walk, two executors
#: modules that define the contract or the request and walk every host shares: they run no model
SHARED_CONTRACT = (*CONTRACT, "request", "walk")
#: modules that run the model for a turn (the HF executor and what it calls)
EXECUTORS = ("prefill", "executor")
#: the request's bookkeeping, defined once (``request.py``): neither host defines its own
REQUEST_BOOKKEEPING = frozenset(
    {"_record", "_release", "_compact_views", "compact_views", "add_views", "record_output", "open_turn"}
    | {"next_output_slot", "_rollback", "rollback", "held_slot", "piece_slot"}
)
HOSTS = (f"{ROOT}.session", f"{ROOT}.serving.host")


def test_the_contract_and_the_request_run_no_model():
    """``method.py`` / ``persistence.py`` (the contract), ``request.py`` and ``walk.py`` import neither the
    prefill nor the HF executor, not even inside a function: ``Method.build`` reaches the executor through
    ``turn.executor``."""
    bad = [
        f"{ROOT}.{module} imports {target}"
        for module in SHARED_CONTRACT
        for target in sorted(imports_of(f"{ROOT}.{module}"))
        if any(_inside(target, executor) for executor in EXECUTORS)
    ]
    assert not bad, "the contract / request / walk import the model's executor:\n" + "\n".join(bad)


def _defined_functions(tree: ast.AST) -> set[str]:
    return {n.name for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _hook_calls(tree: ast.AST) -> list[int]:
    """Lines calling a method's span hooks: ``x.placeholder(turn, span, cache)`` / ``x.prefix(...)``
    with three arguments (``SegmentKV.prefix(n)`` takes one)."""
    return [
        node.lineno
        for node in walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("placeholder", "prefix")
        and len(node.args) == 3
    ]


def test_one_request_and_one_walk_serve_both_hosts():
    """The Session and the serving host are each a :class:`hf_kvshare.request.Request` and define none
    of its bookkeeping themselves (prepare / record / release / compact views); outside ``methods/`` only
    ``walk.py`` calls a method's span hooks (``placeholder`` / ``prefix``): both hosts walk the method
    with :class:`hf_kvshare.walk.Walk`."""
    trees = {name: parsed(MODULES[name]) for name in MODULES}
    bad = []
    for host, cls in zip(HOSTS, ("Session", "ServingHost")):
        classes = {n.name: n for n in walk(trees[host]) if isinstance(n, ast.ClassDef)}
        assert cls in classes, f"{host} defines no {cls}"
        if "Request" not in _base_names(classes[cls]):
            bad.append(f"{host}.{cls} is not a Request")
        bad += [
            f"{host} defines {name}" for name in sorted(_defined_functions(trees[host]) & REQUEST_BOOKKEEPING)
        ]
    assert f"{ROOT}.request" in MODULES and REQUEST_BOOKKEEPING & _defined_functions(trees[f"{ROOT}.request"])
    assert _hook_calls(trees[f"{ROOT}.walk"]), "the finder sees no hook call in the walk"
    bad += [
        f"{name}:{line} calls a method's span hook"
        for name, tree in trees.items()
        if name != f"{ROOT}.walk" and not _inside(name, "methods")
        for line in _hook_calls(tree)
    ]
    assert not bad, "request bookkeeping or the walk written twice:\n" + "\n".join(bad)


def test_the_hook_call_finder_finds_one():
    tree = ast.parse("a = m.placeholder(turn, span, cache)\nb = kv.prefix(3)\nc = m.prefix(t, s, c)\n")
    assert _hook_calls(tree) == [1, 3]


# ------------------------------------------------ the cache: a table over layers that store; engines above
#: the core's storage modules: the segment table (cache), the layers that store (cache_layer), detached K/V
#: and the interface of K/V computed where it is written (segment_kv)
CACHE_CORE = ("cache", "cache_layer", "segment_kv")
#: in-place tensor writes and fresh buffers: K/V are written by the layer class and the K/V kinds, not the
#: cache that dispatches to them
TENSOR_WRITES = frozenset({"copy_", "index_copy_", "zero_", "add_", "fill_", "apply_into", "new_empty"})
#: the most methods ``SegmentedCache`` may define itself (the table, its guards, dispatch to its layers)
MAX_CACHE_METHODS = 34


def tensor_writes(tree: ast.AST) -> list[int]:
    """Line numbers of calls ``<x>.<w>(...)`` for ``w`` in :data:`TENSOR_WRITES`."""
    return [
        node.lineno
        for node in walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in TENSOR_WRITES
    ]


def _methods(cls: ast.ClassDef) -> list[str]:
    return [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_cache_is_a_table_over_layers_that_store():
    """``SegmentedCache`` is the segment table, its guards and dispatch (at most
    :data:`MAX_CACHE_METHODS` methods of its own); its layers store (``cache_layer.SegmentLayer``, a
    ``DynamicLayer``: hold, write slots, keep, copy; ``laid_out``), so ``cache.py`` writes no tensor."""
    trees = {name: parsed(MODULES[name]) for name in MODULES}
    cache = trees[f"{ROOT}.cache"]
    lines = tensor_writes(cache)
    assert not lines, f"hf_kvshare/cache.py writes tensors itself (lines {lines}); its layers store"
    layers = subclasses_of(trees, "DynamicLayer").get(f"{ROOT}.cache_layer", [])
    assert "SegmentLayer" in layers, "the cache's layer class (a DynamicLayer) is missing from cache_layer.py"
    table = next(n for n in cache.body if isinstance(n, ast.ClassDef) and n.name == "SegmentedCache")
    assert len(_methods(table)) <= MAX_CACHE_METHODS, (
        f"SegmentedCache defines {len(_methods(table))} methods (at most {MAX_CACHE_METHODS}): put storage "
        "on the layer class (cache_layer.py), the multimodal-RoPE track in mrope.py"
    )


def test_the_core_cache_holds_no_engine():
    """The cache's modules import no engine, method, host or driver, and every kind of K/V computed where
    it is written (``DeferredKV``: the interface the cache consumes) is an engine's, defined beside it
    (``anchors/corrected.py``: ``CorrectedKV``)."""
    edges = graph()
    above = (*ENGINES, *ABOVE_ENGINES, "serving")
    bad = [
        f"{module} imports {target}"
        for module in (f"{ROOT}.{m}" for m in CACHE_CORE)
        for target in sorted(edges[module])
        if any(_inside(target, area) for area in above)
    ]
    assert not bad, "the core cache imports engines or modules above them:\n" + "\n".join(bad)
    trees = {name: parsed(path) for name, path in MODULES.items()}
    kinds = subclasses_of(trees, "DeferredKV")
    assert kinds, "no DeferredKV kind found (CorrectedKV in anchors/corrected.py)"
    outside = {m: c for m, c in kinds.items() if not any(_inside(m, e) for e in ENGINES)}
    assert not outside, f"kinds of deferred K/V defined outside the engines: {outside}"


#: multimodal-RoPE internals: its types, the model's rope index (through ``_compat``), the track's state;
#: named (called or read) only in ``mrope.py`` (and ``_compat.py``, which holds the private access)
MROPE_NAMES = frozenset(
    {"RopeTrack", "VisualRope", "visual_rope", "mrope_index", "mrope_section", "visual_token_ids"}
    | {"get_rope_index", "next_shift", "second_per_grid_ts"}
)
MROPE_HOMES = {f"{ROOT}.mrope", f"{ROOT}._compat"}


def mrope_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, name)`` of the code (not docstrings or annotations) in ``tree`` naming a multimodal-RoPE
    internal (:data:`MROPE_NAMES`): a call or a read of the name or attribute, or a string key."""
    annotations = {
        id(n)
        for node in walk(tree)
        for a in (getattr(node, "annotation", None), getattr(node, "returns", None))
        if isinstance(a, ast.AST)
        for n in walk(a)
    }
    found = []
    for node in walk(tree):
        if id(node) in annotations:
            continue
        name = _name_of(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MROPE_NAMES:
            name = node.value
        if name in MROPE_NAMES:
            found.append((node.lineno, name))
    return sorted(found)


def test_multimodal_rope_lives_in_mrope():
    """Multimodal RoPE (Qwen2-VL's 3D positions) is one module: the image layouts, the cache's rope
    track, the forward's position ids and the slot-frame rotations are in ``mrope.py``; the cache, the
    prefill, vision, recomputation and the session only call it."""
    bad = [
        f"{name}:{line} ({what})"
        for name, path in MODULES.items()
        if name not in MROPE_HOMES
        for line, what in mrope_uses(parsed(path))
    ]
    assert not bad, "multimodal-RoPE internals outside mrope.py:\n" + "\n".join(bad)


def test_the_cache_rule_finders_find_them():
    tree = ast.parse(
        "class A(DeferredKV): pass\nclass B(A):\n    def f(self, k: VisualRope):\n"
        "        k.copy_(1)\n        return RopeTrack(s), x['second_per_grid_ts'], self.next_shift\n"
    )
    assert tensor_writes(tree) == [4]
    assert subclasses_of({"m": tree}, "DeferredKV") == {"m": ["A", "B"]}
    assert mrope_uses(tree) == [(5, "RopeTrack"), (5, "next_shift"), (5, "second_per_grid_ts")]


# ------------------------------------------------------------------ images are opened in one place
#: the one function that opens an image file: its size is checked from the header before decoding
IMAGE_OPENER = (f"{ROOT}.vision", "open_image")


def image_opens(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, function)`` of each ``Image.open(...)`` / ``PIL.Image.open(...)`` call in ``tree``, with
    the function it is in (``""`` at the top level)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr == "open"
                and _name_of(child.func.value) == "Image"
            ):
                found.append((child.lineno, function))
            visit(child, name)

    visit(tree, "")
    return found


def test_images_are_opened_in_one_place():
    """Every image file the package reads (the Python API's ``PH(image=path)``, video frames, the bench's
    task files) goes through ``vision.open_image``, which refuses an image over the pixel limit from its
    header before decoding it (a decompression bomb): no other code calls ``Image.open``."""
    bad = [
        f"{name}:{line} ({function or 'module'})"
        for name, path in MODULES.items()
        for line, function in image_opens(parsed(path))
        if (name, function) != IMAGE_OPENER
    ]
    assert not bad, "Image.open outside vision.open_image:\n" + "\n".join(bad)
    assert image_opens(parsed(MODULES[IMAGE_OPENER[0]])), "vision.open_image opens no image"


def test_the_image_open_finder_finds_them():
    tree = ast.parse("def f(p):\n    return Image.open(p)\nx = PIL.Image.open('a')\ny = open('b')\n")
    assert image_opens(tree) == [(2, "f"), (3, "")]


# ------------------------------------------------------------------ options are checked where they are set
def setattr_overrides(tree: ast.AST) -> list[str]:
    """Classes in ``tree`` that define ``__setattr__`` / ``__setstate__`` themselves."""
    return [
        f"{node.name}.{fn.name}"
        for node in walk(tree)
        if isinstance(node, ast.ClassDef)
        for fn in node.body
        if isinstance(fn, ast.FunctionDef) and fn.name in ("__setattr__", "__setstate__")
    ]


def test_every_method_option_is_checked_when_set():
    """A method's options are checked by its constructor and again when assigned later (``m.tau = x``):
    ``Method.__setattr__`` re-runs the constructor's checks; no method file overrides it (which would
    let an option change unchecked)."""
    import hf_kvshare.methods  # noqa: F401  (registration)
    from hf_kvshare.method import METHODS, Method

    bad = [
        f"{name}: {found}"
        for name, path in MODULES.items()
        if _inside(name, "methods")
        for found in setattr_overrides(parsed(path))
    ]
    bad += [name for name, cls in METHODS.items() if cls.__setattr__ is not Method.__setattr__]
    assert not bad, "methods that bypass the option check on assignment:\n" + "\n".join(bad)


def test_the_setattr_finder_finds_one():
    tree = ast.parse("class A:\n    def __setattr__(self, k, v):\n        pass\nclass B:\n    x = 1\n")
    assert setattr_overrides(tree) == ["A.__setattr__"]


#: the cause vocabulary of spans not shared is ``reasons.py``: a leaf (it imports no hf_kvshare module,
#: so the turn, the bench and the server all read it) and the one place a reason's text is matched
REASONS = f"{ROOT}.reasons"
#: fragments of the reasons the engines write (anchors/): matching one is classifying a reason
REASON_FRAGMENTS = (
    "fewer than 2",
    "> tau",
    "tau = 0",
    "the turn is dense",
    "no anchor holds",
    "far from every anchor",
    "first agent to see",
)
_MATCHERS = frozenset({"search", "match", "fullmatch", "compile", "findall", "startswith", "endswith"})


def reason_matches(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that match a reason's text (:data:`REASON_FRAGMENTS`): a fragment tested with
    ``in`` / ``not in``, or given to a regex or ``startswith`` / ``endswith`` call."""
    found = []
    for node in walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and _name_of(node.func) in _MATCHERS:
            operands = list(node.args)
        else:
            continue
        for operand in operands:
            text = operand.value if isinstance(operand, ast.Constant) else None
            if isinstance(text, str) and any(f in text for f in REASON_FRAGMENTS):
                found.append(node.lineno)
    return sorted(set(found))


def test_the_reasons_of_spans_not_shared_are_classified_in_reasons_only():
    """``reasons.py`` imports no hf_kvshare module, and no other module matches a reason's text
    (the engines write reasons; the turn, the demo, the bench and the server ask ``reasons`` for the
    cause)."""
    assert REASONS in MODULES
    assert not imports_of(REASONS), f"reasons.py imports {sorted(imports_of(REASONS))}: it must be a leaf"
    bad = [
        f"{name}:{line}"
        for name, path in MODULES.items()
        if name != REASONS
        for line in reason_matches(parsed(path))
    ]
    assert not bad, "reason texts matched outside reasons.py:\n" + "\n".join(bad)


def test_the_reason_match_finder_finds_them():
    tree = ast.parse(
        "a = 'fewer than 2 anchors' in r\nb = re.search(r'entropy .* > tau', r)\n"
        "c = r.startswith('the turn is dense')\nd = 'x' in r\ne = f('tau = 0')\n"
    )
    assert reason_matches(tree) == [1, 2, 3]


MATCHER = f"{ROOT}.matching"


def _piece_slot_builds(tree: ast.AST) -> list[int]:
    """Lines constructing a slot that is a piece of another: a call with a ``piece_of=`` keyword whose
    callee is named ``Slot``."""
    return [
        node.lineno
        for node in walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == "Slot"
        and any(k.arg == "piece_of" for k in node.keywords)
    ]


def test_the_content_matcher_is_one_leaf_module():
    """``matching.py`` imports no hf_kvshare module and no tensor library (token ids only, no model); the
    serving layout derives its pieces with ``matching.match``; only ``request.py`` builds a piece slot."""
    tree = parsed(MODULES[MATCHER])
    third = {
        alias.name.split(".")[0]
        for node in _import_nodes(tree)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert not imports_of(MATCHER), f"{MATCHER} imports {sorted(imports_of(MATCHER))}"
    assert not third & {"torch", "numpy", "transformers"}, f"{MATCHER} imports {sorted(third)}"
    layout = f"{ROOT}.serving.layout"
    assert MATCHER in imports_of(layout), f"{layout} does not find pieces through {MATCHER}"
    builds = {name: lines for name in MODULES if (lines := _piece_slot_builds(parsed(MODULES[name])))}
    assert set(builds) == {f"{ROOT}.request"}, f"piece slots built outside request.py: {builds}"


def test_the_piece_slot_finder_finds_one():
    tree = ast.parse("a = Slot('x', ids, '')\nb = turn.Slot('y', ids, '', piece_of=('x', 0, 3))\n")
    assert _piece_slot_builds(tree) == [2]


# ------------------------------------------------------------- agent frameworks: plain clients of the server
#: the examples that drive ``hf-kvshare serve`` through an agent framework, as its users would write them
FRAMEWORK_EXAMPLES = ("agent_workflow.py", "agents_sdk.py", "langgraph_agents.py")
#: what only a client that knows hf_kvshare sends: the layout fields and the request body's extras
LAYOUT_FIELDS = frozenset({"kv_transfer_params", "hf_kvshare", "extra_body", "cache_salt"})


def client_faults(tree: ast.AST) -> list[str]:
    """What makes ``tree`` more than a plain client of the server: an import of ``hf_kvshare``, or a
    layout field named (a string, keyword, name or attribute in :data:`LAYOUT_FIELDS`)."""
    faults = []
    for node in walk(tree):
        if isinstance(node, ast.Import):
            faults += [f"imports {a.name}" for a in node.names if a.name.split(".")[0] == ROOT]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == ROOT:
            faults.append(f"imports {node.module}")
        named = (
            node.value
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            else node.arg
            if isinstance(node, ast.keyword)
            else _name_of(node)
            if isinstance(node, (ast.Name, ast.Attribute))
            else None
        )
        if named in LAYOUT_FIELDS:
            faults.append(f"line {node.lineno} names {named}")
    return sorted(faults)


def test_the_agent_framework_examples_send_no_layout():
    """``examples/agents_sdk.py`` and ``examples/langgraph_agents.py`` (and their shared workflow) are what
    a framework's user writes: they import nothing of hf_kvshare and send no layout field; whatever they
    share, the server finds in the prompt."""
    examples = PACKAGE.parent / "examples"
    bad = {
        name: faults
        for name in FRAMEWORK_EXAMPLES
        if (faults := client_faults(ast.parse((examples / name).read_text())))
    }
    assert not bad, f"agent-framework examples that are not plain clients: {bad}"


def test_the_client_fault_finder_finds_them():
    tree = ast.parse(
        "from hf_kvshare.serving import client\nimport json\n"
        "c.create(extra_body={'kv_transfer_params': {}})\nx = 'hf_kvshare[agents]'\n"
    )
    assert client_faults(tree) == [
        "imports hf_kvshare.serving",
        "line 3 names extra_body",
        "line 3 names kv_transfer_params",
    ]


#: the calls by which a thread blocks on another (a sleep, a condition's or an event's wait, a join, a
#: future's result)
BLOCKING_CALLS = frozenset({"sleep", "wait", "wait_for", "join", "result"})
#: the serving module that plans, claims and records without ever waiting for another request
NEVER_WAITS = "hf_kvshare.serving.host"


def blocking_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, name)`` of each call of a :data:`BLOCKING_CALLS` method or function (not a string's
    ``join``)."""
    found = []
    for node in walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            on_text = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Constant)
            if name in BLOCKING_CALLS and not on_text:
                found.append((node.lineno, name))
    return sorted(found)


def test_the_serving_store_never_waits_for_another_request():
    """Waiting for another request (its record, its read-back) is the connector scheduler side's: it
    answers vLLM "not decided yet" and asks ``Sharing`` again (``recorded``, a plan); ``serving/host.py``
    only decides, with a claim's stop and its reason (``not recorded yet``), and never blocks."""
    path = MODULES[NEVER_WAITS]
    bad = blocking_calls(parsed(path))
    assert not bad, f"{NEVER_WAITS} blocks: {bad}"


def test_the_blocking_call_finder_finds_them():
    tree = ast.parse("time.sleep(1)\ncond.wait_for(f, 2)\nfuture.result()\nthread.join()\n','.join(x)\n")
    assert blocking_calls(tree) == [(1, "sleep"), (2, "wait_for"), (3, "result"), (4, "join")]


def test_every_gate_rule_beyond_the_reference_is_a_profile_knob_the_reference_turns_off():
    """KVCMAS's rules beyond the authors' code are knobs both profiles set (``PROFILES``): the same
    knobs, each field defaulting to ``None`` (the profile's), and ``profile="reference"`` turns every
    one off (0 / ``False``; the whole-turn fallback), so one option restores the authors' decisions."""
    from dataclasses import fields

    from hf_kvshare.methods.kvcmas import KVCMAS, PROFILES

    reuse, reference = PROFILES["reuse"], PROFILES["reference"]
    assert set(reuse) == set(reference), "a rule set by one profile only"
    defaults = {f.name: f.default for f in fields(KVCMAS)}
    assert {k: defaults[k] for k in reuse if defaults[k] is not None} == {}, "a profile knob with a default"
    on = {
        k: v
        for k, v in reference.items()
        if not (v is False or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0))
    }
    assert on == {"turn_fallback": "turn"}, f"rules the reference profile leaves on: {on}"


def test_one_selective_recompute_engine_runs_tokens_through_the_layers():
    """Only ``recompute/layers.py`` hands a decoder layer a cache (``decoder_layer_cache_kwarg``, defined
    in ``_compat.py``): every module that runs some tokens of a segment through the layers does it
    through ``SegmentRecompute``; in the anchors engine only the verification probe
    (``anchors/verify.py``, KVCMAS's ``verify_tokens``) does, and it imports that engine."""
    layer_callers = sorted(
        name
        for name, path in MODULES.items()
        if "decoder_layer_cache_kwarg" in path.read_text()
        and name not in (f"{ROOT}._compat", f"{ROOT}.recompute.layers")
    )
    assert not layer_callers, f"a second layer-by-layer engine: {layer_callers}"
    probing = sorted(
        name
        for name, path in MODULES.items()
        if _inside(name, "anchors") and re.search(r"SegmentRecompute\(|\.run_layer\(", path.read_text())
    )
    assert probing == [f"{ROOT}.anchors.verify"], probing
    assert f"{ROOT}.recompute.layers" in imports_of(f"{ROOT}.anchors.verify")


# ------------------------------------------------------------------ files given by path: one bounded read
def test_files_given_by_path_are_read_in_one_bounded_place():
    """A saved state's ``state.json``, a method option's file and the bench's inputs are read by
    ``bounded_read.read_input`` (a regular file of at most a stated size, checked on the descriptor it
    opened without blocking): no other module opens a file with ``O_NONBLOCK``, and the module imports
    no hf_kvshare module."""
    openers = [
        name
        for name, path in MODULES.items()
        if "O_NONBLOCK" in path.read_text() and name != f"{ROOT}.bounded_read"
    ]
    assert not openers, f"non-blocking opens outside bounded_read.read_input: {openers}"
    tree = parsed(MODULES[f"{ROOT}.bounded_read"])
    relative = [
        n
        for n in walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.level or "hf_kvshare" in (n.module or ""))
    ]
    assert not relative, "bounded_read imports hf_kvshare modules"


#: the one module that reads and writes vLLM's paged cache, and the calls that reach a backend's writer
PAGED = f"{ROOT}.serving.paged"
PAGED_WRITER_CALLS = frozenset({"do_kv_cache_update", "backend_writer"})


def test_one_module_reaches_vllms_cache_writer():
    """Only ``serving/paged.py`` calls an attention backend's cache writer (``do_kv_cache_update``) or
    takes it (``backend_writer``): the connector reaches a layer's cache through ``paged.open_layer``,
    whose start-up checks (MLA, shapes, dtype, the probed layout) every layer passes or is refused with
    the reason and what works."""
    calling = sorted(
        name
        for name, path in MODULES.items()
        if name != PAGED and _callees(parsed(path)) & PAGED_WRITER_CALLS
    )
    assert not calling, f"modules calling vLLM's cache writer outside {PAGED}: {calling}"


# ------------------------------------------------------------------ every store is bounded by bytes
#: the module that names the stores' byte budgets (``BUDGETS``) and the places each must reach
BUDGET_HOST = "hf_kvshare.serving.host"
#: the ``hf-kvshare serve`` flag of a budget (``--max-<store>-bytes``; the slots' store is the store)
BUDGET_FLAGS = {"max_bytes": "--max-store-bytes"}


def tuple_constant(tree: ast.Module, name: str) -> tuple[str, ...]:
    """The strings of the top-level ``name = (...)`` tuple of ``tree`` (empty when missing)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            if isinstance(node.value, ast.Tuple):
                return tuple(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return ()


def init_keywords(tree: ast.Module, cls: str) -> set[str]:
    """The parameter names of ``cls.__init__`` in ``tree``."""
    for node in walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    args = fn.args
                    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    return set()


def budget_flag(budget: str) -> str:
    return BUDGET_FLAGS.get(budget, "--" + budget.replace("_", "-"))


def test_every_store_has_a_byte_budget_from_the_cli_to_the_connector():
    """A store's byte budget is an option all the way: ``Sharing``, the launcher's ``Server``, the
    ``hf-kvshare serve`` flag, the connector's ``kv_connector_extra_config`` (``make_sharing`` reads
    ``BUDGETS``), and ``Sharing.stores`` reports them (a budget that reaches one place only bounds
    nothing the user can set)."""
    host = parsed(MODULES[BUDGET_HOST])
    budgets = tuple_constant(host, "BUDGETS")
    assert "max_bytes" in budgets and len(budgets) >= 4, budgets
    server = parsed(MODULES["hf_kvshare.serving.server"])
    cli = MODULES["hf_kvshare.cli"].read_text()
    common = parsed(MODULES["hf_kvshare.serving.connector_common"])  # both sides build their Sharing there
    make = next(n for n in walk(common) if isinstance(n, ast.FunctionDef) and n.name == "make_sharing")
    missing = [
        f"{budget}: {where}"
        for budget in budgets
        for where, ok in (
            ("a keyword of Sharing.__init__", budget in init_keywords(host, "Sharing")),
            ("a keyword of Server.__init__", budget in init_keywords(server, "Server")),
            (f"the serve flag {budget_flag(budget)}", f'"{budget_flag(budget)}"' in cli),
        )
        if not ok
    ]
    if not any(isinstance(n, ast.Name) and n.id == "BUDGETS" for n in walk(make)):
        missing.append("make_sharing does not read BUDGETS from kv_connector_extra_config")
    stores = next(n for n in walk(host) if isinstance(n, ast.FunctionDef) and n.name == "stores")
    keys = {n.value for n in walk(stores) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    missing += [
        f"Sharing.stores reports no {key!r}" for key in ("bytes", "max_bytes", "evicted") if key not in keys
    ]
    assert not missing, "store budgets that do not reach every place:\n" + "\n".join(missing)


def test_the_budget_finders_find_them():
    tree = ast.parse("B = ('a', 'b')\nclass S:\n    def __init__(self, x, *, y=1):\n        pass\n")
    assert tuple_constant(tree, "B") == ("a", "b") and tuple_constant(tree, "C") == ()
    assert init_keywords(tree, "S") == {"self", "x", "y"} and init_keywords(tree, "T") == set()
    assert (
        budget_flag("max_bytes") == "--max-store-bytes"
        and budget_flag("max_anchor_bytes") == "--max-anchor-bytes"
    )


TENSOR_PARALLEL = f"{ROOT}.serving.tensor_parallel"


def test_tensor_parallel_heads_are_decided_in_one_leaf_module():
    """Which KV heads a worker rank holds (``kv_head_range``) and the ranks' read-backs assembled into
    all heads (``RankAssembly``) are defined once, in ``serving/tensor_parallel.py``, a leaf that imports
    no hf_kvshare module and not vLLM (the fast lane tests it); the connector's sides use it."""
    tree = parsed(MODULES[TENSOR_PARALLEL])
    third = {
        alias.name.split(".")[0]
        for node in _import_nodes(tree)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert not imports_of(TENSOR_PARALLEL), f"{TENSOR_PARALLEL} imports {sorted(imports_of(TENSOR_PARALLEL))}"
    assert "vllm" not in third, f"{TENSOR_PARALLEL} imports vLLM"
    defined = {
        name
        for name in MODULES
        for node in walk(parsed(MODULES[name]))
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        and node.name in ("kv_head_range", "RankAssembly")
    }
    assert defined == {TENSOR_PARALLEL}, f"the ranks' heads are decided in {sorted(defined)}"
    for side in ("connector_worker", "connector_scheduler"):
        assert TENSOR_PARALLEL in imports_of(f"{ROOT}.serving.{side}"), f"serving/{side}.py does not use it"


def test_pipeline_parallel_ranks_and_layers_are_decided_in_the_same_leaf_module():
    """A worker's rank over stages and tensor-parallel ranks (``worker_rank``) and the pipeline size
    are defined once, in ``serving/tensor_parallel.py`` (beside ``RankAssembly``, which checks the layers
    each stage announces and routes a claim by them); the worker numbers itself with it and announces
    its layers, the scheduler routes by ``RankAssembly.layers`` (no slicing of a claim by layers of its
    own)."""
    defined = {
        name
        for name in MODULES
        for node in walk(parsed(MODULES[name]))
        if isinstance(node, ast.FunctionDef) and node.name in ("worker_rank", "pipeline_parallel_size")
    }
    assert defined == {TENSOR_PARALLEL}, f"the ranks' numbering is decided in {sorted(defined)}"
    worker = MODULES[f"{ROOT}.serving.connector_worker"].read_text()
    scheduler = MODULES[f"{ROOT}.serving.connector_scheduler"].read_text()
    assert "worker_rank(" in worker and "meta.layers = self.layers" in worker
    assert "self._assembly.layers(rank)" in scheduler and "self._assembly.announce(" in scheduler


#: the serving host's function that says why admission did not place a span
WHY_UNPLACED = (f"{ROOT}.serving.host", "_why_unplaced")


def returned_constants(tree: ast.Module, function: str) -> list[str]:
    """The module-level string constants (``NAME = "..."``) that ``function`` in ``tree`` returns for a
    PH span (a name returned directly or by a conditional expression; not under an ``if`` that tests
    for ``"PF"``, the agent's own text, which is not in rho), sorted."""
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and any(
                isinstance(c, ast.Constant) and c.value == "PF" for c in walk(child.test)
            ):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Return) and child.value is not None:
                value = child.value
                values = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
                found.extend(constants[v.id] for v in values if isinstance(v, ast.Name) and v.id in constants)
            visit(child)

    for node in walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            visit(node)
    return sorted(found)


def test_every_reason_the_serving_host_gives_names_a_cause():
    """An unplaced span's reason in a server report (``unplaced``) is read back by
    ``reasons.cause_of_reason``: each one the host can give names a cause (``evicted``, ``first``, ``not
    recorded yet``, ...), none is ``other``."""
    from hf_kvshare import reasons

    module, function = WHY_UNPLACED
    texts = returned_constants(parsed(MODULES[module]), function)
    assert len(texts) >= 3, f"{module}.{function} returns no reason constants: {texts}"
    bad = [t for t in texts if reasons.cause_of_reason(t) == "other"]
    assert not bad, f"reasons of unplaced spans that reasons.py does not classify: {bad}"


def test_the_returned_constant_finder_finds_them():
    tree = ast.parse(
        "A = 'a'\nB = 'b'\nC = 3\nD = 'd'\ndef f(x):\n    if x.kind == 'PF':\n        return D\n"
        "    if x:\n        return B\n    return A if x else C\n"
    )
    assert returned_constants(tree, "f") == ["a", "b"]


def connector_byte_keys(sources: dict[str, str]) -> dict[str, str]:
    """``{key: module}`` of each ``extra.get("<key>_bytes", ...)`` in ``sources`` (``{module: source}``):
    a byte budget a connector side reads from ``kv_connector_extra_config``."""
    found = {}
    for module, source in sources.items():
        for node in walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "extra"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).endswith("_bytes")
            ):
                found.setdefault(node.args[0].value, module)
    return found


def test_the_connectors_byte_budgets_are_documented():
    """A byte budget of the connector (the worker's device store and sent claims, the admission's plans
    decided ahead) is a ``kv_connector_extra_config`` key that docs/architecture.md names."""
    sources = {
        name: path.read_text() for name, path in MODULES.items() if name.startswith("hf_kvshare.serving.")
    }
    keys = connector_byte_keys(sources)
    assert {"device_store_bytes", "payload_bytes", "planned_bytes"} <= set(keys), keys
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = {key: module for key, module in keys.items() if f"`{key}`" not in docs}
    assert not missing, (
        f"byte budgets of kv_connector_extra_config not named in docs/architecture.md: {missing}"
    )
    assert connector_byte_keys({"m": "extra.get('a_bytes', 1)\nextra.get('b')\nother.get('c_bytes')\n"}) == {
        "a_bytes": "m"
    }


# ------------------------------------------------------------- the derived layout reads no client's wording
#: the function of ``serving/layout.py`` that makes the default layout, and what it may not call
DERIVE = ("hf_kvshare.serving.layout", "derive")
TEXT_READERS = frozenset({"decode", "tokenize", "encode", "batch_decode"})


def wording_reads(tree: ast.AST, function: str) -> list[str]:
    """Where ``function`` of ``tree`` reads a client's words: a call of a text reader
    (:data:`TEXT_READERS`), or a comparison with a string constant."""
    found = []
    for node in walk(tree):
        if not (isinstance(node, ast.FunctionDef) and node.name == function):
            continue
        for inner in walk(node):
            if isinstance(inner, ast.Call) and _name_of(inner.func) in TEXT_READERS:
                found.append(f"line {inner.lineno}: calls {_name_of(inner.func)}")
            if isinstance(inner, ast.Compare):
                sides = [inner.left, *inner.comparators]
                if any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides):
                    found.append(f"line {inner.lineno}: compares with a string")
    return found


def int_constant(tree: ast.Module, name: str) -> int | None:
    """The value of the top-level ``name = <int>`` of ``tree`` (``None`` when missing)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, int):
                return node.value.value
    return None


def test_the_derived_layout_decides_by_messages_roles_and_lengths_only():
    """Any chat client, no workload's wording: the default layout (``layout.derive``) decides on token
    ids, message boundaries and roles (``message_chunks``), never by decoding text or comparing it with a
    string; a whole message is a slot from ``MIN_MESSAGE_TOKENS`` tokens, a run inside one from
    ``MIN_SEGMENT_TOKENS`` (a message is a unit the client chose: never held to more than a run)."""
    module, function = DERIVE
    tree = parsed(MODULES[module])
    assert any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree.body), DERIVE
    assert not wording_reads(tree, function), wording_reads(tree, function)
    message, run = int_constant(tree, "MIN_MESSAGE_TOKENS"), int_constant(tree, "MIN_SEGMENT_TOKENS")
    assert message is not None and run is not None and 1 <= message <= run, (message, run)


def test_the_wording_finder_finds_them():
    tree = ast.parse(
        "def derive(p, tok):\n    t = tok.decode(p)\n    if t == 'Task:':\n        return 1\n"
        "    return 'x' in t\ndef other(tok):\n    return tok.decode([])\n"
    )
    assert wording_reads(tree, "derive") == [
        "line 2: calls decode",
        "line 3: compares with a string",
        "line 5: compares with a string",
    ]


#: what ``import hf_kvshare`` must not load: the optional heavy dependencies (seconds of CPU in every
#: fresh interpreter, a subprocess test or ``hf-kvshare --help``); transformers' generation module is
#: here because it imports accelerate (and, through accelerate, boto3) when they are installed
NOT_AT_IMPORT = (
    "accelerate",
    "bitsandbytes",
    "boto3",
    "datasets",
    "gguf",
    "matplotlib",
    "peft",
    "transformers.generation.utils",
    "vllm",
)


#: the modules a fresh interpreter starts from: the package, ``python -m hf_kvshare`` (``hf-kvshare``),
#: ``python -m hf_kvshare.bench`` and the serving wrapper (``hf-kvshare serve``'s process)
STARTING_MODULES = (
    "hf_kvshare",
    "hf_kvshare.__main__",
    "hf_kvshare.bench.__main__",
    "hf_kvshare.serving.server",
)


def test_importing_the_package_loads_no_optional_heavy_dependency():
    import subprocess
    import sys

    probe = (
        f"import sys; import {', '.join(STARTING_MODULES)}; "
        f"print(sorted(m for m in {NOT_AT_IMPORT!r} if sys.modules.get(m) is not None))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )
    assert out.stdout.strip() == "[]", (
        f"importing {STARTING_MODULES} loads {out.stdout.strip()} (import them where used)"
    )


def scratch_reads(tree: ast.AST) -> list[int]:
    """Lines reading a ``.scratch`` attribute (a turn's per-method scratch)."""
    return sorted({n.lineno for n in walk(tree) if isinstance(n, ast.Attribute) and n.attr == "scratch"})


def test_serving_reads_no_methods_turn_scratch():
    """The serving host learns why a method did not place a span from ``Method.why_not_placed``, not by
    reading the method's decisions in ``turn.scratch``."""
    bad = [
        f"{name}:{line}"
        for name, path in MODULES.items()
        if name.startswith(f"{ROOT}.serving")
        for line in scratch_reads(parsed(path))
    ]
    assert not bad, "serving modules reading a method's turn scratch:\n" + "\n".join(bad)
    assert scratch_reads(ast.parse("a = turn.scratch['x']\nb = scratch_cache\n")) == [1]


#: the serving functions that may read a slot's ``latest``: the store's bound (drops it), the record's
#: eviction marks (a slot kept again) and the store's byte accounting (``slot_storages``: the storages
#: the slots keep alive); every decision that a slot has K/V asks ``Sharing.has_kv``
LATEST_READERS = {"_bound", "_finish_request", "slot_storages"}


def latest_readers(tree: ast.AST) -> set[str]:
    """The functions of ``tree`` that read a ``.latest`` attribute (a function holding one that does too)."""
    return {
        node.name
        for node in walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(isinstance(n, ast.Attribute) and n.attr == "latest" for n in walk(node))
    }


def test_serving_asks_the_method_whether_a_slot_has_kv():
    """No serving module decides from a slot's ``latest`` whether it has K/V (a wait for a record, "not
    recorded yet"): it asks ``Sharing.has_kv`` (``Method.has_source``); only the store's bookkeeping reads it."""
    bad = {
        f"{name}.{function}"
        for name, path in MODULES.items()
        if name.startswith(f"{ROOT}.serving")
        for function in latest_readers(parsed(path)) - LATEST_READERS
    }
    assert not bad, f"serving functions reading a slot's latest K/V (ask Sharing.has_kv): {sorted(bad)}"
    assert latest_readers(ast.parse("def f(h):\n    return h.slots['a'].latest is None\n")) == {"f"}


SHARDED = f"{ROOT}.anchors.sharded"
#: collectives (``torch.distributed``'s and vLLM's group wrappers share these names)
COLLECTIVE_CALLS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "broadcast_object_list",
        "all_to_all",
        "all_to_all_single",
        "barrier",
    }
)


def distributed_uses(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that import ``torch.distributed``, name ``torch.distributed`` or call a collective."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.add(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (
            (node.module or "").startswith("torch.distributed")
            or (node.module == "torch" and any(a.name == "distributed" for a in node.names))
        ):
            lines.add(node.lineno)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.add(node.lineno)
        elif isinstance(node, ast.Call) and _name_of(node.func) in COLLECTIVE_CALLS:
            lines.add(node.lineno)
    return sorted(lines)


def test_only_the_sharded_engine_module_communicates_across_ranks():
    """The anchors engine's per-rank primitives (``anchors/sharded.py``) import no vLLM and no serving
    module (a worker passes vLLM's process group in), and no other module of the package uses
    ``torch.distributed`` or calls a collective: what the ranks exchange is decided in one place."""
    assert not {m for m in imports_of(SHARDED) if _inside(m, "serving")}, f"{SHARDED} imports serving"
    third = {
        alias.name.split(".")[0]
        for node in _import_nodes(parsed(MODULES[SHARDED]))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert "vllm" not in third, f"{SHARDED} imports vLLM"
    bad = [
        f"{name}:{line}"
        for name, path in MODULES.items()
        if name != SHARDED
        for line in distributed_uses(parsed(path))
    ]
    assert not bad, "torch.distributed used outside anchors/sharded.py:\n" + "\n".join(bad)
    assert distributed_uses(parsed(MODULES[SHARDED])), (
        "the finder no longer sees anchors/sharded.py's collectives"
    )


def test_the_distributed_use_finder_finds_them():
    source = (
        "import torch.distributed as dist\nfrom torch import distributed\nx = torch.distributed.get_rank()\n"
        "group.all_reduce(t)\nsender.send(t)\ny = torch.gather(t, 0, i)\n"
    )
    assert distributed_uses(ast.parse(source)) == [1, 2, 3, 4]


#: the anchors engine's reductions over ``D`` on the served path (KVCMAS / KVComm) and its factorizations:
#: each takes the engine's one shard context (``shard``) and reduces through ``anchors/lowrank.py``'s hooks
SHARD_AWARE = {
    f"{ROOT}.anchors.correction": ("gate_distances", "token_distances", "match", "guard_estimate"),
    f"{ROOT}.anchors.lowrank": (
        "FactoredKV.from_kv",
        "FactoredKV.from_layers",
        "DeferredFactoredKV.__init__",
        "relative_spread",
        "row_energy",
        "relative_distance",
    ),
    f"{ROOT}.anchors.pool": (
        "LRUDict.trim",
        "Anchor.measure",
        "Anchor.size",
        "AnchorPool.near_duplicate",
        "correction_agreement",
        "nearest_relative",
    ),
    f"{ROOT}.anchors.store": ("clamp_ranks",),
}
#: where ``anchors/`` calls ``from_matrix``: the ``factorize`` hook (a pipeline stage's, whose layers are
#: whole: the one-rank factors), and GraphFlow's profiles (not served)
OWN_FACTORIZATIONS = {
    (f"{ROOT}.anchors.lowrank", "factorize"),
    (f"{ROOT}.anchors.sharded", "StageShard.factors"),
    (f"{ROOT}.anchors.lowrank", "FactoredKV.from_matrices"),
}
#: the served scopes, whose layer-0 rule names the model's layer 0 (a later pipeline stage holds another)
LAYER_SCOPES = (f"{ROOT}.anchors.slot_scope", f"{ROOT}.anchors.edge_scope")


def functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef]]:
    """``(qualified name, definition)`` of the module's functions and its classes' methods."""
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def test_the_anchors_engine_reduces_over_the_heads_through_one_shard_context():
    """Every reduction over ``D`` of the served engine and every factorization takes ``shard`` (one
    context threaded from the store, exact to one rank under tensor parallel), and nothing in
    ``anchors/`` factorizes a matrix but through the ``factorize`` hook."""
    missing = []
    for module, names in SHARD_AWARE.items():
        defined = dict(functions(parsed(MODULES[module])))
        for name in names:
            args = defined[name].args if name in defined else None
            if args is None or "shard" not in [a.arg for a in (*args.args, *args.kwonlyargs)]:
                missing.append(f"{module}:{name}")
    assert not missing, "reductions over D without a shard parameter:\n" + "\n".join(missing)
    own = {
        (name, qualname)
        for name, path in MODULES.items()
        if name.startswith(f"{ROOT}.anchors.")
        for qualname, function in functions(parsed(path))
        if any(isinstance(n, ast.Call) and _name_of(n.func) == "from_matrix" for n in ast.walk(function))
    }
    assert own <= OWN_FACTORIZATIONS, f"factorized outside the factorize hook: {own - OWN_FACTORIZATIONS}"


def test_the_served_scopes_leave_the_models_layer_0_uncorrected_not_a_stages_first():
    """A correction told to leave layer 0 as placed (``skip_layer0``, indexed by the member's layers) is
    told so through ``Scope.skips_layer0`` (the option, on the member holding the model's layer 0 only):
    on a later pipeline stage its first layer is another (docs/architecture.md, "Pipeline stages")."""
    wrong = []
    for module in LAYER_SCOPES:
        for node in walk(parsed(MODULES[module])):
            if not isinstance(node, ast.Call):
                continue
            passed = [k.value for k in node.keywords if k.arg == "skip_layer0"]
            if _name_of(node.func) == "prefix_correction" and len(node.args) >= 7:
                passed.append(node.args[6])
            for value in passed:
                if not (isinstance(value, ast.Attribute) and value.attr == "skips_layer0"):
                    wrong.append(f"{module}:{node.lineno}")
    assert not wrong, "skip_layer0 passed as the option itself:\n" + "\n".join(wrong)


# ------------------------------------------------------------------- worker replicas (issue 51 items 1+2)
REPLICA = f"{ROOT}.serving.replica"
#: what drives a Sharing's engine (its calls that change it): on the worker side only the replica's
SHARING_DRIVERS = frozenset({"plan", "claim", "release", "record", "settle"})
#: the fields an op of the replicas' stream may carry (metadata: ids, token ids, the layout, counts,
#: decisions), never a tensor
OP_FIELDS = frozenset(
    {"request_id", "prompt", "params", "local_hit", "output_ids", "stop_ids", "decision", "final"}
    | {"deferred", "index"}  # a record's deferred parts' count, a settle's part
)


def test_only_the_replica_drives_a_worker_sharing_and_no_op_carries_a_tensor():
    """A worker rank's Sharing (its engine replica) is driven by ``serving/replica.py`` alone, in the op
    stream's order: the worker side calls none of a Sharing's driving methods itself; every op is built
    by ``OpStream.op`` from :data:`OP_FIELDS` (no tensor: ``OpStream.op`` refuses what is not JSON)."""
    worker = parsed(MODULES[f"{ROOT}.serving.connector_worker"])
    driven = {
        node.func.attr
        for node in walk(worker)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in SHARING_DRIVERS
        and "sharing" in ast.unparse(node.func.value).lower()
    }
    assert not driven, f"the worker side drives a Sharing itself: {sorted(driven)}"
    assert "Sharing" not in _callees(worker), "the worker side builds a Sharing (make_sharing does)"
    replica = parsed(MODULES[REPLICA])
    fields = {
        keyword.arg
        for node in walk(replica)
        if isinstance(node, ast.Call) and _name_of(node.func) == "op"
        for keyword in node.keywords
    }
    assert fields and fields <= OP_FIELDS, f"op fields beyond the metadata allowed: {fields - OP_FIELDS}"
    op = next(f for name, f in functions(replica) if name == "OpStream.op")
    assert "dumps" in _callees(op), "OpStream.op no longer checks that an op is JSON"


def test_only_the_sharded_module_handles_the_followers_meta_stand_ins():
    """The follower runs the engine's one code path: no module of ``anchors/`` but ``sharded.py`` makes or
    tests a ``meta`` tensor, and the pools' byte bound counts through ``bound_count``."""
    found = [
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        if name.startswith(f"{ROOT}.anchors.") and name != f"{ROOT}.anchors.sharded"
        for node in ast.walk(parsed(path))
        if (isinstance(node, ast.Attribute) and node.attr == "is_meta")
        or (isinstance(node, ast.Constant) and node.value == "meta")
    ]
    assert not found, "meta stand-ins handled outside anchors/sharded.py:\n" + "\n".join(found)
    trim = dict(functions(parsed(MODULES[f"{ROOT}.anchors.pool"])))["LRUDict.trim"]
    assert "bound_count" in {_name_of(n.func) for n in ast.walk(trim) if isinstance(n, ast.Call)}

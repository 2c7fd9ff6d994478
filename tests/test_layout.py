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
  near-duplicate test, the distances they read); its hooks drive a scope that does;
- results (``docs/architecture.md``, "Results and benchmarks"): no module under ``hf_kvshare`` cites a
  ``docs/results/...py`` script; ``docs/results`` stays a few pages and small summaries (at most
  :data:`RESULTS_MAX_FILES` files, none over :data:`RESULTS_MAX_BYTES`); the scripts in ``benchmarks/``
  use the public API only (no private ``hf_kvshare`` name, no ``setattr``).
"""

from __future__ import annotations

import ast
import re
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
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
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
    return found


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
        "token_distances",
        "usage_reference",
        "usage_crossing",
    }
)


def _decision_calls(tree: ast.AST) -> list[str]:
    """The names in :data:`ENGINE_DECISIONS` that ``tree`` calls (``f(...)`` or ``x.f(...)``)."""
    found = []
    for node in ast.walk(tree):
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
        if _inside(name, "methods") and (found := _decision_calls(ast.parse(path.read_text())))
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
        for node in ast.walk(tree)
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
        tree = ast.parse(path.read_text(), filename=str(path))
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
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
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
    classes = [
        (module, node)
        for module, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]
    known, found = set(STORAGE_BASES), {}
    changed = True
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
    for node in ast.walk(tree):
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
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}
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
#: serving modules that may import vLLM (the connector and its paged-cache access); the others (layout,
#: host, middleware, server, models) import without vLLM, so the main suite tests them
SERVING_VLLM = {f"{ROOT}.serving.connector", f"{ROOT}.serving.paged"}


def _top_imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in _import_nodes(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if isinstance(node, ast.ImportFrom) and node.level:
            continue
        found.update(n.split(".")[0] for n in names)
    return found


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
    ]
    assert not bad, "serving modules importing engines / session / evaluation / bench:\n" + "\n".join(bad)
    users = sorted(
        m
        for m, targets in edges.items()
        if not _inside(m, SERVING) and any(_inside(t, SERVING) for t in targets)
    )
    drivers = [m for m in users if m != f"{ROOT}.cli" and not _inside(m, "bench")]
    assert not drivers, f"modules outside serving importing it (only the CLI and the bench may): {drivers}"
    vllm = sorted(
        m
        for m in serving
        if m not in SERVING_VLLM
        and "vllm" in _top_imports(ast.parse(MODULES[m].read_text(), filename=str(MODULES[m])))
    )
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
    for node in ast.walk(tree):
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
    bad = [
        f"{path.name}: {use}"
        for path in scripts
        for use in private_uses(ast.parse(path.read_text(), filename=str(path)))
    ]
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

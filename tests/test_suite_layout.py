"""The test suite's own layout rules, checked on its source (AST only; docs/architecture.md, "Tests").

- a test module is named by its subject (what it tests), not after the issue or the review that added
  it: no ``issue`` / ``hardening`` / ``review`` in the name, no bare number as a name part;
- a helper is written once: no top-level function or class (other than a test) of five or more lines
  stands, identical, in two modules under ``tests/`` (it belongs in a helper module: ``tiny.py``,
  ``vision_helpers.py``, ``adversarial.py``, ``bench_helpers.py``, ...; fixtures in ``conftest.py``);
- no module under ``tests/`` imports a test module (``test_*.py``), not even inside a function (a helper's
  ``if __name__ == "__main__":`` script excepted): what two modules share is a helper module's (a test
  module imported by another brings its fixtures, marks and module-level set-up into the importer);
- the connector's stand-ins are written once (``serving_stand_ins.py``: a worker's announcement, a worker
  over stand-in paged caches, a ``deliver`` recorder) and the serving lane's live server of the vLLM and
  tensor-parallel modules starts through ``live_server.py``;
- the fast lane is one marker expression: README's fast-lane command and ``.ci/run``'s run on the floor
  transformers deselect the embedded-model and gloo-rank tests with the same
  ``-m "not real_model and not gloo_ranks"``; every fixture that spawns gloo ranks (calls ``run_ranks`` or
  ``rank_runs``) is decorated ``spawns_ranks``, so that its tests are marked ``gloo_ranks``;
- the live parallel shapes are one parametrized pair: ``test_serving_tp.py``'s live checks take the module
  fixture ``parallel_server``, parametrized by ``PARALLEL_SHAPES`` (one server at a time); no test or
  fixture starts a shape of its own.
- collecting the tests imports no optional heavy package (PEFT, bitsandbytes, datasets) at module level.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: what names a test module after its history rather than its subject
HISTORY_NAME = re.compile(r"issue|hardening|review|(?:^test|_)\d+(?:_|$)")
#: a copied helper shorter than this (unparsed lines) is let be (a one-line fixture, a tiny wrapper)
MIN_HELPER_LINES = 5


@functools.cache
def parsed(source: str) -> ast.Module:
    """The syntax tree of ``source``, parsed once per process (the rules below read every test module)."""
    return ast.parse(source)


def history_named(names: list[str]) -> list[str]:
    """The test module names (``test_*.py``) among ``names`` that name an issue, not a subject."""
    return [n for n in names if n.startswith("test_") and HISTORY_NAME.search(Path(n).stem)]


def copied_helpers(sources: dict[str, str]) -> list[list[str]]:
    """Groups of ``module:name`` whose top-level (non-test) function or class is the same code in two
    or more modules of ``sources`` (``{module name: source}``), each of at least MIN_HELPER_LINES."""
    by_code: dict[str, list[str]] = {}
    for module, source in sorted(sources.items()):
        for node in parsed(source).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("test_") or len(ast.unparse(node).splitlines()) < MIN_HELPER_LINES:
                continue
            by_code.setdefault(ast.dump(node), []).append(f"{module}:{node.name}")
    return [places for places in by_code.values() if len({p.split(":")[0] for p in places}) > 1]


def test_test_modules_are_named_by_subject():
    bad = history_named(sorted(p.name for p in TESTS.glob("test_*.py")))
    assert not bad, f"test modules named after their history, not their subject: {bad}"


def test_no_helper_is_copied_between_test_modules():
    sources = {p.name: p.read_text() for p in sorted(TESTS.glob("*.py"))}
    copies = copied_helpers(sources)
    assert not copies, "helpers copied between test modules (move them to a helper module):\n" + "\n".join(
        ", ".join(group) for group in copies
    )


def _outside_main(tree: ast.AST):
    """Every node of ``tree`` but those of its ``if __name__ == "__main__":`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            for other in node.orelse:
                yield other
                yield from _outside_main(other)
            continue
        yield node
        yield from _outside_main(node)


def imported_test_modules(sources: dict[str, str]) -> list[str]:
    """``module:line test_module`` of each import, at any depth, of a test module (``test_*``) in ``sources``
    (outside ``if __name__ == "__main__":`` blocks: a helper run as a script may gather the tests' cases)."""
    found = []
    for module, source in sorted(sources.items()):
        for node in _outside_main(parsed(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{module}:{node.lineno} {n}" for n in names if n.split(".")[0].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    sources = {p.name: p.read_text() for p in sorted(TESTS.glob("*.py"))}
    found = imported_test_modules(sources)
    assert not found, (
        f"test modules imported by other modules (move what they share to a helper module): {found}"
    )
    cases = {
        "test_a.py": "from test_b import helper\nimport tiny\n",
        "test_c.py": "def test_x():\n    import test_d as d\n    from tiny import tiny_model\n",
        "tiny.py": "from test_e import x\nfrom testing import y\n",
        "adversarial.py": "if __name__ == '__main__':\n    import test_f\nelse:\n    import test_g\n",
    }
    assert imported_test_modules(cases) == [
        "adversarial.py:4 test_g",
        "test_a.py:1 test_b",
        "test_c.py:2 test_d",
        "tiny.py:1 test_e",
    ]


def test_the_finders_find_them():
    assert history_named(["test_hardening.py", "test_issue26.py", "test_26_items.py", "tiny.py"]) == [
        "test_hardening.py",
        "test_issue26.py",
        "test_26_items.py",
    ]
    assert history_named(["test_real_gemma3.py", "test_vision_mrope.py", "test_bad_session_input.py"]) == []
    helper = "def strip(ids):\n    ids = list(ids)\n    while ids and ids[-1] == 2:\n        ids.pop()\n    return ids\n"
    short = "def two():\n    return 2\n"
    sources = {"a.py": helper + short, "b.py": short + helper, "c.py": "def test_x():\n    pass\n"}
    assert copied_helpers(sources) == [["a.py:strip", "b.py:strip"]]


#: what the fast lane leaves out: the embedded-model tests and those that spawn gloo ranks (conftest marks both)
FAST_LANE_MARKERS = "not real_model and not gloo_ranks"
#: the fast lane's marker expression, in a pytest command line of README.md or .ci/run
FAST_LANE = re.compile(r"""pytest[^\n]*-m\s+["']([^"']+)["']""")


def fast_lane_expressions(text: str) -> set[str]:
    """The ``-m`` expressions of the pytest command lines in ``text`` that deselect the embedded-model tests."""
    return {m for m in FAST_LANE.findall(text) if "real_model" in m}


def test_the_fast_lane_is_one_marker_expression():
    """README's fast-lane command and .ci/run's fast lane (on the floor transformers) select the same tests."""
    root = TESTS.parent
    readme = fast_lane_expressions((root / "README.md").read_text())
    ci = fast_lane_expressions((root / ".ci" / "run").read_text())
    assert readme == ci == {FAST_LANE_MARKERS}, (readme, ci)


def test_the_fast_lane_finder_finds_it():
    text = f'python -m pytest -q -m "{FAST_LANE_MARKERS}" -n 2\npython -m pytest -m serving tests/x.py\n'
    assert fast_lane_expressions(text) == {FAST_LANE_MARKERS}


#: the calls that spawn gloo ranks (tests/gloo_ranks.py, tests/anchors_trajectory.py)
SPAWNS = {"run_ranks", "rank_runs"}


def unmarked_spawning_fixtures(sources: dict[str, str]) -> list[str]:
    """``module:fixture`` of each fixture (a function decorated ``pytest.fixture``) that calls one of
    :data:`SPAWNS` and is not decorated ``spawns_ranks``."""
    found = []
    for name, source in sources.items():
        for node in ast.walk(parsed(source)):
            if not isinstance(node, ast.FunctionDef):
                continue
            decorators = {ast.unparse(d) for d in node.decorator_list}
            if not any("fixture" in d for d in decorators) or "spawns_ranks" in decorators:
                continue
            calls = {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}
            if calls & SPAWNS:
                found.append(f"{name}:{node.name}")
    return found


def test_every_fixture_that_spawns_gloo_ranks_marks_its_tests():
    sources = {p.name: p.read_text() for p in sorted(TESTS.glob("*.py"))}
    unmarked = unmarked_spawning_fixtures(sources)
    assert not unmarked, (
        f"fixtures that spawn gloo ranks without @spawns_ranks (the fast lane would run them): {unmarked}"
    )


def test_the_spawning_fixture_finder_finds_them():
    spawning = "import pytest\n\n@pytest.fixture(scope='module')\n{}def ranks(f):\n    return run_ranks(main, 2, f)\n"
    assert unmarked_spawning_fixtures({"a.py": spawning.format("")}) == ["a.py:ranks"]
    assert unmarked_spawning_fixtures({"a.py": spawning.format("@spawns_ranks\n")}) == []


#: the connector's stand-ins, written once (tests/serving_stand_ins.py): a worker's announcement to the
#: scheduler (``Captured(orders=...)`` without K/V) and a worker over stand-in paged caches (a ``do_kv_cache_update``)
STAND_IN_KEYWORDS = {"Captured": "orders", "SimpleNamespace": "do_kv_cache_update"}
STAND_INS = "serving_stand_ins.py"


def stand_ins_built_again(sources: dict[str, str]) -> list[str]:
    """``module:line`` of each call in ``sources`` (other than :data:`STAND_INS`) that builds a stand-in
    of :data:`STAND_IN_KEYWORDS` itself instead of calling the helper module."""
    found = []
    for module, source in sorted(sources.items()):
        if module == STAND_INS:
            continue
        for node in ast.walk(parsed(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                keywords = {k.arg for k in node.keywords}
                if name in STAND_IN_KEYWORDS and STAND_IN_KEYWORDS[name] in keywords and "kv" not in keywords:
                    found.append(f"{module}:{node.lineno}")  # a step output with K/V is what a test checks
    return found


def test_the_connectors_stand_ins_are_written_once():
    """The channel, worker-store and tensor-parallel tests announce a worker and build one over stand-in
    caches through tests/serving_stand_ins.py (``announce_worker(scheduler, rank=...)``,
    ``stand_in_worker``), and their live servers start through tests/live_server.py."""
    sources = {p.name: p.read_text() for p in sorted(TESTS.glob("*.py")) if p.name != Path(__file__).name}
    again = stand_ins_built_again(sources)
    assert not again, f"stand-ins built again (use tests/{STAND_INS}): {again}"
    assert stand_ins_built_again(
        {"a.py": "Captured(orders=x, rank=1)\n", STAND_INS: "Captured(orders=x)\n"}
    ) == ["a.py:1"]
    for module in ("test_serving_vllm.py", "test_serving_tp.py"):
        assert "wait_ready" not in sources[module], (
            f"{module} starts its server itself (tests/live_server.py)"
        )


#: the functions of tests/test_serving_tp.py that start its live servers or ask its fixture for one
SHAPE_STARTERS = ("_start", "parallel_server")


def shapes_written_per_test(source: str) -> list[str]:
    """The places (``line``) in a serving-lane module's ``source`` that start a server at a literal number of
    ranks above one (``_start(2, ...)``, ``parallel_server(1, pp=2)``): each parallel shape is an entry of
    ``PARALLEL_SHAPES``, which the one parametrized fixture starts, not a test or fixture of its own."""
    found = []
    for node in ast.walk(parsed(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in SHAPE_STARTERS:
            values = [*node.args, *(k.value for k in node.keywords)]
            if any(isinstance(v, ast.Constant) and type(v.value) is int and v.value > 1 for v in values):
                found.append(str(node.lineno))
    return found


def test_the_live_parallel_shapes_are_one_parametrized_pair():
    """tests/test_serving_tp.py's live checks (FullShared == one rank; exact mode == plain vLLM) are
    written once over ``PARALLEL_SHAPES``: its server is the module fixture ``parallel_server``
    parametrized by them (pytest stops one shape's server before it starts the next's)."""
    source = (TESTS / "test_serving_tp.py").read_text()
    again = shapes_written_per_test(source)
    assert not again, f"test_serving_tp.py starts a parallel shape of its own at lines {again}"
    assert "params=PARALLEL_SHAPES" in source
    assert (
        shapes_written_per_test("def f(get):\n    _start(1, x)\n    get(2)\n    _start(tp, x, pp=pp)\n") == []
    )
    assert shapes_written_per_test("_start(2, x)\nparallel_server(1, pp=2)\n") == ["1", "2"]


#: optional heavy packages a test process need not load to collect the tests: PEFT loads bitsandbytes
#: (~2 CPU-s), datasets pyarrow; each is imported inside the test or helper that uses it
NOT_AT_COLLECTION = ("peft", "bitsandbytes", "datasets")


def imported_at_collection(sources: dict[str, str]) -> list[str]:
    """``module:line`` of each module-level import in ``sources`` of a package of :data:`NOT_AT_COLLECTION`
    (``if TYPE_CHECKING:`` blocks excepted: they never run)."""
    found = []
    for module, source in sorted(sources.items()):
        for node in parsed(source).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n.split(".")[0] in NOT_AT_COLLECTION for n in names):
                found.append(f"{module}:{node.lineno}")
    return found


def test_optional_heavy_packages_are_not_imported_at_collection():
    """The fast lane's budget: collecting the tests loads neither PEFT nor bitsandbytes nor datasets."""
    sources = {p.name: p.read_text() for p in sorted(TESTS.glob("*.py"))}
    found = imported_at_collection(sources)
    assert not found, f"import these inside the tests or helpers that use them: {found}"
    cases = {
        "a.py": "from peft import LoraConfig\nimport torch\n",
        "b.py": "def f():\n    import peft\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from peft import LoraConfig\n",
        "d.py": "import bitsandbytes.nn as bnn\nfrom datasets import load_dataset\n",
    }
    assert imported_at_collection(cases) == ["a.py:1", "d.py:1", "d.py:2"]

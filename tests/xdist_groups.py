"""Test helper: a test's xdist group where xdist's loadgroup scheduler reads it (tests/conftest.py).

The scheduler reads a test's group from its node id's ``@group`` suffix, which pytest-xdist (3.8) writes
to ``item._nodeid`` at collection. pytest >= 9.2 builds node ids from ``item._id`` and no longer reads
that field (pytest-xdist issue 1386): the groups were lost without a word, and every module-scoped
fixture of a grouped module was built on both workers (the floor fast lane's rise at 6201166). Where the
suffix is missing it is written to the field this pytest reads; both fields are pytest's private ones,
so tests/test_suite_grouping.py checks the result where xdist reads it."""

from __future__ import annotations


def group_of(item) -> str | None:
    """The group xdist's loadgroup gives ``item`` (its ``xdist_group`` marks' names, joined), or None."""
    names = {
        str(m.args[0] if m.args else m.kwargs.get("name", "default"))
        for m in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names)) or None


def set_node_id(item, nodeid: str) -> None:
    """Make ``item.nodeid`` read ``nodeid`` (a structured id on pytest >= 9.2, a string before)."""
    if hasattr(item, "_id"):
        item._id = type(item._id).parse(nodeid)
    else:
        item._nodeid = nodeid


def carry_the_group_in_the_node_id(item) -> None:
    """End ``item``'s node id with ``@`` and its group, unless it has no group or the suffix is there."""
    group = group_of(item)
    if group is not None and not item.nodeid.endswith(f"@{group}"):
        set_node_id(item, f"{item.nodeid}@{group}")

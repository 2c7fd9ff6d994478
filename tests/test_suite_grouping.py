"""The suite's xdist groups take effect (docs/architecture.md, "Tests"): under ``-n 2 --dist loadgroup``
(.ci/run) the tests of a module that use one of its module-scoped fixtures carry the module's group in
their node id, where xdist's loadgroup scheduler reads it, so the fixture is built on one worker only.
pytest 9.2 stopped reading the field xdist writes the group to and the groups were lost without a word
(xdist_groups.py restores them); this module fails if they are lost again."""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadGroupScheduling
from xdist_groups import carry_the_group_in_the_node_id, set_node_id


def _scheduled_unit(nodeid: str) -> str:
    """The work unit xdist's loadgroup scheduler puts ``nodeid`` in (the tests of a unit share a worker)."""
    return LoadGroupScheduling._split_scope(None, nodeid)


@pytest.fixture(scope="module")
def built_once() -> list[str]:
    return ["a module-scoped fixture"]


def test_a_module_fixtures_tests_are_scheduled_as_one_unit(request, built_once):
    """On a loadgroup worker this test (it takes a module-scoped fixture) is in its module's unit; run
    without xdist it is its own unit and its node id is pytest's."""
    nodeid = request.node.nodeid
    if getattr(request.config.option, "loadgroup", False):
        assert nodeid.endswith("@test_suite_grouping")
        assert _scheduled_unit(nodeid) == "test_suite_grouping"
    else:
        assert "@" not in nodeid
        assert _scheduled_unit(nodeid) == nodeid


@pytest.mark.xdist_group("named_here")
def test_a_test_that_names_its_group_keeps_it(request, built_once):
    """A test marked with its own ``xdist_group`` (a group shared with another module) keeps that group,
    module-scoped fixture or not."""
    nodeid = request.node.nodeid
    if getattr(request.config.option, "loadgroup", False):
        assert nodeid.endswith("@named_here")
        assert _scheduled_unit(nodeid) == "named_here"
    else:
        assert _scheduled_unit(nodeid) == nodeid


@pytest.mark.parametrize("case", ["a", "b@c"])
def test_the_group_is_written_where_this_pytest_reads_the_node_id(request, case):
    """A test given an ``xdist_group`` mark gets the ``@group`` suffix, once, in the node id this pytest
    reports, and xdist schedules it in that group; an ``@`` inside a parameter is no group."""
    item = request.node
    original = item.nodeid
    assert _scheduled_unit(original) == original
    item.add_marker(pytest.mark.xdist_group("the_group"))
    try:
        carry_the_group_in_the_node_id(item)
        carry_the_group_in_the_node_id(item)
        assert item.nodeid == f"{original}@the_group"
        assert _scheduled_unit(item.nodeid) == "the_group"
    finally:
        item.own_markers.pop()
        set_node_id(item, original)
    assert item.nodeid == original

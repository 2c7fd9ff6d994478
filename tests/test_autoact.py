"""The generated AutoAct-style world, gold trajectories and training examples."""

from __future__ import annotations

import random

import pytest

from hf_kvshare.bench.workloads.autoact_world import ROLES, Episode, World, gold_turns, training_examples


def test_world_is_reproducible_and_pages_hold_the_facts():
    a, b = World.generate(seed=3), World.generate(seed=3)
    assert a.countries == b.countries and a.cities == b.cities
    assert World.generate(seed=4).countries != a.countries
    country = next(iter(a.countries.values()))
    city = a.cities[country.capital]
    assert f"Its capital is {country.capital}." in a.page(country.name)
    assert f"founded in {city.founded}" in a.page(city.name)
    assert a.page("Nowhere").startswith("Could not find [Nowhere]")


@pytest.mark.parametrize("kind,size", [("compare", 1), ("compare", 3), ("chain", 2)])
def test_gold_trajectory_answers_the_question(kind, size):
    world = World.generate(seed=0)
    question = world.question(kind, size, random.Random(1))
    turns = gold_turns(world, question)
    acts = [t.output for t in turns if t.agent == "act"]
    assert acts == [f"Action: Lookup[{hop}]" for hop in question.hops]
    assert turns[-1].agent == "reflect" and turns[-1].output.endswith(f"Answer: {question.answer}")
    assert turns[0].instruction.startswith("<|im_start|>system") and question.text in turns[0].instruction
    # every observation shown is the page of the hop looked up just before
    last_lookup = None
    for turn in turns:
        if turn.observation is not None:
            assert turn.observation == world.page(last_lookup)
        if turn.agent == "act":
            last_lookup = turn.output[len("Action: Lookup[") : -1]
    assert sum(t.observation is not None for t in turns) >= len(question.hops)
    with pytest.raises(ValueError, match="kind"):
        world.question("riddle", 2, random.Random(0))


def test_training_examples_cover_every_role():
    examples = list(training_examples(World.generate(seed=0), questions=10))
    assert {role for role, _, _ in examples} == set(ROLES)
    for _, context, target in examples:
        assert context.endswith("<|im_start|>assistant\n") and target.endswith("<|im_end|>")


def test_episode_lays_out_the_shared_trajectory():
    episode = Episode()
    first = episode.segments("instruction text")
    assert [s.slot for s in first] == ["instruction0"] and first[0].text == "instruction text"
    episode.add("plan")
    second = episode.segments("next")
    assert [s.slot for s in second] == ["instruction0", "plan", "instruction1"]
    assert second[0].text is None  # earlier slots are referenced, not re-given

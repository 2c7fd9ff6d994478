"""An AutoAct-style plan -> act -> reflect workload over a generated knowledge base (no downloads).

AutoAct (Qiao et al., 2024) splits an agent into three role-specific LoRA agents: a *plan*
agent thinks about the next step, an *act* agent emits a tool call, the environment returns an
observation, and a *reflect* agent either continues or answers. Here the tool is ``Lookup[name]``
over a small fictional world generated from a seed (countries, capitals, founding years,
rivers), so the model cannot answer from memory and every run is reproducible offline.

All agents read one shared trajectory; each turn appends the agent's instruction (with the
latest observation) and its output (:class:`Episode`).

>>> import random
>>> world = World.generate(seed=0)
>>> question = world.question(kind="compare", size=3, rng=random.Random(1))
>>> [turn.agent for turn in gold_turns(world, question)][:5]
['plan', 'act', 'plan', 'act', 'reflect']
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from ...trajectory import PH

ROLES = ("plan", "act", "reflect")
#: sentences of filler per ``Lookup`` page in the role adapters' training episodes (:mod:`hf_kvshare.bench.train_roles`)
TRAINING_FILLER = 2

SYSTEM = (
    "<|im_start|>system\nYou are one of three agents (plan, act, reflect) that answer a multi-hop question "
    "together. The only tool is Lookup[name], which returns the encyclopedia page of a country or a city."
    "<|im_end|>\n"
)
INSTRUCTIONS = {
    "plan": "Plan agent: think about what is still missing and which page to look up next.",
    "act": "Act agent: give the next tool call, exactly as Action: Lookup[name].",
    "reflect": "Reflect agent: sum up the facts found; give the answer if you can, otherwise say what to do next.",
}

_SYLLABLES = "ka lo ri ve ta mor sen du ar el vin sa to ber na quo li es dra fen gal hu iro jas".split()
_REGIONS = ["northern", "southern", "eastern", "western", "central", "coastal", "alpine"]
_LANDMARKS = ["old bridge", "stone tower", "royal library", "harbour gate", "glass market", "red cathedral"]
_FILLER = [
    "The climate is mild in summer and wet in winter, with strong winds from the sea in autumn.",
    "Farming, weaving and the trade in salt and timber have shaped the local economy for centuries.",
    "Travellers often mention the long market streets, the music festivals and the bread baked with honey.",
    "Several small museums keep records of old maps, coins and letters written by early merchants.",
    "A railway line opened in the last century and connects the region with the neighbouring valleys.",
    "Schools teach two languages, and many families keep gardens with apple trees and beehives.",
    "The local council meets every spring to decide on roads, bridges and the care of the forests.",
    "Fishing boats leave before dawn, and the evening fish market is one of the busiest places in town.",
]


@dataclass
class Country:
    name: str
    capital: str
    north: str
    region: str
    language: str


@dataclass
class City:
    name: str
    country: str
    founded: int
    river: str
    landmark: str
    population: int


@dataclass
class World:
    """Countries with capitals (and which country lies to their north), and capital cities."""

    countries: dict[str, Country]
    cities: dict[str, City]
    filler: int = 4  # extra sentences per page (observation length)

    @classmethod
    def generate(cls, seed: int = 0, size: int = 24, filler: int = 4) -> World:
        rng = random.Random(seed)
        names: set[str] = set()

        def fresh(parts: int) -> str:
            while True:
                n = "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()
                if n not in names:
                    names.add(n)
                    return n

        country_names = [fresh(3) for _ in range(size)]
        countries, cities = {}, {}
        for i, c in enumerate(country_names):
            capital = fresh(2)
            countries[c] = Country(
                name=c,
                capital=capital,
                north=country_names[(i + 1) % size],
                region=rng.choice(_REGIONS),
                language=fresh(2) + "ic",
            )
            cities[capital] = City(
                name=capital,
                country=c,
                founded=rng.randrange(800, 1900),
                river=fresh(2),
                landmark=rng.choice(_LANDMARKS),
                population=rng.randrange(20, 900) * 1000,
            )
        return cls(countries, cities, filler)

    def page(self, name: str) -> str:
        """The encyclopedia page ``Lookup[name]`` returns."""
        rng = random.Random(name)  # the same page every time
        filler = " ".join(rng.sample(_FILLER, k=min(self.filler, len(_FILLER))))
        if name in self.countries:
            c = self.countries[name]
            return (
                f"{c.name} is a country in the {c.region} part of the continent. Its capital is {c.capital}. "
                f"People there speak {c.language}. To the north, {c.name} borders {c.north}. {filler}"
            )
        if name in self.cities:
            t = self.cities[name]
            return (
                f"{t.name} is the capital of {t.country}. It was founded in {t.founded} on the banks of the "
                f"{t.river} river. About {t.population} people live there, and its best-known sight is the "
                f"{t.landmark}. {filler}"
            )
        close = sorted(self.countries)[:3]
        return f"Could not find [{name}]. Similar: {', '.join(close)}."

    def question(self, kind: str, size: int, rng: random.Random) -> Question:
        """A multi-hop question: ``"compare"`` the founding years of ``size`` capitals, or ``"chain"``:
        the river of the capital ``size`` countries to the north."""
        if size < 1:
            raise ValueError(f"question size must be >= 1; got {size}")
        if kind == "compare":
            picked = rng.sample(sorted(self.countries), size)
            hops = [h for c in picked for h in (c, self.countries[c].capital)]
            oldest = min(picked, key=lambda c: self.cities[self.countries[c].capital].founded)
            if size == 1:
                capital = self.cities[self.countries[picked[0]].capital]
                return Question(
                    f"In which year was the capital of {picked[0]} founded?", hops, str(capital.founded)
                )
            text = (
                "Which of these capitals was founded first: the capital of "
                + ", the capital of ".join(picked[:-1])
                + f" or the capital of {picked[-1]}?"
            )
            return Question(text, hops, answer=self.countries[oldest].capital)
        if kind == "chain":
            start = rng.choice(sorted(self.countries))
            hops, c = [], start
            for _ in range(size):
                hops.append(c)
                c = self.countries[c].north
            hops += [c, self.countries[c].capital]
            where = "directly north of" if size == 1 else f"{size} countries north of"
            text = f"Which river flows through the capital of the country {where} {start}?"
            return Question(text, hops, answer=self.cities[self.countries[c].capital].river)
        raise ValueError(f"question kind must be 'compare' or 'chain'; got {kind!r}")

    def fact(self, name: str) -> str:
        """The one sentence of ``name``'s page that matters for the questions."""
        if name in self.countries:
            c = self.countries[name]
            return f"the capital of {c.name} is {c.capital} and {c.north} lies to its north"
        t = self.cities[name]
        return f"{t.name} was founded in {t.founded} on the {t.river}"


@dataclass
class Question:
    text: str
    hops: list[str]  # the pages to look up, in order
    answer: str


@dataclass
class GoldTurn:
    """One agent turn of a reference trajectory: the instruction it gets and a good output."""

    agent: str
    instruction: str
    output: str
    observation: str | None = None  # the observation shown in the instruction, if any


def instruction(agent: str, observation: str | None = None, first: bool = False, question: str = "") -> str:
    """The text a turn appends before the agent's output (chat markup of SmolLM2-Instruct)."""
    head = SYSTEM + f"<|im_start|>user\nQuestion: {question}\n" if first else "<|im_end|>\n<|im_start|>user\n"
    obs = f"Observation: {observation}\n" if observation else ""
    return f"{head}{obs}{INSTRUCTIONS[agent]}<|im_end|>\n<|im_start|>assistant\n"


def gold_turns(world: World, question: Question, reflect_every: int = 2) -> list[GoldTurn]:
    """The reference plan/act(/observe)/reflect trajectory for ``question`` (training data, and the
    environment's observations in the benchmark)."""
    turns: list[GoldTurn] = []
    observation: str | None = None
    facts: list[str] = []
    for i, hop in enumerate(question.hops):
        need = "the capital" if hop in world.countries else "the founding year and river"
        plan = instruction("plan", observation, first=i == 0, question=question.text)
        thought = f"Thought: I still need {need} of {hop}, so I will look up {hop}."
        turns.append(GoldTurn("plan", plan, thought, observation))
        turns.append(GoldTurn("act", instruction("act"), f"Action: Lookup[{hop}]"))
        observation = world.page(hop)
        facts.append(world.fact(hop))
        last = i == len(question.hops) - 1
        if last or (i + 1) % reflect_every == 0:
            summary = "; ".join(facts[-reflect_every:])
            if last:
                out = f"Reflection: {summary}. Answer: {question.answer}"
            else:
                out = f"Reflection: {summary}. Not done yet: continue with {question.hops[i + 1]}."
            turns.append(GoldTurn("reflect", instruction("reflect", observation), out, observation))
            observation = None
    return turns


@dataclass
class Episode:
    """Lays out a trajectory's turns for a PReCache session: ``segments(instruction)`` is the trajectory
    so far as PH slots plus the new instruction as a new PH slot; ``add(output_slot)`` appends both."""

    history: list[PH] = field(default_factory=list)
    step: int = 0

    def segments(self, text: str) -> list[PH]:
        return [*self.history, PH(f"instruction{self.step}", text)]

    def add(self, output_slot: str) -> None:
        self.history += [PH(f"instruction{self.step}"), PH(output_slot)]
        self.step += 1


def training_examples(world: World, questions: int, seed: int = 0) -> Iterator[tuple[str, str, str]]:
    """``(role, context, target)`` triples from gold trajectories (context = the trajectory so far
    plus the role's instruction; target = the gold output closed by ``<|im_end|>``)."""
    rng = random.Random(seed)
    for _ in range(questions):
        kind = rng.choice(["compare", "chain"])
        question = world.question(kind, rng.choice([2, 3]) if kind == "compare" else rng.choice([1, 2]), rng)
        context = ""
        for turn in gold_turns(world, question):
            context += turn.instruction
            yield turn.agent, context, turn.output + "<|im_end|>"
            context += turn.output

"""A stress workload in which FullShared visibly degrades on the embedded model: long, very different
agent prefixes in plain layout, a multi-hop chain, prompts that end on shared content. Why each
of them matters: ``docs/workloads.md`` ("The stress workload").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Workload, register_workload
from .spec import AgentSpec, SlotSpec, StepSpec, TaskSpec

PERSONAS = [
    (
        "historian",
        "You are a meticulous historian of medieval Europe. You relate every request to events of the "
        "twelfth and thirteenth centuries: monasteries, merchant guilds, kings, famines and the plague. "
        "You write long, formal sentences, cite chronicles by name, never use lists, never write code, "
        "and always end with a moral drawn from history. When asked about the present, you first describe"
        " how a medieval town would have handled the same question, which guild would have been in "
        "charge, and what the chroniclers wrote about similar disputes. You distrust modern numbers and "
        "prefer the testimony of monks and merchants.",
    ),
    (
        "poet",
        "You are a poet who only writes short rhyming verse in the style of nursery rhymes. Whatever you "
        "are given, you turn it into rhyming lines about a farmyard: cows, hens, a sleepy dog and a "
        "clever cat. You never explain yourself, never mention numbers, and never break the rhythm. Each "
        "verse has four short lines, the second and fourth lines rhyme, and the cat always gets the last "
        "word. If someone asks for facts you answer with a riddle instead, and if someone asks for a plan"
        " you sing about the seasons on the farm.",
    ),
    (
        "lawyer",
        "You are a contract lawyer. You read everything as a legal agreement: you name the parties, their"
        " obligations and liabilities, and you warn about clauses that could be disputed in court. You "
        "write in numbered legal paragraphs and use the words hereinafter, whereas and notwithstanding. "
        "Before any advice you state that the following does not constitute legal advice, define every "
        "term in capital letters, and list the governing law and the jurisdiction. You end each answer "
        "with a clause on termination and a clause on dispute resolution by arbitration.",
    ),
    (
        "chef",
        "You are a French chef. You explain everything as a recipe: ingredients with quantities in grams,"
        " oven temperatures and cooking times, and numbered cooking steps. You mention butter, shallots "
        "and white wine often and finish with advice on plating the dish for guests. You are proud and a "
        "little impatient, you call everyone 'mon ami', and you compare every problem to a sauce that "
        "must not be rushed. You never give an answer without telling which wine goes with it and how "
        "long the guests should wait before dessert.",
    ),
    (
        "coder",
        "You are a terse Python programmer. You answer only with Python code in a single code block, with"
        " type hints and a docstring, and no prose before or after the code. Names are short, functions "
        "are small, and every function has a doctest. You never explain in words: comments inside the "
        "code are your only prose. You prefer the standard library, raise ValueError on bad input, and "
        "write tests with assert statements right below each function. If the request is not a "
        "programming task you still answer with code.",
    ),
    (
        "critic",
        "You are a harsh film critic. You review whatever you are given as if it were a movie: the plot, "
        "the actors, the camera work and the music, and you give it a score out of ten stars with a "
        "sarcastic one-line verdict at the end. You have seen every film since 1950 and you compare "
        "everything to a forgotten masterpiece. You complain about the length, the lighting and the "
        "soundtrack, you quote a line of dialogue that you invented, and you never recommend anything to "
        "anyone.",
    ),
    (
        "sailor",
        "You are an old sailor telling stories in a harbour tavern. Everything reminds you of storms, "
        "knots, tides and ports from Lisbon to Valparaiso. You speak in a rough, friendly voice, call the"
        " listener 'matey', and never get to the point quickly. Every answer starts with a story about a "
        "voyage that went wrong, a captain who ignored the weather, or a cargo of spices that spoiled. "
        "You measure distances in nautical miles and time in watches, and you end by raising your glass "
        "to the listener.",
    ),
    (
        "scientist",
        "You are a physicist who explains everything with equations, units and orders of magnitude. You "
        "state your assumptions, estimate every quantity, check the dimensions of each result, and say "
        "how certain you are in percent. You draw analogies with springs, pendulums and heat engines, "
        "write every result with an error bar, and refuse to give a single number without a range. You "
        "finish with the one experiment that would settle the question and what it would cost.",
    ),
]

QUERIES = [
    "The town council wants a plan for the old mill by the river: it could become a library, a bakery or a "
    "museum. List the costs, the risks and who benefits, and recommend one option with reasons.",
    "A family of four wants to cut its monthly electricity bill by a third without buying new appliances. "
    "Suggest concrete changes, estimate the savings of each, and say which to do first.",
    "A school has one computer room for 300 students and wants every class to use it twice a week. Propose "
    "a timetable rule, explain the trade-offs, and say what to do when a teacher is absent.",
    "A small bakery sells out of bread by noon but throws away cakes every evening. Explain what might cause "
    "this, what data to collect for a week, and how to change the baking plan.",
    "A village bus runs every two hours and is nearly empty at midday but full at seven in the morning. "
    "Propose a new schedule with the same number of trips, and say who gains and who loses.",
    "A library wants to lend tools as well as books: drills, ladders and sewing machines. List what could go "
    "wrong, the rules it needs, and how to decide which tools to buy first.",
    "Two neighbours share a garden and argue about a tall tree that shades one house. Describe the options, "
    "what each would cost both of them, and a fair way to reach a decision.",
    "A football club for children has more players than coaches on Saturdays. Suggest how to organise the "
    "mornings, what parents could do, and how to keep every child playing.",
]


@register_workload
@dataclass
class StressWorkload(Workload):
    """A chain of ``hops`` agents with long, very different persona prefixes; each continues right after
    the previous agent's output (which it reads with the query); fixed-length outputs."""

    name = "stress"
    description = (
        "FullShared degrades: a chain of agents with long different personas reading the previous output"
    )

    hops: int = 6
    output_tokens: int = 12
    requests: int = 2
    first_prefix: bool = False  # the first agent reads the query with no persona prefix

    def __post_init__(self) -> None:
        if not 2 <= self.hops <= len(PERSONAS):
            raise ValueError(f"stress: hops must be within 2..{len(PERSONAS)}, got {self.hops}")
        if not 1 <= self.requests <= len(QUERIES):
            raise ValueError(f"stress: requests must be within 1..{len(QUERIES)}, got {self.requests}")
        if self.output_tokens < 1:
            raise ValueError(f"stress: output_tokens must be >= 1, got {self.output_tokens}")

    def tasks(self, tokenizer: Any, seed: int = 0) -> list[TaskSpec]:
        agents = []
        for k, (name, persona) in enumerate(PERSONAS[: self.hops]):
            system = persona if (k or self.first_prefix) else ""
            glue = "\n\nThe {label} began:\n" if k else "\n\n{label}:\n"
            tail = "" if k else "\n\nBegin:\n"
            agents.append(AgentSpec(name=name, system=system, glue=glue, tail=tail))
        tasks = []
        for r, query in enumerate(QUERIES[: self.requests]):
            schedule = [
                StepSpec(
                    agent=name,
                    reads=("query",) if k == 0 else ("query", PERSONAS[k - 1][0]),
                    max_new_tokens=self.output_tokens,
                    min_new_tokens=self.output_tokens,
                )
                for k, (name, _) in enumerate(PERSONAS[: self.hops])
            ]
            tasks.append(
                TaskSpec(
                    id=f"stress-{r}",
                    agents=agents,
                    slots=[SlotSpec(name="query", text=query, label="Task")],
                    schedule=schedule,
                    max_new_tokens=self.output_tokens,
                    chat=False,
                )
            )
        return tasks

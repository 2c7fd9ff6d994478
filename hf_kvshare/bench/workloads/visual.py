"""The base of the vision-language workloads the project draws (``mathvista``, ``videomme``): each
request is one generated image or video with a known answer and one question about it; three task
agents read the shared image / video and the question, then a reflection agent reads them and the
three agents' answers (the seeds' GSM8K / MMLU structure as KVCMAS adapts it to MathVista and
Video-MME). Needs a vision-language model and its processor."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from .base import Workload
from .spec import AgentSpec, SlotSpec, StepSpec, TaskSpec


@dataclass(frozen=True)
class Drawn:
    """One drawn request: the image (``media="image"``) or the frames (``"video"``), the question, its
    known answer and the checker, and what the drawing was made from (``meta``)."""

    media: Any
    question: str
    answer: str
    checker: str
    meta: dict[str, Any]


@dataclass
class VisualQAWorkload(Workload):
    """Four agents over one generated image or video per request (``roles`` in order, the last one
    the reflection agent): subclasses draw request ``i`` from ``rng`` (:meth:`draw`)."""

    #: the requests put images (or video frames) in the prompts: the bench loads the model's processor
    visual: ClassVar[bool] = True
    #: agent name -> system prompt; the last one reads the others' answers
    roles: ClassVar[dict[str, str]] = {}
    #: the shared media slot: its name, its label in the glue and whether it is an image or a video
    media_slot: ClassVar[str] = "image"
    media_label: ClassVar[str] = "Image"
    media_kind: ClassVar[str] = "image"

    limit: int | None = 4  # how many requests
    offset: int = 0  # the first request's index (requests are drawn from the run's seed and the index)
    max_new_tokens: int = 48

    def check(self, adapters=()) -> None:
        if self.limit is None or self.limit < 1 or self.offset < 0:
            raise ValueError(
                f"{self.name} draws its requests: --limit must be >= 1 and --offset >= 0; got "
                f"limit={self.limit}, offset={self.offset}"
            )

    def draw(self, rng: random.Random) -> Drawn:
        raise NotImplementedError

    def tasks(self, tokenizer: Any = None, seed: int = 0) -> list[TaskSpec]:
        self.check()
        names = list(self.roles)
        solvers, final = names[:-1], names[-1]
        shared = (self.media_slot, "question")
        tasks = []
        for i in range(self.offset, self.offset + self.limit):
            drawn = self.draw(random.Random(f"{self.name}-{seed}-{i}"))
            media = {self.media_kind: drawn.media}
            tasks.append(
                TaskSpec(
                    id=f"{self.name}-{i}",
                    agents=[AgentSpec(name=n, system=self.roles[n], tail="\n\nYour answer:") for n in names],
                    slots=[
                        SlotSpec(name=self.media_slot, label=self.media_label, kind="observation", **media),
                        SlotSpec(name="question", text=drawn.question, label="Question", kind="question"),
                    ],
                    schedule=[StepSpec(agent=n, reads=shared) for n in solvers]
                    + [StepSpec(agent=final, reads=(*shared, *solvers))],
                    max_new_tokens=self.max_new_tokens,
                    answer=drawn.answer,
                    checker=drawn.checker,
                    meta=drawn.meta,
                )
            )
        return tasks

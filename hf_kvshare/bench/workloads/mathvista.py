"""A MathVista-like workload on charts the project draws: each request is one bar chart (3-5 labelled
bars with distinct integer heights, drawn with PIL) and one question about it whose answer follows
from the chart's data, so a checker exists. Three task agents read the shared image and the
question; a reflection agent reads the image, the question and the three agents' answers (the
seeds' GSM8K structure as KVCMAS adapts it to MathVista). Needs a vision-language model and its
processor (``bench run --workload mathvista --model <LLaVA-OneVision folder or hub id>``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from .base import register_workload
from .visual import Drawn, VisualQAWorkload

LABELS = (
    "apple",
    "pear",
    "plum",
    "fig",
    "kiwi",
    "lime",
    "mango",
    "peach",
    "grape",
    "melon",
    "cherry",
    "lemon",
)
COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7")
#: question kind -> (question text, checker); ``{label}`` is filled for "value_of"
QUESTIONS = {
    "max_value": ("What is the value of the tallest bar?", "numeric"),
    "min_value": ("What is the value of the shortest bar?", "numeric"),
    "value_of": ("What is the value of the bar labelled {label}?", "numeric"),
    "difference": ("What is the difference between the tallest and the shortest bar?", "numeric"),
    "max_label": ("Which label has the largest value?", "answer"),
}

ANSWER_LINE = " End with a line of the form: Answer: <answer> (a number, or a label as written on the chart)."
ROLES = {
    "chart_reader": (
        "You read charts precisely. Look at the chart, read the height of every bar against the axis, "
        "then answer the question." + ANSWER_LINE
    ),
    "mathematical_analyst": (
        "You are a mathematical analyst. List the values the chart shows, say which ones the question "
        "needs, compute the result step by step." + ANSWER_LINE
    ),
    "critic": (
        "You are a careful critic. Read the chart and the question, say what is easy to misread in this "
        "chart, and give the answer you are sure of." + ANSWER_LINE
    ),
    "final": (
        "You make the final decision. Read the chart, the question and the team's answers, check them "
        "against the chart, and give the correct one." + ANSWER_LINE
    ),
}


@dataclass(frozen=True)
class BarChart:
    """A bar chart's data: ``labels[i]`` has height ``values[i]`` (distinct positive integers)."""

    labels: tuple[str, ...]
    values: tuple[int, ...]
    value_labels: bool = True  # each bar's value written above it (False: read it off the axis)

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.values) or not self.labels:
            raise ValueError(f"a bar chart needs one value per label; got {self.labels} and {self.values}")
        if len(set(self.values)) != len(self.values) or min(self.values) < 1:
            raise ValueError(f"bar heights must be distinct positive integers; got {self.values}")

    def answer(self, kind: str, label: str | None = None) -> str:
        """The answer of question ``kind`` (:data:`QUESTIONS`) computed from the data."""
        values = dict(zip(self.labels, self.values))
        if kind == "max_value":
            return str(max(self.values))
        if kind == "min_value":
            return str(min(self.values))
        if kind == "value_of":
            if label not in values:
                raise ValueError(f"no bar labelled {label!r}; labels: {', '.join(self.labels)}")
            return str(values[label])
        if kind == "difference":
            return str(max(self.values) - min(self.values))
        if kind == "max_label":
            return max(values, key=values.get)
        raise ValueError(f"unknown question kind {kind!r}; one of {', '.join(QUESTIONS)}")

    def image(self, size: int = 384) -> Any:
        """The chart as a ``size`` x ``size`` RGB ``PIL.Image``: a y axis with ticks and grid lines,
        one coloured bar per label, the labels under the bars (and the values above them)."""
        from PIL import Image, ImageDraw, ImageFont

        if size < 64:
            raise ValueError(f"a chart image needs at least 64 pixels a side; got {size}")
        image = Image.new("RGB", (size, size), "white")
        draw = ImageDraw.Draw(image)
        font = ImageFont.load_default(size=max(8, size // 24))
        left, right, top, bottom = size * 0.14, size * 0.96, size * 0.06, size * 0.86
        step = _tick_step(max(self.values))
        top_value = step * -(-max(self.values) // step)

        def y(value: float) -> float:
            return bottom - (bottom - top) * value / top_value

        for tick in range(0, top_value + 1, step):
            draw.line([(left, y(tick)), (right, y(tick))], fill="#dddddd", width=1)
            draw.text((left - size * 0.02, y(tick)), str(tick), fill="black", font=font, anchor="rm")
        draw.line([(left, top), (left, bottom)], fill="black", width=2)
        draw.line([(left, bottom), (right, bottom)], fill="black", width=2)
        slot = (right - left) / len(self.values)
        for i, (label, value) in enumerate(zip(self.labels, self.values)):
            x0, x1 = left + slot * (i + 0.2), left + slot * (i + 0.8)
            draw.rectangle([(x0, y(value)), (x1, bottom)], fill=COLORS[i % len(COLORS)], outline="black")
            draw.text(((x0 + x1) / 2, bottom + size * 0.02), label, fill="black", font=font, anchor="ma")
            if self.value_labels:
                draw.text(((x0 + x1) / 2, y(value) - 2), str(value), fill="black", font=font, anchor="md")
        return image


def _tick_step(largest: int) -> int:
    """A round tick step giving about five ticks up to ``largest``."""
    for step in (1, 2, 5, 10, 20, 25, 50, 100):
        if largest / step <= 6:
            return step
    return 200


def random_chart(rng: random.Random) -> BarChart:
    """3-5 bars with distinct labels and distinct integer heights in 1..50."""
    n = rng.randint(3, 5)
    return BarChart(tuple(rng.sample(LABELS, n)), tuple(rng.sample(range(1, 51), n)))


def chart_question(rng: random.Random, chart: BarChart) -> tuple[str, str, str]:
    """``(question, answer, checker)``: a question kind drawn at random, its answer from the data."""
    kind = rng.choice(list(QUESTIONS))
    text, checker = QUESTIONS[kind]
    label = rng.choice(chart.labels) if kind == "value_of" else None
    return text.format(label=label), chart.answer(kind, label), checker


@register_workload
@dataclass
class MathVistaWorkload(VisualQAWorkload):
    """Bar charts with known answers, four agents (three task agents, a reflection agent)."""

    name = "mathvista"
    description = (
        "MathVista-like: generated bar charts + a question with a known answer (needs a vision-language "
        "model, e.g. LLaVA-OneVision): chart reader, analyst, critic, final"
    )
    roles = ROLES
    media_slot, media_label, media_kind = "chart", "Chart", "image"
    #: pixels a side of the chart images (LLaVA-OneVision's input size)
    image_size: ClassVar[int] = 384

    def draw(self, rng: random.Random) -> Drawn:
        chart = random_chart(rng)
        question, answer, checker = chart_question(rng, chart)
        meta = {"labels": list(chart.labels), "values": list(chart.values)}
        return Drawn(chart.image(self.image_size), question, answer, checker, meta)

"""A Video-MME-like workload on videos the project draws: each request is one short video (a list of
``frames`` PIL frames: a circle moving one way, squares appearing one after another, or a square
changing colour) and one multiple-choice question about it (four options, A-D) whose answer follows
from how the video was drawn, so a letter checker exists. Three task agents read the shared video
and the question; a reflection agent reads them and the three agents' answers (MMLU's structure as
KVCMAS adapts it to Video-MME). Needs a vision-language model with video input (LLaVA-OneVision:
``bench run --workload videomme --model <folder, hub id or random:llava-onevision-0.5b>``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .base import register_workload
from .visual import Drawn, VisualQAWorkload

#: colour name -> RGB (distinct, named as the options name them)
COLOURS = {
    "red": (220, 40, 40),
    "blue": (40, 80, 220),
    "green": (40, 170, 60),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 130, 30),
}
DIRECTIONS = ("left", "right", "up", "down")
#: question kind -> question text (``{colour}`` filled for "direction")
QUESTIONS = {
    "direction": "In which direction does the {colour} circle move?",
    "count": "How many squares are on the screen at the end of the video?",
    "colour": "The square changes colour during the video. Which colour does it change to?",
}
#: the bounds of the workload's options (``--frames``, ``--frame-size``)
MIN_FRAMES, MAX_FRAMES = 2, 32
MIN_FRAME_SIZE, MAX_FRAME_SIZE = 32, 768
MAX_SQUARES = 6

LETTER_LINE = " Start your reply with the letter of your answer (A, B, C or D)."
ROLES = {
    "frame_observer": (
        "You watch videos closely. Look at the frames in order, say what each object does from the first "
        "frame to the last, then answer the question." + LETTER_LINE
    ),
    "temporal_reasoner": (
        "You reason about time and motion. List what changes between the frames and when, say which "
        "change the question is about, and answer it." + LETTER_LINE
    ),
    "critic": (
        "You are an excellent critic. Point out the weak points of the other agents' analysis, then "
        "start a new line with the letter you believe is correct (A, B, C or D)."
    ),
    "final": (
        "You make the final decision. The question has four options, A, B, C and D, and exactly one is "
        "correct. Using the video and the team's analysis, reply with one letter only: A, B, C or D."
    ),
}


@dataclass(frozen=True)
class Shape:
    """One object in one frame: ``"circle"`` or ``"square"`` of colour ``colour`` (a name of
    :data:`COLOURS`), centred at ``(x, y)`` in units of the frame's side (0..1, y down)."""

    kind: str
    colour: str
    x: float
    y: float


@dataclass(frozen=True)
class Clip:
    """A drawn video's data: the shapes of every frame, the question about it, its four options and
    the right one (``answer``, a letter)."""

    kind: str
    frames: tuple[tuple[Shape, ...], ...]
    question: str
    options: tuple[str, str, str, str]
    answer: str

    def __post_init__(self) -> None:
        if not self.frames:
            raise ValueError("a video needs at least one frame; got 0")
        if (
            len(self.options) != 4
            or len(set(self.options)) != 4
            or self.answer not in "ABCD"
            or not self.answer
        ):
            raise ValueError(
                f"a clip needs four distinct options and an answer A-D; got {self.options}, {self.answer!r}"
            )

    @property
    def query(self) -> str:
        """The question with its options, as MMLU lays them out."""
        return self.question + "\n" + "\n".join(f"{'ABCD'[k]}: {o}" for k, o in enumerate(self.options))

    def images(self, size: int = 384) -> list[Any]:
        """The frames as ``size`` x ``size`` RGB ``PIL.Image`` s (white background, each shape a
        filled disc or square of side ``size / 8``)."""
        from PIL import Image, ImageDraw

        check_frame_size(size)
        out = []
        radius = size / 16
        for shapes in self.frames:
            image = Image.new("RGB", (size, size), "white")
            draw = ImageDraw.Draw(image)
            for shape in shapes:
                x, y = shape.x * size, shape.y * size
                box = [(x - radius, y - radius), (x + radius, y + radius)]
                fill = COLOURS[shape.colour]
                if shape.kind == "circle":
                    draw.ellipse(box, fill=fill)
                else:
                    draw.rectangle(box, fill=fill)
            out.append(image)
        return out


def check_frames(frames: Any) -> None:
    if not isinstance(frames, int) or isinstance(frames, bool) or not MIN_FRAMES <= frames <= MAX_FRAMES:
        raise ValueError(
            f"videomme draws videos of {MIN_FRAMES} to {MAX_FRAMES} frames (motion needs two): --frames "
            f"must be in that range; got {frames!r}"
        )


def check_frame_size(size: Any) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or not MIN_FRAME_SIZE <= size <= MAX_FRAME_SIZE:
        raise ValueError(
            f"videomme frames are {MIN_FRAME_SIZE} to {MAX_FRAME_SIZE} pixels a side: --frame-size must be "
            f"in that range; got {size!r}"
        )


def _options(rng: random.Random, right: str, others: list[str]) -> tuple[tuple[str, ...], str]:
    """Four options, ``right`` among them at a random place, and its letter."""
    options = [right, *rng.sample([o for o in others if o != right], 3)]
    rng.shuffle(options)
    return tuple(options), "ABCD"[options.index(right)]


def direction_clip(rng: random.Random, frames: int) -> Clip:
    """A circle moving in a straight line one way (left, right, up or down) at a steady speed."""
    colour, direction = rng.choice(list(COLOURS)), rng.choice(DIRECTIONS)
    across = rng.uniform(0.3, 0.7)  # the other coordinate
    start, end = (0.8, 0.2) if direction in ("left", "up") else (0.2, 0.8)
    steps = []
    for f in range(frames):
        t = start + (end - start) * f / (frames - 1)
        x, y = (t, across) if direction in ("left", "right") else (across, t)
        steps.append((Shape("circle", colour, x, y),))
    options, answer = _options(rng, direction, list(DIRECTIONS))
    return Clip("direction", tuple(steps), QUESTIONS["direction"].format(colour=colour), options, answer)


#: the square count's cells (3 columns x 2 rows, one square each)
CELLS = tuple((0.2 + 0.3 * c, 0.3 + 0.4 * r) for r in range(2) for c in range(3))


def count_clip(rng: random.Random, frames: int) -> Clip:
    """``k`` squares appearing one after another (at distinct frames, the first at frame 0), each
    staying once it appears; the question asks for ``k``."""
    k = rng.randint(1, min(MAX_SQUARES, frames))
    cells = rng.sample(CELLS, k)
    colours = [rng.choice(list(COLOURS)) for _ in range(k)]
    appear = [0, *sorted(rng.sample(range(1, frames), k - 1))]
    steps = [
        tuple(Shape("square", colours[j], *cells[j]) for j in range(k) if appear[j] <= f)
        for f in range(frames)
    ]
    options, answer = _options(rng, str(k), [str(n) for n in range(1, MAX_SQUARES + 2)])
    return Clip("count", tuple(steps), QUESTIONS["count"], options, answer)


def colour_clip(rng: random.Random, frames: int) -> Clip:
    """A square in the middle of the frame, one colour up to frame ``t`` and another from it on
    (``1 <= t < frames``); the question asks for the second colour (the first is among the options)."""
    before, after = rng.sample(list(COLOURS), 2)
    t = rng.randint(1, frames - 1)
    steps = [(Shape("square", before if f < t else after, 0.5, 0.5),) for f in range(frames)]
    others = [before, *rng.sample([c for c in COLOURS if c not in (before, after)], 2)]
    options = [after, *others]
    rng.shuffle(options)
    return Clip("colour", tuple(steps), QUESTIONS["colour"], tuple(options), "ABCD"[options.index(after)])


CLIPS = {"direction": direction_clip, "count": count_clip, "colour": colour_clip}


def random_clip(rng: random.Random, frames: int = 8) -> Clip:
    """A clip of a question kind drawn at random (:data:`QUESTIONS`)."""
    check_frames(frames)
    return CLIPS[rng.choice(list(CLIPS))](rng, frames)


@register_workload
@dataclass
class VideoMMEWorkload(VisualQAWorkload):
    """Drawn videos with a multiple-choice question, four agents (three task agents, a reflection agent)."""

    name = "videomme"
    description = (
        "Video-MME-like: generated videos (frames) + a multiple-choice question A-D with a known answer "
        "(needs a vision-language model with video input, e.g. LLaVA-OneVision): observer, reasoner, critic, final"
    )
    roles = ROLES
    media_slot, media_label, media_kind = "video", "Video", "video"

    frames: int = 8  # frames per video (2..32)
    frame_size: int = 384  # pixels a side (32..768; LLaVA-OneVision's video processor resizes to 384)

    def check(self, adapters=()) -> None:
        super().check(adapters)
        check_frames(self.frames)
        check_frame_size(self.frame_size)

    def draw(self, rng: random.Random) -> Drawn:
        clip = random_clip(rng, self.frames)
        meta = {"kind": clip.kind, "options": list(clip.options), "question": clip.question}
        return Drawn(clip.images(self.frame_size), clip.query, clip.answer, "letter", meta)

"""Images and video frames through the JSONL task format: a slot names an image file (``"image"``) or
a list of frame files (``"video"``), paths relative to the task file; they run through ``bench run
--workload file`` on a vision-language model exactly (NonShared's first turn equals plain
``generate`` with the same pixel values); bad input (a missing or corrupt file, zero frames, text
beside an image, an image for a text-only model) is one clear line before any model work."""

from __future__ import annotations

import json

import pytest
import torch
from bench_helpers import save_tiny
from tiny import counts_video_tokens, random_image, save_tiny_vlm, video_pixels

from hf_kvshare import Session
from hf_kvshare.bench.__main__ import main
from hf_kvshare.bench.workloads import (
    TaskSpec,
    WorkloadFormatError,
    load_task_file,
    make_workload,
    validate_task_file,
)
from hf_kvshare.models import load_model, load_processor

#: the runs read a saved model folder once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("folders_read_once")


def bench(*argv) -> int:
    return main([str(a) for a in argv])


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_images(directory):
    """A chart image and three frames under ``directory/media`` (PNG), written here."""
    media = directory / "media"
    media.mkdir(parents=True)
    random_image(0, 40, 60).save(media / "chart.png")
    for i in range(3):
        random_image(10 + i, 32, 32).save(media / f"f{i}.png")
    return media


def record(task_id="see", slots=None, **extra):
    slots = slots or [
        {"name": "chart", "image": "media/chart.png"},
        {"name": "clip", "video": ["media/f0.png", "media/f1.png", "media/f2.png"]},
        {"name": "question", "text": "Which letter? A, B, C or D."},
    ]
    names = [s["name"] for s in slots]
    return {
        "id": task_id,
        "max_new_tokens": 3,
        "agents": [{"name": "looker"}, {"name": "judge"}],
        "slots": slots,
        "schedule": [{"agent": "looker", "reads": names}, {"agent": "judge", "reads": [*names, "looker"]}],
        "answer": "B",
        "checker": "letter",
        **extra,
    }


TEXT_ONLY = {
    "id": "plain",
    "agents": [{"name": "a"}],
    "slots": [{"name": "q", "text": "Say hi."}],
    "schedule": [{"agent": "a", "reads": ["q"]}],
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------------- the format
def test_paths_are_relative_to_the_task_file(tmp_path, monkeypatch):
    write_images(tmp_path / "data")
    path = write_jsonl(tmp_path / "data" / "tasks.jsonl", [record(), TEXT_ONLY])
    monkeypatch.chdir(tmp_path)  # elsewhere than the file's folder
    for tasks in (validate_task_file(path), load_task_file(path)):
        see, plain = tasks
        chart, clip, question = see.slots
        assert chart.image == str(tmp_path / "data" / "media" / "chart.png") and chart.text == ""
        assert clip.video == [str(tmp_path / "data" / "media" / f"f{i}.png") for i in range(3)]
        assert question.text.startswith("Which") and plain.slots[0].media is None
        assert see.slot_kinds() == {"chart": "observation", "clip": "observation", "question": "question"}
    segments = [seg for seg in see.turns()[0].content if getattr(seg, "visual", None)]
    assert [seg.visual[0] for seg in segments] == ["image", "video"]
    again = TaskSpec.from_record(see.to_record())  # the record names the (resolved) files
    assert [s.media for s in again.slots] == [s.media for s in see.slots]
    assert make_workload("file", data=str(path)).visual
    assert not make_workload("file", data=str(write_jsonl(tmp_path / "text.jsonl", [TEXT_ONLY]))).visual


BAD = [
    (
        {"name": "chart", "image": "media/none.png"},
        r"line 1: slots\[0\]\.image: no image file at '.*media/none\.png'",
    ),
    ({"name": "chart", "image": "media/broken.png"}, r"line 1: slots\[0\]\.image: could not read image file"),
    ({"name": "chart", "image": "media"}, r"line 1: slots\[0\]\.image: '.*media' is not a regular file"),
    (
        {"name": "clip", "video": []},
        r"line 1: slots\[0\]\.video: a video needs at least one frame; got an empty list",
    ),
    (
        {"name": "clip", "video": ["media/f0.png", "media/broken.png"]},
        r"line 1: slots\[0\]\.video\[1\]: could not read image file",
    ),
    (
        {"name": "clip", "video": ["media/f0.png", 3]},
        r"slots\[0\]\.video\[1\]: expected a frame's image file path",
    ),
    ({"name": "clip", "video": "media/f0.png"}, r"slots\[0\]\.video: expected a list, got str"),
    (
        {"name": "chart", "image": "media/chart.png", "text": "a chart"},
        r"slots\[0\]: give one of text, image or video; got text and image",
    ),
    ({"name": "chart", "image": 7}, r"slots\[0\]\.image: expected a string, got int"),
]


@pytest.mark.parametrize("slot, message", BAD)
def test_bad_image_slots_are_refused_with_the_line_and_field(tmp_path, slot, message):
    media = write_images(tmp_path)
    (media / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    path = write_jsonl(
        tmp_path / "tasks.jsonl", [record(slots=[slot, {"name": "question", "text": "Which?"}])]
    )
    with pytest.raises(WorkloadFormatError, match=message):
        validate_task_file(path)


@pytest.mark.parametrize("slot, message", BAD[:2])
def test_bench_refuses_a_bad_image_file_before_loading(tmp_path, capsys, monkeypatch, slot, message):
    import hf_kvshare.models

    media = write_images(tmp_path)
    (media / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    path = write_jsonl(
        tmp_path / "tasks.jsonl", [record(slots=[slot, {"name": "question", "text": "Which?"}])]
    )

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the task file's check")

    monkeypatch.setattr(hf_kvshare.models, "load_model", refuse)
    with pytest.raises(SystemExit) as exit_info:
        bench("run", "--workload", "file", "--data", path, "--out", tmp_path / "out")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0]
    assert not (tmp_path / "out").exists()
    assert bench("validate", path) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "slots[0]" in err[0]


def test_bench_validate_refuses_a_decompression_bomb_in_one_line(tmp_path, capsys):
    """Issue 52 (inputs): a 20000x20000 PNG named by a task file is one line from ``bench validate`` (its
    size read from the header, nothing decoded), not a traceback."""
    from vision_helpers import bomb_png

    media = write_images(tmp_path)
    bomb_png(media / "bomb.png")
    slots = [{"name": "chart", "image": "media/bomb.png"}, {"name": "question", "text": "Which?"}]
    path = write_jsonl(tmp_path / "tasks.jsonl", [record(slots=slots)])
    message = r"slots\[0\]\.image: image file '.*bomb\.png' is 400,000,000 pixels, over the limit of"
    with pytest.raises(WorkloadFormatError, match=message):
        validate_task_file(path)
    assert bench("validate", path) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "400,000,000 pixels" in err[0]


def test_bench_refuses_images_for_a_text_only_model_before_loading(tokenizer, tmp_path, capsys, monkeypatch):
    import hf_kvshare.models

    directory = save_tiny(tmp_path / "llama", tokenizer)
    write_images(tmp_path)
    path = write_jsonl(tmp_path / "tasks.jsonl", [TEXT_ONLY, record()])

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the workload's model check")

    monkeypatch.setattr(hf_kvshare.models, "load_model", refuse)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        bench("run", "--workload", "file", "--data", path, "--model", directory, "--out", tmp_path / "out")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--workload file puts images in the prompts" in lines[0]
    assert "text-only model (llama" in lines[0]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- on a model
def test_jsonl_images_and_frames_run_exactly_through_the_bench(tmp_path):
    directory = save_tiny_vlm(tmp_path / "vlm")
    processor = load_processor(str(directory))
    write_images(tmp_path)
    slots = None
    if not counts_video_tokens(processor):  # transformers 5.16: video segments are refused; images only
        slots = [{"name": "chart", "image": "media/chart.png"}, {"name": "question", "text": "Which?"}]
    # one visual request (a text-only request on LLaVA-OneVision fails in the teacher-forced pass, in
    # the cache's token check: a separate bug, on main too)
    path = write_jsonl(tmp_path / "tasks.jsonl", [record(slots=slots)])
    out = tmp_path / "out"
    argv = ["run", "--workload", "file", "--data", path, "--methods", "nonshared", "fullshared"]
    assert bench(*argv, "--model", directory, "--out", out, "--no-progress", "--no-plots") == 0
    (config,) = [d for d in out.iterdir() if (d / "config.json").exists()]
    ref = json.loads((config / "nonshared" / "summary.json").read_text())
    full = json.loads((config / "fullshared" / "summary.json").read_text())
    assert ref["kv_error"] == 0.0 and ref["agreement"] == 1.0 and full["reuse_ratio"] == 1.0
    turns = read_jsonl(config / "nonshared" / "turns.jsonl")
    assert [t["agent"] for t in turns] == ["looker", "judge"]
    chart = next(s for s in turns[0]["segments"] if s["name"] == "chart")
    assert chart["end"] - chart["start"] > 16  # the image's placeholders (anyres: base + grid tiles)

    model, tok = load_model(str(directory))
    task = load_task_file(path)[0]
    step = task.to_workflow(tok).steps[0]
    prompt = Session(model, tok, "nonshared", processor=processor).run_turn(
        "x", step.segments, max_new_tokens=1
    )
    from PIL import Image

    image = Image.open(tmp_path / "media" / "chart.png")
    inputs = dict(processor(images=image, text="<image>", return_tensors="pt"))
    inputs = {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]}
    if slots is None:
        frames = [Image.open(tmp_path / "media" / f"f{i}.png") for i in range(3)]
        inputs["pixel_values_videos"] = video_pixels(processor, frames)
        clip = next(s for s in turns[0]["segments"] if s["name"] == "clip")
        assert clip["end"] - clip["start"] == 3 * 4 + 1
    with torch.no_grad():
        plain = model.generate(input_ids=prompt.prompt_ids[None], **inputs, max_new_tokens=3, do_sample=False)
    plain = plain[0, prompt.prompt_ids.numel() :].tolist()
    assert turns[0]["output_ids"] and turns[0]["output_ids"] == plain[: len(turns[0]["output_ids"])]


def test_the_shipped_vision_example_validates(capsys):
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "vision_tasks.jsonl"
    assert bench("validate", example) == 0
    assert "2 tasks, 4 agent turns: OK" in capsys.readouterr().out
    chart, motion = validate_task_file(example)
    assert Path(chart.slots[0].image).is_file() and len(motion.slots[0].video) == 4
    assert make_workload("file", data=str(example)).visual

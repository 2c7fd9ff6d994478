"""The Video-MME-like workload (drawn videos with a multiple-choice question, A-D): the frames carry
the answer, the letter checker scores it, the four agents share the video, bad options are refused
before the model loads, and NonShared through the shared cache equals plain ``generate`` on the
workload's own frames (on a transformers whose processor counts video tokens; 5.16's does not, and
the refusal is asserted there)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from tiny import counts_video_tokens, save_tiny_vlm, tiny_vlm, tiny_vlm_processor, video_pixels

from hf_kvshare import PF, PH, Session
from hf_kvshare.bench import make_workload
from hf_kvshare.bench.__main__ import main
from hf_kvshare.bench.checkers import check_answer
from hf_kvshare.bench.workloads import Clip, WorkloadFormatError
from hf_kvshare.bench.workloads.videomme import CELLS, COLOURS, QUESTIONS, random_clip
from hf_kvshare.models import load_model, load_processor
from hf_kvshare.vision import pil_video_pixels


def bench(*argv) -> int:
    return main([str(a) for a in argv])


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------- the videos
def colour_pixels(frame, name: str) -> np.ndarray:
    """``[n, 2]`` (x, y) of the pixels of colour ``name`` in ``frame``."""
    pixels = np.asarray(frame).astype(int)
    ys, xs = np.nonzero(np.abs(pixels - np.array(COLOURS[name])).sum(axis=2) == 0)
    return np.stack([xs, ys], axis=1)


def seen_answer(frames, question: str) -> str:
    """The answer read off the frames here, from the question's wording alone."""
    size = frames[0].size[0]
    if question.startswith("In which direction"):
        colour = question.split(" the ")[1].split()[0]
        (x0, y0), (x1, y1) = (colour_pixels(f, colour).mean(axis=0) for f in (frames[0], frames[-1]))
        if abs(x1 - x0) > abs(y1 - y0):
            return "right" if x1 > x0 else "left"
        return "down" if y1 > y0 else "up"
    last = np.asarray(frames[-1]).astype(int)
    if question.startswith("How many squares"):
        inked = [last[int(y * size), int(x * size)].tolist() != [255, 255, 255] for x, y in CELLS]
        return str(sum(inked))
    centre = last[size // 2, size // 2].tolist()
    first = np.asarray(frames[0]).astype(int)[size // 2, size // 2].tolist()
    assert first != centre  # the square did change
    return next(name for name, rgb in COLOURS.items() if list(rgb) == centre)


def test_answers_follow_from_the_frames():
    tasks = make_workload("videomme", limit=40, frames=5, frame_size=96).tasks(None, seed=2)
    kinds = set()
    for task in tasks:
        video = next(s.video for s in task.slots if s.name == "video")
        query = next(s.text for s in task.slots if s.name == "question")
        assert len(video) == 5 and all(f.size == (96, 96) and f.mode == "RGB" for f in video)
        question, *options = query.split("\n")
        assert [o[:3] for o in options] == ["A: ", "B: ", "C: ", "D: "]
        assert question == task.meta["question"] and len(set(task.meta["options"])) == 4
        kinds.add(task.meta["kind"])
        right = options["ABCD".index(task.answer)][3:]
        assert right == seen_answer(video, question), (query, task.answer)
        assert task.checker == "letter"
    assert kinds == set(QUESTIONS)  # every question kind is drawn


def test_the_letter_checker_scores_right_wrong_and_unparsable():
    task = make_workload("videomme", limit=1, frames=2, frame_size=32).tasks(None)[0]
    wrong = next(letter for letter in "ABCD" if letter != task.answer)
    assert check_answer(task, f"{task.answer}. The circle goes that way.")["correct"] is True
    assert check_answer(task, f"The answer is {task.answer}")["correct"] is True
    assert check_answer(task, f"{wrong}: the other one")["correct"] is False
    unparsable = check_answer(task, "I cannot tell from these frames.")
    assert unparsable["correct"] is False and unparsable["extracted"] is None


def test_requests_are_reproducible_per_seed_and_index():
    a = make_workload("videomme", limit=3, frames=3, frame_size=32).tasks(None, seed=0)
    b = make_workload("videomme", limit=2, offset=1, frames=3, frame_size=32).tasks(None, seed=0)
    c = make_workload("videomme", limit=3, frames=3, frame_size=32).tasks(None, seed=1)
    assert [t.meta for t in a[1:]] == [t.meta for t in b] and [t.id for t in b] == [
        "videomme-1",
        "videomme-2",
    ]
    assert all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a[1].slots[0].video, b[0].slots[0].video)
    )
    assert [t.meta for t in a] + [t.answer for t in a] != [t.meta for t in c] + [t.answer for t in c]


def test_a_clip_needs_frames_and_four_options():
    with pytest.raises(ValueError, match="at least one frame; got 0"):
        Clip("count", (), "How many?", ("1", "2", "3", "4"), "A")
    with pytest.raises(ValueError, match="four distinct options"):
        Clip("count", ((),), "How many?", ("1", "1", "3", "4"), "A")
    clip = random_clip(random.Random(0), frames=2)
    assert len(clip.frames) == 2 and clip.query.count("\n") == 4


@pytest.mark.parametrize(
    "params, message",
    [
        ({"frames": 0}, "--frames must be in that range; got 0"),
        ({"frames": 1}, "--frames must be in that range; got 1"),
        ({"frames": 33}, "--frames must be in that range; got 33"),
        ({"frame_size": 16}, "--frame-size must be in that range; got 16"),
        ({"frame_size": 1000}, "--frame-size must be in that range; got 1000"),
        ({"limit": 0}, "--limit must be >= 1"),
    ],
)
def test_bad_options_are_refused(params, message):
    workload = make_workload("videomme", **params)
    with pytest.raises(ValueError, match=message):
        workload.check()
    with pytest.raises(ValueError, match=message):
        workload.tasks(None)


def test_bench_refuses_zero_frames_before_loading(tmp_path, capsys, monkeypatch):
    import hf_kvshare.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the workload's check")

    monkeypatch.setattr(hf_kvshare.models, "load_model", refuse)
    with pytest.raises(SystemExit) as exit_info:
        bench("run", "--workload", "videomme", "--frames", "0", "--out", tmp_path / "out")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--frames must be in that range; got 0" in lines[0]
    assert not (tmp_path / "out").exists()


def test_mathvista_takes_no_frames():
    with pytest.raises(ValueError, match="workload 'mathvista' does not take frames"):
        make_workload("mathvista", frames=4)


# ------------------------------------------------------------------------------- the layout
def test_three_task_agents_then_a_reflection_agent_read_the_shared_video():
    task = make_workload("videomme", limit=1, frames=3, frame_size=32).tasks(None)[0]
    assert [s.reads for s in task.schedule] == [("video", "question")] * 3 + [
        ("video", "question", "frame_observer", "temporal_reasoner", "critic")
    ]
    videos = [seg for turn in task.turns() for seg in turn.content if getattr(seg, "video", None) is not None]
    assert len(videos) == 4 and all(seg.video is task.slots[0].video for seg in videos)
    assert all(seg.kind == "observation" for seg in videos)
    with pytest.raises(WorkloadFormatError, match="'video' hold an image or a video in memory"):
        task.to_record()


# ------------------------------------------------------------------------------- on a model
def test_nonshared_equals_plain_generate_on_the_workloads_frames():
    """Every agent's turn under NonShared, through the shared cache, equals plain ``generate`` given
    the same pixel values of the workload's frames (prepared without torchvision's video processor)."""
    vlm, processor = tiny_vlm(), tiny_vlm_processor()
    task = make_workload("videomme", limit=1, frames=3, frame_size=48, max_new_tokens=6).tasks(None)[0]
    workflow = task.to_workflow(processor.tokenizer)
    session = Session(vlm, processor.tokenizer, "nonshared", processor=processor)
    if not counts_video_tokens(processor):
        with pytest.raises(ValueError, match="video segments need a transformers"):
            session.run_turn("a", workflow.steps[0].segments, max_new_tokens=2)
        assert not session.slots
        pytest.skip("this transformers' processor does not count video tokens (refused clearly above)")
    pixels = pil_video_pixels(processor, task.slots[0].video)[None]
    assert pixels.shape == (1, 3, 3, 32, 32)  # resized to the processor's size
    for step in workflow.steps:
        turn = session.run_turn(step.agent, step.segments, max_new_tokens=6)
        assert int((turn.prompt_ids == processor.video_token_id).sum()) == 3 * 4 + 1
        with torch.no_grad():
            plain = vlm.generate(
                input_ids=turn.prompt_ids[None], pixel_values_videos=pixels, max_new_tokens=6, do_sample=False
            )[0, turn.prompt_ids.numel() :]
        assert turn.output_ids.tolist() == plain.tolist()[: turn.output_ids.numel()]
    assert session.slots["video"].visual.encodes == 1  # the vision tower ran once for four agents


def test_frames_on_a_qwen2_vl_without_a_video_processor_are_refused():
    from tiny import tiny_qwen_vl, tiny_qwen_vl_processor

    model, processor = tiny_qwen_vl(), tiny_qwen_vl_processor()
    frames = make_workload("videomme", limit=1, frames=2, frame_size=32).tasks(None)[0].slots[0].video
    session = Session(model, processor.tokenizer, processor=processor)
    with pytest.raises(ValueError, match="has no video processor.*video_grid_thw"):
        session.run_turn("a", [PF("W.\n"), PH("clip", video=frames), PF("\n?")])
    assert not session.slots


def test_the_folders_video_processor_options_prepare_the_frames(tmp_path):
    """``load_processor``'s image-only processor keeps the folder's video processor options; frames are
    resized and normalized by them, not by the image processor's."""
    directory = save_tiny_vlm(tmp_path / "vlm")
    frames = make_workload("videomme", limit=1, frames=2, frame_size=48).tasks(None)[0].slots[0].video
    plain = load_processor(str(directory))
    if getattr(plain, "video_processor", None) is not None:
        pytest.skip("torchvision is installed: the processor has its video processor")
    if not counts_video_tokens(plain):  # 5.16: video segments are refused (above); its AutoVideoProcessor
        # also fails on a folder whose video_preprocessor_config.json names no class, without torchvision
        pytest.skip("this transformers' processor does not count video tokens: video segments are refused")
    assert plain.video_options is None
    options = {
        "size": {"height": 32, "width": 32},
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
    }
    (directory / "video_preprocessor_config.json").write_text(json.dumps(options))
    given = load_processor(str(directory))
    assert given.video_options == options
    ours = pil_video_pixels(given, frames)
    expected = np.stack(
        [np.asarray(f.resize((32, 32), 3), dtype=np.float32).transpose(2, 0, 1) / 255 for f in frames]
    )
    assert torch.allclose(ours, torch.from_numpy(expected), atol=1e-6)
    assert not torch.allclose(ours, pil_video_pixels(plain, frames))  # the image processor's mean / std


def test_bench_runs_the_video_workload_on_the_vlm(tmp_path):
    directory = save_tiny_vlm(tmp_path / "vlm")
    out = tmp_path / "out"
    argv = ["run", "--workload", "videomme", "--limit", "1", "--frames", "3", "--frame-size", "48"]
    argv += ["--max-new-tokens", "3", "--methods", "nonshared", "fullshared", "--model", directory]
    argv += ["--out", out, "--no-progress", "--no-plots"]
    processor = load_processor(str(directory))
    if not counts_video_tokens(processor):
        pytest.skip("this transformers' processor does not count video tokens")
    assert bench(*argv) == 0
    (config,) = [d for d in out.iterdir() if (d / "config.json").exists()]
    ref = json.loads((config / "nonshared" / "summary.json").read_text())
    full = json.loads((config / "fullshared" / "summary.json").read_text())
    assert ref["agreement"] == 1.0 and ref["kv_error"] == 0.0 and ref["reuse_ratio"] == 0.0
    assert full["reuse_turns"] == 3 and full["reuse_ratio"] == 1.0 and full["kv_error"] > 0
    turns = read_jsonl(config / "nonshared" / "turns.jsonl")
    assert [t["agent"] for t in turns] == ["frame_observer", "temporal_reasoner", "critic", "final"]
    video = next(s for s in turns[0]["segments"] if s["name"] == "video")
    assert video["end"] - video["start"] == 3 * 4 + 1
    (request,) = read_jsonl(config / "nonshared" / "requests.jsonl")
    assert request["check"]["status"] == "checked"

    model, tok = load_model(str(directory))
    task = make_workload("videomme", limit=1, frames=3, frame_size=48, max_new_tokens=3).tasks(tok)[0]
    step = task.to_workflow(tok).steps[0]
    prompt = Session(model, tok, "nonshared", processor=processor).run_turn(
        "x", step.segments, max_new_tokens=1
    )
    pixels = video_pixels(processor, task.slots[0].video)
    with torch.no_grad():
        plain = model.generate(
            input_ids=prompt.prompt_ids[None], pixel_values_videos=pixels, max_new_tokens=3, do_sample=False
        )[0, prompt.prompt_ids.numel() :]
    assert turns[0]["output_ids"] == plain.tolist()[: len(turns[0]["output_ids"])] and turns[0]["output_ids"]

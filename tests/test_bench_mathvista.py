"""The MathVista-like workload (generated bar charts with known answers) and its bench wiring: a
LLaVA-OneVision folder loads with its processor, the workflow runs under NonShared and FullShared
through ``bench run``, NonShared's output equals plain ``generate`` with the same pixel values, and a
text-only model is refused before it loads."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from bench_helpers import save_tiny
from tiny import random_image, save_tiny_vlm, tiny_vlm_processor

from hf_kvshare import Session
from hf_kvshare.bench import make_workload
from hf_kvshare.bench.__main__ import main
from hf_kvshare.bench.checkers import check_answer
from hf_kvshare.bench.workloads import BarChart, TaskSpec, WorkloadFormatError
from hf_kvshare.bench.workloads.mathvista import COLORS, QUESTIONS, chart_question, random_chart
from hf_kvshare.models import load_model, load_processor


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-llava-ov"))


def bench(*argv) -> int:
    return main([str(a) for a in argv])


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------- the charts
def expected_answer(question: str, labels: list[str], values: list[int]) -> str:
    """The answer worked out here from the question's wording and the chart's data."""
    if question.startswith("Which label"):
        return labels[values.index(max(values))]
    if "tallest and the shortest" in question:
        return str(max(values) - min(values))
    if "tallest" in question:
        return str(max(values))
    if "shortest" in question:
        return str(min(values))
    label = question.rsplit(" ", 1)[1].rstrip("?")
    return str(values[labels.index(label)])


def test_answers_follow_from_the_chart_data():
    tasks = make_workload("mathvista", limit=40).tasks(None, seed=3)
    kinds = set()
    for task in tasks:
        labels, values = task.meta["labels"], task.meta["values"]
        assert 3 <= len(labels) <= 5 and len(set(values)) == len(values) and min(values) >= 1
        question = next(s.text for s in task.slots if s.name == "question")
        kinds.add(next(k for k, (text, _) in QUESTIONS.items() if text.split("{")[0] in question))
        assert task.answer == expected_answer(question, labels, values), (question, labels, values)
        assert task.checker == ("answer" if question.startswith("Which") else "numeric")
        right = check_answer(task, f"Reading the chart carefully.\nAnswer: {task.answer}")
        wrong = check_answer(task, "Answer: 999" if task.checker == "numeric" else "Answer: nothing")
        assert right["correct"] is True and wrong["correct"] is False
    assert kinds == set(QUESTIONS)  # every question kind is drawn


def test_requests_are_reproducible_per_seed_and_index():
    a = make_workload("mathvista", limit=3).tasks(None, seed=0)
    b = make_workload("mathvista", limit=2, offset=1).tasks(None, seed=0)
    c = make_workload("mathvista", limit=3).tasks(None, seed=1)
    assert [t.meta for t in a[1:]] == [t.meta for t in b] and [t.id for t in b] == [
        "mathvista-1",
        "mathvista-2",
    ]
    assert np.array_equal(np.asarray(a[1].slots[0].image), np.asarray(b[0].slots[0].image))
    assert [t.meta for t in a] != [t.meta for t in c]


def bar_heights(image, chart: BarChart) -> list[int]:
    """Pixels of each bar's colour down the middle of its column."""
    pixels = np.asarray(image).astype(int)
    size = pixels.shape[1]
    left, right = size * 0.14, size * 0.96
    width = (right - left) / len(chart.values)
    heights = []
    for i in range(len(chart.values)):
        x = int(left + width * (i + 0.5))
        color = np.array([int(COLORS[i][k : k + 2], 16) for k in (1, 3, 5)])
        heights.append(int((np.abs(pixels[:, x] - color).sum(axis=1) == 0).sum()))
    return heights


@pytest.mark.parametrize("value_labels", [True, False])
def test_the_image_draws_the_data(value_labels):
    """Each bar's height in pixels is proportional to its value (the picture carries the answer)."""
    rng = random.Random(7)
    for _ in range(5):
        data = random_chart(rng)
        chart = BarChart(data.labels, data.values, value_labels=value_labels)
        image = chart.image(384)
        assert image.size == (384, 384) and image.mode == "RGB"
        heights = bar_heights(image, chart)
        per_unit = [h / v for h, v in zip(heights, chart.values)]
        assert max(per_unit) - min(per_unit) < 1.5, (heights, chart.values)  # within rounding
        assert np.argmax(heights) == np.argmax(chart.values)


def test_bad_charts_and_parameters_are_refused():
    with pytest.raises(ValueError, match="distinct positive integers"):
        BarChart(("a", "b"), (3, 3))
    with pytest.raises(ValueError, match="one value per label"):
        BarChart(("a", "b"), (3,))
    with pytest.raises(ValueError, match="no bar labelled 'z'"):
        BarChart(("a", "b"), (1, 2)).answer("value_of", "z")
    with pytest.raises(ValueError, match="--limit must be >= 1"):
        make_workload("mathvista", limit=0).check()
    assert chart_question(random.Random(0), BarChart(("a", "b", "c"), (1, 5, 2)))[0]


# ------------------------------------------------------------------------------- the layout
def test_three_task_agents_then_a_reflection_agent_read_the_shared_image():
    task = make_workload("mathvista", limit=1).tasks(None)[0]
    assert [s.reads for s in task.schedule] == [("chart", "question")] * 3 + [
        ("chart", "question", "chart_reader", "mathematical_analyst", "critic")
    ]
    turns = task.turns()
    images = [seg for turn in turns for seg in turn.content if getattr(seg, "image", None) is not None]
    assert len(images) == 4 and all(seg.image is task.slots[0].image for seg in images)
    assert all(seg.kind == "observation" for seg in images)
    assert task.reused_slots()[3] == {"chart", "question", "chart_reader", "mathematical_analyst", "critic"}


def test_a_drawn_image_is_not_part_of_the_file_format():
    """A drawn chart (a PIL image in memory) has no file record; a record names an image file instead."""
    task = make_workload("mathvista", limit=1).tasks(None)[0]
    with pytest.raises(
        WorkloadFormatError, match="'chart' hold an image or a video in memory; the JSONL task format"
    ):
        task.to_record()
    record = {
        "agents": [{"name": "a"}],
        "slots": [{"name": "q", "text": "hi", "image": "chart.png"}],
        "schedule": [{"agent": "a", "reads": ["q"]}],
    }
    with pytest.raises(
        WorkloadFormatError, match=r"slots\[0\]: give one of text, image or video; got text and image"
    ):
        TaskSpec.from_record(record)


# ------------------------------------------------------------------------------- loading
def test_a_llava_onevision_folder_loads_with_its_processor(vlm_dir):
    """``load_model`` loads the folder's VLM; ``load_processor`` its processor (without torchvision,
    AutoProcessor cannot build the video processor: the image-only one), expanding an image exactly
    as the model's processor does."""
    model, tok = load_model(str(vlm_dir))
    assert type(model).__name__ == "LlavaOnevisionForConditionalGeneration" and not model.training
    processor = load_processor(str(vlm_dir))
    reference = tiny_vlm_processor()
    image = random_image(4, 50, 70)
    ours = processor(images=image, text="<image>", return_tensors="pt", add_special_tokens=False)
    theirs = reference(images=image, text="<image>", return_tensors="pt", add_special_tokens=False)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
    assert processor.tokenizer.chat_template == tok.chat_template is not None


def test_a_folder_without_a_vision_processor_is_refused(vlm_dir, tmp_path):
    import shutil

    broken = shutil.copytree(vlm_dir, tmp_path / "broken")
    path = broken / "processor_config.json"
    path.write_text(path.read_text().replace('"LlavaOnevisionProcessor"', '"NoSuchProcessor"'))
    with pytest.raises(ValueError, match="cannot load the image processor.*'NoSuchProcessor'"):
        load_processor(str(broken))


def test_a_text_only_model_has_no_processor(tokenizer, tmp_path):
    directory = save_tiny(tmp_path / "llama", tokenizer)
    with pytest.raises(ValueError, match="text-only model"):
        load_processor(str(directory))
    with pytest.raises(ValueError, match="text-only model"):
        load_processor("random:qwen2.5-7b")


# ------------------------------------------------------------------------------- bench run
def test_bench_runs_nonshared_and_fullshared_on_the_vlm(vlm_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["run", "--workload", "mathvista", "--limit", "1", "--max-new-tokens", "3"]
    argv += [
        "--methods",
        "nonshared",
        "fullshared",
        "--model",
        vlm_dir,
        "--out",
        out,
        "--no-progress",
        "--no-plots",
    ]
    assert bench(*argv) == 0
    (config,) = [d for d in out.iterdir() if (d / "config.json").exists()]
    ref = json.loads((config / "nonshared" / "summary.json").read_text())
    full = json.loads((config / "fullshared" / "summary.json").read_text())
    assert ref["agreement"] == 1.0 and ref["kv_error"] == 0.0 and ref["reuse_ratio"] == 0.0
    assert full["reuse_turns"] == 3 and full["reuse_ratio"] == 1.0 and full["kv_error"] > 0
    turns = read_jsonl(config / "nonshared" / "turns.jsonl")
    assert [t["agent"] for t in turns] == ["chart_reader", "mathematical_analyst", "critic", "final"]
    chart = next(s for s in turns[0]["segments"] if s["name"] == "chart")
    assert chart["end"] - chart["start"] > 16  # the image's placeholders (anyres: base + grid tiles)
    (request,) = read_jsonl(config / "nonshared" / "requests.jsonl")
    assert request["check"]["status"] == "checked"

    # NonShared's first turn through the bench == plain generate with the same pixel values
    model, tok = load_model(str(vlm_dir))
    processor = load_processor(str(vlm_dir))
    task = make_workload("mathvista", limit=1, max_new_tokens=3).tasks(tok, seed=0)[0]
    step = task.to_workflow(tok).steps[0]
    prompt = Session(model, tok, "nonshared", processor=processor).run_turn(
        "x", step.segments, max_new_tokens=1
    )
    pixels = processor(images=task.slots[0].image, text="<image>", return_tensors="pt")
    with torch.no_grad():
        plain = model.generate(
            input_ids=prompt.prompt_ids[None],
            pixel_values=pixels["pixel_values"],
            image_sizes=pixels["image_sizes"],
            max_new_tokens=3,
            do_sample=False,
        )[0, prompt.prompt_ids.numel() :]
    assert turns[0]["output_ids"] == plain.tolist()[: len(turns[0]["output_ids"])]
    assert len(turns[0]["output_ids"]) >= 1


def test_bench_refuses_a_text_only_model_before_loading(tokenizer, tmp_path, capsys, monkeypatch):
    import hf_kvshare.models

    directory = save_tiny(tmp_path / "llama", tokenizer)

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the workload's model check")

    monkeypatch.setattr(hf_kvshare.models, "load_model", refuse)
    capsys.readouterr()  # the save's progress bars
    with pytest.raises(SystemExit) as exit_info:
        bench("run", "--workload", "mathvista", "--model", directory, "--out", tmp_path / "out")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0]
    assert (
        "--workload mathvista puts images in the prompts" in lines[0] and "text-only model (llama" in lines[0]
    )
    assert not (tmp_path / "out").exists()


def test_calibrate_refuses_the_image_workload_before_loading(tmp_path, capsys, monkeypatch):
    import hf_kvshare.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(hf_kvshare.models, "load_model", refuse)
    with pytest.raises(SystemExit) as exit_info:
        bench(
            "calibrate",
            "--workload",
            "mathvista",
            "--method",
            "kvcmas",
            "--target-rho",
            "0.5",
            "--out",
            tmp_path,
        )
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "calibrate runs text workloads only" in lines[0]


def test_the_runner_needs_the_processor_for_the_image_workload(tmp_path):
    from hf_kvshare.bench.runner import BenchInputError, BenchRunner, RunConfig

    workload = make_workload("mathvista", limit=1)
    config = RunConfig(workload.name, workload.params(), model="some-vlm")
    runner = BenchRunner(None, None, workload, config, tmp_path, progress=False)
    with pytest.raises(
        BenchInputError, match=r"needs the model's processor \(BenchRunner\(\.\.\., processor="
    ):
        runner.tasks()
    assert not any(tmp_path.iterdir())

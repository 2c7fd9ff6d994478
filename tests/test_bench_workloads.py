"""Workloads: the JSONL task format and its validation, layouts, built-in workloads on local files."""

from __future__ import annotations

import copy
import json

import pytest
from bench_helpers import GRAPH_TASKS, write_jsonl

from hf_kvshare import PF, PH
from hf_kvshare.bench.workloads import (
    WORKLOADS,
    TaskSpec,
    WorkloadFormatError,
    load_task_file,
    make_workload,
    synthetic_text,
    validate_task_file,
)
from hf_kvshare.bench.workloads.autoact_world import SYSTEM, World
from hf_kvshare.session import Session


# ------------------------------------------------------------- file format
def test_task_file_loads_through_datasets(tmp_path):
    path = write_jsonl(
        tmp_path / "tasks.jsonl", [GRAPH_TASKS[0], "", GRAPH_TASKS[1]]
    )  # blank lines are skipped
    tasks = load_task_file(path)
    assert [t.id for t in tasks] == ["graph-1", "graph-2"]
    first = tasks[0]
    assert first.output_slots() == ["planner", "coder", "tester", "judge", "planner#2"]
    assert first.reused_slots() == [
        set(),
        {"query", "planner"},
        {"query", "planner"},
        {"query", "coder", "tester"},
        {"query", "judge"},
    ]
    assert first.agent("coder").glue == "\n[{label}]\n" and first.agent("planner").tail == "\n\nYour answer:"
    assert first.schedule[2].max_new_tokens == 2 and first.schedule[4].min_new_tokens == 2
    assert (first.answer, first.checker) == ("4", "numeric")
    second = tasks[1]
    assert second.chat is False and second.output_slots() == ["a", "verdict"] and second.answer is None
    # a round trip through the record form gives the same task
    assert TaskSpec.from_record(first.to_record()).to_record() == first.to_record()


def _bad(tmp_path, mutate, line_before=None):
    record = copy.deepcopy(GRAPH_TASKS[0])
    mutate(record)
    lines = [{**GRAPH_TASKS[1], "id": f"ok-{i}"} for i in range(line_before or 0)] + [record]
    return write_jsonl(tmp_path / "bad.jsonl", lines)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda r: r["schedule"][1]["reads"].append("tester"),
            r"line 3: schedule\[1\]\.reads\[2\]: .*'tester'.*later step",
        ),
        (
            lambda r: r["schedule"][0].update(agent="ghost"),
            r"line 3: schedule\[0\]\.agent: unknown agent 'ghost'",
        ),
        (
            lambda r: r["schedule"][2].update(max_new_tokens="many"),
            r"line 3: schedule\[2\]\.max_new_tokens: expected an integer",
        ),
        (lambda r: r["schedule"][2].update(max_new_tokens=0), r"schedule\[2\]\.max_new_tokens: must be >= 1"),
        (
            lambda r: r["schedule"][4].update(min_new_tokens=9),
            r"schedule\[4\]\.min_new_tokens: must be between 0",
        ),
        (
            lambda r: r["agents"][1].update(name="planner"),
            r"agents\[1\]\.name: agent 'planner' is defined twice",
        ),
        (lambda r: r["agents"][0].update(glue="{slot}:"), r"agents\[0\]\.glue: unknown placeholder \{slot\}"),
        (
            lambda r: r["agents"][1].update(glue="{label:>999999999}"),
            r"line 3: agents\[1\]\.glue: \{label:>999999999\}: the format widths add up to 999999999 .*at most 4096",
        ),
        (
            lambda r: r["agents"][1].update(glue="{label:>3000}{label:>3000}"),
            r"line 3: agents\[1\]\.glue: \{label:>3000\}: the format widths add up to 6000",
        ),
        (
            lambda r: r["agents"][1].update(glue="{label:d}"),
            r"line 3: agents\[1\]\.glue: cannot be formatted with label 'Task' \(Unknown format code 'd'",
        ),
        (
            lambda r: r["agents"][1].update(glue="{label!x}"),
            r"agents\[1\]\.glue: cannot be formatted with label .*Unknown conversion",
        ),
        (
            lambda r: r["agents"][1].update(glue="{label:{label}}"),
            r"agents\[1\]\.glue: \{label:\{label\}\}: a nested field",
        ),
        (
            lambda r: r["agents"][1].update(glue="\n[{label"),
            r"agents\[1\]\.glue: cannot be formatted \(expected '\}'",
        ),
        (lambda r: r["agents"][0].update(system=3), r"agents\[0\]\.system: expected a string"),
        (lambda r: r["agents"][0].update(temperature=0.2), r"agents\[0\]\.temperature: unknown field"),
        (lambda r: r.update(checkr="numeric"), r"line 3: checkr: unknown field"),
        (lambda r: r.update(checker="regex"), r"line 3: checker: unknown checker 'regex'"),
        (lambda r: r.pop("answer"), r"line 3: answer: checker 'numeric' needs an answer"),
        (lambda r: r.update(agents=[]), r"line 3: agents: must not be empty"),
        (lambda r: r.pop("schedule"), r"line 3: schedule: is required"),
        (lambda r: r["slots"][0].update(text=""), r"slots\[0\]\.text: must be a non-empty string"),
        (
            lambda r: r["schedule"][1].update(output="query"),
            r"schedule\[1\]\.output: slot 'query' already exists",
        ),
        (
            lambda r: r["schedule"][1].update(reads=["query", "query"]),
            r"reads\[1\]: slot 'query' is read twice",
        ),
        (lambda r: r.update(chat="yes"), r"line 3: chat: expected true or false"),
    ],
)
def test_bad_records_name_line_and_field(tmp_path, mutate, message):
    path = _bad(tmp_path, mutate, line_before=2)
    with pytest.raises(WorkloadFormatError, match=message):
        validate_task_file(path)
    with pytest.raises(WorkloadFormatError, match=message):
        load_task_file(path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda r: r["slots"][0].update(label="Task" * 30_000),
            r"line 3: slots\[0\]\.label: 120,000 characters; at most 256 \(a name or label, not text\)",
        ),
        (
            lambda r: r["agents"][0].update(glue="{label}" * 1000),
            r"agents\[0\]\.glue: 7,000 characters; at most 4,096",
        ),
        (lambda r: r["agents"][1].update(tail="x" * 5000), r"agents\[1\]\.tail: 5,000 characters"),
        (lambda r: r["agents"][0].update(system="y" * 70_000), r"agents\[0\]\.system: 70,000 characters"),
        (lambda r: r["agents"][0].update(name="a" * 300), r"agents\[0\]\.name: 300 characters"),
        (lambda r: r["slots"][0].update(name="q" * 300), r"slots\[0\]\.name: 300 characters"),
        (lambda r: r["schedule"][0].update(output="o" * 300), r"schedule\[0\]\.output: 300 characters"),
        (
            lambda r: r["schedule"][1].update(reads=["query", "r" * 300]),
            r"schedule\[1\]\.reads\[1\]: 300 characters",
        ),
        (lambda r: r.update(id="i" * 300), r"line 3: id: 300 characters"),
        (
            lambda r: r["slots"][0].update(text="z" * (2**22 + 1)),
            r"schedule\[0\]: the turn's prompt holds 4,194,3\d\d characters of given text .*at most 4,194,304",
        ),
    ],
)
def test_names_labels_and_glue_are_bounded_in_length(tmp_path, capsys, mutate, message):
    """Issue 52 (inputs): a label repeated to 120 KB, a long glue, tail, system prompt, name or a turn
    of over 4 M characters: one clear error naming the line, the field, its length and the bound
    (``bench validate`` exits 1 with one line), before anything is formatted or tokenized."""
    from hf_kvshare.bench.__main__ import main

    path = _bad(tmp_path, mutate, line_before=2)
    with pytest.raises(WorkloadFormatError, match=message):
        validate_task_file(path)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "characters" in err[0]


def test_glue_format_specs_within_bounds_are_kept(tokenizer):
    record = copy.deepcopy(GRAPH_TASKS[1])
    record["agents"][1]["glue"] = "{{{label!r:>8.6}}} "  # literal braces, a conversion, width, precision
    task = TaskSpec.from_record(record)
    texts = [seg.text for seg in task.to_workflow(tokenizer).steps[1].segments if isinstance(seg, PF)]
    assert "{   'doc'} " in texts and "{     'a'} " in texts
    record["agents"][1]["glue"] = "{label:>4097}"
    with pytest.raises(WorkloadFormatError, match=r"agents\[1\]\.glue: .*add up to 4097"):
        TaskSpec.from_record(record)


def test_max_new_tokens_against_the_model_positions(tmp_path):
    records = [GRAPH_TASKS[0], {**GRAPH_TASKS[1], "max_new_tokens": 63}]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    assert len(validate_task_file(path, max_positions=64, model="m")) == 2  # 63 new + 1 prompt token fit
    assert len(validate_task_file(tmp_path / "t.jsonl")) == 2  # no limit given: not checked
    with pytest.raises(WorkloadFormatError) as error:
        validate_task_file(path, max_positions=63, model="tiny")
    assert str(error.value) == (
        "t.jsonl line 2: max_new_tokens: 63 new tokens plus at least 1 prompt token exceed the 63 positions "
        "of model tiny (max_position_embeddings); at most 62"
    )
    step = copy.deepcopy(GRAPH_TASKS[0])
    step["schedule"][2]["max_new_tokens"] = 40  # the task default (3) fits, this step does not
    path = write_jsonl(tmp_path / "t.jsonl", [GRAPH_TASKS[1], step])
    with pytest.raises(
        WorkloadFormatError, match=r"line 2: schedule\[2\]\.max_new_tokens: 40 new tokens .* 32 "
    ):
        validate_task_file(path, max_positions=32, model="tiny")
    assert len(validate_task_file(path, max_positions=41, model="tiny")) == 2


def test_workload_parameters_against_the_model_positions(tmp_path):
    make_workload("trace", output_tokens=31).check_positions(32, "m")
    with pytest.raises(ValueError, match=r"--output-tokens 32: .* the 32 positions of model m"):
        make_workload("trace", output_tokens=32).check_positions(32, "m")
    with pytest.raises(ValueError, match=r"--max-new-tokens 64: .* the 64 positions"):  # the default counts
        make_workload("gsm8k").check_positions(64, "m")
    data = write_jsonl(tmp_path / "t.jsonl", [GRAPH_TASKS[0]])
    make_workload("file", data=str(data)).check_positions(4, "m")
    with pytest.raises(WorkloadFormatError, match=r"t.jsonl line 1: max_new_tokens: 3 new tokens"):
        make_workload("file", data=str(data)).check_positions(3, "m")


def test_bad_json_duplicate_ids_and_empty_file(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [GRAPH_TASKS[1], '{"id": "x", "agents": [}'])
    with pytest.raises(WorkloadFormatError, match=r"t.jsonl line 2: not valid JSON"):
        validate_task_file(path)
    path = write_jsonl(tmp_path / "t.jsonl", [GRAPH_TASKS[0], GRAPH_TASKS[0]])
    with pytest.raises(WorkloadFormatError, match=r"line 2: id: 'graph-1' is already used on line 1"):
        validate_task_file(path)
    path = write_jsonl(tmp_path / "t.jsonl", ["", "  "])
    with pytest.raises(WorkloadFormatError, match="holds no task"):
        validate_task_file(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        validate_task_file(tmp_path / "missing.jsonl")
    path = write_jsonl(tmp_path / "t.jsonl", ["[1, 2]"])
    with pytest.raises(WorkloadFormatError, match="line 1: record: expected a JSON object"):
        validate_task_file(path)


# ------------------------------------------------------------------ layout
def test_plain_and_chat_layouts(tokenizer):
    plain = TaskSpec.from_record(GRAPH_TASKS[1])
    steps = plain.to_workflow(tokenizer).steps
    assert steps[0].segments == [
        PF("Agent A.\n\n"),
        PF("doc:\n"),
        PH("doc", GRAPH_TASKS[1]["slots"][0]["text"]),
        PF("\n\nYour answer:"),
    ]
    assert steps[1].segments == [
        PF("<doc> "),
        PH("doc", GRAPH_TASKS[1]["slots"][0]["text"]),
        PF("<a> "),
        PH("a"),
        PF(" =>"),
    ]
    assert steps[1].output_slot == "verdict" and steps[1].reads == ("doc", "a")

    chat = TaskSpec.from_record(GRAPH_TASKS[0]).to_workflow(tokenizer)
    judge = chat.steps[3]
    kinds = [type(s).__name__ for s in judge.segments]
    assert kinds == ["PF", "PH", "PF", "PH", "PF", "PH", "PF"]
    assert judge.segments[0].text.startswith("<|im_start|>system\nYou decide.") and judge.segments[
        0
    ].text.endswith("Task:\n")
    assert judge.segments[2].text == "\n\ncoder:\n"  # output slots are labelled with the producing agent
    assert judge.segments[-1].text.endswith("<|im_start|>assistant\n")  # tail "" -> only the template
    assert chat.steps[4].generate_kwargs == {"min_new_tokens": 2} and chat.steps[4].output_slot == "planner#2"


def test_layout_runs_in_a_session_with_default_slot_names(tiny_llama, tokenizer):
    """Without custom output names the steps work with the foundation's own run_workflow too."""
    from hf_kvshare.evaluation import run_workflow

    workflow = TaskSpec.from_record(GRAPH_TASKS[0]).to_workflow(tokenizer)
    results = run_workflow(Session(tiny_llama, tokenizer, "fullshared"), workflow)
    assert [r.output_slot for r in results] == [s.output_slot for s in workflow.steps]


# ---------------------------------------------------------------- built-ins
def test_trace_context_has_exact_length_and_schedule(tokenizer):
    for n in (1, 37, 256):
        text = synthetic_text(tokenizer, n, __import__("random").Random(n))
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == n
    w = make_workload("trace", shared_tokens=64, agents=2, rounds=2, output_tokens=5, requests=2)
    tasks = w.tasks(tokenizer, seed=1)
    assert len(tasks) == 2 and tasks[0].slots[0].text != tasks[1].slots[0].text  # one context per request
    assert tasks[0].slots[0].text == w.tasks(tokenizer, seed=1)[0].slots[0].text  # deterministic per seed
    t = tasks[0]
    assert [s.agent for s in t.schedule] == ["planner", "researcher", "planner", "researcher"]
    assert t.schedule[3].reads == ("context", "planner", "researcher", "planner#2")
    assert all(s.min_new_tokens == s.max_new_tokens == 5 for s in t.schedule)
    assert w.tag() == "trace-S64-N2-R2-O5-Q2"


def test_humaneval_workload(tokenizer):
    tasks = make_workload("humaneval", limit=2, offset=1).tasks(tokenizer)
    assert [t.id for t in tasks] == ["HumanEval-1", "HumanEval-2"]
    t = tasks[0]
    assert [a.name for a in t.agents] == [
        "project_manager",
        "algorithm_designer",
        "programming_expert",
        "final",
    ]
    assert t.schedule[3].reads == ("query", "project_manager", "algorithm_designer", "programming_expert")
    assert t.checker == "humaneval" and {"test", "entry_point", "prompt"} <= set(t.meta)
    assert t.slots[0].text == t.meta["prompt"]


def test_gsm8k_and_mmlu_from_local_files(tmp_path, tokenizer):
    gsm = write_jsonl(
        tmp_path / "gsm.jsonl",
        [
            {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "A pen costs $2. How much do 600 pens cost?", "answer": "2 * 600\n#### 1,200"},
        ],
    )
    tasks = make_workload("gsm8k", data=str(gsm), limit=None).tasks(tokenizer)
    assert [(t.answer, t.checker) for t in tasks] == [("7", "numeric"), ("1200", "numeric")]
    assert [a.name for a in tasks[0].agents][-1] == "final" and len(tasks[0].schedule) == 4

    csv_file = tmp_path / "mmlu.csv"
    csv_file.write_text('question,choices,answer\n"2+2?","[""3"", ""4"", ""5"", ""6""]",1\n')
    t = make_workload("mmlu", data=str(csv_file)).tasks(tokenizer)[0]
    assert t.answer == "B" and t.slots[0].text == "2+2?\nA: 3\nB: 4\nC: 5\nD: 6" and t.checker == "letter"
    import datasets

    parquet = tmp_path / "mmlu.parquet"
    rows = [{"question": "Capital of France?", "choices": ["Rome", "Paris", "Oslo", "Bern"], "answer": "C"}]
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    t = make_workload("mmlu", data=str(parquet)).tasks(tokenizer)[0]
    assert t.answer == "C" and "B: Paris" in t.slots[0].text

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "Q?", "choices": ["a", "b"], "answer": 0}])
    with pytest.raises(ValueError, match=r"row 0: choices: expected a list of 4"):
        make_workload("mmlu", data=str(bad)).tasks(tokenizer)
    missing = write_jsonl(tmp_path / "m.jsonl", [{"text": "Q?"}])
    with pytest.raises(ValueError, match="missing column"):
        make_workload("gsm8k", data=str(missing)).tasks(tokenizer)
    with pytest.raises(FileNotFoundError):
        make_workload("gsm8k", data=str(tmp_path / "nope.jsonl")).tasks(tokenizer)


def test_stress_and_autoact_specs(tokenizer):
    stress = make_workload("stress", hops=4, requests=1, output_tokens=6).tasks(tokenizer)[0]
    assert [s.reads for s in stress.schedule] == [
        ("query",),
        ("query", "historian"),
        ("query", "poet"),
        ("query", "lawyer"),
    ]
    assert stress.agents[0].system == "" and len(stress.agents[1].system) > 300  # long, distinct personas
    assert stress.chat is False and stress.agents[1].tail == ""  # prompts end on the previous output
    with_prefix = make_workload("stress", hops=2, requests=1, first_prefix=True).tasks(tokenizer)[0]
    assert with_prefix.agents[0].system

    # AutoAct: the role adapters' own episodes (hf_kvshare.bench.workloads.autoact_world), one trajectory read by all
    auto = make_workload("autoact", limit=2).tasks(tokenizer)
    world = World.generate(seed=0, filler=2)
    assert [s.agent for s in auto[0].schedule] == [
        "plan",
        "act",
        "plan",
        "act",
        "reflect",
        "plan",
        "act",
        "reflect",
    ]
    assert auto[0].adapters == ["act", "plan", "reflect"] and auto[0].chat is False
    assert auto[0].slots[0].text.startswith(SYSTEM) and "Question: Which river" in auto[0].slots[0].text
    assert auto[0].checker == "answer" and auto[0].answer in {c.river for c in world.cities.values()}
    assert auto[0].slots[0].text != auto[1].slots[0].text  # different questions
    observed = [s.text for s in auto[0].slots if "Observation:" in s.text]
    assert len(observed) == 3 and all("Lookup" not in t for t in observed)  # the replayed pages
    last = auto[0].schedule[-1].reads  # the whole trajectory, instructions included, in order
    assert last[:3] == ("instruction0", "plan@0", "instruction1") and last[-1] == "instruction7"
    assert auto[0].output_slots()[-1] == "reflect@7"
    steps = auto[0].to_workflow(tokenizer).steps
    assert all(isinstance(s, PH) for s in steps[-1].segments) and steps[0].adapter == "plan"
    assert len(make_workload("autoact", hops=2, limit=1).tasks(tokenizer)[0].schedule) > 8
    with pytest.raises(ValueError, match="rounds .* applies to --data"):
        make_workload("autoact", rounds=2).tasks(tokenizer)


def test_autoact_from_user_questions(tokenizer, tmp_path):
    data = write_jsonl(
        tmp_path / "q.jsonl", [{"question": "What is 2 + 3?", "answer": "5"}, {"question": "Why?"}]
    )
    tasks = make_workload("autoact", data=str(data), rounds=2).tasks(tokenizer)
    assert [s.agent for s in tasks[0].schedule] == ["plan", "act", "reflect"] * 2
    assert "Question: What is 2 + 3?" in tasks[0].slots[0].text and "Question" not in tasks[0].slots[1].text
    assert (tasks[0].answer, tasks[0].checker, tasks[1].answer, tasks[1].checker) == (
        "5",
        "answer",
        None,
        None,
    )
    with pytest.raises(ValueError, match="needs a `question` column"):
        make_workload("autoact", data=str(write_jsonl(tmp_path / "bad.jsonl", [{"q": "x"}]))).tasks(tokenizer)


def test_select_slices():
    from hf_kvshare.bench.workloads.base import select

    assert list(select(10, 2, 3)) == [2, 3, 4] and list(select(10, 8, 5)) == [8, 9]
    assert list(select(3, 0, 0)) == [0, 1, 2] and list(select(3, 1, None)) == [1, 2]
    with pytest.raises(ValueError, match="past the end"):
        select(3, 3, 1)
    with pytest.raises(ValueError, match=">= 0"):
        select(3, 0, -1)


def test_workload_registry_and_parameter_errors():
    assert {"trace", "file", "humaneval", "gsm8k", "mmlu", "stress", "autoact"} <= set(WORKLOADS)
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        make_workload("nope")
    with pytest.raises(ValueError, match="does not take hops"):
        make_workload("trace", hops=3)
    with pytest.raises(ValueError, match="agents must be >= 1"):
        make_workload("trace", agents=0)
    with pytest.raises(ValueError, match="needs --data"):
        make_workload("file").tasks(None)


def test_task_json_is_plain_data():
    spec = TaskSpec.from_record(GRAPH_TASKS[0])
    assert json.loads(json.dumps(spec.to_record()))["schedule"][1]["reads"] == ["query", "planner"]

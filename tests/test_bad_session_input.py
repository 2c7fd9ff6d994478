"""Bad session input says what was expected and changes nothing: segments, agents, slots, chat
messages, output slots, generate's arguments; the adversarial re-run's session-input cases (each
legitimate input honoured: NonShared's output is plain greedy generate's over the prompt)."""

from __future__ import annotations

import functools

import pytest
import torch
from adversarial import Case, assert_holds, cached_model, cached_tokenizer
from tiny import STEPS, tiny_model

from hf_kvshare import Session


def test_bad_segments_and_arguments_say_what_was_expected(tokenizer):
    from hf_kvshare import PF, PH

    with pytest.raises(TypeError, match=r"PF text must be a string; got 5 \(int\)"):
        PF(5)
    with pytest.raises(TypeError, match=r"PH slot must be a non-empty string .* got 3 \(int\)"):
        PH(3, "text")
    with pytest.raises(TypeError, match="PH text must be a string or None"):
        PH("query", 7)
    model = tiny_model("llama", seed=3)
    session = Session(model, tokenizer, "fullshared")
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got 2.5 \(float\)"):
        session.build_cache(*STEPS[0], batch_size=2.5)
    for bad in ("8", 1.5, 0, True):  # None: the generation_config's, else 64
        with pytest.raises(ValueError, match=rf"max_new_tokens must be an int >= 1, got {bad!r}"):
            session.run_turn(*STEPS[0], max_new_tokens=bad)
    with pytest.raises(ValueError, match=r"force_output ids must be in \[0, 49152\).*\[49152, -1\]"):
        session.run_turn(*STEPS[0], force_output=[5, 49152, -1])
    with pytest.raises(ValueError, match="integer token ids"):
        session.run_turn(*STEPS[0], force_output=[1.5])
    assert session.slots == {} and session.turns == []


def test_chat_content_and_roles_are_checked(tokenizer):
    from hf_kvshare import PF, PH, chat

    with pytest.raises(TypeError, match="content must be a str, PF, PH or a list of them; got a dict"):
        chat(tokenizer, [{"role": "user", "content": {"text": "hello", "extra": 1}}])
    with pytest.raises(ValueError, match="role must be a string without the segment marker"):
        chat(tokenizer, [{"role": "user\u27e6hfkv:0\u27e7", "content": [PH("q", "What?"), PF(" ok")]}])
    segments = chat(tokenizer, [{"role": "user", "content": [PH("q", "What?"), " ok"]}])
    assert [s.slot for s in segments if isinstance(s, PH)] == ["q"]


def test_an_output_slot_is_a_non_empty_string(tokenizer):
    session = Session(tiny_model("llama", seed=3), tokenizer, "fullshared")
    for bad in (7, "", b"x"):
        with pytest.raises(ValueError, match=f"output_slot must be a non-empty string.*got {bad!r}"):
            session.run_turn(*STEPS[0], max_new_tokens=2, output_slot=bad)
    assert session.slots == {}
    assert session.run_turn(*STEPS[0], max_new_tokens=2, output_slot="first-out").output_slot == "first-out"


# ---------------------------------------------------------------- the adversarial re-run (tests/adversarial.py): session inputs
_INPUTS = "session inputs"


def _greedy_of(ids: torch.Tensor, n: int, model=None) -> list[int]:
    model = model or cached_model()
    prompt = ids[None]
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False
        )
    return Session(model, cached_tokenizer(), "nonshared")._strip_eos(out[0, prompt.shape[1] :]).tolist()


def _input_ok(label, turns, method="nonshared", tokenizer=None):
    """Legitimate inputs: every turn runs, its prompt is the segments tokenized one by one, and (NonShared)
    its output is plain greedy generate's over that prompt."""

    def run():
        session = Session(cached_model(), tokenizer or cached_tokenizer(), method)
        return [
            session.run_turn(agent, segments() if callable(segments) else segments, max_new_tokens=3)
            for agent, segments in turns
        ]

    def check(results):
        return all(r.output_ids.tolist() == _greedy_of(r.prompt_ids, 3) for r in results)

    return Case(_INPUTS, label, run, None, check)


def _input_refused(label, turns, match, tokenizer=None, model=None):
    """The last turn is refused; the turns before it ran; the session is as they left it."""
    box = {}

    def run():
        session = box["s"] = Session(
            model() if model else cached_model(), tokenizer or cached_tokenizer(), "fullshared"
        )
        for agent, segments in turns[:-1]:
            session.run_turn(agent, segments, max_new_tokens=2)
        box["before"] = (dict(session.slots), dict(session.aliases), len(session.turns))
        agent, segments = turns[-1]
        return session.run_turn(agent, segments() if callable(segments) else segments, max_new_tokens=2)

    def after():
        s = box.get("s")
        return (
            s is None
            or "before" not in box
            or (dict(s.slots), dict(s.aliases), len(s.turns)) == box["before"]
        )

    return Case(_INPUTS, label, run, match, None, after)


@functools.cache
def _plain_tokenizer():
    """The embedded tokenizer without a chat template."""
    import copy

    tok = copy.deepcopy(cached_tokenizer())
    tok.chat_template = None
    return tok


def _input_cases():
    from hf_kvshare import PF, PH

    q = [PF("Task: "), PH("query", "Add two and two."), PF("\nAnswer:")]
    msgs = lambda content, role="user": [{"role": role, "content": content}]  # noqa: E731
    return [
        _input_refused("agent ''", [("", q)], r"agent must be a non-empty string, got ''"),
        _input_refused("agent None", [(None, q)], r"agent must be a non-empty string, got None"),
        _input_refused("agent 5", [(5, q)], r"agent must be a non-empty string, got 5"),
        _input_refused("agent b'x'", [(b"x", q)], r"agent must be a non-empty string, got b'x'"),
        _input_ok(
            "a unicode agent name and text",
            [("планировщик", [PF("Задача: "), PH("query", "сложить 2 и 2 ✓"), PF("\n→")])],
        ),
        _input_ok("an agent name with newlines and spaces", [("a b\nc", q)]),
        _input_ok("an agent name of 10000 characters", [("a" * 10000, q)]),
        _input_ok("one agent twice (a#2)", [("a", q), ("a", q + [PF(" "), PH("a")])]),
        _input_ok(
            "agent 'a#2' after two turns of 'a' (its output: 'a#2#2')",
            [("a", q), ("a", q), ("a#2", q + [PF(" "), PH("a#2")])],
        ),
        Case(
            _INPUTS,
            "output_slot naming a given slot",
            lambda: Session(cached_model(), cached_tokenizer(), "fullshared").run_turn(
                "a", q, output_slot="query"
            ),
            r"output slot 'query' already exists",
        ),
        Case(
            _INPUTS,
            "output_slot naming an output",
            lambda: (lambda s: (s.run_turn("a", q, max_new_tokens=2), s.run_turn("b", q, output_slot="a")))(
                Session(cached_model(), cached_tokenizer(), "fullshared")
            ),
            r"output slot 'a' already exists",
        ),
        _input_refused(
            "one slot, two texts in one turn",
            [("a", [PH("x", "one"), PF(" "), PH("x", "two")])],
            r"PH slot 'x' already holds 'one'.*'two'",
        ),
        _input_refused(
            "a slot never recorded",
            [("a", [PF("Read "), PH("nobody")])],
            r"PH slot 'nobody' was never recorded.*recorded slots: none",
        ),
        _input_refused(
            "PH text ''", [("a", [PF("x"), PH("q", "")])], r"PH slot 'q': text '' tokenizes to zero tokens"
        ),
        _input_refused(
            "PF text ''", [("a", [PF(""), PH("q", "hi")])], r"segment 0 \(PF ''\) tokenizes to zero tokens"
        ),
        _input_ok("PF text ' '", [("a", [PF(" "), PH("q", "hi there")])]),
        _input_ok(
            "a NUL and control characters in text", [("a", [PF("x\x00\x01\t"), PH("q", "\x7f\x00 y")])]
        ),
        _input_refused(
            "20000 words",
            [("a", [PF("go "), PH("q", "word " * 20000)])],
            r"needs \d+ prompt \+ 2 new tokens.*supports 512",
        ),
        _input_refused(
            "segments a str", [("a", "hello")], r"segments must be a list of PF/PH.*not a single segment"
        ),
        _input_refused("segments a PF", [("a", PF("hello"))], r"not a single segment"),
        _input_refused("segments []", [("a", [])], r"a turn needs at least one segment"),
        _input_refused(
            "a None segment", [("a", [PF("x"), None])], r"segment 1 is a NoneType; expected PF, PH or str"
        ),
        _input_refused(
            "an int segment", [("a", [PF("x"), 3])], r"segment 1 is a int; expected PF, PH or str"
        ),
        _input_refused(
            "a dict among segments",
            [("a", [PF("x"), {"role": "user", "content": "y"}])],
            r"segment 1 is a dict",
        ),
        _input_ok("segments a generator", [("a", lambda: (s for s in q))]),
        _input_ok("segments a tuple", [("a", tuple(q))]),
        _input_refused(
            "chat without a template",
            [("a", msgs("hello"))],
            r"no chat template",
            tokenizer=_plain_tokenizer(),
        ),
        _input_ok("PF/PH without a template", [("a", q)], tokenizer=_plain_tokenizer()),
        _input_refused(
            "a message without content",
            [("a", [{"role": "user"}])],
            r"needs 'role' and 'content'; got keys \['role'\]",
        ),
        _input_refused(
            "message content None",
            [("a", msgs(None))],
            r"content must be a str, PF, PH or a list of them; got a NoneType",
        ),
        _input_refused(
            "message role None", [("a", [{"role": None, "content": "x"}])], r"role must be a string.*got None"
        ),
        _input_refused(
            "message content [1]", [("a", msgs([1]))], r"content items must be str, PF or PH; got int"
        ),
        _input_ok(
            "the segment marker in message text (kept as text)", [("a", msgs(["a \u27e6hfkv:0\u27e7 b"]))]
        ),
        _input_ok(
            "a PH in a system message",
            [
                (
                    "a",
                    lambda: _chat(
                        [
                            {"role": "system", "content": [PH("query", "Add.")]},
                            {"role": "user", "content": "go"},
                        ]
                    ),
                )
            ],
        ),
        _input_refused(
            "PH kind 'answer'",
            [("a", lambda: [PH("q", "x", kind="answer")])],
            r"kind must be one of 'question', 'observation' or None.*'answer'",
        ),
        _input_refused(
            "two questions in one request",
            [("a", [PH("q1", "one", kind="question"), PF(" "), PH("q2", "two", kind="question")])],
            r"question",
        ),
        _input_refused(
            "a slot restated with another kind",
            [
                ("a", [PH("q", "one", kind="observation"), PF(" ")]),
                ("b", [PH("q", kind="question"), PF(" ")]),
            ],
            r"stated as kind='question'.*observation",
        ),
        _input_refused(
            "an output restated as a question",
            [("a", q), ("b", [PH("a", kind="question"), PF(" ")])],
            r"stated as kind='question'.*output of 'a'",
        ),
        _input_refused(
            "PH slot b'q'", [("a", lambda: [PH(b"q", "x")])], r"PH slot must be a non-empty string.*b'q'"
        ),
        _input_refused(
            "PF label 3", [("a", lambda: [PF("x", label=3)])], r"PF label must be a string or None; got 3"
        ),
        _input_refused(
            "text past a small model's vocabulary",
            [("a", [PF("Task: "), PH("query", "Add two and two.")])],
            r"token ids \[\d+.*outside the model's vocabulary of 1000",
            model=lambda: _model_vocab(1000),
        ),
        _input_ok(
            "one text under two names", [("a", [PH("x", "same text"), PF(" and "), PH("y", "same text")])]
        ),
        _input_ok("a prompt ending in an output", [("a", q), ("b", [PF("Read: "), PH("a")])]),
        _input_ok("a one-token prompt", [("a", [PF("Hi")])]),
    ]


def _chat(messages):
    from hf_kvshare import chat

    return chat(cached_tokenizer(), messages)


@functools.cache
def _model_vocab(vocab):
    return tiny_model("llama", seed=3, vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=2)


ADVERSARIAL_INPUTS = _input_cases()


@pytest.mark.parametrize("case", ADVERSARIAL_INPUTS, ids=lambda c: c.name)
def test_adversarial_session_inputs(case):
    assert_holds(case)


ADVERSARIAL = ADVERSARIAL_INPUTS


def test_one_session_from_two_threads_refuses_the_overlapping_turns_and_loses_no_slot(tokenizer):
    """Issue 52 (inputs): one Session used by two threads at once, each running the whole workflow.
    A turn that overlaps the other thread's is refused with a ``RuntimeError`` naming the cause before it
    touches the session; every turn that ran is recorded (its output is a slot holding exactly its ids),
    so the session holds what a sequential run of the same turns holds."""
    import threading

    model = tiny_model("llama", seed=3, num_hidden_layers=2)
    session = Session(model, tokenizer, "fullshared")
    barrier, ran, errors = threading.Barrier(2), [], []

    def worker(tag):
        barrier.wait()
        for agent, segments in STEPS:
            try:
                result = session.run_turn(agent, segments, max_new_tokens=3)
                ran.append((result.output_slot, result.output_ids.tolist()))
            except Exception as error:  # noqa: BLE001 - every refusal is checked below
                errors.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=worker, args=(tag,)) for tag in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(ran) + len(errors) == 2 * len(STEPS) and ran
    overlap = [
        e for e in errors if e.startswith("RuntimeError") and "in use by a turn in another thread" in e
    ]
    assert overlap, "the threads never overlapped"
    # a later turn of a refused thread may read an output its refused turn never made: a clear refusal too
    assert all(e in overlap or "ValueError" in e for e in errors), errors
    for slot, ids in ran:
        assert session.slots[slot].token_ids.tolist() == ids, slot
    outputs = {name for name, slot in session.slots.items() if slot.producer is not None}
    assert outputs == {slot for slot, _ in ran}

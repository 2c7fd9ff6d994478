"""Threads: Sessions on one model in threads equal a sequential run; a Session, a method instance or
a PeftModel's adapters used by two threads at once are refused loudly (or both turns are right), and
the turn running in the other thread is unharmed; one Session used from threads one after another."""

from __future__ import annotations

import threading

import pytest
import torch
from adversarial import Case, assert_holds, cached_model, cached_tokenizer
from tiny import METHOD_OPTIONS, STEPS, tiny_model

from hf_kvshare import METHODS, Session


def _workflow(model, tokenizer, method, request: int) -> list[list[int]]:
    session = Session(model, tokenizer, METHODS[method](**METHOD_OPTIONS[method]))
    out = []
    for agent, segments in STEPS:
        segments = [s for s in segments]
        result = session.run_turn(agent, segments, max_new_tokens=4 + request % 3)
        out.append(result.output_ids.tolist())
    return out


def test_sessions_on_one_model_in_threads_equal_a_sequential_run(tokenizer):
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    jobs = [(method, r) for r in range(2) for method in METHOD_OPTIONS]
    expected = {job: _workflow(model, tokenizer, *job) for job in jobs}
    got: dict = {}
    errors: list = []
    barrier = threading.Barrier(2)

    def worker(my_jobs):
        barrier.wait()
        try:
            for _ in range(2):
                for job in my_jobs:
                    got.setdefault(job, []).append(_workflow(model, tokenizer, *job))
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(jobs[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    wrong = [job for job, runs in got.items() if any(run != expected[job] for run in runs)]
    assert not wrong, f"{len(wrong)} of {len(got)} requests differ from the sequential run: {wrong}"


def test_peft_agents_from_two_threads_at_once_are_refused(tokenizer):
    """One PeftModel's active adapter is model-wide: a second thread's turn while one runs is refused
    loudly (it silently ran with the other thread's adapter); one after another they run."""
    from lora_helpers import lora_model

    from hf_kvshare.agents import agent_adapter

    model = lora_model()
    segments = STEPS[0][1]
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold():
        with agent_adapter(model, "act"):
            inside.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(60)
    try:
        with pytest.raises(RuntimeError, match="another thread.*cannot run concurrently"):
            Session(model, tokenizer, "nonshared").run_turn("plan", segments, max_new_tokens=2)
    finally:
        release.set()
        holder.join()
    expected = Session(model, tokenizer, "nonshared").run_turn("plan", segments, max_new_tokens=2).output_ids

    def later():
        try:
            errors.append(Session(model, tokenizer, "nonshared").run_turn("plan", segments, max_new_tokens=2))
        except BaseException as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=later)
    thread.start()
    thread.join()
    assert torch.equal(errors[0].output_ids, expected)


# ---------------------------------------------------------------- the adversarial re-run (tests/adversarial.py): concurrency
_THREADS = "concurrency"


class _Held:
    """A turn held inside generate in another thread (its logits processor waits), so that a second
    call is certain to overlap it; ``result`` is that turn's output (or its error)."""

    def __init__(self, session, agent, segments):
        self.inside, self.release, self.result = threading.Event(), threading.Event(), None

        def hold(input_ids, scores):
            self.inside.set()
            self.release.wait(60)
            return scores

        def run():
            try:
                self.result = session.run_turn(
                    agent, segments, max_new_tokens=3, logits_processor=[hold]
                ).output_ids.tolist()
            except BaseException as error:  # reported by the case
                self.result = error

        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.inside.wait(60)

    def finish(self):
        self.release.set()
        self.thread.join(60)
        return self.result


def _sequential(method, options, steps):
    session = Session(cached_model(layers=4), cached_tokenizer(), METHODS[method](**options))
    return [session.run_turn(a, s, max_new_tokens=3).output_ids.tolist() for a, s in steps]


def _overlap(label, method, options, shared):
    """A turn of thread A is inside generate; the calling thread B runs a turn on the same Session
    (``shared="session"``) or on its own Session with the same method instance (``"method"``). B
    refused loudly or both correct (as a sequential run); A's turn is unharmed either way."""
    box = {}

    def run():
        instance = METHODS[method](**options)
        first = Session(cached_model(layers=4), cached_tokenizer(), instance)
        held = box["held"] = _Held(first, *STEPS[0])
        try:
            if shared == "session":
                return first.run_turn("other", STEPS[0][1], max_new_tokens=3).output_ids.tolist()
            return (
                Session(cached_model(layers=4), cached_tokenizer(), instance)
                .run_turn(*STEPS[0], max_new_tokens=3)
                .output_ids.tolist()
            )
        finally:
            box["a"] = held.finish()

    def a_unharmed():
        return box.get("a") == _sequential(method, options, STEPS[:1])[0]

    def check(b):
        return a_unharmed() and b == _sequential(method, options, STEPS[:1])[0]

    return Case(
        _THREADS,
        label,
        run,
        r"in use by a turn in another thread.*cannot run concurrently",
        check,
        a_unharmed,
    )


def _threads_ok(label, method, options, jobs=2):
    """Each thread its own Session and instance: every thread equals a sequential run."""

    def run():
        got, errors = [None] * jobs, []
        barrier = threading.Barrier(jobs)

        def work(i):
            barrier.wait()
            try:
                got[i] = _sequential(method, options, STEPS)
            except BaseException as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return got

    return Case(
        _THREADS, label, run, None, lambda got: all(g == _sequential(method, options, STEPS) for g in got)
    )


def _one_after_another(label, method, options):
    """One Session used by two threads one after the other (never at once): a sequential run."""

    def run():
        session = Session(cached_model(layers=4), cached_tokenizer(), METHODS[method](**options))
        out = []
        for agent, segments in STEPS:
            thread = threading.Thread(
                target=lambda a=agent, s=segments: out.append(
                    session.run_turn(a, s, max_new_tokens=3).output_ids.tolist()
                )
            )
            thread.start()
            thread.join()
        return out

    return Case(_THREADS, label, run, None, lambda got: got == _sequential(method, options, STEPS))


def _build_during_turn():
    session = Session(cached_model(layers=4), cached_tokenizer(), "fullshared")
    held = _Held(session, *STEPS[0])
    try:
        return session.build_cache("other", STEPS[0][1])
    finally:
        held.finish()


def _rollback_across_threads():
    """A's turn fails after B's turn (same Session, another thread) recorded its output: B's output
    must survive A's rollback (or B be refused)."""

    class Fail(Exception):
        pass

    session = Session(cached_model(layers=4), cached_tokenizer(), "fullshared")
    inside, release = threading.Event(), threading.Event()

    def hold_then_fail(input_ids, scores):
        inside.set()
        release.wait(60)
        raise Fail("A fails after B ran")

    thread = threading.Thread(
        target=lambda: _swallow(
            lambda: session.run_turn(*STEPS[0], max_new_tokens=2, logits_processor=[hold_then_fail]), Fail
        )
    )
    thread.start()
    assert inside.wait(60)
    try:
        b = session.run_turn("b", STEPS[0][1], max_new_tokens=2)
    finally:
        release.set()
        thread.join(60)
    return b.output_slot in session.slots


def _swallow(fn, kind):
    try:
        fn()
    except kind:
        pass


def _concurrency_cases():
    methods = {
        "nonshared": {},
        "fullshared": {},
        "kvcmas": {},
        "kvcomm": {},
        "graphflow": {},
        "cacheblend": {"rho": 0.5},
        "droidspeak": {"rho": 0.5, "layer_profile": [0.0, 2.0, 0.5, 1.0]},
        "relaycaching": {"rho": 0.5},
    }
    return [
        *[_overlap(f"one Session, two threads at once: {m}", m, o, "session") for m, o in methods.items()],
        *[
            _overlap(f"one {m} instance, two Sessions in two threads at once", m, o, "method")
            for m, o in methods.items()
        ],
        Case(
            _THREADS,
            "build_cache on a Session running a turn in another thread",
            _build_during_turn,
            r"in use by a turn in another thread",
        ),
        Case(
            _THREADS,
            "a failed turn's rollback and another thread's turn",
            _rollback_across_threads,
            r"in use by a turn in another thread",
            lambda kept: kept,
        ),
        _threads_ok("kvcmas: a Session and an instance per thread", "kvcmas", {}, jobs=3),
        _threads_ok(
            "graphflow: a Session and an instance per thread", "graphflow", {"calibration_requests": 1}
        ),
        _one_after_another("kvcmas: one Session, turns from two threads one after another", "kvcmas", {}),
    ]


ADVERSARIAL_THREADS = _concurrency_cases()


@pytest.mark.parametrize("case", ADVERSARIAL_THREADS, ids=lambda c: c.name)
def test_adversarial_concurrency(case):
    assert_holds(case)


ADVERSARIAL = ADVERSARIAL_THREADS

"""The layout the server derives without layout fields (``serving/layout.py``, "Default layout"), on
requests shaped as ``examples/repeated_docs.jsonl``'s: each agent's system prompt, then a task
statement, the team notes and the earlier replies, each a user message behind a short label message
(``ChatTrajectory.request``'s default split). Issue 50: "the same rho on the server as the Session".

The task statement (one sentence, under :data:`~hf_kvshare.serving.layout.MIN_SEGMENT_TOKENS`) is a
slot of its own, computed by the task's first agent and found by the next: folded into every agent's
leading text (as it was), that text was new in every task, so the claim (one contiguous range) stopped
at position 0 and the notes and replies placed behind it were never claimed.
"""

from __future__ import annotations

from hf_kvshare.serving import layout as lay
from hf_kvshare.serving.host import Sharing
from hf_kvshare.serving.standin import engine

SYSTEMS = {"planner": "You plan the solution in three short steps.", "coder": "You write the Python code."}
TASKS = (
    "Write a function that checks whether a number is prime.",
    "Write a function that reverses the words of a sentence.",
)
NOTE = (
    "Team note 1 (coding standards): every function has a docstring that states its inputs, outputs "
    "and the errors it raises; names are lower_case_with_underscores."
)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def messages(agent: str, task: str, replies: dict[str, str]) -> list[dict[str, str]]:
    """An agent's chat request as ``ChatTrajectory.request`` splits it: labels and texts, each a message."""
    user = ["Task:\n", task, "\n\nNote:\n", NOTE]
    for name, reply in replies.items():
        user += [f"\n\n{name}:\n", reply]
    user.append("\n\nYour answer:")
    return [{"role": "system", "content": SYSTEMS[agent]}] + [{"role": "user", "content": c} for c in user]


def prompt_of(tokenizer, agent: str, task: str, replies: dict[str, str]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages(agent, task, replies), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def derived(tokenizer, prompt: list[int], known: dict[str, list[int]]) -> lay.ResolvedLayout:
    return lay.resolve(lay.RequestLayout(), prompt, lay.TokenInfo(tokenizer), known)


def spans(prompt: list[int], resolved: lay.ResolvedLayout) -> dict[str, list[int]]:
    return {s.slot: prompt[s.start : s.end] for s in resolved.segments}


def test_the_task_statement_is_a_slot_the_next_agent_finds_and_labels_stay_own_text(tokenizer):
    task = ids_of(tokenizer, TASKS[0])
    assert lay.MIN_MESSAGE_TOKENS <= len(task) < lay.MIN_SEGMENT_TOKENS  # one sentence: under a run's minimum
    planner = prompt_of(tokenizer, "planner", TASKS[0], {})
    first = derived(tokenizer, planner, {})
    new = {s.slot: planner[s.start : s.end] for s in first.segments if s.new}
    assert task in new.values() and ids_of(tokenizer, NOTE) in new.values()
    assert len(new) == 2  # the labels ("Task:", "Note:", "Your answer:") are the agent's own glue
    task_slot = next(name for name, ids in new.items() if ids == task)

    known = dict(new)
    known["planner-reply"] = ids_of(
        tokenizer, "1. Check small numbers. 2. Try divisors. 3. Return the answer."
    )
    coder = prompt_of(tokenizer, "coder", TASKS[0], {"planner": tokenizer.decode(known["planner-reply"])})
    second = derived(tokenizer, coder, known)
    assert not any(s.new for s in second.segments)  # everything shared is found, nothing new
    assert spans(coder, second)[task_slot] == task  # the task statement, where the coder's prompt has it
    # the coder's own text before it: its system prompt and the template's glue, no task text
    own = coder[: second.segments[0].start]
    assert tokenizer.decode(own).count("Task:") == 1 and TASKS[0] not in tokenizer.decode(own)


def test_an_agents_leading_text_is_the_same_in_every_task(tokenizer):
    """What prefix reuse keys kept text by (its exact token ids): with the task statement a slot, the
    agent's leading text before it is the same in the next task, so it is placed again."""
    leading = []
    for task in TASKS:
        prompt = prompt_of(tokenizer, "planner", task, {})
        first = derived(tokenizer, prompt, {})
        assert prompt[first.segments[0].start : first.segments[0].end] == ids_of(tokenizer, task)
        leading.append(prompt[: first.segments[0].start])
    assert leading[0] == leading[1]


def test_a_short_message_slot_is_found_whole_only_never_inside_a_larger_message(tokenizer):
    """A slot under the run minimum (a task statement) is matched as a message of its own only: the same
    words inside a longer message are coincidence as likely as quotation, and stay that message's text."""
    planner = prompt_of(tokenizer, "planner", TASKS[0], {})
    first = derived(tokenizer, planner, {})
    known = {s.slot: planner[s.start : s.end] for s in first.segments if s.new}
    quoted = [
        {"role": "system", "content": SYSTEMS["coder"]},
        {"role": "user", "content": f"Earlier we were asked: {TASKS[0]} Now do it for lists of floats."},
    ]
    prompt = list(
        tokenizer.apply_chat_template(quoted, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    second = derived(tokenizer, prompt, known)
    assert [s.new for s in second.segments] == [True]  # the whole message, a new slot of the coder's


def test_the_next_agent_claims_past_the_task_statement_on_a_later_task(tiny_llama, tokenizer):
    """Through the serving host (FullShared with prefix reuse, no layout fields, one server-wide task):
    on the second task the coder's claim starts at 0 (its leading text kept from the first task) and
    runs past the task statement (placed from the planner's record) and the note. Before, the task
    statement was part of the coder's leading text, new in every task: nothing was claimed."""
    sharing = Sharing(tiny_llama, tokenizer, "fullshared", prefix_reuse=True)
    params = sharing.admit(None, sharing.salt)

    def run(rid: str, prompt: list[int]):
        plan = sharing.plan(rid, prompt, params, 0)
        assert plan.error is None, plan.error
        out, k, v = engine(tiny_llama, plan, max_new_tokens=4)
        sharing.record(plan, k, v, out, set())
        return plan, tokenizer.decode(out, skip_special_tokens=True)

    for t, task in enumerate(TASKS):
        planner, reply = run(f"p{t}", prompt_of(tokenizer, "planner", task, {}))
        coder, _ = run(f"c{t}", prompt_of(tokenizer, "coder", task, {"planner": reply}))

    def span_of(plan, text: str):
        return next(s for s in plan.turn.spans if s.token_ids.tolist() == ids_of(tokenizer, text))

    task_span, note_span = span_of(coder, TASKS[1]), span_of(coder, NOTE)
    assert task_span.kind == note_span.kind == "PH" and task_span.start < note_span.start
    assert coder.claim_start == 0 and coder.claim_end >= note_span.start + len(note_span.token_ids)
    # the planner's claim: its kept leading text, up to the new task statement it computes
    assert (planner.claim_start, planner.claim_end) == (0, span_of(planner, TASKS[1]).start)


def test_a_reply_cut_at_its_length_limit_is_found_at_the_start_of_its_message(tokenizer):
    """An output that stopped on its length is recorded without its last token (the engine never
    computed that token's K/V); the client passes the whole reply back as a message, which then starts
    with the slot: found there (before, a short slot had to be the whole message, and the reply became a
    new slot of the reader's, nothing placed)."""
    reply = "First check small numbers, then try the divisors."
    cut = ids_of(tokenizer, reply)[:-1]
    assert lay.MIN_MESSAGE_TOKENS <= len(cut) < lay.MIN_SEGMENT_TOKENS
    known = {"planner": cut}
    coder = prompt_of(tokenizer, "coder", TASKS[0], {"planner": reply})
    second = derived(tokenizer, coder, known)
    found = [s for s in second.segments if s.slot == "planner"]
    assert len(found) == 1 and coder[found[0].start : found[0].end] == cut
    assert tokenizer.decode(coder[found[0].end : found[0].end + 1]).strip()  # its last token: own text
    # not where it does not start a message: the same words inside a larger message stay its text
    quoted = [
        {"role": "system", "content": SYSTEMS["coder"]},
        {"role": "user", "content": f"The plan said: {reply} Follow it."},
    ]
    prompt = list(
        tokenizer.apply_chat_template(quoted, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    assert not any(s.slot == "planner" for s in derived(tokenizer, prompt, known).segments)


def test_a_very_short_reply_cut_at_its_limit_is_found_where_it_is_most_of_its_message(tokenizer):
    """A reply under ``MIN_MESSAGE_TOKENS`` (``bench serve``'s trace: 8 output tokens, recorded as 7) is
    found at the start of the message it is most of; not at the start of a longer one."""
    reply = "Check small numbers, then divisors."
    ids = ids_of(tokenizer, reply)
    cut = ids[:-1]
    assert len(cut) < lay.MIN_MESSAGE_TOKENS <= len(ids)
    coder = prompt_of(tokenizer, "coder", TASKS[0], {"planner": reply})
    assert [
        coder[s.start : s.end] for s in derived(tokenizer, coder, {"p": cut}).segments if s.slot == "p"
    ] == [cut]
    longer = prompt_of(tokenizer, "coder", TASKS[0], {"planner": reply + " Then write the tests for it."})
    assert not any(s.slot == "p" for s in derived(tokenizer, longer, {"p": cut}).segments)

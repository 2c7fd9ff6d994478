"""The content matcher (hf_kvshare.matching): runs of a prompt that repeat runs of the request's slots,
found by token ids alone (no model), longest first, each prompt / slot token used once, bounded work;
and a piece of a slot as a slot of its own (Request.piece_slot)."""

from __future__ import annotations

import random

import pytest
import torch

from hf_kvshare import get_method
from hf_kvshare.cache import SegmentKV
from hf_kvshare.matching import WORK_PER_TOKEN, Piece, match, piece_name, window_hashes
from hf_kvshare.request import NewSlots, Request
from hf_kvshare.turn import Slot


def tokens(n, seed, vocab=5000):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def naive_longest_common_run(a, b):
    best = 0
    for i in range(len(a)):
        for j in range(len(b)):
            k = 0
            while i + k < len(a) and j + k < len(b) and a[i + k] == b[j + k]:
                k += 1
            best = max(best, k)
    return best


def test_rolling_hashes_are_the_windows_hashes():
    ids = tokens(50, 1, vocab=7)
    k = 5
    hashes = window_hashes(ids, k)
    assert len(hashes) == len(ids) - k + 1
    for i in range(len(hashes)):
        for j in range(len(hashes)):
            if ids[i : i + k] == ids[j : j + k]:
                assert hashes[i] == hashes[j]
    assert window_hashes(ids[:3], 5) == []


def test_a_span_inside_a_message_is_found_exactly_where_it_is():
    doc, glue, tail = tokens(300, 1), tokens(12, 2), tokens(9, 3)
    prompt = glue + doc[40:250] + tail
    found = match(prompt, {"doc": doc}, min_tokens=16)
    assert found.pieces == [Piece(prompt_start=len(glue), slot="doc", slot_start=40, slot_end=250)]
    (p,) = found.pieces
    assert prompt[p.prompt_start : p.prompt_end] == doc[p.slot_start : p.slot_end]
    assert not found.exhausted and found.covered() == 210


def test_a_reply_retokenized_at_one_place_is_found_as_the_pieces_around_it():
    """The model generated one "\\n\\n" token; the client's text re-tokenizes it to two "\\n"."""
    NN, NL = 1116, 198
    reply = tokens(40, 4) + [NN] + tokens(30, 5)
    prompt = tokens(20, 6) + reply[:40] + [NL, NL] + reply[41:] + tokens(5, 7)
    pieces = match(prompt, {"a1": reply}, min_tokens=16).pieces
    assert [(p.slot, p.slot_start, p.slot_end, p.prompt_start) for p in pieces] == [
        ("a1", 0, 40, 20),
        ("a1", 41, 71, 62),
    ]


def test_longest_first_each_prompt_token_once_and_clipped_overlaps():
    a, b = tokens(100, 8), tokens(60, 9)
    # "long" holds a's first 80 tokens then b's 60: the prompt holds a[0:100] then b
    long_src = a[:80] + b
    prompt = a + b
    pieces = match(prompt, {"a": a, "long": long_src}, min_tokens=16).pieces
    # long's runs in the prompt are a[0:80] at 0 and b at 100 (80 and 60 tokens); a's run is 100: a
    # first, long's a[0:80] lies inside it (dropped), long's b after it
    assert pieces == [Piece(0, "a", 0, 100), Piece(100, "long", 80, 140)]
    covered = [0] * len(prompt)
    for p in pieces:
        for i in range(p.prompt_start, p.prompt_end):
            covered[i] += 1
    assert max(covered) == 1


def test_a_partial_overlap_is_clipped_to_its_free_run():
    x = tokens(200, 10)
    src1 = x[0:120]  # prompt [0, 120)
    src2 = x[90:200]  # prompt [90, 200): overlaps the first in [90, 120)
    pieces = match(x, {"s1": src1, "s2": src2}, min_tokens=16).pieces
    assert pieces == [Piece(0, "s1", 0, 120), Piece(120, "s2", 30, 110)]
    # clipped below the minimum: dropped
    src3 = x[110:130]
    pieces = match(x[:130], {"s1": src1, "s3": src3}, min_tokens=16).pieces
    assert pieces == [Piece(0, "s1", 0, 120)]


def test_a_slot_the_prompt_holds_twice_is_placed_once():
    doc = tokens(50, 11)
    prompt = doc + tokens(7, 12) + doc[:30]
    pieces = match(prompt, {"doc": doc}, min_tokens=16).pieces
    assert pieces == [Piece(0, "doc", 0, 50)]  # the longest; the second copy is the agent's text
    # two slots of the same text: the earlier-named one, once; the other finds only the second copy
    pieces = match(doc + tokens(7, 12) + doc, {"first": doc, "second": doc}, min_tokens=16).pieces
    assert pieces == [Piece(0, "first", 0, 50), Piece(57, "second", 0, 50)]


def test_a_short_slot_is_matched_whole_only():
    short = tokens(5, 13)
    prompt = tokens(10, 14) + short + tokens(10, 15) + short[:4]
    assert match(prompt, {"s": short}, min_tokens=16).pieces == [Piece(10, "s", 0, 5)]
    assert match(prompt, {"s": []}, min_tokens=16).pieces == []
    with pytest.raises(ValueError, match="min_tokens"):
        match(prompt, {"s": short}, min_tokens=0)


@pytest.mark.parametrize("seed", range(6))
def test_the_longest_piece_is_the_longest_common_run(seed):
    rng = random.Random(seed)
    src = [rng.randrange(4) for _ in range(60)]
    prompt = [rng.randrange(4) for _ in range(20)] + src[rng.randrange(10) :][:35] + [rng.randrange(4)] * 5
    pieces = match(prompt, {"s": src}, min_tokens=6, max_work=10**9).pieces
    assert max((p.length for p in pieces), default=0) == naive_longest_common_run(prompt, src)
    for p in pieces:
        assert prompt[p.prompt_start : p.prompt_end] == src[p.slot_start : p.slot_end] and p.length >= 6


def test_work_is_bounded_on_repetitive_text():
    """A long run of one token in the prompt and in a slot: every alignment matches, a naive search
    is quadratic; the matcher stops at its bound and keeps what it found."""
    n = 20_000
    prompt, src = [7] * n, [7] * n
    found = match(prompt, {"s": src}, min_tokens=16)
    assert found.work <= WORK_PER_TOKEN * 2 * n + n + 16
    assert found.pieces and found.pieces[0].length == n  # the first alignment found is the whole run
    capped = match(prompt, {"s": src}, min_tokens=16, max_work=1000)
    assert capped.exhausted and capped.work <= 1000 + n + 1
    # ordinary text: far below the bound
    doc = tokens(5000, 16)
    ordinary = match(tokens(300, 17) + doc + tokens(300, 18), {"doc": doc, "other": tokens(5000, 19)})
    assert not ordinary.exhausted and ordinary.work < 5 * 5600


# ------------------------------------------------------------------ pieces of slots


class _Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


def _kv(n, start, layers=2):
    torch.manual_seed(0)
    return SegmentKV(
        keys=[torch.randn(1, 2, n, 4) for _ in range(layers)],
        values=[torch.randn(1, 2, n, 4) for _ in range(layers)],
        start=start,
        agent="a1",
    )


def test_a_piece_of_a_slot_is_a_slot_with_the_parents_slice():
    request = Request(model=None, tokenizer=_Tok())
    parent = Slot("a1", torch.arange(10, 30), "reply", producer="a1", latest=_kv(20, start=7))
    request.slots["a1"] = parent
    new = NewSlots()
    piece = request.piece_slot("a1", 5, 15, new)
    assert piece.name == piece_name("a1", 5, 15) == "a1[5:15]" and new.slots == {"a1[5:15]": piece}
    assert piece.producer == "a1" and piece.kind is None and piece.piece_of == ("a1", 5, 15)
    assert torch.equal(piece.token_ids, torch.arange(15, 25))
    assert piece.latest.start == 12 and piece.latest.length == 10
    for k, pk in zip(parent.latest.keys, piece.latest.keys):
        assert (
            torch.equal(pk, k[:, :, 5:15])
            and pk.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
        )
    assert request.piece_slot("a1", 5, 15, new) is piece  # once per name
    assert request.piece_slot("a1", 0, 20, new) is parent  # the whole slot is itself
    for bad in ((5, 5), (-1, 3), (3, 21)):
        with pytest.raises(ValueError, match="not a piece"):
            request.piece_slot("a1", *bad, new)
    with pytest.raises(KeyError, match="no slot"):
        request.piece_slot("nope", 0, 3, new)
    request.slots["img"] = Slot("img", torch.arange(8), "", kind="observation", visual=object())
    with pytest.raises(ValueError, match="image"):
        request.piece_slot("img", 0, 3, new)
    # a parent without K/V: a piece without K/V (the reader computes it; its record keeps it)
    request.slots["doc"] = Slot("doc", torch.arange(40), "doc", kind="observation")
    assert request.piece_slot("doc", 0, 20, new).latest is None


def test_a_session_reads_a_piece_named_by_its_slot_and_range(tiny_llama, tokenizer):
    """The Python API: ``PH("<slot>[s:e]")`` reads tokens [s, e) of a held slot (its K/V moved to where
    the piece sits); NonShared stays plain generate's; a range outside the slot is refused clearly."""
    from hf_kvshare import PF, PH, Session

    doc = "The river Lune reaches the sea at Plover Scar near Glasson, by the lighthouse on the Scar."
    outputs = {}
    for method in ("nonshared", "fullshared"):
        session = Session(tiny_llama, tokenizer, method=method)
        session.run_turn("a1", [PF("You plan.\n"), PH("doc", doc), PF("\nWhere?")], max_new_tokens=4)
        result = session.run_turn(
            "a2", [PF("Quote:\n"), PH("doc[3:12]"), PF("\nWho?")], max_new_tokens=6, keep_cache=True
        )
        piece = session.slots["doc[3:12]"]
        assert piece.piece_of == ("doc", 3, 12)
        assert torch.equal(piece.token_ids, session.slots["doc"].token_ids[3:12])
        row = next(s for s in result.segments if s.name == "doc[3:12]")
        assert row.provenance == ("reused" if method == "fullshared" else "dense")
        outputs[method] = result
        with pytest.raises(ValueError, match="not a piece"):
            session.run_turn("a3", [PH("doc[3:999]"), PF("\nWho?")], max_new_tokens=2)
    plain_ids = outputs["nonshared"].prompt_ids[None]
    with torch.no_grad():
        plain = tiny_llama.generate(
            input_ids=plain_ids, attention_mask=torch.ones_like(plain_ids), max_new_tokens=6, do_sample=False
        )
    assert outputs["nonshared"].output_ids.tolist() == plain[0, plain_ids.shape[1] :].tolist()


@pytest.mark.parametrize("method", ["droidspeak", "relaycaching"])
def test_a_piece_reads_its_rows_of_the_parents_kept_hidden_states(tiny_llama, tokenizer, method):
    """Methods that keep each slot's input hidden states (DroidSpeak, RelayCaching) read a piece's rows of
    its parent's until the piece is recorded on its own (before: "keeps no input hidden state")."""
    from hf_kvshare import PF, PH, Session

    doc = "The river Lune reaches the sea at Plover Scar near Glasson, by the lighthouse on the Scar."
    from tiny import METHOD_OPTIONS

    fit = {"relaycaching": {"band": (0.0, 1.0)}, "droidspeak": {"layer_profile": [0.0, 2.0, 0.5]}}  # 3 layers
    options = dict(METHOD_OPTIONS[method], **fit[method])
    session = Session(tiny_llama, tokenizer, method=get_method(method, **options), match_text=False)
    session.run_turn("a1", [PF("You plan.\n"), PH("doc", doc), PF("\nWhere?")], max_new_tokens=4)
    result = session.run_turn("a2", [PF("Quote:\n"), PH("doc[3:12]"), PF("\nWho?")], max_new_tokens=3)
    assert result.output_ids.numel() == 3
    assert any(s.name == "doc[3:12]" for s in result.segments)

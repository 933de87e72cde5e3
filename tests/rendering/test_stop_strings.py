"""rendering.stop_strings: vLLM's stop-string rules and the streaming hold-back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rendering.stop_strings import StopStrings, buffer_length, stop_list


def vllm_reference(pieces: list[str], stop: list[str], include: bool, min_tokens: int = 0) -> tuple[str, str | None]:
    """vLLM 0.32's detokenizer loop, written plainly: the whole text, checked after every token;
    of the stop strings in the new window the one ending first wins, ties in list order."""
    text = ""
    for count, piece in enumerate(pieces, start=1):
        text += piece
        if not piece or count <= min_tokens:
            continue
        found = []
        for order, s in enumerate(stop):
            at = text.find(s, max(0, len(text) - len(piece) - len(s) + 1))
            if at >= 0:
                found.append((at + len(s), order, at, s))
        if found:
            end, _, at, s = min(found)
            return text[: end if include else at], s
    return text, None


def run(pieces: list[str], stop: list[str], include: bool = False, min_tokens: int = 0) -> tuple[list[str], str | None]:
    checker = StopStrings(stop, include_stop_str_in_output=include)
    sent: list[str] = []
    for count, piece in enumerate(pieces, start=1):
        sent.append(checker.feed(piece, check=count > min_tokens))
        if checker.matched is not None:
            break
    else:
        sent.append(checker.flush())
    return sent, checker.matched


def test_stop_list_and_buffer_length() -> None:
    assert stop_list(None) == () and stop_list([]) == () and stop_list("x") == ("x",)
    assert stop_list(["a", "bc"]) == ("a", "bc")
    assert buffer_length(("a", "bcd"), False) == 2
    assert buffer_length(("a", "bcd"), True) == 0
    assert buffer_length((), False) == 0


def test_trims_at_the_match() -> None:
    sent, matched = run(["hello", " wor", "ld"], ["world"])
    assert "".join(sent) == "hello " and matched == "world"


def test_include_stop_str_in_output_keeps_it() -> None:
    sent, matched = run(["hello", " wor", "ld", "!"], ["world"], include=True)
    assert "".join(sent) == "hello world" and matched == "world"


def test_a_match_inside_one_piece_cuts_the_rest_of_it() -> None:
    sent, matched = run(["abcSTOPdef"], ["STOP"])
    assert "".join(sent) == "abc" and matched == "STOP"
    sent, matched = run(["abcSTOPdef"], ["STOP"], include=True)
    assert "".join(sent) == "abcSTOP"


def test_the_stop_string_ending_first_wins_then_list_order() -> None:
    # both match in the same new text: vLLM 0.32 takes the one that ends first
    sent, matched = run(["xab"], ["b", "a"])
    assert matched == "a" and "".join(sent) == "x"
    sent, matched = run(["xabc"], ["bc", "abc"])  # both end at the same place: list order
    assert matched == "bc" and "".join(sent) == "xa"
    sent, matched = run(["xabc"], ["abc", "bc"])
    assert matched == "abc" and "".join(sent) == "x"


def test_streaming_holds_back_what_could_start_a_stop_string() -> None:
    checker = StopStrings(["END"])
    assert checker.feed("abc") == "a"  # "bc" could be the start of "END"... held: 2 characters
    assert checker.held == 2
    assert checker.feed("E") == "b"
    assert checker.feed("N") == "c"
    assert checker.feed("x") == "E"  # "ENx" is no longer "END"
    assert checker.flush() == "Nx"
    assert checker.matched is None


def test_a_partial_stop_string_is_never_sent_when_it_completes() -> None:
    checker = StopStrings(["END"])
    out = [checker.feed(p) for p in ["ab", "E", "N", "D", "more"]]
    assert "".join(out) == "ab" and checker.matched == "END"
    assert checker.feed("late") == "" and checker.flush() == ""


def test_no_hold_back_with_include_stop_str_in_output() -> None:
    checker = StopStrings(["END"], include_stop_str_in_output=True)
    assert checker.feed("abE") == "abE"
    assert checker.feed("ND") == "ND" and checker.matched == "END"


def test_a_stop_string_spanning_pieces_is_found() -> None:
    sent, matched = run(["he", "ll", "o wo", "r", "ld"], ["lo w"])
    assert "".join(sent) == "hel" and matched == "lo w"


def test_min_tokens_delays_the_check() -> None:
    # the stop string arrives with token 2, but min_tokens=2: checks start after it
    sent, matched = run(["a", "STOP", "b", "STOP"], ["STOP"], min_tokens=2)
    assert matched == "STOP" and "".join(sent) == "aSTOPb"


def test_empty_pieces_change_nothing() -> None:
    checker = StopStrings(["xy"])
    assert checker.feed("") == "" and checker.held == 0
    assert checker.feed("ax") == "a" and checker.feed("") == "" and checker.held == 1


def test_needs_a_stop_string() -> None:
    with pytest.raises(ValueError):
        StopStrings([])


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abcXYZ€ ", max_size=5), max_size=25),
    stop=st.lists(st.text(alphabet="abcXYZ€ ", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    min_tokens=st.integers(min_value=0, max_value=3),
)
def test_matches_vllms_loop_and_never_sends_text_it_later_cuts(
    pieces: list[str], stop: list[str], include: bool, min_tokens: int
) -> None:
    sent, matched = run(pieces, stop, include, min_tokens)
    want_text, want_stop = vllm_reference(pieces, stop, include, min_tokens)
    assert matched == want_stop
    # every delta is a continuation of the final text: nothing sent is ever taken back
    assert "".join(sent) == want_text
    if not include:
        for k in range(len(sent)):
            so_far = "".join(sent[: k + 1])
            assert want_text.startswith(so_far)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abXY", max_size=4), max_size=20),
    stop=st.lists(st.text(alphabet="abXY", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_streamed_text_is_vllms_text_minus_the_buffer_after_every_token(
    pieces: list[str], stop: list[str], include: bool
) -> None:
    """vLLM streams ``output_text[:len - output_text_buffer_length]`` while a choice runs."""
    checker = StopStrings(stop, include_stop_str_in_output=include)
    hold = buffer_length(stop, include)
    text = ""
    sent = ""
    for piece in pieces:
        sent += checker.feed(piece)
        if checker.matched is not None:
            break
        text += piece
        assert sent == text[: max(0, len(text) - hold)]

"""Stop strings: matches across chunk and token boundaries, hold-back of partial matches, token cut."""

import pytest

from mtpserve.server.stop_strings import StopHit, StopStringMatcher


def _hit(matcher: StopStringMatcher) -> StopHit:
    assert matcher.hit is not None, "no stop string matched"
    return matcher.hit


def _run(stops, pieces) -> tuple[str, StopStringMatcher]:
    matcher = StopStringMatcher(stops)
    shown = [matcher.feed(p) for p in pieces]
    if matcher.hit is None:
        shown.append(matcher.flush())
    return "".join(shown), matcher


@pytest.mark.parametrize("pieces", [["hello END world"], ["hello E", "N", "D world"], ["hello EN", "D"],
                                    list("hello END world")])
def test_match_anywhere_truncates_before_stop(pieces):
    text, matcher = _run(["END"], pieces)
    assert text == "hello "
    assert _hit(matcher).stop == "END"


def test_partial_match_is_held_then_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == "abc "
    assert matcher.feed("ART") == "START"
    assert matcher.hit is None


def test_held_tail_flushed_at_end():
    text, matcher = _run(["STOP"], ["the end ST"])
    assert text == "the end ST" and matcher.hit is None


def test_earliest_of_several_stops_wins():
    text, matcher = _run(["world", "lo w"], ["hello world"])
    assert text == "hel" and _hit(matcher).stop == "lo w"


def test_hit_end_is_relative_to_the_last_fed_text():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("line one\n") == "line one"  # the newline might start "\n\n"
    assert matcher.feed("\nmore") == ""
    assert _hit(matcher).end_in_fed == 1


def test_no_stops_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == "abc" and matcher.flush() == ""


def test_include_stop_keeps_the_stop_string():
    matcher = StopStringMatcher(["END"], include_stop=True)
    assert matcher.feed("abc E") == "abc " and matcher.feed("ND more") == "END"
    assert _hit(matcher).stop == "END"

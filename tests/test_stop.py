"""Stop strings: the streaming matcher always agrees with the non-streaming truncation."""

from __future__ import annotations

import random
import zlib

import pytest

from pocketllm.protocol.stop import StopMatcher, find_stop, truncate_at_stop


def _stream(stops: list[str], deltas: list[str]) -> tuple[list[str], str, StopMatcher]:
    """Push every delta; return the emitted pieces, the flushed tail and the matcher."""
    matcher = StopMatcher(stops)
    pieces = []
    for delta in deltas:
        piece, stopped = matcher.push(delta)
        pieces.append(piece)
        assert stopped == matcher.stopped
    return pieces, matcher.flush(), matcher


def _random_split(text: str, rng: random.Random) -> list[str]:
    """Cut ``text`` into random pieces, empty pieces included."""
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, len(text) + 2)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_truncate_at_stop():
    assert truncate_at_stop("Hello USER: more", ["USER:"]) == "Hello "
    assert truncate_at_stop("abc", []) == "abc"
    assert truncate_at_stop("abc", [""]) == "abc"
    assert truncate_at_stop("xaby", ["b", "ab"]) == "x"  # earliest start wins, whatever the list order
    assert truncate_at_stop("stop", ["stop"]) == ""
    assert find_stop("xaby", ["b", "ab"]) == (1, "ab")
    assert find_stop("abcd", ["abc", "ab"]) == (0, "ab")  # same start: the shortest
    assert find_stop("abcd", ["z"]) is None


def test_stop_straddling_deltas():
    pieces, tail, matcher = _stream(["USER:"], ["Sure.", " US", "E", "R", ": next", " more"])
    assert pieces == ["Sure.", " ", "", "", "", ""]
    assert tail == "" and matcher.matched == "USER:"


def test_partial_is_held_then_released():
    matcher = StopMatcher(["</s>"])
    assert matcher.push("hello <") == ("hello ", False)
    assert matcher.held == "<"
    assert matcher.push("/") == ("", False)
    assert matcher.push("x>") == ("</x>", False)
    assert matcher.push(" end </") == (" end ", False)
    assert matcher.flush() == "</"  # generation ended: the partial can no longer complete
    assert matcher.matched is None and not matcher.stopped


def test_nothing_held_when_tail_cannot_start_a_stop():
    matcher = StopMatcher(["xyz", "###"])
    for delta in ["abc", " def", "x!", "#a"]:
        assert matcher.push(delta) == (delta, False)
    assert matcher.flush() == ""


def test_after_stop_everything_is_dropped():
    matcher = StopMatcher(["END"])
    assert matcher.push("one END two") == ("one ", True)
    assert matcher.push("three") == ("", True)
    assert matcher.flush() == ""
    assert matcher.matched == "END"


def test_no_stops_pass_through():
    for stops in ([], [""], ("", "")):
        matcher = StopMatcher(stops)
        assert matcher.push("a</s>b") == ("a</s>b", False)
        assert matcher.push("") == ("", False)
        assert matcher.flush() == ""


def test_earlier_partial_beats_later_complete_match():
    # "bc" completes first, but "abcd" started earlier and may still complete: wait for it.
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("xabc") == ("x", False)
    assert matcher.push("d") == ("", True)
    assert matcher.matched == "abcd"
    # When the earlier one fails, the later complete match ends the text.
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("xabc") == ("x", False)
    assert matcher.push("e") == ("a", True)
    assert matcher.matched == "bc"
    # And if generation ends while waiting, flush still cuts at the complete match.
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.push("xabc") == ("x", False)
    assert matcher.flush() == "a"
    assert matcher.matched == "bc" and matcher.stopped


def test_overlapping_and_prefix_stops():
    assert _stream(["ab", "b"], ["xa", "b"])[0] == ["x", ""]
    assert _stream(["ab", "b"], ["xb"])[0] == ["x"]
    pieces, tail, matcher = _stream(["a", "aa", "aaa"], ["xa"])
    assert pieces == ["x"] and matcher.matched == "a"
    pieces, tail, matcher = _stream(["aaa", "aa"], ["xa", "a"])
    assert pieces == ["x", ""] and matcher.matched == "aa"


def test_hold_is_bounded_by_longest_stop():
    matcher = StopMatcher(["<|im_end|>", "\n\n"])
    emitted = ""
    pushed = ""
    for delta in ["<", "|im", "_en", "d", "|", "x", "\n", "y", "<|im_e"]:
        pushed += delta
        piece, stopped = matcher.push(delta)
        emitted += piece
        assert not stopped
        assert len(pushed) - len(emitted) < len("<|im_end|>")
    assert emitted + matcher.flush() == pushed


STOP_SETS = [
    ["ab", "b"],
    ["abcd", "bc"],
    ["a", "aa", "aaa"],
    ["aab", "ab"],
    ["abab", "bab"],
    ["cab", "abc", "bca"],
    ["aaab", "aab", "b"],
    ["abc"],
    ["c"],
    [],
    ["", "ba"],
]


@pytest.mark.parametrize("stops", STOP_SETS, ids=lambda s: "|".join(s) or "none")
def test_streaming_equals_non_streaming_for_random_splits(stops):
    rng = random.Random(zlib.crc32("|".join(stops).encode()))
    longest = max((len(s) for s in stops), default=0)
    for _ in range(400):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        deltas = _random_split(text, rng)
        matcher = StopMatcher(stops)
        emitted, pushed = "", ""
        for delta in deltas:
            piece, stopped = matcher.push(delta)
            emitted += piece
            pushed += delta
            if not stopped:
                assert len(pushed) - len(emitted) <= max(longest - 1, 0)
        emitted += matcher.flush()
        assert emitted == truncate_at_stop(text, stops), (text, deltas)
        found = find_stop(text, stops)
        assert matcher.matched == (found[1] if found else None), (text, deltas)


def test_streaming_equals_non_streaming_with_random_stops():
    rng = random.Random(1234)
    for _ in range(1500):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 4)))
                 for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice("abx") for _ in range(rng.randint(0, 16)))
        deltas = _random_split(text, rng)
        pieces, tail, matcher = _stream(stops, deltas)
        assert "".join(pieces) + tail == truncate_at_stop(text, stops), (stops, text, deltas)
        found = find_stop(text, stops)
        assert matcher.matched == (found[1] if found else None), (stops, text, deltas)

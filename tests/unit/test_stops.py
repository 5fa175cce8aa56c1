"""Stop sequences: generated text cut at the first one, held back while it may begin one."""

from __future__ import annotations

from worker.stops import StopText


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    text = StopText(stops)
    out = []
    for piece in pieces:
        sent = text.feed(piece)
        if sent:
            out.append(sent)
        if text.stopped:
            break
    if not text.stopped and (rest := text.flush()):
        out.append(rest)
    return out, text.stopped


def test_text_before_the_first_stop_goes_out_and_nothing_after() -> None:
    out, stopped = run(["END"], [" one", " two END three", " four"])
    assert "".join(out) == " one two "
    assert stopped


def test_a_stop_string_across_pieces_is_held_back_then_cut() -> None:
    out, stopped = run(["\nUser:"], [" hello", " world\nU", "se", "r: next"])
    assert out == [" hello", " world"]
    assert stopped


def test_a_held_end_that_turns_out_not_to_stop_goes_out() -> None:
    out, stopped = run(["\nUser:"], [" a\nU", "nder the sea"])
    assert out == [" a", "\nUnder the sea"]
    assert not stopped


def test_the_earliest_of_several_stops_wins() -> None:
    out, _ = run(["three", "two"], [" one two three"])
    assert out == [" one "]


def test_the_end_held_at_the_end_of_generation_is_flushed() -> None:
    out, stopped = run(["xyz"], [" ab", " x"])
    assert "".join(out) == " ab x"
    assert not stopped


def test_no_stops_and_empty_stops_pass_everything() -> None:
    for stops in ([], [""]):
        out, stopped = run(stops, [" a", " b"])
        assert out == [" a", " b"]
        assert not stopped

"""The status line of long work (megatron_lite.progress): plain lines in logs, one line
rewritten in place on a terminal, and stdout left alone."""

from __future__ import annotations

import io
import sys

from megatron_lite.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _simulate_two_systems(stream, clock) -> None:
    for system in ("ZeRO-3", "ZeRO++"):
        with Progress(f"simulating {system} as rank 0 of 64", stream=stream,
                      clock=clock) as progress:
            progress.update("setting up")
            for i in range(1, 4):
                clock.now += 20
                progress.update(f"iteration {i} of 3")


def _visible(text: str) -> str:
    """What a terminal shows on the last line: "\\r" returns to column 0 and overwrites."""
    screen: list[str] = []
    column = 0
    for char in text.split("\n")[-1]:
        if char == "\r":
            column = 0
            continue
        if column < len(screen):
            screen[column] = char
        else:
            screen.append(char)
        column += 1
    return "".join(screen)


def test_a_log_gets_one_line_per_system_and_iteration():
    stream, clock = io.StringIO(), Clock()
    _simulate_two_systems(stream, clock)
    text = stream.getvalue()
    assert "\r" not in text
    assert text.splitlines() == [
        "simulating ZeRO-3 as rank 0 of 64: setting up (0 s)",
        "simulating ZeRO-3 as rank 0 of 64: iteration 1 of 3 (20 s)",
        "simulating ZeRO-3 as rank 0 of 64: iteration 2 of 3 (40 s)",
        "simulating ZeRO-3 as rank 0 of 64: iteration 3 of 3 (60 s)",
        "simulating ZeRO++ as rank 0 of 64: setting up (0 s)",
        "simulating ZeRO++ as rank 0 of 64: iteration 1 of 3 (20 s)",
        "simulating ZeRO++ as rank 0 of 64: iteration 2 of 3 (40 s)",
        "simulating ZeRO++ as rank 0 of 64: iteration 3 of 3 (60 s)",
    ]


def test_a_terminal_gets_one_line_rewritten_in_place_and_cleared(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    stream, clock = FakeTerminal(), Clock()
    with Progress("simulating ZeRO++ as rank 0 of 64", stream=stream, clock=clock) as progress:
        assert progress.in_place
        progress.update("setting up")
        clock.now += 5
        progress.update("iteration 12 of 30")
        clock.now += 5
        progress.update("iteration 2 of 3")  # shorter: the rest of the longer one is blanked
        during = stream.getvalue()
        assert "\n" not in during
        assert during.count("\r") == 3
        assert _visible(during).rstrip() == (
            "simulating ZeRO++ as rank 0 of 64: iteration 2 of 3 (10 s)")
    after = stream.getvalue()
    assert after.endswith("\r") and "\n" not in after
    assert _visible(after).strip() == ""  # cleared: what prints next starts a clean line


def test_a_terminal_line_is_cut_to_the_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    stream = FakeTerminal()
    Progress("simulating a very long description of the work", stream=stream).update("x")
    assert len(_visible(stream.getvalue())) == 39


def test_nothing_goes_to_stdout_and_stderr_is_the_default(capsys):
    with Progress("simulating ZeRO-3 as rank 0 of 8") as progress:
        progress.update("iteration 1 of 3")
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("simulating ZeRO-3 as rank 0 of 8: iteration 1 of 3 (")
    assert Progress("x", stream=sys.stderr, in_place=True).in_place  # forced either way


def test_a_stream_without_isatty_or_closed_is_not_a_terminal():
    class Bare:
        def write(self, text):
            pass

        def flush(self):
            pass

    closed = io.StringIO()
    closed.close()
    assert not Progress("x", stream=Bare()).in_place
    assert not Progress("x", stream=closed).in_place

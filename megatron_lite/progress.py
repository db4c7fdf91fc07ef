"""Where long work is: one status line on stderr.

The simulated GPU cluster (``megatron_lite.simulate``) runs for minutes per system on large
models, and ``--dry-run`` and ``scripts.bench.paper_memory`` print their tables only at the
end. A ``Progress`` says what is running and for how long. On a terminal the line is rewritten
in place (carriage return) and cleared when the work ends, so the table printed next on
stdout starts on a clean line; elsewhere (a log file, a pipe) each update is a line of its
own, so the log stays readable. stdout is never written: the tables stay what they were.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """``what`` (the work), then each ``update``'s status and the seconds since the start:

        simulating ZeRO++ as rank 0 of 64: iteration 2 of 3 (41 s)

    ``stream`` defaults to ``sys.stderr`` at construction; ``in_place`` to whether the
    stream is a terminal. Use it as a context manager, or call ``close()`` when done.
    """

    def __init__(self, what: str, stream: TextIO | None = None, in_place: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.stream = sys.stderr if stream is None else stream
        self.in_place = _is_terminal(self.stream) if in_place is None else in_place
        self._clock = clock
        self._started = clock()
        self._shown = 0  # characters of the line now on the terminal

    def update(self, status: str) -> None:
        line = f"{self.what}: {status} ({self._clock() - self._started:.0f} s)"
        if not self.in_place:
            self.stream.write(line + "\n")
        else:
            # A line wider than the terminal would wrap, and "\r" returns to its last row.
            line = line[: max(shutil.get_terminal_size().columns - 1, 20)]
            self.stream.write("\r" + line.ljust(self._shown))
            self._shown = len(line)
        self.stream.flush()

    def close(self) -> None:
        """On a terminal, blank the line and return to its start; elsewhere nothing."""
        if self.in_place and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

"""The one progress bar of pagedkv's commands (`pagedkv verify`, `pagedkv run`), on stderr.

On a terminal it redraws one line in place, at most ten times a second:

    serving  [#########.....................]      14/48 req     3.1 req/s  step 52, pool 97%

Elsewhere (a log file, CI) it writes a line at each tenth of the total and one at the end, so
that a log shows progress without carriage returns. Standard library only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

REDRAW_SECONDS = 0.1
"""The shortest time between two redraws on a terminal; before it, no rate is shown."""


class ProgressBar:
    """Progress towards `total` units (steps, requests), drawn on `stream`.

    `update(done)` sets how many units are done, `advance(n)` adds to it; `close()` (or leaving
    a `with` block) draws the last state and ends the line. A disabled bar draws nothing.
    """

    def __init__(
        self,
        total: int,
        *,
        unit: str,
        label: str = "",
        stream: TextIO | None = None,
        enabled: bool = True,
        width: int = 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(total, 1)
        self.unit = unit
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.width = width
        self.tty = self.stream.isatty()
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.detail = ""
        self.last_draw = -REDRAW_SECONDS
        self.last_tenth = -1
        self.last_drawn: int | None = None
        self.closed = False

    def update(self, done: int, detail: str | None = None) -> None:
        """Set the units done (and the text after the rate, when given); redraw if it is time."""
        self.done = done
        if detail is not None:
            self.detail = detail
        self._draw(final=False)

    def advance(self, units: int = 1, detail: str | None = None) -> None:
        """Add `units` to the units done."""
        self.update(self.done + units, detail)

    def close(self) -> None:
        """Draw the final state and end the line (once)."""
        if not self.closed:
            self.closed = True
            self._draw(final=True)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def line(self) -> str:
        """The bar's text for the current state, without the line ending."""
        fraction = min(self.done / self.total, 1.0)
        elapsed = self.clock() - self.start
        rate = self.done / elapsed if elapsed >= REDRAW_SECONDS else None
        total = f"{self.total:,}" if self.total < 10**15 else "?"
        shown = "      -" if rate is None else f"{rate:>7,.1f}" if rate < 100 else f"{rate:>7,.0f}"
        text = f"{self.done:>9,}/{total} {self.unit}  {shown} {self.unit}/s"
        if self.detail:
            text += f"  {self.detail}"
        label = f"{self.label}  " if self.label else ""
        if self.tty:
            filled = int(fraction * self.width)
            return f"{label}[{'#' * filled}{'.' * (self.width - filled)}] {text}"
        return f"{label}[{fraction:4.0%}] {text}"

    def _draw(self, *, final: bool) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if self.tty:
            if not final and now - self.last_draw < REDRAW_SECONDS:
                return
            self.last_draw = now
            self.stream.write(f"\r{self.line()}" + ("\n" if final else ""))
        else:
            tenth = int(min(self.done / self.total, 1.0) * 10)
            if (tenth <= self.last_tenth and not final) or (final and self.done == self.last_drawn):
                return
            self.last_tenth, self.last_drawn = tenth, self.done
            self.stream.write(f"{self.line()}\n")
        self.stream.flush()

"""The one progress bar of `pagedkv verify` and `pagedkv run` (`pagedkv.progress`)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from pagedkv.progress import ProgressBar

ROOT = Path(__file__).resolve().parent.parent


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_it_writes_a_line_per_tenth_and_the_last_state_once() -> None:
    stream, clock = io.StringIO(), Clock()
    with ProgressBar(100, unit="steps", stream=stream, clock=clock) as bar:
        for done in range(0, 101, 5):
            clock.now = done / 10
            bar.update(done, f"{done * 2} states")
    lines = stream.getvalue().splitlines()
    tenths = [f"[{tenth:3d}%" for tenth in range(0, 101, 10)]
    assert [line.split("]")[0] for line in lines] == tenths
    assert lines[0] == "[  0%]         0/100 steps        - steps/s  0 states"
    assert lines[-1] == "[100%]       100/100 steps     10.0 steps/s  200 states"


def test_on_a_terminal_it_redraws_one_line_at_most_ten_times_a_second() -> None:
    stream, clock = Terminal(), Clock()
    bar = ProgressBar(48, unit="req", label="serving", stream=stream, width=8, clock=clock)
    bar.advance(0, "step 0")  # drawn: the first, too early for a rate
    clock.now = 0.2
    bar.advance(6, "step 1")
    bar.advance(6, "step 2")  # not drawn: too soon
    clock.now = 0.4
    bar.advance(12, "step 3")
    clock.now = 0.5
    bar.close()
    bar.close()  # once
    assert stream.getvalue().split("\r")[1:] == [
        "serving  [........]         0/48 req        - req/s  step 0",
        "serving  [#.......]         6/48 req     30.0 req/s  step 1",
        "serving  [####....]        24/48 req     60.0 req/s  step 3",
        "serving  [####....]        24/48 req     48.0 req/s  step 3\n",
    ]


def test_a_disabled_bar_writes_nothing() -> None:
    stream = Terminal()
    with ProgressBar(10, unit="req", stream=stream, enabled=False) as bar:
        bar.advance(10)
    assert stream.getvalue() == ""


def test_verify_draws_the_shared_bar() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "verify", "--layer", "pool", "--steps", "400"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    last = completed.stderr.splitlines()[-1]
    assert last.startswith("[100%]") and " steps/s " in last and last.endswith(" states"), last

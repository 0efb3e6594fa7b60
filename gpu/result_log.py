"""Results written the moment they are measured: one JSON object per line, each on disk before
the call returns, so a timeout, a crash or a kill loses nothing that was finished.

Each record is appended with a single `write()` on a file opened with O_APPEND and then
fsynced: a process killed at any point leaves whole lines only (at worst the line it was
writing is missing). `read_results` reads such a file back.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Record = Callable[[dict[str, Any]], None]
"""Where a measuring function sends each result as it has it."""


def discard(record: dict[str, Any]) -> None:
    """A `Record` that keeps nothing (callers that want only the final report)."""


class ResultLog:
    """Appends records to a JSON-lines file, each stamped with "time" (seconds since the epoch,
    so records of several writers of one file stay in order).

    Args:
        path: the file (created, or appended to).
        echo: also print each record on stdout, one short line each.
    """

    def __init__(self, path: Path, echo: bool = True) -> None:
        self.path = path
        self.echo = echo
        self.started = time.time()
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, record: dict[str, Any]) -> None:
        """Append `record` (plus "time") durably; echo it with the seconds since opening.

        Complexity: one write and one fsync.
        """
        now = time.time()
        stamped = {"time": round(now, 2), **record}
        line = json.dumps(stamped, default=str) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.echo:
            text = json.dumps(record, default=str)
            text = text if len(text) <= 150 else text[:147] + "..."
            print(f"  {now - self.started:6.1f}s {text}", flush=True)


def read_results(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file, in order.

    Raises:
        ValueError: a line is not a JSON object (the file was not written by `ResultLog`).
    """
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        record = json.loads(line)
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number} is not a JSON object")
        records.append(record)
    return records

"""Memory sizes as people write them: `40GiB` in (`parse_size`), `42,949,672,960 bytes (40.00
GiB)` out (`format_bytes`). Decimal units are powers of 1,000, binary ones powers of 1,024.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pagedkv.vocab.errors import InvalidArgumentError

GiB = 1 << 30

SIZE_UNITS: Mapping[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
"""Bytes per unit, by lower-case unit name."""

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in `text`: a number with an optional unit (B, KB..TB decimal, KiB..TiB binary).

    Raises:
        InvalidArgumentError: not a number with a known unit, or not a whole number of bytes.

    Complexity: O(len(text)).
    """
    match = _SIZE.fullmatch(text.lower())
    if match is None or match.group(2) not in SIZE_UNITS:
        raise InvalidArgumentError(
            f"not a memory size: {text!r} (a number with B, KB, MB, GB, TB, KiB, MiB, GiB or "
            f"TiB, e.g. 40GiB)"
        )
    number, unit = match.groups()
    scale = SIZE_UNITS[unit]
    if "." not in number:
        return int(number) * scale
    value = float(number) * scale
    if value != int(value):
        raise InvalidArgumentError(f"not a whole number of bytes: {text!r} = {value} bytes")
    return int(value)


def format_bytes(num_bytes: int) -> str:
    """`num_bytes` with thousands separators and in the largest binary unit that is >= 1.

    Complexity: O(digits).
    """
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes:,} bytes ({num_bytes / scale:.2f} {unit})"
    return f"{num_bytes:,} bytes"

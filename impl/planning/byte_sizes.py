"""Memory sizes as people write them: `40GiB` in (`parse_size`), `42,949,672,960 bytes (40.00
GiB)` out (`format_bytes`). Decimal units are powers of 1,000, binary ones powers of 1,024; a
one-letter unit is read as vLLM reads it (`80g` decimal, `80G` binary).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pagedkv.vocab.errors import InvalidArgumentError

GiB = 1 << 30

SIZE_UNITS: Mapping[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
"""Bytes per unit, by lower-case unit name (any case is accepted for these)."""

LETTER_UNITS: Mapping[str, int] = {
    **{letter: 10 ** (3 * power) for power, letter in enumerate("kmgt", start=1)},
    **{letter: 1 << (10 * power) for power, letter in enumerate("KMGT", start=1)},
}
"""One-letter units as vLLM's `human_readable_int` reads them (`--kv-cache-memory-bytes`): lower
case decimal (`80g` = 80 * 10**9), upper case binary (`80G` = 80 * 2**30)."""

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in `text`: a number and a unit (B; KB..TB decimal; KiB..TiB or Ki..Ti binary; one
    letter as vLLM reads it, `80g` decimal and `80G` binary).

    A bare number is refused: "80" is 80 bytes to some tools and 80 GiB to others.

    Raises:
        InvalidArgumentError: not a number with a known unit, or not a whole number of bytes.

    Complexity: O(len(text)).
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        raise InvalidArgumentError(
            f"not a memory size: {text!r} (a number with a unit: B, KB, MB, GB, TB, KiB, MiB, "
            f"GiB, TiB, or Ki..Ti; e.g. 80GiB)"
        )
    number, unit = match.groups()
    if not unit:
        raise InvalidArgumentError(_unit_advice(text.strip(), number))
    scale = LETTER_UNITS.get(unit) or SIZE_UNITS.get(unit.lower())
    if scale is None:
        raise InvalidArgumentError(
            f"not a memory size: {text!r}: unknown unit {unit!r} (B, KB, MB, GB, TB, KiB, MiB, "
            f"GiB, TiB, or Ki..Ti; one letter as vLLM reads it: 80g decimal, 80G binary)"
        )
    if "." not in number:
        return int(number) * scale
    value = float(number) * scale
    if value != int(value):
        raise InvalidArgumentError(f"not a whole number of bytes: {text!r} = {value} bytes")
    return int(value)


def _unit_advice(text: str, number: str) -> str:
    """What to write instead of a bare number: bytes for a large one, else GiB, GB or B."""
    value = float(number)
    if value >= 1 << 20:
        return (
            f"a memory size needs a unit: {text}B if you mean bytes ({value / (1 << 30):,.2f} GiB)"
        )
    return (
        f"a memory size needs a unit: {text}GiB ({int(value * (1 << 30)):,} bytes), "
        f"{text}GB ({int(value * 10**9):,} bytes) or {text}B"
    )


def format_bytes(num_bytes: int) -> str:
    """`num_bytes` with thousands separators and in the largest binary unit that is >= 1.

    Complexity: O(digits).
    """
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes:,} bytes ({num_bytes / scale:.2f} {unit})"
    return f"{num_bytes:,} bytes"

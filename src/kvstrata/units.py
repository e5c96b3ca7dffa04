"""Human sizes: ``parse_size("8GiB") == 8 << 30``, ``format_size(3 << 20) == "3.0 MiB"``."""

from __future__ import annotations

import re

from kvstrata.errors import InvalidValue

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, name: str = "size") -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"8G"`` (binary), ``"1.5GB"`` (decimal).

    Bare ``K``/``M``/``G``/``T`` are binary (as ``free -g`` and most tools mean them). ValueError
    naming ``name`` for anything else.
    """
    if isinstance(value, bool):
        raise InvalidValue(f"{name}: expected a size such as '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidValue(f"{name}: must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise InvalidValue(f"{name}: expected a size such as '8GiB', got {value!r}")
    m = _SIZE.match(value)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise InvalidValue(f"{name}: expected a size such as '8GiB', '512MB' or '1073741824', got {value!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(nbytes: float) -> str:
    """``1536 -> "1.5 KiB"``; plain bytes below 1 KiB."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}"
    raise AssertionError("unreachable")

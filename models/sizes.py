"""Byte counts for people: the one size formatter of llmlocal.

Binary units with IEC names (KiB, MiB, GiB, TiB: powers of 1024), everywhere llmlocal shows a
size: progress bars, `models list/info/rm`, `plan`, `quantize`. Binary because the figures a
user compares them with are memory sizes (`free -h`, GPU memory, the planner's budget, which
`--ram 8G` also reads as powers of 1024); IEC names because "GB" is ambiguous.

    1023 B    1.5 MiB    93.4 MiB    512 MiB    4.2 GiB
"""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_size(n: float) -> str:
    """``n`` bytes as a short figure: whole bytes below 1 KiB, then one decimal below 100 of a
    unit and none above (``93.4 MiB``, ``512 MiB``)."""
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1024:
        return f"{sign}{value:.0f} B"
    for unit in _UNITS[1:]:
        value /= 1024
        # Move up a unit when this one would print 1024 or more (1023.96 KiB -> 1.0 MiB).
        if _rounded(value) < 1024 or unit == _UNITS[-1]:
            return f"{sign}{_digits(value)} {unit}"
    raise AssertionError("unreachable: the last unit always returns")


def _rounded(value: float) -> float:
    return round(value, 1) if value < 100 else round(value)


def _digits(value: float) -> str:
    return f"{value:.1f}" if _rounded(value) < 100 else f"{value:.0f}"

"""Small helpers over profiler records, shared by the report and its exporters.

Times in records are microseconds from the start of the profile; a record whose CUDA events were
never timed has ``None`` for them (counted in bytes, not in times).

Example::

    time_span({"start_us": 1.0, "end_us": 3.0})      # (1.0, 3.0)
    fmt_bytes(3 << 20)                           # '3.0 MiB'
"""

from __future__ import annotations

import math

#: The row name of records whose storage was packed outside any module forward.
NO_MODULE = "(no module)"


def to_jsonable(x):
    """``x`` as JSON data: dict keys as strings, tuples as lists, NaN/inf as None, tensors and numpy
    scalars through ``.item()``, anything else as its ``str``."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def fmt_bytes(n) -> str:
    """``n`` bytes for a human: ``"512 B"``, ``"1.5 KiB"``, ... ``"3.2 GiB"``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def start_key(rec) -> float:
    """Sort key by start time; untimed records last."""
    t = rec.get("start_us")
    return math.inf if t is None else t


def gbps(nbytes, seconds) -> float:
    """Bandwidth in GB/s (1e9 bytes); 0.0 for no time."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def time_span(rec, start="start_us", end="end_us"):
    """(start, end) of a record in microseconds, or None when the recorder had no time for it."""
    t0, t1 = rec.get(start), rec.get(end)
    return None if t0 is None or t1 is None else (float(t0), float(t1))

"""Argument checks shared by the public API: each error names the argument and what it accepts."""

from __future__ import annotations

import functools
import inspect
import math
import re
from typing import Iterable

import torch

DEVICE_TYPES = ("cpu", "cuda")


#: The largest byte count (or count) the native core takes: its integers are 64-bit. A larger
#: Python int would reach pybind11 and fail there with an "incompatible function arguments" dump
#: that names no argument, so every integer bound for C++ is checked against this first.
INT64_MAX = 2**63 - 1


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        want = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        limit = "2**63 - 1" if maximum == INT64_MAX else str(maximum)
        raise ValueError(f"{name} must be <= {limit}, got {value}")
    return value


def check_native_int(name: str, value, *, minimum: int = 0, allow_none: bool = False):
    """check_int for a value passed on to the native core: an int in [minimum, 2**63 - 1]."""
    return check_int(name, value, minimum=minimum, maximum=INT64_MAX, allow_none=allow_none)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(name: str, value) -> int:
    """``1 << 30``, ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"`` -> bytes (int). Raises naming ``name``.

    The one reader of sizes: every byte-valued argument of ckpt_offload takes a string this reads
    (``KiB``/``MiB``/``GiB``/``TiB`` are powers of 1024, ``KB``/``MB``/``GB``/``TB`` of 1000, case
    ignored; ``B`` or no unit: bytes). A size must come to whole bytes: ``"1.5KiB"`` (1536) is
    read, ``"0.3B"`` is refused (it would silently be 0), as is a float between 0 and 1.

    Example::

        parse_bytes("max_bytes", "512MiB")   # -> 536870912
        parse_bytes("budget", "1.5GB")       # -> 1500000000
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string such as '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of bytes >= 0, got {value!r}")
        if 0 < value < 1:  # int() would make it 0 bytes without a word
            raise ValueError(f"{name}: {value!r} is a fraction of a byte; sizes are whole bytes (e.g. 1, or 0)")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            # Exact arithmetic for the whole-byte check: float("0.1") * 1000 is 100.00000000000001.
            from fractions import Fraction

            size = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
            if size.denominator != 1:
                raise ValueError(
                    f"{name}: {value!r} is {float(size)} bytes, not a whole number of bytes; write a size "
                    f"that is (e.g. {math.ceil(size)} for the next whole byte)"
                )
            return int(size)
        raise ValueError(f"{name}: cannot read {value!r} as bytes; write e.g. '2GiB', '512MiB', '1.5GB' or an int")
    raise TypeError(f"{name} must be a number of bytes or a string such as '2GiB', got {type(value).__name__}")


def check_bytes(name: str, value, *, minimum: int = 0, allow_none: bool = False):
    """A byte count bound for the native core: an int, or a size string (:func:`parse_bytes`),
    in [minimum, 2**63 - 1]; returned as an int (None stays None where allowed)."""
    if isinstance(value, str):
        value = parse_bytes(name, value)
    try:
        return check_native_int(name, value, minimum=minimum, allow_none=allow_none)
    except TypeError:
        want = "an int or None" if allow_none else "an int"
        raise TypeError(
            f"{name} must be {want} (or a size string such as '512MiB'), got {type(value).__name__} ({value!r})"
        ) from None


def check_choice(name: str, value, choices: Iterable[str]):
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__} ({value!r})")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_optional_bool(name: str, value):
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None, got {type(value).__name__} ({value!r})")
    return value


def device_types(name: str, value) -> list[str]:
    """Normalizes a device type, a torch.device, or a list of them, to a list of type names."""
    items = [value] if isinstance(value, (str, torch.device)) else value
    try:
        items = list(items)
    except TypeError:
        raise TypeError(
            f"{name} must be a device type ('cpu', 'cuda'), a torch.device, or a list of them; "
            f"got {type(value).__name__} ({value!r})"
        ) from None
    out = []
    for item in items:
        if isinstance(item, torch.device):
            dev = item
        elif isinstance(item, str):
            try:
                dev = torch.device(item)
            except RuntimeError:
                raise ValueError(f"{name}: unknown device {item!r}; allowed: {DEVICE_TYPES}") from None
        else:
            raise TypeError(f"{name} entries must be strings or torch.device, got {type(item).__name__} ({item!r})")
        if dev.type not in DEVICE_TYPES:
            raise ValueError(f"{name}: device type {dev.type!r} is not supported; allowed: {DEVICE_TYPES}")
        if dev.index is not None:
            raise ValueError(
                f"{name} takes device types, not devices: got {str(dev)!r}; pass {dev.type!r} "
                f"(every {dev.type} device is then offloaded)"
            )
        if dev.type not in out:
            out.append(dev.type)
    return out


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance with transpositions counted as one edit (``offlaod`` -> ``offload``: 1)."""
    a, b = a.lower(), b.lower()
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if prev2 is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The choice ``name`` is most likely a typo of: within 2 edits (1 for names of up to 4
    characters), or differing only in case, ``_`` or a plural ``s``; None when none is that close."""
    best, best_d = None, None
    for choice in choices:
        if name == choice:
            continue
        if name.lower().replace("_", "").rstrip("s") == choice.lower().replace("_", "").rstrip("s"):
            return choice
        if len(name) >= 6 and choice.startswith(name):  # cut short: preserve_rng -> preserve_rng_state
            return choice
        d = edit_distance(name, choice)
        if d <= (1 if len(choice) <= 4 else 2) and (best_d is None or d < best_d):
            best, best_d = choice, d
    return best


def check_keywords(route: str, given: Iterable[str], valid: Iterable[str], *, elsewhere: dict | None = None) -> None:
    """Raises TypeError naming the keywords of ``given`` that ``route`` does not take, the closest
    valid one (a typo), and every valid option; ``elsewhere`` maps a keyword that belongs to
    another API to a sentence saying where it goes."""
    valid = tuple(valid)
    unknown = [k for k in given if k not in valid]
    if not unknown:
        return
    for k in unknown:
        if elsewhere and k in elsewhere:
            raise TypeError(f"{route} got {k}=, which it does not take: {elsewhere[k]}")
    hints = [f"{k!r} (did you mean {closest(k, valid)!r}?)" if closest(k, valid) else repr(k) for k in unknown]
    raise TypeError(
        f"{route} got unknown keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
        f"its options are: {', '.join(valid)}"
    )


def suggest_keywords(route: str):
    """Decorates a public function (or a class's ``__init__``) so that a keyword it does not take
    raises :func:`check_keywords`'s TypeError (the closest valid name, every option) instead of
    Python's bare "unexpected keyword argument". A set difference per call with keywords."""

    def decorate(function):
        parameters = inspect.signature(function).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in parameters):
            return function  # it reads its own keywords
        valid = tuple(
            p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
        )
        valid_set = frozenset(valid)

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if kwargs and not valid_set.issuperset(kwargs):
                check_keywords(route, kwargs, valid)
            return function(*args, **kwargs)

        return wrapper

    return decorate

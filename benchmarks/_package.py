"""Which ckpt_offload the benchmarks measure, decided in one place.

The checkout these scripts sit in, when it has a built extension (``python setup.py build_ext
--inplace``: the code a developer just changed); else the installed package (CI and users run
``pip install .``, which builds nothing inside the tree). Preferring an installed package
unconditionally once made a whole session measure a stale install left in the venv, and
``python3 benchmarks/x.py`` puts ``benchmarks/``, not the checkout, on ``sys.path``.

Each script does::

    _HERE = os.path.dirname(os.path.abspath(__file__))
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    from _package import co  # noqa: E402
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_is_built(root: str = ROOT) -> bool:
    """True when ``root/ckpt_offload`` holds a built ``_C`` extension."""
    return bool(
        glob.glob(os.path.join(root, "ckpt_offload", "_C.*.so"))
        + glob.glob(os.path.join(root, "ckpt_offload", "_C.*.pyd"))
    )


if "ckpt_offload" not in sys.modules and checkout_is_built() and ROOT not in sys.path:
    sys.path.insert(0, ROOT)

try:
    import ckpt_offload as co
except ImportError as e:
    raise SystemExit(
        f"benchmarks: cannot import ckpt_offload ({e}). Install it (pip install --no-build-isolation .) or "
        "build the checkout in place (python setup.py build_ext --inplace)."
    ) from e


def save_report(out_dir: str, stem: str, report: dict, markdown: str, default=str) -> None:
    """Writes ``out_dir/<stem>.json`` (``report``; ``default`` converts what JSON cannot hold) and
    ``out_dir/<stem>.md`` (``markdown``), creating ``out_dir``: every benchmark's ``--out``."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(report, f, indent=1, default=default)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown)


__all__ = ["co", "checkout_is_built", "ROOT", "save_report"]


def positive_int_list(text: str) -> list[int]:
    """argparse type of ``--seq-lens``: comma-separated positive integers ("512,1024")."""
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq-lens: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--seq-lens: expected positive integers, got {text!r}")
    return values

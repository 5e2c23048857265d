"""``python -m ckpt_offload {demo,profile,plan,info}``: the command line lives in :mod:`ckpt_offload.cli`.

Example::

    python -m ckpt_offload info
    python -m ckpt_offload demo --size tiny --steps 2 --device cpu
"""

from __future__ import annotations

import sys

from ckpt_offload.cli import build_parser, main

__all__ = ["main", "build_parser"]

if __name__ == "__main__":
    sys.exit(main())

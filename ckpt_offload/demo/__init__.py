"""The demo: a small built-in transformer and the ``demo`` runner.

Nothing here is needed to use ckpt_offload; it shows and measures what :func:`ckpt_offload.offload`
does on a model that needs no download.

* :mod:`ckpt_offload.demo.model`: :class:`TinyTransformer`, its presets and data.
* :mod:`ckpt_offload.demo.runner`: :func:`run_demo` (train with and without ``co.offload``, compare).
* :mod:`ckpt_offload.demo.report`: :func:`format_report` and :func:`write_json` (its result, worded and saved).
* the command line that runs it: :mod:`ckpt_offload.cli` (``python -m ckpt_offload demo``).

Example::

    from ckpt_offload.demo import format_report, run_demo
    print(format_report(run_demo(size="tiny", steps=2, device="cpu", min_bytes=0)))
"""

from __future__ import annotations

from ckpt_offload.demo.model import CONFIGS, TinyConfig, TinyTransformer, lm_loss, make_batch, make_config
from ckpt_offload.demo.report import DEMO_JSON, format_report, write_json
from ckpt_offload.demo.runner import default_device, gpu_usable, run_demo

__all__ = [
    "CONFIGS",
    "DEMO_JSON",
    "TinyConfig",
    "TinyTransformer",
    "default_device",
    "format_report",
    "gpu_usable",
    "lm_loss",
    "make_batch",
    "make_config",
    "run_demo",
    "write_json",
]

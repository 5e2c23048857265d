"""``co.profile()`` and what it produces: the context manager, the report and its exporters.

* :mod:`ckpt_offload.profiling.context`: :class:`profile`, the context manager (turns the native
  recorder on and off, names the modules).
* :mod:`ckpt_offload.profiling.report`: :class:`ProfileReport`, the records and their totals
  and per-module rows; :mod:`ckpt_offload.profiling.summary` writes its summary table.
* :mod:`ckpt_offload.profiling.export_trace`: the Chrome trace.
* :mod:`ckpt_offload.profiling.export_table`: JSON (``to_dict``) and CSV.
* :mod:`ckpt_offload.profiling.plot`: the memory timeline PNG.

Example::

    import ckpt_offload as co

    with co.profile(model) as prof:
        with co.offload():
            loss = model(x).sum()
        loss.backward()
    print(prof.summary())
"""

from __future__ import annotations

from ckpt_offload.profiling.context import profile
from ckpt_offload.profiling.report import KEEP_REASONS, ProfileReport

#: Deprecated alias of :class:`ProfileReport` (its name differed from :class:`profile` only by
#: case); kept for existing code, to be removed in a later release.
Profile = ProfileReport

__all__ = ["KEEP_REASONS", "Profile", "ProfileReport", "profile"]

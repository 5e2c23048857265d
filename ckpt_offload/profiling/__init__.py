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

from ckpt_offload._warn import deprecated_names
from ckpt_offload.profiling.context import profile
from ckpt_offload.profiling.report import KEEP_REASONS, ProfileReport

__all__ = ["KEEP_REASONS", "ProfileReport", "profile"]


#: The names kept for one release with a DeprecationWarning (``co.Profile`` reads this table too).
DEPRECATED = {
    # Profile: the old name of ProfileReport (it differed from profile only by case).
    "Profile": ("Profile is deprecated since 0.1.0 and goes in 0.3.0: use ProfileReport", lambda: ProfileReport),
}
__getattr__ = deprecated_names(__name__, DEPRECATED)

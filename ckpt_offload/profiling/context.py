"""``co.profile()``: every copy, every stall and the memory timeline of offloaded activations.

The C++ side records, while profiling is on, each device-to-host and host-to-device copy
(bytes, stream, start and end: CUDA events on a GPU, a steady clock on CPU), each storage it
offloaded (shape, dtype, module), each unpack that waited for a reload, each tensor kept on the
device and why, the pool's backend allocations and cap hits, and a memory sample at every pack
and unpack. This module is the context manager: it turns the recorder on and off, adds the module
names (forward hooks keep a module path per thread) and the compute ranges, and hands the records
to a :class:`~ckpt_offload.profiling.report.ProfileReport` at exit (the summary table, Chrome
trace, CSV, JSON and memory plot come from there).

Example::

    import ckpt_offload as co

    with co.profile(model) as prof:
        with co.offload():
            loss = model(x).sum()
        loss.backward()
    print(prof.summary())
    prof.save("profile_out")        # summary.txt, trace.json, records.csv, profile.json, memory.png
"""

from __future__ import annotations

import threading

import torch

from ckpt_offload._args import suggest_keywords
from ckpt_offload._runtime import _C
from ckpt_offload.profiling.report import ProfileReport

__all__ = ["profile"]

# One profile at a time: the C++ recorder is process-wide.
_active_lock = threading.Lock()
_active: profile | None = None


def _require_native():
    missing = [
        name
        for name in (
            "profiler_start",
            "profiler_stop",
            "profiler_enabled",
            "profiler_set_scope",
            "profiler_range",
            "profiler_records",
        )
        if not hasattr(_C, name)
    ]
    if missing:
        raise RuntimeError(
            f"ckpt_offload: this build of the native extension has no profiler ({', '.join(missing)} missing). "
            "Rebuild it: `pip install --no-build-isolation .` (or `python setup.py build_ext --inplace` in the "
            "source folder)."
        )


def _first_device(args) -> str | None:
    """The device of the first tensor among a forward's positional arguments (one level into
    lists, tuples and dicts), as ``"cuda:0"`` / ``"cpu"``; None when there is none."""
    for a in args:
        items = a if isinstance(a, (list, tuple)) else a.values() if isinstance(a, dict) else (a,)
        for b in items:
            if isinstance(b, torch.Tensor):
                return _device_str(b.device)
    return None


def _device_str(device: torch.device) -> str | None:
    if device.type not in ("cpu", "cuda"):  # meta, xla, ...: nothing the recorder can time
        return None
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


class _ModuleTracker:
    """Global forward hooks that keep, per thread, the path of the module running now; they
    tell the C++ recorder the scope (pack records take it) and open / close compute ranges."""

    def __init__(self, model: torch.nn.Module | None):
        self._names: dict[int, tuple[torch.nn.Module, str]] = {}
        if model is not None:
            for name, m in model.named_modules(remove_duplicate=False):
                # The root's name is "": call it by its class so top-level ops have a scope.
                self._names.setdefault(id(m), (m, name or type(m).__name__))
        self._tls = threading.local()
        self._handles = []

    def _stack(self) -> list:
        st = getattr(self._tls, "stack", None)
        if st is None:
            st = self._tls.stack = []
        return st

    def _path(self, module, parent: str) -> str:
        hit = self._names.get(id(module))
        if hit is not None and hit[0] is module:
            return hit[1]
        cls = type(module).__name__
        return f"{parent}/{cls}" if parent else cls

    def _pre(self, module, args):
        st = self._stack()
        path = self._path(module, st[-1][0] if st else "")
        device = _first_device(args)
        if device is not None:
            _C.profiler_range(path, device, True)
        st.append((path, device))
        _C.profiler_set_scope(path)

    def _post(self, module, args, output):
        st = self._stack()
        if not st:  # hooks installed while this forward was already running
            return
        path, device = st.pop()
        if device is not None:
            _C.profiler_range(path, device, False)
        _C.profiler_set_scope(st[-1][0] if st else "")

    def install(self):
        mod = torch.nn.modules.module
        self._handles.append(mod.register_module_forward_pre_hook(self._pre))
        try:
            # always_call: the path is popped even when a forward raises.
            self._handles.append(mod.register_module_forward_hook(self._post, always_call=True))
        except TypeError:  # torch without always_call
            self._handles.append(mod.register_module_forward_hook(self._post))

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack().clear()


class profile:
    """Context manager that records what ckpt_offload does inside it; ``as`` gives a
    :class:`~ckpt_offload.profiling.report.ProfileReport`.

    Records every offload (D2H) and reload (H2D) copy with its bytes, stream, start and end
    (CUDA events on a GPU, a steady clock on CPU), every wait of the compute stream for a reload,
    every tensor kept on the device and why, the pool's backend allocations and cap hits, module
    forward ranges, and a memory sample at each pack and unpack. Outside a profile nothing is
    recorded. One profile at a time per process (a nested or concurrent one raises RuntimeError).

    Args:
        model: optional ``nn.Module``; its ``named_modules()`` names ("blocks.3.attn") label
            the records. Without it, modules are named by their classes joined with "/"
            ("TinyTransformer/Block/CausalSelfAttention").
        record_shapes: keep each offloaded tensor's shape and dtype in the records (default
            True); False drops them from the stored records and exports.
        pools: the :class:`~ckpt_offload.HostPool` (or list of them) whose counters are
            captured at exit for the summary; default :func:`~ckpt_offload.default_pool`.

    The records are fetched once, at exit (this waits for the copies still in flight). Read
    them after the ``with`` block, after backward has run inside it.

    Example::

        with co.profile(model) as prof:
            with co.offload():
                loss = lm_loss(model, tokens)
            loss.backward()
        print(prof.summary())
        prof.export_chrome_trace("trace.json")    # open in https://ui.perfetto.dev
    """

    @suggest_keywords("co.profile")
    def __init__(self, model: torch.nn.Module | None = None, record_shapes: bool = True, pools=None):
        # Argument checks first, before anything is set up.
        from ckpt_offload.pool import HostPool

        pools_error = TypeError(
            f"pools must be None, a ckpt_offload.HostPool or a list of them, got {type(pools).__name__} ({pools!r})"
        )
        if pools is None:
            pools = []
        elif isinstance(pools, HostPool):
            pools = [pools]
        elif isinstance(pools, (str, bytes, dict)):
            raise pools_error
        else:
            try:
                pools = list(pools)
            except TypeError:  # not iterable (pools=5): say what pools takes, not "int is not iterable"
                raise pools_error from None
        for p in pools:
            if not isinstance(p, HostPool):
                raise TypeError(
                    f"pools must be None, a ckpt_offload.HostPool or a list of them; an entry is {type(p).__name__}"
                )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if not isinstance(record_shapes, bool):
            raise TypeError(f"record_shapes must be True or False, got {type(record_shapes).__name__}")
        self.model = model
        self.record_shapes = record_shapes
        self._pools = pools
        self._tracker = None
        self._profile: ProfileReport | None = None

    def __enter__(self) -> ProfileReport:
        global _active
        _require_native()
        with _active_lock:
            if _active is not None:
                raise RuntimeError(
                    "co.profile(): another profile is already active in this process (profiles cannot be nested "
                    "or run concurrently: the recorder is process-wide). Exit it first."
                )
            if _C.profiler_enabled():
                raise RuntimeError(
                    "co.profile(): the native profiler is already recording (started through ckpt_offload._C "
                    "directly?); call ckpt_offload._C.profiler_stop() first."
                )
            _active = self
        try:
            self._profile = ProfileReport(None)
            self._tracker = _ModuleTracker(self.model)
            _C.profiler_start()
            self._tracker.install()
            _C.profiler_set_scope("")
        except BaseException:
            self._teardown()
            raise
        return self._profile

    def _teardown(self) -> dict | None:
        global _active
        records = None
        try:
            if self._tracker is not None:
                self._tracker.remove()
                self._tracker = None
            try:
                _C.profiler_set_scope("")
            finally:
                _C.profiler_stop()
            records = _C.profiler_records()
        finally:
            with _active_lock:
                _active = None
        return records

    def __exit__(self, *exc) -> None:
        with _active_lock:
            if _active is not self:
                return  # not entered, or already exited: a second __exit__ must not end another profile
        records = self._teardown()
        from ckpt_offload.pool import default_pool

        pools = self._pools or [default_pool()]
        pool_stats = []
        for p in pools:
            p.synchronize()
            pool_stats.append(dict(p.stats()))
        self._profile._load(records, pool_stats, record_shapes=self.record_shapes)

"""``co.offload()``: keep the tensors autograd saves in a host-memory pool until backward; and
``co.keep()``, the part of a forward whose saved tensors stay where they are. (One tensor copied
by hand, outside autograd: ``co.offload_tensor``, ``host_copy.py``.)"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import torch

from ckpt_offload._compile import check_compiled_regions
from ckpt_offload._option_docs import args_section
from ckpt_offload._runtime import _C
from ckpt_offload._warn import (
    _warn_lock,
    _warned_callers,
    graph_break_if_compiling,
    hooks_disabled_reason,
    warn,
    warn_at_user_line,
)
from ckpt_offload.options import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_MIN_BYTES,
    DEFAULT_PREFETCH_BYTES,
    OFFLOAD_KEYS,
    ON_FULL_POLICIES,
    POSITIONAL_KEYS,
    STREAM_MODES,
    OffloadOptions,
    check_offloads_something,
    from_arguments,
    native_packer_options,
    option_docs,
)
from ckpt_offload.pool import default_pool

__all__ = [
    "offload",
    "keep",
    "DEFAULT_MIN_BYTES",
    "DEFAULT_PREFETCH_BYTES",
    "DEFAULT_BATCH_BYTES",
    "STREAM_MODES",
    "ON_FULL_POLICIES",
]

_warned_hooks_disabled: set = set()


def _warn_hooks_disabled(reason: str) -> None:
    with _warn_lock:
        if reason in _warned_hooks_disabled:
            return
        _warned_hooks_disabled.add(reason)
    warn(
        f"ckpt_offload.offload(): saved-tensor hooks are disabled here ({reason!r}; torch.func.grad, vjp, "
        "jacrev and hessian disable them), so the tensors saved inside this block are not offloaded. "
        "Gradients are unaffected. To offload them, run this forward outside the torch.func transform "
        "(or outside torch.autograd.graph.disable_saved_tensors_hooks). (Warned once per reason.)",
        stacklevel=3,  # the user's `with`: _warn_hooks_disabled <- __enter__
    )


_NOOP_CHECKS = 64  # exits a context checks for having offloaded nothing (Note [Offloaded nothing])
_NOOP_KEY = "co.offload-offloaded-nothing"  # its warning's key (once per context and line)

# What the native entry and exit return (Note [Native activation], csrc/torch/activation.cpp).
_BUSY, _NOT_ACTIVE = _C.Activation.BUSY, _C.Activation.NOT_ACTIVE
_REPORT_NOOP, _REPORT_FULL, _REPORT_DISK_FULL = (
    int(_C.ExitReport.NOOP),
    int(_C.ExitReport.FULL),
    int(_C.ExitReport.DISK_FULL),
)
_REPORT_HOST_LIMITS = int(_C.ExitReport.FALLBACK) | int(_C.ExitReport.SHARE)
# An exit that could not pop its own entry still exits, having repaired the stack as Note [Exits
# that cannot pop] (csrc/torch/activation.cpp) says; what is said about each repair.
_REPAIRED = {
    _C.Activation.OTHER_THREAD: (
        "on a different thread than the one that entered it (saved-tensor hooks are per thread): its hooks stay "
        "on that thread's stack, offloading nothing, until the next co.offload enters or exits there"
    ),
    _C.Activation.OTHER_BACKWARD: (
        "inside a backward it was not entered in (or outside the backward it was entered in): autograd keeps a "
        "separate hooks stack for each backward; its hooks offload nothing from now on and are dropped when they "
        "can be"
    ),
    _C.Activation.OUT_OF_ORDER: (
        "while a saved-tensor hooks context entered after it (another co.offload, a co.checkpoint region, "
        "torch's save_on_cpu, ...) is still active: its own hooks were taken out from under that context, which "
        "stays in force"
    ),
    _C.Activation.NOT_ON_STACK: "where its hooks are not on the saved-tensor hooks stack: its hooks offload nothing "
    "from now on",
}


class offload:
    """Context manager: tensors that autograd saves inside it wait for backward in a host pool.

    Built on ``torch.autograd.graph.saved_tensors_hooks``. The per-tensor work (deciding, copying,
    deduplicating, restoring) runs in C++. Gradients are bit-identical to a run without it.

    Args:
        {options}

    One context object is active at most once at a time: entering it again (also from another
    thread) before it exits raises ``RuntimeError``; nest a new ``co.offload()`` instead.
    Contexts exit in the reverse order of entering, on the thread that entered them, outside
    the backward they were not entered in. An exit that breaks this still exits, with a
    ``RuntimeWarning``, and leaves nothing installed: out of order, exactly its own hooks are
    taken off the stack (the contexts entered after it stay in force); from another thread or
    another backward, its hooks stop offloading at once and are dropped from the entering
    thread's stack at the next ``co.offload`` enter or exit there. A second ``__exit__`` does
    nothing, an ``__exit__`` of a context never entered raises ``RuntimeError``; ``__exit__()``
    takes no arguments too. Where saved-tensor hooks are disabled
    (inside ``torch.func.grad``, ``vjp``, ``jacrev``, ``hessian``) the block runs without
    offload, with a one-time warning. A context that saw saved tensors and offloaded none of
    them (all under ``min_bytes``, or on a device it does not offload) warns once, naming the
    reason and the fix (Note [Offloaded nothing]).

    Never offloaded (kept and counted in :meth:`stats`): parameters, buffers and views of them
    (``nn.Linear`` saves ``weight.t()``; a buffer is recognised when the module that owns it, or an
    ancestor, is running its forward), autocast's cached casts of parameters (``autocast_cast``), tensors on other
    devices, sparse / nested / quantized
    / conjugate-view tensors, ``__torch_dispatch__`` tensor subclasses other than DTensor (a DTensor, what
    tensor parallelism saves, is offloaded through its local tensor and rebuilt with its mesh and placements
    on unpack), tensors with no data of their own (``no_data``: ZeroTensors,
    such as forward-mode AD's zero tangents, and tensors whose storage was freed), and tensors smaller than
    ``min_bytes``. Several
    saved tensors that view one storage are offloaded once. A saved tensor modified in place
    after it was saved makes backward raise, as autograd does without hooks.

    Example::

        import ckpt_offload as co
        with co.offload() as ctx:
            loss = model(x).sum()
        loss.backward()
        print(ctx.stats())   # tensors_offloaded, bytes_offloaded, kept_by_reason, ...
    """

    def __init__(self, *args, keep_dedup: bool = False, **options):
        graph_break_if_compiling()
        # The options are checked (each error names the option) and normalized by OffloadOptions.
        self._setup(from_arguments("co.offload()", args, options), keep_dedup)
        check_offloads_something(self.options.devices, "co.offload()")

    @classmethod
    def _from_options(cls, options: OffloadOptions, keep_dedup: bool = False) -> "offload":
        """A context for ``options`` that a route (co.checkpoint, co.apply, co.hf, a plan) makes
        from inside forward: the route checked at the user's own line that they offload
        something, so this one does not warn again."""
        ctx = cls.__new__(cls)
        ctx._setup(options, keep_dedup)
        return ctx

    def _setup(self, options: OffloadOptions, keep_dedup: bool) -> None:
        if not isinstance(keep_dedup, bool):
            raise TypeError(f"keep_dedup must be True or False, got {type(keep_dedup).__name__}")
        self.options = options  #: the :class:`~ckpt_offload.OffloadOptions` of this context
        # The other options read through to self.options (_option_reader, below the class).
        self.devices = options.device_types
        self.pool = options.pool if options.pool is not None else default_pool()
        self._packer = _C.Packer(native_packer_options(options), self.pool._impl)
        self.keep_dedup = keep_dedup
        # The hook functions and the activation in force, entered and exited in one native call
        # each (Note [Native activation], csrc/torch/activation.cpp): one activation at a time.
        self._hooks = _C.Hooks(self._packer, keep_dedup)
        self._warned_full = False  # the pool-cap warning is given once per context
        self._warned_disk_full = False  # and so is the disk-full one
        # Exits left for the offloaded-nothing check (Note [Offloaded nothing]); none without a
        # device to offload (the construction warned about that already). Counted down natively.
        self._hooks.noop_checks = _NOOP_CHECKS if self.devices else 0
        self._arm_exit_checks()

    def _arm_exit_checks(self) -> None:
        """Tells the native exit which counters to report (the pool's and the disk tier's
        one-time warnings not given yet); an exit with nothing to report returns None."""
        keep = self.on_full == "keep"
        self._hooks.check_full = keep and not self._warned_full and self.pool._share is None
        self._hooks.check_disk = keep and not self._warned_disk_full and self.pool._tier is not None
        self._hooks.check_fallback = self.pool._fallback_possible and not self.pool._warned_fallback
        self._hooks.check_share = self.pool._share is not None and not self.pool._warned_share

    @property
    def active(self) -> bool:
        """True between ``__enter__`` and ``__exit__``."""
        return self._hooks.active

    def __call__(self, fn):
        """Used as a decorator: every call of ``fn`` runs inside this context (one call at a
        time: a recursive or concurrent call raises, as entering an active context does).

        Example::

            @co.offload(devices=["cpu"])
            def forward(x):
                return model(x)
        """
        if not callable(fn):
            raise TypeError(f"co.offload(...) decorates a function; got {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapper

    def __enter__(self) -> "offload":
        if torch.compiler.is_compiling():
            graph_break_if_compiling()
        return self._enter()

    def _enter(self) -> "offload":
        """``__enter__`` after its compile check: what the checkpoint routes call, having made
        that check once for the whole call (Note [Fixed cost per call])."""
        check_compiled_regions()  # Note [Compiled regions inside co.offload]
        # Claims the activation, pushes the hooks, begins the packer's activation (one call).
        refused = self._hooks.enter()
        if refused is not None:
            if refused is _BUSY:
                raise RuntimeError(
                    "this co.offload() context is already active (entered and not exited yet, on this thread or "
                    "another); nest a new co.offload() instead"
                )
            # DISABLED: entered without hooks (no offload), which the exit ends as usual.
            _warn_hooks_disabled(hooks_disabled_reason())
        self._entered = True  # __exit__ tells a context never entered from one exited twice
        return self

    def __exit__(self, exc_type=None, exc=None, tb=None) -> None:
        if torch.compiler.is_compiling():
            graph_break_if_compiling()
        self._exit(exc_type, 2)

    def _exit(self, exc_type=None, depth: int = 1) -> None:
        """``__exit__`` after its compile check (as ``_enter``). ``depth``: how many frames up
        the line that exited the context is, from here (its warnings point there)."""
        try:
            # Pops its own entry and ends the activation (one call), or says why it cannot.
            done = self._hooks.exit()
        except Exception as e:
            # The flush's error (PoolFullError with on_full="raise"): the context has exited.
            self._after_flush_error(e, exc_type, depth + 1)
            return
        if done is None:
            return  # nothing to report: the usual exit
        if type(done) is int:  # ExitReport bits: the exit checks have something to say
            caller = sys._getframe(depth)
            if done == _REPORT_NOOP and (_NOOP_KEY, id(caller.f_code), caller.f_lasti) in _warned_callers:
                self._hooks.noop_checks = 0  # this line has warned (a fresh context per step)
                return
            self._report(done, caller)
            return
        if done is _NOT_ACTIVE:  # a second __exit__, or one never entered
            if not getattr(self, "_entered", False):
                raise RuntimeError(
                    "co.offload().__exit__ called on a context that was never entered, so nothing was "
                    "offloaded and there is nothing to end: use `with co.offload(...) as ctx:` (or call "
                    "ctx.__enter__() first)"
                )
            return
        if done is _BUSY:
            return  # another thread is entering/exiting it
        # The exit could not pop its own entry: it repaired the stack, ended the activation, and
        # says how, with what the end gave (None, ExitReport bits, or the flush's exception).
        repair, outcome = done
        warn(
            f"co.offload().__exit__ called {_REPAIRED[repair]}. The context has exited. Exit contexts in the reverse "
            "order of entering, on the thread (and in the backward, or outside backward) that entered them.",
            RuntimeWarning,
            stacklevel=depth + 1,
        )
        if isinstance(outcome, BaseException):
            self._after_flush_error(outcome, exc_type, depth + 1)
        elif outcome is not None:
            self._report(outcome, sys._getframe(depth))

    def _after_flush_error(self, error: Exception, exc_type, depth: int = 2) -> None:
        # An exception raised in the block (a KeyboardInterrupt, an OOM) is the one the caller
        # must see; the flush's PoolFullError only when the block itself succeeded. Its tensors
        # were kept on the device either way, so backward still works.
        if exc_type is None:
            raise error
        done = self._hooks.report()
        if done is not None:
            self._report(done, sys._getframe(depth))

    def _report(self, why: int, caller=None) -> None:
        """What the native exit reported (Note [Native activation]): ExitReport bits, one per check
        that has something to say; ``caller``: the frame that called ``__exit__``."""
        counts = self._packer.exit_counts()  # _C.ExitCounts
        if why & _REPORT_NOOP:
            self._warn_if_offloaded_nothing(
                counts.too_small_tensors, counts.too_small_bytes, counts.device_tensors, caller
            )
            if why == _REPORT_NOOP:
                return
        if why & _REPORT_FULL:
            self._warn_pool_was_full(counts.pool_full_tensors, counts.pool_full_bytes)
        if why & _REPORT_DISK_FULL:
            self._warn_disk_full(counts.disk_full_tensors, counts.disk_full_bytes)
        if why & _REPORT_HOST_LIMITS:
            self.pool._check_host_limits()
        self._arm_exit_checks()  # what was warned about is not reported again

    # Note [Offloaded nothing]
    # A context that offloads nothing costs its hooks and frees no memory, and a user who sees
    # training run has no reason to look at stats(): at an exit where this context has kept tensors
    # it could have offloaded (under min_bytes, or on a device it does not offload) and has offloaded
    # none, it warns once, naming the reason and the fix. The native exit checks the counters
    # (Note [Native activation]) and reports only then, and the check runs only until the
    # context has offloaded something (then never again), has warned, or has exited _NOOP_CHECKS
    # times without either (it saw only what it never offloads by design: parameters, buffers,
    # autocast's casts -- those do not count). With no device selected at all (devices=[] or the
    # default without a GPU) the construction already warned, and the check is off.
    def _warn_disk_full(self, disk_full: int, disk_full_bytes: int) -> None:
        self._warned_disk_full = True
        limit = self.pool._tier.stats().get("max_bytes") if self.pool._tier is not None else None
        warn_at_user_line(
            f"co.offload(): the pool's disk tier is full (spill_dir={self.pool.spill_dir!r}, spill_max_bytes="
            f"{limit or 'none: what the disk has'}), so {disk_full} saved tensors "
            f"({disk_full_bytes} bytes) stayed on the device "
            "(kept_by_reason['disk_full']). Raise spill_max_bytes or free disk space, raise the pool's "
            "max_bytes, offload fewer tensors (a larger min_bytes), or pass on_full='raise' to fail "
            "instead. (Warned once per context.)",
            key=None,
        )

    def _warn_if_offloaded_nothing(self, small: int, size: int, device: int, caller=None) -> None:
        other_device = device if self.devices else 0
        if not (small or other_device):
            return
        self._hooks.noop_checks = 0
        # Built only where it is shown: a fresh context per step would otherwise format it at
        # every exit for a line that has warned already.
        warn_at_user_line(
            functools.partial(self._offloaded_nothing_message, small, size, other_device), key=_NOOP_KEY, caller=caller
        )

    def _offloaded_nothing_message(self, small: int, size: int, other_device: int) -> str:
        reasons = []
        if small:
            reasons.append(
                f"{small} saved tensors ({size} bytes) were each under min_bytes={self.min_bytes} "
                "(kept_by_reason['too_small']): lower it, e.g. co.offload(min_bytes=0) or "
                "offload={'min_bytes': 0} (docs/api.md, 'Choosing min_bytes'); tensors under min_bytes "
                "are never offloaded, batched or not, so to copy many small ones cheaply lower min_bytes "
                "and add batch_below= (e.g. min_bytes=4096, batch_below='256KiB')"
            )
        if other_device:
            reasons.append(
                f"{other_device} saved tensors were on a device this context does not offload "
                f"(devices={list(self.devices)}; kept_by_reason['device']): add their device type, "
                "e.g. devices=['cpu'] for CPU tensors"
            )
        return (
            "co.offload(): this context saw saved tensors but offloaded none of them, so it frees no memory: "
            + "; ".join(reasons)
            + ". (Warned once per context and line.)"
        )

    def _warn_pool_was_full(self, count: int, kept: int) -> None:
        self._warned_full = True
        cap = self.pool.max_bytes
        message = (
            f"co.offload(): the host pool is at its cap ({'none' if cap is None else f'{cap} bytes'}), so "
            f"{count} saved tensors ({kept} bytes) stayed on the device "
            "(kept_by_reason['pool_full']). Raise the cap (co.HostPool(max_bytes=...), or "
            "pool.set_max_bytes(...)), offload fewer tensors (a larger min_bytes), or pass on_full='raise' "
            "to fail instead. (Warned once per context.)"
        )
        # Once per context through self._warned_full; a key with id(self) would silence a later
        # context that happens to get the same id.
        warn_at_user_line(message, key=None)

    def stats(self) -> dict:
        """What this context did, accumulated over every time it was entered.

        Keys: ``tensors_offloaded``, ``bytes_offloaded``, ``tensors_deduplicated`` (saved tensors
        that reused an offloaded storage), ``bytes_deduplicated``, ``tensors_kept``, ``bytes_kept``,
        ``kept_by_reason`` (counts by ``parameter``, ``buffer``, ``too_small``, ``device``,
        ``layout``, ``subclass``, ``pool_full``, ``cuda_graph_capture``, ``disk_full``,
        ``autocast_cast``, ``no_data``), ``kept_bytes_by_reason``, ``tensors_reloaded``,
        ``bytes_reloaded``, ``tensors_reload_shared`` (unpacks served by an already reloaded copy),
        ``tensors_batched`` and ``batches`` (small tensors gathered into shared copies, and those
        copies), ``prefetches`` / ``bytes_prefetched`` (reloads started ahead of need),
        ``prefetch_hits`` (unpacks served by one), ``prefetches_unused`` (dropped unused),
        ``peak_prefetch_bytes`` (most prefetched bytes waiting at once; at most ``prefetch_bytes``),
        ``prefetch_failures`` (prefetches that raised, e.g. out of device memory: backward goes
        on and reloads those tensors when asked), ``tensors_spilled`` / ``bytes_spilled`` (offloads
        the pool's cap refused that went to its disk tier), ``disk_prefetches`` (disk reads started
        by prefetch), ``prefetch_window_bytes`` /
        ``prefetch_block_bytes`` / ``prefetch_lead`` (the window the last backward used, the
        block it was sized from, and how many blocks ahead the next backward starts copies),
        ``device_saved_peak_bytes`` (the most device bytes of saved activations held, by every
        context of the process, right after one of this context's packs or unpacks).
        ``bytes_stored`` (bytes the host holds for the offloaded tensors: ``bytes_offloaded`` less
        what ``store_dtype`` saved), ``tensors_converted`` (tensors stored narrower),
        ``store_dtype`` (its name, or None) and ``store_error`` (with ``measure_error``: per class,
        ``tensors``, ``mean_rel_error``, ``max_rel_error``).
        ``kept_by_reason`` and ``kept_bytes_by_reason`` list every reason, zeros included.
        :meth:`reset_stats` starts the counts and peaks over (the ``prefetch_*`` window keys are
        what the prefetcher learned, and stay). ``co._C.stats_keys()`` / ``co._C.keep_reasons()``
        list them all, from the native table they are built from.
        """
        return self._packer.stats()

    def reset_stats(self) -> None:
        """Sets every count and peak of :meth:`stats` back to zero (tensors already offloaded stay
        where they are; their reloads count from now on). The prefetch window keys stay.

        Example::

            ctx.reset_stats()
            with ctx:
                loss = model(x).sum()
            print(ctx.stats()["bytes_offloaded"])   # this step only
        """
        self._packer.reset_stats()
        self._warned_full = False
        self._warned_disk_full = False
        self._arm_exit_checks()

    def __repr__(self) -> str:
        return (
            f"co.offload(min_bytes={self.min_bytes}, stream={self.stream!r}, devices={list(self.devices)}, "
            f"on_full={self.on_full!r}, prefetch_bytes={self.prefetch_bytes}, batch_below={self.batch_below}"
            + (f", store_dtype={self.store_dtype}" if self.store_dtype is not None else "")
            + ")"
        )


def _signature() -> inspect.Signature:
    """co.offload's signature, made from OffloadOptions (where the names and defaults are written)."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(OffloadOptions):
        kind = P.POSITIONAL_OR_KEYWORD if f.name in POSITIONAL_KEYS else P.KEYWORD_ONLY
        params.append(P(f.name, kind, default=f.default, annotation=f.type))
    params.insert(len(POSITIONAL_KEYS) + 1, P("keep_dedup", P.KEYWORD_ONLY, default=False, annotation="bool"))
    return inspect.Signature(params)


offload.__init__.__signature__ = _signature()

#: co.offload's one option that is not an OffloadOptions field (it is about the context object).
KEEP_DEDUP_DOC = (
    "Keep the table of offloaded storages from one entry of this context to the next (default `False`: each "
    "entry starts afresh), so that a tensor saved in several entries -- an input every checkpointed layer "
    "receives -- is stored once. The table holds no tensor. `co.checkpoint` uses this for the context it "
    "shares across layers."
)


def _option_reader(name: str) -> property:
    return property(
        lambda self: getattr(self.options, name), doc=f"This context's ``{name}`` option (``ctx.options.{name}``)."
    )


# ctx.min_bytes, ctx.stream, ...: read from ctx.options, not copied into every context made
# (Note [Fixed cost per call]); devices (the types resolved) and pool (the default resolved)
# are the context's own.
for _name in OFFLOAD_KEYS:
    if _name not in ("devices", "pool"):
        setattr(offload, _name, _option_reader(_name))
del _name


def argument_docs() -> dict:
    """co.offload's arguments and their descriptions, in its signature's order: the options'
    (from :class:`OffloadOptions`' fields) with ``keep_dedup`` after the positional ones."""
    docs = list(option_docs().items())
    docs.insert(len(POSITIONAL_KEYS), ("keep_dedup", KEEP_DEDUP_DOC))
    return dict(docs)


if offload.__doc__:  # None under python -OO
    offload.__doc__ = offload.__doc__.replace("        {options}\n", args_section(argument_docs()) + "\n")


def _keep_pack(t):
    # A detached alias (same storage and version counter, no grad_fn): an output saved by its
    # own node would otherwise form a reference cycle that keeps the graph alive.
    return t.detach()


def _keep_unpack(t):
    return t


class keep:
    """Context manager (or decorator): tensors autograd saves inside it stay where they are, also
    inside :class:`offload` or an offloading checkpoint -- for the parts not worth a copy, such as
    the LM head and the loss (their activations are needed first in backward), as torchtune's
    ``NoOpManager``. Its saved-tensor hooks are the innermost, so they win over the outer ones;
    gradients are unchanged.

    Example::

        with co.offload():
            h = model.body(x)
            with co.keep():
                loss = loss_fn(model.lm_head(h), y)
        loss.backward()
    """

    def __init__(self):
        self._hooks = []  # a stack: one object may be entered again inside itself

    def __enter__(self) -> "keep":
        if hooks_disabled_reason() is not None:
            self._hooks.append(None)  # torch.func: no hooks at all, nothing is offloaded anyway
            return self
        hooks = torch.autograd.graph.saved_tensors_hooks(_keep_pack, _keep_unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        hooks = self._hooks.pop() if self._hooks else None
        if hooks is not None:
            hooks.__exit__(exc_type, exc, tb)

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with keep():
                return fn(*args, **kwargs)

        return wrapper

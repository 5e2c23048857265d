"""Selective checkpointing whose kept outputs wait in the host pool: a ``context_fn`` for
``torch.utils.checkpoint.checkpoint`` (and ``co.checkpoint``, and Hugging Face's
``gradient_checkpointing_enable``) that honours ``CheckpointPolicy.MUST_CPU_OFFLOAD`` and
``PREFER_CPU_OFFLOAD`` in eager mode.

torch declares the two offload policies but, outside ``torch.compile``, treats them as recompute.
Here a policy's decision for each op of the checkpointed region is carried out as it says:

- ``MUST_SAVE`` / ``PREFER_SAVE`` (or ``True``): the output is kept where it is (on the device)
  until backward, as torch's selective checkpoint keeps it;
- ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``: the output is kept too, but in the host pool,
  copied by the copy engine (what ``co.offload`` does for a saved tensor), and copied back when
  the recompute in backward reaches the op;
- ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE`` (or ``False``): the op runs again in backward.

Two dispatch modes do it, as torch's ``create_selective_checkpoint_contexts`` does: the first runs
around the forward and records each op's outputs (a cache keyed by the op and its call count),
the second runs around the recompute and answers the cached ops from the cache, each entry once.
The cache lives in the checkpoint's own frame: it goes with the graph, and an entry goes as soon
as the recompute has used it.

At the end, the policies of the planner's "selective" and "selective_offload" blocks: keep (or
offload) the outputs of ``SELECTIVE_SAVE_OPS`` -- matmuls, convolutions, fused attention -- and
recompute the rest; a "selective_offload" block runs this context with :func:`offload_policy`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ckpt_offload._args import suggest_keywords
from ckpt_offload.offloading import offload as offload_context
from ckpt_offload.options import OffloadOptions, as_options, check_offloads_something

__all__ = [
    "selective_offload_context",
    "SelectiveOffload",
    "OFFLOAD_POLICIES",
    "SELECTIVE_SAVE_OPS",
    "selective_policy",
    "offload_policy",
]

# torch's selective checkpoint (2.4+); without it plans have no "selective"
CheckpointPolicy = getattr(torch_checkpoint, "CheckpointPolicy", None)
create_selective_checkpoint_contexts = getattr(torch_checkpoint, "create_selective_checkpoint_contexts", None)
_SelectiveCheckpointContext = getattr(torch_checkpoint, "SelectiveCheckpointContext", None)


def _policy(name):
    return getattr(CheckpointPolicy, name, None) if CheckpointPolicy is not None else None


#: The policies whose outputs go to the host pool (those this torch declares).
OFFLOAD_POLICIES = frozenset(p for p in (_policy("MUST_CPU_OFFLOAD"), _policy("PREFER_CPU_OFFLOAD")) if p is not None)
_SAVE = frozenset(p for p in (_policy("MUST_SAVE"), _policy("PREFER_SAVE")) if p is not None)
_RECOMPUTE_POLICIES = frozenset(p for p in (_policy("MUST_RECOMPUTE"), _policy("PREFER_RECOMPUTE")) if p is not None)

# Ops whose count differs between the forward and the recompute (checkpoint adds detaches, its
# determinism check reads metadata): never cached, as in torch's own selective checkpoint.
_IGNORED_OPS = frozenset(getattr(torch_checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default}))

_RECOMPUTE = object()  # the op runs again in backward
_CONSUMED = object()  # the recompute has taken the entry


def _policy_names() -> str:
    return ", ".join(f"CheckpointPolicy.{p.name}" for p in CheckpointPolicy) if CheckpointPolicy else ""


def _detached(t: torch.Tensor) -> torch.Tensor:
    # Detached so that the cache holds no graph (the graph holds the cache: a cycle otherwise).
    # With ADInplaceOrView on, a view's detach keeps sharing the version counter, so a later
    # in-place change of the view is seen.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


class _Kept:
    """A saved output, on its device. Checks at use that it was not modified in place."""

    __slots__ = ("value", "version")

    def __init__(self, value):
        self.value = _detached(value) if isinstance(value, torch.Tensor) else value
        self.version = self.value._version if isinstance(value, torch.Tensor) else None

    def get(self, allow_mutation: bool):
        if self.version is not None and not allow_mutation and self.value._version != self.version:
            raise RuntimeError(
                "co.selective_offload_context: an output the policy saved was modified in place after it was "
                "saved, so backward would use the wrong values. Clone it before modifying it, or pass "
                "allow_cache_entry_mutation=True if the in-place change is meant to be seen by backward."
            )
        return self.value


class _Offloaded:
    """An output in the host pool: the packer's handle (the same one ``co.offload`` makes for a
    saved tensor: parameters, tensors under min_bytes or on another device stay as they are)."""

    __slots__ = ("handle", "unpack")

    def __init__(self, value, pack, unpack):
        self.handle = pack(_detached(value))
        self.unpack = unpack

    def get(self, allow_mutation: bool):
        return self.unpack(self.handle)


class _Caching(TorchDispatchMode):
    """Around the forward: runs each op, asks the policy, records the outputs."""

    def __init__(self, owner: "SelectiveOffload", cache: dict) -> None:
        super().__init__()
        self.owner = owner
        self.cache = cache
        self.counts: dict = defaultdict(int)

    def __enter__(self):
        self.owner._begin()
        try:
            return super().__enter__()
        except BaseException:
            self.owner._end()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.owner._end()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func in _IGNORED_OPS:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        index = self.counts[func]
        self.counts[func] += 1
        decision = self.owner._decide(out, func, args, kwargs)
        if decision in OFFLOAD_POLICIES:
            pack, unpack = self.owner._pack, self.owner._unpack
            entry = tree_map(lambda v: _Offloaded(v, pack, unpack) if isinstance(v, torch.Tensor) else _Kept(v), out)
        elif decision in _SAVE:
            entry = tree_map(_Kept, out)
        else:
            entry = _RECOMPUTE
        self.cache.setdefault(func, {})[index] = entry
        return out


class _Cached(TorchDispatchMode):
    """Around the recompute: answers the cached ops from the cache (each entry once)."""

    def __init__(self, cache: dict, allow_mutation: bool) -> None:
        super().__init__()
        self.cache = cache
        self.allow_mutation = allow_mutation
        self.counts: dict = defaultdict(int)

    def __enter__(self):
        self.counts.clear()  # a second backward (retain_graph) starts counting again, and raises below
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func in _IGNORED_OPS:
            return func(*args, **kwargs)
        index = self.counts[func]
        self.counts[func] += 1
        entry = self.cache.get(func, {}).get(index)
        if entry is None:
            raise RuntimeError(
                f"co.selective_offload_context: {func} (call {index}) ran in the recompute but not in the forward. "
                "The checkpointed function must run the same ops in backward as in forward (no randomness in "
                "control flow, no global state that changed in between)."
            )
        if entry is _CONSUMED:
            raise RuntimeError(
                "co.selective_offload_context: trying to backward an extra time through a selectively checkpointed "
                "region; each region can be differentiated once (its cached outputs are released as the recompute "
                "uses them)."
            )
        if entry is _RECOMPUTE:
            return func(*args, **kwargs)
        self.cache[func][index] = _CONSUMED  # released now, not when the graph dies
        return tree_map(lambda e: e.get(self.allow_mutation), entry)


class SelectiveOffload:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: call it with no arguments to get
    the pair of contexts torch's checkpoint enters (the forward's, the recompute's). Made by
    :func:`selective_offload_context`; one object serves any number of checkpoints and steps.

    Attributes: ``policy_fn``, ``options`` (the :class:`~ckpt_offload.OffloadOptions`), ``pool``.
    :meth:`stats` counts what went to the pool (the keys of ``co.offload().stats()``).
    """

    def __init__(self, policy_fn, options: OffloadOptions, allow_cache_entry_mutation: bool):
        self.policy_fn = policy_fn
        self.options = options
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        # One packer for every region this object serves (its counts add up in stats()). Its
        # per-forward state (the dedup table, batches) is opened by the outermost forward and
        # closed when that forward ends.
        self._context = offload_context._from_options(options)
        # The cache hands its entries out as the outputs of ops: each unpack must be a tensor of its
        # own, never one another unpack made (Note [Same view, same tensor]).
        self._context._packer.distinct_unpacks = True
        self._pack, self._unpack = self._context._packer.pack, self._context._packer.unpack
        self._lock = threading.Lock()
        self._depth = 0

    @property
    def pool(self):
        return self._context.pool

    def __reduce__(self):
        # Pickled (with the model whose checkpoint function holds it): a fresh packer with the
        # same policy and options; the copy's counts are its own.
        return (SelectiveOffload, (self.policy_fn, self.options, self.allow_cache_entry_mutation))

    def __deepcopy__(self, memo):
        # Copied (a model's deepcopy): the same, sharing the options and their pool.
        return SelectiveOffload(self.policy_fn, self.options, self.allow_cache_entry_mutation)

    def __call__(self):
        cache: dict = {}
        return _Caching(self, cache), _Cached(cache, self.allow_cache_entry_mutation)

    def _begin(self) -> None:
        with self._lock:
            self._depth += 1
            first = self._depth == 1
        if first:
            self._context._packer.begin()

    def _end(self) -> None:
        with self._lock:
            self._depth -= 1
            last = self._depth == 0
        if last:
            self._context._packer.end(keep_dedup=False)

    def _decide(self, out, func, args, kwargs):
        if _SelectiveCheckpointContext is not None:
            try:
                ctx = _SelectiveCheckpointContext(is_recompute=False, op_output=out)
            except TypeError:  # a torch whose context has no op_output
                ctx = _SelectiveCheckpointContext(is_recompute=False)
        else:  # pragma: no cover - torch without selective checkpointing
            ctx = None
        decision = self.policy_fn(ctx, func, *args, **kwargs)
        if isinstance(decision, bool):
            return _policy("MUST_SAVE") if decision else _policy("PREFER_RECOMPUTE")
        if decision in OFFLOAD_POLICIES or decision in _SAVE or decision in _RECOMPUTE_POLICIES:
            return decision
        raise TypeError(
            f"co.selective_offload_context: policy_fn returned {decision!r} for {func}; it must return a "
            f"torch.utils.checkpoint.CheckpointPolicy ({_policy_names()}) or a bool (True: save, False: recompute)"
        )

    def stats(self) -> dict:
        """What went to the pool, over every region this object served: ``co.offload().stats()``'s keys
        (``tensors_offloaded``, ``bytes_offloaded``, ``tensors_reloaded``, ``kept_by_reason``, ...)."""
        return self._context.stats()

    def reset_stats(self) -> None:
        """Starts the counts of :meth:`stats` over."""
        self._context.reset_stats()

    def __repr__(self) -> str:
        name = getattr(self.policy_fn, "__name__", type(self.policy_fn).__name__)
        return f"co.selective_offload_context({name}, offload={self.options!r})"


@suggest_keywords("co.selective_offload_context")
def selective_offload_context(
    policy_fn: Callable[..., Any], offload=True, *, allow_cache_entry_mutation: bool = False
) -> SelectiveOffload:
    """A ``context_fn`` for selective activation checkpointing in which the outputs the policy marks
    ``CheckpointPolicy.MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD`` wait in the host pool between
    forward and backward, the ones marked ``MUST_SAVE`` / ``PREFER_SAVE`` stay on the device, and
    the rest are recomputed -- in eager mode, where torch itself recomputes the offload ones.

    Pass it as ``context_fn=`` to ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
    to :func:`ckpt_offload.checkpoint`, or to Hugging Face's
    ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"context_fn": ..., "use_reentrant":
    False})``. Gradients are bit-identical to torch's selective checkpoint with the same policy
    (offload read as save): the pool stores the bytes exactly (unless ``store_dtype`` says otherwise).

    Args:
        policy_fn: ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (or a bool: True
            saves, False recomputes), called once per op in forward, as for torch's
            ``create_selective_checkpoint_contexts``.
        offload: where and how the offload-marked outputs are stored: ``True`` (``co.offload``'s
            defaults: the accelerator's tensors of at least ``min_bytes``), a dict of
            ``co.offload`` options (``{"devices": ["cpu"], "min_bytes": 0}``) or a
            :class:`~ckpt_offload.OffloadOptions`. Outputs it would not offload (parameters, tensors
            under ``min_bytes``, on a device it does not offload) are kept on the device, as saved.
        allow_cache_entry_mutation: as torch's: an in-place change of a saved (kept) output after
            it was saved is allowed instead of raising, and backward sees the changed values. An
            offload-marked output changed in place still makes backward raise: its copy to the
            host may have read the old or the new values.

    Each op's outputs are released as soon as the recompute has used them; differentiating a
    region a second time (``retain_graph=True``) raises. It needs a torch whose ``CheckpointPolicy``
    has ``MUST_CPU_OFFLOAD`` (2.14 has); ``torch.compile`` has its own treatment of the policies
    and is not served by this eager context.

    Example::

        from torch.utils.checkpoint import CheckpointPolicy, checkpoint

        def policy(ctx, op, *args, **kwargs):
            if op is torch.ops.aten.mm.default:
                return CheckpointPolicy.MUST_CPU_OFFLOAD   # matmul outputs: kept, in host memory
            return CheckpointPolicy.PREFER_RECOMPUTE       # everything else: recomputed

        context_fn = co.selective_offload_context(policy)
        y = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"context_fn": context_fn, "use_reentrant": False})
    """
    if CheckpointPolicy is None or not OFFLOAD_POLICIES:
        raise RuntimeError(
            "co.selective_offload_context needs torch.utils.checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD, which "
            f"this torch ({torch.__version__}) does not have"
        )
    if not callable(policy_fn):
        raise TypeError(
            f"policy_fn must be callable as policy_fn(ctx, op, *args, **kwargs) returning a CheckpointPolicy; got "
            f"{type(policy_fn).__name__}. For a list of ops to offload, write "
            "lambda ctx, op, *a, **k: CheckpointPolicy.MUST_CPU_OFFLOAD if op in ops else "
            "CheckpointPolicy.PREFER_RECOMPUTE"
        )
    if not isinstance(allow_cache_entry_mutation, bool):
        raise TypeError(f"allow_cache_entry_mutation must be True or False, got {allow_cache_entry_mutation!r}")
    if offload is None or offload is False:
        raise ValueError(
            "co.selective_offload_context: offload must say where the offload-marked outputs go (True, a dict of "
            "co.offload options or a co.OffloadOptions); for torch's own selective checkpoint without offload use "
            "torch.utils.checkpoint.create_selective_checkpoint_contexts"
        )
    options = as_options(offload)
    check_offloads_something(options.devices, "co.selective_offload_context(offload=...)")
    return SelectiveOffload(policy_fn, options, allow_cache_entry_mutation)


# --- the planner's selective kinds: what "selective" and "selective_offload" blocks keep ----------

# What selective recompute keeps (its outputs are saved, everything else is recomputed): the ops
# whose recompute costs the most per byte they produce (Korthikanti et al. 2022 keep the matmuls and
# recompute attention's cheap pointwise ops).
SELECTIVE_SAVE_OPS = tuple(
    op
    for op in (
        getattr(torch.ops.aten, name, None)
        for name in (
            "mm",
            "addmm",
            "bmm",
            "baddbmm",
            "convolution",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        )
    )
    if op is not None
)
_SAVE_OPS = set(SELECTIVE_SAVE_OPS)


def selective_policy(ctx, op, *args, **kwargs):
    """Torch's selective-checkpoint policy of the planner's "selective": keep the outputs of matmuls,
    convolutions and fused attention, recompute everything else."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn_selective():
    """The ``context_fn`` of a plan's "selective" block: torch's selective checkpoint of :func:`selective_policy`."""
    return create_selective_checkpoint_contexts(selective_policy)


def offload_policy(ctx, op, *args, **kwargs):
    """The planner's "selective_offload": :func:`selective_policy` with the outputs it saves
    offloaded (``CheckpointPolicy.MUST_CPU_OFFLOAD``) instead of kept on the device."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_CPU_OFFLOAD if packet in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_selective_offloads_lock = threading.Lock()
_selective_offloads: dict = {}  # options -> context_fn of the blocks wrapped without a handle


def context_fn_selective_offload(options, collector):
    """The ``context_fn`` of a "selective_offload" block: one per handle and options (its packer's
    counts are the handle's, in ``handle.stats()``)."""
    table = _selective_offloads if collector is None else collector.__dict__.setdefault("_selective_offloads", {})
    key = (options.replace(pool=None), id(options.pool))
    with _selective_offloads_lock:
        context_fn = table.get(key)
        if context_fn is None:
            context_fn = table[key] = selective_offload_context(offload_policy, options)
    if collector is not None:
        collector.add(context_fn._context)
    return context_fn

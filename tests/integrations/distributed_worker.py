"""One rank of the multi-process tests in tests/integrations/test_distributed.py (not a test module itself).

Launched by tests/gloo_ranks.py as ``python tests/integrations/distributed_worker.py OUT_DIR SCENARIO...``,
one process per rank, gloo over 127.0.0.1. One launch runs every scenario it is given in one
process group (a process start costs seconds on a 2-core machine; a scenario costs far less), and
writes ``OUT_DIR/rank{RANK}.pt``: ``{scenario: result dict}``, or ``{"error": traceback}`` for
a scenario that raised -- so the test reports the failing composition by name (the loop is
worker_main.py's, shared with deepspeed_worker.py).

Every scenario trains the same tiny model twice from the same seed and data, once as the engine
runs it alone and once with ckpt_offload, and returns both final (full, unsharded) parameter
sets plus ckpt_offload's counters. Each rank trains on its own batches (the data depends on the
rank), so an engine that did not reduce gradients would leave the ranks' parameters apart.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ckpt_offload as co
from ckpt_offload.demo.model import TinyTransformer, lm_loss
from worker_main import run_rank

# tests/ (the shared helpers) after this script's folder, which Python put first.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import QUIET_CPU_TRAINING, gpt2  # noqa: E402

MODEL = dict(vocab=64, dim=32, layers=4, heads=4, seq=16, dropout=0.1)
STEPS = 3
BATCH = 4


def rank() -> int:
    return dist.get_rank()


def batches(steps=STEPS, micro=1):
    """[step][micro] token batches; different on every rank."""
    g = torch.Generator().manual_seed(100 + rank())
    return [
        [torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq"] + 1), generator=g) for _ in range(micro)]
        for _ in range(steps)
    ]


def cpu_options(pool):
    return {"devices": ["cpu"], "min_bytes": 0, "pool": pool}


def full_params(model) -> dict:
    """Parameters by name, as full tensors (FSDP2's are sharded DTensors)."""
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n.removeprefix("module.")] = t.detach().clone()
    return out


def wrap(model, how, pool):
    """Puts ckpt_offload on ``model`` in one of the ways a user writes it. Returns a context
    manager to run each forward in (co.offload) and the co.apply handle, if any."""
    opts = cpu_options(pool)
    if how == "offload":
        ctx = co.offload(**opts)
        return ctx, None
    if how == "checkpoint":
        # The user's own forward loop calls co.checkpoint per block.
        for block in model.blocks:
            block.forward = functools.partial(co.checkpoint, block.forward, offload=opts)
        return None, None
    if how == "apply2":
        return None, co.apply(model, every_n_layers=2, offload=opts)
    if how == "apply":
        return None, co.apply(model, offload=opts)
    assert how is None, how
    return None, None


def result(plain, got, pool, ctx=None, handle=None, **extra):
    co.synchronize()
    out = {"plain": plain, "got": got, "pool": {k: v for k, v in pool.stats().items() if isinstance(v, int)}}
    if ctx is not None:
        out["ctx"] = ctx.stats()
    if handle is not None:
        out["names"] = list(handle.names)
    out.update(extra)
    return out


# --- DDP ---------------------------------------------------------------------------------


def train_ddp(how, pool, micro=1, find_unused=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = TinyTransformer(**MODEL, seed=0)
    if find_unused:
        # A parameter forward never uses: DDP must find it unused in every step's graph, with
        # ckpt_offload's hooks and checkpoints in that graph.
        torch.manual_seed(5)  # the same spare weights in both runs
        model.spare = nn.Linear(MODEL["dim"], MODEL["dim"])
    ctx, handle = wrap(model, how, pool)
    ddp = DDP(model, find_unused_parameters=find_unused)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    torch.manual_seed(1234)  # dropout masks: the same in both runs (checkpoints restore the RNG state)
    for step in batches(micro=micro):
        for i, tokens in enumerate(step):
            # no_sync on every micro-batch but the last: gradients accumulate locally and the
            # last backward all-reduces their sum.
            with ddp.no_sync() if i < micro - 1 else contextlib.nullcontext():
                with ctx if ctx is not None else contextlib.nullcontext():
                    loss = lm_loss(ddp, tokens)
                loss.backward()
        opt.step()
        opt.zero_grad()
    return full_params(model), ctx, handle


def ddp_scenario(how, micro=1, find_unused=False):
    plain, _, _ = train_ddp(None, co.HostPool(pinned=False), micro, find_unused)
    pool = co.HostPool(pinned=False)
    got, ctx, handle = train_ddp(how, pool, micro, find_unused)
    return result(plain, got, pool, ctx, handle)


# --- FSDP2 -------------------------------------------------------------------------------


def fsdp2_available():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return f"torch.distributed.fsdp.fully_shard is missing in torch {torch.__version__}: {e}"
    return None


def train_fsdp2(how, pool, order, reshard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = TinyTransformer(**MODEL, seed=0)
    ctx = handle = None
    if order == "before":
        ctx, handle = wrap(model, how, pool)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if order == "after":
        ctx, handle = wrap(model, how, pool)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1234)
    for (tokens,) in batches():
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return full_params(model), ctx, handle


def fsdp2_scenario(how, order, reshard):
    missing = fsdp2_available()
    if missing:
        return {"unsupported": missing}
    plain, _, _ = train_fsdp2(None, co.HostPool(pinned=False), order, reshard)
    pool = co.HostPool(pinned=False)
    got, ctx, handle = train_fsdp2(how, pool, order, reshard)
    extra = {}
    if how == "offload":
        # The same co.offload around the same forward of an unsharded model in this process: what
        # it keeps as parameters and offloads as activations, for the test to compare with.
        local = TinyTransformer(**MODEL, seed=0)
        reference = co.offload(**cpu_options(co.HostPool(pinned=False)))
        torch.manual_seed(1234)
        for (tokens,) in batches():
            with reference:
                loss = lm_loss(local, tokens)
            loss.backward()
        extra["reference_ctx"] = reference.stats()
    return result(plain, got, pool, ctx, handle, **extra)


# --- tensor parallel (DTensor) --------------------------------------------------------------


class MLPBlock(nn.Module):
    """A residual MLP block; tensor parallel splits fc1 column-wise and fc2 row-wise."""

    def __init__(self, dim=32, hidden=128):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class MLPStack(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def tp_loss(out):
    # The row-wise layer's output is a replicated DTensor (use_local_output=False): its local
    # tensor is the whole output on every rank.
    return (out.to_local() if hasattr(out, "to_local") else out).square().mean()


def train_tp(how, pool, fsdp=False):
    """Tensor parallel over every rank (or, with ``fsdp``, FSDP2 over a 2-D mesh's first
    dimension on top of tensor parallel over its second, the composition torchtitan uses: 1 x 2
    on 2 ranks, 2 x 2 on 4).
    The blocks' outputs stay DTensors, so the residual stream, the blocks' inputs (what
    ``co.apply`` offloads) and everything autograd saves inside them are DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    dp = 2 if fsdp and world >= 4 and world % 2 == 0 else 1  # 4 ranks: a 2 x 2 mesh
    mesh2d = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp")) if fsdp else None
    tp_mesh = mesh2d["tp"] if fsdp else init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = MLPStack()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(use_local_output=False)})
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh2d["dp"])
        fully_shard(model, mesh=mesh2d["dp"])
    opts = cpu_options(pool)
    ctx = co.offload(**opts) if how == "offload" else None
    handle = co.apply(model, offload=opts) if how == "apply" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)  # tensor parallel: every rank sees the same batch
    for _ in range(STEPS):
        x = DTensor.from_local(torch.randn(8, 32, generator=g), tp_mesh, [Replicate()])
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = tp_loss(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return full_params(model), ctx, handle


def tp_scenario(how, fsdp=False):
    if fsdp and fsdp2_available():
        return {"unsupported": fsdp2_available()}
    plain, _, _ = train_tp(None, co.HostPool(pinned=False), fsdp)
    pool = co.HostPool(pinned=False)
    got, ctx, handle = train_tp(how, pool, fsdp)
    extra = {}
    if handle is not None:
        # What the checkpoints' own offload contexts did: the blocks' DTensor inputs went to the pool.
        extra["apply_stats"] = handle.stats()
    return result(plain, got, pool, ctx, handle, **extra)


def dtensor_details_scenario():
    """Deduplication and in-place detection on DTensors, and a DTensor parameter saved for backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    pool = co.HostPool(pinned=False)
    d = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)]).requires_grad_()
    ctx = co.offload(**cpu_options(pool))
    with ctx:
        h = d * 3  # a DTensor activation
        a = h.sin()  # saves h
        b = h.view(-1).cos()  # saves a view of h: the same local storage
    (a.sum() + b.sum()).backward()
    d2 = d.detach().clone().requires_grad_()  # the same without ckpt_offload
    h2 = d2 * 3
    (h2.sin().sum() + h2.view(-1).cos().sum()).backward()
    out["grad_bit_identical"] = torch.equal(d.grad.to_local(), d2.grad.to_local())
    out["ctx"] = ctx.stats()
    out["grad_type"] = type(d.grad).__name__
    # In place after saving: backward must raise, as autograd does without hooks.
    with co.offload(**cpu_options(pool)):
        h = d * 2
        z = h.sin()
    h.add_(1)
    try:
        z.sum().backward()
        out["inplace"] = "no error"
    except RuntimeError as e:
        out["inplace"] = str(e)
    del h, z
    # A replicated DTensor parameter used in a matmul: autograd saves the parameter (kept as one).
    w = nn.Parameter(distribute_tensor(torch.randn(16, 16), mesh, [Replicate()]))
    x = distribute_tensor(torch.randn(4, 16), mesh, [Replicate()]).requires_grad_()
    pctx = co.offload(**cpu_options(pool))
    with pctx:
        y = (x @ w.t()).relu()
    y.sum().backward()
    out["param_ctx"] = pctx.stats()
    # Any other __torch_dispatch__ subclass (here torch's test TwoTensor) is still kept.
    from torch.testing._internal.two_tensor import TwoTensor

    tt = TwoTensor(torch.randn(64), torch.randn(64)).requires_grad_()
    sctx = co.offload(**cpu_options(pool))
    with sctx:
        u = (tt * 2).sin()
    u.sum().backward()
    out["subclass_ctx"] = sctx.stats()
    co.synchronize()
    out["pool"] = {k: v for k, v in pool.stats().items() if isinstance(v, int)}
    return out


# --- sequence parallel: Ulysses all-to-all, torch's context parallel -------------------------

SP = dict(vocab=64, dim=32, heads=4, layers=2, seq=16, batch=2)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 of a ``[world, ...]`` tensor: chunk j goes to rank j, and
    chunk j of the result came from rank j. With equal chunks the exchange is its own inverse, so
    backward sends the gradient back the same way. (gloo has all_to_all_single on CPU tensors.)"""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty(x.shape, dtype=x.dtype)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad)


def seq_to_heads(x, world):
    """Ulysses' first all-to-all: ``[B, S/P, H, hd]`` (this rank's tokens, every head) to
    ``[B, S, H/P, hd]`` (every token, this rank's heads)."""
    b, s, h, d = x.shape
    x = AllToAll.apply(x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4))  # [P, B, S/P, H/P, hd]
    return x.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def heads_to_seq(x, world):
    """Ulysses' second all-to-all, the inverse of :func:`seq_to_heads`."""
    b, s, h, d = x.shape
    x = AllToAll.apply(x.reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4))  # [P, B, S/P, H/P, hd]
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h, d)


def sdpa(q, k, v, causal):
    """Attention on ``[B, S, H, hd]`` tensors."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    ).transpose(1, 2)


def ulysses_attention(q, k, v, causal=True):
    """DeepSpeed Ulysses: each rank holds a slice of the sequence; an all-to-all gives it the whole
    sequence for H/P heads, attention runs on those, and a second all-to-all gives the sequence back."""
    world = dist.get_world_size()
    q, k, v = (seq_to_heads(t, world) for t in (q, k, v))
    return heads_to_seq(sdpa(q, k, v, causal), world)


class SPBlock(nn.Module):
    def __init__(self, attention, dropout):
        super().__init__()
        dim = SP["dim"]
        self.attention = attention
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, SP["heads"], dim // SP["heads"]).unbind(2)
        x = x + self.drop(self.proj(self.attention(q, k, v).reshape(b, s, dim)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class SPModel(nn.Module):
    """A tiny causal LM whose forward sees this rank's slice of the sequence (tokens and their
    global positions); ``attention(q, k, v)`` is the sequence-parallel part."""

    def __init__(self, attention, dropout=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(SP["vocab"], SP["dim"]), nn.Embedding(SP["seq"], SP["dim"])
        self.blocks = nn.ModuleList(SPBlock(attention, dropout) for _ in range(SP["layers"]))
        self.norm, self.head = nn.LayerNorm(SP["dim"]), nn.Linear(SP["dim"], SP["vocab"])

    def forward(self, tokens, positions):
        x = self.emb(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sp_batches(steps=2):
    """(inputs, labels, positions) per step, whole sequences: the same on every rank, which trains
    on its slice of them."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        t = torch.randint(0, SP["vocab"], (SP["batch"], SP["seq"] + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:], torch.arange(SP["seq"]).expand(SP["batch"], -1)))
    return out


def sp_loss(model, inputs, labels, positions):
    """This rank's tokens' share of the mean cross-entropy over every token of the batch."""
    logits = model(inputs, positions)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (SP["batch"] * SP["seq"])


def reduce_grads(model):
    """The ranks hold the same parameters and each has its tokens' share of the gradient: sum them
    (what DDP or FSDP over the sequence-parallel group does)."""
    for p in model.parameters():
        dist.all_reduce(p.grad)


def ulysses_step(model, batch, ctx):
    """One forward and backward on this rank's contiguous slice of the sequence."""
    world = dist.get_world_size()
    with ctx:
        loss = sp_loss(model, *(t.chunk(world, dim=1)[rank()].contiguous() for t in batch))
    loss.backward()
    reduce_grads(model)


def context_parallel_step(backend):
    """One forward and backward under torch's ``context_parallel``: it shards the buffers (inputs,
    labels, positions; load-balanced, so a rank's slice need not be contiguous) along the sequence
    in place and patches ``scaled_dot_product_attention`` to run on DTensors sharded on it.
    Backward runs inside the context too, with or without ckpt_offload: on exit the context
    writes the whole buffers back into them in place, which the embedding saved for backward
    (autograd's version check fails outside), and a checkpointed block's recompute must call the
    patched attention again. ``backend``: an ``SDPBackend`` name, or None for torch's choice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def step(model, batch, ctx):
        buffers = [t.clone() for t in batch]
        kernel = sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext()
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1]), kernel:
            with ctx:
                loss = sp_loss(model, *buffers)
            loss.backward()
        reduce_grads(model)

    return step


def train_sp(attention, step, how, pool, dropout=0.1):
    """Returns the final parameters, the co.offload context and co.apply handle (if any), and the
    pool's bytes in use after each step's backward."""
    model = SPModel(attention, dropout)
    opts = cpu_options(pool)
    handle = co.apply(model, offload=opts) if how == "apply" else None
    ctx = co.offload(**opts) if how == "offload" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1234)  # the same dropout masks in both runs
    after_backward = []
    for batch in sp_batches():
        step(model, batch, ctx if ctx is not None else contextlib.nullcontext())
        co.synchronize()
        after_backward.append(pool.stats()["bytes_in_use"])
        opt.step()
        opt.zero_grad()
    return full_params(model), ctx, handle, after_backward


def sp_scenario(kind, how, causal=True, backend=None):
    """Sequence parallel (``kind`` "ulysses" or "context_parallel") trained with ckpt_offload
    (``how``) and without. A context-parallel configuration torch itself cannot run on CPU is
    reported as unsupported, with torch's error."""
    attention = ulysses_attention if kind == "ulysses" else (lambda q, k, v: sdpa(q, k, v, causal))
    step = ulysses_step if kind == "ulysses" else context_parallel_step(backend)
    try:
        plain, _, _, _ = train_sp(attention, step, None, co.HostPool(pinned=False))
    except NotImplementedError as e:
        if kind == "ulysses":
            raise
        return {
            "unsupported": f"torch {torch.__version__}'s context_parallel, {backend or 'default'} attention on "
            f"CPU (is_causal={causal}), fails without ckpt_offload: {e}"
        }
    pool = co.HostPool(pinned=False)
    got, ctx, handle, after_backward = train_sp(attention, step, how, pool)
    initial = SPModel(attention).state_dict()
    extra = {
        "bytes_after_backward": after_backward,
        "trained": any(not torch.equal(initial[n], p) for n, p in got.items()),
    }
    if handle is not None:
        extra["apply_stats"] = handle.stats()  # the checkpoints' own offload contexts
    # Dropout off, one step: the sequence-parallel gradient equals the gradient of the whole
    # sequence in one process (up to rounding) -- the exchanges and the sum compute the same thing.
    batch = sp_batches(1)[0]
    sharded = SPModel(attention, dropout=0.0)
    step(sharded, batch, contextlib.nullcontext())
    whole = SPModel(lambda q, k, v: sdpa(q, k, v, causal), dropout=0.0)
    sp_loss(whole, *batch).backward()
    extra["max_diff_to_unsharded"] = max(
        (a.grad - b.grad).abs().max().item() for a, b in zip(sharded.parameters(), whole.parameters())
    )
    return result(plain, got, pool, ctx, handle, **extra)


# --- Accelerate with its FSDP2 plugin ---------------------------------------------------------


def accelerate_fsdp2_scenario():
    """Accelerate's FSDP2 plugin. Accelerate picks FSDP only for accelerator devices, so on CPU
    processes ``Accelerator(cpu=True, fsdp_plugin=...)`` runs as MULTI_CPU and ``prepare`` would not
    shard; there the model goes through accelerate's own FSDP2 preparation,
    ``accelerate.utils.fsdp_utils.fsdp2_prepare_model`` (what ``prepare`` calls under FSDP:
    ``fully_shard`` on every layer its wrap policy picks, then on the root), with the plugin set on
    the accelerator's state -- the same composition, run by accelerate's code."""
    import accelerate
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule

    def train(how, pool):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Block"],
            reshard_after_forward=True,
        )
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        model = TinyTransformer(**MODEL, seed=0)
        handle = co.apply(model, offload=cpu_options(pool)) if how else None  # on the bare model, as documented
        kind = accelerator.distributed_type
        if kind == DistributedType.FSDP:
            model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        else:  # prepare would wrap the model in DDP (MULTI_CPU): accelerate's FSDP2 step, then the optimizer
            accelerator.state.fsdp_plugin = plugin
            model = fsdp2_prepare_model(accelerator, model)
            opt = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
        sharded = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        torch.manual_seed(1234)
        for (tokens,) in batches():
            accelerator.backward(lm_loss(model, tokens))
            opt.step()
            opt.zero_grad()
        return full_params(model), handle, kind, sharded

    plain, _, kind, sharded = train(None, None)
    pool = co.HostPool(pinned=False)
    got, handle, _, _ = train("apply", pool)
    out = result(plain, got, pool, handle=handle)
    out["distributed_type"] = kind.value
    out["accelerate"] = accelerate.__version__
    out["sharded"] = sharded
    return out


# --- Hugging Face Trainer (DDP over gloo, accelerate underneath) ---------------------------


def hf_trainer_scenario(out_dir):
    import transformers

    def model():
        torch.manual_seed(0)
        return gpt2(use_cache=False)

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(1, 100, (16, 8), generator=torch.Generator().manual_seed(2))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def train(m, callbacks, tag):
        args = transformers.TrainingArguments(
            output_dir=os.path.join(out_dir, tag),
            max_steps=3,
            per_device_train_batch_size=2,
            ddp_backend="gloo",
            **QUIET_CPU_TRAINING,
        )
        trainer = transformers.Trainer(model=m, args=args, train_dataset=Tokens(), callbacks=callbacks)
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        return losses, {n: p.detach().clone() for n, p in m.named_parameters()}, trainer

    plain_losses, plain, trainer = train(model(), [], "plain")
    pool = co.HostPool(pinned=False)
    cb = co.hf.OffloadCheckpointCallback(every_n_layers=2, offload=cpu_options(pool))
    losses, got, trainer = train(model(), [cb], "offload")
    return result(
        plain,
        got,
        pool,
        handle=cb.handle,
        plain_losses=plain_losses,
        losses=losses,
        calls=cb.handle.function.calls,
        world_size=trainer.args.world_size,
        parallel_mode=str(trainer.args.parallel_mode),
        wrapped=type(trainer.model_wrapped).__name__,
    )


def trl_sft_scenario(out_dir):
    """TRL's SFTTrainer (a Trainer subclass: its own dataset preparation, loss and metrics) over 2
    processes with ``co.hf.OffloadCheckpointCallback``: same losses, same parameters."""
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers

    # A word-level tokenizer built here: SFTTrainer wants a processing class, and nothing is downloaded.
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w1"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w0", pad_token="w0", unk_token="w1")
    ids = torch.randint(2, 100, (16, 8), generator=torch.Generator().manual_seed(2)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids})  # already tokenized

    def model():
        torch.manual_seed(0)
        return gpt2(use_cache=False, pad_token_id=0)

    def train(m, callbacks, tag):
        args = trl.SFTConfig(
            output_dir=os.path.join(out_dir, tag),
            max_steps=3,
            per_device_train_batch_size=2,
            ddp_backend="gloo",
            **QUIET_CPU_TRAINING,
        )
        trainer = trl.SFTTrainer(model=m, args=args, train_dataset=data, processing_class=tok, callbacks=callbacks)
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        return losses, {n: p.detach().clone() for n, p in m.named_parameters()}, trainer

    plain_losses, plain, _ = train(model(), [], "plain")
    pool = co.HostPool(pinned=False)
    cb = co.hf.OffloadCheckpointCallback(every_n_layers=2, offload=cpu_options(pool))
    losses, got, trainer = train(model(), [cb], "offload")
    return result(
        plain,
        got,
        pool,
        handle=cb.handle,
        plain_losses=plain_losses,
        losses=losses,
        calls=cb.handle.function.calls,
        world_size=trainer.args.world_size,
        trl=trl.__version__,
    )


SCENARIOS = {
    "ddp_offload": lambda out: ddp_scenario("offload"),
    "ddp_checkpoint": lambda out: ddp_scenario("checkpoint"),
    "ddp_apply2": lambda out: ddp_scenario("apply2"),
    "ddp_apply2_no_sync": lambda out: ddp_scenario("apply2", micro=2),
    "ddp_offload_no_sync": lambda out: ddp_scenario("offload", micro=2),
    "ddp_apply2_find_unused": lambda out: ddp_scenario("apply2", find_unused=True),
    "ddp_offload_find_unused": lambda out: ddp_scenario("offload", find_unused=True),
    "fsdp2_offload_reshard": lambda out: fsdp2_scenario("offload", "after", True),
    "fsdp2_offload_no_reshard": lambda out: fsdp2_scenario("offload", "after", False),
    "fsdp2_apply_before_reshard": lambda out: fsdp2_scenario("apply", "before", True),
    "fsdp2_apply_after_reshard": lambda out: fsdp2_scenario("apply", "after", True),
    "fsdp2_apply_before_no_reshard": lambda out: fsdp2_scenario("apply", "before", False),
    "tp_offload": lambda out: tp_scenario("offload"),
    "tp_apply": lambda out: tp_scenario("apply"),
    "fsdp2_tp_offload": lambda out: tp_scenario("offload", fsdp=True),
    "fsdp2_tp_apply": lambda out: tp_scenario("apply", fsdp=True),
    "dtensor_details": lambda out: dtensor_details_scenario(),
    "sp_ulysses_apply": lambda out: sp_scenario("ulysses", "apply"),
    "sp_ulysses_offload": lambda out: sp_scenario("ulysses", "offload"),
    "sp_cp_math_apply": lambda out: sp_scenario("context_parallel", "apply", causal=False, backend="MATH"),
    "sp_cp_math_offload": lambda out: sp_scenario("context_parallel", "offload", causal=False, backend="MATH"),
    "sp_cp_causal_apply": lambda out: sp_scenario("context_parallel", "apply", causal=True),
    "accelerate_fsdp2": lambda out: accelerate_fsdp2_scenario(),
    "hf_trainer": hf_trainer_scenario,
    "trl_sft": trl_sft_scenario,
}


def main(out_dir: str, names: list) -> None:
    def start() -> dict:
        dist.init_process_group("gloo")
        return {}

    run_rank(out_dir, names, lambda name: SCENARIOS[name](out_dir), start)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

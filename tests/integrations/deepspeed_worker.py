"""One rank of tests/integrations/test_deepspeed.py (not a test module itself).

Launched by tests/gloo_ranks.py as ``python tests/integrations/deepspeed_worker.py OUT_DIR SCENARIO...``, one
process per rank, gloo over 127.0.0.1, DeepSpeed's CPU accelerator. Each scenario
(``zero{1,2,3}_{offload,apply}``) trains the tiny transformer with ``deepspeed.initialize`` for a
few steps alone and again with ckpt_offload, and writes both final (gathered) parameter sets and
ckpt_offload's counters to ``OUT_DIR/rank{RANK}.pt`` (the loop over the scenarios is
worker_main.py's, shared with distributed_worker.py).

DeepSpeed's TorchBackend JIT-compiles a shared-memory all-reduce op (``deepspeed_shm_comm``)
when its communication backend starts, before the process group's rendezvous: minutes of C++
compilation on a small machine, which is what kept the ranks from reaching the rendezvous
within a test's timeout. That op serves only ``inference_all_reduce``; training's collectives
go through torch.distributed (gloo here). The worker marks the op unavailable, as DeepSpeed
does itself where the op cannot be built, so no compiler runs.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import ckpt_offload as co
from ckpt_offload.demo.model import TinyTransformer, lm_loss
from worker_main import run_rank

MODEL = dict(vocab=64, dim=32, layers=4, heads=4, seq=16, dropout=0.1)
STEPS = 3
BATCH = 4


def batches():
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq"] + 1), generator=g) for _ in range(STEPS)]


def train(stage, how, pool):
    import deepspeed

    model = TinyTransformer(**MODEL, seed=0)
    opts = {"devices": ["cpu"], "min_bytes": 0, "pool": pool}
    ctx = co.offload(**opts) if how == "offload" else None
    handle = co.apply(model, offload=opts) if how == "apply" else None  # on the bare model, before initialize
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        # torch's AdamW: DeepSpeed's own CPU Adam is a C++ op it would compile first.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(1234)  # dropout masks: the same in both runs (checkpoints restore the RNG state)
    for tokens in batches():
        if ctx is not None:
            with ctx:
                loss = lm_loss(engine, tokens)
        else:
            loss = lm_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
    params = {}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        for n, p in engine.module.named_parameters():
            params[n] = p.detach().clone()
    out = {"params": params}
    if ctx is not None:
        out["ctx"] = ctx.stats()
    if handle is not None:
        out["names"] = list(handle.names)
        out["apply_stats"] = handle.stats()
    if stage == 3:
        # What ZeRO-3 leaves in a parameter between uses: an empty placeholder (the shard lives in ds_tensor).
        out["partitioned_numel"] = sum(p.numel() for p in engine.module.parameters())
    return out


def scenario(name):
    stage, how = int(name[4]), name.split("_")[1]
    plain = train(stage, None, co.HostPool(pinned=False))
    pool = co.HostPool(pinned=False)
    got = train(stage, how, pool)
    co.synchronize()
    return {
        "plain": plain["params"],
        "got": got["params"],
        **{k: v for k, v in got.items() if k != "params"},
        "pool": {k: v for k, v in pool.stats().items() if isinstance(v, int)},
    }


def main(out_dir: str, names: list) -> None:
    def start() -> dict:
        import deepspeed
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the module docstring
        deepspeed.init_distributed(dist_backend="gloo")
        return {"deepspeed": deepspeed.__version__}

    run_rank(out_dir, names, scenario, start)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

"""One local rank of tests/offload/test_host_share.py (not a test module itself).

Launched by tests/gloo_ranks.py as ``python tests/offload/host_share_worker.py OUT_DIR NODE_MAX_BYTES
SPILL_DIR``, one process per rank with ``LOCAL_WORLD_SIZE`` set, gloo over 127.0.0.1. Every rank
makes its pool with ``co.HostPool(max_bytes="auto", node_max_bytes=...)`` -- the node's budget,
shared between the local ranks -- and ``spill_dir``, trains a small MLP whose saved activations
need more than its share, and writes ``OUT_DIR/rank{RANK}.pt``: its pool's counters, the
warnings it raised, and its gradients with and without ckpt_offload.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

import ckpt_offload as co


def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(8)])
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(2):
        x = torch.randn(256, 64, generator=g)  # 64 KiB per saved activation, ~1 MiB per step
        if ctx is None:
            loss = model(x).square().mean()
        else:
            with ctx:
                loss = model(x).square().mean()
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def main(out_dir: str, node_max_bytes: str, spill_dir: str) -> None:
    co._C.testing.set_cpu_copy_delay_us(int(os.environ.get("CKPT_OFFLOAD_TEST_DELAY_US", "200")))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = {}
    try:
        plain = train(None)
        dist.barrier()  # every rank's pool fills at about the same time
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pool = co.HostPool(
                max_bytes="auto",
                node_max_bytes=int(node_max_bytes),
                pinned=False,
                segment_bytes=64 << 10,
                spill_dir=spill_dir,
                spill_staging_bytes=256 << 10,
            )
            ctx = co.offload(devices=["cpu"], min_bytes=0, pool=pool)
            got = train(ctx)
        co.synchronize()
        s = pool.stats()
        result = {
            "share": pool.share,
            "pool": {k: v for k, v in s.items() if isinstance(v, int)},
            "disk": {k: v for k, v in s["disk"].items() if isinstance(v, int)},
            "warnings": [str(w.message) for w in caught],
            "ctx": ctx.stats(),
            "same_grads": all(torch.equal(plain[n], got[n]) for n in plain),
        }
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""One rank of the LocalSGD test in tests/integrations/test_accelerate.py (not a test module itself).

Launched by the test as a plain ``python tests/integrations/accelerate_worker.py OUT_DIR`` subprocess per
rank, without ``accelerate launch``: the test sets the variables accelerate's ``PartialState``
reads to build a multi-CPU gloo state -- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` -- and ``Accelerator(cpu=True)``
then picks ``DistributedType.MULTI_CPU`` with the gloo backend (``cpu=True`` is what makes a
set ``LOCAL_RANK`` mean "CPU processes" rather than "one GPU each").

The rank trains the same tiny model twice in one process group, from the same seed: once as
is, once with ``co.apply(model, offload={...})`` (applied before ``accelerator.prepare``, the
order a user writes), each inside ``LocalSGD(local_sgd_steps=2)``. It writes both final
parameter sets, the pool counters and the accelerate state to ``OUT_DIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import ckpt_offload as co
from ckpt_offload.demo.model import TinyTransformer, lm_loss

MODEL = dict(vocab=64, dim=32, layers=3, heads=4, seq=16, dropout=0.1)
SAMPLES = 40  # 2 ranks x 5 batches of 4: LocalSGD averages after steps 2 and 4, and on exit
BATCH = 4


def train(accelerator, offload_opts):
    from accelerate.local_sgd import LocalSGD

    model = TinyTransformer(**MODEL, seed=0)
    handle = co.apply(model, offload=offload_opts) if offload_opts is not None else None
    tokens = torch.randint(0, MODEL["vocab"], (SAMPLES, MODEL["seq"] + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens), batch_size=BATCH, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # Every rank draws the same dropout masks; the data differs per rank (accelerate shards it).
    torch.manual_seed(1234)
    steps = 0
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2, enabled=True) as local_sgd:
        if not local_sgd.enabled:
            raise RuntimeError(f"LocalSGD is disabled: distributed_type={accelerator.distributed_type}")
        for (batch,) in loader:
            with accelerator.accumulate(model):
                loss = lm_loss(model, batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
            steps += 1
    params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    return params, steps, handle


def main(out_dir: str) -> None:
    from accelerate import Accelerator

    # The same asynchronous CPU copy threads with an injected delay as tests/conftest.py uses,
    # so a missing wait corrupts data here too.
    co._C.testing.set_cpu_copy_delay_us(
        int(os.environ.get("CKPT_OFFLOAD_CPU_COPY_DELAY_US", os.environ.get("CKPT_OFFLOAD_TEST_DELAY_US", "200")))
    )
    accelerator = Accelerator(cpu=True)
    result = {
        "distributed_type": accelerator.distributed_type.value,
        "backend": accelerator.state.backend,
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
    }
    pool = co.HostPool(pinned=False)
    opts = {"devices": ["cpu"], "min_bytes": 0, "pool": pool}

    result["plain"], result["plain_steps"], _ = train(accelerator, None)
    result["offload"], result["offload_steps"], handle = train(accelerator, opts)
    co.synchronize()
    result["checkpointed_blocks"] = list(handle.names)
    result["pool_stats"] = {k: v for k, v in pool.stats().items() if isinstance(v, int)}

    accelerator.wait_for_everyone()
    torch.save(result, os.path.join(out_dir, f"rank{accelerator.process_index}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])

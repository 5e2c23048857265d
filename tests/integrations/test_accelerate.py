"""Hugging Face Accelerate training loops with co.apply(..., offload=...) end where they end without it.

1. ``accelerator.accumulate(model)`` with ``gradient_accumulation_steps=2`` in this process.
2. ``accelerate.local_sgd.LocalSGD`` across 2 CPU processes talking gloo over 127.0.0.1
   (tests/integrations/accelerate_worker.py is one rank).

Order: ``co.apply`` goes on the bare model *before* ``accelerator.prepare`` -- what a user
writes (build, wrap blocks, prepare). It only replaces the blocks' ``forward`` on the block
instances, which survive the DDP wrapper ``prepare`` adds in a multi-process run. Applying it
after ``prepare`` to the returned model also works (the blocks are found through the wrapper)
and is checked in the single-process test too.

Dropout stays on (0.1): the checkpoint restores the RNG state for its recompute, so the masks,
and hence the parameters, match bit for bit.
"""

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ckpt_offload as co  # noqa: E402
from ckpt_offload.demo.model import TinyTransformer, lm_loss  # noqa: E402
from conftest import assert_same_params  # noqa: E402
from gloo_ranks import gloo_available, launch_ranks, wait_ranks  # noqa: E402
from helpers import GPU_REASON, HAS_GPU  # noqa: E402

MODEL = dict(vocab=64, dim=32, layers=3, heads=4, seq=16, dropout=0.1)
WORKER = Path(__file__).with_name("accelerate_worker.py")
WORKER_TIMEOUT_S = 120


def _reset_accelerate():
    # Accelerator's state is a per-process singleton; a fresh one per run keeps the runs (and
    # the other test modules) independent, as accelerate's own AccelerateTestCase does.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate():
    _reset_accelerate()
    yield
    _reset_accelerate()


def train_accumulate(offload_opts=None, order="apply_then_prepare"):
    """7 batches with gradient_accumulation_steps=2: optimizer steps after batches 2, 4, 6 and
    at the end of the dataloader (7). Returns the final parameters and the co.apply handle."""
    _reset_accelerate()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    assert accelerator.device.type == "cpu"
    model = TinyTransformer(**MODEL, seed=0)
    tokens = torch.randint(0, MODEL["vocab"], (28, MODEL["seq"] + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens), batch_size=4, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = None
    if offload_opts is not None and order == "apply_then_prepare":
        handle = co.apply(model, offload=offload_opts)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if offload_opts is not None and order == "prepare_then_apply":
        handle = co.apply(model, offload=offload_opts)
    torch.manual_seed(1234)  # dropout
    optimizer_steps = 0
    for (batch,) in loader:
        with accelerator.accumulate(model):
            loss = lm_loss(model, batch)
            accelerator.backward(loss)
            optimizer_steps += accelerator.sync_gradients
            optimizer.step()
            optimizer.zero_grad()
    assert optimizer_steps == 4
    co.synchronize()
    params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    return params, handle


@pytest.mark.parametrize("order", ["apply_then_prepare", "prepare_then_apply"])
def test_gradient_accumulation_matches_without_ckpt_offload(fresh_accelerate, order):
    base, _ = train_accumulate(None)
    initial = TinyTransformer(**MODEL, seed=0).state_dict()
    assert any(not torch.equal(initial[n], p) for n, p in base.items()), "the loop did not train"

    pool = co.HostPool(pinned=False)
    got, handle = train_accumulate({"devices": ["cpu"], "min_bytes": 0, "pool": pool}, order)
    assert handle.names == ["blocks.0", "blocks.1", "blocks.2"]
    stats = pool.stats()
    # Fails if co.apply silently did nothing: the checkpoint inputs must have gone to the pool.
    assert stats["num_allocs"] > 0, stats
    assert stats["bytes_in_use"] == 0, stats  # every offloaded input was released after backward
    assert_same_params(base, got, f"accumulate, co.apply {order}")


def test_local_sgd_two_cpu_processes_matches_without_ckpt_offload(tmp_path):
    # The ranks see no GPU (launch_ranks' default): a CPU test checks the same thing on every
    # machine.
    _local_sgd_two_cpu_processes(tmp_path, gpu_visible=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
def test_local_sgd_two_cpu_processes_with_a_gpu_visible(tmp_path):
    """The same CPU training (``Accelerator(cpu=True)``, gloo, a pageable pool) on a machine whose
    GPU the ranks can see: ckpt_offload's defaults (the default pool is pinned there, its zero
    stats come from it) must not move or break anything of a run that asked for the CPU."""
    _local_sgd_two_cpu_processes(tmp_path, gpu_visible=True)


def _local_sgd_two_cpu_processes(tmp_path, gpu_visible):
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    wait_ranks(launch_ranks(WORKER, tmp_path, gpu_visible=gpu_visible), tmp_path, WORKER_TIMEOUT_S)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    initial = TinyTransformer(**MODEL, seed=0).state_dict()
    for rank, res in enumerate(results):
        assert res["distributed_type"] == "MULTI_CPU" and res["backend"] == "gloo", res["distributed_type"]
        assert (res["num_processes"], res["process_index"]) == (2, rank)
        assert res["plain_steps"] == res["offload_steps"] == 5
        assert res["checkpointed_blocks"] == ["blocks.0", "blocks.1", "blocks.2"]
        assert res["pool_stats"]["num_allocs"] > 0, res["pool_stats"]
        assert res["pool_stats"]["bytes_in_use"] == 0, res["pool_stats"]
        assert any(not torch.equal(initial[n], p) for n, p in res["plain"].items()), "rank did not train"
        assert_same_params(res["plain"], res["offload"], f"LocalSGD rank {rank}")

    # LocalSGD averages the parameters on exit, so the ranks end identical (a mean of two values
    # is the same on both ranks) -- although each trained on its own shard in between.
    for variant in ("plain", "offload"):
        assert_same_params(results[0][variant], results[1][variant], f"LocalSGD {variant}: rank 0 vs rank 1")

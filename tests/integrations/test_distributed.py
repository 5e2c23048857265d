"""ckpt_offload under distributed engines: 2 CPU processes, gloo over 127.0.0.1.

tests/integrations/distributed_worker.py is one rank; one launch runs every scenario below in one process
group (tests/gloo_ranks.py launches it, bounded by a timeout so a hang fails). Each scenario
trains a tiny transformer (dropout on) for 3 steps with the engine alone and again with
ckpt_offload, and the final parameters must be **bit-identical**: DDP's and FSDP2's gloo
reductions and the checkpoint's RNG restore are deterministic, so nothing justifies a
tolerance. Each rank trains on its own data, so ranks that end with equal parameters also show
the engine reduced gradients through ckpt_offload's hooks and recomputes.

- DDP with ``co.offload`` around the forward, ``co.checkpoint(offload=...)`` per block, and
  ``co.apply(every_n_layers=2, offload=...)``; ``no_sync`` accumulation over 2 micro-batches;
  ``find_unused_parameters=True`` with a parameter forward never uses.
- FSDP2 ``fully_shard`` per block and on the root (``reshard_after_forward`` True and False),
  with ``co.offload`` around the forward and ``co.apply(offload=...)`` before and after
  sharding. The parameters FSDP2 unshards for forward (and frees after it when resharding) are
  parameters' storages: they must be kept, not offloaded -- counted against the same
  ``co.offload`` around the unsharded model.
- Tensor parallel (``parallelize_module``, column- then row-wise, the blocks' outputs kept as
  DTensors), alone and under FSDP2 on a 2-D (dp x tp) mesh (1 x 2 here; 2 x 2 in a second,
  4-process launch), with ``co.offload`` and
  ``co.apply(offload=...)``: the DTensors autograd saves are offloaded through their local
  tensors and rebuilt on unpack; views of one DTensor are copied once, an in-place write after
  saving raises, DTensor parameters are kept.
- Accelerate with ``FullyShardedDataParallelPlugin(fsdp_version=2)`` and ``co.apply`` on the bare
  model before ``prepare``; where accelerate does not use FSDP for CPU processes (1.16 does not),
  through accelerate's own FSDP2 preparation (``fsdp2_prepare_model``) with that plugin.
- The Hugging Face Trainer (DDP over gloo through accelerate) with
  ``co.hf.OffloadCheckpointCallback``.
- Sequence parallel, each rank holding half of every sequence: Ulysses (all-to-all to heads and
  back, written here) and torch's ``context_parallel`` where it runs on CPU (math attention,
  non-causal; torch's own choice, flash attention for CPU, has no context-parallel rule and is
  reported with torch's error), with ``co.apply(offload=...)`` and ``co.offload``.
"""

from pathlib import Path

import pytest
import torch

from ckpt_offload.demo.model import TinyTransformer
from conftest import assert_same_params, nonzero
from gloo_ranks import gloo_available, launch_ranks, wait_ranks

WORKER = Path(__file__).with_name("distributed_worker.py")
WORKER_TIMEOUT_S = 240  # measured 45-60 s for the whole launch on a busy 2-core machine
MODEL = dict(vocab=64, dim=32, layers=4, heads=4, seq=16, dropout=0.1)  # as in the worker

DDP = [
    "ddp_offload",
    "ddp_checkpoint",
    "ddp_apply2",
    "ddp_apply2_no_sync",
    "ddp_offload_no_sync",
    "ddp_apply2_find_unused",
    "ddp_offload_find_unused",
]
FSDP2 = [
    "fsdp2_offload_reshard",
    "fsdp2_offload_no_reshard",
    "fsdp2_apply_before_reshard",
    "fsdp2_apply_after_reshard",
    "fsdp2_apply_before_no_reshard",
]
FSDP2_TP = ["fsdp2_tp_offload", "fsdp2_tp_apply"]
TP = ["tp_offload", "tp_apply", *FSDP2_TP]
HF = ["accelerate_fsdp2", "hf_trainer"]
try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError:
    HF = []
try:
    import trl  # noqa: F401
except ImportError:
    TRL = []
else:
    TRL = ["trl_sft"] if HF else []


# Sequence parallel: Ulysses (all-to-all), torch's context parallel (math attention; torch's choice, causal).
SP = ["sp_ulysses_apply", "sp_ulysses_offload", "sp_cp_math_apply", "sp_cp_math_offload", "sp_cp_causal_apply"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    out = tmp_path_factory.mktemp("distributed")
    wait_ranks(launch_ranks(WORKER, out, DDP + FSDP2 + TP + ["dtensor_details"] + HF + TRL + SP), out, WORKER_TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def scenario(results, name):
    per_rank = [res[name] for res in results]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"{name} failed on rank {r}:\n{res['error']}"
        if "unsupported" in res:
            pytest.skip(f"{name} cannot run here: {res['unsupported']}")
    return per_rank


def check_trained_alike(name, per_rank, extra_params=()):
    initial = TinyTransformer(**MODEL, seed=0).state_dict()
    for r, res in enumerate(per_rank):
        # Fails when ckpt_offload changes a single bit of any gradient in any step.
        assert_same_params(res["plain"], res["got"], f"{name} rank {r}: with ckpt_offload vs without")
        assert any(not torch.equal(initial[n], p) for n, p in res["plain"].items() if n in initial), (
            f"{name}: rank {r} did not train"
        )
        # Every offloaded tensor came back and was released: none is left in the pool.
        assert res["pool"]["num_allocs"] > 0, f"{name}: nothing went to the pool ({res['pool']})"
        assert res["pool"]["bytes_in_use"] == 0, res["pool"]
    # Different data per rank, equal parameters: the gradients were reduced across ranks.
    assert_same_params(per_rank[0]["got"], per_rank[1]["got"], f"{name}: rank 0 vs rank 1")


@pytest.mark.parametrize("name", DDP)
def test_ddp_matches_without_ckpt_offload(results, name):
    per_rank = scenario(results, name)
    check_trained_alike(name, per_rank)
    for res in per_rank:
        if "offload" in name:
            assert res["ctx"]["tensors_offloaded"] > 0, res["ctx"]
        if "apply2" in name:
            assert res["names"] == ["blocks.0", "blocks.2"]
        if "find_unused" in name:
            assert "spare.weight" in res["got"]


@pytest.mark.parametrize("name", FSDP2)
def test_fsdp2_matches_without_ckpt_offload(results, name):
    per_rank = scenario(results, name)
    check_trained_alike(name, per_rank)
    for res in per_rank:
        if "apply" in name:
            assert res["names"] == [f"blocks.{i}" for i in range(MODEL["layers"])]


@pytest.mark.parametrize("name", [n for n in FSDP2 if "offload" in n])
def test_fsdp2_unsharded_parameters_are_kept_activations_offloaded(results, name):
    """FSDP2 all-gathers each block's parameters into unsharded storages for forward, and with
    reshard_after_forward=True frees them right after; the views of them that autograd saves
    (``weight.t()``) must be kept as parameters -- offloading them would copy weights the
    engine re-gathers anyway. The counts must equal those of the same ``co.offload`` around the
    same model unsharded in one process: as many parameter views kept, the same activations
    (tensors and bytes) offloaded."""
    for res in scenario(results, name):
        got, ref = res["ctx"], res["reference_ctx"]
        assert got["kept_by_reason"]["parameter"] > 0, got
        assert got["kept_by_reason"]["parameter"] == ref["kept_by_reason"]["parameter"], (got, ref)
        assert got["kept_bytes_by_reason"]["parameter"] == ref["kept_bytes_by_reason"]["parameter"], (got, ref)
        assert (got["tensors_offloaded"], got["bytes_offloaded"]) == (
            ref["tensors_offloaded"],
            ref["bytes_offloaded"],
        ), (got, ref)
        assert got["bytes_offloaded"] > 0


@pytest.mark.parametrize("name", TP)
def test_tensor_parallel_dtensor_activations_are_offloaded(results, name):
    """Under tensor parallelism (alone, and under FSDP2 on a 2-D mesh) everything autograd saves is
    a DTensor: each goes to the pool through its local tensor and comes back as the same DTensor,
    so the parameters end bit-identical to the same engine without ckpt_offload, and no DTensor
    is kept as a subclass."""
    per_rank = scenario(results, name)
    for r, res in enumerate(per_rank):
        assert_same_params(res["plain"], res["got"], f"{name} rank {r}: with ckpt_offload vs without")
        stats = res["ctx"] if "ctx" in res else res["apply_stats"]
        assert stats["kept_by_reason"]["subclass"] == 0, stats
        assert stats["tensors_offloaded"] > 0, stats
        assert res["pool"]["num_allocs"] > 0 and res["pool"]["bytes_in_use"] == 0, res["pool"]
        if "offload" in name:
            # The DTensor weights (and their transposes) autograd saves are kept as parameters; every
            # other saved tensor is an activation and was offloaded.
            assert set(nonzero(stats["kept_by_reason"])) == {"parameter"}, stats
        else:
            assert res["names"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert_same_params(per_rank[0]["got"], per_rank[1]["got"], f"{name}: rank 0 vs rank 1")


@pytest.fixture(scope="module")
def results_2x2(tmp_path_factory):
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    out = tmp_path_factory.mktemp("distributed_2x2")
    wait_ranks(launch_ranks(WORKER, out, FSDP2_TP, world_size=4), out, WORKER_TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.parametrize("name", FSDP2_TP)
def test_fsdp2_tensor_parallel_2x2_mesh_offloads_dtensors(results_2x2, name):
    """4 processes: FSDP2 over 2 data-parallel groups, each a tensor-parallel pair."""
    per_rank = [res[name] for res in results_2x2]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"{name} failed on rank {r}:\n{res['error']}"
        assert_same_params(res["plain"], res["got"], f"{name} 2x2 rank {r}: with ckpt_offload vs without")
        stats = res["ctx"] if "ctx" in res else res["apply_stats"]
        assert stats["kept_by_reason"]["subclass"] == 0 and stats["tensors_offloaded"] > 0, stats
        assert res["pool"]["bytes_in_use"] == 0, res["pool"]
    for r in range(1, 4):
        assert_same_params(per_rank[0]["got"], per_rank[r]["got"], f"{name} 2x2: rank 0 vs rank {r}")


def test_dtensor_views_deduplicated_inplace_detected_parameters_kept(results):
    for res in scenario(results, "dtensor_details"):
        # h and a view of h are saved: one copy of h's local storage, the view deduplicated.
        assert (res["ctx"]["tensors_offloaded"], res["ctx"]["tensors_deduplicated"]) == (1, 1), res["ctx"]
        assert res["grad_bit_identical"] and res["grad_type"] == "DTensor", res
        assert "modified by an inplace operation" in res["inplace"], res["inplace"]
        assert "Detected by ckpt_offload" in res["inplace"], res["inplace"]
        # x @ w.t() with a DTensor parameter w: w.t() is kept as a parameter, x and the relu offloaded.
        assert nonzero(res["param_ctx"]["kept_by_reason"]) == {"parameter": 1}, res["param_ctx"]
        assert res["param_ctx"]["tensors_offloaded"] == 2, res["param_ctx"]
        # Other __torch_dispatch__ subclasses are kept as they are.
        assert res["subclass_ctx"]["kept_by_reason"]["subclass"] > 0, res["subclass_ctx"]
        assert res["subclass_ctx"]["tensors_offloaded"] == 0, res["subclass_ctx"]
        assert res["pool"]["bytes_in_use"] == 0, res["pool"]


@pytest.mark.skipif(not HF, reason="transformers and accelerate are not installed")
def test_accelerate_fsdp2_plugin_matches_without_ckpt_offload(results):
    """On CPU processes accelerate runs as MULTI_CPU and does not shard; the worker then runs
    accelerate's own FSDP2 preparation (fsdp2_prepare_model) with the plugin, which must have
    sharded every Block and the root."""
    per_rank = scenario(results, "accelerate_fsdp2")
    check_trained_alike("accelerate_fsdp2", per_rank)
    for res in per_rank:
        assert res["names"] == [f"blocks.{i}" for i in range(MODEL["layers"])]
        assert set(res["sharded"]) >= {""} | {f"blocks.{i}" for i in range(MODEL["layers"])}, res["sharded"]


@pytest.mark.skipif(not HF, reason="transformers is not installed")
def test_hf_trainer_two_processes_matches_without_ckpt_offload(results):
    per_rank = scenario(results, "hf_trainer")
    for r, res in enumerate(per_rank):
        assert res["world_size"] == 2 and res["parallel_mode"] == "ParallelMode.DISTRIBUTED", res
        assert res["wrapped"] == "DistributedDataParallel", res["wrapped"]
        assert res["names"] == ["transformer.h.0", "transformer.h.2"]
        assert res["calls"] == 6  # our function checkpointed 2 layers x 3 steps
        assert res["losses"] == res["plain_losses"]
        assert_same_params(res["plain"], res["got"], f"Trainer rank {r}")
        assert res["pool"]["num_allocs"] > 0 and res["pool"]["bytes_in_use"] == 0, res["pool"]
    assert_same_params(per_rank[0]["got"], per_rank[1]["got"], "Trainer: rank 0 vs rank 1")


@pytest.mark.skipif(not TRL, reason="trl (with transformers and accelerate) is not installed")
def test_trl_sft_trainer_two_processes_matches_without_ckpt_offload(results):
    per_rank = scenario(results, "trl_sft")
    for r, res in enumerate(per_rank):
        assert res["world_size"] == 2, res["world_size"]
        assert res["names"] == ["transformer.h.0", "transformer.h.2"]
        assert res["calls"] == 6  # 2 checkpointed layers x 3 steps
        assert res["losses"] == res["plain_losses"]
        assert_same_params(res["plain"], res["got"], f"SFTTrainer rank {r}")
        assert res["pool"]["num_allocs"] > 0 and res["pool"]["bytes_in_use"] == 0, res["pool"]
    assert_same_params(per_rank[0]["got"], per_rank[1]["got"], "SFTTrainer: rank 0 vs rank 1")


@pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo is not available")
def test_the_ranks_port_is_held_from_the_moment_it_is_picked(tmp_path):
    # A port picked free and closed, then bound again by rank 0 when it starts, can be taken in
    # between by any other process (other test workers launch ranks too): the LocalSGD launch once
    # ended "rank 0 exited with 1". The launcher serves the rendezvous store on the port it picks.
    import socket
    import time

    worker = tmp_path / "port_worker.py"
    worker.write_text(
        "import os, sys\n"
        "open(os.path.join(sys.argv[1], 'port.tmp'), 'w').write(os.environ['MASTER_PORT'])\n"
        "os.replace(os.path.join(sys.argv[1], 'port.tmp'), os.path.join(sys.argv[1], 'port'))\n"
    )
    procs = launch_ranks(worker, tmp_path, world_size=1)
    deadline = time.monotonic() + 60
    while not (tmp_path / "port").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    port = int((tmp_path / "port").read_text())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", port))  # taken already: nobody else can have it before the ranks connect
    wait_ranks(procs, tmp_path, 60)


@pytest.mark.parametrize("name", SP)
def test_sequence_parallel_matches_without_ckpt_offload(results, name):
    """Sequence parallel over 2 processes, each holding half of every sequence: Ulysses (an
    all-to-all gives each rank the whole sequence for half the heads, a second one gives the
    sequence back) and torch's ``context_parallel`` (attention on DTensors sharded along the
    sequence), with ``co.apply(offload=...)`` (the recompute repeats the block's collectives in
    backward) and with ``co.offload`` around the forward. The parameters after 2 steps are
    bit-identical to the same sequence-parallel run without ckpt_offload, the pool is empty after
    every backward, and the sequence-parallel gradient is the one-process gradient of the whole
    sequence (so the exchanges are right, and so is what ckpt_offload is compared with)."""
    per_rank = scenario(results, name)
    for r, res in enumerate(per_rank):
        assert_same_params(res["plain"], res["got"], f"{name} rank {r}: with ckpt_offload vs without")
        assert res["trained"], name
        assert res["max_diff_to_unsharded"] < 1e-5, res["max_diff_to_unsharded"]
        stats = res["ctx"] if "ctx" in res else res["apply_stats"]
        assert stats["tensors_offloaded"] > 0, stats
        # Context parallel's DTensors too are offloaded through their local tensors, none kept.
        assert set(nonzero(stats["kept_by_reason"])) <= {"parameter"}, stats
        assert res["pool"]["num_allocs"] > 0, res["pool"]
        assert res["bytes_after_backward"] == [0, 0] and res["pool"]["bytes_in_use"] == 0, res
        if "apply" in name:
            assert res["names"] == ["blocks.0", "blocks.1"]
    assert_same_params(per_rank[0]["got"], per_rank[1]["got"], f"{name}: rank 0 vs rank 1")

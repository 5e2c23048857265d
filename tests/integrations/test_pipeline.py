"""Pipeline schedules: several micro-batches' saved activations alive at once, backward in the
schedule's order.

A pipeline stage under ``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved schedules)
runs the forwards of several micro-batches before their backwards: GPipe runs forward 1, forward
2, backward 1, backward 2; 1F1B interleaves (forward 1, forward 2, backward 1, forward 3, ...).
Here one process plays one stage's sequence by hand on the same tiny transformer (dropout on):
the pool must hold every live micro-batch, reloads (and prefetches, which follow pack order)
must hand each backward its own micro-batch's tensors, and the accumulated gradients must be
bit-identical to the same schedule without ckpt_offload, with the pool back to where it started.
"""

import pytest
import torch

import ckpt_offload as co
from conftest import assert_bit_identical, grads_of
from models_for_tests import Transformer

VOCAB, SEQ = 97, 16

# (forward k | backward k) steps of one stage
SCHEDULES = {
    "gpipe": ["F0", "F1", "B0", "B1"],
    "reverse": ["F0", "F1", "B1", "B0"],
    "1f1b": ["F0", "F1", "B0", "F2", "B1", "B2"],
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on a busy 2-core machine
    yield
    torch.set_num_threads(threads)


def micro_batches(n):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (2, SEQ + 1), generator=g) for _ in range(n)]


def run(schedule, mode=None, options=None):
    """Runs one stage's schedule; returns the accumulated gradients, the pool's bytes in use
    after each step, and the co.offload context (mode "offload") or co.apply handle."""
    torch.manual_seed(0)
    model = Transformer(vocab=VOCAB, dim=64, layers=3, seq=SEQ).train()
    ctx = handle = None
    if mode == "offload":
        ctx = co.offload(**options)
    elif mode == "checkpoint":
        handle = co.apply(model, offload=options)
    batches = micro_batches(max(int(s[1:]) for s in schedule) + 1)
    losses, in_use = {}, []
    torch.manual_seed(1234)  # dropout
    for step in schedule:
        k = int(step[1:])
        if step[0] == "F":
            tokens = batches[k]
            with ctx if ctx is not None else torch.enable_grad():
                logits = model(tokens[:, :-1])
            losses[k] = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        else:
            losses.pop(k).backward()
        if options is not None:
            co.synchronize()
            in_use.append(options["pool"].stats()["bytes_in_use"])
    return grads_of(model), in_use, ctx or handle


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("mode", ["offload", "checkpoint"])
def test_interleaved_micro_batches_bit_identical(pool, stream, schedule, mode):
    steps = SCHEDULES[schedule]
    base, _, _ = run(steps)
    options = {"devices": ["cpu"], "min_bytes": 0, "pool": pool, "stream": stream}
    grads, in_use, what = run(steps, mode, options)
    assert_bit_identical(base, grads)
    # Two micro-batches were alive at once after F0, F1: the pool held both (twice the bytes of one).
    assert in_use[1] == 2 * in_use[0] > 0, in_use
    assert in_use[-1] == 0, in_use  # every micro-batch's tensors went back to the pool
    if mode == "offload":
        stats = what.stats()
        assert stats["tensors_offloaded"] > 0
        assert stats["tensors_reloaded"] + stats["tensors_reload_shared"] >= stats["tensors_offloaded"]
        if stream == "side":
            # Prefetch walks pack order. Where that is the schedule's backward order every tensor
            # fetched ahead is used. In "reverse" (F0, F1, B1, B0) backward 1 walks on into micro-batch
            # 0's tensors; those prefetches are released when backward 1 ends (device memory is not
            # held between backwards) and B0 reloads them: counted as unused, never lost.
            assert stats["prefetches"] > 0, stats
            assert stats["prefetch_hits"] + stats["prefetches_unused"] == stats["prefetches"], stats
            if schedule != "reverse":
                assert stats["prefetches_unused"] == 0, stats
    else:
        assert what.names == ["blocks.0", "blocks.1", "blocks.2"]

"""The main loop of one rank, shared by tests/integrations/distributed_worker.py and
deepspeed_worker.py (not a test module itself; each worker imports it from this folder, which
Python puts first on the path of a script it runs).

A worker launched by tests/gloo_ranks.py runs every scenario it is given in one process group
and writes ``OUT_DIR/rank{RANK}.pt``: ``{scenario: result dict}``, or ``{"error": traceback}``
for a scenario that raised -- so the test reports the failing composition by name.
"""

from __future__ import annotations

import os
import traceback
from typing import Callable

import torch
import torch.distributed as dist

import ckpt_offload as co


def copy_delay_us() -> int:
    """The CPU copy delay tests/conftest.py uses, from the same environment variables."""
    return int(os.environ.get("CKPT_OFFLOAD_CPU_COPY_DELAY_US", os.environ.get("CKPT_OFFLOAD_TEST_DELAY_US", "200")))


def run_rank(out_dir: str, names: list, run: Callable[[str], dict], start: Callable[[], dict]) -> None:
    """Runs ``run(name)`` for each scenario name, each followed by a barrier, and saves the results.

    ``start()`` starts the process group (after the copy delay and one CPU thread are set) and
    returns the entries the results begin with."""
    # The same asynchronous CPU copy threads with an injected delay as tests/conftest.py uses,
    # so a missing wait corrupts data here too.
    co._C.testing.set_cpu_copy_delay_us(copy_delay_us())
    torch.set_num_threads(1)
    results = start()
    for name in names:
        try:
            results[name] = run(name)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()

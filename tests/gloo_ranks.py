"""Launching N plain Python processes as the ranks of a gloo process group on 127.0.0.1.

Shared by the multi-process tests (tests/integrations/test_accelerate.py, tests/integrations/test_distributed.py). Each
rank is ``python WORKER OUT_DIR [ARGS...]`` with the environment that both
``torch.distributed.init_process_group`` (``env://``) and accelerate's ``PartialState`` read:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a
``MASTER_PORT`` on which the launcher itself already serves the ranks' rendezvous store, as torchrun's
agent does (``TORCHELASTIC_USE_AGENT_STORE=True``: every rank connects as a client). The port is
bound from the moment the OS picks it: a port picked free, closed, and bound again by rank 0 could
be taken in between by another process (other test workers launch ranks too), and rank 0 then
exited with "address already in use". Nothing listens beyond loopback. :func:`wait_ranks` bounds the whole run
by a timeout, so a hang (a collective one rank never joins) fails the test instead of stalling CI,
and puts every rank's log tail in the failure message (its last line on the message's first line,
which is all a one-line test summary keeps).

The ranks see no GPU unless ``gpu_visible=True``: these are CPU tests (gloo, CPU tensors, CPU
pools), and on a GPU machine a visible device would change what they run -- torch, accelerate
and ckpt_offload pick defaults by whether a GPU is usable -- so the CPU test would no longer
check what it checks on a machine without one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckpt_offload as co


def gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def rendezvous_store(world_size: int):
    """A TCPStore server on a loopback port the OS picks (port 0) and that it holds from then on:
    the ranks' rendezvous, served by the launcher (torchrun's agent store). ``store.port`` is the
    ``MASTER_PORT`` to give them."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))


class Launch(list):
    """The ranks' ``(process, log)`` pairs; holds the rendezvous store until it is dropped."""

    store = None


def launch_ranks(worker: Path, out_dir: Path, args=(), world_size: int = 2, gpu_visible: bool = False):
    """Starts one plain Python process per rank running ``worker OUT_DIR *args``; loopback only.
    ``gpu_visible=False`` hides every GPU from the ranks (``CUDA_VISIBLE_DEVICES=""``). Keep the
    result until the ranks are done (:func:`wait_ranks`): it holds their rendezvous store."""
    repo_root = str(Path(co.__file__).resolve().parent.parent)  # the ckpt_offload this test imported
    procs = Launch()
    procs.store = rendezvous_store(world_size)
    port = procs.store.port
    for rank in range(world_size):
        env = dict(os.environ)
        env.pop("ACCELERATE_USE_CPU", None)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            # Every rank a client of the store served above at MASTER_ADDR:MASTER_PORT (rank 0 does
            # not bind the port again), as under torchrun; the attempt is what torchrun numbers.
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT="0",
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            GLOO_SOCKET_IFNAME="lo",  # gloo's pairs bind to loopback, not the host's address
            OMP_NUM_THREADS="1",  # 2 ranks on a 2-core machine; also silences accelerate's hint
            PYTHONPATH=os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p),
        )
        if not gpu_visible:
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = open(out_dir / f"rank{rank}.log", "wb")
        cmd = [sys.executable, str(worker), str(out_dir), *map(str, args)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=repo_root), log))
    return procs


def last_line(log: Path) -> str:
    """The last non-empty line of a rank's log (its exception, when it raised), or a note."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError as e:
        return f"(no log: {e})"
    return lines[-1][:300] if lines else "(empty log)"


def wait_ranks(procs, out_dir: Path, timeout_s: float) -> None:
    """Waits for every rank; fails the test (with each rank's log tail) when one exits non-zero or
    the ranks together run past ``timeout_s``. Ranks still running are killed either way."""
    deadline = time.monotonic() + timeout_s
    failed = None
    try:
        for rank, (proc, _) in enumerate(procs):
            try:
                rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"rank {rank} did not finish within {timeout_s} s (hang?)"
                break
            if rc != 0 and failed is None:
                failed = f"rank {rank} exited with {rc}: {last_line(out_dir / f'rank{rank}.log')}"
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        if isinstance(procs, Launch):
            procs.store = None  # the port goes back to the OS
    if failed:
        logs = "\n".join(
            f"--- rank {r} ---\n" + (out_dir / f"rank{r}.log").read_text(errors="replace")[-4000:]
            for r in range(len(procs))
        )
        pytest.fail(f"{failed}\n{logs}")

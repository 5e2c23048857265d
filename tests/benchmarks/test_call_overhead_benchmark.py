"""benchmarks/call_overhead.py on CPU: the arms it times and the files it writes (never times)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from helpers import REPO_ROOT

ARMS = [
    "torch_checkpoint",
    "torch_checkpoint (again)",
    "co_checkpoint",
    "co_checkpoint_offload",
    "co_checkpoint_offload_dict",
    "co_apply_offload",
]


def test_quick_run_writes_json_and_markdown(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "benchmarks", "call_overhead.py"),
            "--quick",
            "--device",
            "cpu",
            "--rounds",
            "3",
            "--warmup",
            "1",
            "--reps",
            "1",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.load(open(tmp_path / "call_overhead.json"))
    assert r["mode"] == "cpu" and r["args"]["clock"] == "process" and r["args"]["rounds"] == 3
    assert [x["arm"] for x in r["rows"]] == ARMS
    base = r["rows"][0]
    assert base["over_torch_checkpoint_us"] == 0 and base["ratio"] == 1.0  # itself, in every round
    assert all(math.isfinite(x["overhead_us"]) and x["ratio"] is not None for x in r["rows"])
    made = r["construction_us"]
    assert set(made) == {"co_offload", "saved_tensors_hooks", "save_on_cpu"}
    assert all(math.isfinite(v) and v > 0 for v in made.values())
    md = (tmp_path / "call_overhead.md").read_text()
    assert "Making a context: co.offload(...)" in md
    assert all(f"| {a} |" in md for a in ARMS) and "CPU numbers, not GPU numbers" in md
    assert os.path.basename(r["package"]) == "ckpt_offload"  # which one was measured (a checkout or installed)


def test_every_arm_computes_the_plain_blocks_gradients():
    # The arms time the same block: a route that dropped or changed work would time something else.
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    try:
        import call_overhead
    finally:
        sys.path.remove(os.path.join(REPO_ROOT, "benchmarks"))
    import torch

    import ckpt_offload as co

    pool = co.HostPool()
    fns = call_overhead.arms("cpu", 8, pool)
    x = torch.randn(4, 8, requires_grad=True)
    fns["plain"](x).sum().backward()
    want = x.grad.clone()
    for name, fn in fns.items():
        x.grad = None
        fn(x).sum().backward()
        assert torch.equal(x.grad, want), name
    assert pool.stats()["num_allocs"] > 0  # the offload arms copied into the pool

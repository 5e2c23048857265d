"""Issue 11's small things: co.offload as a decorator, co.keep(), --version, info's default
line, records.csv stream names."""
import csv
import json

import pytest
import torch
from torch import nn

import ckpt_offload as co
from ckpt_offload.__main__ import main
from ckpt_offload.profiling.export_table import stream_names


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def test_offload_as_decorator_offloads_and_matches_grads():
    model, x = _model(), torch.randn(32, 64)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ctx = co.offload(devices=["cpu"], min_bytes=0, pool=co.HostPool(pinned=False))

    @ctx
    def forward(inp):
        return model(inp).sum()

    forward(x).backward()
    assert ctx.stats()["tensors_offloaded"] > 0 and not ctx.active
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
    assert forward.__name__ == "forward"


def test_keep_region_keeps_inside_offload_and_grads_match():
    model, head, x = _model(), nn.Linear(64, 512), torch.randn(32, 64)
    (head(model(x)).logsumexp(-1).sum()).backward()
    ref = [p.grad.clone() for p in [*model.parameters(), *head.parameters()]]
    model.zero_grad()
    head.zero_grad()
    ctx = co.offload(devices=["cpu"], min_bytes=0, pool=co.HostPool(pinned=False))
    with ctx:
        h = model(x)
        before = ctx.stats()["tensors_offloaded"] + ctx.stats()["tensors_kept"]
        with co.keep():
            loss = head(h).logsumexp(-1).sum()
        after = ctx.stats()["tensors_offloaded"] + ctx.stats()["tensors_kept"]
    assert before > 0 and after == before  # nothing inside co.keep() reached the offload hooks
    loss.backward()
    got = [p.grad for p in [*model.parameters(), *head.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_keep_as_decorator():
    ctx = co.offload(devices=["cpu"], min_bytes=0, pool=co.HostPool(pinned=False))

    @co.keep()
    def loss_fn(t):
        return (t * t).sum()

    x = torch.randn(100, requires_grad=True)
    with ctx:
        loss = loss_fn(x.sin())
    loss.backward()
    assert ctx.stats()["tensors_offloaded"] == 1  # sin's input; t * t saved nothing offloaded
    assert torch.equal(x.grad, 2 * x.detach().sin() * x.detach().cos())


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ckpt_offload {co.__version__}"


def test_info_says_whether_default_offload_does_anything(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    if co.build_info()["gpu_available"]:
        assert "co.offload() with defaults here: offloads CUDA tensors" in out
    else:
        assert "co.offload() with defaults here: offloads NOTHING" in out and "devices=['cpu']" in out


def test_stream_names():
    copies = [
        {"id": 0, "device": 0, "stream": 11, "kind": "d2h"},
        {"id": 1, "device": 0, "stream": 12, "kind": "h2d"},
        {"id": 2, "device": 0, "stream": 13, "kind": "h2d"},
        {"id": 3, "device": 1, "stream": 20, "kind": "d2h"},
        {"id": 4, "device": 1, "stream": 20, "kind": "h2d"},
    ]
    assert stream_names(copies) == {(0, 11): "d2h", (0, 12): "h2d", (0, 13): "h2d.2", (1, 20): "compute"}


def test_records_csv_names_streams(tmp_path):
    pool = co.HostPool(pinned=False)
    with co.profile(pools=[pool]) as prof:
        with co.offload(devices=["cpu"], min_bytes=0, pool=pool):
            y = torch.randn(1000, requires_grad=True).sin()
        y.sum().backward()
    with open(prof.export_csv(tmp_path / "records.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["stream"] for r in rows} <= {"compute", "d2h", "h2d", "h2d.2", "d2h.2"}
    json.dumps(rows)

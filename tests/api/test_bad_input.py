"""Bad input to every public function and option: each case must raise a Python exception of the
given type whose message names the argument and what it accepts -- never a crash, a pybind11
"incompatible function arguments" dump, or an unrelated error from deep inside.

Cases marked risky (raw memory: resized storages, odd layouts, the native entry point itself) run
in a subprocess, so a segfault fails that case instead of killing the test run.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
from dataclasses import dataclass

import pytest
import torch

import ckpt_offload as co
from conftest import assert_bit_identical, grads_of

# Made once per process; every case's code runs in a copy of this namespace.
PRELUDE = """
import torch, torch.nn as nn, ckpt_offload as co

pool = co.HostPool(pinned=False, segment_bytes=1 << 16)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


model = Net()
x = torch.randn(2, 4, requires_grad=True)


def resized(keep_bytes, numel=64):
    t = torch.randn(numel)
    t.untyped_storage().resize_(keep_bytes)
    return t


class FakeHF(nn.Module):  # passes co.hf.enable's "is this a Hugging Face model" check
    def gradient_checkpointing_enable(self, **kwargs):
        pass
"""

BIG = 2**63  # one past the native int64 range
HUGE = 2**64


@dataclass
class Case:
    id: str
    code: str
    exc: type
    needles: tuple  # substrings the message must contain: the argument and what it accepts
    risky: bool = False
    hf: bool = False


def C(id, code, exc, *needles, risky=False, hf=False):
    return Case(id, code, exc, needles, risky, hf)


CASES = [
    # co.offload
    # Sizes may be strings ("64KiB"); one that is not a size is refused naming the argument.
    C("offload-min_bytes-str", "co.offload(min_bytes='lots')", ValueError, "min_bytes", "cannot read", "'2GiB'"),
    C("offload-min_bytes-float", "co.offload(min_bytes=1.5)", TypeError, "min_bytes", "an int"),
    C("offload-min_bytes-bool", "co.offload(min_bytes=True)", TypeError, "min_bytes", "an int"),
    C("offload-min_bytes-negative", "co.offload(min_bytes=-1)", ValueError, "min_bytes", ">= 0"),
    C("offload-min_bytes-2**63", f"co.offload(min_bytes={BIG})", ValueError, "min_bytes", "<= 2**63 - 1"),
    C("offload-stream-gpu", "co.offload(stream='gpu')", ValueError, "stream", "'side'", "'compute'"),
    C("offload-stream-none", "co.offload(stream=None)", TypeError, "stream", "'side'"),
    C("offload-on_full-drop", "co.offload(on_full='drop')", ValueError, "on_full", "'keep'", "'raise'"),
    C("offload-devices-tpu", "co.offload(devices='tpu')", ValueError, "devices", "'cpu'"),
    C("offload-devices-meta", "co.offload(devices=['meta'])", ValueError, "devices", "'cpu'"),
    C("offload-devices-int", "co.offload(devices=5)", TypeError, "devices", "device type"),
    C("offload-devices-entry-int", "co.offload(devices=['cpu', 1])", TypeError, "devices", "torch.device"),
    C("offload-devices-index", "co.offload(devices=['cpu:0'])", ValueError, "devices", "device types"),
    C("offload-pool-str", "co.offload(pool='pool')", TypeError, "pool", "HostPool"),
    C("offload-pool-native", "co.offload(pool=pool._impl)", TypeError, "pool", "HostPool"),
    C("offload-prefetch-negative", "co.offload(prefetch_bytes=-1)", ValueError, "prefetch_bytes", ">= 0"),
    C("offload-prefetch-2**64", f"co.offload(prefetch_bytes={HUGE})", ValueError, "prefetch_bytes", "2**63 - 1"),
    C("offload-batch_below-negative", "co.offload(batch_below=-5)", ValueError, "batch_below", ">= 0"),
    C("offload-batch_below-2**63", f"co.offload(batch_below={BIG}, batch_bytes={BIG})", ValueError, "2**63 - 1"),
    C("offload-batch_bytes-zero", "co.offload(batch_bytes=0)", ValueError, "batch_bytes", ">= 1"),
    C("offload-batch_bytes-2**63", f"co.offload(batch_bytes={BIG})", ValueError, "batch_bytes", "2**63 - 1"),
    C(
        "offload-batch_below-over-bytes",
        "co.offload(batch_below=4096, batch_bytes=1024)",
        ValueError,
        "batch_below",
        "batch_bytes",
    ),
    C("offload-unknown-kwarg", "co.offload(min_byte=0)", TypeError, "min_byte"),
    # co.checkpoint
    C("checkpoint-function-int", "co.checkpoint(5, x)", TypeError, "function", "callable"),
    C("checkpoint-offload-str", "co.checkpoint(model, x, offload='yes')", TypeError, "offload", "dict"),
    C(
        "checkpoint-offload-unknown-key",
        "co.checkpoint(model, x, offload={'min_byte': 0})",
        TypeError,
        "min_byte",
        "min_bytes",
        "allowed",
    ),
    C("checkpoint-offload-non-str-key", "co.checkpoint(model, x, offload={1: 0})", TypeError, "offload", "allowed"),
    C(
        "checkpoint-offload-min_bytes-negative",
        "co.checkpoint(model, x, offload={'min_bytes': -1})",
        ValueError,
        "offload",
        "min_bytes",
        ">= 0",
    ),
    C(
        "checkpoint-offload-devices-tpu",
        "co.checkpoint(model, x, offload={'devices': 'tpu'})",
        ValueError,
        "offload",
        "devices",
        "'cpu'",
    ),
    C(
        "checkpoint-use_reentrant-str",
        "co.checkpoint(model, x, use_reentrant='no')",
        TypeError,
        "use_reentrant",
        "True or False",
    ),
    C(
        "checkpoint-reentrant-with-offload",
        "co.checkpoint(model, x, offload=True, use_reentrant=True)",
        ValueError,
        "use_reentrant=False",
    ),
    # co.checkpoint_sequential
    C("sequential-functions-int", "co.checkpoint_sequential(5, 1, x)", TypeError, "functions", "nn.Sequential"),
    C("sequential-functions-empty", "co.checkpoint_sequential([], 1, x)", ValueError, "functions", "empty"),
    C(
        "sequential-functions-entry",
        "co.checkpoint_sequential([model.layers[0], 3], 1, x)",
        TypeError,
        "functions[1]",
        "callable",
    ),
    C("sequential-segments-zero", "co.checkpoint_sequential(model.layers, 0, x)", ValueError, "segments", ">= 1"),
    C(
        "sequential-segments-str",
        "co.checkpoint_sequential(model.layers, '2', x)",
        ValueError,
        "segments",
        "an int",
        "'sqrt'",
    ),
    C(
        "sequential-segments-too-many",
        "co.checkpoint_sequential(model.layers, 3, x)",
        ValueError,
        "segments",
        "number of functions",
    ),
    C(
        "sequential-offload-stream",
        "co.checkpoint_sequential(model.layers, 2, x, offload={'stream': 'gpu'})",
        ValueError,
        "offload",
        "stream",
        "'side'",
    ),
    # co.apply
    C("apply-model-str", "co.apply('model')", TypeError, "model", "nn.Module"),
    C("apply-layers-int-class", "co.apply(model, layers=int)", TypeError, "layers", "nn.Module subclass", "predicate"),
    C("apply-layers-int", "co.apply(model, layers=5)", TypeError, "layers", "nn.Module subclass", "predicate"),
    C("apply-layers-none-found", "co.apply(model, layers=nn.Conv2d)", ValueError, "Conv2d", "layers="),
    C("apply-every-zero", "co.apply(model, every_n_layers=0)", ValueError, "every_n_layers", ">= 1"),
    C("apply-every-float", "co.apply(model, every_n_layers=1.0)", TypeError, "every_n_layers", "an int"),
    C(
        "apply-offload-min_bytes-negative",
        "co.apply(model, offload={'min_bytes': -1})",
        ValueError,
        "offload",
        "min_bytes",
        ">= 0",
    ),
    C(
        "apply-offload-min_bytes-2**63",
        f"co.apply(model, offload={{'min_bytes': {BIG}}})",
        ValueError,
        "min_bytes",
        "2**63 - 1",
    ),
    C(
        "apply-offload-stream-gpu",
        "co.apply(model, offload={'stream': 'gpu'})",
        ValueError,
        "offload",
        "stream",
        "'side'",
    ),
    C("apply-offload-on_full", "co.apply(model, offload={'on_full': 'spill'})", ValueError, "on_full", "'keep'"),
    C("apply-offload-devices-tpu", "co.apply(model, offload={'devices': ['tpu']})", ValueError, "devices", "'cpu'"),
    C("apply-offload-pool-str", "co.apply(model, offload={'pool': 'p'})", TypeError, "pool", "HostPool"),
    C(
        "apply-offload-batch",
        "co.apply(model, offload={'batch_below': 10, 'batch_bytes': 5})",
        ValueError,
        "batch_below",
        "batch_bytes",
    ),
    C("apply-offload-list", "co.apply(model, offload=['cpu'])", TypeError, "offload", "dict"),
    C("apply-unknown-kwarg", "co.apply(model, preserve_rng=True)", TypeError, "preserve_rng", "allowed"),
    C(
        "apply-reentrant-with-offload",
        "co.apply(model, offload=True, use_reentrant=True)",
        ValueError,
        "use_reentrant=False",
    ),
    # co.HostPool and its methods
    C("pool-max_bytes-zero", "co.HostPool(max_bytes=0)", ValueError, "max_bytes", ">= 4096"),
    C("pool-max_bytes-str", "co.HostPool(max_bytes='1 parsec')", ValueError, "max_bytes", "cannot read"),
    C("pool-max_bytes-list", "co.HostPool(max_bytes=[1])", TypeError, "max_bytes", "an int or None", "'512MiB'"),
    C("pool-max_bytes-2**64", f"co.HostPool(max_bytes={HUGE})", ValueError, "max_bytes", "2**63 - 1"),
    C("pool-segment-zero", "co.HostPool(pinned=False, segment_bytes=0)", ValueError, "segment_bytes", ">= 1"),
    C(
        "pool-segment-2**64",
        f"co.HostPool(pinned=False, segment_bytes={HUGE})",
        ValueError,
        "segment_bytes",
        "2**63 - 1",
    ),
    C("pool-pinned-str", "co.HostPool(pinned='yes')", TypeError, "pinned", "True, False or None"),
    C("pool-backend-cuda", "co.HostPool(backend='cuda')", ValueError, "backend", "'pinned'", "'pageable'"),
    C("pool-backend-contradiction", "co.HostPool(pinned=True, backend='pageable')", ValueError, "pinned", "backend"),
    C("pool-numa_node-word", "co.HostPool(pinned=False, numa_node='near')", ValueError, "numa_node", "'auto'"),
    C("pool-numa_node-float", "co.HostPool(pinned=False, numa_node=0.0)", TypeError, "numa_node", "an int"),
    C("pool-numa_node-negative", "co.HostPool(pinned=False, numa_node=-1)", ValueError, "numa_node", ">= 0"),
    C("pool-numa_node-absent", "co.HostPool(pinned=False, numa_node=1000)", ValueError, "numa_node=1000", "None"),
    C("pool-reserve-zero", "pool.reserve(0)", ValueError, "nbytes", ">= 1"),
    C("pool-reserve-negative", "pool.reserve(-1)", ValueError, "nbytes", ">= 1"),
    C("pool-reserve-str", "pool.reserve('one')", ValueError, "nbytes", "cannot read"),
    C("pool-reserve-float", "pool.reserve(1.5)", TypeError, "nbytes", "an int"),
    C("pool-reserve-2**64", f"pool.reserve({HUGE})", ValueError, "nbytes", "2**63 - 1"),
    C("pool-cap-negative", "pool.max_bytes = -1", ValueError, "max_bytes", ">= 4096"),
    C("pool-cap-2**64", f"pool.max_bytes = {HUGE}", ValueError, "max_bytes", "2**63 - 1"),
    C("pool-set_max_bytes-float", "pool.set_max_bytes(1.5)", TypeError, "max_bytes", "an int or None"),
    # a cap below one page could never hold a block (and spill_max_bytes rounded to "no cap")
    C(
        "pool-max_bytes-below-page",
        "co.HostPool(pinned=False, max_bytes=128)",
        ValueError,
        "max_bytes=128",
        "4096",
        "None",
    ),
    C("pool-cap-below-page", "pool.max_bytes = 4095", ValueError, "max_bytes=4095", "4096"),
    C("pool-set_max_bytes-below-page", "pool.set_max_bytes(1)", ValueError, "max_bytes=1", "4096"),
    C(
        "pool-spill_max_bytes-below-page",
        "co.HostPool(pinned=False, max_bytes=1 << 20, spill_dir=__import__('tempfile').gettempdir(), "
        "spill_max_bytes=100)",
        ValueError,
        "spill_max_bytes=100",
        "4096",
        "None",
    ),
    # co.offload_tensor
    C("offload_tensor-not-tensor", "co.offload_tensor([1, 2], pool)", TypeError, "tensor", "torch.Tensor"),
    C("offload_tensor-pool-str", "co.offload_tensor(x, 'pool')", TypeError, "pool", "HostPool"),
    C("offload_tensor-stream", "co.offload_tensor(x, pool, stream='gpu')", ValueError, "stream", "'side'"),
    C(
        "offload_tensor-resized-to-0",
        "co.offload_tensor(resized(0), pool)",
        ValueError,
        "tensor",
        "storage",
        "resized",
        risky=True,
    ),
    C(
        "offload_tensor-resized-short",
        "co.offload_tensor(resized(100), pool)",
        ValueError,
        "tensor",
        "storage",
        "holds 100 bytes",
        risky=True,
    ),
    C(
        "offload_tensor-resized-under-view",
        "t = torch.randn(64)\nv = t[30:40]\nt.untyped_storage().resize_(128)\n"
        "co.offload_tensor(v, pool, stream='compute')",
        ValueError,
        "tensor",
        "holds 128 bytes",
        risky=True,
    ),
    C(
        "offload_tensor-native-resized",
        "co._C.offload_tensor(resized(0), pool._impl, True)",
        ValueError,
        "storage",
        "resized",
        risky=True,
    ),
    C(
        "offload_tensor-meta",
        "co.offload_tensor(torch.randn(4, device='meta'), pool)",
        ValueError,
        "tensor",
        "plain strided",
        "meta",
        risky=True,
    ),
    C(
        "offload_tensor-nested",
        "co.offload_tensor(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), pool)",
        ValueError,
        "tensor",
        "plain strided",
        "nested",
        risky=True,
    ),
    C(
        "offload_tensor-quantized",
        "co.offload_tensor(torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8), pool)",
        ValueError,
        "tensor",
        "plain strided",
        "quantized",
        risky=True,
    ),
    C(
        "offload_tensor-sparse",
        "co.offload_tensor(torch.eye(3).to_sparse(), pool)",
        ValueError,
        "tensor",
        "plain strided",
        "sparse",
        risky=True,
    ),
    C(
        "offload_tensor-mkldnn",
        "co.offload_tensor(torch.randn(4).to_mkldnn(), pool)",
        ValueError,
        "tensor",
        "plain strided",
        "MKL-DNN",
        risky=True,
    ),
    C(
        "offload_tensor-conj",
        "co.offload_tensor(torch.randn(4, dtype=torch.cfloat).conj(), pool)",
        ValueError,
        "tensor",
        "conjugate",
        "resolve_conj",
        risky=True,
    ),
    C(
        "offload_tensor-neg",
        "co.offload_tensor(torch.randn(4, dtype=torch.cfloat).conj().imag, pool)",
        ValueError,
        "tensor",
        "negative",
        "resolve_neg",
        risky=True,
    ),
    # co.profile and Profile
    C("profile-pools-int", "co.profile(pools=5)", TypeError, "pools", "HostPool", "list"),
    C("profile-pools-str", "co.profile(pools='pool')", TypeError, "pools", "HostPool"),
    C("profile-pools-entry", "co.profile(pools=[pool, 5])", TypeError, "pools", "HostPool"),
    C("profile-model-int", "co.profile(model=5)", TypeError, "model", "nn.Module or None"),
    C("profile-record_shapes-str", "co.profile(record_shapes='yes')", TypeError, "record_shapes", "True or False"),
    C(
        "profile-summary-by",
        "p = co.profile()\nwith p as prof: pass\nprof.summary(by='layer')",
        ValueError,
        "by",
        "'module'",
        "'total'",
    ),
    C(
        "profile-summary-top",
        "p = co.profile()\nwith p as prof: pass\nprof.summary(top=0)",
        ValueError,
        "top",
        "positive int",
    ),
    # co.hf.enable and the Trainer callback
    C("hf-enable-not-hf", "co.hf.enable(model)", TypeError, "Hugging Face", "co.apply", hf=True),
    C(
        "hf-enable-every-zero",
        "co.hf.enable(FakeHF(), every_n_layers=0)",
        ValueError,
        "every_n_layers",
        ">= 1",
        hf=True,
    ),
    C(
        "hf-enable-offload-stream",
        "co.hf.enable(FakeHF(), offload={'stream': 'gpu'})",
        ValueError,
        "offload",
        "stream",
        "'side'",
        hf=True,
    ),
    C(
        "hf-enable-offload-min_bytes",
        f"co.hf.enable(FakeHF(), offload={{'min_bytes': {BIG}}})",
        ValueError,
        "min_bytes",
        "2**63 - 1",
        hf=True,
    ),
    C("hf-enable-unknown-kwarg", "co.hf.enable(FakeHF(), preserve=True)", TypeError, "preserve", "allowed", hf=True),
    C(
        "hf-callback-every-zero",
        "co.hf.OffloadCheckpointCallback(every_n_layers=0)",
        ValueError,
        "every_n_layers",
        ">= 1",
        hf=True,
    ),
    C(
        "hf-callback-offload-str",
        "co.hf.OffloadCheckpointCallback(offload='cpu')",
        TypeError,
        "offload",
        "dict",
        hf=True,
    ),
    C(
        "hf-callback-offload-devices",
        "co.hf.OffloadCheckpointCallback(offload={'devices': 'tpu'})",
        ValueError,
        "devices",
        "'cpu'",
        hf=True,
    ),
    C(
        "hf-callback-unknown-kwarg",
        "co.hf.OffloadCheckpointCallback(use_reentrantt=False)",
        TypeError,
        "use_reentrantt",
        "did you mean 'use_reentrant'",
        "its options are: every_n_layers, offload",
        hf=True,
    ),
    C(
        "hf-offload-callback-typo",
        "co.hf.OffloadCallback(min_byte=0)",
        TypeError,
        "'min_byte' (did you mean 'min_bytes'?)",
        "its options are: min_bytes, stream, devices",
        hf=True,
    ),
    C(
        "hf-offload-callback-every_n_layers",
        "co.hf.OffloadCallback(every_n_layers=2)",
        TypeError,
        "every_n_layers",
        "co.hf.OffloadCheckpointCallback(every_n_layers=",
        hf=True,
    ),
    # First-hour mistakes: each says what was meant.
    C(
        "offload-device-as-min_bytes",
        "co.offload('cpu')",
        TypeError,
        "min_bytes",
        "names a device",
        "co.offload(devices=['cpu'])",
    ),
    C("offload-devices-list-as-min_bytes", "co.offload(['cpu'])", TypeError, "min_bytes", "devices=['cpu']"),
    C(
        "checkpoint-keyword-typo",
        "co.checkpoint(torch.sin, x, offlaod=True)",
        TypeError,
        "offlaod=",
        "did you mean offload=",
        "functools.partial",
    ),
    C(
        "checkpoint-offload-option-as-keyword",
        "co.checkpoint(model, x, min_bytes=0)",
        TypeError,
        "min_bytes",
        "offload={'min_bytes'",
    ),
    C(
        "apply-no-blocks",
        "co.apply(nn.Linear(2, 2))",
        ValueError,
        "co.apply found no list of identical blocks",
        "layers=",
    ),
    C(
        "offload_tensor-past-the-cap",
        "co.offload_tensor(torch.randn(1 << 16), pool=co.HostPool(max_bytes=1 << 12, pinned=False))",
        co.PoolFullError,
        "cap 4.0 KiB",
        "co.offload_tensor stores every tensor",
        "max_bytes",
    ),
    C(
        "plan-bandwidth-word",
        "co.plan(model, lambda: model(x).sum().backward(), budget='1MiB', bandwidth='fast')",
        ValueError,
        "bandwidth",
        "bytes per second",
        "'25GB/s'",
    ),
    C(
        "hf-callback-reentrant-offload",
        "co.hf.OffloadCheckpointCallback(offload=True, use_reentrant=True)",
        ValueError,
        "use_reentrant=False",
        hf=True,
    ),
]

_BY_ID = {c.id: c for c in CASES}
assert len(_BY_ID) == len(CASES), "duplicate case id"


def _check_message(case: Case, exc_type_names: list, message: str):
    assert case.exc.__name__ in exc_type_names, f"{case.id}: raised {exc_type_names[0]}: {message}"
    assert "incompatible function arguments" not in message, f"{case.id}: a pybind11 dump reached the user"
    for needle in case.needles:
        assert needle in message, f"{case.id}: message does not say {needle!r}: {message}"


@pytest.fixture(scope="module")
def namespace():
    ns: dict = {}
    exec(PRELUDE, ns)
    return ns


@pytest.mark.parametrize("case", [c for c in CASES if not c.risky], ids=lambda c: c.id)
def test_bad_input(case, namespace):
    if case.hf:
        pytest.importorskip("transformers")
    with pytest.raises(Exception) as info:
        exec(case.code, dict(namespace))
    _check_message(case, [t.__name__ for t in type(info.value).__mro__], str(info.value))


# Runs the risky cases given as JSON in argv[1], one after another, printing a line per case
# started and a JSON line per case finished; a crash leaves a case started and not finished.
_WORKER = (
    PRELUDE
    + """
import json, sys
for case_id, code in json.loads(sys.argv[1]):
    print("START", case_id, flush=True)
    result = {"id": case_id, "raised": None, "message": ""}
    try:
        exec(code, dict(globals()))
    except Exception as e:
        result = {"id": case_id, "raised": [t.__name__ for t in type(e).__mro__], "message": str(e)}
    co.synchronize()  # an accepted bad copy would read freed memory now, on the copy thread
    print("RESULT", json.dumps(result), flush=True)
"""
)


@pytest.fixture(scope="module")
def risky_results():
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            p for p in (os.path.dirname(os.path.dirname(co.__file__)), os.environ.get("PYTHONPATH")) if p
        ),
    )
    pending = [(c.id, c.code) for c in CASES if c.risky]
    results: dict = {}
    while pending:
        # cwd outside the source tree: `python -c` puts the cwd first on sys.path, and a checkout's
        # ckpt_offload/ (no built _C in it) would shadow the package these tests imported.
        p = subprocess.run(
            [sys.executable, "-c", _WORKER, json.dumps(pending)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        started = None
        for line in p.stdout.splitlines():
            if line.startswith("START "):
                started = line.split(" ", 1)[1]
            elif line.startswith("RESULT "):
                r = json.loads(line.split(" ", 1)[1])
                results[r["id"]] = r
                started = None
        if started is None and p.returncode != 0:
            started = next(i for i, _ in pending if i not in results)  # died before its first case
        if started is not None:  # crashed inside this case: record it, go on with the rest
            results[started] = {"id": started, "crashed": p.returncode, "output": (p.stdout + p.stderr)[-3000:]}
        pending = [(i, code) for i, code in pending if i not in results]
    return results


@pytest.mark.parametrize("case", [c for c in CASES if c.risky], ids=lambda c: c.id)
def test_bad_input_in_subprocess(case, risky_results):
    r = risky_results[case.id]
    assert "crashed" not in r, f"{case.id} crashed the process (exit {r.get('crashed')}):\n{r.get('output')}"
    assert r["raised"] is not None, f"{case.id}: no exception raised"
    _check_message(case, r["raised"], r["message"])


def test_the_table_is_large():
    assert len(CASES) >= 60


# --- what the checks must still accept ------------------------------------------------------------


def test_limits_themselves_are_accepted():
    top = 2**63 - 1
    co.offload(min_bytes=top, devices=["cpu"], prefetch_bytes=top, batch_below=top, batch_bytes=top)
    pool = co.HostPool(pinned=False, max_bytes=top, segment_bytes=1 << 16)
    with pytest.raises(co.PoolFullError):  # no host has 2**63 bytes: refused by the backend, with a message
        pool.reserve(top)
    pool.max_bytes = top
    assert pool.max_bytes == top


def test_offload_tensor_within_a_larger_storage_still_works(pool):
    base = torch.arange(64, dtype=torch.float32)
    view = base[10:20]
    assert torch.equal(co.offload_tensor(view, pool).reload(), view)
    base.untyped_storage().resize_(20 * 4)  # shrunk, but still holds the view's span exactly
    assert torch.equal(co.offload_tensor(view, pool).reload(), torch.arange(10, 20, dtype=torch.float32))
    empty = torch.empty(0)
    empty.untyped_storage().resize_(0)
    assert co.offload_tensor(empty, pool).reload().shape == (0,)


def _apply_grads(offload, layers=None):
    from models_for_tests import MLP

    torch.manual_seed(0)
    model = MLP(dim=8, hidden=16)
    x = torch.randn(4, 8)
    handle = co.apply(model, layers=layers or torch.nn.Linear, offload=offload) if offload is not None else None
    model(x).sum().backward()
    if handle is not None:
        handle.remove()
    return grads_of(model)


def test_offload_dict_takes_a_set_of_devices(pool):
    # co.offload(devices={"cpu"}) accepts a set; the same option in an offload dict used to fail
    # with "unhashable type: 'set'" at the first forward.
    got = _apply_grads({"devices": {"cpu"}, "min_bytes": 0, "pool": pool})
    assert pool.stats()["num_allocs"] > 0, "nothing was offloaded"
    assert_bit_identical(_apply_grads(None), got)
    x = torch.randn(3, 5, requires_grad=True)
    co.checkpoint(torch.sin, x, offload={"devices": {"cpu"}, "min_bytes": 0, "pool": pool}).sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach()))


def test_offload_tensor_past_the_cap_names_no_option_it_does_not_take():
    with pytest.raises(co.PoolFullError) as info:
        co.offload_tensor(torch.randn(1 << 16), pool=co.HostPool(max_bytes=1 << 12, pinned=False))
    assert "on_full" not in str(info.value) and "min_bytes" not in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, device="meta"),
        lambda: torch._efficientzerotensor(8),
        lambda: torch.randn(4, dtype=torch.cfloat).conj(),
        lambda: torch.eye(3).to_sparse(),
    ],
    ids=["meta", "zerotensor", "conj", "sparse"],
)
def test_offload_tensor_checks_its_tensor_once_with_one_message(pool, make):
    # The checks live in the native entry alone: co.offload_tensor and _C.offload_tensor say the
    # same thing, in co.offload_tensor's words (they used to differ in wording and coverage).
    x = make()
    with pytest.raises(ValueError) as api:
        co.offload_tensor(x, pool)
    with pytest.raises(ValueError) as native:
        co._C.offload_tensor(x.detach(), pool._impl, True)
    assert str(api.value) == str(native.value) and str(api.value).startswith("tensor: "), str(native.value)


def test_pool_full_errors_carry_their_facts_and_remedies_apart():
    # Nothing parses the message back: the native error gives its parts as attributes.
    with pytest.raises(co.PoolFullError) as standalone:
        co.offload_tensor(torch.randn(1 << 16), pool=co.HostPool(max_bytes=1 << 12, pinned=False))
    e = standalone.value
    assert str(e) == f"{e.facts}. {e.remedies}"
    assert "Asked for 256.0 KiB (262144 bytes) for the tensor [Float on cpu, shape [65536]]" in e.facts
    assert e.remedies.startswith("co.offload_tensor stores every tensor it is given")
    x = torch.randn(1 << 16, requires_grad=True)
    full = co.HostPool(max_bytes=1 << 12, pinned=False)
    with (
        pytest.raises(co.PoolFullError) as packed,
        co.offload(devices=["cpu"], min_bytes=0, on_full="raise", pool=full),
    ):
        torch.tanh(x)
    e = packed.value
    assert str(e) == f"{e.facts}. {e.remedies}" and "for a saved tensor [Float on cpu" in e.facts
    assert 'on_full="keep"' in e.remedies


def test_compile_fullgraph_over_ckpt_offload_says_what_works():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)

    def around_offload(t):
        with co.offload(devices=["cpu"], min_bytes=0):
            return model(t).sum()

    handle = None
    try:
        # A co.offload context inside the compiled function cannot be traced: fullgraph says so.
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(around_offload, fullgraph=True, backend="eager")(x)
        message = str(info.value)
        assert "torch.compile(fullgraph=True)" in message, message
        assert "without fullgraph" in message and "block.forward = torch.compile(" in message, message
        assert "pybind11" not in message.split("Developer debug")[0], message
        # co.apply's offloaded checkpoints trace into one graph (tests/integrations/test_compile_fullgraph.py).
        torch._dynamo.reset()
        handle = co.apply(model, offload={"devices": ["cpu"], "min_bytes": 0})
        torch.compile(model, fullgraph=True, backend="eager")(x).sum().backward()
        # Without fullgraph the same model runs, as documented.
        torch._dynamo.reset()
        out = torch.compile(model, backend="eager")(x)
        out.sum().backward()
    finally:
        if handle is not None:
            handle.remove()
        torch._dynamo.reset()


# -- the command line: errors print the subcommand's usage and come before any measuring ----------


def _cli(argv, capsys):
    from ckpt_offload.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_plan_negative_budget_is_named_not_expected_one_argument(capsys):
    code, _, err = _cli(["plan", "--size", "tiny", "--device", "cpu", "--budget", "-5MiB"], capsys)
    assert code == 2
    assert "argument --budget: must be an amount of bytes >= 0" in err and "'-5MiB'" in err, err
    assert "expected one argument" not in err and "usage: python -m ckpt_offload plan" in err


def test_plan_bad_bandwidth_fails_before_planning_with_the_bandwidth_format(capsys):
    code, out, err = _cli(
        ["plan", "--size", "tiny", "--device", "cpu", "--budget", "1MiB", "--bandwidth", "fast"], capsys
    )
    assert code == 2 and "'25GB/s'" in err and "'2GiB'" not in err, err
    assert "planning" not in err + out  # nothing was measured


def test_plan_unwritable_out_is_a_clear_error_before_measuring(tmp_path, capsys, monkeypatch):
    import tempfile as tempfile_module

    blocker = tmp_path / "file"
    blocker.write_text("")
    code, out, err = _cli(
        ["plan", "--size", "tiny", "--device", "cpu", "--budget", "1MiB", "--out", str(blocker / "sub")], capsys
    )
    assert code == 2 and "--out: cannot write to" in err and "usage: python -m ckpt_offload plan" in err, err
    assert "planning" not in err + out

    # A read-only folder (permission bits do not stop root, so the write itself is made to fail).
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile_module, "mkstemp", read_only)
    code, _, err = _cli(
        ["plan", "--size", "tiny", "--device", "cpu", "--budget", "1MiB", "--out", str(tmp_path / "ro")], capsys
    )
    assert code == 2 and "Permission denied" in err and "pass a folder you can write to" in err, err


def test_plan_write_failure_at_the_end_exits_3_not_over_budget(tmp_path, capsys, monkeypatch):
    from ckpt_offload.__main__ import main
    from ckpt_offload.cli import plan as plan_cli

    seen = {}
    real_plan = co.plan

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real_plan(*args, **kwargs)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(co, "plan", spy)
    monkeypatch.setattr(plan_cli.json, "dump", disk_full)
    status = main(
        [
            "plan",
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--budget",
            "3MiB",
            "--steps",
            "1",
            "--levels",
            "1",
            "--bandwidth",
            "inf",
            "--out",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert status == 3, (out, err)
    assert "cannot write the plan files" in err and "No space left on device" in err, err
    assert "measured with the plan" in out  # the results were printed before
    assert seen["levels"] == 1  # --levels reaches co.plan
    assert "3 when OUT/plan.json" in plan_cli.PLAN_DESCRIPTION


def test_subcommand_errors_after_parsing_print_the_subcommands_usage(tmp_path, capsys):
    code, _, err = _cli(
        ["plan", "--script", str(tmp_path / "none.py") + ":f", "--budget", "1MiB", "--out", str(tmp_path / "o")], capsys
    )
    assert code == 2 and "usage: python -m ckpt_offload plan" in err and "no such file" in err, err
    code, _, err = _cli(["profile", "--script", "nocolon", "--out", str(tmp_path / "p")], capsys)
    assert code == 2 and "usage: python -m ckpt_offload profile" in err, err

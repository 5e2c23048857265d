"""The package's shape: no import circle, no public name hiding a module, one option list (in
Python and at the C++ boundary), every route taking the one option set, and one block installer
whose handles put back exactly the forward a block had."""

import ast
import copy
import dataclasses
import warnings
import importlib
import importlib.util
import inspect
import io
import os
import pathlib
import pickle
import pkgutil
import re
import types

import pytest
import torch
import torch.nn as nn

import ckpt_offload as co
from helpers import REPO_ROOT
from conftest import assert_bit_identical, grads_of
from models_for_tests import Chain

from ckpt_offload._runtime import _C
from ckpt_offload._units import Unit
from ckpt_offload.blocks import BlockForward, install_units, select_blocks
from ckpt_offload.options import OFFLOAD_KEYS, OffloadOptions, as_options

PACKAGE = pathlib.Path(co.__file__).parent
CPU = {"devices": ["cpu"], "min_bytes": 0}


# --- imports ---------------------------------------------------------------------------------------


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _under_type_checking(tree) -> set:
    """The import nodes inside ``if TYPE_CHECKING:`` blocks (they never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for inner in node.body:
                skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def import_graph() -> dict:
    """module -> the package modules it imports when it (or a function of it) runs: the module
    named, or for ``from P import X`` the submodule X where there is one, plus the packages
    between (their ``__init__`` runs first), except the root package (every import runs it) and
    the importer's own packages (they are running already)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _under_type_checking(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in found:
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # the packages on the way, then the module
                    prefix = ".".join(parts[:i])
                    # The importer's own packages are running already: not an edge.
                    if prefix in modules and prefix != name and not (name + ".").startswith(prefix + "."):
                        targets.add(prefix)
        graph[name] = targets
    return graph


def circles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan): scripts/include_graph.py's,
    which reads the C++ layers the same way."""
    return _include_graph().circles(graph)


def test_the_import_graph_reader_sees_a_circle():
    # The check below can fail: a two-module loop and a loop through a package's __init__.
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    graph = import_graph()
    assert "ckpt_offload.options" in graph["ckpt_offload.offloading"]
    assert "ckpt_offload.planner" not in graph["ckpt_offload.planner.costs"]  # its own package is not an edge
    # A module importing from inside a subpackage runs that subpackage's __init__ first: an edge.
    assert "ckpt_offload.planner" in graph["ckpt_offload.cli.plan"]
    assert "ckpt_offload.blocks" in graph["ckpt_offload.planner.apply"]


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert len(graph) > 30
    assert circles(graph) == []


def test_lower_layers_import_nothing_above_them():
    graph = import_graph()
    low = {
        "ckpt_offload._args",
        "ckpt_offload._runtime",
        "ckpt_offload._warn",
        "ckpt_offload._units",
        "ckpt_offload._version",
        "ckpt_offload._torch_compat",
    }
    for name in low:
        assert graph[name] <= low | {"ckpt_offload._build_config", "ckpt_offload._C"}, name
    # The engine layers never reach the planner, the integrations or the command line.
    for name in (
        "ckpt_offload.options",
        "ckpt_offload.offloading",
        "ckpt_offload.checkpointing",
        "ckpt_offload.blocks",
    ):
        reach, todo = set(), [name]
        while todo:
            for w in graph[todo.pop()]:
                if w not in reach:
                    reach.add(w)
                    todo.append(w)
        assert not {
            r
            for r in reach
            if r.startswith(
                ("ckpt_offload.planner", "ckpt_offload.integrations", "ckpt_offload.cli", "ckpt_offload.demo")
            )
        }, name


def _include_graph():
    """scripts/include_graph.py: the C++ layers' include graph, by unit (a .cpp with its .h)."""
    # The checkout's scripts/ (CI tests the installed package, whose parent has none).
    spec = importlib.util.spec_from_file_location(
        "include_graph", os.path.join(REPO_ROOT, "scripts", "include_graph.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_include_graph_reader_sees_a_circle():
    ig = _include_graph()
    assert ig.circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    graph = ig.include_graph(("csrc/torch",))
    assert "csrc/torch/saved_tensor" in graph["csrc/torch/packer"]  # packer.h includes saved_tensor.h
    assert "csrc/torch/device_runtime" in graph["csrc/torch/cuda/runtime"]  # "../device_runtime.h"
    assert "csrc/torch/packer" not in graph["csrc/torch/packer"]  # packer.cpp's own header is no edge


def test_no_include_runs_back_up_in_the_torch_layer():
    # A unit (x.cpp with x.h) that includes another that includes it back, however far round,
    # runs an include back up: every unit of csrc/torch stands on a floor above all it includes
    # (python scripts/include_graph.py prints them).
    ig = _include_graph()
    graph = ig.include_graph(("csrc/torch",))
    assert len(graph) > 25
    assert ig.circles(graph) == []


def test_the_span_of_a_tensor_is_the_engines_own_rule():
    # Note [Span of a tensor]: one definition, _C.span_bytes, which the planner and the demo read.
    base = torch.zeros(4, 6, 8)
    assert _C.span_bytes(base) == 4 * 6 * 8 * 4
    assert _C.span_bytes(base.transpose(0, 2)) == 4 * 6 * 8 * 4  # the same elements
    assert _C.span_bytes(base[:, ::2, 1]) == ((4 - 1) * 48 + (3 - 1) * 16 + 1) * 4  # the gaps between count
    assert _C.span_bytes(torch.zeros(8).expand(5, 8)) == 8 * 4  # stride 0: only the source's elements
    assert _C.span_bytes(torch.zeros(0, 3)) == 0
    # What co.offload copies for a strided view is that span.
    x = torch.randn(64, 64, requires_grad=True)
    with co.offload(**CPU) as ctx:
        view = (x * 2)[::2, 1::3]
        z = torch.sin(view)  # saves its input, the strided view, and nothing else
    assert (ctx.stats()["tensors_offloaded"], ctx.stats()["bytes_offloaded"]) == (1, _C.span_bytes(view))
    assert _C.span_bytes(view) == ((32 - 1) * 128 + (21 - 1) * 3 + 1) * 4
    z.sum().backward()


# --- names -----------------------------------------------------------------------------------------


def _packages():
    pytest.importorskip("transformers")  # co.hf's package imports it
    found = [co]
    for info in pkgutil.walk_packages(co.__path__, "ckpt_offload."):
        if info.ispkg:
            found.append(importlib.import_module(info.name))
    return found


def test_no_public_name_shadows_a_submodule():
    checked = 0
    for package in _packages():
        for info in pkgutil.iter_modules(package.__path__):
            full = f"{package.__name__}.{info.name}"
            importlib.import_module(full)
            got = getattr(package, info.name)
            assert isinstance(got, types.ModuleType), f"{full} is hidden by {got!r}"
            assert got.__name__ == full
            checked += 1
    assert checked > 30
    import ckpt_offload.offloading as m  # the old spelling gave the class for ckpt_offload.offload

    assert isinstance(m, types.ModuleType) and m.offload is co.offload
    assert isinstance(co.offload, type) and callable(co.checkpoint)


@pytest.mark.parametrize(
    "old, new",
    [
        ("ckpt_offload.offload", "ckpt_offload.offloading"),
        ("ckpt_offload.checkpoint", "ckpt_offload.checkpointing"),
        ("ckpt_offload.planner.plan", "ckpt_offload.planner.planning"),
        ("ckpt_offload.demo.cli", "ckpt_offload.cli"),
    ],
)
def test_an_old_module_path_names_the_new_one(old, new):
    with pytest.raises(ModuleNotFoundError, match=re.escape(new)):
        importlib.import_module(old)
    assert isinstance(co.offload, type)  # the failed import bound nothing over the public name


def test_public_names_are_what_all_lists():
    for name in co.__all__:
        assert hasattr(co, name), name
    assert "OffloadOptions" in co.__all__ and "pinned_available" in co.__all__
    with pytest.warns(DeprecationWarning, match="ProfileReport"):
        assert co.Profile is co.ProfileReport


def test_names_of_0_1_0_kept_for_one_release_warn_at_the_readers_line():
    import ckpt_offload.planner.apply as planner_apply
    from ckpt_offload import profiling
    from ckpt_offload.planner import solver

    for module, name, expected, fix in [
        (co, "Profile", co.ProfileReport, "ProfileReport"),
        (profiling, "Profile", co.ProfileReport, "ProfileReport"),
        (co.planner, "chain_dp", solver.chain_dp, "planner.solver"),
        (planner_apply, "PlanHandle", co.CheckpointHandle, "co.CheckpointHandle"),
    ]:
        with pytest.warns(DeprecationWarning, match=re.escape(fix)) as record:
            assert getattr(module, name) is expected
        assert record[0].filename == __file__, (module.__name__, name, record[0].filename)
    for module in (co, profiling, co.planner, planner_apply):
        with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
            module.NoSuchName  # noqa: B018


# --- one option list -------------------------------------------------------------------------------


def test_the_option_list_is_written_once_in_python_and_once_at_the_cpp_boundary():
    fields = [f.name for f in dataclasses.fields(OffloadOptions)]
    assert tuple(fields) == OFFLOAD_KEYS
    # co.offload's signature is made from the fields: same names, same defaults, same order.
    params = inspect.signature(co.offload).parameters
    assert [p for p in params if p != "keep_dedup"] == fields
    for f in dataclasses.fields(OffloadOptions):
        assert params[f.name].default == f.default, f.name
    # The C++ boundary: one table of option names (no defaults there), exactly what Python passes.
    kwargs = OffloadOptions(**CPU).packer_kwargs()
    assert sorted(_C.PACKER_OPTIONS) == sorted(kwargs)
    pool = co.HostPool(pinned=False)._impl
    _C.Packer(pool, **kwargs)
    with pytest.raises(TypeError, match="Packer: missing option 'measure_error'"):
        _C.Packer(pool, **{k: v for k, v in kwargs.items() if k != "measure_error"})  # nothing is filled in for you
    with pytest.raises(TypeError, match="Packer: unknown option 'min_byte'"):
        _C.Packer(pool, **kwargs, min_byte=0)
    with pytest.raises(TypeError, match="Packer: option 'min_bytes' has the wrong type"):
        _C.Packer(pool, **dict(kwargs, min_bytes="0"))
    assert kwargs["offload_cpu"] and not kwargs["offload_cuda"] and kwargs["min_bytes"] == 0


def test_every_spelling_of_the_options_is_one_value():
    a = OffloadOptions(devices={"cpu"}, min_bytes="64KiB", batch_below="16KiB")
    b = as_options({"devices": ["cpu"], "min_bytes": 65536, "batch_below": 16384})
    c = co.offload(devices=("cpu",), min_bytes=64 * 1024, batch_below="16 KiB").options
    d = co.offload(65536, stream="side", devices=["cpu"], batch_below=16384).options
    with pytest.warns(DeprecationWarning, match="after min_bytes by position"):  # goes in 0.3.0
        e = co.offload(65536, "side", ["cpu"], batch_below=16384).options
    assert a == b == c == d == e and hash(a) == hash(b)
    assert a.min_bytes == 65536 and a.devices == ("cpu",)
    assert a.to_dict() == {"min_bytes": 65536, "devices": ("cpu",), "batch_below": 16384}
    assert as_options(a.to_dict()) == a and as_options(True) == OffloadOptions() and as_options(False) is None
    assert co.offload(a).options is a
    assert a.replace(stream="compute").stream == "compute" and a.stream == "side"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.min_bytes = 0
    assert "min_bytes=65536" in repr(a) and "stream" not in repr(a)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: OffloadOptions(stream="gpu"), ValueError, "stream must be one of"),
        (lambda: OffloadOptions(min_bytes=-1), ValueError, "min_bytes must be >= 0"),
        (
            lambda: OffloadOptions(batch_below=2 << 20, batch_bytes=1 << 20),
            ValueError,
            "batch_below .* must not exceed",
        ),
        (lambda: OffloadOptions(store_dtype=torch.int8), ValueError, "store_dtype must be None or one of"),
        (lambda: OffloadOptions(pool="pool"), TypeError, "pool must be a ckpt_offload.HostPool"),
        (lambda: OffloadOptions(min_bytes="cpu"), TypeError, "names a device"),
        (
            lambda: co.offload(mni_bytes=0),
            TypeError,
            r"unknown co.offload option\(s\) 'mni_bytes' \(did you mean 'min_bytes'\?\)",
        ),
        (
            lambda: co.offload(0, "side", None, None, "keep", None, 0, 1 << 20, None),
            TypeError,
            r"takes one positional option \(min_bytes\), got 9; pass the others by keyword",
        ),
        (lambda: co.offload(0, min_bytes=0), TypeError, "min_bytes both by position and by keyword"),
        (
            lambda: as_options({"strem": "side"}),
            TypeError,
            r"offload: unknown co.offload option\(s\) 'strem' \(did you mean 'stream'\?\)",
        ),
        (
            lambda: as_options({"stream": "gpu"}, name="co.apply(offload=...)"),
            ValueError,
            r"co.apply\(offload=...\): stream must be",
        ),
        (lambda: OffloadOptions().replace(bogus=1), TypeError, r"OffloadOptions.replace: unknown co.offload option"),
    ],
)
def test_bad_options_name_the_option(call, error, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the 9-positional call warns before it raises
        with pytest.raises(error, match=message):
            call()


def test_options_after_min_bytes_by_position_warn_with_the_call_spelled_by_keyword():
    # Keyword-only from 0.2 (OffloadOptions' fields after min_bytes): still taken by position, with a
    # DeprecationWarning at the user's line that spells the same call by keyword, until 0.3.0.
    with pytest.warns(DeprecationWarning) as caught:
        ctx = co.offload(0, "compute", ["cpu"])
        opts = OffloadOptions(0, "compute")
    assert ctx.options == OffloadOptions(min_bytes=0, stream="compute", devices=["cpu"])
    assert opts == OffloadOptions(min_bytes=0, stream="compute")
    said = [str(w.message) for w in caught]
    assert "co.offload(min_bytes=0, stream='compute', devices=['cpu'])" in said[0] and "0.3.0" in said[0]
    assert "co.OffloadOptions(min_bytes=0, stream='compute')" in said[1]
    assert all(w.filename == __file__ for w in caught)
    assert [p.name for p in inspect.signature(co.offload).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD] == [
        "min_bytes"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        co.offload(4096, devices=["cpu"])  # min_bytes alone by position: no warning


def _chain_grads(route):
    torch.manual_seed(0)
    model = Chain(n=4, width=64)
    x = torch.randn(8, 64, requires_grad=True)
    stats = route(model, x)
    return grads_of(model), stats


def test_every_route_takes_the_option_set():
    opts = OffloadOptions(**CPU)
    expected, _ = _chain_grads(lambda m, x: m(x).sum().backward())

    def via_offload(m, x):
        with co.offload(opts) as ctx:
            loss = m(x).sum()
        loss.backward()
        return ctx.stats()

    def via_checkpoint(m, x):
        h = x
        for layer in m.layers:
            h = co.checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), h, offload=opts)
        h.sum().backward()
        return None

    def via_apply(m, x):
        handle = co.apply(m, offload=opts)
        m(x).sum().backward()
        stats = handle.stats()
        handle.remove()
        return stats

    for route in (via_offload, via_checkpoint, via_apply):
        got, stats = _chain_grads(route)
        assert_bit_identical(expected, got)
        if stats is not None:
            assert stats["tensors_offloaded"] > 0, route.__name__


def test_the_trainer_callback_takes_the_option_set():
    hf = pytest.importorskip("ckpt_offload.integrations.hf")
    callback = hf.OffloadCallback(**OffloadOptions(**CPU).to_dict())
    assert callback.context.options == OffloadOptions(**CPU)
    assert hf.OffloadCallback(OffloadOptions(**CPU)).context.options == OffloadOptions(**CPU)
    assert hf.OffloadCallback(dict(CPU), stream="compute").context.options == OffloadOptions(**CPU, stream="compute")
    with pytest.raises(ValueError, match=r"OffloadCallback\(False\) offloads nothing"):
        hf.OffloadCallback(False)
    with pytest.raises(TypeError, match=r"OffloadCallback\(options\): unknown co.offload option"):
        hf.OffloadCallback({"min_byte": 0})
    with pytest.raises(TypeError, match="did you mean 'min_bytes'"):
        hf.OffloadCallback(min_byte=0)


# --- one block installer ---------------------------------------------------------------------------


class _Doubling(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x, scale=1.0):
        return torch.tanh(self.lin(x)) * scale


class _Stack(nn.Module):
    def __init__(self, n=6, width=32):
        super().__init__()
        self.layers = nn.ModuleList(_Doubling(width) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _instance_forward(block):
    """A forward set on the instance (as a library that patches modules would)."""

    def forward(x, scale=1.0):
        return type(block).forward(block, x, scale) + 0.0

    return forward


def _units():
    return [
        Unit(0, 0, "offload"),
        Unit(1, 1, "recompute"),
        Unit(2, 3, "recompute_offload"),
        Unit(4, 4, "recompute_offload"),
        Unit(5, 5, "keep"),
    ]


def test_a_plan_handle_puts_back_the_forward_each_block_had():
    model = _Stack()
    patched = _instance_forward(model.layers[2])
    model.layers[2].forward = patched  # an instance-level forward before the plan
    before = {i: m.__dict__.get("forward") for i, m in enumerate(model.layers)}
    handle = install_units(model, select_blocks(model, None), _units(), CPU)
    assert handle.kinds == [
        "offload",
        "recompute",
        "recompute_offload_segment",
        "recompute_offload_segment",
        "recompute_offload",
    ]
    assert all(isinstance(m.__dict__["forward"], BlockForward) for m in list(model.layers)[:5])
    x = torch.randn(4, 32, requires_grad=True)
    model(x).sum().backward()
    assert handle.stats()["tensors_offloaded"] > 0
    handle.remove()
    after = {i: m.__dict__.get("forward") for i, m in enumerate(model.layers)}
    assert after == before and after[2] is patched  # the patched forward is back, not deleted
    assert not any("_ckpt_offload_wrapped" in m.__dict__ for m in model.layers)
    assert "_ckpt_offload_handle" not in model.__dict__


def test_co_apply_and_plans_share_the_guard_and_the_handle():
    model = _Stack()
    handle = co.apply(model, offload=CPU)
    with pytest.raises(RuntimeError, match="already applied"):
        install_units(model, select_blocks(model, None), _units(), CPU)
    with pytest.raises(RuntimeError, match="already applied"):
        co.apply(model)
    assert type(handle) is co.CheckpointHandle and handle.kinds == ["recompute_offload"] * 6
    handle.remove()
    plan_handle = install_units(model, select_blocks(model, None), _units(), CPU)
    assert type(plan_handle) is co.CheckpointHandle
    plan_handle.remove()


def test_a_planned_model_survives_deepcopy_and_pickle():
    torch.manual_seed(0)
    model = _Stack()
    plain = copy.deepcopy(model)  # the same weights, never wrapped
    x = torch.randn(4, 32)
    install_units(model, select_blocks(model, None), _units(), CPU)
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    pickled = pickle.loads(pickle.dumps(model))
    plain(x).sum().backward()
    expected = grads_of(plain)
    for other in (model, twin, loaded, pickled):
        for m in list(other.layers)[:5]:
            wrapper = m.__dict__["forward"]
            assert isinstance(wrapper, BlockForward) and wrapper.block is m  # its own block, not the original's
        other(x).sum().backward()
        assert_bit_identical(expected, grads_of(other))
        assert other._ckpt_offload_handle.stats()["tensors_offloaded"] > 0  # counts of its own
        other._ckpt_offload_handle.remove()


def test_co_apply_segments_makes_exactly_the_segments_asked_for():
    from ckpt_offload.blocks.applying import _segment_units

    assert _segment_units(9, 6) == [(0, 1), (2, 3), (4, 5), (6, 6), (7, 7), (8, 8)]
    assert _segment_units(3, 2) == [(0, 1), (2, 2)]
    assert _segment_units(9, "sqrt") == [(0, 2), (3, 5), (6, 8)]
    for n in range(1, 13):
        for k in range(1, n + 1):
            runs = _segment_units(n, k)
            assert len(runs) == k and runs[0][0] == 0 and runs[-1][1] == n - 1
            assert all(b[0] == a[1] + 1 for a, b in zip(runs, runs[1:]))
            assert max(e - s for s, e in runs) - min(e - s for s, e in runs) <= 1
    torch.manual_seed(0)
    model = _Stack(n=9)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 32)
    plain(x).sum().backward()
    handle = co.apply(model, segments=6)
    model(x).sum().backward()
    assert handle.kinds == ["recompute_segment"] * 6 + ["recompute"] * 3
    assert_bit_identical(grads_of(plain), grads_of(model))
    handle.remove()


def test_the_offload_callback_wraps_the_model_with_the_one_installer():
    hf = pytest.importorskip("ckpt_offload.integrations.hf")
    model = _Stack()
    callback = hf.OffloadCallback(**CPU)
    callback.on_init_end(None, None, None, model=model)
    callback.on_init_end(None, None, None, model=model)  # twice: still one wrapper
    wrapper = model.__dict__["forward"]
    assert isinstance(wrapper, BlockForward) and wrapper.own_forward().__func__ is _Stack.forward
    assert list(inspect.signature(model.forward).parameters) == ["x"]  # Trainer reads it to keep columns
    model(torch.randn(4, 32, requires_grad=True)).sum().backward()
    assert callback.stats()["tensors_offloaded"] > 0
    callback.remove()
    assert "forward" not in model.__dict__ and "_ckpt_offload_wrapped" not in model.__dict__

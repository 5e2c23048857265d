// Note [Torch internals]
// Every read of torch's private Python that the torch layer makes, in one file: the one to
// revisit when torch changes. None is a documented API; each is read where torch has it, and
// each falls back to "not found" (the tensor is then offloaded or kept by the other rules, never
// wrongly) when a torch release moves it:
//  - nn.Module._call_impl's code object, and the `self` of its frames on this thread's stack
//    (Note [Reading the Python stack]); a module's `_parameters` and `_buffers` dicts;
//  - torch.distributed.tensor.DTensor's `_local_tensor`, `_spec` and `_is_param`, and its
//    constructor from a local tensor and a spec (Note [DTensor activations]);
//  - torch.utils.checkpoint's selective-checkpoint cache: the code object of the function that
//    hands cached tensors to the pack hook (`wrap` in _CachingTorchDispatchMode.__torch_dispatch__),
//    and the `allow_cache_entry_mutation` local of _VersionWrapper.get_val (Note [Selective
//    checkpoint cache mutation]).
// This file includes no torch header: the interpreter's internal frame layout is read (on the
// Pythons whose layout is known) with Py_BUILD_CORE set, which no torch header should see.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

namespace ckpt_offload {

// Note [Reading the Python stack]
// KeepRules::leaf_owner asks which modules' forwards are running: the `self` of every frame of
// nn.Module._call_impl on the stack. The public C API can only say that through frame objects:
// PyFrame_GetBack makes one for every frame it steps over (an allocation each, on a stack that
// is new every step), and reading a local from one builds its f_locals dict. On the Pythons CI
// and the GPU machine run (3.11, 3.12), this reads the interpreter's own frame records instead:
// the code object and the first local of each, nothing made. Elsewhere it falls back to the
// public API (frame objects, and PyFrame_GetVarString or f_locals).
//
// Puts (new references to) the nn.Module instances whose forward is running on this thread --
// the `self` of each nn.Module._call_impl frame -- innermost first, into out[0..max_out),
// looking `max_frames` frames deep at most; returns how many (0 when this torch has no
// _call_impl).
int running_modules(int max_frames, PyObject** out, int max_out);
// The module's `_parameters` (or, with `buffers`, `_buffers`) dict as a new reference; null
// (no error set) when it has none.
PyObject* module_state(PyObject* module, bool buffers);

// torch.distributed.tensor.DTensor (borrowed), or null while that module is not imported (no
// DTensor can exist then; importing it here would cost every subclass pack).
PyObject* dtensor_class();
// A DTensor's local tensor (`_local_tensor`) as a new reference, or null (no error set).
PyObject* dtensor_local(PyObject* dtensor);
// Whether a DTensor is a parameter: nn.Parameter(a DTensor) is a DTensor marked `_is_param`
// (what isinstance(p, Parameter) reads for subclasses), not an instance of Parameter.
bool dtensor_is_param(PyObject* dtensor);
// A DTensor's local tensor and spec (`_spec`), what unpack builds it again from; raise when
// missing.
pybind11::object dtensor_local_tensor(pybind11::handle dtensor);
pybind11::object dtensor_spec(pybind11::handle dtensor);
// The DTensor of `local` laid out as `spec` (requires_grad=False: autograd gives the unpacked
// tensor its grad_fn or requires_grad itself).
pybind11::object dtensor_from(pybind11::handle local, pybind11::handle spec);

// Note [Selective checkpoint cache mutation]: true when this unpack hook was called by SAC's
// _VersionWrapper.get_val with allow_cache_entry_mutation=True (a frame read; call it only where
// the version check would raise).
bool sac_allows_mutation();
// True when this pack hook was called by SAC's cache (`wrap`), found by its code object: a
// pointer compare per pack (Note [Same view, same tensor]).
bool sac_cache_pack();

}  // namespace ckpt_offload

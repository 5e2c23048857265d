// The saved-tensor hook functions torch calls once per saved tensor (Note [Hook entry points]):
// the per-tensor entry points from Python, hence C++.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <memory>

namespace ckpt_offload {

class Packer;

// Note [Hook entry points]: a new pack (or unpack) function object of `packer`.
pybind11::object hook_function(std::shared_ptr<Packer> packer, bool pack);
// The same as a new reference, or null with a Python error set.
PyObject* new_hook_function(const std::shared_ptr<Packer>& packer, bool pack);
// Makes the pack function `fn` (of new_hook_function) hand every tensor back as it is from now
// on (HookHolder::closed): the entry left on a stack by an exit that could not pop it offloads
// nothing (Note [Exits that cannot pop]).
void close_hook_function(PyObject* fn);
// Raises the C++ exception being handled as the Python exception pybind11 would raise
// (PoolFullError included); returns null, for a CPython function to return.
PyObject* raise_translated() noexcept;

}  // namespace ckpt_offload

// The saved-tensor hook functions torch calls, and the activation of a co.offload context that
// pushes and pops them: the per-step and per-tensor entry points from Python, hence C++.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

namespace ckpt_offload {

class Packer;

// Note [Hook entry points]: a new pack (or unpack) function object of `packer`.
pybind11::object hook_function(std::shared_ptr<Packer> packer, bool pack);

// Registers close_hook and the Hooks type (Note [Native activation]) in the extension module.
void bind_hooks(pybind11::module_& m);

}  // namespace ckpt_offload

// The activation of a co.offload context: its entry and exit, whole, in one C call each
// (Note [Native activation]), including the repair of an exit that cannot pop its own entry
// (Note [Exits that cannot pop]).
#pragma once

#include <pybind11/pybind11.h>

namespace ckpt_offload {

// Registers the Hooks type and its two enums, Activation and ExitReport, in the extension module.
void bind_activation(pybind11::module_& m);

}  // namespace ckpt_offload

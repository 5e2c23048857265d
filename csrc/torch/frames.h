// Reading this thread's Python stack from C++, without making frame objects on the way.
#pragma once

#include <Python.h>

namespace ckpt_offload {

// Note [Reading the Python stack]
// Packer::leaf_owner asks which modules' forwards are running: the `self` of every frame of
// nn.Module._call_impl on the stack. The public C API can only say that through frame objects:
// PyFrame_GetBack makes one for every frame it steps over (an allocation each, on a stack that
// is new every step), and reading a local from one builds its f_locals dict. On the Pythons CI
// and the GPU machine run (3.11, 3.12), this reads the interpreter's own frame records instead:
// the code object and the first local of each, nothing made. Elsewhere it falls back to the
// public API (frame objects, and PyFrame_GetVarString or f_locals).
//
// Puts (new references to) the `self` -- the first local -- of each frame running `code`, a
// function whose first parameter is `self`, innermost first, into out[0..max_out), looking
// `max_frames` frames deep at most; returns how many.
int first_locals_of(PyObject* code, int max_frames, PyObject** out, int max_out);
// True when this thread's innermost running Python frame runs `code` (read from the frame
// records: no frame object made, so it costs a pointer compare on the Pythons above).
bool running_code(PyObject* code);

}  // namespace ckpt_offload

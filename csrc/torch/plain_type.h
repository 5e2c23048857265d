// The minimal CPython types of the hot path (Note [Saved activation objects], Note [Hook entry
// points], Note [Native activation]): objects that embed C++ state, made and freed without
// pybind11's instance registry.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

namespace ckpt_offload {

// Readies the static type `t` (its other slots, such as tp_getset or tp_new, set beforehand):
// a plain object of `size` bytes freed by `dealloc`, outside the cyclic GC -- each of these
// holds no Python object that could refer back to it. Raises what PyType_Ready set.
inline PyTypeObject* ready_plain_type(PyTypeObject& t, const char* name, Py_ssize_t size, destructor dealloc,
                                      const char* doc) {
  t.tp_name = name;
  t.tp_basicsize = size;
  t.tp_dealloc = dealloc;
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = doc;
  if (PyType_Ready(&t) < 0) throw pybind11::error_already_set();
  return &t;
}

}  // namespace ckpt_offload

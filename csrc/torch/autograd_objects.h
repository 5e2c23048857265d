// The CPython objects autograd holds for co.offload: what pack returns for a saved tensor (a
// SavedActivation, or a SavedDTensor) and what each hook function carries (a HookHolder). Each is
// a minimal static type that embeds its C++ state, made and freed without pybind11's instance
// registry: they are made once per saved tensor (Note [Saved activation objects]) or read once
// per saved tensor (Note [Hook entry points]).
#pragma once

#include <ATen/ATen.h>
#include <ATen/DimVector.h>
#include <Python.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <memory>
#include <new>
#include <utility>

#include "saved_tensor.h"

namespace ckpt_offload {

class Packer;

// Readies the static type `t` (its other slots, such as tp_getset or tp_new, set beforehand):
// a plain object of `size` bytes freed by `dealloc`, outside the cyclic GC -- each of these
// holds no Python object that could refer back to it. Raises what PyType_Ready set. (The
// context's Hooks type, hooks.cpp, is made the same way.)
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

// Note [Saved activation objects]
// What pack returns to autograd is a minimal CPython object embedding the SavedTensor (no
// allocation of its own, no reference count of a shared_ptr), not a pybind11 instance: a
// pybind11 instance is registered in (and removed from) pybind11's global instance table, which
// cost more than the whole keep decision. It holds no Python reference, so it is not tracked by
// the cyclic GC either (which would add a collection every few hundred saved tensors).
struct SavedObject {
  PyObject_HEAD SavedTensor saved;
};

PyTypeObject* make_saved_type();
// ckpt_offload._C.SavedActivation, made once (inline: unpack compares with it per tensor).
inline PyTypeObject* saved_type() {
  static PyTypeObject* type = make_saved_type();
  return type;
}

// The Python object autograd holds, its SavedTensor constructed in place from `args`.
template <class... Args>
pybind11::object make_saved(Args&&... args) {
  PyTypeObject* type = saved_type();
  PyObject* obj = type->tp_alloc(type, 0);
  if (!obj) throw pybind11::error_already_set();
  try {
    new (&reinterpret_cast<SavedObject*>(obj)->saved) SavedTensor(std::forward<Args>(args)...);
  } catch (...) {
    type->tp_free(obj);  // nothing constructed to destroy
    throw;
  }
  return pybind11::reinterpret_steal<pybind11::object>(obj);
}

// What pack returns for a DTensor (Note [DTensor activations], packer.cpp): the packed local
// tensor, the DTensor's spec, and the DTensor's own version. An in-place op on a DTensor bumps
// the DTensor's version counter (autograd's in-place kernel runs on it), not its local tensor's
// (DTensor runs the op on the local tensor below autograd), so both are checked.
struct DTensorOuter {
  SavedVersion version;
  c10::ScalarType dtype;
  at::DimVector sizes;
  c10::Device device;
  explicit DTensorOuter(const at::Tensor& t)
      : version(t), dtype(t.scalar_type()), sizes(t.sizes()), device(t.device()) {}
  void check() const { version.check(dtype, sizes, device); }
};

struct SavedDTensorObject {
  PyObject_HEAD PyObject* local;  // owned: what pack returned for the local tensor
  PyObject* spec;                 // owned
  DTensorOuter outer;
};

PyTypeObject* make_saved_dtensor_type();
// ckpt_offload._C.SavedDTensor, made once (inline, as saved_type).
inline PyTypeObject* saved_dtensor_type() {
  static PyTypeObject* type = make_saved_dtensor_type();
  return type;
}
// The SavedDTensor of DTensor `t`: its local tensor packed (`local`) and its spec, both taken.
pybind11::object make_saved_dtensor(const at::Tensor& t, pybind11::object local, pybind11::object spec);

// What each hook function carries, as the function's `self` (Note [Hook entry points]): a
// minimal CPython object (not a capsule, whose every read compares its name with strcmp: twice
// per saved tensor). `closed`: set by the exit of the context that pushed the function where its
// entry could not be popped (another thread, another backward: Note [Exits that cannot pop]):
// from then on pack hands every tensor back as it is (a detached alias, which unpack returns),
// so the entry left on that thread's stack offloads nothing.
struct HookHolder {
  PyObject_HEAD std::shared_ptr<Packer> packer;
  std::atomic<bool> closed;
};

PyTypeObject* holder_type();
inline HookHolder* holder_of(PyObject* self) { return reinterpret_cast<HookHolder*>(self); }
// A new function object for `def` (hooks.cpp's pack or unpack) whose `self` is a new HookHolder
// of `packer`; null with a Python error set when it cannot be made.
PyObject* holder_function(const std::shared_ptr<Packer>& packer, PyMethodDef* def);

}  // namespace ckpt_offload

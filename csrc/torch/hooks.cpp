// Note [Hook entry points]: what Python calls per saved tensor.
#include "hooks.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <atomic>

#include "autograd_objects.h"
#include "packer.h"

namespace py = pybind11;

namespace ckpt_offload {

// Note [Hook entry points]
// The saved-tensor hooks torch calls once per saved tensor are plain CPython functions (METH_O),
// not pybind11 methods: pybind11's dispatcher (overload resolution, argument casters) costs as
// much as the whole keep decision. Each function carries its Packer in its `self` (HookHolder,
// autograd_objects.h), and turns a C++ exception into the Python exception pybind11 would have
// raised (PoolFullError included).
PyObject* raise_translated() noexcept {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (py::builtin_exception& e) {
    e.set_error();
  } catch (...) {
    py::detail::try_translate_exceptions();
  }
  return nullptr;
}

namespace {

PyObject* hook_pack(PyObject* self, PyObject* arg) {
  try {
    HookHolder* holder = holder_of(self);
    if (holder->closed.load(std::memory_order_relaxed)) {
      if (!THPVariable_Check(arg)) return py::reinterpret_borrow<py::object>(arg).release().ptr();
      return THPVariable_Wrap(THPVariable_Unpack(arg).detach());
    }
    return holder->packer->pack(arg).release().ptr();
  } catch (...) {
    return raise_translated();
  }
}

PyObject* hook_unpack(PyObject* self, PyObject* arg) {
  try {
    return THPVariable_Wrap(holder_of(self)->packer->unpack(arg));
  } catch (...) {
    return raise_translated();
  }
}

PyMethodDef pack_def{"pack", hook_pack, METH_O, "co.offload's pack hook: one saved tensor -> what autograd keeps"};
PyMethodDef unpack_def{"unpack", hook_unpack, METH_O, "co.offload's unpack hook: what pack returned -> the tensor"};

}  // namespace

PyObject* new_hook_function(const std::shared_ptr<Packer>& packer, bool pack) {
  return holder_function(packer, pack ? &pack_def : &unpack_def);
}

py::object hook_function(std::shared_ptr<Packer> packer, bool pack) {
  PyObject* fn = new_hook_function(packer, pack);
  if (!fn) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

void close_hook_function(PyObject* fn) {
  PyObject* self = PyCFunction_Check(fn) ? PyCFunction_GET_SELF(fn) : nullptr;
  if (self && Py_TYPE(self) == holder_type()) holder_of(self)->closed.store(true);
}

}  // namespace ckpt_offload

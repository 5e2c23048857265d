// The CPython objects autograd holds (autograd_objects.h): their types, made once.
#include "autograd_objects.h"

namespace py = pybind11;

namespace ckpt_offload {

namespace {

void saved_dealloc(PyObject* self) {
  reinterpret_cast<SavedObject*>(self)->saved.~SavedTensor();
  Py_TYPE(self)->tp_free(self);
}

// A read-only attribute for tests and debugging (never read on the hot path): `offloaded`, its
// bytes are held by the host pool (or its disk tier) rather than kept as the tensor.
PyObject* saved_get_offloaded(PyObject* self, void*) {
  return PyBool_FromLong(reinterpret_cast<SavedObject*>(self)->saved.offloaded());
}

PyGetSetDef saved_getset[] = {
    {"offloaded", saved_get_offloaded, nullptr, "True when the bytes are held by the host pool (or its disk tier).",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

void saved_dtensor_dealloc(PyObject* self) {
  auto* d = reinterpret_cast<SavedDTensorObject*>(self);
  Py_XDECREF(d->local);
  Py_XDECREF(d->spec);
  d->outer.~DTensorOuter();
  Py_TYPE(self)->tp_free(self);
}

void holder_dealloc(PyObject* o) {
  auto* h = reinterpret_cast<HookHolder*>(o);
  h->packer.~shared_ptr();
  h->closed.~atomic();
  Py_TYPE(o)->tp_free(o);
}

}  // namespace

PyTypeObject* make_saved_type() {
  static PyTypeObject t = {PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_getset = saved_getset;
  return ready_plain_type(t, "ckpt_offload._C.SavedActivation", sizeof(SavedObject), saved_dealloc,
                          "A tensor saved by co.offload's pack hook: kept, or held in the host pool until unpacked.");
}

PyTypeObject* make_saved_dtensor_type() {
  static PyTypeObject t = {PyVarObject_HEAD_INIT(nullptr, 0)};
  // Its local tensor and spec cannot refer back to it.
  return ready_plain_type(t, "ckpt_offload._C.SavedDTensor", sizeof(SavedDTensorObject), saved_dtensor_dealloc,
                          "A DTensor saved by co.offload's pack hook: its packed local tensor and its spec.");
}

py::object make_saved_dtensor(const at::Tensor& t, py::object local, py::object spec) {
  PyTypeObject* type = saved_dtensor_type();
  PyObject* o = type->tp_alloc(type, 0);
  if (!o) throw py::error_already_set();
  auto* d = reinterpret_cast<SavedDTensorObject*>(o);
  new (&d->outer) DTensorOuter(t);
  d->local = local.release().ptr();
  d->spec = spec.release().ptr();
  return py::reinterpret_steal<py::object>(o);
}

PyTypeObject* holder_type() {
  static PyTypeObject* type = [] {
    static PyTypeObject t = {PyVarObject_HEAD_INIT(nullptr, 0)};
    return ready_plain_type(t, "ckpt_offload._C.HookHolder", sizeof(HookHolder), holder_dealloc,
                            "The Packer a co.offload hook function calls (Note [Hook entry points]).");
  }();
  return type;
}

PyObject* holder_function(const std::shared_ptr<Packer>& packer, PyMethodDef* def) {
  PyTypeObject* type = holder_type();
  PyObject* o = type->tp_alloc(type, 0);
  if (!o) return nullptr;
  auto* h = reinterpret_cast<HookHolder*>(o);
  new (&h->packer) std::shared_ptr<Packer>(packer);
  new (&h->closed) std::atomic<bool>(false);
  PyObject* fn = PyCFunction_New(def, o);
  Py_DECREF(o);
  return fn;
}

}  // namespace ckpt_offload

// Note [Torch internals]: every read of torch's private Python, and Note [Reading the Python
// stack]. No torch header here: see torch_internals.h.
#include "torch_internals.h"

#include <frameobject.h>

#include <exception>
#include <string>

namespace py = pybind11;

namespace ckpt_offload {

namespace {

// An attribute name made once (interned), so that reading it builds no string.
PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);  // leaked on purpose: one per name, for the process
  if (!s) throw py::error_already_set();
  return s;
}

PyObject* module_class() {
  // Leaked on purpose: a strong reference to torch.nn.Module for the life of the process.
  static PyObject* cls = py::object(py::module_::import("torch.nn").attr("Module")).release().ptr();
  return cls;
}

// The code object of nn.Module._call_impl, through which every module call runs (its first
// argument is the module); null if this torch has none.
PyObject* call_impl_code() {
  static PyObject* code = [] {
    py::object fn = py::getattr(py::handle(module_class()), "_call_impl", py::none());
    return fn.is_none() ? nullptr : py::object(py::getattr(fn, "__code__", py::none())).release().ptr();
  }();
  return code == Py_None ? nullptr : code;
}

// The code object of the function through which torch's selective checkpoint hands the
// tensors it caches to the saved-tensor hooks (`wrap` in _CachingTorchDispatchMode's
// __torch_dispatch__), or null if this torch has none.
PyObject* sac_cache_wrap_code() {
  static PyObject* code = [] {
    PyObject* found = nullptr;
    try {
      py::object mode = py::module_::import("torch.utils.checkpoint").attr("_CachingTorchDispatchMode");
      // Unwrapped: torch decorates it (a Dynamo-disabling wrapper keeps the original as __wrapped__).
      py::object fn = py::module_::import("inspect").attr("unwrap")(mode.attr("__torch_dispatch__"));
      py::object consts = fn.attr("__code__").attr("co_consts");
      for (py::handle c : consts)
        if (PyCode_Check(c.ptr()) && py::str(c.attr("co_name")).cast<std::string>() == "wrap")
          found = py::reinterpret_borrow<py::object>(c).release().ptr();  // leaked on purpose
    } catch (const std::exception&) {
      PyErr_Clear();
    }
    return found;
  }();
  return code;
}

// A frame's first local, unwrapped from its cell when a closure captures it; borrowed.
PyObject* unwrap_cell(PyObject* v) { return v && PyCell_Check(v) ? PyCell_GET(v) : v; }

// Puts (new references to) the `self` -- the first local -- of each frame running `code`, a
// function whose first parameter is `self`, innermost first, into out[0..max_out), looking
// `max_frames` frames deep at most; returns how many. Defined at the end of this file, where
// the interpreter's internal headers can be included last.
int first_locals_of(PyObject* code, int max_frames, PyObject** out, int max_out);
// True when this thread's innermost running Python frame runs `code`: a pointer compare on the
// frame record, no frame object made (defined at the end of this file too).
bool running_code(PyObject* code);

}  // namespace

int running_modules(int max_frames, PyObject** out, int max_out) {
  PyObject* call_impl = call_impl_code();
  if (!call_impl) return 0;
  const int n = first_locals_of(call_impl, max_frames, out, max_out);
  PyTypeObject* module_type = reinterpret_cast<PyTypeObject*>(module_class());
  int kept = 0;
  for (int i = 0; i < n; ++i) {
    if (PyType_IsSubtype(Py_TYPE(out[i]), module_type))
      out[kept++] = out[i];
    else
      Py_DECREF(out[i]);
  }
  return kept;
}

PyObject* module_state(PyObject* module, bool buffers) {
  static PyObject* const parameters_attr = interned("_parameters");
  static PyObject* const buffers_attr = interned("_buffers");
  PyObject* dict = PyObject_GetAttr(module, buffers ? buffers_attr : parameters_attr);
  if (!dict) PyErr_Clear();
  return dict;
}

PyObject* dtensor_class() {
  static PyObject* cls = nullptr;  // leaked on purpose, as module_class()
  if (cls) return cls;
  // Not imported: no DTensor can exist, and importing it here would cost every subclass pack.
  static PyObject* const name = interned("torch.distributed.tensor");
  PyObject* mod = PyDict_GetItem(PyImport_GetModuleDict(), name);  // borrowed
  if (!mod) return nullptr;
  PyObject* c = PyObject_GetAttrString(mod, "DTensor");
  if (!c) {
    PyErr_Clear();
    return nullptr;
  }
  cls = c;
  return cls;
}

PyObject* dtensor_local(PyObject* dtensor) {
  PyObject* local = PyObject_GetAttrString(dtensor, "_local_tensor");
  if (!local) PyErr_Clear();
  return local;
}

bool dtensor_is_param(PyObject* dtensor) {
  PyObject* flag = PyObject_GetAttrString(dtensor, "_is_param");
  const int param = flag ? PyObject_IsTrue(flag) : 0;
  Py_XDECREF(flag);
  PyErr_Clear();
  return param == 1;
}

py::object dtensor_local_tensor(py::handle dtensor) { return dtensor.attr("_local_tensor"); }

py::object dtensor_spec(py::handle dtensor) { return dtensor.attr("_spec"); }

py::object dtensor_from(py::handle local, py::handle spec) {
  return py::handle(dtensor_class())(local, spec, py::arg("requires_grad") = false);
}

bool sac_allows_mutation() {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed: the frame that called this unpack hook
  if (!frame) return false;
  PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
  bool allowed = false;
  PyObject* name = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_name");
  PyObject* file = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_filename");
  if (name && file && PyUnicode_Check(name) && PyUnicode_Check(file) &&
      PyUnicode_CompareWithASCIIString(name, "get_val") == 0) {
    const char* path = PyUnicode_AsUTF8(file);
    const std::string suffix = "checkpoint.py";
    const std::string p = path ? path : "";
    if (p.size() >= suffix.size() && p.compare(p.size() - suffix.size(), suffix.size(), suffix) == 0) {
      PyObject* locals = PyObject_GetAttrString(reinterpret_cast<PyObject*>(frame), "f_locals");
      PyObject* flag = locals ? PyMapping_GetItemString(locals, "allow_cache_entry_mutation") : nullptr;
      allowed = flag && PyObject_IsTrue(flag) == 1;
      Py_XDECREF(flag);
      Py_XDECREF(locals);
    }
  }
  Py_XDECREF(name);
  Py_XDECREF(file);
  Py_DECREF(code);
  PyErr_Clear();
  return allowed;
}

bool sac_cache_pack() {
  // Asked at every pack (Note [Same view, same tensor]): the frame that called this pack hook,
  // read from its record (PyEval_GetFrame would make a frame object for it).
  PyObject* wrap = sac_cache_wrap_code();
  return wrap && running_code(wrap);
}

}  // namespace ckpt_offload

// Note [Reading the Python stack]: the frame walk, last in this file -- on the Pythons whose
// internal frame layout is known, it is read with Py_BUILD_CORE set, which nothing above sees.
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
#define CKPT_OFFLOAD_FRAME_RECORDS 1
#ifndef Py_BUILD_CORE
#define Py_BUILD_CORE 1
#endif
#include <internal/pycore_frame.h>
#endif

namespace ckpt_offload {
namespace {

#ifdef CKPT_OFFLOAD_FRAME_RECORDS

int first_locals_of(PyObject* code, int max_frames, PyObject** out, int max_out) {
  int n = 0;
  _PyInterpreterFrame* f = PyThreadState_GET()->cframe->current_frame;
  for (int depth = 0; f && depth < max_frames && n < max_out; f = f->previous) {
    if (_PyFrame_IsIncomplete(f)) continue;  // not started yet: its locals are not set
    ++depth;
    if (reinterpret_cast<PyObject*>(f->f_code) != code || f->f_code->co_nlocalsplus < 1) continue;
    if (PyObject* self = unwrap_cell(f->localsplus[0])) {
      Py_INCREF(self);
      out[n++] = self;
    }
  }
  return n;
}

bool running_code(PyObject* code) {
  _PyInterpreterFrame* f = PyThreadState_GET()->cframe->current_frame;
  while (f && _PyFrame_IsIncomplete(f)) f = f->previous;
  return f && reinterpret_cast<PyObject*>(f->f_code) == code;
}

#else

bool running_code(PyObject* code) {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  if (!frame) return false;
  PyCodeObject* c = PyFrame_GetCode(frame);  // new reference
  const bool match = reinterpret_cast<PyObject*>(c) == code;
  Py_DECREF(c);
  return match;
}

int first_locals_of(PyObject* code, int max_frames, PyObject** out, int max_out) {
  int n = 0;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  for (int depth = 0; frame && depth < max_frames && n < max_out; ++depth) {
    PyCodeObject* c = PyFrame_GetCode(frame);  // new reference
    const bool match = reinterpret_cast<PyObject*>(c) == code;
    Py_DECREF(c);
    if (match) {
#if PY_VERSION_HEX >= 0x030C0000
      PyObject* self = PyFrame_GetVarString(frame, "self");
#else
      // Reading f_locals snapshots the frame's locals into a dict that lives as long as the
      // frame; _call_impl's locals (the module, its arguments) live that long anyway.
      PyObject* locals = PyObject_GetAttrString(reinterpret_cast<PyObject*>(frame), "f_locals");
      PyObject* self = locals ? PyMapping_GetItemString(locals, "self") : nullptr;
      Py_XDECREF(locals);
#endif
      if (self) {
        PyObject* v = unwrap_cell(self);
        Py_INCREF(v);
        Py_DECREF(self);
        out[n++] = v;
      }
      PyErr_Clear();
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return n;
}

#endif

}  // namespace
}  // namespace ckpt_offload

// Note [Reading the Python stack]. This file includes no torch header: the interpreter's
// internal frame layout is read with Py_BUILD_CORE set, which no other header should see.
#include "frames.h"

#include <frameobject.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
#define CKPT_OFFLOAD_FRAME_RECORDS 1
#ifndef Py_BUILD_CORE
#define Py_BUILD_CORE 1
#endif
#include <internal/pycore_frame.h>
#endif

namespace ckpt_offload {

namespace {

// A frame's first local, unwrapped from its cell when a closure captures it; borrowed.
PyObject* unwrap_cell(PyObject* v) { return v && PyCell_Check(v) ? PyCell_GET(v) : v; }

}  // namespace

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

}  // namespace ckpt_offload

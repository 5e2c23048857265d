// Note [Hook entry points] and Note [Native activation]: what Python calls per saved tensor and
// per context entry and exit.
#include "hooks.h"

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <structmember.h>

#include <atomic>
#include <cstddef>
#include <new>
#include <stdexcept>
#include <utility>

#include "autograd_objects.h"
#include "packer.h"
#include "pinned_fallback.h"

namespace py = pybind11;

namespace ckpt_offload {

namespace {

// Note [Hook entry points]
// The saved-tensor hooks torch calls once per saved tensor are plain CPython functions (METH_O),
// not pybind11 methods: pybind11's dispatcher (overload resolution, argument casters) costs as
// much as the whole keep decision. Each function carries its Packer in its `self` (HookHolder),
// and turns a C++ exception into the Python exception pybind11 would have raised (PoolFullError
// included).
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

// Note [Native activation]
// A co.offload context is entered and exited once per step (once per block under co.checkpoint,
// co.apply and plans), and what an entry and an exit do runs among a step's ops, whose kernels
// have pushed it out of the caches: every Python call and attribute read there costs several
// times what it costs in a loop. So the whole of a normal entry and exit is one C call each, on
// a Hooks object the context makes once (its pack and unpack functions, the activation in force):
//  - enter() claims the activation (one context is active at most once), notes the thread and
//    the backward it is entered in, pushes the hook functions on torch's saved-tensor hooks stack
//    and starts the Packer's activation. It returns None, or a code for what Python handles: the
//    context is active already (BUSY), or hooks are disabled here (DISABLED: the activation is
//    recorded without hooks, and Python warns).
//  - exit() checks that the exit can pop exactly its own entry (same thread, same backward, its
//    functions on top of the stack), pops it and ends the activation (finish). Anything else
//    returns a code and changes nothing but the claim: NOT_ACTIVE, BUSY (another thread is
//    entering or exiting it), MISUSE (Python takes the entry off as Note [Exits that cannot pop]
//    says, then calls finish()).
//  - finish() ends the Packer's activation (its batches' flush may raise PoolFullError: the
//    activation has ended anyway) and returns what Python has to report, or None: the checks of
//    Note [Offloaded nothing] and of the pool's one-time warnings are made here from the
//    counters, so an exit with nothing to say costs Python nothing.
struct HooksObject {
  PyObject_HEAD
  std::shared_ptr<Packer> packer;
  PyObject* pack;    // owned: the functions pushed (Note [Hook entry points])
  PyObject* unpack;  // owned
  std::atomic<int> state;
  unsigned long thread;  // PyThread_get_thread_ident() of the entry
  int64_t graph_task;    // the backward it was entered in, -1 outside backward
  bool pushed;           // the functions were pushed (false where hooks are disabled)
  bool keep_dedup;       // Packer::end's argument
  // The exit checks Python asks for (Note [Offloaded nothing], the pool's one-time warnings).
  int noop_checks;
  bool check_full, check_disk, check_fallback, check_share;
  // Test seam: the next enter() fails as torch refusing the push (1) or the Packer's begin
  // raising (2) would make it, so that the undoing of each can be tested.
  int fail_next_enter;
};

enum State : int { kIdle = 0, kActive = 1, kClaimed = 2 };
// What enter() / exit() return when Python has something to do (a report is a positive int).
enum Code : int { kBusy = -1, kDisabled = -2, kNotActive = -3, kMisuse = -4 };
// Why finish() reports (a bit each).
enum Report : int { kNoop = 1, kFull = 2, kDiskFull = 4, kFallback = 8, kShare = 16 };

PyObject* code(int c) { return PyLong_FromLong(c); }

bool top_is_ours(const HooksObject* self) {
  const auto& stack = at::SavedTensorDefaultHooks::get_tls_state().stack;
  if (stack.empty()) return false;
  const auto& top = stack.top();
  c10::impl::PyInterpreter* interp = ::getPyInterpreter();
  return top.first.ptr(interp) == self->pack && top.second.ptr(interp) == self->unpack;
}

void push(HooksObject* self) {
  at::SavedTensorDefaultHooks::lazy_initialize();
  c10::impl::PyInterpreter* interp = ::getPyInterpreter();
  Py_INCREF(self->pack);
  Py_INCREF(self->unpack);
  // Raises where hooks are disabled (checked before), dropping both references.
  at::SavedTensorDefaultHooks::push_hooks(c10::SafePyObject(self->pack, interp), c10::SafePyObject(self->unpack, interp));
}

PyObject* hooks_enter(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<HooksObject*>(o);
  int expected = kIdle;
  if (!self->state.compare_exchange_strong(expected, kClaimed)) return code(kBusy);
  self->thread = PyThread_get_thread_ident();
  self->graph_task = torch::autograd::get_current_graph_task_id();
  self->pushed = false;
  if (!at::SavedTensorDefaultHooks::is_enabled()) {
    self->state.store(kActive);
    return code(kDisabled);
  }
  const int fail = std::exchange(self->fail_next_enter, 0);
  try {
    if (fail == 1) throw std::runtime_error("ckpt_offload: simulated refusal of the hooks push");
    push(self);
  } catch (...) {
    self->state.store(kIdle);
    return raise_translated();
  }
  try {
    if (fail == 2) throw std::runtime_error("ckpt_offload: simulated failure of the activation's begin");
    self->packer->begin();
  } catch (...) {
    at::SavedTensorDefaultHooks::pop_hooks();
    try {
      self->packer->end(self->keep_dedup);
    } catch (...) {
    }
    self->state.store(kIdle);
    return raise_translated();
  }
  self->pushed = true;
  self->state.store(kActive);
  Py_RETURN_NONE;
}

int64_t fallback_segments(HostPool& pool) {
  auto* f = dynamic_cast<FallbackBackend*>(&pool.backend());
  return f ? static_cast<int64_t>(f->segments()) : 0;
}

// What finish() reports: None, or the reasons (Report bits; Packer.exit_counts() has the numbers).
PyObject* report(HooksObject* self) {
  const Packer& p = *self->packer;
  int why = 0;
  if (self->noop_checks > 0) {
    --self->noop_checks;
    if (p.offloaded_or_shared())
      self->noop_checks = 0;
    else if (p.kept(KeepReason::TooSmall).first || p.kept(KeepReason::Device).first)
      why |= kNoop;
  }
  if (self->check_full && p.kept(KeepReason::PoolFull).first) why |= kFull;
  if (self->check_disk && p.kept(KeepReason::DiskFull).first) why |= kDiskFull;
  HostPool& pool = *p.options().pool;
  if (self->check_fallback && fallback_segments(pool)) why |= kFallback;
  if (self->check_share && pool.stats().num_cap_hits) why |= kShare;
  if (!why) Py_RETURN_NONE;
  return PyLong_FromLong(why);
}

PyObject* finish(HooksObject* self) {
  if (self->pushed) {
    self->pushed = false;
    try {
      self->packer->end(self->keep_dedup);
    } catch (...) {
      self->state.store(kIdle);
      return raise_translated();
    }
  }
  self->state.store(kIdle);
  return report(self);
}

PyObject* hooks_exit(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<HooksObject*>(o);
  int expected = kActive;
  if (!self->state.compare_exchange_strong(expected, kClaimed)) return code(expected == kIdle ? kNotActive : kBusy);
  if (self->pushed) {
    if (self->thread != PyThread_get_thread_ident() ||
        self->graph_task != torch::autograd::get_current_graph_task_id() || !top_is_ours(self))
      return code(kMisuse);  // claimed: Python takes the entry off, then calls finish()
    try {
      at::SavedTensorDefaultHooks::pop_hooks();
    } catch (...) {
      self->state.store(kActive);
      return raise_translated();
    }
  }
  return finish(self);
}

PyObject* hooks_finish(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<HooksObject*>(o);
  if (self->state.load() != kClaimed) {
    PyErr_SetString(PyExc_RuntimeError, "ckpt_offload: Hooks.finish() called outside a claimed exit");
    return nullptr;
  }
  return finish(self);
}

PyObject* hooks_report(PyObject* o, PyObject*) { return report(reinterpret_cast<HooksObject*>(o)); }

// New pack and unpack functions for the next entry: an exit that could not pop its entry closed
// the old ones (Note [Exits that cannot pop]).
PyObject* hooks_renew(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<HooksObject*>(o);
  PyObject* pack = new_hook_function(self->packer, &pack_def);
  if (!pack) return nullptr;
  PyObject* unpack = new_hook_function(self->packer, &unpack_def);
  if (!unpack) {
    Py_DECREF(pack);
    return nullptr;
  }
  Py_XSETREF(self->pack, pack);
  Py_XSETREF(self->unpack, unpack);
  Py_RETURN_NONE;
}

PyObject* hooks_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* packer_obj = nullptr;
  int keep_dedup = 0;
  static const char* names[] = {"packer", "keep_dedup", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", const_cast<char**>(names), &packer_obj, &keep_dedup))
    return nullptr;
  std::shared_ptr<Packer> packer;
  try {
    packer = py::cast<std::shared_ptr<Packer>>(py::handle(packer_obj));
  } catch (...) {
    PyErr_SetString(PyExc_TypeError, "ckpt_offload: Hooks(packer) takes a _C.Packer");
    return nullptr;
  }
  PyObject* o = type->tp_alloc(type, 0);
  if (!o) return nullptr;
  auto* self = reinterpret_cast<HooksObject*>(o);
  new (&self->packer) std::shared_ptr<Packer>(std::move(packer));
  new (&self->state) std::atomic<int>(kIdle);
  self->pack = self->unpack = nullptr;
  self->thread = 0;
  self->graph_task = -1;
  self->pushed = false;
  self->keep_dedup = keep_dedup != 0;
  self->noop_checks = 0;
  self->check_full = self->check_disk = self->check_fallback = self->check_share = false;
  self->fail_next_enter = 0;
  PyObject* r = hooks_renew(o, nullptr);
  if (!r) {
    Py_DECREF(o);
    return nullptr;
  }
  Py_DECREF(r);
  return o;
}

void hooks_dealloc(PyObject* o) {
  auto* self = reinterpret_cast<HooksObject*>(o);
  Py_XDECREF(self->pack);
  Py_XDECREF(self->unpack);
  self->packer.~shared_ptr();
  self->state.~atomic();
  Py_TYPE(o)->tp_free(o);
}

PyObject* get_function(PyObject* o, void* which) {
  auto* self = reinterpret_cast<HooksObject*>(o);
  PyObject* fn = which ? self->unpack : self->pack;
  Py_INCREF(fn);
  return fn;
}

PyObject* get_active(PyObject* o, void*) {
  return PyBool_FromLong(reinterpret_cast<HooksObject*>(o)->state.load() != kIdle);
}

PyMethodDef hooks_methods[] = {
    {"enter", hooks_enter, METH_NOARGS, "Claims the activation, pushes the hook functions, begins the Packer's activation."},
    {"exit", hooks_exit, METH_NOARGS, "Pops its own entry and finishes, or returns a code (Note [Native activation])."},
    {"finish", hooks_finish, METH_NOARGS, "Ends a claimed exit's activation; returns the reasons to report (an int) or None."},
    {"report", hooks_report, METH_NOARGS, "The exit checks' reasons to report or None, without ending anything."},
    {"renew", hooks_renew, METH_NOARGS, "Makes new pack and unpack functions (the old ones were closed)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef hooks_getset[] = {
    {"pack", get_function, nullptr, "The pack function pushed at each entry.", nullptr},
    {"unpack", get_function, nullptr, "The unpack function pushed at each entry.", reinterpret_cast<void*>(1)},
    {"active", get_active, nullptr, "True between an entry and the end of its exit.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMemberDef hooks_members[] = {
    {"thread", T_ULONG, offsetof(HooksObject, thread), READONLY, "threading.get_ident() of the entry."},
    {"graph_task", T_LONGLONG, offsetof(HooksObject, graph_task), READONLY, "The backward entered in, -1 outside."},
    {"pushed", T_BOOL, offsetof(HooksObject, pushed), READONLY, "The entry pushed its functions."},
    {"noop_checks", T_INT, offsetof(HooksObject, noop_checks), 0, "Exits left for Note [Offloaded nothing]."},
    {"check_full", T_BOOL, offsetof(HooksObject, check_full), 0, "Report kept_by_reason['pool_full']."},
    {"check_disk", T_BOOL, offsetof(HooksObject, check_disk), 0, "Report kept_by_reason['disk_full']."},
    {"check_fallback", T_BOOL, offsetof(HooksObject, check_fallback), 0, "Report a pinned pool's pageable segments."},
    {"check_share", T_BOOL, offsetof(HooksObject, check_share), 0, "Report the pool's cap hits."},
    {"_fail_next_enter", T_INT, offsetof(HooksObject, fail_next_enter), 0,
     "Test seam: 1 makes the next enter() fail at the push, 2 at the Packer's begin."},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject* hooks_type() {
  static PyTypeObject* type = [] {
    static PyTypeObject t = {PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_new = hooks_new;
    t.tp_methods = hooks_methods;
    t.tp_getset = hooks_getset;
    t.tp_members = hooks_members;
    // Its functions hold the Packer, never this object: no cycle.
    return ready_plain_type(t, "ckpt_offload._C.Hooks", sizeof(HooksObject), hooks_dealloc,
                            "A co.offload context's hook functions and the activation in force "
                            "(Note [Native activation]).");
  }();
  return type;
}

}  // namespace

py::object hook_function(std::shared_ptr<Packer> packer, bool pack) {
  PyObject* fn = new_hook_function(packer, pack ? &pack_def : &unpack_def);
  if (!fn) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

void bind_hooks(py::module_& m) {
  PyTypeObject* type = hooks_type();
  Py_INCREF(type);
  m.add_object("Hooks", py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(type)));
  // Its codes, as class attributes (a static type's dict is written before it is used).
  const std::pair<const char*, int> constants[] = {
      {"BUSY", kBusy},          {"DISABLED", kDisabled},        {"NOT_ACTIVE", kNotActive},
      {"MISUSE", kMisuse},      {"REPORT_NOOP", kNoop},          {"REPORT_FULL", kFull},
      {"REPORT_DISK_FULL", kDiskFull}, {"REPORT_FALLBACK", kFallback}, {"REPORT_SHARE", kShare}};
  for (const auto& [name, value] : constants) {
    py::int_ v(value);
    if (PyDict_SetItemString(type->tp_dict, name, v.ptr()) < 0) throw py::error_already_set();
  }
  PyType_Modified(type);
  m.def(
      "close_hook",
      [](py::handle fn) {
        PyObject* self = PyCFunction_Check(fn.ptr()) ? PyCFunction_GET_SELF(fn.ptr()) : nullptr;
        if (!self || Py_TYPE(self) != holder_type())
          throw py::type_error("ckpt_offload: close_hook takes a Packer's pack function");
        holder_of(self)->closed.store(true);
      },
      py::arg("pack"), "Makes a Packer's pack function hand tensors back unchanged from now on (see HookHolder).");
}

}  // namespace ckpt_offload

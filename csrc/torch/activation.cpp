// Note [Native activation] and Note [Exits that cannot pop]: a co.offload context's entry and
// exit, and the repair of an exit that cannot pop its own entry.
#include "activation.h"

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/extension.h>

#include <structmember.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <new>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

#include "autograd_objects.h"
#include "hooks.h"
#include "packer.h"
#include "pinned_fallback.h"

namespace py = pybind11;

namespace ckpt_offload {

namespace {

// Note [Native activation]
// A co.offload context is entered and exited once per step (once per block under co.checkpoint,
// co.apply and plans), and what an entry and an exit do runs among a step's ops, whose kernels
// have pushed it out of the caches: every Python call and attribute read there costs several
// times what it costs in a loop. So the whole of an entry and an exit is one C call each, on a
// Hooks object the context makes once (its pack and unpack functions, the activation in force),
// and the state machine of the activation is here, whole; Python only words what it returns:
//  - enter() claims the activation (one context is active at most once), drops the closed
//    entries of this thread that are on top of its stack (Note [Exits that cannot pop]), notes
//    the thread and the backward it is entered in, pushes the hook functions on torch's
//    saved-tensor hooks stack and starts the Packer's activation. It returns None, or an
//    Activation code: the context is active already (BUSY: nothing done), or hooks are disabled
//    here (DISABLED: the activation is recorded without hooks, and Python warns).
//  - exit() pops exactly its own entry when it can (same thread, same backward, its functions on
//    top of the stack) and ends the activation: the Packer's end (its batches' flush may raise
//    PoolFullError: the activation has ended anyway), then the checks of Note [Offloaded nothing]
//    and of the pool's one-time warnings, made here from the counters, so an exit with nothing
//    to say costs Python nothing. It returns None, or ExitReport bits saying what to report
//    (Packer.exit_counts() has the numbers). NOT_ACTIVE (never entered, or exited already) and
//    BUSY (another thread is entering or exiting it) change nothing. Any other exit is
//    repaired (Note [Exits that cannot pop]) and still ends the activation; it returns
//    (Activation code of the repair, what the end gave: None, ExitReport bits, or the flush's
//    exception), for Python to warn.
//  - report() makes the exit checks again without ending anything (after a flush's error).
struct HooksObject {
  PyObject_HEAD std::shared_ptr<Packer> packer;
  PyObject* pack;    // owned: the functions pushed (Note [Hook entry points])
  PyObject* unpack;  // owned
  std::atomic<int> state;
  unsigned long thread;  // PyThread_get_thread_ident() of the entry (threading.get_ident())
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

// What enter() and exit() return when Python has something to do besides reporting: bound as
// _C.Activation.
enum class Activation : int {
  Busy,           // active already (enter), or another thread is entering or exiting it (exit)
  Disabled,       // entered where saved-tensor hooks are disabled: recorded without hooks
  NotActive,      // exit of a context never entered, or exited already
  OtherThread,    // exited on another thread than the one that entered it
  OtherBackward,  // exited inside a backward it was not entered in (or outside the one it was)
  OutOfOrder,     // exited while a hooks context entered after it is still active
  NotOnStack,     // exited where its functions are not on the hooks stack at all
  kCount
};

// Why exit() reports (a bit each): bound as _C.ExitReport.
enum ExitReport : int { kNoop = 1, kFull = 2, kDiskFull = 4, kFallback = 8, kShare = 16 };

// The members of _C.Activation, made at bind time: what enter() and exit() return (a new
// reference each time, no object made).
PyObject* g_codes[static_cast<int>(Activation::kCount)] = {};

PyObject* code(Activation c) {
  PyObject* o = g_codes[static_cast<int>(c)];
  Py_INCREF(o);
  return o;
}

// --- Note [Exits that cannot pop] ----------------------------------------------------------
// torch's saved-tensor hooks live on a per-thread stack, and torch's own contexts pop whatever
// is on top when they exit, so any sequence of exits ends with an empty stack. A co.offload
// exited out of order, on another thread, or inside a backward it was not entered in cannot
// pop its entry with a plain pop; refusing (raising and leaving it installed) left it on that
// thread's stack for good when nobody called __exit__ again (a @contextmanager scope closed out
// of order), and later plain ops were offloaded into its pool. So such an exit always exits,
// and Python warns:
//  - out of order on the thread that entered it: exactly its own entry is taken out of the
//    stack (the entries above are popped and pushed back, in order), so the contexts entered
//    after it stay in force and exit normally (OutOfOrder);
//  - on another thread, or inside another backward (whose stack is a copy): that stack cannot
//    be reached from here. The entry's pack function is closed (close_hook_function: it hands
//    every tensor back as it is, offloading nothing), and the entry is dropped from the
//    entering thread's stack as soon as it is on top there, at the next co.offload enter or
//    exit on that thread (drop_stale_entries). An entry made inside a backward lived in that
//    backward's copy of the stack, which autograd drops when the backward ends: it is only
//    closed (OtherThread, OtherBackward);
//  - anywhere else its functions are not on the stack: they are closed and dropped as above
//    (NotOnStack).
// Either way the context gets new functions for its next entry (the entry left behind holds
// the old ones, closed).

// An entry left on a thread's stack by an exit that could not pop it: its functions (owned)
// and the backward it was entered in.
struct StaleEntry {
  PyObject* pack;
  PyObject* unpack;
  int64_t graph_task;
};
std::mutex g_stale_mu;
std::unordered_map<unsigned long, std::vector<StaleEntry>> g_stale;  // by thread id
std::atomic<int> g_stale_count{0};  // entries in g_stale: enter and exit look only when not 0

void leave_stale(const HooksObject* self, bool record) {
  close_hook_function(self->pack);
  if (!record) return;
  Py_INCREF(self->pack);
  Py_INCREF(self->unpack);
  std::lock_guard<std::mutex> lock(g_stale_mu);
  g_stale[self->thread].push_back(StaleEntry{self->pack, self->unpack, self->graph_task});
  g_stale_count.fetch_add(1);
}

// Pops the closed entries on top of this thread's stack.
void drop_stale_entries() {
  if (g_stale_count.load(std::memory_order_relaxed) == 0) return;
  const unsigned long me = PyThread_get_thread_ident();
  const int64_t task = torch::autograd::get_current_graph_task_id();
  c10::impl::PyInterpreter* interp = ::getPyInterpreter();
  std::vector<StaleEntry> dropped;
  {
    std::lock_guard<std::mutex> lock(g_stale_mu);
    auto it = g_stale.find(me);
    if (it == g_stale.end()) return;
    auto& entries = it->second;
    for (;;) {
      const auto top = at::SavedTensorDefaultHooks::get_hooks(/*ignore_is_tracing=*/false);
      if (!top) break;
      auto match = entries.begin();
      while (match != entries.end() && !(match->pack == top->first.ptr(interp) &&
                                         match->unpack == top->second.ptr(interp) && match->graph_task == task))
        ++match;
      if (match == entries.end()) break;
      at::SavedTensorDefaultHooks::pop_hooks();
      dropped.push_back(*match);
      entries.erase(match);
      g_stale_count.fetch_sub(1);
    }
    if (entries.empty()) g_stale.erase(it);
  }
  for (const auto& e : dropped) {  // outside the lock: the last references may go here
    Py_DECREF(e.pack);
    Py_DECREF(e.unpack);
  }
}

// Takes exactly (pack, unpack) out of this thread's stack, wherever it is, leaving the others as
// they were. False (and the stack unchanged) when it is not on the stack, or when the others
// could not be pushed back (hooks disabled here).
bool pop_own_entry(PyObject* pack, PyObject* unpack) {
  if (!at::SavedTensorDefaultHooks::is_enabled()) return false;
  c10::impl::PyInterpreter* interp = ::getPyInterpreter();
  std::vector<std::pair<c10::SafePyObject, c10::SafePyObject>> above;
  bool found = false;
  auto push_back_above = [&] {
    for (auto it = above.rbegin(); it != above.rend(); ++it)
      at::SavedTensorDefaultHooks::push_hooks(std::move(it->first), std::move(it->second));
    above.clear();
  };
  try {
    while (at::SavedTensorDefaultHooks::get_hooks(/*ignore_is_tracing=*/true)) {
      auto entry = at::SavedTensorDefaultHooks::pop_hooks();
      if (entry.first.ptr(interp) == pack && entry.second.ptr(interp) == unpack) {
        found = true;
        break;
      }
      above.push_back(std::move(entry));
    }
  } catch (...) {
    push_back_above();
    throw;
  }
  push_back_above();
  return found;
}

// Takes the entry off where the exit could not pop it: the Activation code of what was done.
Activation uninstall(HooksObject* self) {
  if (self->thread != PyThread_get_thread_ident()) {
    leave_stale(self, /*record=*/true);
    return Activation::OtherThread;
  }
  if (self->graph_task != torch::autograd::get_current_graph_task_id()) {
    // Entered outside backward: the entry is on this thread's own stack, out of reach until
    // backward ends. Entered in a backward: it lived in that backward's copy of the stack,
    // which autograd drops when the backward ends.
    leave_stale(self, /*record=*/self->graph_task == -1);
    return Activation::OtherBackward;
  }
  // Its own entry is off the stack: nothing else to do.
  if (pop_own_entry(self->pack, self->unpack)) return Activation::OutOfOrder;
  leave_stale(self, /*record=*/true);
  return Activation::NotOnStack;
}

// --- the activation ------------------------------------------------------------------------

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
  at::SavedTensorDefaultHooks::push_hooks(c10::SafePyObject(self->pack, interp),
                                          c10::SafePyObject(self->unpack, interp));
}

PyObject* hooks_enter(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<HooksObject*>(o);
  int expected = kIdle;
  if (!self->state.compare_exchange_strong(expected, kClaimed)) return code(Activation::Busy);
  try {
    drop_stale_entries();
  } catch (...) {
    self->state.store(kIdle);
    return raise_translated();
  }
  self->thread = PyThread_get_thread_ident();
  self->graph_task = torch::autograd::get_current_graph_task_id();
  self->pushed = false;
  if (!at::SavedTensorDefaultHooks::is_enabled()) {
    self->state.store(kActive);
    return code(Activation::Disabled);
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

// The exit checks: None, or the reasons to report (ExitReport bits).
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

// Ends a claimed exit's activation: the Packer's end, then the exit checks.
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

// New pack and unpack functions for the next entry; false with a Python error set.
bool renew(HooksObject* self) {
  PyObject* pack = new_hook_function(self->packer, /*pack=*/true);
  if (!pack) return false;
  PyObject* unpack = new_hook_function(self->packer, /*pack=*/false);
  if (!unpack) {
    Py_DECREF(pack);
    return false;
  }
  Py_XSETREF(self->pack, pack);
  Py_XSETREF(self->unpack, unpack);
  return true;
}

// The Python error set now, taken as an exception object (with its traceback).
PyObject* take_error() {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb && value) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
}

// An exit that cannot pop its own entry (Note [Exits that cannot pop]); the exit is claimed.
PyObject* repair_exit(HooksObject* self) {
  Activation done;
  try {
    done = uninstall(self);
  } catch (...) {
    // Ends the activation anyway, then raises what went wrong (no new functions: the old ones
    // may still be where they were).
    raise_translated();
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject* end = finish(self);
    if (end)
      Py_DECREF(end);
    else
      PyErr_Clear();
    try {
      drop_stale_entries();
    } catch (...) {
    }
    PyErr_Restore(type, value, tb);
    return nullptr;
  }
  PyObject* outcome = finish(self);
  if (!outcome) outcome = take_error();  // the flush's error: Python raises it after warning
  // Unless another thread entered it since (then that entry has the functions in force).
  if (self->state.load() == kIdle && !renew(self)) {
    Py_DECREF(outcome);
    return nullptr;
  }
  try {
    drop_stale_entries();
  } catch (...) {
    Py_DECREF(outcome);
    return raise_translated();
  }
  PyObject* kind = code(done);
  PyObject* result = PyTuple_Pack(2, kind, outcome);
  Py_DECREF(kind);
  Py_DECREF(outcome);
  return result;
}

PyObject* hooks_exit(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<HooksObject*>(o);
  int expected = kActive;
  if (!self->state.compare_exchange_strong(expected, kClaimed)) {
    if (expected != kIdle) return code(Activation::Busy);
    try {
      drop_stale_entries();  // a second __exit__ may be what leaves this thread's stack clean
    } catch (...) {
      return raise_translated();
    }
    return code(Activation::NotActive);
  }
  if (self->pushed) {
    if (self->thread != PyThread_get_thread_ident() ||
        self->graph_task != torch::autograd::get_current_graph_task_id() || !top_is_ours(self))
      return repair_exit(self);
    try {
      at::SavedTensorDefaultHooks::pop_hooks();
    } catch (...) {
      self->state.store(kActive);
      return raise_translated();
    }
  }
  return finish(self);
}

PyObject* hooks_report(PyObject* o, PyObject*) { return report(reinterpret_cast<HooksObject*>(o)); }

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
  if (!renew(self)) {
    Py_DECREF(o);
    return nullptr;
  }
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
    {"enter", hooks_enter, METH_NOARGS,
     "Claims the activation, pushes the hook functions, begins the Packer's activation; None or an Activation "
     "code (Note [Native activation])."},
    {"exit", hooks_exit, METH_NOARGS,
     "Pops its own entry (or repairs the stack) and ends the activation; None, ExitReport bits, an Activation code, "
     "or (Activation, outcome) after a repair (Note [Native activation])."},
    {"report", hooks_report, METH_NOARGS, "The exit checks' ExitReport bits or None, without ending anything."},
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

void bind_activation(py::module_& m) {
  PyTypeObject* type = hooks_type();
  Py_INCREF(type);
  m.add_object("Hooks", py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(type)));
  py::enum_<Activation> activation(
      m, "Activation",
      "What Hooks.enter() and Hooks.exit() return when Python has something to do besides reporting: "
      "see Note [Native activation] and Note [Exits that cannot pop] (csrc/torch/activation.cpp).");
  const std::pair<const char*, Activation> codes[] = {{"BUSY", Activation::Busy},
                                                      {"DISABLED", Activation::Disabled},
                                                      {"NOT_ACTIVE", Activation::NotActive},
                                                      {"OTHER_THREAD", Activation::OtherThread},
                                                      {"OTHER_BACKWARD", Activation::OtherBackward},
                                                      {"OUT_OF_ORDER", Activation::OutOfOrder},
                                                      {"NOT_ON_STACK", Activation::NotOnStack}};
  for (const auto& [name, value] : codes) {
    activation.value(name, value);
    g_codes[static_cast<int>(value)] = py::object(activation.attr(name)).release().ptr();  // kept for the process
  }
  py::enum_<ExitReport>(m, "ExitReport",
                        "Why Hooks.exit() (or report()) has something to report, a bit each: see Note [Native "
                        "activation] (csrc/torch/activation.cpp); the numbers are in Packer.exit_counts().",
                        py::arithmetic())
      .value("NOOP", kNoop)
      .value("FULL", kFull)
      .value("DISK_FULL", kDiskFull)
      .value("FALLBACK", kFallback)
      .value("SHARE", kShare);
}

}  // namespace ckpt_offload

#include "packer.h"

#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <exception>
#include <string>

#include "../core/profiler.h"
#include "device_memory.h"
#include "frames.h"
#include "plain_type.h"
#include "runtime.h"
#include "host_copies.h"
#include "tensor_layout.h"

namespace py = pybind11;

namespace ckpt_offload {

// Note [Parameters and buffers]
// Parameters, buffers and views of them are kept: they live across the step anyway, so a copy
// frees nothing. They are recognised from the saved tensor itself, with no module hook (a
// global forward pre-hook would put every nn.Module call of the process on torch's slow hook
// path, and make torch.compile warn about global hooks):
//  - an nn.Parameter, or a view whose root (`_base`; torch keeps the root, not a chain) is one:
//    nn.Linear saves weight.t(), a plain Tensor. Frozen weights are Parameters too.
//  - any other tensor whose view root is a leaf (no grad_fn: inputs, masks built without grad,
//    buffers, parameters swapped in by torch.func.functional_call) is looked up among the
//    `_parameters` and `_buffers` of the modules whose forward is running on this thread: the
//    module of each nn.Module._call_impl frame on the Python stack (Packer::leaf_owner). A buffer used outside the
//    forward of the module that owns it (or of one of its ancestors) is not recognised and is
//    offloaded like an activation: a copy, not a wrong gradient. Non-leaf activations, the
//    bulk of what autograd saves, never reach this lookup.
//  - under torch.autocast, a cast of a parameter that autocast's weight cache holds for the
//    region (`weight.to(bf16)` of an fp32 Parameter that requires grad: the cache's own rule,
//    at::autocast::cached_cast, for parameters) is kept as "autocast_cast": the cache keeps it
//    alive anyway. Frozen weights' casts are not cached (made afresh by every op): offloaded.
namespace {

// An attribute name made once (interned), so that reading it builds no string.
PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);  // leaked on purpose: one per name, for the process
  if (!s) throw py::error_already_set();
  return s;
}

bool is_parameter_object(PyObject* obj) { return PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(ParameterClass)); }

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

PyObject* dtensor_class();

// True when `target` is the storage of a tensor in a module's `_parameters` or `_buffers` dict.
bool scan_state(PyObject* module, PyObject* attr, PyObject* dtensor, const void* target) {
  PyObject* dict = PyObject_GetAttr(module, attr);
  if (!dict) {
    PyErr_Clear();
    return false;
  }
  bool hit = false;
  if (PyDict_Check(dict)) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (!hit && PyDict_Next(dict, &pos, &key, &value)) {
      if (value == Py_None || !THPVariable_Check(value)) continue;
      // A DTensor parameter's storage is its local tensor's (Note [DTensor activations]).
      py::object local;
      if (dtensor && Py_TYPE(value) == reinterpret_cast<PyTypeObject*>(dtensor)) {
        local = py::getattr(py::handle(value), "_local_tensor", py::none());
        if (!THPVariable_Check(local.ptr())) continue;
        value = local.ptr();
      }
      const at::Tensor& v = THPVariable_Unpack(value);
      if (!v.has_storage() || v.key_set().has(c10::DispatchKey::Python)) continue;
      hit = v.storage().unsafeGetStorageImpl() == target;
    }
  }
  Py_DECREF(dict);
  return hit;
}

// Note [Saved activation objects]
// What pack returns to autograd is a minimal CPython object embedding the SavedTensor (no
// allocation of its own, no reference count of a shared_ptr), not a pybind11 instance: a pybind11 instance is registered in (and removed from) pybind11's
// global instance table, which cost more than the whole keep decision. It holds no Python
// reference, so it is not tracked by the cyclic GC either (which would add a collection every
// few hundred saved tensors).
struct SavedObject {
  PyObject_HEAD
  SavedTensor saved;
};

void saved_dealloc(PyObject* self) {
  reinterpret_cast<SavedObject*>(self)->saved.~SavedTensor();
  Py_TYPE(self)->tp_free(self);
}

// A read-only attribute for tests and debugging (never read on the hot path): `offloaded`, its
// bytes are held by the host pool (or its disk tier) rather than kept as the tensor.
PyObject* saved_offloaded(PyObject* self, void*) {
  return PyBool_FromLong(reinterpret_cast<SavedObject*>(self)->saved.offloaded());
}

PyGetSetDef saved_getset[] = {
    {"offloaded", saved_offloaded, nullptr, "True when the bytes are held by the host pool (or its disk tier).",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject* saved_type() {
  static PyTypeObject* type = [] {
    static PyTypeObject t = {PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_getset = saved_getset;
    return ready_plain_type(t, "ckpt_offload._C.SavedActivation", sizeof(SavedObject), saved_dealloc,
                            "A tensor saved by co.offload's pack hook: kept, or held in the host pool until unpacked.");
  }();
  return type;
}

// The Python object autograd holds, its SavedTensor constructed in place from `args`.
template <class... Args>
py::object make_saved(Args&&... args) {
  PyTypeObject* type = saved_type();
  PyObject* obj = type->tp_alloc(type, 0);
  if (!obj) throw py::error_already_set();
  try {
    new (&reinterpret_cast<SavedObject*>(obj)->saved) SavedTensor(std::forward<Args>(args)...);
  } catch (...) {
    type->tp_free(obj);  // nothing constructed to destroy
    throw;
  }
  return py::reinterpret_steal<py::object>(obj);
}

// How many Python frames leaf_owner looks through: deep enough for nested modules
// (each adds ~2 frames: _call_impl and forward), bounded so that a deep stack costs little;
// and how many running modules it reads at most.
constexpr int kMaxFrames = 96;
constexpr int kMaxModules = 48;

// True inside a torch.autocast region (whose weight cache is then live): torch.autocast's
// __enter__ increments a per-thread nesting count and its __exit__ decrements it, clearing the
// cache at zero. There is no getter; increment and decrement each return the new count and
// leave it as it was. Not at::autocast::is_autocast_enabled: pack runs inside autocast's
// kernel, which excludes autocast's dispatch key (what that function reads) while it runs the op.
bool autocast_region_active() {
  const int n = at::autocast::increment_nesting();
  at::autocast::decrement_nesting();
  return n > 1;
}

// `root` is what autocast's weight cache holds for a parameter: a cast (`_to_copy`) to the
// region's low precision of an fp32 leaf that requires grad and is no view (the cache's rule,
// at::autocast::cached_cast), here an nn.Parameter.
bool is_autocast_weight_cast(const at::TensorBase& root) {
  if (!at::autocast::is_autocast_cache_enabled()) return false;
  const c10::DeviceType type = root.device().type();
  if (root.scalar_type() != at::autocast::get_autocast_dtype(type)) return false;
  auto fn = root.grad_fn();
  if (!dynamic_cast<torch::autograd::generated::ToCopyBackward0*>(fn.get()) || fn->next_edges().empty()) return false;
  auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(fn->next_edges()[0].function.get());
  if (!acc) return false;
  const at::Tensor& source = acc->variable;
  if (!source.defined() || source.scalar_type() != at::kFloat || source.is_view() || !source.requires_grad())
    return false;
  // The cache also holds casts of other leaves that require grad (an input created with
  // requires_grad=True): those are activations of this step, offloaded as usual.
  PyObject* obj = THPVariable_Wrap(source);
  const bool parameter = obj && is_parameter_object(obj);
  Py_XDECREF(obj);
  return parameter;
}

// Note [Selective checkpoint cache mutation]
// torch's selective activation checkpoint (SAC) with respect_saved_tensors_hooks=True hands the
// tensors it caches to our pack hook, and in backward calls our unpack from
// _VersionWrapper.get_val(allow_cache_entry_mutation). With allow_cache_entry_mutation=True
// torch lets a cached tensor be modified in place after it was cached (its own check is off),
// so ours must be too: the unpack then returns what it holds -- a kept tensor as it is now, an
// offloaded one as it was saved (what save_on_cpu returns on a GPU). Read only on the path where
// the version check would raise, so it costs nothing otherwise.
// "As it was saved" needs the copy to read the bytes before the region's next op can write
// them: a side-stream copy, or a batch copied at context exit, would race with that write (and
// return the bytes as written, or half of them). So a tensor SAC caches (pack called from the
// cache's `wrap`, found by its code object, sac_cache_pack) is copied on its own, on the
// current stream: after the op that made it, before any op after it.
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

// True when this pack was called by SAC's cache (Note [Selective checkpoint cache mutation]).
bool sac_cache_pack() {
  PyObject* wrap = sac_cache_wrap_code();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed: the frame that called this pack hook
  if (!wrap || !frame) return false;
  PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
  const bool from_cache = reinterpret_cast<PyObject*>(code) == wrap;
  Py_DECREF(code);
  return from_cache;
}

// Note [DTensor activations]
// Under tensor parallelism (torch.distributed.tensor) the tensors autograd saves are DTensors:
// wrapper subclasses whose own storage holds nothing, with the data in a plain local tensor
// (`_local_tensor`, this rank's shard or replica) and the layout in a spec (`_spec`: mesh,
// placements, global shape and strides). Pack offloads the local tensor through the same path as
// any saved tensor -- several DTensor views of one local storage are copied once, and the
// version check runs on the local tensor's counter, which an in-place op on the DTensor bumps
// (DTensor runs the op on the local tensor) -- and keeps the spec; unpack builds the DTensor
// again from the reloaded local tensor and the spec. The local tensor of a DTensor computed by an
// op is always a leaf (DTensor computes below autograd), so the parameter lookup runs on the
// DTensor: a DTensor parameter, or a view of one, is kept as a parameter. Every other
// __torch_dispatch__ subclass is kept (KeepReason::Subclass): its storage is not its data.
// Only exactly DTensor: a subclass of it may hold more than its local tensor and spec.
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

// What pack returns for a DTensor: the packed local tensor, the DTensor's spec, and the
// DTensor's own version. An in-place op on a DTensor bumps the DTensor's version counter
// (autograd's in-place kernel runs on it), not its local tensor's (DTensor runs the op on the
// local tensor below autograd), so both are checked.
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
  PyObject_HEAD
  PyObject* local;
  PyObject* spec;
  DTensorOuter outer;
};

void saved_dtensor_dealloc(PyObject* self) {
  auto* d = reinterpret_cast<SavedDTensorObject*>(self);
  Py_XDECREF(d->local);
  Py_XDECREF(d->spec);
  d->outer.~DTensorOuter();
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject* saved_dtensor_type() {
  static PyTypeObject* type = [] {
    static PyTypeObject t = {PyVarObject_HEAD_INIT(nullptr, 0)};
    // Its local tensor and spec cannot refer back to it.
    return ready_plain_type(t, "ckpt_offload._C.SavedDTensor", sizeof(SavedDTensorObject), saved_dtensor_dealloc,
                            "A DTensor saved by co.offload's pack hook: its packed local tensor and its spec.");
  }();
  return type;
}

// True while pack_dtensor packs the local tensor of a DTensor that is an activation: that local
// tensor is a leaf, but no parameter or buffer (Note [DTensor activations]).
thread_local bool t_local_of_activation = false;

}  // namespace

py::object Packer::pack_dtensor(py::handle obj, const at::Tensor& t, int64_t nbytes) {
  PyObject* cls = dtensor_class();
  if (!cls || Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(cls)) return py::object();
  const at::TensorBase& root = t.is_view() ? t._base() : static_cast<const at::TensorBase&>(t);
  const bool leaf = root.is_leaf();
  if (leaf) {
    // nn.Parameter(a DTensor) is a DTensor marked `_is_param` (what isinstance(p, Parameter)
    // reads for subclasses), not an instance of Parameter.
    PyObject* root_obj = THPVariable_Wrap(root);
    int param = -1;
    if (root_obj) {
      PyObject* flag = PyObject_GetAttrString(root_obj, "_is_param");
      param = flag ? PyObject_IsTrue(flag) : 0;
      Py_XDECREF(flag);
      Py_DECREF(root_obj);
    }
    PyErr_Clear();
    if (param == 1) return keep(t, KeepReason::Parameter, nbytes);
  }
  py::object local = obj.attr("_local_tensor");
  py::object spec = obj.attr("_spec");
  py::object inner;
  {
    const bool outer = t_local_of_activation;
    t_local_of_activation = !leaf;
    try {
      inner = pack(local);
    } catch (...) {
      t_local_of_activation = outer;
      throw;
    }
    t_local_of_activation = outer;
  }
  PyTypeObject* type = saved_dtensor_type();
  PyObject* o = type->tp_alloc(type, 0);
  if (!o) throw py::error_already_set();
  auto* d = reinterpret_cast<SavedDTensorObject*>(o);
  new (&d->outer) DTensorOuter(t);
  d->local = inner.release().ptr();
  d->spec = spec.release().ptr();
  return py::reinterpret_steal<py::object>(o);
}

std::optional<KeepReason> Packer::leaf_owner(const at::Tensor& t, const at::TensorBase& root) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (&root != static_cast<const at::TensorBase*>(&t)) {
    PyObject* base_obj = THPVariable_Wrap(root);
    const bool param_base = base_obj && is_parameter_object(base_obj);
    Py_XDECREF(base_obj);
    if (param_base) return KeepReason::Parameter;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::find(parameter_storages_.begin(), parameter_storages_.end(), storage) != parameter_storages_.end())
      return KeepReason::Parameter;
    if (std::find(buffer_storages_.begin(), buffer_storages_.end(), storage) != buffer_storages_.end())
      return KeepReason::Buffer;
  }
  PyObject* call_impl = call_impl_code();
  if (!call_impl) return std::nullopt;
  // The modules whose forward is running: `self` of the _call_impl frames on this thread's
  // stack, innermost first (Note [Reading the Python stack]).
  PyObject* modules[kMaxModules];
  const int n = first_locals_of(call_impl, kMaxFrames, modules, kMaxModules);
  static PyObject* const parameters_attr = interned("_parameters");
  static PyObject* const buffers_attr = interned("_buffers");
  PyObject* dtensor = dtensor_class();
  std::optional<KeepReason> found;
  PyTypeObject* module_type = reinterpret_cast<PyTypeObject*>(module_class());
  for (int i = 0; i < n; ++i) {
    PyObject* self = modules[i];
    if (!found && PyType_IsSubtype(Py_TYPE(self), module_type)) {
      if (scan_state(self, parameters_attr, dtensor, storage))
        found = KeepReason::Parameter;
      else if (scan_state(self, buffers_attr, dtensor, storage))
        found = KeepReason::Buffer;
    }
    Py_DECREF(self);
  }
  PyErr_Clear();
  if (found) {  // a buffer (or a swapped-in parameter) is often saved by several ops
    std::lock_guard<std::mutex> lock(mu_);
    (*found == KeepReason::Parameter ? parameter_storages_ : buffer_storages_).push_back(storage);
  }
  return found;
}

Packer::Packer(PackerOptions options) : options_(std::move(options)), counters_(std::make_shared<PackerCounters>()) {
  if (!options_.pool) throw std::invalid_argument("ckpt_offload: Packer needs a pool");
  // Prefetching on the compute stream would only move the same stall earlier.
  if (options_.prefetch_bytes > 0 && options_.side_stream)
    prefetcher_ = std::make_shared<Prefetcher>(options_.prefetch_bytes, counters_, options_.prefetch_auto);
}

void Packer::flush_batches() {
  std::map<int, std::shared_ptr<Batch>> open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    open.swap(open_batches_);
  }
  size_t refused = 0, refused_bytes = 0;
  TieredRefusal why = TieredRefusal::PoolFull;
  for (auto& kv : open) {
    if (!kv.second->flush()) {
      refused += kv.second->size();
      refused_bytes += kv.second->block_bytes();
      why = kv.second->refusal();
    }
  }
  if (refused && options_.raise_on_full)
    throw PoolFull(full_message(why, *options_.pool, "a batch of " + std::to_string(refused) + " small saved tensors",
                                static_cast<int64_t>(refused_bytes)) +
                   " (The batch's tensors were kept on the device, so backward still works.)");
}

void Packer::begin() {
  if (prefetcher_) prefetcher_->mark_block();  // each activation is a block (Note [Prefetch window])
  std::lock_guard<std::mutex> lock(mu_);
  parameter_storages_.clear();
  buffer_storages_.clear();
}

void Packer::end(bool keep_dedup) {
  std::exception_ptr flush_error;
  try {
    flush_batches();
  } catch (...) {
    flush_error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!keep_dedup) {
      dedup_.clear();
      converted_.clear();
    }
    parameter_storages_.clear();
    buffer_storages_.clear();
  }
  engine().poll();
  if (flush_error) std::rethrow_exception(flush_error);
}

// Note [Kept as it is]
// A kept tensor is held through a detached alias (a TensorImpl of its own, and at unpack a
// Python object of its own) so that an output saved by its own node (relu's, tanh's) forms no
// reference cycle with that node, which would leak the graph when it is dropped without
// backward. A parameter, a buffer, a view of one (nn.Linear saves weight.t()) or autocast's
// cached cast of one is held as it is instead, and unpack hands back its own Python object:
// such a tensor is a leaf, or its grad_fn is the view (or cast) made before the saving node,
// never that node. Not "never" by construction -- an autograd.Function may return a view of a
// weight as its own output and save it -- so a tensor whose grad_fn is the newest node of this
// thread (the saving node, when it is an output) still gets the alias. The version check is
// ours either way (SavedVersion).
static bool held_as_it_is(const at::Tensor& t, KeepReason why) {
  if (why != KeepReason::Parameter && why != KeepReason::Buffer && why != KeepReason::AutocastCast) return false;
  const torch::autograd::AutogradMeta* meta = torch::autograd::impl::get_autograd_meta(t);
  const torch::autograd::Node* fn = meta ? meta->grad_fn_.get() : nullptr;  // the field: no view regeneration
  if (!fn) return true;
  const uint64_t next = at::sequence_number::peek();
  return next > 0 && fn->sequence_nr() < next - 1;
}

py::object Packer::keep(const at::Tensor& t, KeepReason why, int64_t nbytes) {
  counters_->kept_tensors[static_cast<int>(why)]++;
  counters_->kept_bytes[static_cast<int>(why)] += nbytes;
  // A detached alias: same storage and version counter, but no grad_fn, so an output saved
  // by its own node does not form a reference cycle that would leak the graph. For a plain
  // strided tensor made directly (what the detach op does, without its dispatch); subclasses
  // and other layouts go through their own detach. Some are held as they are (Note [Kept as it is]).
  at::Tensor alias;
  if (why == KeepReason::Subclass || why == KeepReason::Layout || why == KeepReason::NoData ||
      t.key_set().has(c10::DispatchKey::Python)) {
    alias = t.detach();
  } else if (held_as_it_is(t, why)) {
    alias = t;
  } else {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    alias = at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), impl->allow_tensor_metadata_change()));
  }
  // Parameters, buffers and autocast's cached casts live across the step anyway: not counted
  // as saved activations in the memory timeline.
  const bool lives_anyway = why == KeepReason::Parameter || why == KeepReason::Buffer || why == KeepReason::AutocastCast;
  py::object saved = make_saved(SavedTensor::KeptTag{}, t, std::move(alias), nbytes, lives_anyway ? 0 : nbytes, counters_);
  if (profiler::enabled()) {
    profiler::KeepRecord k;
    k.reason = keep_reason_name(why);
    k.dtype = dtype_name(t.scalar_type());
    k.module = profiler::scope();
    k.bytes = static_cast<size_t>(nbytes);
    k.device = device_index(t.device());
    k.shape = t.sizes().vec();
    profiler::add(std::move(k));
    sample_memory(options_.pool.get(), t.device());
  }
  counters_->note_device_peak();
  return saved;
}

std::optional<KeepReason> Packer::classify(PyObject* o, const at::Tensor& t, Span* span, int64_t* keep_bytes,
                                           std::optional<CurrentStream>* current) {
  const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
  const int64_t itemsize = static_cast<int64_t>(impl.dtype().itemsize());
  *keep_bytes = impl.numel() * itemsize;
  int64_t extent = 0;  // elements of its storage it reaches (extent_elements)
  // The usual case first: torch.Tensor's own class (not a Parameter, which THPVariable_CheckExact
  // also accepts, nor any other subclass), plainly strided. For it the checks below conclude "no
  // parameter object, no subclass, a supported layout, not a ZeroTensor"; what is left of
  // without_data is the storage test.
  if (Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(THPVariableClass) && plain_strided(impl)) {
    extent = extent_elements(impl);
    if (storage_lacks_span(impl, extent)) {
      *keep_bytes = 0;  // Note [Tensors without data]
      return KeepReason::NoData;
    }
  } else {
    if (is_parameter_object(o)) return KeepReason::Parameter;
    if (!THPVariable_CheckExact(o) || wrapped_tensor(t)) return KeepReason::Subclass;
    if (unsupported_layout(t)) return KeepReason::Layout;
    if (without_data(t)) {  // Note [Tensors without data]: nothing to copy, nothing held
      *keep_bytes = 0;
      return KeepReason::NoData;
    }
    extent = extent_elements(t);
  }
  const c10::Device device = impl.device();
  const bool device_ok = (device.is_cpu() && options_.offload_cpu) || (device.is_cuda() && options_.offload_cuda);
  if (!device_ok) return KeepReason::Device;
  // Under CUDA graph capture events cannot be queried and the pool's addresses would be baked
  // into the graph: leave such tensors alone.
  current->emplace(CurrentStream::of(device));
  if ((*current)->capturing()) return KeepReason::GraphCapture;

  // Note [Parameters and buffers]. An activation (the root of its views has a grad_fn) costs
  // one flag test here; under autocast a cast of a parameter is a low-precision float.
  const at::TensorBase& root = t.is_view() ? t._base() : static_cast<const at::TensorBase&>(t);
  if (root.is_leaf()) {
    if (!t_local_of_activation)
      if (auto why = leaf_owner(t, root)) return why;
  } else if (c10::isReducedFloatingType(root.scalar_type()) && autocast_region_active() &&
             is_autocast_weight_cast(root)) {
    return KeepReason::AutocastCast;
  }

  if (extent == 0) {
    *keep_bytes = 0;
    return KeepReason::TooSmall;
  }
  span->itemsize = itemsize;
  span->lo = impl.storage_offset() * itemsize;
  span->hi = span->lo + extent * itemsize;
  if (span->bytes() < options_.min_bytes) {
    *keep_bytes = span->bytes();
    return KeepReason::TooSmall;
  }
  const auto& vc = impl.version_counter();
  span->version = vc.enabled() ? vc.current_version() : 0;
  return std::nullopt;
}

std::shared_ptr<OffloadedStorage> Packer::find_duplicate(const at::Tensor& t, const Span& span, const Span& wide,
                                                         std::vector<Touched>* touched) {
  std::lock_guard<std::mutex> lock(mu_);
  auto* e = dedup_.find(t.storage().unsafeGetStorageImpl());
  if (!e) return nullptr;
  for (size_t i = 0; i < e->groups.size();) {
    DedupGroup& g = e->groups[i];
    auto copy = g.offloaded.lock();
    if (!copy) {  // every saved tensor of that copy is gone
      e->groups.erase(e->groups.begin() + i);
      continue;
    }
    ++i;
    if (g.version != span.version) continue;
    if (span.lo >= g.lo && span.hi <= g.hi) {
      touched->clear();
      return copy;
    }
    // Shares a 512-byte cell with this copy: joins it (Note [One copy per storage]).
    if (wide.lo < g.hi && wide.hi > g.lo)
      touched->push_back(Touched{std::move(copy), g.lo, g.hi, g.extendable, g.counted});
  }
  return nullptr;
}

std::shared_ptr<OffloadedStorage> Packer::join(const at::Tensor& t, const Span& span, const Span& wide,
                                               std::vector<Touched>& touched, const CurrentStream& current,
                                               TieredRefusal* refused) {
  for (const auto& g : touched)
    if (!g.extendable || !g.held->extendable()) return nullptr;
  std::sort(touched.begin(), touched.end(), [](const Touched& a, const Touched& b) { return a.lo < b.lo; });
  // The bytes of `wide` no copy holds: below the first, between copies, above the last. Every
  // copy touched shares a cell with `wide`, so the union is one span.
  const int64_t lo = std::min(wide.lo, touched.front().lo);
  int64_t hi = lo;
  std::vector<std::pair<int64_t, int64_t>> missing;
  for (const auto& g : touched) {
    if (g.lo > hi) missing.emplace_back(hi, g.lo);
    hi = std::max(hi, g.hi);
  }
  if (wide.hi > hi) missing.emplace_back(hi, wide.hi);
  hi = std::max(hi, wide.hi);
  std::shared_ptr<OffloadedStorage> target = touched.front().held;
  std::vector<OffloadedStorage::Piece> pieces;
  for (const auto& m : missing) {
    // Copied as pieces of the first copy: the same handle in the profile.
    auto buffer = offload_bytes(t, m.first, m.second, options_.pool, options_.side_stream, &current, target->handle(),
                                refused);
    if (!buffer) return nullptr;
    if (buffer->spilled()) counters_->bytes_spilled += m.second - m.first;
    pieces.push_back(OffloadedStorage::Piece{std::move(buffer), m.first});
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto* entry = dedup_.find(t.storage().unsafeGetStorageImpl());
    if (!entry) return nullptr;
    auto& groups = entry->groups;
    // Another thread may have changed these copies since find_duplicate: then this view gets a
    // copy of its own (correct, if not minimal).
    std::vector<size_t> at;
    for (const auto& g : touched) {
      size_t i = 0;
      while (i < groups.size() && !(groups[i].offloaded.lock() == g.held && groups[i].lo == g.lo &&
                                    groups[i].hi == g.hi && groups[i].version == span.version))
        ++i;
      if (i == groups.size()) return nullptr;
      at.push_back(i);
    }
    std::vector<std::pair<std::shared_ptr<OffloadedStorage>, std::pair<std::vector<OffloadedStorage::Piece>, int>>>
        absorbed;
    int pending = 0;
    bool ok = true;
    for (size_t k = 1; k < touched.size() && ok; ++k) {
      std::vector<OffloadedStorage::Piece> theirs;
      int their_pending = 0;
      ok = touched[k].held->absorb_into(target, &theirs, &their_pending);
      if (!ok) break;
      pending += their_pending;
      for (const auto& p : theirs) pieces.push_back(p);
      absorbed.push_back({touched[k].held, {std::move(theirs), their_pending}});
    }
    ok = ok && target->extend(std::move(pieces), pending);
    if (!ok) {
      for (auto& a : absorbed) a.first->restore(std::move(a.second.first), a.second.second);
      return nullptr;
    }
    groups[at[0]].lo = lo;
    groups[at[0]].hi = hi;
    // The joined copy holds lo..hi on the host: what its views had counted becomes that.
    int64_t counted = 0;
    for (const auto& g : touched) counted += g.counted;
    groups[at[0]].counted = hi - lo;
    counters_->bytes_offloaded += hi - lo - counted;
    counters_->bytes_stored += hi - lo - counted;
    std::sort(at.begin() + 1, at.end());
    for (size_t k = at.size(); k-- > 1;) groups.erase(groups.begin() + at[k]);
  }
  return target;
}

std::shared_ptr<OffloadedStorage> Packer::batch(const at::Tensor& t, const Span& span, const CurrentStream& current) {
  const int key = device_index(t.device());
  for (;;) {
    std::shared_ptr<Batch> batch, full;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& open = open_batches_[key];
      if (open && (open->flushed() || open->block_bytes() + static_cast<size_t>(span.bytes()) + 16 >
                                          static_cast<size_t>(options_.batch_bytes))) {
        full = std::move(open);
        open.reset();
      }
      if (!open) open = std::make_shared<Batch>(t.device(), options_.side_stream, options_.pool, counters_, prefetcher_);
      batch = open;
    }
    if (full && !full->flush() && options_.raise_on_full)
      throw PoolFull(full_message(full->refusal(), *options_.pool, "a batch of " + std::to_string(full->size()) +
                                  " small saved tensors", static_cast<int64_t>(full->block_bytes())) +
                     " (The batch's tensors were kept on the device, so backward still works.)");
    // Null when an unpack flushed the batch meanwhile: take a new one.
    if (auto storage = batch->add(t, span.lo, span.bytes(), current)) {
      counters_->tensors_batched++;
      return storage;
    }
  }
}

std::shared_ptr<ConvertedCopy> Packer::find_converted(const at::Tensor& t, const Span& span) {
  std::lock_guard<std::mutex> lock(mu_);
  auto* e = converted_.find(t.storage().unsafeGetStorageImpl());
  if (!e) return nullptr;
  for (size_t i = 0; i < e->groups.size();) {
    ConvertedGroup& g = e->groups[i];
    auto copy = g.copy.lock();
    if (!copy) {  // every saved tensor over that copy is gone
      e->groups.erase(e->groups.begin() + i);
      continue;
    }
    ++i;
    // The same bytes, read as the same elements at the same version: converting them again
    // would give the same bits (fp8's scale is their amax), so they are shared. Spans
    // that only overlap convert on their own.
    if (g.version == span.version && g.lo == span.lo && g.hi == span.hi && g.dtype == t.scalar_type() &&
        (g.dense ? t.is_non_overlapping_and_dense() : t.sizes().equals(g.sizes) && t.strides().equals(g.strides)))
      return copy;
  }
  return nullptr;
}

Packer::Placed Packer::place(const at::Tensor& t, const Span& span, const Span& wide, const CurrentStream& current,
                             Placement* how, TieredRefusal* refused) {
  Placed p;
  // Note [Selective checkpoint cache mutation]: a tensor SAC caches is copied now, on its own.
  // Only asked when a copy could be late (side stream, batches): a cheap frame test.
  if ((options_.side_stream || options_.batch_below > 0) && sac_cache_pack()) {
    p.storage = copy_to_host(t, options_.pool, /*side_stream=*/false, counters_, refused, &current, wide.lo, wide.hi);
    *how = Placement::Single;
    return p;
  }
  // Exact copies of this storage first: one that holds the span, or those that share its cells.
  std::vector<Touched> touched;
  if ((p.storage = find_duplicate(t, span, wide, &touched))) {
    *how = Placement::Duplicate;
    return p;
  }
  if (!touched.empty()) {
    if ((p.storage = join(t, span, wide, touched, current, refused))) {
      *how = Placement::Joined;
      return p;
    }
    if (*refused != TieredRefusal::None) return p;
  }
  // Note [Low-precision storage]: converted tensors take the single-copy path, and are
  // remembered apart (their host bytes are not the storage's): only a later tensor of exactly
  // the same span shares a narrow copy.
  std::optional<lowp::Source> narrow;
  if (options_.store_format != lowp::Format::None && span.bytes() >= options_.store_min_bytes)
    narrow = store_source(t, options_.store_format);
  if (narrow) {
    if ((p.copy = find_converted(t, span))) {
      *how = Placement::SharedConverted;
      return p;
    }
    p.copy = convert_to_host(t, *narrow, options_.store_format, options_.pool, options_.side_stream, counters_,
                             refused, &current, options_.measure_error ? store_errors_.get() : nullptr);
    if (p.copy && prefetcher_) p.copy->staged()->set_order(prefetcher_, prefetcher_->add(p.copy->staged()));
    *how = Placement::Converted;
    return p;
  }
  if (options_.batch_below > 0 && span.bytes() < options_.batch_below) {
    *how = Placement::Batched;
    p.storage = batch(t, span, current);
    return p;
  }
  p.storage = copy_to_host(t, options_.pool, options_.side_stream, counters_, refused, &current, wide.lo, wide.hi);
  *how = Placement::Single;
  p.prefetch = p.storage && prefetcher_;
  return p;
}

void Packer::remember(const at::Tensor& t, const Span& span, const Span& wide, const Placed& placed,
                      Placement how) {
  std::lock_guard<std::mutex> lock(mu_);
  if (how == Placement::Converted) {
    ConvertedGroup g;
    g.copy = placed.copy;
    g.version = span.version;
    g.lo = span.lo;
    g.hi = span.hi;
    g.dtype = t.scalar_type();
    g.dense = t.is_non_overlapping_and_dense();
    if (!g.dense) {
      g.sizes = t.sizes().vec();
      g.strides = t.strides().vec();
    }
    converted_.add(t, std::move(g));
    return;
  }
  // A batch member's copy is its span, and cannot grow; a copy of its own is the widened span.
  const bool own = how == Placement::Single;
  DedupGroup g;
  g.offloaded = placed.storage;
  g.version = span.version;
  g.lo = own ? wide.lo : span.lo;
  g.hi = own ? wide.hi : span.hi;
  g.extendable = own;
  g.counted = span.bytes();
  dedup_.add(t, std::move(g));
}

py::object Packer::refuse(const at::Tensor& t, TieredRefusal why, int64_t bytes) {
  if (options_.raise_on_full) throw PoolFull(full_message(why, *options_.pool, t, bytes));
  return keep(t, why == TieredRefusal::DiskFull ? KeepReason::DiskFull : KeepReason::PoolFull, bytes);
}

py::object Packer::pack(py::handle obj) {
  PyObject* o = obj.ptr();
  if (!THPVariable_Check(o)) return py::reinterpret_borrow<py::object>(obj);
  const at::Tensor& t = THPVariable_Unpack(o);
  Span span;
  int64_t keep_bytes = 0;
  std::optional<CurrentStream> current;
  if (auto why = classify(o, t, &span, &keep_bytes, &current)) {
    if (*why == KeepReason::Subclass)
      if (py::object d = pack_dtensor(obj, t, keep_bytes)) return d;
    return keep(t, *why, keep_bytes);
  }
  // Note [One copy per storage]: the span widened to the 512-byte cells of its storage.
  Span wide = span;
  wide.lo = span.lo / static_cast<int64_t>(kAlignment) * static_cast<int64_t>(kAlignment);
  wide.hi = std::min(static_cast<int64_t>(round_up(static_cast<size_t>(span.hi), kAlignment)),
                     static_cast<int64_t>(t.storage().nbytes()));
  Placement how = Placement::Single;
  TieredRefusal refused = TieredRefusal::None;
  Placed placed = place(t, span, wide, *current, &how, &refused);
  if (!placed.storage && !placed.copy) return refuse(t, refused, span.bytes());
  const bool shared = how == Placement::Duplicate || how == Placement::Joined || how == Placement::SharedConverted;
  if (shared) {
    counters_->tensors_deduplicated++;
    counters_->bytes_deduplicated += span.bytes();
  } else {
    counters_->tensors_offloaded++;
    counters_->bytes_offloaded += span.bytes();
    counters_->bytes_stored += placed.copy ? placed.copy->stored_nbytes() : span.bytes();
    if (how == Placement::Converted) counters_->tensors_converted++;
    remember(t, span, wide, placed, how);
  }
  // A joined copy copied the missing cells; a duplicate copied nothing.
  if (how != Placement::Duplicate && how != Placement::SharedConverted) {
    sample_memory(options_.pool.get(), t.device());
    counters_->note_device_peak();
  }
  if (placed.copy) return make_saved(t, std::move(placed.copy), counters_);
  std::shared_ptr<OffloadedStorage> storage = placed.prefetch ? placed.storage : nullptr;
  py::object out = make_saved(t, std::move(placed.storage), counters_);
  // After the link: the prefetcher reads the bytes a saved tensor still has to unpack.
  if (storage) storage->set_order(prefetcher_, prefetcher_->add(storage));
  return out;
}

at::Tensor Packer::unpack(py::handle obj) {
  if (Py_TYPE(obj.ptr()) == saved_dtensor_type()) {  // Note [DTensor activations]
    auto* d = reinterpret_cast<SavedDTensorObject*>(obj.ptr());
    d->outer.check();
    at::Tensor local = unpack(py::handle(d->local));
    py::object local_obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(local)));
    // autograd gives the unpacked tensor its grad_fn or requires_grad itself.
    py::object dt = py::handle(dtensor_class())(local_obj, py::handle(d->spec), py::arg("requires_grad") = false);
    return THPVariable_Unpack(dt.ptr());
  }
  if (Py_TYPE(obj.ptr()) != saved_type()) {  // Note [Saved activation objects]
    if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr());
    throw py::type_error("ckpt_offload: unpack got an object that ckpt_offload did not pack");
  }
  SavedTensor& saved = reinterpret_cast<SavedObject*>(obj.ptr())->saved;
  // A tensor modified in place after it was saved raises here, before this backward has a
  // callback queued or anything of the saved tensor is touched: the raising unpack leaves the
  // state as it found it (the graph is torn down later, maybe on autograd's device thread).
  if (saved.version().modified() && sac_allows_mutation())
    saved.version().accept_modification();  // Note [Selective checkpoint cache mutation]
  saved.check_version();
  const int task = torch::autograd::get_current_graph_task_id();
  if (task >= 0 && last_graph_task_.load(std::memory_order_relaxed) != task &&
      last_graph_task_.exchange(task) != task) {
    // Once per backward: what this backward leaves behind is released when it ends, not when
    // its graph dies or the next forward offloads.
    torch::autograd::Engine::get_default_engine().queue_callback(
        [prefetcher = prefetcher_, pool = options_.pool] { end_of_backward(prefetcher, pool); });
  }
  at::Tensor out;
  try {
    out = saved.unpack();
  } catch (const DeviceCopyModified&) {
    // Note [One version per device copy]: the device copy this unpack shares was written since
    // it was made; only SAC's cache with allow_cache_entry_mutation takes it as it is now (Note
    // [Selective checkpoint cache mutation]). Nothing changed before the raise: unpack again.
    if (!sac_allows_mutation()) throw;
    out = saved.unpack(/*accept_modified=*/true);
  }
  counters_->note_device_peak();
  return out;
}

void Packer::end_of_backward(const std::shared_ptr<Prefetcher>& prefetcher, const std::shared_ptr<HostPool>& pool) {
  if (prefetcher) prefetcher->drop_unused();
  engine().poll();
  if (pool) pool->release_retired();
}

py::dict Packer::stats() const {
  // Note [Stats table]: the keys in stats_keys()'s order, counters from the table.
  const PackerCounters& c = *counters_;
  py::dict d;
#define CKPT_OFFLOAD_COUNTER_STAT(key, merge) d[#key] = c.key.load();
  CKPT_OFFLOAD_COUNTERS(CKPT_OFFLOAD_COUNTER_STAT)
#undef CKPT_OFFLOAD_COUNTER_STAT
  py::dict kept_by_reason, kept_bytes_by_reason;
  int64_t kept = 0, kept_bytes = 0;
  for (int r = 0; r < static_cast<int>(KeepReason::kCount); ++r) {
    const int64_t n = c.kept_tensors[r].load();
    const int64_t b = c.kept_bytes[r].load();
    kept += n;
    kept_bytes += b;
    {  // every reason, zeros included: callers index it without .get()
      kept_by_reason[keep_reason_name(static_cast<KeepReason>(r))] = n;
      kept_bytes_by_reason[keep_reason_name(static_cast<KeepReason>(r))] = b;
    }
  }
  d[stat_keys::tensors_kept] = kept;
  d[stat_keys::bytes_kept] = kept_bytes;
  d[stat_keys::kept_by_reason] = kept_by_reason;
  d[stat_keys::kept_bytes_by_reason] = kept_bytes_by_reason;
  // The window backward used last (Note [Prefetch window]); 0 without prefetch.
  d[stat_keys::prefetch_window_bytes] = prefetcher_ ? (prefetcher_->auto_window() ? prefetcher_->window() : options_.prefetch_bytes) : 0;
  d[stat_keys::prefetch_block_bytes] = prefetcher_ ? prefetcher_->block_bytes() : 0;
  d[stat_keys::prefetch_lead] = prefetcher_ ? prefetcher_->lead() : 0;
  d[stat_keys::store_dtype] = options_.store_format == lowp::Format::None ? py::object(py::none())
                                                                 : py::object(py::str(store_format_name(options_.store_format)));
  d[stat_keys::store_error] = store_errors_->to_dict();
  return d;
}

}  // namespace ckpt_offload

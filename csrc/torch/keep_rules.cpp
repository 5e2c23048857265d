// Why a saved tensor is kept for what it is (keep_rules.h).
#include "keep_rules.h"

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>

#include "torch_internals.h"

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
//    module of each nn.Module._call_impl frame on the Python stack (KeepRules::leaf_owner). A
//    buffer used outside the forward of the module that owns it (or of one of its ancestors) is
//    not recognised and is offloaded like an activation: a copy, not a wrong gradient. Non-leaf
//    activations, the bulk of what autograd saves, never reach this lookup.
//  - under torch.autocast, a cast of a parameter that autocast's weight cache holds for the
//    region (`weight.to(bf16)` of an fp32 Parameter that requires grad: the cache's own rule,
//    at::autocast::cached_cast, for parameters) is kept as "autocast_cast": the cache keeps it
//    alive anyway. Frozen weights' casts are not cached (made afresh by every op): offloaded.
namespace {

// How many Python frames leaf_owner looks through: deep enough for nested modules
// (each adds ~2 frames: _call_impl and forward), bounded so that a deep stack costs little;
// and how many running modules it reads at most.
constexpr int kMaxFrames = 96;
constexpr int kMaxModules = 48;

// True when `target` is the storage of a tensor in a module's `_parameters` (or `_buffers`) dict.
bool scan_state(PyObject* module, bool buffers, PyObject* dtensor, const void* target) {
  PyObject* dict = module_state(module, buffers);
  if (!dict) return false;
  bool hit = false;
  if (PyDict_Check(dict)) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (!hit && PyDict_Next(dict, &pos, &key, &value)) {
      if (value == Py_None || !THPVariable_Check(value)) continue;
      // A DTensor parameter's storage is its local tensor's (Note [DTensor activations]).
      PyObject* local = nullptr;
      if (dtensor && Py_TYPE(value) == reinterpret_cast<PyTypeObject*>(dtensor)) {
        local = dtensor_local(value);
        if (!local || !THPVariable_Check(local)) {
          Py_XDECREF(local);
          continue;
        }
        value = local;
      }
      const at::Tensor& v = THPVariable_Unpack(value);
      if (v.has_storage() && !v.key_set().has(c10::DispatchKey::Python))
        hit = v.storage().unsafeGetStorageImpl() == target;
      Py_XDECREF(local);
    }
  }
  Py_DECREF(dict);
  return hit;
}

}  // namespace

std::optional<KeepReason> KeepRules::leaf_owner(const at::Tensor& t, const at::TensorBase& root) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (&root != static_cast<const at::TensorBase*>(&t)) {
    PyObject* base_obj = THPVariable_Wrap(root);
    const bool param_base = base_obj && is_parameter(base_obj);
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
  // The modules whose forward is running: `self` of the _call_impl frames on this thread's
  // stack, innermost first (Note [Reading the Python stack]).
  PyObject* modules[kMaxModules];
  const int n = running_modules(kMaxFrames, modules, kMaxModules);
  PyObject* dtensor = dtensor_class();
  std::optional<KeepReason> found;
  for (int i = 0; i < n; ++i) {
    PyObject* self = modules[i];
    if (!found) {
      if (scan_state(self, /*buffers=*/false, dtensor, storage))
        found = KeepReason::Parameter;
      else if (scan_state(self, /*buffers=*/true, dtensor, storage))
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

void KeepRules::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  parameter_storages_.clear();
  buffer_storages_.clear();
}

// `root` is what autocast's weight cache holds for a parameter: a cast (`_to_copy`) to the
// region's low precision of an fp32 leaf that requires grad and is no view (the cache's rule,
// at::autocast::cached_cast), here an nn.Parameter.
bool KeepRules::is_autocast_weight_cast(const at::TensorBase& root) {
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
  const bool parameter = obj && is_parameter(obj);
  Py_XDECREF(obj);
  return parameter;
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
bool KeepRules::not_the_saving_node(const at::Tensor& t) {
  const torch::autograd::AutogradMeta* meta = torch::autograd::impl::get_autograd_meta(t);
  const torch::autograd::Node* fn = meta ? meta->grad_fn_.get() : nullptr;  // the field: no view regeneration
  if (!fn) return true;
  const uint64_t next = at::sequence_number::peek();
  return next > 0 && fn->sequence_nr() < next - 1;
}

}  // namespace ckpt_offload

// Why a saved tensor stays where it is for what it is, not for how big or where it is: a
// parameter, a buffer or a view of one (Note [Parameters and buffers]), autocast's cached cast of
// a parameter, and how such a tensor is held (Note [Kept as it is]). Packer::classify asks these
// in its order; the size, device and layout rules are its own.
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <mutex>
#include <optional>
#include <vector>

#include "counters.h"

namespace ckpt_offload {

class KeepRules {
 public:
  // Note [Parameters and buffers]: why a tensor whose view root `root` is a leaf is kept
  // (Parameter, Buffer), or none. Remembers the storages it found until clear().
  std::optional<KeepReason> leaf_owner(const at::Tensor& t, const at::TensorBase& root);
  // Forgets the storages leaf_owner found: each activation of the context starts afresh.
  void clear();

  // An nn.Parameter (or a subclass of it).
  static bool is_parameter(PyObject* obj) {
    return PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(ParameterClass));
  }
  // Note [Parameters and buffers]: `root`, the view root of a non-leaf saved tensor, is what
  // autocast's weight cache holds for a parameter. Cheap tests first: a low-precision float
  // inside a torch.autocast region.
  static bool autocast_cast(const at::TensorBase& root) {
    return c10::isReducedFloatingType(root.scalar_type()) && autocast_region_active() && is_autocast_weight_cast(root);
  }
  // Note [Kept as it is]: a tensor kept for `why` is held as it is, not through a detached alias.
  // The reason first (inline: every kept tensor asks).
  static bool held_as_it_is(const at::Tensor& t, KeepReason why) {
    return (why == KeepReason::Parameter || why == KeepReason::Buffer || why == KeepReason::AutocastCast) &&
           not_the_saving_node(t);
  }

 private:
  // True inside a torch.autocast region (whose weight cache is then live): torch.autocast's
  // __enter__ increments a per-thread nesting count and its __exit__ decrements it, clearing the
  // cache at zero. There is no getter; increment and decrement each return the new count and
  // leave it as it was. Not at::autocast::is_autocast_enabled: pack runs inside autocast's
  // kernel, which excludes autocast's dispatch key (what that function reads) while it runs the op.
  static bool autocast_region_active() {
    const int n = at::autocast::increment_nesting();
    at::autocast::decrement_nesting();
    return n > 1;
  }
  static bool is_autocast_weight_cast(const at::TensorBase& root);
  // held_as_it_is's test past the reason: t is a leaf, or its grad_fn is not the saving node.
  static bool not_the_saving_node(const at::Tensor& t);

  // Storages leaf_owner found to be a running module's parameter or buffer this activation
  // (only ever positives: a miss is looked up again; a few at most, searched in order). A leaf
  // lock: nothing is taken under it (Note [Lock order]).
  std::mutex mu_;
  std::vector<const void*> parameter_storages_, buffer_storages_;
};

}  // namespace ckpt_offload

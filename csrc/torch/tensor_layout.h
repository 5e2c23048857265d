// Pure helpers about a tensor's layout and how it is named in messages: no state, no streams.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../core/host_pool.h"
#include "../core/spill.h"

namespace ckpt_offload {

// Layouts whose bytes are not plain strided memory, or whose flags a raw copy would drop.
bool unsupported_layout(const at::Tensor& t);
// True for a tensor with no bytes of its own to copy: a ZeroTensor, no storage, a null data
// pointer, or a storage smaller than the tensor's span. Note [Tensors without data].
bool without_data(const at::Tensor& t);
// Wrapper tensors (functorch, functionalization, __torch_dispatch__ subclasses) have a
// storage that is not theirs to copy.
bool wrapped_tensor(const at::Tensor& t);
// Note [Span of a tensor]
// The bytes a saved tensor is copied as: the span of its storage from its first element to its
// last, extent_elements(t) * itemsize bytes from byte storage_offset * itemsize -- its own
// elements and whatever lies between them (a transpose, a slice with steps), nothing before or
// after. An expanded tensor (stride 0) reaches only its source's elements, so it does not grow
// on the host. torch has no negative strides (as_strided and set_ refuse them), so the first
// element is the lowest and the rule needs no abs(). Defined here once; Python reads it as
// _C.span_bytes (the planner's costs, the demo's counts) instead of writing it again.
int64_t extent_elements(const at::Tensor& t);

// The three below are what Packer::classify asks of every saved tensor, inline here.
inline const c10::DispatchKeySet& wrapper_keys() {  // wrapped_tensor's
  static const c10::DispatchKeySet keys({c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                         c10::DispatchKey::Functionalize, c10::DispatchKey::Python,
                                         c10::DispatchKey::BatchedNestedTensor});
  return keys;
}
// Neither wrapped_tensor, nor unsupported_layout, nor a ZeroTensor, told in one key-set test.
inline bool plain_strided(const c10::TensorImpl& t) {
  static const c10::DispatchKeySet unusual =
      wrapper_keys() |
      c10::DispatchKeySet({c10::DispatchKey::Conjugate, c10::DispatchKey::Negative, c10::DispatchKey::ZeroTensor,
                           c10::DispatchKey::NestedTensor, c10::DispatchKey::Quantized, c10::DispatchKey::Sparse,
                           c10::DispatchKey::SparseCsr});
  return !t.key_set().has_any(unusual) && t.layout() == c10::kStrided && !t.is_mkldnn() && !t.is_meta();
}
inline int64_t extent_elements(const c10::TensorImpl& t) {
  if (t.numel() == 0) return 0;
  const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
  int64_t extent = 1;
  for (size_t d = 0; d < sizes.size(); ++d) extent += (sizes[d] - 1) * strides[d];
  return extent;
}
// without_data's test past the ZeroTensor one: no storage, or a span of `extent` elements (its
// extent_elements) whose data pointer is null or that reaches past the storage's bytes.
inline bool storage_lacks_span(const c10::TensorImpl& t, int64_t extent) {
  if (!t.has_storage()) return true;
  if (extent == 0) return false;  // nothing to read: an empty tensor may have a null pointer
  const c10::Storage& st = t.storage();
  return st.data() == nullptr ||
         static_cast<size_t>((t.storage_offset() + extent) * static_cast<int64_t>(t.dtype().itemsize())) > st.nbytes();
}
// The profiler's device number: the CUDA index, -1 for CPU.
int device_index(const c10::Device& d);
// torch's Python names ("float32", "bfloat16"), which is what users read in traces and CSVs.
std::string dtype_name(c10::ScalarType t);
std::string human_bytes(size_t bytes);
// torch's names ("torch.strided", "torch.sparse_coo"), without c10's stream operator
// (Note [No iostreams in the extension], csrc/core/text.h).
std::string layout_name(c10::Layout layout);
// "[float32 on cuda:0, shape [2, 3]]"
std::string describe(c10::ScalarType dtype, const std::vector<int64_t>& sizes, const c10::Device& device);
// Autograd's in-place error for a saved tensor (described as `dtype`, `sizes`, `device`) whose
// version is `now` where `expected` was saved (SavedVariable::unpack's wording, so that what
// catches torch's error catches ours), then why ckpt_offload saw it (`why`) and the fix (`hint`).
std::string inplace_message(c10::ScalarType dtype, c10::IntArrayRef sizes, const c10::Device& device, uint32_t now,
                            uint32_t expected, const char* why, const char* hint);
// Raised when the pool (and its disk tier) cannot hold a copy and the caller asked for an error
// (on_full="raise", co.offload_tensor): PoolFullError in Python. Its message is the facts (what
// was asked for, what the pool holds), then the remedies; the two are kept apart (PoolFullError's
// `facts` and `remedies`), so that a caller with remedies of its own words them instead of
// parsing the message.
class PoolFull : public std::runtime_error {
 public:
  PoolFull(std::string facts, std::string remedies)
      : std::runtime_error(facts + ". " + remedies), facts_(std::move(facts)), remedies_(std::move(remedies)) {}
  const std::string& facts() const { return facts_; }
  const std::string& remedies() const { return remedies_; }

 private:
  std::string facts_, remedies_;
};
// How messages name a saved tensor: "a saved tensor [float32 on cpu, shape [2, 3]]".
std::string saved_tensor_name(const at::Tensor& t);
// The facts of a refused copy of `span` bytes for `what`: the pool is full (why ==
// TieredRefusal::PoolFull), or its disk tier refused too (DiskFull: spill_max_bytes, or a full
// disk), with what each holds.
std::string full_facts(TieredRefusal why, HostPool& pool, const std::string& what, int64_t span);
// PoolFull with those facts and co.offload's remedies (a larger cap, less offloaded, on_full="keep").
PoolFull pool_full(TieredRefusal why, HostPool& pool, const std::string& what, int64_t span);

}  // namespace ckpt_offload

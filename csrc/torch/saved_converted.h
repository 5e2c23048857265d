// Note [Saved tensor kinds]: the Converted kind -- a view of a narrow host copy of a span
// (Note [Low-precision storage], store_dtype.h) -- made and unpacked.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>

#include "../core/host_pool.h"
#include "../core/low_precision.h"
#include "counters.h"
#include "runtime.h"
#include "saved_tensor.h"
#include "store_dtype.h"

namespace ckpt_offload {

// The narrow host copy of one span of a storage, shared by every saved tensor that is that
// span: the same storage, first byte, extent, dtype and version. Its up-converted reload is
// shared too: one conversion back, one full-width device storage.
class ConvertedCopy {
 public:
  ConvertedCopy(SavedTensor stored, lowp::Format f, lowp::Source s, c10::ScalarType dtype, c10::Device device,
                int64_t lo, int64_t elems)
      : stored_(std::move(stored)), format_(f), source_(s), dtype_(dtype), device_(device), lo_(lo), elems_(elems) {}
  // A saved tensor over this copy was made / unpacked for the first time or died before that.
  void link();
  void unlink();
  // A tensor with `sizes` and `strides` over the full-width storage (shared while one is alive,
  // or kept for the saved tensors that have not unpacked yet), starting at the span's first
  // element. Tensors over one storage share its version counter, checked when it is shared (Note
  // [One version per device copy]: DeviceCopyModified unless `accept_modified`). `*fresh_bytes`:
  // device bytes this call converted back (0 when shared). `first`: the caller's first unpack.
  at::Tensor materialize(bool first, c10::IntArrayRef sizes, c10::IntArrayRef strides, bool accept_modified,
                         int64_t* fresh_bytes);
  // The exact host copy of the staging bytes.
  const std::shared_ptr<OffloadedStorage>& staged() const { return *stored_.storage(); }
  int64_t stored_nbytes() const { return stored_.nbytes(); }

 private:
  SavedTensor stored_;  // the staging bytes, offloaded exactly (an Offloaded one)
  lowp::Format format_;
  lowp::Source source_;
  c10::ScalarType dtype_;
  c10::Device device_;
  int64_t lo_, elems_;
  // Taken around a reload and its conversion, before the inner storage's locks (Note [Lock order]).
  std::mutex mu_;
  int pending_ = 0;  // saved tensors over this copy that have not unpacked yet
  c10::weak_intrusive_ptr<c10::StorageImpl> reloaded_{c10::intrusive_ptr<c10::StorageImpl>()};
  c10::Storage held_;  // the reload, kept while pending_ > 0
  std::shared_ptr<Event> ready_;  // the conversion back of reloaded_ (on a device)
  DeviceCopyVersion version_;     // of reloaded_ (Note [One version per device copy])
};

// t (of kind s) converted to format f into a staging tensor, which copy_to_host copies: the
// narrow copy of t's span, or null when the pool (and its disk tier) refused it (`why` says
// which). `errors`: where the error is added, with measure_error (else null).
std::shared_ptr<ConvertedCopy> convert_to_host(const at::Tensor& t, lowp::Source s, lowp::Format f,
                                               const std::shared_ptr<HostPool>& pool, bool side_stream,
                                               const std::shared_ptr<PackerCounters>& counters, TieredRefusal* why,
                                               const CurrentStream* current, StoreErrors* errors);

}  // namespace ckpt_offload

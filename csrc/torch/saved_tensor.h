// What pack returns to autograd for one saved tensor, and the standalone co.offload_tensor.
#pragma once

#include <ATen/ATen.h>
#include <ATen/DimVector.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "../core/host_pool.h"
#include "counters.h"
#include "device_bytes.h"
#include "offloaded_storage.h"
#include "runtime.h"
#include "store_dtype.h"

namespace ckpt_offload {

class SavedTensor;

// The narrow host copy of one span of a storage (Note [Low-precision storage]), shared by every
// saved tensor that is that span: the same storage, first byte, extent, dtype and version. Its
// up-converted reload is shared too: one conversion back, one full-width device storage.
class ConvertedCopy {
 public:
  ConvertedCopy(std::shared_ptr<SavedTensor> stored, lowp::Format f, lowp::Source s, c10::ScalarType dtype,
                c10::Device device, int64_t lo, int64_t elems)
      : stored_(std::move(stored)), format_(f), source_(s), dtype_(dtype), device_(device), lo_(lo), elems_(elems) {}
  // A saved tensor over this copy was made / unpacked for the first time or died before that.
  void link();
  void unlink();
  // The full-width storage (shared while one is alive, or kept for the saved tensors that have
  // not unpacked yet) and the element offset of the span's first element in it. `*fresh_bytes`:
  // device bytes this call converted back (0 when shared). `first`: the caller's first unpack.
  c10::Storage materialize(bool first, int64_t* offset, int64_t* fresh_bytes);
  const std::shared_ptr<SavedTensor>& stored() const { return stored_; }
  int64_t stored_nbytes() const;

 private:
  std::shared_ptr<SavedTensor> stored_;  // the staging bytes, offloaded exactly
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
};

// What pack returns to autograd. Holds no reference to the graph (no grad_fn, no original
// tensor of an output), so a dropped graph frees it and its pool block.
class SavedTensor {
 public:
  // Copies t's bytes (the span of its storage it reaches) into `pool` (or, at its cap, through
  // its disk tier: Note [Spilling offloaded blocks]), keeping its layout. Returns nullptr when
  // neither can take them; `why` (optional) then says which refused.
  // `from`, `to` (bytes of t's storage, covering t's span; -1: t's span): what to copy
  // (Note [One copy per storage]).
  static std::shared_ptr<SavedTensor> offload(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                              bool side_stream, std::shared_ptr<PackerCounters> counters,
                                              TieredRefusal* why = nullptr, const CurrentStream* current = nullptr,
                                              int64_t from = -1, int64_t to = -1);
  ~SavedTensor();
  // A SavedTensor with t's layout and version filled in, holding nothing yet.
  static std::shared_ptr<SavedTensor> describe_layout(const at::Tensor& t, std::shared_ptr<PackerCounters> counters);
  // A SavedTensor with only t's version filled in: enough for one kept as an alias (`kept_`
  // has the layout), and cheaper on the hot path than describe_layout.
  static std::shared_ptr<SavedTensor> describe_version(const at::Tensor& t, std::shared_ptr<PackerCounters> counters);
  // Note [Low-precision storage]: t (kind s) stored in format f, through a staging tensor that
  // offload() copies. `errors`: where the error is added, with measure_error (else null).
  static std::shared_ptr<SavedTensor> offload_converted(const at::Tensor& t, lowp::Source s, lowp::Format f,
                                                        const std::shared_ptr<HostPool>& pool, bool side_stream,
                                                        std::shared_ptr<PackerCounters> counters, TieredRefusal* why,
                                                        const CurrentStream* current, StoreErrors* errors);
  // A saved tensor t whose span is that of `copy` (Note [Low-precision storage]): shares it.
  static std::shared_ptr<SavedTensor> share_converted(const at::Tensor& t, std::shared_ptr<ConvertedCopy> copy,
                                                      bool side_stream, std::shared_ptr<PackerCounters> counters);
  at::Tensor unpack();
  bool offloaded() const { return storage_ != nullptr || converted_ != nullptr; }
  // Bytes held on the host for this tensor: the narrow ones when converted.
  int64_t stored_nbytes() const { return converted_ ? converted_->stored_nbytes() : nbytes_; }
  const c10::Device& device() const { return device_; }
  int64_t nbytes() const { return nbytes_; }

 private:
  friend class Packer;
  void check_version() const;

  at::Tensor kept_;                            // when kept: a detached alias
  std::shared_ptr<OffloadedStorage> storage_;  // when offloaded
  bool side_stream_ = true;
  c10::ScalarType dtype_ = c10::kFloat;
  c10::Device device_{c10::kCPU};
  // Inline up to 5 dimensions: no heap allocation per saved tensor for the usual ranks.
  at::DimVector sizes_, strides_;
  // t's first byte in its original storage; its element offset in the reloaded storage is
  // (lo_ - storage_->base()) / itemsize, read at unpack (the copy may grow until then).
  int64_t lo_ = 0;
  int64_t nbytes_ = 0;
  c10::VariableVersion version_;  // shares the counter, not the tensor
  uint32_t saved_version_ = 0;
  std::shared_ptr<PackerCounters> counters_;
  DeviceBytesHeld device_held_;  // this tensor's device bytes in the memory timeline
  bool unpacked_ = false;
  // When stored narrower (Note [Low-precision storage]): the narrow copy of this tensor's span,
  // maybe shared with other saved tensors that are the same span.
  at::Tensor unpack_converted();
  std::shared_ptr<ConvertedCopy> converted_;
};

// Copies bytes [from, to) of t's storage into `pool` (or its disk tier), in t's device's stream
// order (`current`, or read here). Null when neither can take them; `why` says which refused.
std::shared_ptr<TieredBuffer> offload_bytes(const at::Tensor& t, int64_t from, int64_t to,
                                            const std::shared_ptr<HostPool>& pool, bool side_stream,
                                            const CurrentStream* current, uint64_t handle, TieredRefusal* why);

// The standalone engine entry point (co.offload_tensor): validates, offloads, raises PoolFull.
std::shared_ptr<SavedTensor> offload_tensor(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                            bool side_stream);

}  // namespace ckpt_offload

// What pack returns to autograd for one saved tensor, and the standalone co.offload_tensor.
#pragma once

#include <ATen/ATen.h>
#include <ATen/DimVector.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "../core/host_pool.h"
#include "counters.h"
#include "device_bytes.h"
#include "offloaded_storage.h"
#include "runtime.h"
#include "store_dtype.h"

namespace ckpt_offload {

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
  at::Tensor unpack();
  bool offloaded() const { return storage_ != nullptr || stored_ != nullptr; }
  // Bytes held on the host for this tensor: the narrow ones when converted.
  int64_t stored_nbytes() const { return stored_ ? stored_->nbytes() : nbytes_; }
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
  // When stored narrower (Note [Low-precision storage]): the offloaded staging bytes, and how
  // to convert them back into store_elems_ elements of a new storage (aligned as lo_ was).
  at::Tensor unpack_converted();
  std::shared_ptr<SavedTensor> stored_;
  lowp::Format store_format_ = lowp::Format::None;
  lowp::Source store_source_ = lowp::Source::F32;
  int64_t store_elems_ = 0;
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

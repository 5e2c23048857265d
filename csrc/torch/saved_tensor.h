// What pack returns to autograd for one saved tensor, and the standalone co.offload_tensor.
#pragma once

#include <ATen/ATen.h>
#include <ATen/DimVector.h>

#include <cstdint>
#include <memory>
#include <variant>

#include "../core/host_pool.h"
#include "counters.h"
#include "device_bytes.h"
#include "offloaded_storage.h"
#include "runtime.h"

namespace ckpt_offload {

class ConvertedCopy;  // saved_converted.h

// Note [Saved tensor kinds]
// A SavedTensor is what every kind of saved tensor shares -- the tensor's dtype, device, sizes,
// strides and first byte, its version when saved, the counters of the context that packed it,
// its device bytes in the memory timeline -- and one of three holders of its bytes:
//  - Kept: a detached alias of the tensor itself, on its device (Packer::classify says why, as
//    a KeepReason; a refused copy is kept too). Unpack returns the alias. Here.
//  - Offloaded: a view of an exact host copy, an OffloadedStorage (offloaded_storage.h) that
//    other views of the same storage may share (Note [One copy per storage]) or that lives in a
//    batch. Made and unpacked in saved_offloaded.cpp.
//  - Converted: a view of a narrow host copy, a ConvertedCopy (saved_converted.h), maybe shared
//    with saved tensors of the same span (Note [Low-precision storage]). Made and unpacked in
//    saved_converted.cpp.
// Packer::pack (packer.cpp) decides the kind once per tensor (classify, then place) and makes
// it; SavedTensor::unpack dispatches on it once. The Python object autograd holds embeds the
// SavedTensor (Note [Saved activation objects]): no allocation of its own per saved tensor.

// A saved tensor's version counter and its value at pack: unpack refuses a tensor modified in
// place since (autograd does not check saved tensors that went through hooks).
class SavedVersion {
 public:
  SavedVersion() = default;
  explicit SavedVersion(const at::Tensor& t);
  bool modified() const { return version_.enabled() && version_.current_version() != saved_; }
  // Takes the tensor's current version as its saved one (Note [Selective checkpoint cache mutation]).
  void accept_modification() { saved_ = version_.current_version(); }
  // Raises autograd's error, naming the tensor as `dtype`, `sizes`, `device`, when modified().
  void check(c10::ScalarType dtype, c10::IntArrayRef sizes, const c10::Device& device) const;

 private:
  c10::VariableVersion version_;  // shares the counter, not the tensor; disabled: never modified
  uint32_t saved_ = 0;
};

class SavedTensor {
 public:
  struct Kept {
    at::Tensor alias;  // detached: no grad_fn, so an output saved by its own node forms no cycle
  };
  struct Offloaded {
    std::shared_ptr<OffloadedStorage> storage;
  };
  struct Converted {
    std::shared_ptr<ConvertedCopy> copy;
  };
  using Bytes = std::variant<Kept, Offloaded, Converted>;

  // t kept as `alias`: `nbytes` counted for it, `device_bytes` of them in the memory timeline
  // (0 for a parameter's or buffer's: those live across the step anyway).
  struct KeptTag {};
  SavedTensor(KeptTag, const at::Tensor& t, at::Tensor alias, int64_t nbytes, int64_t device_bytes,
              std::shared_ptr<PackerCounters> counters);
  // t, a view of `storage` / `copy`: one more saved tensor over it to unpack (linked).
  SavedTensor(const at::Tensor& t, std::shared_ptr<OffloadedStorage> storage, std::shared_ptr<PackerCounters> counters);
  SavedTensor(const at::Tensor& t, std::shared_ptr<ConvertedCopy> copy, std::shared_ptr<PackerCounters> counters);

  SavedTensor(SavedTensor&&) noexcept = default;
  SavedTensor& operator=(SavedTensor&&) = delete;
  SavedTensor(const SavedTensor&) = delete;
  ~SavedTensor();

  // The tensor again (raises if it was modified in place since pack, or if the device copy it
  // shares with other unpacks was: DeviceCopyModified, unless `accept_modified`), by its kind.
  at::Tensor unpack(bool accept_modified = false);
  void check_version() const;
  SavedVersion& version() { return version_; }
  bool offloaded() const { return !std::holds_alternative<Kept>(bytes_); }
  // The exact host copy of an Offloaded one, else null.
  const std::shared_ptr<OffloadedStorage>* storage() const {
    const auto* o = std::get_if<Offloaded>(&bytes_);
    return o ? &o->storage : nullptr;
  }
  // The narrow host copy of a Converted one, else null.
  const std::shared_ptr<ConvertedCopy>* copy() const {
    const auto* c = std::get_if<Converted>(&bytes_);
    return c ? &c->copy : nullptr;
  }
  // Bytes held on the host for this tensor: the narrow ones when converted.
  int64_t stored_nbytes() const;
  const c10::Device& device() const { return device_; }
  int64_t nbytes() const { return nbytes_; }
  // A tensor selective checkpointing caches: its unpack never gets (or leaves) the tensor object
  // another unpack made (Note [Same view, same tensor]).
  void set_distinct() { distinct_ = true; }

 private:
  // t's dtype, device and version; with `layout`, its sizes, strides, first byte and extent
  // (a Kept one rebuilds nothing: its alias has them).
  SavedTensor(const at::Tensor& t, bool layout, std::shared_ptr<PackerCounters> counters, Bytes bytes);
  at::Tensor unpack_offloaded(Offloaded& o, bool accept_modified);  // saved_offloaded.cpp
  at::Tensor unpack_converted(Converted& c, bool accept_modified);  // saved_converted.cpp

  Bytes bytes_;
  SavedVersion version_;
  c10::ScalarType dtype_ = c10::kFloat;
  c10::Device device_{c10::kCPU};
  // Inline up to 5 dimensions: no heap allocation per saved tensor for the usual ranks.
  at::DimVector sizes_, strides_;
  // t's first byte in its original storage; its element offset in the reloaded storage is
  // (lo_ - storage->base()) / itemsize, read at unpack (the copy may grow until then).
  int64_t lo_ = 0;
  int64_t nbytes_ = 0;
  std::shared_ptr<PackerCounters> counters_;
  DeviceBytesHeld device_held_;  // this tensor's device bytes in the memory timeline
  bool unpacked_ = false;
  bool distinct_ = false;
};

// The Offloaded kind's copy (saved_offloaded.cpp). Copies bytes [from, to) of t's storage (-1:
// t's span) into `pool` (or, at its cap, through its disk tier: Note [Spilling offloaded
// blocks]), in t's device's stream order (`current`, or read here), as a host copy whose byte 0
// stands for byte `from` of t's storage. Null when neither can take them; `why` (optional) then
// says which refused.
std::shared_ptr<OffloadedStorage> copy_to_host(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                               bool side_stream, const std::shared_ptr<PackerCounters>& counters,
                                               TieredRefusal* why = nullptr, const CurrentStream* current = nullptr,
                                               int64_t from = -1, int64_t to = -1);

// The bytes [from, to) of t's storage as pool (or disk tier) buffers: copy_to_host's copy, and
// the missing pieces of a joined copy (Note [One copy per storage]).
std::shared_ptr<TieredBuffer> offload_bytes(const at::Tensor& t, int64_t from, int64_t to,
                                            const std::shared_ptr<HostPool>& pool, bool side_stream,
                                            const CurrentStream* current, uint64_t handle, TieredRefusal* why);

// The standalone engine entry point (co.offload_tensor): validates, offloads, raises PoolFull.
std::shared_ptr<SavedTensor> offload_tensor(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                            bool side_stream);

}  // namespace ckpt_offload

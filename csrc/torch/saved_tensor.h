// The saved-tensor hooks: pack decides keep / offload / deduplicate for each tensor autograd
// saves, unpack brings it back. This is the per-tensor hot path, hence C++.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <pybind11/pybind11.h>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "../core/copy_engine.h"
#include "../core/host_pool.h"

namespace ckpt_offload {

// Raised by pack when the pool is at its cap and on_full="raise".
class PoolFull : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Why a saved tensor stayed where it was.
enum class KeepReason : int { Parameter = 0, Buffer, TooSmall, Device, Layout, Subclass, PoolFull, GraphCapture, kCount };
const char* keep_reason_name(KeepReason r);

struct PackerOptions {
  int64_t min_bytes = 0;
  bool offload_cpu = false;
  bool offload_cuda = true;
  bool side_stream = true;
  bool raise_on_full = false;
  std::shared_ptr<HostPool> pool;
};

struct PackerCounters {
  std::atomic<int64_t> tensors_offloaded{0}, bytes_offloaded{0};
  std::atomic<int64_t> tensors_deduplicated{0}, bytes_deduplicated{0};
  std::atomic<int64_t> tensors_reloaded{0}, bytes_reloaded{0};
  std::atomic<int64_t> tensors_reload_shared{0};
  std::array<std::atomic<int64_t>, static_cast<int>(KeepReason::kCount)> kept_tensors{};
  std::array<std::atomic<int64_t>, static_cast<int>(KeepReason::kCount)> kept_bytes{};
};

// The host copy of one span of a storage, shared by every saved tensor that views it.
class OffloadedStorage {
 public:
  // `pad` bytes precede the span in a reloaded storage, so the data pointer keeps its original
  // alignment (mod kReloadAlignment): kernels choose code paths by alignment, and a different
  // path could change the result's bits.
  OffloadedStorage(std::shared_ptr<HostBuffer> buffer, c10::Device device, size_t pad)
      : buffer_(std::move(buffer)), device_(device), pad_(pad) {}
  static constexpr size_t kReloadAlignment = 512;
  // A device storage holding the bytes again. While one reloaded storage is alive, later
  // unpacks (other views, retain_graph, double backward) share it instead of copying again.
  c10::Storage materialize(bool side_stream, bool* shared);
  size_t nbytes() const { return buffer_->nbytes(); }
  size_t pad() const { return pad_; }

 private:
  std::shared_ptr<HostBuffer> buffer_;
  c10::Device device_;
  size_t pad_;
  std::mutex mu_;
  c10::weak_intrusive_ptr<c10::StorageImpl> reloaded_{c10::intrusive_ptr<c10::StorageImpl>()};
  std::shared_ptr<Event> reloaded_ready_;
};

// What pack returns to autograd. Holds no reference to the graph (no grad_fn, no original
// tensor of an output), so a dropped graph frees it and its pool block.
class SavedTensor {
 public:
  // Copies t's bytes (the span of its storage it reaches) into `pool`, keeping its layout.
  // Returns nullptr when the pool cannot provide the memory.
  static std::shared_ptr<SavedTensor> offload(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                              bool side_stream, std::shared_ptr<PackerCounters> counters);
  // A SavedTensor with t's layout and version filled in, holding nothing yet.
  static std::shared_ptr<SavedTensor> describe_layout(const at::Tensor& t, std::shared_ptr<PackerCounters> counters);
  at::Tensor unpack();
  bool offloaded() const { return storage_ != nullptr; }
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
  std::vector<int64_t> sizes_, strides_;
  int64_t offset_ = 0;  // in elements, from the start of the reloaded storage
  int64_t nbytes_ = 0;
  c10::VariableVersion version_;  // shares the counter, not the tensor
  uint32_t saved_version_ = 0;
  std::shared_ptr<PackerCounters> counters_;
};

// The standalone engine entry point (co.offload_tensor): validates, offloads, raises PoolFull.
std::shared_ptr<SavedTensor> offload_tensor(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                            bool side_stream);
std::string pool_full_message(HostPool& pool, const at::Tensor& t, int64_t span);

class Packer {
 public:
  explicit Packer(PackerOptions options);
  pybind11::object pack(pybind11::handle obj);
  at::Tensor unpack(pybind11::handle obj);
  // Records the storages of a module's own parameters and buffers (called from a forward
  // pre-hook), so views of them are never offloaded.
  void note_module_state(pybind11::handle parameters, pybind11::handle buffers);
  // Starts / ends an activation of the context. The deduplication table lives in between, or
  // across activations with keep_dedup (co.checkpoint: an input shared by every layer, such
  // as a rotary table or a mask, is stored once); its entries are weak either way.
  void begin();
  void end(bool keep_dedup);
  pybind11::dict stats() const;
  const PackerOptions& options() const { return options_; }

 private:
  pybind11::object keep(const at::Tensor& t, KeepReason why, int64_t nbytes);

  struct DedupEntry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
    std::weak_ptr<OffloadedStorage> offloaded;
    uint32_t version = 0;
    int64_t lo = 0, hi = 0;  // byte range of the storage held on the host
  };

  PackerOptions options_;
  std::shared_ptr<PackerCounters> counters_;
  std::mutex mu_;
  std::unordered_map<const void*, DedupEntry> dedup_;
  size_t prune_at_ = 1024;  // drop expired dedup entries when the table grows past this
  std::unordered_set<const void*> parameter_storages_, buffer_storages_;
};


}  // namespace ckpt_offload

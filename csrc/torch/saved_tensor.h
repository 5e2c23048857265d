// The saved-tensor hooks: pack decides keep / offload / deduplicate for each tensor autograd
// saves, unpack brings it back. This is the per-tensor hot path, hence C++.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <pybind11/pybind11.h>

#include <array>
#include <map>
#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "../core/copy_engine.h"
#include "../core/host_pool.h"
#include "../core/profiler.h"
#include "../core/spill.h"

namespace ckpt_offload {

// Raised by pack when the pool is at its cap and on_full="raise".
class PoolFull : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Why a saved tensor stayed where it was.
enum class KeepReason : int { Parameter = 0, Buffer, TooSmall, Device, Layout, Subclass, PoolFull, GraphCapture, DiskFull, kCount };
const char* keep_reason_name(KeepReason r);

struct PackerOptions {
  int64_t min_bytes = 0;
  bool offload_cpu = false;
  bool offload_cuda = true;
  bool side_stream = true;
  bool raise_on_full = false;
  // Backward reloads the next handles (reverse pack order) while this many bytes of reloads
  // wait unconsumed; 0 turns prefetch off. Only with side streams.
  int64_t prefetch_bytes = 0;
  // Tensors spanning fewer bytes than this (and at least min_bytes) are gathered into shared
  // blocks of about batch_bytes, copied once; 0 turns batching off.
  int64_t batch_below = 0;
  int64_t batch_bytes = 4 << 20;
  std::shared_ptr<HostPool> pool;
};

struct PackerCounters {
  std::atomic<int64_t> tensors_offloaded{0}, bytes_offloaded{0};
  std::atomic<int64_t> tensors_deduplicated{0}, bytes_deduplicated{0};
  std::atomic<int64_t> tensors_reloaded{0}, bytes_reloaded{0};
  std::atomic<int64_t> tensors_reload_shared{0};
  std::atomic<int64_t> tensors_batched{0}, batches{0};
  std::atomic<int64_t> prefetches{0}, bytes_prefetched{0}, prefetch_hits{0}, prefetches_unused{0};
  std::atomic<int64_t> peak_prefetch_bytes{0};
  std::atomic<int64_t> prefetch_failures{0};  // prefetches that raised (e.g. out of device memory)
  // Offloads the pool refused that went to its disk tier; reads started by prefetch.
  std::atomic<int64_t> tensors_spilled{0}, bytes_spilled{0}, disk_prefetches{0};
  std::array<std::atomic<int64_t>, static_cast<int>(KeepReason::kCount)> kept_tensors{};
  std::array<std::atomic<int64_t>, static_cast<int>(KeepReason::kCount)> kept_bytes{};
};

// Something backward can reload ahead of need: one offloaded storage, or a batch of them.
class Reloadable {
 public:
  virtual ~Reloadable() = default;
  // Upper bound of the device bytes a prefetch would take now; 0 when there is nothing to
  // prefetch (already on the device, prefetched, or unpacked before).
  virtual int64_t prefetchable_bytes() = 0;
  // Starts the reload without making the compute stream wait; returns the bytes staged.
  virtual int64_t start_prefetch() = 0;
};

// Remembers the order handles were packed in; after each unpack it starts the reloads of the
// handles packed just before (the ones backward needs next), within a byte budget of reloads
// nobody has consumed yet. Correct for any unpack order: a prefetched reload is only a staged
// copy, used by whichever unpack comes first and dropped (after its copy) if none does.
class Prefetcher {
 public:
  Prefetcher(int64_t budget, std::shared_ptr<PackerCounters> counters)
      : budget_(budget), counters_(std::move(counters)) {}
  uint64_t add(std::weak_ptr<Reloadable> r);
  void after_unpack(uint64_t seq);
  void release(int64_t bytes) { outstanding_ -= bytes; }
  int64_t outstanding() const { return outstanding_.load(); }

 private:
  int64_t budget_;
  std::shared_ptr<PackerCounters> counters_;
  std::mutex mu_;
  std::map<uint64_t, std::weak_ptr<Reloadable>> order_;
  uint64_t next_ = 0;
  size_t prune_at_ = 1024;
  std::atomic<int64_t> outstanding_{0};
};

class Batch;

// Test hook: the next `n` prefetches raise (as running out of device memory would).
void fail_next_prefetches(int n);
// Test hook: batches gather through a device staging block (default) or copy member by member.
void set_batch_staging(bool on);

// The host copy of one span of a storage, shared by every saved tensor that views it. Its
// bytes live in a HostBuffer of its own, or at an offset of a Batch's.
class OffloadedStorage : public Reloadable {
 public:
  // `pad` bytes precede the span in a reloaded storage, so the data pointer keeps its original
  // alignment (mod kReloadAlignment): kernels choose code paths by alignment, and a different
  // path could change the result's bits.
  OffloadedStorage(std::shared_ptr<TieredBuffer> buffer, c10::Device device, size_t pad, bool side_stream,
                   std::shared_ptr<PackerCounters> counters);
  OffloadedStorage(std::shared_ptr<Batch> batch, c10::Device device, size_t pad, size_t nbytes, bool side_stream,
                   std::shared_ptr<PackerCounters> counters);
  ~OffloadedStorage() override;
  static constexpr size_t kReloadAlignment = 512;
  // A device storage holding the bytes again. While one reloaded storage is alive, later
  // unpacks (other views, retain_graph, double backward) share it instead of copying again.
  // `*fresh_bytes`: device bytes this call brought back (0 when shared).
  // `first`: the first unpack of one of the saved tensors that view this storage.
  c10::Storage materialize(bool first, bool* shared, int64_t* fresh_bytes);
  // A saved tensor that views this storage was made / died before it was ever unpacked.
  void link();
  void unlink();
  size_t nbytes() const { return nbytes_; }
  size_t pad() const { return pad_; }
  uint64_t handle() const { return handle_; }
  HostPool* pool() const;
  void set_order(std::shared_ptr<Prefetcher> prefetcher, uint64_t seq);
  int64_t prefetchable_bytes() override;
  int64_t start_prefetch() override;

 private:
  friend class Batch;

// Test hook: the next `n` prefetches raise (as running out of device memory would).
void fail_next_prefetches(int n);
// Test hook: batches gather through a device staging block (default) or copy member by member.
void set_batch_staging(bool on);
  friend class SavedTensor;
  struct Staged {
    c10::Storage storage;
    std::shared_ptr<Event> ready;
    Stream* copy = nullptr;  // the side stream of a prefetch, which the consumer has not waited on
    bool prefetch = false;
    // A reload kept for the saved tensors that have not unpacked yet (tanh's output is also
    // the next Linear's input): they share it instead of copying the same bytes again.
    bool held = false;
  };
  bool resident_locked();
  // Takes a staged reload (from a batch reload, or a prefetch); false (and the copy is let go
  // once finished) when the bytes are already on the device.
  bool stage_locked(Staged staged);
  void drop_staged_locked();

  std::shared_ptr<TieredBuffer> buffer_;  // a storage of its own (in the pool or spilled)
  std::shared_ptr<Batch> batch_;          // or a member of a batch
  // A prefetch that only started the disk read of a spilled buffer: counted in the prefetch
  // budget until an unpack consumes it (the H2D copy then runs on demand).
  bool disk_prefetch_ = false;
  c10::Device device_;
  size_t pad_, nbytes_;
  bool side_stream_;
  uint64_t handle_;
  std::shared_ptr<PackerCounters> counters_;
  std::mutex mu_;
  c10::weak_intrusive_ptr<c10::StorageImpl> reloaded_{c10::intrusive_ptr<c10::StorageImpl>()};
  std::shared_ptr<Event> reloaded_ready_;
  Staged staged_;
  int pending_ = 0;  // saved tensors viewing this storage that have not unpacked yet
  std::shared_ptr<Prefetcher> prefetcher_;
  uint64_t seq_ = 0;
};

// Small saved tensors of one device, gathered into one host block and copied once (a gather
// kernel on a GPU), scattered back into storages of their own on reload.
class Batch : public Reloadable, public std::enable_shared_from_this<Batch> {
 public:
  Batch(c10::Device device, bool side_stream, std::shared_ptr<HostPool> pool, std::shared_ptr<PackerCounters> counters,
        std::shared_ptr<Prefetcher> prefetcher);
  ~Batch() override;
  // Adds t's span [lo, lo + span) of its storage; the batch holds the storage until flush.
  std::shared_ptr<OffloadedStorage> add(const at::Tensor& t, int64_t lo, int64_t span);
  size_t block_bytes() const { return block_bytes_; }
  size_t size() const { return members_.size(); }
  // Copies the members to the host (once). When the pool (and its disk tier) is full, every
  // member instead gets a device copy of its own, counted as kept for pool_full (disk_full);
  // returns false then.
  bool flush();
  TieredRefusal refusal() const { return refusal_; }
  bool flushed();
  // Reloads every member that is alive and not on the device; prefetch: without making the
  // compute stream wait. Returns the bytes staged.
  int64_t reload(bool prefetch);
  int64_t prefetchable_bytes() override;
  int64_t start_prefetch() override { return reload(true); }
  uint64_t handle() const { return handle_; }
  HostPool* pool() const { return pool_.get(); }

 private:
  struct Member {
    std::weak_ptr<OffloadedStorage> storage;
    std::shared_ptr<void> source;  // the source storage, until flush
    const char* src = nullptr;
    size_t lo = 0, offset = 0, bytes = 0, pad = 0;
  };
  c10::Device device_;
  bool side_stream_;
  std::shared_ptr<HostPool> pool_;
  std::shared_ptr<PackerCounters> counters_;
  uint64_t handle_;
  std::mutex mu_;
  std::vector<Member> members_;
  size_t block_bytes_ = 0;
  bool flushed_ = false;
  TieredRefusal refusal_ = TieredRefusal::None;
  std::shared_ptr<TieredBuffer> buffer_;
  int64_t disk_prefetch_bytes_ = 0;  // as OffloadedStorage::disk_prefetch_, for the whole batch
  std::shared_ptr<Prefetcher> prefetcher_;
  uint64_t seq_ = 0;
};

// What pack returns to autograd. Holds no reference to the graph (no grad_fn, no original
// tensor of an output), so a dropped graph frees it and its pool block.
class SavedTensor {
 public:
  // Copies t's bytes (the span of its storage it reaches) into `pool`, keeping its layout.
  // Returns nullptr when the pool cannot provide the memory.
  // `why` (optional) says whether the pool or its disk tier refused.
  static std::shared_ptr<SavedTensor> offload(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                              bool side_stream, std::shared_ptr<PackerCounters> counters,
                                              TieredRefusal* why = nullptr);
  ~SavedTensor();
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
  int64_t device_held_ = 0;  // bytes counted in profiler::g_device_bytes_saved for this tensor
  bool unpacked_ = false;
};

// The standalone engine entry point (co.offload_tensor): validates, offloads, raises PoolFull.
std::shared_ptr<SavedTensor> offload_tensor(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                            bool side_stream);
std::string pool_full_message(HostPool& pool, const at::Tensor& t, int64_t span);
std::string pool_full_message(HostPool& pool, const std::string& what, int64_t span);
// The pool is full and its disk tier refused too (spill_max_bytes, or a full disk).
std::string disk_full_message(HostPool& pool, const std::string& what, int64_t span);
std::string full_message(TieredRefusal why, HostPool& pool, const std::string& what, int64_t span);

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
  // Copies the open batches to the host (context exit, or before a batch member is unpacked).
  void flush_batches();
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
  std::shared_ptr<Prefetcher> prefetcher_;  // null without prefetch
  std::map<int, std::shared_ptr<Batch>> open_batches_;  // by device index (-1: CPU)
};


}  // namespace ckpt_offload

// Batching: many small saved tensors copied as one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../core/copy_engine.h"
#include "../core/host_pool.h"
#include "../core/spill.h"
#include "counters.h"
#include "offloaded_storage.h"
#include "prefetcher.h"
#include "runtime.h"

namespace ckpt_offload {

// Small saved tensors of one device, gathered into one host block and copied once (a gather
// kernel on a GPU), scattered back into storages of their own on reload.
class Batch : public Reloadable, public std::enable_shared_from_this<Batch> {
 public:
  Batch(c10::Device device, bool side_stream, std::shared_ptr<HostPool> pool, std::shared_ptr<PackerCounters> counters,
        std::shared_ptr<Prefetcher> prefetcher);
  ~Batch() override;
  // Adds t's span [lo, lo + span) of its storage; the batch holds the storage until flush.
  // `current`: t's device's current stream, as pack read it.
  std::shared_ptr<OffloadedStorage> add(const at::Tensor& t, int64_t lo, int64_t span, const CurrentStream& current);
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
  void drop_prefetch() override;
  c10::Device device() const override { return device_; }
  // A member whose storage spans more than 2 * its bytes + this is copied out at add (so the
  // batch does not hold a whole activation for a small view of it until the flush).
  static constexpr size_t kCopyOutSlack = 4096;
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
  void drop_disk_prefetch_locked();
  // The latest event of every stream that produced a member, by stream id, until the flush.
  std::map<uintptr_t, std::shared_ptr<Event>> producers_;
  std::shared_ptr<Prefetcher> prefetcher_;
  uint64_t seq_ = 0;
};

}  // namespace ckpt_offload

// Prefetch: backward reloads the handles it will need next while it computes.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <c10/core/Device.h>

#include "counters.h"

namespace ckpt_offload {

// Something backward can reload ahead of need: one offloaded storage, or a batch of them.
class Reloadable {
 public:
  virtual ~Reloadable() = default;
  // Upper bound of the device bytes a prefetch would take now; 0 when there is nothing to
  // prefetch (already on the device, prefetched, or unpacked before).
  virtual int64_t prefetchable_bytes() = 0;
  // Starts the reload without making the compute stream wait; returns the bytes staged.
  virtual int64_t start_prefetch() = 0;
  // Lets go of a prefetched reload no unpack has taken (end of backward).
  virtual void drop_prefetch() = 0;
  // The device its bytes go back to.
  virtual c10::Device device() const = 0;
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
  // After the unpack of handle `seq` on `device`: prefetches only handles of that device, so
  // the work never runs on another device's streams from this (the unpacking device's) thread.
  // Note [Stream ordering] rule 6 (runtime.h).
  void after_unpack(uint64_t seq, const c10::Device& device);
  void release(int64_t bytes) { outstanding_ -= bytes; }
  // End of a backward: drops the prefetches it started that no unpack took, so their device
  // memory does not outlive the backward (it would until the graph died, or the next offload).
  void drop_unused();
  int64_t outstanding() const { return outstanding_.load(); }

 private:
  int64_t budget_;
  std::shared_ptr<PackerCounters> counters_;
  std::mutex mu_;
  std::map<uint64_t, std::weak_ptr<Reloadable>> order_;
  uint64_t next_ = 0;
  size_t prune_at_ = 1024;
  std::atomic<int64_t> outstanding_{0};
  std::vector<std::weak_ptr<Reloadable>> started_;  // prefetched since the last drop_unused
};

}  // namespace ckpt_offload

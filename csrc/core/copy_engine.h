// CopyEngine: moves bytes between tensors' memory and HostPool blocks, in stream order.
//
// The engine knows nothing of tensors; the torch layer hands it pointers, streams and an
// opaque `keepalive` that owns the source memory. The orderings it enforces (DESIGN.md,
// invariant 2):
//   offload: the copy starts after the compute stream has produced the source; the source
//            is kept alive until the copy has finished; the block is not reused before then.
//   reload:  the copy starts after the destination is free in compute order and the
//            offload copy has finished; the compute stream waits for the copy before use;
//            the block is not reused before the copy has read it.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "host_pool.h"
#include "stream.h"

namespace ckpt_offload {

// One pool block holding offloaded bytes. Returns the block to its pool when it dies; the
// pool reuses it only after every copy that touched it has finished.
class HostBuffer {
 public:
  HostBuffer(std::shared_ptr<HostPool> pool, HostPool::Block* block, size_t nbytes);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return HostPool::data(block_); }
  size_t nbytes() const { return nbytes_; }
  const std::shared_ptr<HostPool>& pool() const { return pool_; }
  // Completes when the offload copy into this buffer has finished.
  std::shared_ptr<Event> ready() const;
  void set_ready(std::shared_ptr<Event> ev);
  // Records a copy that reads this buffer.
  void add_reader(std::shared_ptr<Event> ev);

 private:
  std::shared_ptr<HostPool> pool_;
  HostPool::Block* block_;
  size_t nbytes_;
  mutable std::mutex mu_;
  std::shared_ptr<Event> ready_;
  std::vector<std::shared_ptr<Event>> readers_;
};

class CopyEngine {
 public:
  CopyEngine() = default;
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Copies `bytes` bytes at `src` into a new block of `pool`. The copy runs on `copy` after
  // everything enqueued so far on `compute` (the same object for stream="compute").
  // `keepalive` owns the source memory; it is released once the copy has finished.
  // Returns nullptr when the pool cannot provide the memory (cap reached).
  std::shared_ptr<HostBuffer> offload(const std::shared_ptr<HostPool>& pool, const void* src, size_t bytes,
                                      Stream& compute, Stream& copy, std::shared_ptr<void> keepalive);

  // Copies `buf` into `dst` (`buf.nbytes()` bytes), whose memory is free for writing in
  // `compute` order. On return, work enqueued on `compute` afterwards sees the data.
  // Returns the event that marks the end of the copy.
  std::shared_ptr<Event> reload(HostBuffer& buf, void* dst, Stream& compute, Stream& copy);

  // Releases the keepalives whose copies have finished. Never blocks on a copy.
  void poll();
  // Waits for the copies whose sources it still holds, then releases those sources. (The side
  // streams themselves are drained by the runtime's synchronize.)
  void synchronize();
  size_t num_keepalives();

 private:
  void hold(uintptr_t stream_id, std::shared_ptr<Event> done, std::shared_ptr<void> keepalive);

  struct Held {
    std::shared_ptr<Event> done;
    std::shared_ptr<void> keepalive;
  };
  std::mutex mu_;
  // One FIFO per copy stream: its events complete in order, so polling stops at the first
  // one still running and stays O(1) amortized per copy.
  std::map<uintptr_t, std::deque<Held>> held_;
  size_t num_held_ = 0;
};

}  // namespace ckpt_offload

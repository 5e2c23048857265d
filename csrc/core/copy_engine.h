// CopyEngine: moves bytes between tensors' memory and HostPool blocks, in stream order.
//
// The engine knows nothing of tensors; the torch layer hands it pointers, streams and an
// opaque `keepalive` that owns the source memory. The orderings it enforces (the core's half
// of Note [Stream ordering], csrc/torch/runtime.h):
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
#include "profiler.h"
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

// What a copy is, for the profiler's records (ignored while profiling is off).
struct CopyTag {
  uint64_t handle = 0;
  int device = -1;  // -1: CPU
  bool prefetch = false;
  int members = 1;  // tensors moved by this copy (> 1: a batch)
};

// One member of a batched copy: `bytes` bytes at `ptr` on the device (the source of a
// gather, the destination of a scatter), at `offset` in the host block.
struct BatchSpan {
  void* ptr;
  size_t offset;
  size_t bytes;
};

// Makes what owns a copy's source memory (CopyEngine::offload asks only when it must hold it).
class KeepaliveSource {
 public:
  virtual std::shared_ptr<void> make() const = 0;

 protected:
  ~KeepaliveSource() = default;
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
                                      Stream& compute, Stream& copy, std::shared_ptr<void> keepalive,
                                      const CopyTag& tag = {});
  // The same, with the owner of the source made only if the copy is still running once
  // enqueued (an inline copy has read its source already: nothing to hold, nothing made).
  std::shared_ptr<HostBuffer> offload(const std::shared_ptr<HostPool>& pool, const void* src, size_t bytes,
                                      Stream& compute, Stream& copy, const KeepaliveSource& keepalive,
                                      const CopyTag& tag = {});

  // Copies `buf` into `dst` (`buf.nbytes()` bytes), whose memory is free for writing in
  // `compute` order. With `consumer_waits`, work enqueued on `compute` after the return sees
  // the data; without (prefetch), the caller must make the consumer wait on the returned
  // event, which marks the end of the copy.
  std::shared_ptr<Event> reload(HostBuffer& buf, void* dst, Stream& compute, Stream& copy, bool consumer_waits = true,
                                const CopyTag& tag = {});

  // Batched offload of many small spans into one block of `block_bytes`: a gather (one kernel
  // launch per kBatchMaxSegments spans) into `staging` (device memory of block_bytes allocated
  // in compute order, kept alive by `keepalive` too), then one copy to the host. With
  // `staging` null (CPU tensors) the spans are gathered straight into the block. The gather
  // also waits for every event of `producers`: the spans may have been written on other
  // streams than `compute` (see Note [Stream ordering] in csrc/torch/runtime.h).
  std::shared_ptr<HostBuffer> offload_gather(const std::shared_ptr<HostPool>& pool, const std::vector<BatchSpan>& spans,
                                             size_t block_bytes, void* staging, Stream& compute, Stream& copy,
                                             std::shared_ptr<void> keepalive, const CopyTag& tag = {},
                                             const std::vector<std::shared_ptr<Event>>& producers = {});
  // The mirror: one copy of `buf` into `staging` (kept alive by `keepalive` until the copy
  // stream is done with it), then a scatter into each span's destination.
  std::shared_ptr<Event> reload_scatter(HostBuffer& buf, const std::vector<BatchSpan>& spans, void* staging,
                                        Stream& compute, Stream& copy, std::shared_ptr<void> keepalive,
                                        bool consumer_waits = true, const CopyTag& tag = {});

  // Keeps `keepalive` until `done` (an event of `copy`) has completed; e.g. a prefetched
  // reload dropped before use: its memory must not go back to the allocator mid-copy.
  void keep_until(Stream& copy, std::shared_ptr<Event> done, std::shared_ptr<void> keepalive);

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

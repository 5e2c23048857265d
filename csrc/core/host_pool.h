// HostPool: host memory for offloaded activations.
//
// Memory comes from a Backend in large segments and is handed out as best-fit blocks that
// are split on allocation and coalesced on free: the bookkeeping is a BlockAllocator's (one
// region per segment, a block's offset is its distance from the segment's base). A freed block is reused only after every
// copy that touched it has finished: the events are queried (never waited on) at each
// allocation, per block, so one slow copy does not hold back the reuse of the others.
//
// Note [Recent blocks]
// Training frees and allocates blocks of the same few sizes every step, and each trip through
// the allocator's trees costs more than everything else an offload of a small tensor does. So
// a block freed with no copy pending waits, still allocated in the allocator, in a short list
// of recent blocks of its exact size, and an allocation of that size takes the newest of them
// first: an exact fit, as best fit would choose (only among equal fits is the order newest
// first instead of lowest address). Any allocation of a size with no recent block gives all of
// them back to the allocator (coalesced) before it looks for a best fit, and so do growing,
// retiring segments and the checks: the allocator never grows the pool or refuses a request
// while a recent block could serve it.
// Requests are rounded to kAlignment only, never to a power of two, so the bytes reserved
// stay close to the bytes asked for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "block_allocator.h"
#include "stats_table.h"
#include "stream.h"

namespace ckpt_offload {

constexpr size_t kAlignment = 512;          // every block starts on this boundary
constexpr size_t kSegmentAlignment = 4096;  // segments are whole pages
constexpr size_t kDefaultSegmentBytes = size_t(64) << 20;

inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Where segments come from: pinned (cudaHostAlloc) or pageable aligned host memory.
class Backend {
 public:
  virtual ~Backend() = default;
  // Returns nullptr when the memory cannot be had.
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* ptr, size_t bytes) = 0;
  virtual const char* name() const = 0;
  // The NUMA node the segments are placed on (Note [NUMA-local segments] in numa.h), -1 when
  // the backend places none; the pool then measures where each segment's pages are.
  virtual int numa_node() const { return -1; }
};

class PageableBackend final : public Backend {
 public:
  // numa_node >= 0: segments from numa::map_on_node (placed on that node, every page faulted in).
  explicit PageableBackend(int numa_node = -1) : numa_node_(numa_node) {}
  void* allocate(size_t bytes) override;
  void release(void* ptr, size_t bytes) override;
  const char* name() const override { return "pageable"; }
  int numa_node() const override { return numa_node_; }

 private:
  int numa_node_;
};

// HostPool::stats(), one row a stat (Note [Stats tables] in stats_table.h), in the order of the
// dict co.HostPool.stats() returns.
#define CKPT_OFFLOAD_POOL_STATS(FIELD, PEAK, KEY)                                             \
  FIELD(size_t, bytes_in_use, Value)    /* blocks held by live owners (aligned sizes) */      \
  FIELD(size_t, bytes_requested, Value) /* what those owners asked for (unaligned) */         \
  FIELD(size_t, bytes_pending, Value)   /* freed blocks still waiting for their copies */     \
  FIELD(size_t, bytes_retired, Value)   /* free segments taken off the pool, not yet given */ \
                                        /* back (see release_retired) */                      \
  FIELD(size_t, bytes_reserved, Value)  /* all segments taken from the backend (and not */    \
                                        /* retired) */                                        \
  PEAK(size_t, peak_bytes_in_use, bytes_in_use)                                               \
  PEAK(size_t, peak_bytes_reserved, bytes_reserved)                                           \
  FIELD(size_t, max_bytes, Cap) /* 0: no cap */                                               \
  FIELD(size_t, num_segments, Value)                                                          \
  FIELD(uint64_t, num_blocks_in_use, Value)                                                   \
  FIELD(uint64_t, num_allocs, Value) /* successful allocate() calls since creation */         \
  FIELD(uint64_t, num_frees, Value)                                                           \
  FIELD(uint64_t, num_backend_allocs, Value) /* segments obtained from the backend since */   \
                                             /* creation */                                   \
  FIELD(uint64_t, num_backend_frees, Value)                                                   \
  FIELD(uint64_t, num_cap_hits, Value) /* allocate() calls refused by the cap */              \
  KEY(backend)                         /* Backend::name() */                                  \
  KEY(numa_node)                       /* Backend::numa_node(), None when -1 */               \
  KEY(bytes_by_node)                   /* bytes_by_node() as {node: bytes}; None unbound */

struct PoolStats {
  CKPT_OFFLOAD_STATS_STRUCT_BODY(CKPT_OFFLOAD_POOL_STATS)
};

class HostPool {
 public:
  struct Block;

  // max_bytes == 0 means no cap.
  HostPool(std::unique_ptr<Backend> backend, size_t max_bytes = 0, size_t segment_bytes = kDefaultSegmentBytes);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // Returns a block of at least `bytes` bytes aligned to kAlignment, or nullptr when the cap
  // (or the backend) does not allow it. Never blocks on a copy.
  Block* allocate(size_t bytes);
  // Returns a block. It becomes reusable once every event in `pending` has completed. Never
  // throws on a failed event query (the block is leaked instead): called from destructors.
  // See Note [No throw on teardown].
  void free(Block* block, std::vector<std::shared_ptr<Event>> pending = {});

  static void* data(const Block* block);
  static size_t size(const Block* block);

  PoolStats stats();
  // stats().bytes_in_use alone: what a checkpoint samples per call, without copying every counter.
  size_t bytes_in_use();
  void reset_peak();
  // Releases every segment with no live or pending block (and the retired ones). Returns the
  // bytes released.
  size_t empty_cache();
  // Gives the retired segments back to the backend, outside the pool's lock. Segments are
  // retired (taken off the pool, but not released) when growth at the cap needs room:
  // cudaFreeHost / cudaHostUnregister synchronize the whole device, which must not happen in
  // forward, under the pool lock. The torch layer calls this at the end of each backward;
  // empty_cache(), set_max_bytes() and the destructor call it too. Until then
  // the host holds up to bytes_retired beyond the cap. Returns the bytes released.
  size_t release_retired();
  // Takes at least `bytes` more from the backend now (one segment, within the cap), so that the
  // first training step does not pay for backend allocations (cudaHostAlloc takes a driver lock
  // and milliseconds). Returns the size of that segment, 0 when the cap or the backend refused.
  // (Making room under the cap may release wholly free segments first, so bytes_reserved can grow
  // by less than the value returned.)
  size_t reserve(size_t bytes);
  // Blocks until the copies of all blocks pending at the call have finished, then makes them
  // reusable. Other threads may allocate and free meanwhile: the wait holds no lock.
  void synchronize();
  // A lower cap releases wholly free segments at once; the rest go back as they are freed.
  void set_max_bytes(size_t max_bytes);
  // Throws std::invalid_argument for a cap (non-zero) below kSegmentAlignment, which no
  // block could fit under.
  static void check_max_bytes(size_t max_bytes);
  const char* backend_name() const { return backend_->name(); }
  // For a pool whose backend places its segments on a NUMA node: the reserved bytes (segments
  // not retired) by the node their pages are on, measured when each segment was taken
  // (Note [NUMA-local segments]); ascending by node. Empty for an unbound pool.
  std::vector<std::pair<int, size_t>> bytes_by_node();
  Backend& backend() const { return *backend_; }
  size_t segment_bytes() const { return segment_bytes_; }

  // Checks the internal invariants (the allocator's ranges tile the segments, every live block
  // is an allocated range of its segment, the stats match). Test-only.
  bool check_invariants(std::string* why);

 private:
  // A segment is region `i` of alloc_ when segments_[i].base is set; a retired segment's slot
  // is reused by the next one, so region numbers stay small (as FileTier does with its files).
  struct Segment {
    char* base = nullptr;
    size_t size = 0;
    std::vector<std::pair<int, size_t>> placement;  // (node, bytes): a NUMA-bound pool's only
  };

  Block* allocate_locked(size_t bytes);
  // Adds a segment for `bytes`; its size goes to *segment_size when given.
  bool grow_locked(size_t bytes, size_t* segment_size = nullptr);
  void reclaim_locked(bool wait);
  // Gives a Used or Pending block's range back to the allocator and deletes the block.
  void release_block_locked(Block* block);
  // Note [Recent blocks]: a freed block with nothing pending kept for the next allocation of
  // its size (false: no room in the lists); the one to reuse for `size`, or null; all of them
  // given back to the allocator.
  bool keep_recent_locked(Block* block);
  Block* take_recent_locked(size_t size);
  void flush_recent_locked();
  // Moves every wholly free segment to retired_; returns the bytes moved.
  size_t retire_free_segments_locked();
  void release_segment(void* base, size_t size);

  // Note [Lock order] (core): mu_ is a leaf. The backend is called under it only to allocate;
  // releases happen outside it (release_retired). Every `_locked` helper assumes mu_ is held.
  std::unique_ptr<Backend> backend_;
  size_t max_bytes_;
  size_t segment_bytes_;
  std::mutex mu_;
  BlockAllocator alloc_{kAlignment};  // the free ranges; a Used or Pending block's is allocated
  Block* live_ = nullptr;             // every Used or Pending block, linked (Block::prev/next)
  struct Pending {
    Block* block;
    std::vector<std::shared_ptr<Event>> events;
  };
  std::vector<Pending> pending_;
  // Blocks whose copies' events failed (a sticky CUDA error): never reused, and their segments
  // are never given back to the backend. Counted in bytes_pending.
  std::vector<Block*> poisoned_;
  void poison_locked(Block* block);
  std::vector<Segment> segments_;  // index = alloc_'s region
  // Note [Recent blocks]: by exact size, newest last; their ranges stay allocated in alloc_.
  struct Recent {
    size_t size = 0;
    std::vector<Block*> blocks;
  };
  static constexpr size_t kRecentSizes = 16, kRecentPerSize = 16;
  std::vector<Recent> recent_;
  size_t recent_bytes_ = 0;
  std::vector<std::pair<void*, size_t>> retired_;  // released by release_retired(), outside mu_
  PoolStats stats_;
};

}  // namespace ckpt_offload

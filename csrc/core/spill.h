// Spilling: a host pool with a FileTier attached overflows to disk instead of refusing.
//
// Note [Spilling offloaded blocks]: an offload first asks the pool, as without a tier. When the
// pool refuses (its cap), the D2H copy goes into a block of the *staging* pool instead (same
// backend, no cap), and the tier's I/O threads write that block to disk once the copy has
// finished (FileTier's `after` event), then free it. Staging memory is bounded by backpressure:
// an offload waits (a counted stall) while the writes in flight hold more than staging_bytes.
// Reading back lands in a pool block when the pool has room, else a staging block; the
// torch layer lets that copy go after the H2D copy, so host memory holds only what is in
// flight. A spilled block whose file range cannot be had (cap or full disk) is refused like a
// full pool, and the caller keeps the tensor (reason "disk_full") or raises.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

#include "copy_engine.h"
#include "file_tier.h"
#include "host_pool.h"

namespace ckpt_offload {

class TieredBuffer;

class SpillTarget : public std::enable_shared_from_this<SpillTarget> {
 public:
  SpillTarget(std::shared_ptr<FileTier> tier, std::shared_ptr<HostPool> staging, size_t staging_bytes);
  const std::shared_ptr<FileTier>& tier() const { return tier_; }
  const std::shared_ptr<HostPool>& staging() const { return staging_; }
  size_t staging_bytes() const { return staging_bytes_; }

  // Waits while the writes in flight hold more than staging_bytes of staging memory.
  void throttle();
  // Starts writing `staged` (a staging block that a D2H copy is filling) to disk; the block is
  // freed once written. nullptr when the tier refuses (its cap, or a full disk).
  std::shared_ptr<TieredBuffer> spill(std::shared_ptr<HostBuffer> staged, const std::shared_ptr<HostPool>& pool,
                                      uint64_t handle);

  std::atomic<uint64_t> blocks_spilled{0}, bytes_spilled{0};
  std::atomic<uint64_t> blocks_refused{0};   // the tier had no room
  std::atomic<uint64_t> throttle_stalls{0};  // offloads that waited for a write to free staging memory
  std::atomic<int64_t> throttle_stall_ns{0};

 private:
  std::shared_ptr<FileTier> tier_;
  std::shared_ptr<HostPool> staging_;
  size_t staging_bytes_;
  std::mutex mu_;
  std::deque<std::shared_ptr<FileTier::Ticket>> writes_;  // in flight, oldest first
};

// Attaches `target` to `pool`: offloads the pool refuses spill through it. One per pool; null
// detaches. The registry holds neither: the caller owns the target (co.HostPool does), and a
// spilled block holds the target it went through, so blocks still on disk outlive both.
void attach_spill(const std::shared_ptr<HostPool>& pool, std::shared_ptr<SpillTarget> target);
std::shared_ptr<SpillTarget> spill_target(const HostPool* pool);
// Waits until the disk tier of every attached target has no read or write queued or running
// (what a fork needs: Note [Fork], csrc/torch/runtime.cpp).
void synchronize_spill_targets();

// The host copy of one offloaded block: a pool block, or a range of a spill file that is read
// back into a host block on demand.
class TieredBuffer {
 public:
  explicit TieredBuffer(std::shared_ptr<HostBuffer> resident);
  TieredBuffer(std::shared_ptr<SpillTarget> target, std::shared_ptr<FileTier::Spill> spill,
               std::shared_ptr<HostPool> pool, size_t nbytes);
  size_t nbytes() const { return nbytes_; }
  bool spilled() const { return static_cast<bool>(spill_); }
  // The pool the block was offloaded into (a spilled block's pool refused it).
  HostPool* pool() const { return pool_.get(); }
  // Starts reading a spilled block back (no-op if resident, read or being read). `prefetch`:
  // counted as a read started ahead of need.
  void start_read(bool prefetch);
  // True when a spilled block's read-back copy exists or is being read.
  bool reading();
  // A host block holding the bytes, waiting for the read back. Raises FileTierError (naming the
  // file) when the disk gave back other bytes than were written.
  std::shared_ptr<HostBuffer> host();
  // Lets a spilled block's read-back copy go; it is reused once the copies recorded on it end.
  void release_host();

 private:
  void start_read_locked(bool prefetch);

  std::shared_ptr<HostBuffer> resident_;
  std::shared_ptr<SpillTarget> target_;
  std::shared_ptr<FileTier::Spill> spill_;
  std::shared_ptr<HostPool> pool_;
  size_t nbytes_;
  std::mutex mu_;
  std::shared_ptr<HostBuffer> readback_;
  std::shared_ptr<FileTier::Ticket> read_;
};

enum class TieredRefusal { None, PoolFull, DiskFull };

// offload_tiered's path once `pool` has refused: spilled through the pool's SpillTarget.
std::shared_ptr<TieredBuffer> offload_spilled(
    const std::shared_ptr<HostPool>& pool, uint64_t handle,
    const std::function<std::shared_ptr<HostBuffer>(const std::shared_ptr<HostPool>&)>& copy_into, TieredRefusal* why);

// Offloads through `copy_into` (one of CopyEngine's offloads, given the pool to use): into
// `pool`, else spilled through the pool's SpillTarget. nullptr and *why when neither has room.
// A template: the usual path (the pool takes it) makes no std::function.
template <class CopyInto>
std::shared_ptr<TieredBuffer> offload_tiered(const std::shared_ptr<HostPool>& pool, uint64_t handle,
                                             const CopyInto& copy_into, TieredRefusal* why) {
  *why = TieredRefusal::None;
  if (auto buf = copy_into(pool)) return std::make_shared<TieredBuffer>(std::move(buf));
  return offload_spilled(pool, handle, copy_into, why);
}

}  // namespace ckpt_offload

#include "host_pool.h"

#include "numa.h"
#include "profiler.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>

namespace ckpt_offload {

// A block handed out by allocate(), alive until its range goes back to the allocator: Used
// until free(), then Pending while copies may still touch it (or for good, when poisoned).
struct HostPool::Block {
  char* ptr;
  BlockAllocator::Range range;  // region = index into segments_; range.size is the block's size
  size_t requested;
  enum State { Used, Pending, Recent } state = Used;  // Recent: see Note [Recent blocks]
  Block* prev = nullptr;                              // neighbours in the pool's list of live blocks (live_)
  Block* next = nullptr;
};

void* PageableBackend::allocate(size_t bytes) {
  if (numa_node_ >= 0) return numa::map_on_node(bytes, numa_node_);  // Note [NUMA-local segments]
  void* p = nullptr;
  if (posix_memalign(&p, kSegmentAlignment, bytes) != 0) return nullptr;
  return p;
}

void PageableBackend::release(void* ptr, size_t bytes) {
  if (numa_node_ >= 0)
    numa::unmap(ptr, bytes);
  else
    std::free(ptr);
}

HostPool::HostPool(std::unique_ptr<Backend> backend, size_t max_bytes, size_t segment_bytes)
    : backend_(std::move(backend)),
      max_bytes_(max_bytes),
      segment_bytes_(round_up(std::max<size_t>(segment_bytes, kSegmentAlignment), kSegmentAlignment)) {
  check_max_bytes(max_bytes);
  stats_.max_bytes = max_bytes_;
}

void HostPool::check_max_bytes(size_t max_bytes) {
  // Segments are whole pages: a cap below one page could never hold a block, and every
  // offload would be refused while the pool looked configured.
  if (max_bytes != 0 && max_bytes < kSegmentAlignment)
    throw std::invalid_argument("ckpt_offload: max_bytes=" + std::to_string(max_bytes) +
                                " is below the pool's minimum of " + std::to_string(kSegmentAlignment) +
                                " bytes (one page, the smallest segment a block can live in); pass max_bytes >= " +
                                std::to_string(kSegmentAlignment) + ", or 0 / None for no cap");
}

HostPool::~HostPool() {
  release_retired();
  // Owners keep the pool alive (shared_ptr), so no block is in use here; pending copies may
  // still be running, so wait for them before the memory goes back to the backend.
  std::lock_guard<std::mutex> lock(mu_);
  reclaim_locked(/*wait=*/true);
  flush_recent_locked();
  std::vector<bool> poisoned(segments_.size(), false);
  for (const Block* b : poisoned_) poisoned[b->range.region] = true;
  for (Block* b = live_; b;) {
    Block* next = b->next;
    delete b;
    b = next;
  }
  for (size_t i = 0; i < segments_.size(); ++i) {
    // A segment a failed copy may still touch is leaked, not released. Note [No throw on teardown].
    if (segments_[i].base && !poisoned[i]) release_segment(segments_[i].base, segments_[i].size);
  }
}

void HostPool::poison_locked(Block* b) {
  static bool warned = false;
  if (!warned) {
    warned = true;
    std::fprintf(stderr,
                 "ckpt_offload: warning: a copy's event failed (an earlier CUDA error); its host-pool block is "
                 "leaked instead of reused\n");
  }
  if (b->state != Block::Pending) {
    b->state = Block::Pending;
    stats_.bytes_pending += b->range.size;
  }
  poisoned_.push_back(b);
}

void* HostPool::data(const Block* block) { return block->ptr; }
size_t HostPool::size(const Block* block) { return block->range.size; }

void HostPool::release_block_locked(Block* b) {
  // The allocator coalesces the range with its free neighbours, so a large request can reuse
  // space freed as small pieces.
  alloc_.free(b->range);
  if (b->prev)
    b->prev->next = b->next;
  else
    live_ = b->next;
  if (b->next) b->next->prev = b->prev;
  delete b;
}

bool HostPool::keep_recent_locked(Block* b) {
  Recent* list = nullptr;
  for (Recent& r : recent_)
    if (r.size == b->range.size) list = &r;
  if (!list) {
    if (recent_.size() >= kRecentSizes) return false;
    recent_.push_back(Recent{b->range.size, {}});
    list = &recent_.back();
  }
  if (list->blocks.size() >= kRecentPerSize) return false;
  // Off the live list (it is no owner's block), its range still allocated.
  if (b->prev)
    b->prev->next = b->next;
  else
    live_ = b->next;
  if (b->next) b->next->prev = b->prev;
  b->prev = b->next = nullptr;
  b->state = Block::Recent;
  list->blocks.push_back(b);
  recent_bytes_ += b->range.size;
  return true;
}

HostPool::Block* HostPool::take_recent_locked(size_t size) {
  for (Recent& r : recent_) {
    if (r.size != size || r.blocks.empty()) continue;
    Block* b = r.blocks.back();
    r.blocks.pop_back();
    recent_bytes_ -= size;
    b->state = Block::Used;
    b->next = live_;
    if (live_) live_->prev = b;
    live_ = b;
    return b;
  }
  return nullptr;
}

void HostPool::flush_recent_locked() {
  for (Recent& r : recent_)
    for (Block* b : r.blocks) {
      alloc_.free(b->range);
      delete b;
    }
  recent_.clear();
  recent_bytes_ = 0;
}

void HostPool::reclaim_locked(bool wait) {
  if (!wait && capture_active()) return;  // Note [Graph capture]: no event query under capture
  // Each pending block is checked on its own: a slow copy holds back only its own block.
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending& p = pending_[i];
    bool done = true, failed = false;
    for (auto& ev : p.events) {
      if (!ev) continue;
      // Never throws: this runs from ~HostPool too. See Note [No throw on teardown].
      const EventState st = wait ? (ev->try_synchronize() ? EventState::Done : EventState::Failed) : ev->state();
      if (st == EventState::Done) continue;
      done = false;
      failed = st == EventState::Failed;
      break;
    }
    if (failed) {
      poison_locked(p.block);
    } else if (done) {
      stats_.bytes_pending -= p.block->range.size;
      release_block_locked(p.block);
    } else {
      if (kept != i) pending_[kept] = std::move(p);
      ++kept;
    }
  }
  pending_.resize(kept);
}

bool HostPool::grow_locked(size_t bytes, size_t* segment_size) {
  // A large request gets a segment of its own (page-rounded) size; small ones share a segment
  // of segment_bytes_. Either way the reserve grows by about what was asked for.
  const size_t need = round_up(bytes, kSegmentAlignment);
  size_t seg = bytes >= segment_bytes_ / 2 ? need : segment_bytes_;
  if (max_bytes_) {
    if (stats_.bytes_reserved + need > max_bytes_) {
      // Room under the cap from wholly free segments: retired, not released here (this runs
      // in forward, under mu_, and a pinned release synchronizes the device).
      retire_free_segments_locked();
      if (stats_.bytes_reserved + need > max_bytes_) return false;
    }
    const size_t room = (max_bytes_ - stats_.bytes_reserved) / kSegmentAlignment * kSegmentAlignment;
    seg = std::min(seg, room);  // room >= need here
  }
  const bool profiling = profiler::enabled();
  const int64_t t0 = profiling ? profiler::now_ns() : 0;
  void* mem = backend_->allocate(seg);
  if (!mem && seg > need) {
    seg = need;
    mem = backend_->allocate(seg);
  }
  if (!mem) return false;
  if (profiling)
    profiler::add(profiler::PoolRecord{profiler::PoolEventKind::BackendAlloc, seg, t0, profiler::now_ns()});
  // The lowest free slot: a retired segment's region number is reused.
  size_t region = 0;
  while (region < segments_.size() && segments_[region].base) ++region;
  if (region == segments_.size()) segments_.emplace_back();
  segments_[region] = Segment{static_cast<char*>(mem), seg, {}};
  // Where a bound backend's pages went (all present: it faults them in); they stay there.
  if (backend_->numa_node() >= 0) segments_[region].placement = numa::placement(mem, seg);
  alloc_.add_region(static_cast<uint32_t>(region), seg);
  stats_.bytes_reserved += seg;
  stats_.peak_bytes_reserved = std::max(stats_.peak_bytes_reserved, stats_.bytes_reserved);
  stats_.num_segments = alloc_.num_regions();
  stats_.num_backend_allocs++;
  if (segment_size) *segment_size = seg;
  return true;
}

HostPool::Block* HostPool::allocate_locked(size_t bytes) {
  // No host can provide half the address space. Refusing such a request here also keeps the
  // rounding below (and the cap arithmetic in grow_locked) from wrapping around: SIZE_MAX
  // would otherwise round to 0 and be "served" by a zero-byte split of some free block.
  if (bytes > std::numeric_limits<size_t>::max() / 2) return nullptr;
  const size_t need = round_up(std::max<size_t>(bytes, 1), kAlignment);
  // A recent block of exactly this size (Note [Recent blocks]); else the smallest free range
  // that fits, split to `need` (the rest stays free); else what the finished copies give back;
  // else a new segment.
  if (recent_bytes_) {
    if (Block* b = take_recent_locked(need)) {
      b->requested = bytes;
      return b;
    }
    flush_recent_locked();
  }
  BlockAllocator::Range r;
  bool found = alloc_.allocate(need, &r);
  if (!found) {
    reclaim_locked(/*wait=*/false);
    found = alloc_.allocate(need, &r);
  }
  if (!found) {
    if (!grow_locked(need)) return nullptr;
    found = alloc_.allocate(need, &r);
    if (!found) return nullptr;
  }
  auto* b = new Block{segments_[r.region].base + r.offset, r, bytes};
  b->next = live_;
  if (live_) live_->prev = b;
  live_ = b;
  return b;
}

HostPool::Block* HostPool::allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = allocate_locked(bytes);
  if (!b) {
    stats_.num_cap_hits++;
    if (profiler::enabled()) {
      const int64_t t = profiler::now_ns();
      profiler::add(profiler::PoolRecord{profiler::PoolEventKind::CapHit, bytes, t, t});
    }
    return nullptr;
  }
  stats_.num_allocs++;
  stats_.num_blocks_in_use++;
  stats_.bytes_in_use += b->range.size;
  stats_.bytes_requested += b->requested;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  return b;
}

void HostPool::free(Block* b, std::vector<std::shared_ptr<Event>> pending) {
  if (!b) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (b->state != Block::Used) throw std::logic_error("ckpt_offload: HostPool::free of a block that is not in use");
  stats_.num_frees++;
  stats_.num_blocks_in_use--;
  stats_.bytes_in_use -= b->range.size;
  stats_.bytes_requested -= b->requested;
  // state(), not query(): free runs from ~HostBuffer. See Note [No throw on teardown].
  bool failed = false;
  // Under graph capture nothing is queried: the block waits as pending (Note [Graph capture]).
  if (!capture_active())
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&failed](const std::shared_ptr<Event>& e) {
                                   if (!e) return true;
                                   const EventState st = e->state();
                                   failed = failed || st == EventState::Failed;
                                   return st == EventState::Done;
                                 }),
                  pending.end());
  if (failed) {
    poison_locked(b);
  } else if (pending.empty()) {
    if (!keep_recent_locked(b)) release_block_locked(b);
  } else {
    b->state = Block::Pending;
    stats_.bytes_pending += b->range.size;
    pending_.push_back({b, std::move(pending)});
  }
}

void HostPool::release_segment(void* base, size_t size) {
  const bool profiling = profiler::enabled();
  const int64_t t0 = profiling ? profiler::now_ns() : 0;
  backend_->release(base, size);
  if (profiling)
    profiler::add(profiler::PoolRecord{profiler::PoolEventKind::BackendFree, size, t0, profiler::now_ns()});
}

size_t HostPool::retire_free_segments_locked() {
  reclaim_locked(/*wait=*/false);
  flush_recent_locked();
  size_t moved = 0;
  for (size_t i = 0; i < segments_.size(); ++i) {
    Segment& s = segments_[i];
    if (!s.base || !alloc_.region_is_free(static_cast<uint32_t>(i))) continue;
    alloc_.remove_region(static_cast<uint32_t>(i));
    retired_.emplace_back(s.base, s.size);
    stats_.bytes_reserved -= s.size;
    stats_.bytes_retired += s.size;
    moved += s.size;
    s = Segment{};
  }
  while (!segments_.empty() && !segments_.back().base) segments_.pop_back();
  stats_.num_segments = alloc_.num_regions();
  return moved;
}

size_t HostPool::release_retired() {
  if (capture_active()) return 0;  // a pinned release would invalidate the capture (Note [Graph capture])
  std::vector<std::pair<void*, size_t>> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    retired.swap(retired_);
  }
  size_t released = 0;
  for (auto& r : retired) {
    release_segment(r.first, r.second);
    released += r.second;
  }
  if (!retired.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_retired -= released;
    stats_.num_backend_frees += retired.size();
  }
  return released;
}

size_t HostPool::empty_cache() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    retire_free_segments_locked();
  }
  return release_retired();
}

size_t HostPool::reserve(size_t bytes) {
  if (bytes == 0 || bytes > std::numeric_limits<size_t>::max() / 2) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  // A segment of exactly this size (page-rounded): grow_locked gives small requests a
  // default-sized segment, which is not what an explicit reservation asks for.
  const size_t saved = segment_bytes_;
  segment_bytes_ = std::min(segment_bytes_, round_up(bytes, kSegmentAlignment));
  // The new segment's size, not the growth of bytes_reserved: near the cap grow_locked releases
  // free segments to make room, and the difference would then report less than was asked for.
  size_t got = 0;
  const bool ok = grow_locked(bytes, &got);
  segment_bytes_ = saved;
  return ok ? got : 0;
}

void HostPool::synchronize() {
  // Wait without holding the lock: allocate() promises never to block on a copy, and it would
  // if another thread sat in this wait with mu_ held (pack on the forward thread while a
  // backward thread or the user synchronizes).
  std::vector<std::shared_ptr<Event>> events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Pending& p : pending_) events.insert(events.end(), p.events.begin(), p.events.end());
  }
  for (const auto& ev : events)
    if (ev) ev->synchronize();
  std::lock_guard<std::mutex> lock(mu_);
  reclaim_locked(/*wait=*/false);
}

std::vector<std::pair<int, size_t>> HostPool::bytes_by_node() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<int, size_t>> out;
  for (const Segment& s : segments_)
    for (const auto& [node, bytes] : s.placement) {
      auto it = out.begin();
      while (it != out.end() && it->first < node) ++it;
      if (it == out.end() || it->first != node) it = out.insert(it, {node, 0});
      it->second += bytes;
    }
  return out;
}

PoolStats HostPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  reclaim_locked(/*wait=*/false);
  return stats_;
}

size_t HostPool::bytes_in_use() {
  std::lock_guard<std::mutex> lock(mu_);
  reclaim_locked(/*wait=*/false);
  return stats_.bytes_in_use;
}

void HostPool::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.reset_peaks();
}

void HostPool::set_max_bytes(size_t max_bytes) {
  check_max_bytes(max_bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    max_bytes_ = max_bytes;
    stats_.max_bytes = max_bytes;
    // A lowered cap gives back what it can at once; segments with live blocks stay until freed.
    if (max_bytes_ && stats_.bytes_reserved > max_bytes_) retire_free_segments_locked();
  }
  release_retired();
}

bool HostPool::check_invariants(std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string err;  // Note [No iostreams in the extension] (text.h)
  // The recent blocks first: each an allocated range, in the list of its size, counted once.
  size_t recent = 0;
  std::set<std::pair<uint32_t, uint64_t>> recent_ranges;
  for (const Recent& rl : recent_)
    for (const Block* b : rl.blocks) {
      if (b->state != Block::Recent || b->range.size != rl.size) err += "recent block in the wrong list; ";
      if (!alloc_.is_allocated(b->range)) err += "recent block's range is free in the allocator; ";
      if (!recent_ranges.insert({b->range.region, b->range.offset}).second) err += "recent block listed twice; ";
      recent += b->range.size;
    }
  if (recent != recent_bytes_) err += "recent bytes mismatch; ";
  // The ranges tile every segment, and the free ones are coalesced and indexed.
  std::string alloc_why;
  if (!alloc_.check_invariants(&alloc_why)) err += alloc_why;
  size_t reserved = 0, segments = 0;
  for (const Segment& s : segments_) {
    if (!s.base) {
      if (!s.placement.empty()) err += "a free segment slot keeps a placement; ";
      continue;
    }
    reserved += s.size;
    ++segments;
    size_t placed = 0;
    for (const auto& np : s.placement) placed += np.second;
    if (placed > s.size) err += "a segment's placement counts more than its size; ";
  }
  if (segments != alloc_.num_regions()) err += "segments and the allocator's regions differ; ";
  // Every live block is an allocated range of its segment, at its address, and no two share one.
  size_t used = 0, pending = 0, requested = 0, pending_blocks = 0;
  uint64_t blocks_in_use = 0;
  std::set<std::pair<uint32_t, uint64_t>> seen;
  for (const Block* b = live_; b; b = b->next) {
    if (b->next && b->next->prev != b) err += "broken links between live blocks; ";
    const BlockAllocator::Range& r = b->range;
    if (r.region >= segments_.size() || !segments_[r.region].base) {
      err += "block points at no segment; ";
      continue;
    }
    const Segment& s = segments_[r.region];
    if (b->ptr != s.base + r.offset || r.offset + r.size > s.size) err += "block outside its segment; ";
    if (reinterpret_cast<uintptr_t>(b->ptr) % kAlignment) err += "misaligned block; ";
    if (!alloc_.is_allocated(r)) err += "live block's range is free in the allocator; ";
    if (!seen.insert({r.region, r.offset}).second || recent_ranges.count({r.region, r.offset}))
      err += "two live blocks share a range; ";
    if (b->state == Block::Used) {
      used += r.size;
      requested += b->requested;
      ++blocks_in_use;
    } else {
      pending += r.size;
      ++pending_blocks;
    }
  }
  if (live_ && live_->prev) err += "broken links between live blocks; ";
  // With the ranges tiling the segments, the live blocks are exactly the allocated ranges.
  if (alloc_.free_bytes() + used + pending + recent != reserved) err += "blocks do not cover the segments; ";
  if (pending_blocks != pending_.size() + poisoned_.size()) err += "pending blocks missing from the pending lists; ";
  if (reserved != stats_.bytes_reserved) err += "bytes_reserved mismatch; ";
  if (segments != stats_.num_segments) err += "num_segments mismatch; ";
  if (pending != stats_.bytes_pending) err += "bytes_pending mismatch; ";
  if (used != stats_.bytes_in_use) err += "bytes_in_use mismatch; ";
  if (blocks_in_use != stats_.num_blocks_in_use) err += "num_blocks_in_use mismatch; ";
  if (requested != stats_.bytes_requested) err += "bytes_requested mismatch; ";
  if (why) *why = err;
  return err.empty();
}

}  // namespace ckpt_offload

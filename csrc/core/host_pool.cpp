#include "host_pool.h"

#include "profiler.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

namespace ckpt_offload {

struct HostPool::Segment {
  char* base;
  size_t size;
  Block* first;  // the block at `base`; never merged away, so it stays valid for the segment's life
};

struct HostPool::Block {
  char* ptr;
  size_t size;
  size_t requested = 0;
  Segment* segment;
  Block* prev = nullptr;  // neighbours in address order within the segment
  Block* next = nullptr;
  enum State { Free, Used, Pending } state = Free;
};

bool HostPool::BySize::operator()(const Block* a, const Block* b) const {
  if (a->size != b->size) return a->size < b->size;
  return a->ptr < b->ptr;
}

void* PageableBackend::allocate(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kSegmentAlignment, bytes) != 0) return nullptr;
  return p;
}

void PageableBackend::release(void* ptr, size_t) { std::free(ptr); }

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
  for (Segment* s : segments_) {
    bool poisoned = false;
    for (Block* b = s->first; b;) {
      Block* next = b->next;
      poisoned = poisoned || std::find(poisoned_.begin(), poisoned_.end(), b) != poisoned_.end();
      delete b;
      b = next;
    }
    // A segment a failed copy may still touch is leaked, not released. Note [No throw on teardown].
    if (!poisoned) release_segment(s->base, s->size);
    delete s;
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
    stats_.bytes_pending += b->size;
  }
  poisoned_.push_back(b);
}

void* HostPool::data(const Block* block) { return block->ptr; }
size_t HostPool::size(const Block* block) { return block->size; }

void HostPool::insert_free_locked(Block* b) {
  b->state = Block::Free;
  b->requested = 0;
  // Coalesce with free neighbours so a large request can reuse space freed as small pieces.
  if (b->prev && b->prev->state == Block::Free) {
    Block* p = b->prev;
    free_blocks_.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    delete b;
    b = p;
  }
  if (b->next && b->next->state == Block::Free) {
    Block* n = b->next;
    free_blocks_.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete n;
  }
  free_blocks_.insert(b);
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
      stats_.bytes_pending -= p.block->size;
      insert_free_locked(p.block);
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
  if (profiling) profiler::add(profiler::PoolRecord{profiler::PoolEventKind::BackendAlloc, seg, t0, profiler::now_ns()});
  auto* s = new Segment{static_cast<char*>(mem), seg, nullptr};
  auto* b = new Block{s->base, seg, 0, s};
  s->first = b;
  segments_.push_back(s);
  free_blocks_.insert(b);
  stats_.bytes_reserved += seg;
  stats_.peak_bytes_reserved = std::max(stats_.peak_bytes_reserved, stats_.bytes_reserved);
  stats_.num_segments = segments_.size();
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
  auto find = [&]() -> Block* {
    Block key{nullptr, need, 0, nullptr};
    auto it = free_blocks_.lower_bound(&key);
    return it == free_blocks_.end() ? nullptr : *it;
  };
  Block* b = find();
  if (!b) {
    reclaim_locked(/*wait=*/false);
    b = find();
  }
  if (!b) {
    if (!grow_locked(need)) return nullptr;
    b = find();
    if (!b) return nullptr;
  }
  free_blocks_.erase(b);
  if (b->size - need >= kAlignment) {
    auto* rest = new Block{b->ptr + need, b->size - need, 0, b->segment, b, b->next};
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = need;
    free_blocks_.insert(rest);
  }
  b->state = Block::Used;
  b->requested = bytes;
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
  stats_.bytes_in_use += b->size;
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
  stats_.bytes_in_use -= b->size;
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
    insert_free_locked(b);
  } else {
    b->state = Block::Pending;
    stats_.bytes_pending += b->size;
    pending_.push_back({b, std::move(pending)});
  }
}

void HostPool::release_segment(void* base, size_t size) {
  const bool profiling = profiler::enabled();
  const int64_t t0 = profiling ? profiler::now_ns() : 0;
  backend_->release(base, size);
  if (profiling) profiler::add(profiler::PoolRecord{profiler::PoolEventKind::BackendFree, size, t0, profiler::now_ns()});
}

size_t HostPool::retire_free_segments_locked() {
  reclaim_locked(/*wait=*/false);
  size_t moved = 0;
  std::vector<Segment*> keep;
  for (Segment* s : segments_) {
    Block* whole = s->first;
    if (whole->state == Block::Free && whole->size == s->size) {
      free_blocks_.erase(whole);
      delete whole;
      retired_.emplace_back(s->base, s->size);
      stats_.bytes_reserved -= s->size;
      stats_.bytes_retired += s->size;
      moved += s->size;
      delete s;
    } else {
      keep.push_back(s);
    }
  }
  segments_ = std::move(keep);
  stats_.num_segments = segments_.size();
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

PoolStats HostPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  reclaim_locked(/*wait=*/false);
  return stats_;
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
  std::ostringstream err;
  size_t free_count = 0, reserved = 0, used = 0, pending = 0, requested = 0;
  for (Segment* s : segments_) {
    reserved += s->size;
    if (s->first->ptr != s->base || s->first->prev) err << "segment does not start with its first block; ";
    char* expect = s->base;
    for (Block* b = s->first; b; b = b->next) {
      if (b->ptr != expect) err << "gap or overlap between blocks; ";
      if (b->segment != s) err << "block points at the wrong segment; ";
      if (b->next && b->next->prev != b) err << "broken block links; ";
      if (reinterpret_cast<uintptr_t>(b->ptr) % kAlignment) err << "misaligned block; ";
      if (b->state == Block::Free) {
        ++free_count;
        if (!free_blocks_.count(b)) err << "free block missing from the free set; ";
        if (b->next && b->next->state == Block::Free) err << "adjacent free blocks not coalesced; ";
      } else if (b->state == Block::Used) {
        used += b->size;
        requested += b->requested;
      } else {
        pending += b->size;
      }
      expect = b->ptr + b->size;
    }
    if (expect != s->base + s->size) err << "blocks do not cover the segment; ";
  }
  if (free_count != free_blocks_.size()) err << "free set holds blocks of no segment; ";
  if (reserved != stats_.bytes_reserved) err << "bytes_reserved mismatch; ";
  if (pending != stats_.bytes_pending) err << "bytes_pending mismatch; ";
  if (used != stats_.bytes_in_use) err << "bytes_in_use mismatch; ";
  if (requested != stats_.bytes_requested) err << "bytes_requested mismatch; ";
  std::string e = err.str();
  if (why) *why = e;
  return e.empty();
}

}  // namespace ckpt_offload

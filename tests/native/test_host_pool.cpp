// HostPool, single-threaded: split/coalesce, alignment, best fit, event-ordered reuse, the
// byte cap, how much is reserved for what is asked, and the stats.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "cpu_stream.h"
#include "host_pool.h"

using namespace ckpt_offload;
using Block = HostPool::Block;

namespace {

constexpr size_t KiB = size_t(1) << 10;
constexpr size_t MiB = size_t(1) << 20;

std::unique_ptr<HostPool> make_pool(size_t max_bytes = 0, size_t segment_bytes = kDefaultSegmentBytes) {
  return std::make_unique<HostPool>(std::make_unique<PageableBackend>(), max_bytes, segment_bytes);
}

uintptr_t addr(const Block* b) { return reinterpret_cast<uintptr_t>(HostPool::data(b)); }

bool overlaps(const Block* a, const Block* b) {
  return addr(a) < addr(b) + HostPool::size(b) && addr(b) < addr(a) + HostPool::size(a);
}

std::shared_ptr<FenceEvent> fence() { return std::make_shared<FenceEvent>(false); }

// Several blocks carved out of one segment, freed in different orders: the segment must end up
// as one free block again, so a request for all of it is served without a new segment.
void test_split_and_coalesce() {
  const size_t seg = 1 * MiB;
  const size_t n = 8;
  std::vector<std::vector<size_t>> orders = {
      {0, 1, 2, 3, 4, 5, 6, 7},  // ascending: each free merges into its left neighbour
      {7, 6, 5, 4, 3, 2, 1, 0},  // descending: each free merges into its right neighbour
      {0, 2, 4, 6, 1, 3, 5, 7},  // holes first, then the blocks that bridge them (both sides)
      {3, 4, 2, 5, 1, 6, 0, 7},  // grows outwards from the middle
  };
  std::mt19937 rng(1234);
  for (int i = 0; i < 4; ++i) {
    std::vector<size_t> o(n);
    std::iota(o.begin(), o.end(), 0);
    std::shuffle(o.begin(), o.end(), rng);
    orders.push_back(o);
  }
  for (const auto& order : orders) {
    auto pool = make_pool(0, seg);
    std::vector<Block*> blocks;
    for (size_t i = 0; i < n; ++i) {
      Block* b = pool->allocate(seg / n);
      CHECK(b != nullptr);
      CHECK_EQ(HostPool::size(b), seg / n);
      blocks.push_back(b);
    }
    // Split in address order from the segment start: block i sits right after block i-1.
    for (size_t i = 1; i < n; ++i) CHECK_EQ(addr(blocks[i]), addr(blocks[i - 1]) + seg / n);
    const uintptr_t start = addr(blocks[0]);  // a freed block's handle is gone: read it now
    CHECK_EQ(pool->stats().num_backend_allocs, 1u);
    CHECK_EQ(pool->stats().bytes_in_use, seg);
    CHECK_EQ(pool->bytes_in_use(), seg);  // the one-counter read agrees
    CHECK_POOL(*pool);
    for (size_t i : order) {
      pool->free(blocks[i]);
      CHECK_POOL(*pool);  // includes "adjacent free blocks not coalesced"
    }
    PoolStats s = pool->stats();
    CHECK_EQ(s.bytes_in_use, 0u);
    CHECK_EQ(s.num_blocks_in_use, 0u);
    CHECK_EQ(s.bytes_reserved, seg);
    // The whole segment in one block: only possible if every neighbourhood coalesced.
    Block* whole = pool->allocate(seg);
    CHECK(whole != nullptr);
    CHECK_EQ(addr(whole), start);
    CHECK_EQ(pool->stats().num_backend_allocs, 1u);
    CHECK_EQ(pool->stats().num_segments, 1u);
    pool->free(whole);
    CHECK_POOL(*pool);
  }

  // Uneven sizes, partial frees, refill of a hole by a smaller block, then everything back.
  auto pool = make_pool(0, seg);
  Block* a = pool->allocate(1000);      // 1024
  Block* b = pool->allocate(5000);      // 5120
  Block* c = pool->allocate(300);       // 512
  Block* d = pool->allocate(70 * KiB);  // 71680
  CHECK_EQ(HostPool::size(a), 1024u);
  CHECK_EQ(HostPool::size(b), 5120u);
  CHECK_EQ(HostPool::size(c), 512u);
  CHECK_EQ(HostPool::size(d), 70 * KiB);
  const uintptr_t start = addr(a);
  pool->free(b);
  Block* e = pool->allocate(2048);  // fits in b's hole (best fit), leaving a 3072 hole
  CHECK_EQ(addr(e), addr(a) + 1024);
  CHECK_POOL(*pool);
  pool->free(a);
  pool->free(c);  // c merges with the 3072 hole: a 3584 hole between e and d
  CHECK_POOL(*pool);
  Block* f = pool->allocate(3584);
  CHECK_EQ(addr(f), addr(e) + 2048);
  pool->free(f);
  pool->free(e);  // a, e, f's space and the hole now one free run up to d
  pool->free(d);
  CHECK_POOL(*pool);
  Block* whole = pool->allocate(seg);
  CHECK_EQ(addr(whole), start);
  CHECK_EQ(pool->stats().num_backend_allocs, 1u);
  pool->free(whole);
  CHECK_POOL(*pool);
}

void test_alignment() {
  auto pool = make_pool(0, 4 * MiB);
  std::mt19937 rng(7);
  std::vector<Block*> live;
  for (size_t bytes : {size_t(0), size_t(1), size_t(7), size_t(511), size_t(512), size_t(513), size_t(4095),
                       size_t(4096), size_t(4097), size_t(100000)}) {
    Block* b = pool->allocate(bytes);
    CHECK(b != nullptr);
    CHECK_EQ(addr(b) % kAlignment, 0u);
    CHECK_EQ(HostPool::size(b) % kAlignment, 0u);
    CHECK_GE(HostPool::size(b), std::max<size_t>(bytes, 1));
    CHECK_LT(HostPool::size(b), std::max<size_t>(bytes, 1) + kAlignment);  // rounded to 512 only
    live.push_back(b);
  }
  for (int i = 0; i < 2000; ++i) {
    if (!live.empty() && rng() % 2) {
      size_t j = rng() % live.size();
      pool->free(live[j]);
      live[j] = live.back();
      live.pop_back();
    } else {
      size_t bytes = 1 + rng() % (20 * KiB);
      Block* b = pool->allocate(bytes);
      CHECK(b != nullptr);
      CHECK_EQ(addr(b) % kAlignment, 0u);
      CHECK_EQ(HostPool::size(b), round_up(bytes, kAlignment));
      live.push_back(b);
    }
  }
  CHECK_POOL(*pool);
  for (Block* b : live) pool->free(b);
  CHECK_POOL(*pool);
  PoolStats s = pool->stats();
  CHECK_EQ(s.bytes_in_use, 0u);
  CHECK_EQ(s.bytes_requested, 0u);
}

// Holes of 8 KiB, 2 KiB and 4 KiB (in address order), kept apart by live blocks.
void test_best_fit() {
  auto pool = make_pool(0, 1 * MiB);
  Block* h8 = pool->allocate(8 * KiB);
  Block* s1 = pool->allocate(512);
  Block* h2 = pool->allocate(2 * KiB);
  Block* s2 = pool->allocate(512);
  Block* h4 = pool->allocate(4 * KiB);
  Block* s3 = pool->allocate(512);
  Block* h4b = pool->allocate(4 * KiB);  // a second 4 KiB hole, at a higher address
  Block* s4 = pool->allocate(512);
  const uintptr_t a8 = addr(h8), a2 = addr(h2), a4 = addr(h4), a4b = addr(h4b);
  pool->free(h8);
  pool->free(h2);
  pool->free(h4);
  pool->free(h4b);
  CHECK_POOL(*pool);

  Block* x = pool->allocate(3 * KiB);  // smallest hole that fits: 4 KiB, the lower one first
  CHECK_EQ(addr(x), a4);
  Block* y = pool->allocate(2 * KiB);  // the exact 2 KiB hole, not the tail of the 4 KiB one
  CHECK_EQ(addr(y), a2);
  Block* z = pool->allocate(1 * KiB);  // the 1 KiB left of the split 4 KiB hole
  CHECK_EQ(addr(z), a4 + 3 * KiB);
  Block* w = pool->allocate(4 * KiB);  // the other 4 KiB hole, not the 8 KiB one
  CHECK_EQ(addr(w), a4b);
  Block* v = pool->allocate(5 * KiB);  // only the 8 KiB hole fits (the segment tail is bigger)
  CHECK_EQ(addr(v), a8);
  CHECK_EQ(pool->stats().num_backend_allocs, 1u);
  CHECK_POOL(*pool);
  for (Block* b : {x, y, z, w, v, s1, s2, s3, s4}) pool->free(b);
  CHECK_POOL(*pool);
  CHECK_EQ(pool->stats().bytes_in_use, 0u);
}

// A block freed with an incomplete event is not handed out again until the event completes.
void test_event_ordered_reuse() {
  auto pool = make_pool(0, 1 * MiB);
  Block* a = pool->allocate(64 * KiB);
  Block* guard = pool->allocate(512);  // keeps a from merging with the segment tail
  const uintptr_t aa = addr(a);
  auto ev = fence();
  pool->free(a, {ev});
  PoolStats s = pool->stats();
  CHECK_EQ(s.bytes_pending, 64 * KiB);
  CHECK_EQ(s.bytes_in_use, 512u);
  CHECK_EQ(pool->bytes_in_use(), 512u);  // a block waiting for its copy is pending, not in use
  CHECK_EQ(s.num_blocks_in_use, 1u);
  CHECK_POOL(*pool);
  // Everything else may be used, a's bytes may not.
  std::vector<Block*> others;
  for (size_t bytes : {64 * KiB, 64 * KiB, 32 * KiB, 512 * KiB}) {
    Block* b = pool->allocate(bytes);
    CHECK(b != nullptr);
    CHECK_MSG(!overlaps(a, b), "a block overlapping one whose copy has not finished was handed out");
    others.push_back(b);
  }
  CHECK_EQ(pool->stats().bytes_pending, 64 * KiB);
  // Events that are already complete, or null, do not make a block pending.
  Block* c = pool->allocate(1024);
  pool->free(c, {std::make_shared<FenceEvent>(true), nullptr});
  CHECK_EQ(pool->stats().bytes_pending, 64 * KiB);
  CHECK_POOL(*pool);
  // A pending block cannot be freed twice.
  bool threw = false;
  try {
    pool->free(a);
  } catch (const std::logic_error&) {
    threw = true;
  }
  CHECK(threw);

  ev->signal();
  s = pool->stats();  // stats() reclaims completed blocks
  CHECK_EQ(s.bytes_pending, 0u);
  CHECK_POOL(*pool);
  Block* again = pool->allocate(64 * KiB);
  CHECK_EQ(addr(again), aa);  // best fit: the exact 64 KiB hole a left
  pool->free(again);
  for (Block* b : others) pool->free(b);
  pool->free(guard);
  CHECK_POOL(*pool);

  // A block with several events is reusable only once all of them completed.
  Block* m = pool->allocate(4 * KiB);
  auto e1 = fence(), e2 = fence();
  pool->free(m, {e1, e2});
  e2->signal();
  CHECK_EQ(pool->stats().bytes_pending, 4 * KiB);
  e1->signal();
  CHECK_EQ(pool->stats().bytes_pending, 0u);
  CHECK_POOL(*pool);

  // synchronize() waits for pending copies (signalled here from another thread).
  Block* p = pool->allocate(4 * KiB);
  auto e3 = fence();
  pool->free(p, {e3});
  std::thread signaller([e3] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    e3->signal();
  });
  pool->synchronize();
  CHECK(e3->query());
  CHECK_EQ(pool->stats().bytes_pending, 0u);
  signaller.join();
  CHECK_POOL(*pool);
}

// One slow copy must not hold back the reuse of other blocks whose copies finished. The pool
// is full (cap == one segment), so allocate() itself has to find the reusable block.
void test_per_block_reuse() {
  const size_t seg = 64 * KiB, bs = 4 * KiB, n = seg / bs;
  auto pool = make_pool(/*max_bytes=*/seg, /*segment_bytes=*/seg);
  std::vector<Block*> blocks;
  for (size_t i = 0; i < n; ++i) blocks.push_back(pool->allocate(bs));
  for (Block* b : blocks) CHECK(b != nullptr);
  CHECK(pool->allocate(bs) == nullptr);  // full
  CHECK_EQ(pool->stats().num_cap_hits, 1u);

  auto slow = fence(), fast = fence(), fast2 = fence();
  const uintptr_t a_slow = addr(blocks[3]), a_fast = addr(blocks[7]), a_fast2 = addr(blocks[11]);
  pool->free(blocks[3], {slow});  // freed first: an oldest-first reclaim would stop here
  pool->free(blocks[7], {fast});
  pool->free(blocks[11], {fast2});
  CHECK(pool->allocate(bs) == nullptr);  // nothing has completed yet; allocate never blocks
  CHECK_EQ(pool->stats().num_cap_hits, 2u);
  CHECK_EQ(pool->stats().bytes_pending, 3 * bs);

  fast2->signal();
  Block* r = pool->allocate(bs);
  CHECK(r != nullptr);
  CHECK_EQ(addr(r), a_fast2);
  fast->signal();
  Block* r2 = pool->allocate(bs);
  CHECK(r2 != nullptr);
  CHECK_EQ(addr(r2), a_fast);
  CHECK(pool->allocate(bs) == nullptr);  // the slow one is still pending
  CHECK_EQ(pool->stats().bytes_pending, bs);
  CHECK_POOL(*pool);
  slow->signal();
  Block* r3 = pool->allocate(bs);
  CHECK(r3 != nullptr);
  CHECK_EQ(addr(r3), a_slow);
  CHECK_EQ(pool->stats().num_backend_allocs, 1u);
  CHECK_EQ(pool->stats().bytes_pending, 0u);
  blocks[3] = r3;
  blocks[7] = r2;
  blocks[11] = r;
  for (Block* b : blocks) pool->free(b);
  CHECK_POOL(*pool);
  CHECK_EQ(pool->stats().bytes_in_use, 0u);
}

void test_byte_cap() {
  // Segments of 1 MiB; a 1 MiB request is "large" (>= half a segment) and gets its own.
  const size_t cap = 4 * MiB;
  auto pool = make_pool(cap, 1 * MiB);
  std::vector<Block*> blocks;
  for (int i = 0; i < 4; ++i) {
    Block* b = pool->allocate(1 * MiB);
    CHECK(b != nullptr);
    blocks.push_back(b);
    CHECK_LE(pool->stats().bytes_reserved, cap);
  }
  PoolStats s = pool->stats();
  CHECK_EQ(s.bytes_reserved, cap);
  CHECK_EQ(s.max_bytes, cap);
  CHECK_EQ(s.num_cap_hits, 0u);
  CHECK(pool->allocate(512) == nullptr);
  CHECK(pool->allocate(1 * MiB) == nullptr);
  CHECK(pool->allocate(5 * MiB) == nullptr);
  s = pool->stats();
  CHECK_EQ(s.num_cap_hits, 3u);
  CHECK_EQ(s.num_allocs, 4u);
  CHECK_EQ(s.bytes_reserved, cap);
  CHECK_POOL(*pool);

  // Two whole segments free: a 2 MiB request needs one contiguous segment, so the pool must
  // give the free ones back to make room under the cap.
  pool->free(blocks[1]);
  pool->free(blocks[2]);
  Block* big = pool->allocate(2 * MiB);
  CHECK(big != nullptr);
  s = pool->stats();
  CHECK_EQ(s.bytes_reserved, cap);
  // Retired, not released: allocate runs in forward under the pool lock, and a pinned release
  // (cudaFreeHost) synchronizes the device. They go back at release_retired (end of backward).
  CHECK_EQ(s.num_backend_frees, 0u);
  CHECK_EQ(s.bytes_retired, 2 * MiB);
  CHECK_EQ(s.num_segments, 3u);
  CHECK_POOL(*pool);
  CHECK_EQ(pool->release_retired(), 2 * MiB);
  s = pool->stats();
  CHECK_EQ(s.num_backend_frees, 2u);
  CHECK_EQ(s.bytes_retired, 0u);
  CHECK_EQ(pool->release_retired(), 0u);

  // empty_cache() returns wholly free segments only, and reports how much it released.
  pool->free(blocks[0]);
  CHECK_EQ(pool->empty_cache(), 1 * MiB);
  s = pool->stats();
  CHECK_EQ(s.bytes_reserved, 3 * MiB);
  CHECK_EQ(s.num_segments, 2u);
  CHECK_EQ(pool->empty_cache(), 0u);  // nothing left that is wholly free
  // Room again under the cap: growth continues.
  Block* again = pool->allocate(1 * MiB);
  CHECK(again != nullptr);
  CHECK_EQ(pool->stats().bytes_reserved, cap);
  CHECK_POOL(*pool);

  // A pending block keeps its segment: empty_cache must not release memory a copy still uses.
  auto ev = fence();
  pool->free(again, {ev});
  CHECK_EQ(pool->empty_cache(), 0u);
  CHECK_EQ(pool->stats().bytes_pending, 1 * MiB);
  ev->signal();
  CHECK_EQ(pool->empty_cache(), 1 * MiB);
  CHECK_POOL(*pool);

  pool->free(big);
  pool->free(blocks[3]);
  CHECK_EQ(pool->empty_cache(), 3 * MiB);
  s = pool->stats();
  CHECK_EQ(s.bytes_reserved, 0u);
  CHECK_EQ(s.num_segments, 0u);
  CHECK_EQ(s.num_backend_allocs, s.num_backend_frees);
  CHECK_POOL(*pool);

  // Small requests under a cap that is not a multiple of the segment size: the last segment is
  // trimmed to what is left, never past the cap.
  auto odd = make_pool(/*max_bytes=*/2 * MiB + 100 * KiB, /*segment_bytes=*/1 * MiB);
  std::vector<Block*> smalls;
  for (;;) {
    Block* b = odd->allocate(60 * KiB);
    if (!b) break;
    smalls.push_back(b);
    CHECK_LE(odd->stats().bytes_reserved, 2 * MiB + 100 * KiB);
  }
  s = odd->stats();
  CHECK_EQ(s.num_cap_hits, 1u);
  CHECK_EQ(smalls.size(), size_t(2 * (MiB / (60 * KiB)) + 1));  // 17 per 1 MiB segment, one in the 100 KiB tail
  CHECK_LE(s.bytes_reserved, 2 * MiB + 100 * KiB);
  CHECK_POOL(*odd);
  for (Block* b : smalls) odd->free(b);
  CHECK_POOL(*odd);

  // Raising the cap lets growth continue; lowering it stops growth but breaks nothing.
  auto p2 = make_pool(/*max_bytes=*/1 * MiB, /*segment_bytes=*/1 * MiB);
  Block* b1 = p2->allocate(1 * MiB);
  CHECK(b1 != nullptr);
  CHECK(p2->allocate(1 * MiB) == nullptr);
  p2->set_max_bytes(2 * MiB);
  CHECK_EQ(p2->stats().max_bytes, 2 * MiB);
  Block* b2 = p2->allocate(1 * MiB);
  CHECK(b2 != nullptr);
  p2->set_max_bytes(0);  // no cap
  Block* b3 = p2->allocate(8 * MiB);
  CHECK(b3 != nullptr);
  CHECK_POOL(*p2);
  for (Block* b : {b1, b2, b3}) p2->free(b);
  CHECK_POOL(*p2);
}

// Requests are rounded to 512 bytes, not to a power of two: 129.5 MB takes about 129.5 MB.
void test_reserved_close_to_requested() {
  auto pool = make_pool();
  const size_t req = size_t(129.5 * 1000 * 1000);
  Block* b = pool->allocate(req);
  CHECK(b != nullptr);
  PoolStats s = pool->stats();
  CHECK_EQ(s.bytes_requested, req);
  CHECK_GE(s.bytes_reserved, req);
  CHECK_LT(double(s.bytes_reserved), 1.01 * double(req));
  CHECK_LT(double(s.bytes_in_use), 1.01 * double(req));
  CHECK_EQ(s.num_segments, 1u);
  pool->free(b);
  CHECK_EQ(pool->empty_cache(), s.bytes_reserved);

  // The same in MiB, and for a size just over a power of two.
  for (size_t r : {size_t(129.5 * MiB), size_t(64 * MiB + 1), size_t(33 * MiB + 3)}) {
    Block* x = pool->allocate(r);
    CHECK(x != nullptr);
    CHECK_LT(double(pool->stats().bytes_reserved), 1.01 * double(r));
    pool->free(x);
    pool->empty_cache();
  }
  CHECK_POOL(*pool);
}

// A request of at least half a segment gets a segment of its own (page-rounded) size when the
// pool has to grow for it; small requests share segments of segment_bytes.
void test_large_requests_own_segment() {
  auto pool = make_pool(0, 1 * MiB);
  Block* small = pool->allocate(1000);
  CHECK_EQ(pool->stats().bytes_reserved, 1 * MiB);
  const size_t large_seg = round_up(3 * MiB + 100, kSegmentAlignment);
  Block* large = pool->allocate(3 * MiB + 100);
  PoolStats s = pool->stats();
  CHECK_EQ(s.num_segments, 2u);
  CHECK_EQ(s.bytes_reserved, 1 * MiB + large_seg);
  // The large segment's page-rounding tail (3584 bytes) is an ordinary free block: best fit
  // puts the next small request there rather than into the big shared one.
  Block* small2 = pool->allocate(1000);
  CHECK_EQ(addr(small2), addr(large) + 3 * MiB + 512);
  Block* filler = pool->allocate(1 * MiB - 1024);  // exactly the rest of the shared segment
  CHECK_EQ(addr(filler), addr(small) + 1024);
  CHECK_EQ(pool->stats().num_segments, 2u);
  // Exactly half a segment counts as large: 512 KiB reserved, not a whole 1 MiB segment.
  Block* half = pool->allocate(512 * KiB);
  s = pool->stats();
  CHECK_EQ(s.num_segments, 3u);
  CHECK_EQ(s.bytes_reserved, 1 * MiB + large_seg + 512 * KiB);
  CHECK_POOL(*pool);
  // Freed, the large segments are wholly free and go back with empty_cache.
  pool->free(large);
  CHECK_EQ(pool->empty_cache(), 0u);  // small2 still lives in the large segment
  pool->free(small2);
  pool->free(half);
  CHECK_EQ(pool->empty_cache(), large_seg + 512 * KiB);
  CHECK_EQ(pool->stats().num_segments, 1u);
  pool->free(small);
  pool->free(filler);
  CHECK_EQ(pool->empty_cache(), 1 * MiB);
  CHECK_POOL(*pool);
}

void test_stats_and_peaks() {
  auto pool = make_pool(0, 1 * MiB);
  PoolStats s = pool->stats();
  CHECK_EQ(s.bytes_reserved, 0u);
  CHECK_EQ(s.num_segments, 0u);
  Block* a = pool->allocate(1000);
  Block* b = pool->allocate(3000);
  s = pool->stats();
  CHECK_EQ(s.bytes_in_use, 1024u + 3072u);
  CHECK_EQ(s.bytes_requested, 4000u);
  CHECK_EQ(s.num_blocks_in_use, 2u);
  CHECK_EQ(s.num_allocs, 2u);
  CHECK_EQ(s.peak_bytes_in_use, 4096u);
  CHECK_EQ(s.peak_bytes_reserved, 1 * MiB);
  pool->free(a);
  s = pool->stats();
  CHECK_EQ(s.bytes_in_use, 3072u);
  CHECK_EQ(s.bytes_requested, 3000u);
  CHECK_EQ(s.num_frees, 1u);
  CHECK_EQ(s.peak_bytes_in_use, 4096u);  // peaks stay until reset
  pool->reset_peak();
  s = pool->stats();
  CHECK_EQ(s.peak_bytes_in_use, 3072u);
  CHECK_EQ(s.peak_bytes_reserved, 1 * MiB);
  Block* big = pool->allocate(2 * MiB);
  pool->free(big);
  s = pool->stats();
  CHECK_EQ(s.peak_bytes_in_use, 3072u + 2 * MiB);
  CHECK_EQ(s.peak_bytes_reserved, 3 * MiB);
  CHECK_EQ(pool->empty_cache(), 2 * MiB);
  s = pool->stats();
  CHECK_EQ(s.bytes_reserved, 1 * MiB);
  CHECK_EQ(s.peak_bytes_reserved, 3 * MiB);
  pool->reset_peak();
  CHECK_EQ(pool->stats().peak_bytes_reserved, 1 * MiB);
  pool->free(b);
  s = pool->stats();
  CHECK_EQ(s.bytes_in_use, 0u);
  CHECK_EQ(s.bytes_requested, 0u);
  CHECK_EQ(s.num_blocks_in_use, 0u);
  CHECK_EQ(s.num_allocs, 3u);
  CHECK_EQ(s.num_frees, 3u);
  CHECK_EQ(pool->empty_cache(), 1 * MiB);
  s = pool->stats();
  CHECK_EQ(s.num_backend_allocs, 2u);
  CHECK_EQ(s.num_backend_frees, 2u);
  CHECK_EQ(std::string(pool->backend_name()), "pageable");
  CHECK_EQ(pool->segment_bytes(), 1 * MiB);
  // Segment sizes are whole pages.
  CHECK_EQ(make_pool(0, 1000)->segment_bytes(), kSegmentAlignment);
  CHECK_EQ(make_pool(0, 5000)->segment_bytes(), 2 * kSegmentAlignment);
  pool->free(nullptr);  // a no-op, like free(nullptr)
  CHECK_POOL(*pool);
}

// A backend that can be told to refuse, and counts what it hands out.
class FlakyBackend final : public Backend {
 public:
  explicit FlakyBackend(size_t* outstanding) : outstanding_(outstanding) {}
  void* allocate(size_t bytes) override {
    if (bytes > limit) return nullptr;
    *outstanding_ += bytes;
    return inner_.allocate(bytes);
  }
  void release(void* ptr, size_t bytes) override {
    *outstanding_ -= bytes;
    inner_.release(ptr, bytes);
  }
  const char* name() const override { return "flaky"; }
  size_t limit = std::numeric_limits<size_t>::max();

 private:
  PageableBackend inner_;
  size_t* outstanding_;
};

// A backend that cannot give memory makes allocate() return nullptr; when it cannot give a
// whole shared segment the pool asks for just what the request needs.
void test_backend_failure() {
  size_t outstanding = 0;
  {
    auto backend = std::make_unique<FlakyBackend>(&outstanding);
    FlakyBackend* fb = backend.get();
    HostPool pool(std::move(backend), 0, 1 * MiB);
    fb->limit = 64 * KiB;
    Block* b = pool.allocate(10 * KiB);  // a 1 MiB segment is refused, a 12 KiB one is not
    CHECK(b != nullptr);
    PoolStats s = pool.stats();
    CHECK_EQ(s.bytes_reserved, round_up(10 * KiB, kSegmentAlignment));
    CHECK_EQ(outstanding, s.bytes_reserved);
    CHECK(pool.allocate(100 * KiB) == nullptr);
    CHECK_EQ(pool.stats().num_cap_hits, 1u);
    CHECK_POOL(pool);
    fb->limit = std::numeric_limits<size_t>::max();
    Block* c = pool.allocate(100 * KiB);
    CHECK(c != nullptr);
    CHECK_EQ(std::string(pool.backend_name()), "flaky");
    pool.free(b);
    pool.free(c);
    CHECK_POOL(pool);
  }
  CHECK_EQ(outstanding, 0u);  // the destructor gave every segment back
}

// A request no machine can satisfy fails cleanly instead of wrapping around in the rounding.
void test_huge_request() {
  size_t outstanding = 0;
  for (size_t cap : {size_t(0), size_t(1 * MiB)}) {
    auto backend = std::make_unique<FlakyBackend>(&outstanding);
    backend->limit = size_t(1) << 30;  // refuse absurd sizes here rather than in the allocator
    HostPool pool(std::move(backend), cap);
    Block* keep = pool.allocate(1000);
    CHECK(keep != nullptr);
    const size_t reserved = pool.stats().bytes_reserved;
    const size_t kMax = std::numeric_limits<size_t>::max();
    for (size_t bytes : {kMax, kMax - 100, kMax - 4096, kMax - kDefaultSegmentBytes, kMax / 2 + 1}) {
      Block* b = pool.allocate(bytes);
      CHECK_MSG(b == nullptr, "allocate(" << bytes << ") returned a block of " << (b ? HostPool::size(b) : 0)
                                          << " bytes (cap " << cap << ")");
      CHECK_POOL(pool);
    }
    PoolStats s = pool.stats();
    CHECK_EQ(s.num_cap_hits, 5u);
    CHECK_EQ(s.bytes_requested, 1000u);
    CHECK_EQ(s.bytes_reserved, reserved);  // nothing was taken from the backend for them
    CHECK_EQ(s.num_backend_allocs, 1u);
    pool.free(keep);
  }
  CHECK_EQ(outstanding, 0u);
}

// synchronize() waits for pending copies, but other threads keep allocating and freeing
// meanwhile: allocate() never blocks on a copy, not even behind another thread's synchronize().
void test_synchronize_does_not_block_others() {
  auto pool = make_pool(0, 1 * MiB);
  Block* a = pool->allocate(4 * KiB);
  auto ev = fence();
  pool->free(a, {ev});
  std::atomic<bool> synced{false};
  std::thread syncer([&] {
    pool->synchronize();
    synced = true;
  });
  // Let the syncer reach its wait (a free fence it cannot get past).
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::atomic<bool> allocated{false};
  std::thread watchdog([&] {
    // If allocate() were stuck behind synchronize(), this is what would unstick it.
    for (int i = 0; i < 200 && !allocated; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ev->signal();
  });
  const auto t0 = std::chrono::steady_clock::now();
  Block* b = pool->allocate(4 * KiB);
  pool->free(b);
  PoolStats s = pool->stats();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  allocated = true;
  CHECK(b != nullptr);
  CHECK_MSG(!ev->query(),
            "allocate()/free()/stats() waited for a copy another thread was synchronizing on (" << ms << " ms)");
  CHECK_EQ(s.bytes_pending, 4 * KiB);
  CHECK(!synced.load());
  watchdog.join();
  syncer.join();
  CHECK(synced.load());
  CHECK_EQ(pool->stats().bytes_pending, 0u);
  CHECK_POOL(*pool);
}

// Destroying a pool with pending blocks waits for their copies before releasing the memory.
void test_destroy_with_pending() {
  auto pool = make_pool(0, 1 * MiB);
  Block* a = pool->allocate(4 * KiB);
  auto ev = fence();
  pool->free(a, {ev});
  std::thread signaller([ev] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ev->signal();
  });
  pool.reset();
  CHECK(ev->query());
  signaller.join();
}

// reserve() takes one segment of the asked size now; later allocations inside it need no backend
// call; the cap and absurd sizes refuse it.
void test_reserve() {
  auto pool = make_pool(0, 64 * MiB);
  CHECK_EQ(pool->reserve(3 * MiB + 1), 3 * MiB + 4096);
  CHECK_EQ(pool->stats().num_backend_allocs, 1u);
  CHECK_EQ(pool->stats().bytes_reserved, 3 * MiB + 4096);
  Block* a = pool->allocate(1 * MiB);
  Block* b = pool->allocate(2 * MiB);
  CHECK(a && b);
  CHECK_EQ(pool->stats().num_backend_allocs, 1u);
  pool->free(a);
  pool->free(b);
  CHECK_POOL(*pool);
  auto capped = make_pool(1 * MiB, 64 * MiB);
  CHECK_EQ(capped->reserve(2 * MiB), 0u);
  CHECK_EQ(capped->reserve(512 * KiB), 512 * KiB);
  CHECK_EQ(capped->reserve(0), 0u);
  CHECK_EQ(capped->reserve(std::numeric_limits<size_t>::max()), 0u);
  CHECK(capped->stats().bytes_reserved <= 1 * MiB);

  // Near the cap, reserve() makes room by releasing a wholly free segment; it still returns the
  // size of the segment it took (it used to return the net growth: 12 KiB for 16 KiB asked).
  auto tight = make_pool(32 * KiB, 16 * KiB);
  Block* live = tight->allocate(1);  // a 16 KiB segment, in use
  CHECK(live);
  CHECK_EQ(tight->reserve(1), 4 * KiB);  // a free 4 KiB segment: 20 KiB reserved
  CHECK_EQ(tight->reserve(12 * KiB + 1), 16 * KiB);
  CHECK_EQ(tight->stats().bytes_reserved, 32 * KiB);  // the free 4 KiB segment went back
  tight->free(live);
  CHECK_POOL(*tight);
}

}  // namespace

// Note [Recent blocks]: a block freed with nothing pending is what the next allocation of its
// exact size gets; any other size gives the recent blocks back to the allocator first, so best
// fit, coalescing, the cap and empty_cache see them as free space.
void test_recent_blocks() {
  const size_t seg = 256 * KiB;
  {
    auto pool = make_pool(0, seg);
    Block* guard = pool->allocate(512);
    Block* a = pool->allocate(4 * KiB);
    Block* b = pool->allocate(4 * KiB);
    const uintptr_t aa = addr(a), ab = addr(b);
    pool->free(a);
    pool->free(b);
    CHECK_POOL(*pool);  // recent blocks: allocated ranges, off the live list, counted once
    CHECK_EQ(pool->stats().bytes_in_use, 512u);
    Block* c = pool->allocate(4 * KiB);  // the newest recent block of that size
    CHECK_EQ(addr(c), ab);
    Block* d = pool->allocate(3 * KiB + 100);  // rounds to 3.5 KiB: another size -> best fit over all
    CHECK_EQ(addr(d), aa);                     // a's 4 KiB hole, coalesced back into the allocator
    CHECK_POOL(*pool);
    pool->free(c);
    pool->free(d);
    pool->free(guard);
    Block* whole = pool->allocate(seg);  // every recent block coalesced: the whole segment again
    CHECK(whole != nullptr);
    CHECK_EQ(pool->stats().num_backend_allocs, 1u);
    pool->free(whole);
    CHECK_POOL(*pool);
    CHECK_EQ(pool->empty_cache(), seg);  // a segment holding only recent blocks is given back
    CHECK_EQ(pool->stats().bytes_reserved, 0u);
  }
  {
    // At the cap, a request of another size is served from the recent blocks' space, never
    // refused while they could serve it.
    auto pool = make_pool(/*max_bytes=*/seg, seg);
    std::vector<Block*> blocks;
    for (size_t i = 0; i < seg / (8 * KiB); ++i) blocks.push_back(pool->allocate(8 * KiB));
    for (Block* x : blocks) CHECK(x != nullptr);
    CHECK(pool->allocate(512) == nullptr);  // full
    for (Block* x : blocks) pool->free(x);
    Block* big = pool->allocate(seg);
    CHECK(big != nullptr);
    CHECK_EQ(pool->stats().num_backend_allocs, 1u);
    pool->free(big);
    CHECK_POOL(*pool);
  }
  {
    // A block freed while a copy may still touch it is pending, never recent.
    auto pool = make_pool(0, seg);
    Block* a = pool->allocate(4 * KiB);
    auto ev = fence();
    pool->free(a, {ev});
    CHECK_EQ(pool->stats().bytes_pending, 4 * KiB);
    Block* b = pool->allocate(4 * KiB);
    CHECK_MSG(!overlaps(a, b), "a block whose copy has not finished was handed out");
    ev->signal();
    pool->free(b);
    CHECK_POOL(*pool);
  }
  {
    // Many sizes and many blocks of one size: the lists are bounded, the rest goes straight back.
    auto pool = make_pool(0, 4 * MiB);
    std::vector<Block*> blocks;
    for (size_t i = 1; i <= 30; ++i)  // more sizes than the lists hold
      for (int k = 0; k < 8; ++k) blocks.push_back(pool->allocate(i * 512));
    for (int k = 0; k < 24; ++k) blocks.push_back(pool->allocate(16 * KiB));  // more than one list holds
    for (Block* x : blocks) pool->free(x);
    CHECK_POOL(*pool);
    CHECK_EQ(pool->stats().bytes_in_use, 0u);
    Block* whole = pool->allocate(4 * MiB);
    CHECK(whole != nullptr);
    CHECK_EQ(pool->stats().num_backend_allocs, 1u);
    pool->free(whole);
    CHECK_POOL(*pool);
  }
}

int main() {
  check::run("split_and_coalesce", test_split_and_coalesce);
  check::run("alignment", test_alignment);
  check::run("best_fit", test_best_fit);
  check::run("event_ordered_reuse", test_event_ordered_reuse);
  check::run("per_block_reuse", test_per_block_reuse);
  check::run("byte_cap", test_byte_cap);
  check::run("reserved_close_to_requested", test_reserved_close_to_requested);
  check::run("large_requests_own_segment", test_large_requests_own_segment);
  check::run("stats_and_peaks", test_stats_and_peaks);
  check::run("backend_failure", test_backend_failure);
  check::run("huge_request", test_huge_request);
  check::run("synchronize_does_not_block_others", test_synchronize_does_not_block_others);
  check::run("destroy_with_pending", test_destroy_with_pending);
  check::run("reserve", test_reserve);
  check::run("recent_blocks", test_recent_blocks);
  std::printf("all HostPool tests passed\n");
  return 0;
}

// HostPool under many threads: random allocate/free of random sizes, some frees ordered after
// events that complete later. Every thread stamps its blocks and checks the stamps before it
// gives a block back (or before it lets a pending block's "copy" complete), so two blocks that
// overlap, or a pending block handed out early, show up as a clobbered stamp.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
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

struct Live {
  Block* block;
  size_t requested;
  uint64_t tag;
};

// One stamp per 512-byte step plus one at the end: any two overlapping blocks share the
// aligned address where the later one starts, so they share a stamp slot.
bool has_tail_stamp(size_t requested) {
  // The tail stamp is skipped where it would partly overwrite the last step's stamp.
  const size_t tail = requested - 8;
  return tail % kAlignment == 0 || tail % kAlignment >= 8;
}

void stamp(const Live& l) {
  char* p = static_cast<char*>(HostPool::data(l.block));
  if (l.requested < sizeof(uint64_t)) {
    std::memcpy(p, &l.tag, l.requested);
    return;
  }
  for (size_t off = 0; off + sizeof(uint64_t) <= l.requested; off += kAlignment) std::memcpy(p + off, &l.tag, 8);
  if (has_tail_stamp(l.requested)) std::memcpy(p + l.requested - 8, &l.tag, 8);
}

bool stamped(const Live& l) {
  const char* p = static_cast<const char*>(HostPool::data(l.block));
  if (l.requested < sizeof(uint64_t)) return std::memcmp(p, &l.tag, l.requested) == 0;
  for (size_t off = 0; off + sizeof(uint64_t) <= l.requested; off += kAlignment)
    if (std::memcmp(p + off, &l.tag, 8) != 0) return false;
  return !has_tail_stamp(l.requested) || std::memcmp(p + l.requested - 8, &l.tag, 8) == 0;
}

size_t random_size(std::mt19937_64& rng) {
  const unsigned r = rng() % 1000;
  if (r < 5) return 256 * KiB + rng() % (2 * MiB);  // large: may get a segment of its own
  if (r < 20) return 1 + rng() % 8;                 // tiny, below one stamp
  return 1 + rng() % (size_t(1) << (rng() % 17));   // log-uniform up to 64 KiB
}

struct Options {
  int threads = 8;
  int ops = 20000;
  size_t max_bytes = 0;
  size_t segment_bytes = 1 * MiB;
  size_t max_live = 48;
};

void run_threads(const Options& opt, const char* label) {
  HostPool pool(std::make_unique<PageableBackend>(), opt.max_bytes, opt.segment_bytes);
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> reused_pending{0};
  auto worker = [&](int tid) {
    std::mt19937_64 rng(0x9e3779b97f4a7c15ull * (tid + 1));
    std::vector<Live> live;
    struct Pending {
      Live l;
      std::shared_ptr<FenceEvent> ev;
      int due;
    };
    std::deque<Pending> pending;  // freed, "copy" still running
    uint64_t counter = 0;
    auto complete_pending = [&](bool all, int op) {
      while (!pending.empty() && (all || pending.front().due <= op)) {
        Pending& p = pending.front();
        // The block was given back, but its copy is still running: nobody may have reused it.
        CHECK_MSG(stamped(p.l), "thread " << tid << ": a pending block was reused before its event completed");
        p.ev->signal();
        pending.pop_front();
        reused_pending++;
      }
    };
    for (int op = 0; op < opt.ops; ++op) {
      complete_pending(false, op);
      const bool do_alloc = live.empty() || (live.size() < opt.max_live && rng() % 2);
      if (do_alloc) {
        const size_t bytes = random_size(rng);
        Block* b = pool.allocate(bytes);
        if (!b) {
          CHECK_MSG(opt.max_bytes != 0, "allocate(" << bytes << ") failed without a cap");
          refused++;
          if (!live.empty()) {  // make room: give one back
            const size_t j = rng() % live.size();
            CHECK(stamped(live[j]));
            pool.free(live[j].block);
            live[j] = live.back();
            live.pop_back();
          }
          continue;
        }
        CHECK_EQ(reinterpret_cast<uintptr_t>(HostPool::data(b)) % kAlignment, 0u);
        CHECK_GE(HostPool::size(b), bytes);
        Live l{b, bytes, (uint64_t(tid + 1) << 48) | ++counter};
        stamp(l);
        live.push_back(l);
      } else {
        const size_t j = rng() % live.size();
        Live l = live[j];
        live[j] = live.back();
        live.pop_back();
        CHECK_MSG(stamped(l), "thread " << tid << ": block " << HostPool::data(l.block) << " (" << l.requested
                                        << " bytes) was overwritten: it overlaps another live block");
        if (rng() % 8 == 0) {
          auto ev = std::make_shared<FenceEvent>(false);
          pool.free(l.block, {ev});
          pending.push_back({l, ev, op + 1 + int(rng() % 64)});
        } else {
          pool.free(l.block);
        }
      }
      const unsigned r = rng() % 4096;
      if (r == 0) {
        PoolStats s = pool.stats();
        if (opt.max_bytes) CHECK_LE(s.bytes_reserved, opt.max_bytes);
      } else if (r == 1 && tid == 0) {
        pool.empty_cache();
      } else if (r == 2 && tid == 1) {
        CHECK_POOL(pool);
      }
    }
    complete_pending(true, opt.ops);
    for (const Live& l : live) {
      CHECK(stamped(l));
      pool.free(l.block);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < opt.threads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();

  CHECK_POOL(pool);
  PoolStats s = pool.stats();
  CHECK_EQ(s.bytes_in_use, 0u);
  CHECK_EQ(s.bytes_requested, 0u);
  CHECK_EQ(s.bytes_pending, 0u);
  CHECK_EQ(s.num_blocks_in_use, 0u);
  CHECK_EQ(s.num_allocs, s.num_frees);
  CHECK_EQ(s.num_cap_hits, refused.load());
  if (opt.max_bytes) {
    CHECK_LE(s.bytes_reserved, opt.max_bytes);
    CHECK_LE(s.peak_bytes_reserved, opt.max_bytes);
  }
  // Everything is free: every segment must have coalesced back into one block. Segments retired
  // by growth at the cap (HostPool::release_retired) are given back here too.
  CHECK_EQ(pool.empty_cache(), s.bytes_reserved + s.bytes_retired);
  s = pool.stats();
  CHECK_EQ(s.bytes_reserved, 0u);
  CHECK_EQ(s.bytes_retired, 0u);
  CHECK_EQ(s.num_segments, 0u);
  std::printf("  %s: %llu allocs, %llu refused by the cap, %llu pending frees, %llu segments allocated\n", label,
              (unsigned long long)s.num_allocs, (unsigned long long)refused.load(),
              (unsigned long long)reused_pending.load(), (unsigned long long)s.num_backend_allocs);
}

}  // namespace

int main() {
  check::run("threads_no_cap", [] {
    Options opt;  // 8 threads x 20000 ops
    run_threads(opt, "no cap");
  });
  check::run("threads_with_cap", [] {
    // Tight enough that allocations get refused and segments get released to make room.
    Options opt;
    opt.ops = 10000;
    opt.max_bytes = 4 * MiB;
    opt.segment_bytes = 512 * KiB;
    opt.max_live = 24;
    run_threads(opt, "4 MiB cap");
  });
  std::printf("all HostPool thread tests passed\n");
  return 0;
}

// BlockAllocator: best fit, split and coalesce, region removal, and a random workload checked
// against a byte map (no two live ranges overlap; every byte of a region is free or owned once).
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "block_allocator.h"
#include "check.h"

using namespace ckpt_offload;
using Range = BlockAllocator::Range;

#define CHECK_ALLOC(a)                                                                                                \
  do {                                                                                                                \
    std::string check_why_;                                                                                           \
    if (!(a).check_invariants(&check_why_)) ::check::fail(__FILE__, __LINE__, "allocator invariants: " + check_why_); \
  } while (0)

namespace {

void test_best_fit_split_coalesce() {
  BlockAllocator a(512);
  a.add_region(0, 8192);
  Range r1, r2, r3;
  CHECK(a.allocate(1, &r1));
  CHECK_EQ(r1.size, 512u);
  CHECK_EQ(r1.offset, 0u);
  CHECK(a.allocate(1000, &r2));
  CHECK_EQ(r2.size, 1024u);
  CHECK_EQ(r2.offset, 512u);
  CHECK(a.allocate(512, &r3));
  CHECK_EQ(r3.offset, 1536u);
  CHECK_EQ(a.free_bytes(), 8192u - 2048u);
  CHECK_ALLOC(a);
  // A hole of 1024 between r1 and r3: a 1024 request takes it (best fit), not the tail.
  a.free(r2);
  Range r4;
  CHECK(a.allocate(1024, &r4));
  CHECK_EQ(r4.offset, 512u);
  // Freeing everything coalesces back to one free range spanning the region.
  a.free(r1);
  a.free(r3);
  a.free(r4);
  CHECK_ALLOC(a);
  CHECK(a.region_is_free(0));
  Range all;
  CHECK(a.allocate(8192, &all));
  CHECK(!a.allocate(1, &r1));  // full
  a.free(all);
  bool threw = false;
  try {
    a.free(all);  // twice
  } catch (const std::logic_error&) {
    threw = true;
  }
  CHECK(threw);
}

void test_regions() {
  BlockAllocator a(4096);
  a.add_region(3, 4096 * 4);
  a.add_region(1, 4096 * 4);
  Range r;
  CHECK(a.allocate(4096, &r));
  CHECK_EQ(r.region, 1u);  // ties go to the lowest region
  CHECK(!a.region_is_free(1));
  CHECK(a.region_is_free(3));
  a.remove_region(3);
  CHECK_EQ(a.num_regions(), 1u);
  CHECK_EQ(a.free_bytes(), 4096u * 3);
  bool threw = false;
  try {
    a.remove_region(1);  // in use
  } catch (const std::logic_error&) {
    threw = true;
  }
  CHECK(threw);
  a.free(r);
  CHECK_ALLOC(a);
  Range big;
  CHECK(!a.allocate(4096 * 5, &big));
  CHECK(!a.allocate(~uint64_t(0), &big));  // rounding must not wrap to a tiny request
}

void test_random() {
  constexpr uint64_t kAlign = 512, kRegion = 64 * kAlign;
  constexpr uint32_t kRegions = 4;
  BlockAllocator a(kAlign);
  std::vector<std::vector<int>> owner(kRegions, std::vector<int>(kRegion / kAlign, -1));
  for (uint32_t i = 0; i < kRegions; ++i) a.add_region(i, kRegion);
  std::mt19937_64 rng(7);
  std::vector<Range> live;
  int next_id = 0;
  std::vector<int> ids;
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 2) {
      Range r;
      const uint64_t bytes = 1 + rng() % (kAlign * 12);
      if (!a.allocate(bytes, &r)) continue;
      CHECK_GE(r.size, bytes);
      CHECK_EQ(r.size % kAlign, 0u);
      CHECK_LE(r.offset + r.size, kRegion);
      for (uint64_t o = r.offset; o < r.offset + r.size; o += kAlign) {
        CHECK_MSG(owner[r.region][o / kAlign] == -1, "range overlaps a live one at step " << step);
        owner[r.region][o / kAlign] = next_id;
      }
      live.push_back(r);
      ids.push_back(next_id++);
    } else {
      const size_t i = rng() % live.size();
      const Range r = live[i];
      for (uint64_t o = r.offset; o < r.offset + r.size; o += kAlign) {
        CHECK_EQ(owner[r.region][o / kAlign], ids[i]);
        owner[r.region][o / kAlign] = -1;
      }
      a.free(r);
      live[i] = live.back();
      live.pop_back();
      ids[i] = ids.back();
      ids.pop_back();
    }
    if (step % 997 == 0) CHECK_ALLOC(a);
  }
  for (const Range& r : live) a.free(r);
  CHECK_ALLOC(a);
  CHECK_EQ(a.free_bytes(), kRegion * kRegions);
  for (uint32_t i = 0; i < kRegions; ++i) CHECK(a.region_is_free(i));
}

}  // namespace

int main() {
  check::run("best_fit_split_coalesce", test_best_fit_split_coalesce);
  check::run("regions", test_regions);
  check::run("random", test_random);
  return 0;
}

// Spilling (spill.h) over the CPU model of stream="side": a capped pool, a staging pool, a
// FileTier, a WorkerStream with an injected delay as the copy stream. Checks that blocks the
// pool refuses go to disk and come back bit for bit, that a spill write reads its staging
// block only after the (slow) D2H copy has filled it, that staging memory is bounded by the
// throttle, that read-backs use the pool when it has room, that a full tier is reported as
// such, and that the registry forgets dead pools.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "copy_engine.h"
#include "cpu_stream.h"
#include "file_tier.h"
#include "host_pool.h"
#include "spill.h"

using namespace ckpt_offload;

namespace {

constexpr size_t KiB = size_t(1) << 10;
constexpr size_t MiB = size_t(1) << 20;

struct TempDir {
  std::string path;
  TempDir() {
    char name[] = "/tmp/ckpt_offload_spill_XXXXXX";
    CHECK(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() { ::rmdir(path.c_str()); }
};

std::shared_ptr<HostPool> make_pool(size_t max_bytes) {
  return std::make_shared<HostPool>(std::make_unique<PageableBackend>(), max_bytes, 256 * KiB);
}

std::vector<char> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

struct Rig {
  TempDir dir;
  std::shared_ptr<HostPool> pool, staging;
  std::shared_ptr<FileTier> tier;
  std::shared_ptr<SpillTarget> target;
  InlineStream compute;
  WorkerStream copy{/*delay_us=*/2000};
  CopyEngine engine;

  Rig(size_t pool_cap, size_t staging_bytes, size_t tier_cap = 0) {
    pool = make_pool(pool_cap);
    staging = make_pool(0);
    FileTierOptions o;
    o.dir = dir.path;
    o.max_bytes = tier_cap;
    o.file_bytes = 1 * MiB;
    o.chunk_bytes = 64 * KiB;
    tier = FileTier::create(o);
    target = std::make_shared<SpillTarget>(tier, staging, staging_bytes);
    attach_spill(pool, target);
  }
  ~Rig() {
    copy.drain();
    tier->synchronize();
    attach_spill(pool, nullptr);
  }

  std::shared_ptr<TieredBuffer> offload(const std::vector<char>& src, TieredRefusal* why, uint64_t handle = 0) {
    return offload_tiered(
        pool, handle,
        [&](const std::shared_ptr<HostPool>& into) {
          return engine.offload(into, src.data(), src.size(), compute, copy, nullptr);
        },
        why);
  }

  std::vector<char> reload(TieredBuffer& b) {
    std::vector<char> out(b.nbytes());
    auto host = b.host();
    engine.reload(*host, out.data(), compute, copy, /*consumer_waits=*/true);
    b.release_host();
    return out;
  }
};

void test_spill_round_trip() {
  Rig rig(/*pool_cap=*/256 * KiB, /*staging_bytes=*/1 * MiB);
  std::vector<std::vector<char>> data;
  std::vector<std::shared_ptr<TieredBuffer>> bufs;
  for (int i = 0; i < 10; ++i) {
    data.push_back(random_bytes(60 * KiB + i, i));
    TieredRefusal why;
    auto b = rig.offload(data.back(), &why);
    CHECK(b != nullptr);
    CHECK(why == TieredRefusal::None);
    bufs.push_back(b);
  }
  int spilled = 0;
  for (auto& b : bufs) spilled += b->spilled();
  CHECK_EQ(spilled, 6);  // four 60 KiB blocks fill the 256 KiB pool, the rest went to disk
  CHECK_EQ(rig.target->blocks_spilled.load(), 6u);
  // Every staging block goes back once its write is done: nothing stays in host memory.
  rig.copy.drain();
  rig.tier->synchronize();
  CHECK_EQ(rig.staging->stats().bytes_in_use, 0u);
  CHECK_EQ(rig.tier->stats().num_blocks_in_use, 6u);
  // Backward order; the bytes come back exactly (the writes read the staging blocks only
  // after the delayed D2H copies had filled them).
  for (int i = 9; i >= 0; --i) {
    auto back = rig.reload(*bufs[i]);
    CHECK_MSG(back == data[i], "block " << i << (bufs[i]->spilled() ? " (spilled)" : ""));
  }
  bufs.clear();
  rig.copy.drain();
  rig.tier->synchronize();
  CHECK_EQ(rig.tier->stats().bytes_in_use, 0u);
  CHECK_EQ(rig.pool->stats().bytes_in_use, 0u);
  CHECK_EQ(rig.staging->stats().bytes_in_use, 0u);
}

// A read-back takes a pool block when the pool has room, a staging block otherwise.
void test_readback_placement() {
  Rig rig(/*pool_cap=*/128 * KiB, 1 * MiB);
  const auto a = random_bytes(100 * KiB, 1), b = random_bytes(100 * KiB, 2);
  TieredRefusal why;
  auto ra = rig.offload(a, &why);
  auto rb = rig.offload(b, &why);
  CHECK(!ra->spilled());
  CHECK(rb->spilled());
  rb->start_read(/*prefetch=*/true);
  CHECK(rb->reading());
  auto host = rb->host();
  CHECK(host->pool() == rig.staging);  // the pool is full
  CHECK(std::memcmp(host->data(), b.data(), b.size()) == 0);
  host.reset();
  rb->release_host();
  CHECK(!rb->reading());
  ra.reset();  // the pool has room now
  rig.copy.drain();
  rig.pool->synchronize();
  host = rb->host();
  CHECK(host->pool() == rig.pool);
  CHECK(std::memcmp(host->data(), b.data(), b.size()) == 0);
  CHECK_EQ(rig.tier->stats().reads_prefetch, 1u);
}

// Writes wait for their D2H copy; with a slow copy stream, staging memory piles up unless the
// throttle holds the next offload back.
void test_throttle() {
  Rig rig(/*pool_cap=*/64 * KiB, /*staging_bytes=*/128 * KiB);
  rig.copy.set_delay_us(20000);
  std::vector<std::vector<char>> data;
  std::vector<std::shared_ptr<TieredBuffer>> bufs;
  size_t peak_staging = 0;
  for (int i = 0; i < 8; ++i) {
    data.push_back(random_bytes(64 * KiB, 10 + i));
    TieredRefusal why;
    bufs.push_back(rig.offload(data.back(), &why));
    CHECK(bufs.back() != nullptr);
    peak_staging = std::max(peak_staging, rig.staging->stats().bytes_in_use);
  }
  CHECK_GT(rig.target->throttle_stalls.load(), 0u);
  CHECK_LE(peak_staging, 128 * KiB + 64 * KiB);  // the bound, plus the block just offloaded
  rig.copy.set_delay_us(0);
  for (size_t i = 0; i < bufs.size(); ++i) CHECK(rig.reload(*bufs[i]) == data[i]);
}

void test_disk_full() {
  Rig rig(/*pool_cap=*/64 * KiB, 1 * MiB, /*tier_cap=*/128 * KiB);
  const auto d = random_bytes(60 * KiB, 3);
  TieredRefusal why;
  std::vector<std::shared_ptr<TieredBuffer>> bufs;
  for (int i = 0; i < 3; ++i) {
    bufs.push_back(rig.offload(d, &why));
    CHECK(why == TieredRefusal::None);
  }
  auto refused = rig.offload(d, &why);
  CHECK(refused == nullptr);
  CHECK(why == TieredRefusal::DiskFull);
  CHECK_EQ(rig.target->blocks_refused.load(), 1u);
  rig.copy.drain();
  rig.tier->synchronize();
  CHECK_EQ(rig.staging->stats().bytes_in_use, 0u);  // the refused staging block went back too
  // Without a tier the same refusal is the pool's.
  attach_spill(rig.pool, nullptr);
  CHECK(rig.offload(d, &why) == nullptr);
  CHECK(why == TieredRefusal::PoolFull);
}

void test_registry() {
  TempDir tier_dir;
  FileTierOptions o;
  o.dir = tier_dir.path;
  auto target = std::make_shared<SpillTarget>(FileTier::create(o), make_pool(0), 1 * MiB);
  std::weak_ptr<SpillTarget> weak = target;
  auto pool = make_pool(0);
  attach_spill(pool, target);
  CHECK(spill_target(pool.get()) == target);
  // The registry does not own the target: its owner dropping it detaches the tier.
  target.reset();
  CHECK(weak.expired());
  CHECK(spill_target(pool.get()) == nullptr);
  // Nor the pool: a dead pool's entry is never handed to another pool.
  target = std::make_shared<SpillTarget>(FileTier::create(o), make_pool(0), 1 * MiB);
  attach_spill(pool, target);
  const HostPool* dead = pool.get();
  pool.reset();
  CHECK(spill_target(dead) == nullptr);
}

}  // namespace

int main() {
  check::run("spill_round_trip", test_spill_round_trip);
  check::run("readback_placement", test_readback_placement);
  check::run("throttle", test_throttle);
  check::run("disk_full", test_disk_full);
  check::run("registry", test_registry);
  return 0;
}

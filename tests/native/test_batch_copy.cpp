// Batched copies and profiling records in the core, on CPU streams:
//   - the gather/scatter chunk plan (batch_plan.h) copies exactly what plain memcpys would,
//     for sizes around the chunk size, empty copies and more copies than one launch holds;
//   - CopyEngine::offload_gather / reload_scatter round trip through a WorkerStream with a
//     delay, the sources stay alive until the gather has read them, and the consumer of a
//     scatter waits for it;
//   - timed fences complete in order, and the profiler records one copy per batched transfer
//     and nothing while it is off.
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "batch_plan.h"
#include "check.h"
#include "copy_engine.h"
#include "cpu_stream.h"
#include "host_pool.h"
#include "profiler.h"

using namespace ckpt_offload;

namespace {

constexpr size_t MiB = size_t(1) << 20;

std::vector<unsigned char> random_bytes(size_t n, uint32_t seed) {
  std::vector<unsigned char> v(n);
  std::minstd_rand rng(seed + 1);
  for (auto& c : v) c = static_cast<unsigned char>(rng());
  return v;
}

void test_plan_matches_memcpy() {
  std::minstd_rand rng(7);
  std::vector<size_t> sizes = {
      0, 1, 15, 16, 17, kBatchChunkBytes - 1, kBatchChunkBytes, kBatchChunkBytes + 1, 0, 5 * kBatchChunkBytes + 3};
  for (int i = 0; i < 150; ++i) sizes.push_back(rng() % (3 * kBatchChunkBytes));
  size_t total = 0;
  for (size_t s : sizes) total += s + 32;
  auto src = random_bytes(total, 1);
  std::vector<unsigned char> got(total, 0), want(total, 0);
  std::vector<CopySegment> segs;
  size_t off = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t s_off = off + i % 5, d_off = off + i % 11;
    segs.push_back({got.data() + d_off, src.data() + s_off, sizes[i]});
    std::memcpy(want.data() + d_off, src.data() + s_off, sizes[i]);
    off += sizes[i] + 32;
  }
  copy_batch_on_host(segs);
  CHECK(got == want);

  // Every chunk of a launch maps back into its copy, and the chunks cover each copy once.
  BatchLaunch launch;
  const uint32_t chunks = plan_batch_launch(segs.data(), kBatchMaxSegments, &launch);
  std::vector<size_t> covered(kBatchMaxSegments, 0);
  for (uint32_t b = 0; b < chunks; ++b) {
    int seg = -1;
    size_t o = 0, len = 0;
    locate_chunk(launch, b, &seg, &o, &len);
    CHECK(seg >= 0 && seg < kBatchMaxSegments);
    CHECK_EQ(o, covered[seg]);
    CHECK_GT(len, 0u);
    covered[seg] += len;
  }
  for (int i = 0; i < kBatchMaxSegments; ++i) CHECK_EQ(covered[i], segs[i].bytes);
}

void test_gather_scatter_roundtrip() {
  auto pool = std::make_shared<HostPool>(std::make_unique<PageableBackend>(), 0, 4 * MiB);
  CopyEngine engine;
  InlineStream compute;
  // The gather's delay is long enough (50 ms) that "the source is still held right after the
  // call" cannot race with the copy on a loaded machine; 300 us did, once in CI.
  WorkerStream d2h(50000), h2d(300);
  std::vector<size_t> sizes = {100, 4096, 70000, 1, 16384, 333};
  std::vector<std::shared_ptr<std::vector<unsigned char>>> sources;
  std::vector<BatchSpan> spans;
  size_t block = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    sources.push_back(std::make_shared<std::vector<unsigned char>>(random_bytes(sizes[i], 10 + i)));
    block = (block + 15) / 16 * 16;
    spans.push_back({sources.back()->data(), block, sizes[i]});
    block += sizes[i];
  }
  auto expected = sources;  // same objects: compared after the originals are let go
  std::vector<std::vector<unsigned char>> copies;
  for (auto& s : sources) copies.push_back(*s);
  auto keep = std::make_shared<std::vector<std::shared_ptr<std::vector<unsigned char>>>>(sources);
  std::weak_ptr<std::vector<unsigned char>> first = sources[0];
  sources.clear();
  expected.clear();
  auto buf = engine.offload_gather(pool, spans, block, nullptr, compute, d2h, keep);
  keep.reset();
  CHECK(buf);
  CHECK(!first.expired());  // held until the gather has read it
  std::vector<std::vector<unsigned char>> dst;
  std::vector<BatchSpan> out;
  for (size_t i = 0; i < sizes.size(); ++i) dst.emplace_back(sizes[i], 0);
  for (size_t i = 0; i < sizes.size(); ++i) out.push_back({dst[i].data(), spans[i].offset, sizes[i]});
  engine.reload_scatter(*buf, out, nullptr, compute, h2d, nullptr, /*consumer_waits=*/true);
  // InlineStream: consumer_waits blocked until the scatter ran.
  for (size_t i = 0; i < sizes.size(); ++i) CHECK(dst[i] == copies[i]);
  engine.synchronize();
  CHECK(first.expired());
  buf.reset();
  pool->synchronize();
  CHECK_POOL_EMPTY(*pool);
}

// A batch's members may be written on other streams than the one current at the flush (a
// layer run under torch.cuda.stream(s)): the gather waits for every producer's event. Here the
// producer is a slow worker stream writing the sources; without the wait the gather reads
// them before they are written. Note [Stream ordering] rule 1 (csrc/torch/runtime.h).
void test_gather_waits_for_producers() {
  auto pool = std::make_shared<HostPool>(std::make_unique<PageableBackend>(), 0, 4 * MiB);
  CopyEngine engine;
  InlineStream compute;
  WorkerStream producer(20000), other_producer(5000), d2h(0);
  const std::vector<size_t> sizes = {4096, 333, 70000};
  std::vector<std::vector<unsigned char>> sources, expected;
  std::vector<BatchSpan> spans;
  size_t block = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    sources.emplace_back(sizes[i], 0);
    expected.push_back(random_bytes(sizes[i], 40 + i));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    block = (block + 15) / 16 * 16;
    spans.push_back({sources[i].data(), block, sizes[i]});
    // Members 0 and 2 are written on `producer`, member 1 on `other_producer`.
    WorkerStream& by = i == 1 ? other_producer : producer;
    by.memcpy(sources[i].data(), expected[i].data(), sizes[i], CopyKind::HostToHost);
    block += sizes[i];
  }
  std::vector<std::shared_ptr<Event>> producers = {producer.record(), other_producer.record()};
  auto buf = engine.offload_gather(pool, spans, block, nullptr, compute, d2h, nullptr, {}, producers);
  CHECK(buf);
  buf->ready()->synchronize();
  for (size_t i = 0; i < sizes.size(); ++i)
    CHECK_MSG(std::memcmp(static_cast<char*>(buf->data()) + spans[i].offset, expected[i].data(), sizes[i]) == 0,
              "member " << i << " was gathered before its producer wrote it");
  buf.reset();
  pool->synchronize();
  CHECK_POOL_EMPTY(*pool);
}

void test_timed_fences_and_records() {
  WorkerStream s(200);
  auto a = s.record_timed();
  std::vector<char> x(1024, 1), y(1024, 0);
  s.memcpy(y.data(), x.data(), x.size(), CopyKind::HostToHost);
  auto b = s.record_timed();
  CHECK_LE(a->completion_ns(), b->completion_ns());
  CHECK_EQ(s.record()->completion_ns(), -1);  // untimed

  auto pool = std::make_shared<HostPool>(std::make_unique<PageableBackend>(), 0, 4 * MiB);
  CopyEngine engine;
  InlineStream compute;
  profiler::stop();
  {
    auto off = engine.offload(pool, x.data(), x.size(), compute, s, nullptr);
    CHECK_EQ(profiler::snapshot().copies.size(), 0u);  // start() was never called: nothing kept
  }
  profiler::start();
  // A fresh pool: its first segment is taken from the backend inside the profile.
  auto fresh = std::make_shared<HostPool>(std::make_unique<PageableBackend>(), 0, 4 * MiB);
  auto buf = engine.offload(fresh, x.data(), x.size(), compute, s, nullptr, CopyTag{42, -1, false, 1});
  engine.reload(*buf, y.data(), compute, s, true, CopyTag{42, -1, true, 1});
  profiler::stop();
  engine.offload(pool, x.data(), x.size(), compute, s, nullptr);  // after stop: not recorded
  auto snap = profiler::snapshot();
  CHECK_EQ(snap.copies.size(), 2u);
  CHECK(snap.copies[0].r.kind == CopyKind::DeviceToHost);
  CHECK(snap.copies[1].r.kind == CopyKind::HostToDevice && snap.copies[1].r.prefetch);
  CHECK_EQ(snap.copies[0].r.handle, 42u);
  CHECK_LE(0, snap.copies[0].start_ns);
  CHECK_LE(snap.copies[0].start_ns, snap.copies[0].end_ns);
  CHECK_LE(snap.copies[0].end_ns, snap.copies[1].end_ns);
  CHECK_EQ(snap.pool.size(), 1u);
  CHECK(snap.pool[0].kind == profiler::PoolEventKind::BackendAlloc);
  CHECK_EQ(snap.pool[0].bytes, 4 * MiB);
  buf.reset();
  engine.synchronize();
}

}  // namespace

int main() {
  check::run("plan_matches_memcpy", test_plan_matches_memcpy);
  check::run("gather_scatter_roundtrip", test_gather_scatter_roundtrip);
  check::run("gather_waits_for_producers", test_gather_waits_for_producers);
  check::run("timed_fences_and_records", test_timed_fences_and_records);
  return 0;
}

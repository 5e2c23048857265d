// CopyEngine + HostBuffer over a HostPool, with an InlineStream as the compute stream and
// WorkerStreams (with injected delays) as the copy streams: the CPU model of stream="side".
//
// Sources are owned by their keepalive, as a tensor owns its storage: the deleter poisons the
// bytes and frees them. A keepalive released before its copy ran therefore shows up as wrong
// offloaded bytes (and as a heap-use-after-free under ASan), exactly as a GPU would copy
// whatever the caching allocator put in the freed storage.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "copy_engine.h"
#include "cpu_stream.h"
#include "host_pool.h"

using namespace ckpt_offload;
using namespace std::chrono_literals;

namespace {

constexpr size_t KiB = size_t(1) << 10;
constexpr size_t MiB = size_t(1) << 20;
constexpr unsigned char kPoison = 0xDD;

std::shared_ptr<HostPool> make_pool(size_t max_bytes = 0, size_t segment_bytes = 4 * MiB) {
  return std::make_shared<HostPool>(std::make_unique<PageableBackend>(), max_bytes, segment_bytes);
}

std::vector<char> pattern(size_t n, uint32_t seed) {
  std::vector<char> v(n);
  std::minstd_rand rng(seed + 1);
  for (size_t i = 0; i < n; i += 4) {
    const uint32_t r = uint32_t(rng());
    for (size_t k = 0; k < 4 && i + k < n; ++k) {
      char c = char(r >> (8 * k));
      if (static_cast<unsigned char>(c) == kPoison) c = 1;  // poisoned bytes must be recognisable
      v[i + k] = c;
    }
  }
  return v;
}

// What a source's keepalive saw when it was released.
struct Probe {
  std::vector<char> expected;
  std::shared_ptr<Event> ready;  // set by the test once offload() has returned
  std::atomic<int> released{0};
  std::atomic<bool> ready_known{false};
  std::atomic<bool> copy_done_at_release{false};
};

// A source buffer owned by its keepalive. The deleter records whether the offload copy had
// finished, then poisons and frees the bytes.
std::shared_ptr<void> make_source(const std::shared_ptr<Probe>& probe, const char** data) {
  const size_t n = probe->expected.size();
  char* mem = new char[n ? n : 1];
  if (n) std::memcpy(mem, probe->expected.data(), n);
  *data = mem;
  return std::shared_ptr<void>(mem, [probe, n](void* p) {
    if (probe->ready) {
      probe->ready_known = true;
      probe->copy_done_at_release = probe->ready->query();
    }
    if (n) std::memset(p, kPoison, n);
    delete[] static_cast<char*>(p);
    probe->released++;
  });
}

// Holds back everything enqueued on `stream` after this call until the returned fence is
// signalled: "the copy has not run yet" is then a fact, not a bet on the delay being long enough.
std::shared_ptr<FenceEvent> gate(Stream& stream) {
  auto fence = std::make_shared<FenceEvent>(false);
  stream.wait(fence);
  return fence;
}

// Signals `fence` from another thread after `ms` milliseconds.
std::thread signal_later(std::shared_ptr<FenceEvent> fence, int ms) {
  return std::thread([fence, ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    fence->signal();
  });
}

bool holds(const HostBuffer& buf, const std::vector<char>& expected) {
  return buf.nbytes() == expected.size() &&
         (expected.empty() || std::memcmp(buf.data(), expected.data(), expected.size()) == 0);
}

struct Streams {
  InlineStream compute;
  WorkerStream d2h;
  WorkerStream h2d;
  Streams(int64_t d2h_delay_us, int64_t h2d_delay_us) : d2h(d2h_delay_us), h2d(h2d_delay_us) {}
};

// Offload then reload many buffers of many sizes; everything arrives intact.
void test_roundtrip() {
  auto pool = make_pool();
  Streams s(2000, 2000);
  CopyEngine engine;
  std::vector<size_t> sizes = {0, 1, 7, 512, 513, 4096, 10000, 100 * KiB, 1 * MiB + 3, 5 * MiB};
  std::vector<std::shared_ptr<HostBuffer>> bufs;
  std::vector<std::vector<char>> expected;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto probe = std::make_shared<Probe>();
    probe->expected = pattern(sizes[i], uint32_t(i + 1));
    const char* src = nullptr;
    auto keep = make_source(probe, &src);
    auto buf = engine.offload(pool, src, sizes[i], s.compute, s.d2h, std::move(keep));
    CHECK(buf != nullptr);
    CHECK_EQ(buf->nbytes(), sizes[i]);
    CHECK_EQ(reinterpret_cast<uintptr_t>(buf->data()) % kAlignment, 0u);
    CHECK(buf->pool() == pool);
    probe->ready = buf->ready();
    expected.push_back(probe->expected);
    bufs.push_back(buf);
  }
  for (size_t i = 0; i < bufs.size(); ++i) {
    std::vector<char> dst(sizes[i] + 1, 0);
    dst.back() = 0x5a;  // the copy writes exactly nbytes
    auto done = engine.reload(*bufs[i], dst.data(), s.compute, s.h2d);
    // With an inline compute stream, reload() returns once the data may be read.
    CHECK(done->query());
    CHECK(std::equal(expected[i].begin(), expected[i].end(), dst.begin()));
    CHECK_EQ(dst.back(), 0x5a);
    CHECK(holds(*bufs[i], expected[i]));
  }
  engine.synchronize();
  CHECK_EQ(engine.num_keepalives(), 0u);
  bufs.clear();
  s.h2d.drain();
  CHECK_POOL_EMPTY(*pool);
}

// The keepalive is held until the copy has read the source, and released by poll() after.
void test_keepalive_released_after_copy() {
  auto pool = make_pool();
  Streams s(20000, 0);  // 20 ms before each D2H copy
  CopyEngine engine;
  auto probe = std::make_shared<Probe>();
  probe->expected = pattern(256 * KiB, 11);
  const char* src = nullptr;
  auto keep = make_source(probe, &src);
  auto g = gate(s.d2h);
  auto buf = engine.offload(pool, src, probe->expected.size(), s.compute, s.d2h, std::move(keep));
  CHECK(buf != nullptr);
  probe->ready = buf->ready();
  CHECK(!buf->ready()->query());
  CHECK_EQ(engine.num_keepalives(), 1u);
  CHECK_EQ(probe->released.load(), 0);
  engine.poll();  // too early: must not release
  CHECK_EQ(probe->released.load(), 0);
  CHECK_EQ(engine.num_keepalives(), 1u);

  g->signal();
  buf->ready()->synchronize();
  CHECK(holds(*buf, probe->expected));  // the source was intact when copied
  engine.poll();
  CHECK_EQ(probe->released.load(), 1);
  CHECK(probe->ready_known.load());
  CHECK(probe->copy_done_at_release.load());
  CHECK_EQ(engine.num_keepalives(), 0u);
  CHECK(holds(*buf, probe->expected));  // poisoning the source afterwards changes nothing

  // Releases happen in stream order as copies finish; a later offload polls the earlier ones.
  std::vector<std::shared_ptr<Probe>> probes;
  std::vector<std::shared_ptr<HostBuffer>> bufs;
  s.d2h.set_delay_us(2000);
  g = gate(s.d2h);
  for (int i = 0; i < 5; ++i) {
    auto p = std::make_shared<Probe>();
    p->expected = pattern(8 * KiB, 100 + i);
    auto k = make_source(p, &src);
    auto b = engine.offload(pool, src, p->expected.size(), s.compute, s.d2h, std::move(k));
    p->ready = b->ready();
    probes.push_back(p);
    bufs.push_back(b);
  }
  CHECK_EQ(engine.num_keepalives(), 5u);
  for (auto& p : probes) CHECK_EQ(p->released.load(), 0);
  g->signal();
  bufs[2]->ready()->synchronize();
  engine.poll();
  for (int i = 0; i < 5; ++i) {
    if (i <= 2) CHECK_EQ(probes[i]->released.load(), 1);
    if (probes[i]->released.load()) CHECK(probes[i]->copy_done_at_release.load());
  }
  engine.synchronize();
  CHECK_EQ(engine.num_keepalives(), 0u);
  for (int i = 0; i < 5; ++i) {
    CHECK_EQ(probes[i]->released.load(), 1);
    CHECK(probes[i]->copy_done_at_release.load());
    CHECK(holds(*bufs[i], probes[i]->expected));
  }
}

// stream="compute": the copy runs on the compute stream itself. Inline, the copy is done when
// offload() returns, so nothing needs holding; on a worker (an asynchronous compute stream)
// the keepalive is held like on a side stream.
void test_copy_on_compute_stream() {
  auto pool = make_pool();
  CopyEngine engine;
  {
    InlineStream compute;
    auto probe = std::make_shared<Probe>();
    probe->expected = pattern(64 * KiB, 21);
    const char* src = nullptr;
    auto keep = make_source(probe, &src);
    auto buf = engine.offload(pool, src, probe->expected.size(), compute, compute, std::move(keep));
    CHECK(buf->ready()->query());
    CHECK_EQ(engine.num_keepalives(), 0u);
    CHECK_EQ(probe->released.load(), 1);  // released by offload(): the copy had already run
    CHECK(holds(*buf, probe->expected));
    std::vector<char> dst(probe->expected.size());
    auto done = engine.reload(*buf, dst.data(), compute, compute);
    CHECK(done->query());
    CHECK(dst == probe->expected);
  }
  {
    WorkerStream compute(20000);
    auto probe = std::make_shared<Probe>();
    probe->expected = pattern(64 * KiB, 22);
    const char* src = nullptr;
    auto keep = make_source(probe, &src);
    auto g = gate(compute);
    auto buf = engine.offload(pool, src, probe->expected.size(), compute, compute, std::move(keep));
    probe->ready = buf->ready();
    CHECK_EQ(engine.num_keepalives(), 1u);
    engine.poll();
    CHECK_EQ(probe->released.load(), 0);
    g->signal();
    std::vector<char> dst(probe->expected.size(), 0);
    auto done = engine.reload(*buf, dst.data(), compute, compute);
    done->synchronize();
    CHECK(dst == probe->expected);
    engine.synchronize();
    CHECK_EQ(probe->released.load(), 1);
    CHECK(probe->copy_done_at_release.load());
    CHECK(holds(*buf, probe->expected));
  }
  CHECK_EQ(engine.num_keepalives(), 0u);
}

// Reload right after offload, with a long delay on the D2H worker: the H2D copy must wait for
// the offload copy, or it would deliver stale host bytes.
void test_reload_waits_for_offload() {
  auto pool = make_pool();
  CopyEngine engine;
  {
    Streams s(50000, 0);  // 50 ms before the D2H copy, none before the H2D copy
    auto probe = std::make_shared<Probe>();
    probe->expected = pattern(512 * KiB, 31);
    const char* src = nullptr;
    auto keep = make_source(probe, &src);
    auto g = gate(s.d2h);
    auto buf = engine.offload(pool, src, probe->expected.size(), s.compute, s.d2h, std::move(keep));
    probe->ready = buf->ready();
    CHECK(!buf->ready()->query());
    std::vector<char> dst(probe->expected.size(), 0);
    std::thread opener = signal_later(g, 20);  // the D2H copy starts 20 + 50 ms from now
    auto done = engine.reload(*buf, dst.data(), s.compute, s.h2d);
    opener.join();
    // Inline compute: reload() blocked until the H2D copy, which waited for the D2H copy.
    CHECK(buf->ready()->query());
    CHECK(done->query());
    CHECK(dst == probe->expected);
    engine.synchronize();
    CHECK(probe->copy_done_at_release.load());
  }
  {
    // Asynchronous compute stream (a worker): reload() returns at once; work enqueued on the
    // compute stream afterwards sees the data.
    WorkerStream compute(0), d2h(50000), h2d(10000);
    auto probe = std::make_shared<Probe>();
    probe->expected = pattern(512 * KiB, 32);
    const char* src = nullptr;
    auto keep = make_source(probe, &src);
    auto g = gate(d2h);
    auto buf = engine.offload(pool, src, probe->expected.size(), compute, d2h, std::move(keep));
    probe->ready = buf->ready();
    std::vector<char> dst(probe->expected.size(), 0), after(probe->expected.size(), 0);
    auto done = engine.reload(*buf, dst.data(), compute, h2d);
    CHECK(!done->query());
    compute.memcpy(after.data(), dst.data(), dst.size(), CopyKind::HostToHost);  // the "consumer"
    g->signal();
    compute.drain();
    CHECK(done->query());
    CHECK(after == probe->expected);
    CHECK(dst == probe->expected);
    engine.synchronize();
    CHECK(probe->copy_done_at_release.load());
  }
  CHECK_EQ(pool->stats().bytes_in_use, 0u);
}

// The D2H copy reads the source only after the compute stream has produced it.
void test_offload_waits_for_compute() {
  auto pool = make_pool();
  CopyEngine engine;
  WorkerStream compute(20000), d2h(0);  // the compute stream is slow: 20 ms per copy
  auto probe = std::make_shared<Probe>();
  probe->expected = pattern(64 * KiB, 45);
  // The source starts stale; the compute stream's (queued, delayed) work produces it.
  auto produced = std::make_shared<std::vector<char>>(probe->expected);
  std::vector<char> initial(probe->expected.size(), 0x22);
  const char* src = nullptr;
  auto keep = make_source(probe, &src);
  std::memcpy(const_cast<char*>(src), initial.data(), initial.size());
  auto g = gate(compute);
  compute.memcpy(const_cast<char*>(src), produced->data(), produced->size(), CopyKind::HostToHost);
  auto buf = engine.offload(pool, src, probe->expected.size(), compute, d2h, std::move(keep));
  probe->ready = buf->ready();
  CHECK(!buf->ready()->query());  // held behind the compute stream's work
  g->signal();
  buf->ready()->synchronize();
  CHECK(holds(*buf, probe->expected));
  engine.synchronize();
  CHECK(probe->copy_done_at_release.load());
}

// The destination is written only after earlier compute work on it: the H2D copy waits for
// the compute stream (the reload buffer's previous user).
void test_reload_waits_for_compute() {
  auto pool = make_pool();
  CopyEngine engine;
  WorkerStream compute(50000), h2d(0);  // the compute stream is slow: 50 ms per copy
  InlineStream inline_compute;
  WorkerStream d2h(0);
  auto probe = std::make_shared<Probe>();
  probe->expected = pattern(64 * KiB, 41);
  const char* src = nullptr;
  auto keep = make_source(probe, &src);
  auto buf = engine.offload(pool, src, probe->expected.size(), inline_compute, d2h, std::move(keep));
  buf->ready()->synchronize();
  // The previous user of dst, still queued on compute, writes stale bytes into it.
  std::vector<char> stale(probe->expected.size(), 0x11), dst(probe->expected.size(), 0);
  compute.memcpy(dst.data(), stale.data(), stale.size(), CopyKind::HostToHost);
  auto done = engine.reload(*buf, dst.data(), compute, h2d);
  compute.drain();
  CHECK(done->query());
  CHECK(dst == probe->expected);  // the reload came after the stale write, not before
  engine.synchronize();
}

// A HostBuffer destroyed while its copies are still queued: its block stays pending until
// they have run, so a new allocation cannot be handed the same memory.
void test_buffer_destroyed_while_queued() {
  auto pool = make_pool(0, 1 * MiB);
  CopyEngine engine;
  {
    Streams s(20000, 0);
    auto probe = std::make_shared<Probe>();
    probe->expected = pattern(64 * KiB, 51);
    const char* src = nullptr;
    auto keep = make_source(probe, &src);
    auto g = gate(s.d2h);
    auto buf = engine.offload(pool, src, probe->expected.size(), s.compute, s.d2h, std::move(keep));
    probe->ready = buf->ready();
    auto ready = buf->ready();
    const uintptr_t old = reinterpret_cast<uintptr_t>(buf->data());
    CHECK(!ready->query());
    buf.reset();  // e.g. the graph was dropped without backward
    PoolStats st = pool->stats();
    CHECK_EQ(st.bytes_in_use, 0u);
    CHECK_EQ(st.bytes_pending, 64 * KiB);
    HostPool::Block* b = pool->allocate(64 * KiB);
    const uintptr_t fresh = reinterpret_cast<uintptr_t>(HostPool::data(b));
    CHECK_MSG(fresh + 64 * KiB <= old || old + 64 * KiB <= fresh,
              "the block of a buffer whose copy is still queued was handed out again");
    CHECK(!ready->query());
    std::memset(HostPool::data(b), 0x77, 64 * KiB);  // the new owner writes its own bytes
    CHECK_EQ(pool->stats().bytes_pending, 64 * KiB);
    g->signal();
    s.d2h.drain();
    engine.synchronize();
    CHECK(probe->copy_done_at_release.load());
    CHECK_EQ(pool->stats().bytes_pending, 0u);
    // Now, and only now, the old block is reusable: best fit hands out exactly it.
    HostPool::Block* again = pool->allocate(64 * KiB);
    CHECK_EQ(reinterpret_cast<uintptr_t>(HostPool::data(again)), old);
    pool->free(again);
    pool->free(b);
  }
  {
    // The same for a reader: a reload still queued when the buffer dies.
    WorkerStream compute(0), d2h(0), h2d(20000);
    auto probe = std::make_shared<Probe>();
    probe->expected = pattern(32 * KiB, 52);
    const char* src = nullptr;
    auto keep = make_source(probe, &src);
    auto buf = engine.offload(pool, src, probe->expected.size(), compute, d2h, std::move(keep));
    buf->ready()->synchronize();
    std::vector<char> dst(probe->expected.size(), 0);
    auto g = gate(h2d);
    auto done = engine.reload(*buf, dst.data(), compute, h2d);
    const uintptr_t old = reinterpret_cast<uintptr_t>(buf->data());
    CHECK(!done->query());
    buf.reset();
    CHECK_EQ(pool->stats().bytes_pending, 32 * KiB);
    std::vector<HostPool::Block*> blocks;
    for (int i = 0; i < 4; ++i) {  // the H2D copy is still reading the old block
      HostPool::Block* b = pool->allocate(32 * KiB);
      const uintptr_t a = reinterpret_cast<uintptr_t>(HostPool::data(b));
      CHECK(a + 32 * KiB <= old || old + 32 * KiB <= a);
      std::memset(HostPool::data(b), 0x66, 32 * KiB);
      blocks.push_back(b);
    }
    CHECK_EQ(pool->stats().bytes_pending, 32 * KiB);
    g->signal();
    compute.drain();
    CHECK(done->query());
    CHECK(dst == probe->expected);
    CHECK_EQ(pool->stats().bytes_pending, 0u);
    for (auto* b : blocks) pool->free(b);
    engine.synchronize();
  }
  CHECK_EQ(engine.num_keepalives(), 0u);
  CHECK_POOL_EMPTY(*pool);
}

// A buffer reloaded many times (retain_graph=True) stays correct, and its readers are tracked.
void test_reload_many_times() {
  auto pool = make_pool();
  Streams s(0, 1000);
  CopyEngine engine;
  auto probe = std::make_shared<Probe>();
  probe->expected = pattern(16 * KiB, 61);
  const char* src = nullptr;
  auto keep = make_source(probe, &src);
  auto buf = engine.offload(pool, src, probe->expected.size(), s.compute, s.d2h, std::move(keep));
  for (int i = 0; i < 50; ++i) {
    std::vector<char> dst(probe->expected.size(), 0);
    engine.reload(*buf, dst.data(), s.compute, s.h2d);
    CHECK(dst == probe->expected);
  }
  buf.reset();
  engine.synchronize();
  CHECK_EQ(pool->stats().bytes_in_use, 0u);
  CHECK_EQ(pool->stats().bytes_pending, 0u);
}

// num_keepalives counts held sources and drops to 0 after synchronize().
void test_synchronize_releases_all() {
  auto pool = make_pool();
  Streams s(5000, 0);
  CopyEngine engine;
  auto g = gate(s.d2h);
  std::vector<std::shared_ptr<Probe>> probes;
  std::vector<std::shared_ptr<HostBuffer>> bufs;
  for (int i = 0; i < 10; ++i) {
    auto p = std::make_shared<Probe>();
    p->expected = pattern(4 * KiB + i, 70 + i);
    const char* src = nullptr;
    auto k = make_source(p, &src);
    auto b = engine.offload(pool, src, p->expected.size(), s.compute, s.d2h, std::move(k));
    p->ready = b->ready();
    probes.push_back(p);
    bufs.push_back(b);
  }
  CHECK_EQ(engine.num_keepalives(), 10u);
  g->signal();
  engine.synchronize();
  CHECK_EQ(engine.num_keepalives(), 0u);
  for (int i = 0; i < 10; ++i) {
    CHECK_EQ(probes[i]->released.load(), 1);
    CHECK(probes[i]->copy_done_at_release.load());
    CHECK(holds(*bufs[i], probes[i]->expected));
  }
  engine.synchronize();  // nothing held: a no-op
  engine.poll();
  CHECK_EQ(engine.num_keepalives(), 0u);
}

// A full pool: offload() returns nullptr, does not enqueue a copy, and does not keep the source.
void test_offload_pool_full() {
  auto pool = make_pool(/*max_bytes=*/1 * MiB, /*segment_bytes=*/1 * MiB);
  Streams s(0, 0);
  CopyEngine engine;
  auto p1 = std::make_shared<Probe>();
  p1->expected = pattern(768 * KiB, 81);
  const char* src = nullptr;
  auto k1 = make_source(p1, &src);
  auto b1 = engine.offload(pool, src, p1->expected.size(), s.compute, s.d2h, std::move(k1));
  CHECK(b1 != nullptr);
  auto p2 = std::make_shared<Probe>();
  p2->expected = pattern(768 * KiB, 82);
  auto k2 = make_source(p2, &src);
  auto b2 = engine.offload(pool, src, p2->expected.size(), s.compute, s.d2h, std::move(k2));
  CHECK(b2 == nullptr);
  CHECK_EQ(p2->released.load(), 1);
  CHECK_EQ(pool->stats().num_cap_hits, 1u);
  engine.synchronize();
  CHECK(holds(*b1, p1->expected));
  b1.reset();
  s.d2h.drain();
  CHECK_EQ(pool->stats().bytes_in_use, 0u);
}

// Several host threads offload and reload through one engine, one pool and shared copy
// streams (the forward thread and autograd's backward threads).
void test_threads() {
  auto pool = make_pool(0, 2 * MiB);
  WorkerStream d2h(50), h2d(50);
  CopyEngine engine;
  constexpr int kThreads = 4, kIters = 150;
  std::atomic<int> released{0};
  auto worker = [&](int tid) {
    InlineStream compute;
    std::mt19937 rng(1000 + tid);
    std::vector<std::pair<std::shared_ptr<HostBuffer>, std::vector<char>>> live;
    for (int i = 0; i < kIters; ++i) {
      const size_t n = 1 + rng() % (48 * KiB);
      auto probe = std::make_shared<Probe>();
      probe->expected = pattern(n, uint32_t(tid * 100000 + i));
      const char* src = nullptr;
      auto keep = make_source(probe, &src);
      std::shared_ptr<void> counted(keep.get(), [keep, &released](void*) mutable {
        keep.reset();
        released++;
      });
      keep.reset();
      auto buf = engine.offload(pool, src, n, compute, d2h, std::move(counted));
      CHECK(buf != nullptr);
      live.emplace_back(buf, probe->expected);
      if (live.size() > 8 || (rng() % 3 == 0 && !live.empty())) {
        const size_t j = rng() % live.size();
        std::vector<char> dst(live[j].second.size(), 0);
        engine.reload(*live[j].first, dst.data(), compute, h2d);
        CHECK_MSG(dst == live[j].second, "thread " << tid << ": reloaded bytes differ");
        live[j] = std::move(live.back());
        live.pop_back();
      }
    }
    for (auto& [buf, expected] : live) {
      std::vector<char> dst(expected.size(), 0);
      engine.reload(*buf, dst.data(), compute, h2d);
      CHECK(dst == expected);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  engine.synchronize();
  CHECK_EQ(engine.num_keepalives(), 0u);
  CHECK_EQ(released.load(), kThreads * kIters);
  d2h.drain();
  h2d.drain();
  CHECK_EQ(pool->stats().num_allocs, uint64_t(kThreads * kIters));
  CHECK_POOL_EMPTY(*pool);
}

// The pool outlives its last user through the buffers' shared_ptr, and its destructor waits
// for copies still pending when the last buffer dies.
void test_pool_outlives_buffers() {
  Streams s(5000, 0);
  CopyEngine engine;
  std::weak_ptr<HostPool> weak;
  std::shared_ptr<Event> ready;
  {
    auto pool = make_pool();
    weak = pool;
    auto probe = std::make_shared<Probe>();
    probe->expected = pattern(4 * KiB, 91);
    const char* src = nullptr;
    auto keep = make_source(probe, &src);
    auto g = gate(s.d2h);
    auto buf = engine.offload(pool, src, probe->expected.size(), s.compute, s.d2h, std::move(keep));
    ready = buf->ready();
    pool.reset();
    CHECK(!weak.expired());  // held by the buffer
    CHECK(!ready->query());
    std::thread opener = signal_later(g, 20);
    buf.reset();  // last owner: the pool dies here, after waiting for the copy
    CHECK(weak.expired());
    CHECK(ready->query());
    opener.join();
  }
  engine.synchronize();
}

}  // namespace

int main() {
  check::run("roundtrip", test_roundtrip);
  check::run("keepalive_released_after_copy", test_keepalive_released_after_copy);
  check::run("copy_on_compute_stream", test_copy_on_compute_stream);
  check::run("reload_waits_for_offload", test_reload_waits_for_offload);
  check::run("offload_waits_for_compute", test_offload_waits_for_compute);
  check::run("reload_waits_for_compute", test_reload_waits_for_compute);
  check::run("buffer_destroyed_while_queued", test_buffer_destroyed_while_queued);
  check::run("reload_many_times", test_reload_many_times);
  check::run("synchronize_releases_all", test_synchronize_releases_all);
  check::run("offload_pool_full", test_offload_pool_full);
  check::run("threads", test_threads);
  check::run("pool_outlives_buffers", test_pool_outlives_buffers);
  std::printf("all CopyEngine tests passed\n");
  return 0;
}

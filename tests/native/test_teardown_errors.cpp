// After a sticky CUDA error every event query throws. Destructor paths must not: a throw from
// ~HostBuffer or ~HostPool is std::terminate, which kills the process (a notebook kernel) and
// hides the error that caused it. See Note [No throw on teardown] (stream.h).
//
// The failing event is injected here: an Event whose query/synchronize throw as CudaEvent's do
// after a device-side assert. Each case would abort the test binary without the fix.
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "copy_engine.h"
#include "cpu_stream.h"
#include "host_pool.h"

using namespace ckpt_offload;

namespace {

constexpr size_t KiB = size_t(1) << 10;

// Pending until fail() is called; from then on every query and synchronize throws.
class FailingEvent final : public Event {
 public:
  explicit FailingEvent(bool failed = true) : failed_(failed) {}
  bool query() override {
    if (failed_) throw std::runtime_error("CUDA error: device-side assert triggered (injected)");
    return false;
  }
  void synchronize() override {
    if (failed_) throw std::runtime_error("CUDA error: device-side assert triggered (injected)");
    throw std::logic_error("FailingEvent: synchronize on a pending injected event would block forever");
  }
  void fail() { failed_ = true; }

 private:
  bool failed_;
};

// Segments the pool leaked on purpose; the test gives them back at its end, so that the leak
// checker reports only leaks nobody meant.
std::vector<std::pair<void*, size_t>> g_live;

// Counts the segments given out and back.
class CountingBackend final : public Backend {
 public:
  explicit CountingBackend(size_t* outstanding) : outstanding_(outstanding) {}
  void* allocate(size_t bytes) override {
    *outstanding_ += bytes;
    void* p = PageableBackend().allocate(bytes);
    g_live.emplace_back(p, bytes);
    return p;
  }
  void release(void* ptr, size_t bytes) override {
    *outstanding_ -= bytes;
    for (size_t i = 0; i < g_live.size(); ++i)
      if (g_live[i].first == ptr) g_live.erase(g_live.begin() + static_cast<std::ptrdiff_t>(i));
    PageableBackend().release(ptr, bytes);
  }
  const char* name() const override { return "counting"; }

 private:
  size_t* outstanding_;
};

void free_leaked_segments() {
  for (auto& p : g_live) PageableBackend().release(p.first, p.second);
  g_live.clear();
}

// HostPool::free with an event whose query fails: no throw, the block is never handed out
// again, and the pool's destructor leaks its segment instead of releasing it.
void test_free_with_failed_event() {
  size_t outstanding = 0;
  {
    HostPool pool(std::make_unique<CountingBackend>(&outstanding), 0, 64 * KiB);
    HostPool::Block* b = pool.allocate(4 * KiB);
    void* p = HostPool::data(b);
    pool.free(b, {std::make_shared<FailingEvent>()});  // threw (-> terminate in ~HostBuffer) before
    PoolStats s = pool.stats();
    CHECK_EQ(s.bytes_in_use, 0u);
    CHECK_EQ(s.bytes_pending, 4 * KiB);  // leaked, counted as waiting
    CHECK_POOL(pool);
    for (int i = 0; i < 8; ++i) {
      HostPool::Block* c = pool.allocate(4 * KiB);
      CHECK(c != nullptr);
      CHECK(HostPool::data(c) != p);  // never reused: a failed copy may still write it
      pool.free(c);
    }
  }
  CHECK_EQ(outstanding, 64 * KiB);  // the poisoned segment was leaked, not released
}

// A block whose copy was still running at free, and whose event fails later: reclaiming it
// (allocate, stats, ~HostPool's wait) does not throw.
void test_event_fails_after_free() {
  size_t outstanding = 0;
  {
    HostPool pool(std::make_unique<CountingBackend>(&outstanding), 0, 64 * KiB);
    auto ev = std::make_shared<FailingEvent>(/*failed=*/false);
    HostPool::Block* b = pool.allocate(4 * KiB);
    pool.free(b, {ev});
    CHECK_EQ(pool.stats().bytes_pending, 4 * KiB);
    ev->fail();
    HostPool::Block* c = pool.allocate(64 * KiB);  // no free block fits: reclaims, querying the failed event
    CHECK(c != nullptr);
    CHECK(HostPool::data(c) != HostPool::data(b));
    pool.free(c);
    CHECK_EQ(pool.stats().bytes_pending, 4 * KiB);
    CHECK_POOL(pool);
  }  // ~HostPool waits on the failed event: must not terminate
  CHECK_EQ(outstanding, 64 * KiB);
}

// ~HostBuffer (a saved tensor dying) with a failed offload event and a failed reader.
void test_host_buffer_destructor() {
  size_t outstanding = 0;
  auto pool = std::make_shared<HostPool>(std::make_unique<CountingBackend>(&outstanding), 0, 64 * KiB);
  {
    auto buf = std::make_shared<HostBuffer>(pool, pool->allocate(KiB), KiB);
    buf->set_ready(std::make_shared<FailingEvent>());
    buf->add_reader(std::make_shared<FailingEvent>());
  }
  CHECK_EQ(pool->stats().bytes_in_use, 0u);
  CHECK_POOL(*pool);
}

// CopyEngine::keep_until (reached from ~OffloadedStorage for a dropped prefetch) with a failed
// event: no throw; the keepalive is let go (the device is lost, nothing runs on it again).
void test_keep_until_failed_event() {
  CopyEngine engine;
  WorkerStream copy;
  auto keepalive = std::make_shared<int>(7);
  std::weak_ptr<int> watch = keepalive;
  engine.keep_until(copy, std::make_shared<FailingEvent>(), std::move(keepalive));
  CHECK(watch.expired());
  CHECK_EQ(engine.num_keepalives(), 0u);
}

}  // namespace

int main() {
  check::run("free_with_failed_event", test_free_with_failed_event);
  check::run("event_fails_after_free", test_event_fails_after_free);
  check::run("host_buffer_destructor", test_host_buffer_destructor);
  check::run("keep_until_failed_event", test_keep_until_failed_event);
  free_leaked_segments();
  std::printf("all teardown-error tests passed\n");
  return 0;
}

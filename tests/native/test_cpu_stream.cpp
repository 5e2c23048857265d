// CPU streams and events: FenceEvent, InlineStream, and WorkerStream ordering (in-queue order,
// record/wait across streams, waits on host fences, the injected delay, draining at destruction).
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "check.h"
#include "cpu_stream.h"

using namespace ckpt_offload;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

void test_fence_event() {
  FenceEvent done(true);
  CHECK(done.query());
  done.synchronize();  // returns at once

  auto ev = std::make_shared<FenceEvent>(false);
  CHECK(!ev->query());
  const auto t0 = Clock::now();
  std::thread t([ev] {
    std::this_thread::sleep_for(30ms);
    ev->signal();
  });
  ev->synchronize();
  CHECK(ev->query());
  CHECK_GE(ms_since(t0), 25.0);
  t.join();
  ev->signal();  // idempotent
  CHECK(ev->query());

  // Many waiters are all woken by one signal.
  auto gate = std::make_shared<FenceEvent>(false);
  std::vector<std::thread> waiters;
  std::atomic<int> woke{0};
  for (int i = 0; i < 4; ++i)
    waiters.emplace_back([&] {
      gate->synchronize();
      woke++;
    });
  std::this_thread::sleep_for(10ms);
  CHECK_EQ(woke.load(), 0);
  gate->signal();
  for (auto& w : waiters) w.join();
  CHECK_EQ(woke.load(), 4);
}

void test_inline_stream() {
  InlineStream s;
  CHECK(s.is_host_inline());
  CHECK_EQ(s.id(), 0u);
  uint64_t src = 0x1122334455667788ull, dst = 0;
  s.memcpy(&dst, &src, sizeof dst, CopyKind::HostToHost);
  CHECK_EQ(dst, src);                                   // ran on the caller, before memcpy returned
  s.memcpy(nullptr, nullptr, 0, CopyKind::HostToHost);  // zero bytes: nothing touched
  auto ev = s.record();
  CHECK(ev->query());
  s.wait(nullptr);
  // Waiting on an incomplete event blocks the caller (the caller *is* the stream).
  auto fence = std::make_shared<FenceEvent>(false);
  const auto t0 = Clock::now();
  std::thread t([fence] {
    std::this_thread::sleep_for(30ms);
    fence->signal();
  });
  s.wait(fence);
  CHECK(fence->query());
  CHECK_GE(ms_since(t0), 25.0);
  t.join();
}

// Copies on one worker run in the order they were enqueued: a chain b0 -> b1 -> ... -> bN
// only delivers b0's bytes to bN if every link ran after the one before it.
void test_worker_in_order() {
  for (int64_t delay : {int64_t(0), int64_t(200)}) {
    WorkerStream s(delay);
    CHECK(!s.is_host_inline());
    CHECK_EQ(s.delay_us(), delay);
    constexpr int kLinks = 64;
    std::vector<std::array<char, 1000>> bufs(kLinks + 1);
    for (auto& b : bufs) b.fill(0);
    for (int i = 0; i < 1000; ++i) bufs[0][i] = char(i * 7 + 1);
    std::vector<std::shared_ptr<Event>> events;
    for (int i = 0; i < kLinks; ++i) {
      s.memcpy(bufs[i + 1].data(), bufs[i].data(), 1000, CopyKind::HostToHost);
      events.push_back(s.record());
    }
    events.back()->synchronize();
    // Events complete in order: the last one done means all are done.
    for (auto& e : events) CHECK(e->query());
    for (int i = 1; i <= kLinks; ++i) CHECK(std::memcmp(bufs[i].data(), bufs[0].data(), 1000) == 0);
  }
}

// The delay is applied before each copy, and record() marks the point after the queued copies.
void test_worker_delay_and_drain() {
  WorkerStream s(30000);  // 30 ms per copy
  uint64_t src = 42, dst = 0;
  const auto t0 = Clock::now();
  s.memcpy(&dst, &src, sizeof dst, CopyKind::DeviceToHost);
  auto ev = s.record();
  s.drain();
  CHECK(ev->query());
  CHECK_EQ(dst, 42u);
  CHECK_GE(ms_since(t0), 25.0);
  s.set_delay_us(0);
  CHECK_EQ(s.delay_us(), 0);
  src = 43;
  s.memcpy(&dst, &src, sizeof dst, CopyKind::DeviceToHost);
  s.drain();
  CHECK_EQ(dst, 43u);
}

// The side-stream pattern of Note [Stream ordering] (csrc/torch/runtime.h): the consumer
// stream waits on an event of the producer.
void test_record_wait_across_workers() {
  WorkerStream producer(50000);  // 50 ms before each copy
  WorkerStream consumer(0);
  CHECK_NE(producer.id(), consumer.id());
  std::vector<char> src(4096), mid(4096, 0), dst(4096, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = char(i * 31 + 5);
  producer.memcpy(mid.data(), src.data(), src.size(), CopyKind::DeviceToHost);
  auto produced = producer.record();
  consumer.wait(produced);
  consumer.memcpy(dst.data(), mid.data(), mid.size(), CopyKind::HostToDevice);
  auto consumed = consumer.record();
  consumed->synchronize();
  CHECK(produced->query());  // the consumer could only finish after the producer
  CHECK(std::memcmp(dst.data(), src.data(), src.size()) == 0);

  // A wait on an already complete event (or none) does not hold the consumer up.
  consumer.wait(produced);
  consumer.wait(nullptr);
  uint64_t a = 7, b = 0;
  consumer.memcpy(&b, &a, sizeof a, CopyKind::HostToHost);
  consumer.drain();
  CHECK_EQ(b, 7u);

  // Ping-pong: each stream waits on the other's latest event; the bytes travel through all
  // the hops in order and nothing deadlocks.
  std::vector<uint64_t> slots(33, 0);
  slots[0] = 0xabcdef;
  WorkerStream* streams[2] = {&producer, &consumer};
  producer.set_delay_us(1000);
  std::shared_ptr<Event> last;
  for (int i = 0; i < 32; ++i) {
    WorkerStream& s = *streams[i % 2];
    s.wait(last);
    s.memcpy(&slots[i + 1], &slots[i], sizeof(uint64_t), CopyKind::HostToHost);
    last = s.record();
  }
  last->synchronize();
  for (uint64_t v : slots) CHECK_EQ(v, 0xabcdefu);
}

// A worker waiting on a host fence does not run later work until the fence is signalled.
void test_worker_waits_on_fence() {
  WorkerStream s(0);
  auto fence = std::make_shared<FenceEvent>(false);
  uint64_t src = 99, dst = 0;
  s.wait(fence);
  s.memcpy(&dst, &src, sizeof dst, CopyKind::HostToHost);
  auto ev = s.record();
  std::this_thread::sleep_for(30ms);
  CHECK(!ev->query());
  uint64_t seen = 0;
  std::memcpy(&seen, &dst, sizeof seen);  // the worker is parked on the fence: no race
  CHECK_EQ(seen, 0u);
  fence->signal();
  ev->synchronize();
  CHECK_EQ(dst, 99u);
}

// Destroying a worker runs what is still queued (a queued fence nobody signals would hang a
// waiter), including the delay.
void test_worker_destructor_drains() {
  std::vector<uint64_t> src(10), dst(10, 0);
  for (int i = 0; i < 10; ++i) src[i] = 1000 + i;
  std::shared_ptr<Event> ev;
  {
    WorkerStream s(5000);
    for (int i = 0; i < 10; ++i) s.memcpy(&dst[i], &src[i], sizeof(uint64_t), CopyKind::HostToHost);
    ev = s.record();
  }
  CHECK(ev->query());
  for (int i = 0; i < 10; ++i) CHECK_EQ(dst[i], src[i]);
}

// Several host threads enqueue onto one worker; each thread's own copies stay in its order.
void test_worker_many_producers() {
  WorkerStream s(0);
  constexpr int kThreads = 4, kCopies = 500;
  std::vector<std::vector<uint64_t>> chains(kThreads, std::vector<uint64_t>(kCopies + 1, 0));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    chains[t][0] = 0x5000 + t;
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCopies; ++i)
        s.memcpy(&chains[t][i + 1], &chains[t][i], sizeof(uint64_t), CopyKind::HostToHost);
    });
  }
  for (auto& t : threads) t.join();
  s.drain();
  for (int t = 0; t < kThreads; ++t)
    for (uint64_t v : chains[t]) CHECK_EQ(v, uint64_t(0x5000 + t));
}

// Note [Idle worker runs inline]: with no delay, a small copy onto an idle worker has run when
// memcpy returns and record() is already complete; a copy over the limit, or any copy behind a
// queued wait, still goes through the worker (after the wait).
void test_idle_worker_runs_inline() {
  WorkerStream s(0);
  uint64_t src = 5, dst = 0;
  s.memcpy(&dst, &src, sizeof dst, CopyKind::DeviceToHost);
  CHECK_EQ(dst, 5u);
  CHECK(s.record()->query());
  std::vector<char> big(WorkerStream::kInlineCopyBytes + 1, 'x'), out(big.size(), 0);
  auto fence = std::make_shared<FenceEvent>(false);
  s.wait(fence);
  s.memcpy(&dst, &src, 0, CopyKind::HostToHost);
  src = 6;
  s.memcpy(&dst, &src, sizeof dst, CopyKind::DeviceToHost);  // queued behind the wait
  s.memcpy(out.data(), big.data(), big.size(), CopyKind::DeviceToHost);
  auto ev = s.record();
  std::this_thread::sleep_for(20ms);
  CHECK(!ev->query());
  uint64_t seen = 1;
  std::memcpy(&seen, &dst, sizeof seen);  // the worker is parked on the fence: no race
  CHECK_EQ(seen, 5u);
  fence->signal();
  ev->synchronize();
  CHECK_EQ(dst, 6u);
  CHECK(std::memcmp(out.data(), big.data(), big.size()) == 0);
}

}  // namespace

int main() {
  check::run("fence_event", test_fence_event);
  check::run("inline_stream", test_inline_stream);
  check::run("worker_in_order", test_worker_in_order);
  check::run("worker_delay_and_drain", test_worker_delay_and_drain);
  check::run("record_wait_across_workers", test_record_wait_across_workers);
  check::run("worker_waits_on_fence", test_worker_waits_on_fence);
  check::run("worker_destructor_drains", test_worker_destructor_drains);
  check::run("worker_many_producers", test_worker_many_producers);
  check::run("idle_worker_runs_inline", test_idle_worker_runs_inline);
  std::printf("all CPU stream tests passed\n");
  return 0;
}

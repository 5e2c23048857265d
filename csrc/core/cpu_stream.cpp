#include "cpu_stream.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace ckpt_offload {

namespace {
int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void copy_batch_on_host(const std::vector<CopySegment>& segments) {
  // Chunk by chunk through the kernel's own plan, so that the CPU suite checks its arithmetic.
  BatchLaunch launch;
  for (size_t first = 0; first < segments.size(); first += kBatchMaxSegments) {
    const int n = static_cast<int>(std::min<size_t>(kBatchMaxSegments, segments.size() - first));
    const uint32_t chunks = plan_batch_launch(segments.data() + first, n, &launch);
    for (uint32_t b = 0; b < chunks; ++b) {
      int seg = 0;
      size_t offset = 0, length = 0;
      locate_chunk(launch, b, &seg, &offset, &length);
      const CopySegment& s = launch.segments[seg];
      std::memcpy(static_cast<char*>(s.dst) + offset, static_cast<const char*>(s.src) + offset, length);
    }
  }
}

FenceEvent::FenceEvent(bool done, bool timed) : done_(done), timed_(timed) {
  if (done && timed) done_ns_ = steady_ns();
}

int64_t FenceEvent::completion_ns() {
  if (!timed_) return -1;
  synchronize();
  std::lock_guard<std::mutex> lock(mu_);
  return done_ns_;
}

void FenceEvent::synchronize() {
  if (query()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return query(); });
}

void FenceEvent::signal() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (timed_) done_ns_ = steady_ns();
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

namespace {
// A fence that has fired, shared by every record() that finds nothing pending (an inline stream
// always, an idle worker): one reference count instead of a new fence (a mutex, a condition
// variable) per copy. Nothing signals or resets a fired fence, so sharing it changes nothing.
const std::shared_ptr<Event>& fired_fence() {
  static const std::shared_ptr<Event>* fence = new std::shared_ptr<Event>(std::make_shared<FenceEvent>(true));
  return *fence;  // leaked on purpose: events outlive static destruction in worker threads
}
}  // namespace

std::shared_ptr<Event> InlineStream::record() { return fired_fence(); }

std::shared_ptr<Event> InlineStream::record_timed() { return std::make_shared<FenceEvent>(true, true); }

void InlineStream::memcpy_batch(const std::vector<CopySegment>& segments, CopyKind) { copy_batch_on_host(segments); }

void InlineStream::wait(const std::shared_ptr<Event>& event) {
  // The caller *is* this stream: waiting means blocking it.
  if (event) event->synchronize();
}

void InlineStream::memcpy(void* dst, const void* src, size_t bytes, CopyKind) {
  if (bytes) std::memcpy(dst, src, bytes);
}

WorkerStream::WorkerStream(int64_t delay_us) : delay_us_(delay_us), worker_([this] { run(); }) {}

WorkerStream::~WorkerStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void WorkerStream::enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

bool WorkerStream::claim_inline(size_t bytes) {
  if (bytes > kInlineCopyBytes || delay_us_.load(std::memory_order_relaxed) > 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (busy_ || !queue_.empty()) return false;
  busy_ = true;
  return true;
}

void WorkerStream::finish_inline() {
  bool queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    queued = !queue_.empty();
  }
  if (queued) cv_.notify_one();  // work enqueued behind the inline copy
}

void WorkerStream::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Not while a caller runs a copy inline (Note [Idle worker runs inline]).
      cv_.wait(lock, [&] { return (stop_ && !busy_) || (!queue_.empty() && !busy_); });
      // Drain the queue even when stopping: a queued fence nobody signals would hang a waiter.
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    task();
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
  }
}

std::shared_ptr<Event> WorkerStream::record() {
  {
    // Nothing queued or running: everything enqueued so far has run (Note [Idle worker runs inline]).
    std::lock_guard<std::mutex> lock(mu_);
    if (!busy_ && queue_.empty()) return fired_fence();
  }
  auto ev = std::make_shared<FenceEvent>(false);
  enqueue([ev] { ev->signal(); });
  return ev;
}

void WorkerStream::wait(const std::shared_ptr<Event>& event) {
  if (!event || event->query()) return;
  enqueue([event] { event->synchronize(); });
}

std::shared_ptr<Event> WorkerStream::record_timed() {
  auto ev = std::make_shared<FenceEvent>(false, true);
  enqueue([ev] { ev->signal(); });
  return ev;
}

void WorkerStream::delay() {
  const int64_t us = delay_us_.load();
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

void WorkerStream::memcpy(void* dst, const void* src, size_t bytes, CopyKind) {
  if (claim_inline(bytes)) {
    if (bytes) std::memcpy(dst, src, bytes);
    finish_inline();
    return;
  }
  enqueue([this, dst, src, bytes] {
    delay();
    if (bytes) std::memcpy(dst, src, bytes);
  });
}

void WorkerStream::memcpy_batch(const std::vector<CopySegment>& segments, CopyKind) {
  size_t bytes = 0;
  for (const CopySegment& s : segments) bytes += s.bytes;
  if (claim_inline(bytes)) {
    copy_batch_on_host(segments);
    finish_inline();
    return;
  }
  enqueue([this, segments] {
    delay();
    copy_batch_on_host(segments);
  });
}

void WorkerStream::drain() { record()->synchronize(); }

}  // namespace ckpt_offload

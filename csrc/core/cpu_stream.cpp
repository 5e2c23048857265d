#include "cpu_stream.h"

#include <chrono>
#include <cstring>

namespace ckpt_offload {

void FenceEvent::synchronize() {
  if (query()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return query(); });
}

void FenceEvent::signal() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

std::shared_ptr<Event> InlineStream::record() { return std::make_shared<FenceEvent>(true); }

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

void WorkerStream::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      // Drain the queue even when stopping: a queued fence nobody signals would hang a waiter.
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

std::shared_ptr<Event> WorkerStream::record() {
  auto ev = std::make_shared<FenceEvent>(false);
  enqueue([ev] { ev->signal(); });
  return ev;
}

void WorkerStream::wait(const std::shared_ptr<Event>& event) {
  if (!event || event->query()) return;
  enqueue([event] { event->synchronize(); });
}

void WorkerStream::memcpy(void* dst, const void* src, size_t bytes, CopyKind) {
  enqueue([this, dst, src, bytes] {
    const int64_t us = delay_us_.load();
    if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
    if (bytes) std::memcpy(dst, src, bytes);
  });
}

void WorkerStream::drain() { record()->synchronize(); }

}  // namespace ckpt_offload

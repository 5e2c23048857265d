// CPU implementations of Stream/Event.
//
// InlineStream is the CPU analogue of the compute stream: work runs on the calling thread,
// so "wait" blocks the caller. WorkerStream is the analogue of a CUDA copy stream: a worker
// thread runs queued copies in order, optionally sleeping before each one, so that a missing
// wait or an early reuse shows up as wrong data in a CPU test instead of only on a GPU.
//
// Note [Idle worker runs inline]
// Handing one copy to the worker costs a queue node, a futex wake-up of the worker, and (when
// the caller waits for it, as backward waits for a reload) a sleep and a wake-up of the caller:
// tens of microseconds of two threads' CPU time, for a few-KiB memcpy that takes a fraction of
// a microsecond. So when the worker is idle (nothing queued, nothing running), no delay is
// injected and the copy is at most kInlineCopyBytes, the caller runs it itself, as the worker
// would have run it right then: everything enqueued before it has finished (the queue is
// empty), and work enqueued meanwhile by other threads waits behind it (`busy_`), so the
// stream's order is the one it always had. record() on an idle worker returns a completed
// event for the same reason. Larger copies still go to the worker (they overlap the caller's
// work), and so does everything while a test delay is set (the CPU suite's asynchronous
// ordering checks stay asynchronous). Waits on an incomplete event are always queued: the
// caller never blocks where a device stream would not.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "stream.h"

namespace ckpt_offload {

class FenceEvent final : public Event {
 public:
  // A timed fence notes the steady-clock time at which it was signalled (profiling).
  explicit FenceEvent(bool done = false, bool timed = false);
  bool query() override { return done_.load(std::memory_order_acquire); }
  bool settled() override { return query(); }
  void synchronize() override;
  int64_t completion_ns() override;
  void signal();

 private:
  std::atomic<bool> done_;
  bool timed_;
  int64_t done_ns_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
};

class InlineStream final : public Stream {
 public:
  std::shared_ptr<Event> record() override;
  std::shared_ptr<Event> record_timed() override;
  void wait(const std::shared_ptr<Event>& event) override;
  void memcpy(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void memcpy_batch(const std::vector<CopySegment>& segments, CopyKind kind) override;
  bool is_host_inline() const override { return true; }
  uintptr_t id() const override { return 0; }
};

class WorkerStream final : public Stream {
 public:
  explicit WorkerStream(int64_t delay_us = 0);
  ~WorkerStream() override;
  WorkerStream(const WorkerStream&) = delete;
  WorkerStream& operator=(const WorkerStream&) = delete;

  std::shared_ptr<Event> record() override;
  std::shared_ptr<Event> record_timed() override;
  void wait(const std::shared_ptr<Event>& event) override;
  void memcpy(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void memcpy_batch(const std::vector<CopySegment>& segments, CopyKind kind) override;

  // Delay injected before every copy (microseconds). Test-only knob.
  void set_delay_us(int64_t us) { delay_us_.store(us); }
  int64_t delay_us() const { return delay_us_.load(); }
  // Blocks until everything enqueued so far has run.
  void drain();
  // The largest copy an idle worker's caller runs itself (Note [Idle worker runs inline]).
  static constexpr size_t kInlineCopyBytes = 64 * 1024;

 private:
  void enqueue(std::function<void()> task);
  // Note [Idle worker runs inline]: takes the stream for the caller (true) when nothing is
  // queued or running and no delay is set; finish_inline() hands it back.
  bool claim_inline(size_t bytes);
  void finish_inline();
  void delay();
  void run();

  std::atomic<int64_t> delay_us_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;  // a task is running (on the worker, or inline on a caller)
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace ckpt_offload

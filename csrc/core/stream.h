// Streams and events: the one ordering interface the copy engine is written against.
//
// Two implementations exist: CUDA streams/events (cuda_stream.cu) and CPU "streams"
// (cpu_stream.cpp) whose work runs either inline on the caller or on a worker thread,
// with fences for events. Because the engine only ever talks to this interface, the
// ordering it enforces on a GPU is the ordering the CPU test suite exercises.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "batch_plan.h"

namespace ckpt_offload {

// Marks a point in a stream's queue. Complete once all work enqueued before it ran.
class Event {
 public:
  virtual ~Event() = default;
  // Non-blocking: true once the marked work has finished.
  virtual bool query() = 0;
  // Blocks the calling host thread until the marked work has finished.
  virtual void synchronize() = 0;
  // When the marked work finished, in nanoseconds of std::chrono::steady_clock, for events
  // made by Stream::record_timed(); -1 for others. Blocks until the work has finished.
  virtual int64_t completion_ns() { return -1; }
};

enum class CopyKind { DeviceToHost, HostToDevice, HostToHost, DeviceToDevice };

class Stream {
 public:
  virtual ~Stream() = default;
  // Returns an event that completes when all work enqueued so far has run.
  virtual std::shared_ptr<Event> record() = 0;
  // Like record(), but the event also knows when it completed (completion_ns). Costs more
  // (timing-enabled CUDA events): used only while profiling.
  virtual std::shared_ptr<Event> record_timed() { return record(); }
  // Work enqueued after this call starts only after `event` has completed.
  virtual void wait(const std::shared_ptr<Event>& event) = 0;
  // Enqueues a copy of `bytes` bytes from src to dst.
  virtual void memcpy(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  // Enqueues many copies as one unit of work: one gather/scatter kernel launch per
  // kBatchMaxSegments copies on CUDA (every pointer must be device-accessible), a loop of
  // memcpys on a CPU stream.
  virtual void memcpy_batch(const std::vector<CopySegment>& segments, CopyKind kind) = 0;
  // True when the work of this stream runs on the caller, in program order.
  virtual bool is_host_inline() const { return false; }
  // Identifies the underlying queue: two wrappers of one CUDA stream share an id.
  virtual uintptr_t id() const { return reinterpret_cast<uintptr_t>(this); }
};

}  // namespace ckpt_offload

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

// Note [No throw on teardown]
// After a sticky CUDA error (a device-side assert) every event query and synchronize fails, and
// the CUDA implementations throw. Destructors reach event queries (~HostBuffer -> HostPool::free,
// ~OffloadedStorage -> CopyEngine::keep_until, ~HostPool): a throw there is std::terminate, and
// the user loses the Python error that caused it. Destructor paths therefore use state() and
// try_synchronize(), which never throw; a copy whose event failed is treated as never finishing:
// its host block is leaked (never reused, its segment never released) and a warning is printed,
// rather than reusing memory a copy might still touch. Beyond event queries, every destructor on
// these paths (~SavedTensor, ~OffloadedStorage, ~Batch, ~HostBuffer, ~DeviceScope, ~CudaEvent)
// catches whatever its body throws (the capture probe, a device switch, a pool misuse): autograd
// runs them when it drops a graph, also while a backward that raised unwinds and on autograd's
// device threads, where a throw would end the process instead of reporting the first error.

// What a non-throwing query found.
enum class EventState { Done, Pending, Failed };

// Marks a point in a stream's queue. Complete once all work enqueued before it ran.
class Event {
 public:
  virtual ~Event() = default;
  // query() that never throws: Failed when the query itself failed. See Note [No throw on teardown].
  EventState state() noexcept {
    try {
      return query() ? EventState::Done : EventState::Pending;
    } catch (...) {
      return EventState::Failed;
    }
  }
  // synchronize() that never throws: false when the wait failed.
  bool try_synchronize() noexcept {
    try {
      synchronize();
      return true;
    } catch (...) {
      return false;
    }
  }
  // Non-blocking: true once the marked work has finished.
  virtual bool query() = 0;
  // True when the work is known to have finished without asking the device (a CPU fence that
  // fired): what may skip recording the event. False means "ask query()", not "pending".
  virtual bool settled() { return false; }
  // Blocks the calling host thread until the marked work has finished.
  virtual void synchronize() = 0;
  // When the marked work finished, in nanoseconds of std::chrono::steady_clock, for events
  // made by Stream::record_timed(); -1 for others. Blocks until the work has finished.
  virtual int64_t completion_ns() { return -1; }
};

// Whether a CUDA graph is being captured on the calling thread's current stream, as told by a
// probe the torch layer installs (none: never). While it says so, the core queries no event:
// HostPool::free parks blocks as pending, reclaiming and CopyEngine::poll wait for a later call.
// See Note [Graph capture] (csrc/torch/runtime.h).
// The probe may throw (the torch layer's reads the current device and stream, which fail after
// a CUDA error): capture_active() never does -- it runs in destructors (~HostBuffer ->
// HostPool::free) -- and answers "capturing" then, so that nothing queries an event or releases
// memory on a device in an unknown state (Note [No throw on teardown]).
using CaptureProbe = bool (*)();
void set_capture_probe(CaptureProbe probe);
CaptureProbe capture_probe();
bool capture_active() noexcept;

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

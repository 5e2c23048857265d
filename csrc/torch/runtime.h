// Process-wide pieces the torch layer shares: the copy engine and the streams per device.
#pragma once

#include <ATen/record_function.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>

#include "../core/copy_engine.h"
#include "../core/host_pool.h"
#include "../core/stream.h"
#include "current_stream.h"

namespace ckpt_offload {

CopyEngine& engine();

// Note [Stream ordering]
// Every copy runs between a `compute` stream (the current stream of the tensor's device, read
// at every call: FSDP, recompute and user code switch streams) and a `copy` stream (`compute`
// itself for stream="compute", else the device's side stream for the direction). The rules,
// each enforced where it is cited:
//  1. Offload: the copy starts after everything that produced the source (copy.wait(compute
//     event); for a batch, an event of every stream that produced a member, recorded at
//     Batch::add), and the source is kept alive until the copy has read it (CopyEngine::hold).
//  2. Reload: the destination is allocated in compute order and the copy stream waits for the
//     compute stream before writing it; the consumer waits for the copy's event before use.
//  3. A reload buffer consumed on another stream than the one that allocated it (a prefetch
//     made under one stream and unpacked under another, a shared reload) gets record_stream
//     on the consumer (record_consumer), so the caching allocator does not reuse it while the
//     consumer's kernels are queued.
//  4. Demand reloads (backward waits for them now) run on their own highest-priority stream,
//     never behind queued prefetches (SideStream::H2DDemand; a third worker on CPU).
//  5. A host block is reused only after every copy that touched it has finished (HostPool's
//     per-block events, queried, never waited on).
//  6. Device memory (prefetch buffers, staging blocks) and work for a handle of device A are
//     allocated and enqueued with A current (DeviceScope), never on device B's streams.
//  7. Nothing queries an event, polls or releases pool memory while the current stream
//     captures a CUDA graph: see Note [Graph capture].

// Makes `device` current for the scope when it is a CUDA device (a no-op for CPU), so that
// allocations and kernel launches for its tensors land on it. Note [Stream ordering] rule 6.
class DeviceScope {
 public:
  explicit DeviceScope(const c10::Device& device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

// Where the copies of one tensor run. `compute` is the stream that produced (or will
// consume) the tensor, captured at every call; `copy` is `compute` itself for
// stream="compute", or the device's side copy stream for the direction (for a reload that
// backward waits for now, `demand`: the demand stream). See Note [Stream ordering].
class StreamPair {
 public:
  StreamPair(const c10::Device& device, bool side, bool to_host, bool demand = false);
  // The same, with the current stream already read (pack reads it once for every step).
  StreamPair(const CurrentStream& current, bool side, bool to_host, bool demand = false);
  Stream& compute() { return *compute_; }
  Stream& copy() { return *copy_; }

 private:
  std::unique_ptr<Stream> owned_compute_;
  Stream* compute_;
  Stream* copy_;
};

// The names of the ranges around copies, written here once: Python reads them as
// _C.COPY_RANGES (the planner's measurement tells reloaded activations by them).
namespace copy_ranges {
inline constexpr const char* kOffload = "ckpt_offload::offload";
inline constexpr const char* kOffloadBatch = "ckpt_offload::offload_batch";
inline constexpr const char* kReload = "ckpt_offload::reload";
inline constexpr const char* kReloadBatch = "ckpt_offload::reload_batch";
inline constexpr const char* kPrefetch = "ckpt_offload::prefetch";
inline constexpr const char* kPrefetchBatch = "ckpt_offload::prefetch_batch";
// Around the allocation and conversion of a full-width tensor reloaded from a narrower storage
// (co.offload(store_dtype=...)).
inline constexpr const char* kReloadConvert = "ckpt_offload::reload_convert";
}  // namespace copy_ranges

// A named range around the enqueueing of a copy: shows in torch.profiler traces
// (record_function) and, on a GPU, in Nsight Systems (NVTX).
class CopyRange {
 public:
  CopyRange(const char* name, const c10::Device& device);
  ~CopyRange();
  CopyRange(const CopyRange&) = delete;
  CopyRange& operator=(const CopyRange&) = delete;

 private:
  at::RecordFunction guard_;
  bool nvtx_;
};

// Bytes torch's CUDA caching allocator has handed out on `device`; -1 for CPU.
int64_t device_allocated_bytes(const c10::Device& device);

// Delay injected before every copy on the CPU side streams (test knob; also read once from
// CKPT_OFFLOAD_CPU_COPY_DELAY_US).
void set_cpu_copy_delay_us(int64_t us);
int64_t cpu_copy_delay_us();
// Waits for the copies queued on the CPU worker streams; releases nothing (unlike synchronize).
void drain_cpu_streams();
// Waits until every copy enqueued on the side streams has finished.
void synchronize_side_streams();
// How many forks this process came out of as the child (0 in the original process). See
// Note [Fork] in runtime.cpp.
uint64_t fork_generation();

// Note [Graph capture]
// While a stream captures a CUDA graph, an event query, a stream synchronize or a pinned
// memory release (cudaFreeHost / cudaHostUnregister synchronize the device) invalidates the
// capture. So: pack keeps tensors made under capture on the device (KeepReason::GraphCapture);
// unpacking a tensor held in the pool under capture raises (a reload copy must not be baked
// into a graph); and the core's event queries (HostPool::free/reclaim, CopyEngine::poll and
// keep_until, HostBuffer::add_reader) defer themselves while capture_active() (stream.h) says
// so — the torch layer installs the probe (install_capture_probe).

// True while `device`'s current stream is capturing a CUDA graph: nothing that queries an
// event, synchronizes, or frees pinned memory may run then (each invalidates the capture).
// See Note [Graph capture]. Never true for CPU.
bool current_stream_capturing(const c10::Device& device);
// Installs the core's capture probe (stream.h): the current device's current stream captures.
void install_capture_probe();
// Test hook: on, the capture probe raises (as reading the current stream does after a CUDA
// error); off, the probe installed before comes back.
void set_failing_capture_probe(bool on);

bool cuda_compiled();
int cuda_device_count();
std::string cuda_runtime_version();
// A pool on the named backend: "pinned" (cudaHostAlloc), "registered" (cudaHostRegister on
// page-aligned memory) or "pageable". Throws when pinned memory cannot be had.
std::shared_ptr<HostPool> make_pool(const std::string& backend, size_t max_bytes, size_t segment_bytes,
                                    int numa_node = -1);

}  // namespace ckpt_offload

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

namespace ckpt_offload {

CopyEngine& engine();

// Where the copies of one tensor run. `compute` is the stream that produced (or will
// consume) the tensor, captured at every call; `copy` is `compute` itself for
// stream="compute", or the device's side copy stream for the direction.
class StreamPair {
 public:
  StreamPair(const c10::Device& device, bool side, bool to_host);
  Stream& compute() { return *compute_; }
  Stream& copy() { return *copy_; }

 private:
  std::unique_ptr<Stream> owned_compute_;
  Stream* compute_;
  Stream* copy_;
};

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
// Waits until every copy enqueued on the side streams has finished.
void synchronize_side_streams();

bool cuda_compiled();
int cuda_device_count();
std::string cuda_runtime_version();
// A pool on the named backend: "pinned" (cudaHostAlloc), "registered" (cudaHostRegister on
// page-aligned memory) or "pageable". Throws when pinned memory cannot be had.
std::shared_ptr<HostPool> make_pool(const std::string& backend, size_t max_bytes, size_t segment_bytes);

}  // namespace ckpt_offload

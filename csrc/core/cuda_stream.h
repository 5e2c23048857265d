// CUDA implementations of Stream/Event, and the pinned-memory backend of HostPool.
// Compiled only when ckpt_offload is built with CUDA (CKPT_OFFLOAD_WITH_CUDA).
#pragma once

#include <memory>
#include <string>

#include "host_pool.h"
#include "stream.h"

// Keep cuda_runtime.h out of this header: the torch layer includes it next to torch's own
// CUDA headers, and a cudaStream_t is an opaque pointer anyway.
struct CUstream_st;

namespace ckpt_offload {
namespace cuda {

using StreamHandle = CUstream_st*;

class CudaStream final : public Stream {
 public:
  // Wraps an existing stream (not owned), e.g. PyTorch's current stream on `device`.
  CudaStream(StreamHandle stream, int device) : stream_(stream), device_(device) {}
  std::shared_ptr<Event> record() override;
  std::shared_ptr<Event> record_timed() override;
  void wait(const std::shared_ptr<Event>& event) override;
  void memcpy(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void memcpy_batch(const std::vector<CopySegment>& segments, CopyKind kind) override;
  uintptr_t id() const override { return reinterpret_cast<uintptr_t>(stream_) ^ (uintptr_t(device_ + 1) << 56); }
  StreamHandle handle() const { return stream_; }
  int device() const { return device_; }

 private:
  StreamHandle stream_;
  int device_;
};

// D2H: offloads. H2D: prefetches. H2DDemand: reloads that backward waits for now, on a
// stream of their own with the device's highest priority, so that they never queue behind
// prefetches (see Note [Stream ordering], csrc/torch/runtime.h).
enum class SideStream { D2H = 0, H2D = 1, H2DDemand = 2, kCount = 3 };
// The dedicated copy stream of `device` for one direction, created on first use and kept for
// the life of the process.
CudaStream& side_stream(int device, SideStream which);
// Blocks until every side stream created so far has run all its work. Holds no lock while it
// waits: packs on other threads (which look their side stream up) do not stall behind it.
void synchronize_side_streams();

// numa_node >= 0 (both backends): segments from numa::map_on_node, pinned with cudaHostRegister
// (Note [NUMA-local segments] in numa.h: cudaHostAlloc places its pages itself).
class PinnedBackend final : public Backend {
 public:
  explicit PinnedBackend(int numa_node = -1) : numa_node_(numa_node) {}
  void* allocate(size_t bytes) override;
  void release(void* ptr, size_t bytes) override;
  const char* name() const override { return "pinned"; }
  int numa_node() const override { return numa_node_; }

 private:
  int numa_node_;
};

// Page-aligned, pre-faulted host memory made pinned with cudaHostRegister: an alternative to
// cudaHostAlloc for large segments (the segment size is rounded up to whole pages).
class RegisteredBackend final : public Backend {
 public:
  explicit RegisteredBackend(int numa_node = -1) : numa_node_(numa_node) {}
  void* allocate(size_t bytes) override;
  void release(void* ptr, size_t bytes) override;
  const char* name() const override { return "registered"; }
  int numa_node() const override { return numa_node_; }

 private:
  int numa_node_;
};

// NVTX ranges (Nsight Systems); no-ops unless a tool is attached.
void nvtx_push(const char* name);
void nvtx_pop();
// Profiler start: takes fresh per-device timing epochs (the reference event a timed event's
// completion is converted to host time against) for the devices in use now.
void start_timing_epochs();
// The host time (steady clock ns) of `device`'s timing epoch; -1 when it has none. Test hook.
int64_t timing_epoch_ns(int device);

// Number of usable devices; 0 when no driver or device is present (never throws).
int device_count();
// "13.0"-style runtime version string, empty when unavailable.
std::string runtime_version();

}  // namespace cuda
}  // namespace ckpt_offload

// runtime.h's device side for the CUDA build (device_runtime.h): devices, current streams and
// capture status from c10 / the CUDA runtime, the side streams, pinned backends and timing
// epochs of core/cuda_stream.h. The C++-only build compiles ../cpu/runtime.cpp instead.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <stdexcept>

#include "../../core/cuda_stream.h"
#include "../device_runtime.h"
#include "../runtime.h"

namespace ckpt_offload {

DeviceScope::DeviceScope(const c10::Device& device) {
  if (device.is_cuda() && device.has_index()) {
    previous_ = c10::cuda::current_device();
    if (previous_ == device.index()) {
      previous_ = -1;
    } else {
      c10::cuda::set_device(device.index());
    }
  }
}

DeviceScope::~DeviceScope() {
  // Also runs while an exception unwinds (a reload that raised): a second throw would be
  // std::terminate. After a CUDA error the device is lost anyway.
  if (previous_ >= 0) {
    try {
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(previous_));
    } catch (...) {
    }
  }
}

CurrentStream CurrentStream::of(const c10::Device& device) {
  CurrentStream c(device);
  if (device.is_cuda()) {
    c.index_ = device.has_index() ? device.index() : c10::cuda::current_device();
    c.stream_ = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(c.index_)).stream();
  }
  return c;
}

bool CurrentStream::capturing() const {
  if (!device_.is_cuda()) return false;
  // cudaStreamIsCapturing, not a c10 helper: the c10 capture-status helpers differ between
  // the torch releases we support (2.11 - 2.14), the runtime call does not.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream_), &status);
  if (err != cudaSuccess) {
    // Asking about the legacy stream while another thread captures fails
    // (cudaErrorStreamCaptureImplicit): a capture is under way, so answer as if capturing.
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

int64_t device_allocated_bytes(const c10::Device& device) {
  if (device.is_cuda()) {
    const int index = device.has_index() ? device.index() : c10::cuda::current_device();
    return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].current;
  }
  return -1;
}

void install_capture_probe() {
  ensure_fork_handlers();  // Note [Fork]
  set_capture_probe([]() -> bool {
    // A fork child of a process that had called CUDA cannot use CUDA (and must not try):
    // nothing there captures. Note [Fork].
    if (cuda_unusable_after_fork()) return false;
    // No device, no capture; and no CUDA context is created just to ask. May throw (reading the
    // current device after a CUDA error): capture_active() turns that into "capturing".
    static const bool has_device = [] {
      note_cuda_used();
      return cuda::device_count() > 0;
    }();
    return has_device && current_stream_capturing(c10::Device(c10::kCUDA, c10::cuda::current_device()));
  });
}

bool cuda_compiled() { return true; }

int cuda_device_count() {
  if (cuda_unusable_after_fork()) return 0;  // Note [Fork]
  note_cuda_used();
  return cuda::device_count();
}

std::string cuda_runtime_version() { return cuda::runtime_version(); }

namespace device_runtime {

bool stream_pair(const CurrentStream& current, bool side, bool to_host, bool demand, std::unique_ptr<Stream>* owned,
                 Stream** compute, Stream** copy) {
  if (!current.device().is_cuda()) return false;
  // Read by the caller, at every call: FSDP, recompute and user code switch streams.
  *owned = std::make_unique<cuda::CudaStream>(static_cast<cudaStream_t>(current.cuda_stream()), current.index());
  *compute = owned->get();
  const auto which = to_host ? cuda::SideStream::D2H : demand ? cuda::SideStream::H2DDemand : cuda::SideStream::H2D;
  *copy = side ? &cuda::side_stream(current.index(), which) : *compute;
  return true;
}

void range_push(const char* name) { cuda::nvtx_push(name); }

void range_pop() { cuda::nvtx_pop(); }

void synchronize_streams() {
  if (!cuda_unusable_after_fork()) cuda::synchronize_side_streams();  // Note [Fork]
}

std::unique_ptr<Backend> pinned_backend(const std::string& backend_name, int numa_node) {
  if (cuda_device_count() == 0)
    throw std::invalid_argument("ckpt_offload: backend '" + backend_name +
                                "' (pinned memory) needs a usable CUDA device, and none was found; pass "
                                "pinned=False / backend='pageable' (or pinned=None to choose automatically)");
  if (backend_name == "pinned") return std::make_unique<cuda::PinnedBackend>(numa_node);
  return std::make_unique<cuda::RegisteredBackend>(numa_node);
}

void start_timing_epochs() {
  if (cuda_device_count() > 0) cuda::start_timing_epochs();
}

int64_t timing_epoch_ns(int device) { return cuda::timing_epoch_ns(device); }

}  // namespace device_runtime
}  // namespace ckpt_offload

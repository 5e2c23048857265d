#include "cuda_stream.h"

#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>

namespace ckpt_offload {
namespace cuda {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it so the next, unrelated call is not blamed for it
    throw std::runtime_error(std::string("ckpt_offload: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

// Events and streams belong to a device: create and record them with it current.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    set_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (set_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool set_ = false;
};

class CudaEvent final : public Event {
 public:
  CudaEvent() {
    check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  ~CudaEvent() override {
    // May run after the driver has shut down at process exit: ignore the error.
    cudaEventDestroy(event_);
  }
  bool query() override {
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    check(err, "cudaEventQuery");
    return true;
  }
  void synchronize() override { check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
};

}  // namespace

std::shared_ptr<Event> CudaStream::record() {
  DeviceGuard guard(device_);
  auto ev = std::make_shared<CudaEvent>();
  check(cudaEventRecord(ev->get(), stream_), "cudaEventRecord");
  return ev;
}

void CudaStream::wait(const std::shared_ptr<Event>& event) {
  if (!event) return;
  if (auto* ce = dynamic_cast<CudaEvent*>(event.get())) {
    DeviceGuard guard(device_);
    check(cudaStreamWaitEvent(stream_, ce->get(), 0), "cudaStreamWaitEvent");
  } else {
    event->synchronize();  // a host-side fence: the only way to order after it is to wait here
  }
}

void CudaStream::memcpy(void* dst, const void* src, size_t bytes, CopyKind kind) {
  if (!bytes) return;
  DeviceGuard guard(device_);
  cudaMemcpyKind k = kind == CopyKind::DeviceToHost ? cudaMemcpyDeviceToHost
                     : kind == CopyKind::HostToDevice ? cudaMemcpyHostToDevice
                                                      : cudaMemcpyHostToHost;
  check(cudaMemcpyAsync(dst, src, bytes, k, stream_), "cudaMemcpyAsync");
}

namespace {
constexpr int kMaxDevices = 64;
std::mutex side_mu;
CudaStream* side_streams[kMaxDevices][2] = {};  // leaked on purpose: no teardown-order hazards at exit
}  // namespace

void synchronize_side_streams() {
  std::lock_guard<std::mutex> lock(side_mu);
  for (auto& per_device : side_streams)
    for (CudaStream* s : per_device)
      if (s) check(cudaStreamSynchronize(s->handle()), "cudaStreamSynchronize");
}

CudaStream& side_stream(int device, SideStream which) {
  if (device < 0 || device >= kMaxDevices) throw std::out_of_range("ckpt_offload: CUDA device index out of range");
  std::lock_guard<std::mutex> lock(side_mu);
  auto& streams = side_streams;
  CudaStream*& s = streams[device][static_cast<int>(which)];
  if (!s) {
    DeviceGuard guard(device);
    cudaStream_t raw;
    // Non-blocking: the copy stream must not serialize with the legacy default stream.
    check(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    s = new CudaStream(raw, device);
  }
  return *s;
}

void* PinnedBackend::allocate(size_t bytes) {
  void* p = nullptr;
  // Portable: the pool serves tensors of every device.
  cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void PinnedBackend::release(void* ptr, size_t) { cudaFreeHost(ptr); }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return "";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

}  // namespace cuda
}  // namespace ckpt_offload

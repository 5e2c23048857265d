#include "runtime.h"

#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "../core/cpu_stream.h"

#ifdef CKPT_OFFLOAD_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "../core/cuda_stream.h"
#endif

namespace ckpt_offload {
namespace {

int64_t initial_delay() {
  const char* env = std::getenv("CKPT_OFFLOAD_CPU_COPY_DELAY_US");
  return env ? std::atoll(env) : 0;
}

struct CpuStreams {
  InlineStream compute;
  WorkerStream d2h{initial_delay()};
  WorkerStream h2d{initial_delay()};
  WorkerStream h2d_demand{initial_delay()};  // Note [Stream ordering] rule 4
};

CpuStreams& cpu_streams() {
  // Leaked on purpose: worker threads must not be joined during interpreter teardown.
  static CpuStreams* s = new CpuStreams();
  return *s;
}

}  // namespace

CopyEngine& engine() {
  static CopyEngine* e = new CopyEngine();  // leaked: keepalives must outlive every pool user
  return *e;
}

DeviceScope::DeviceScope(const c10::Device& device) {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (device.is_cuda() && device.has_index()) {
    previous_ = c10::cuda::current_device();
    if (previous_ == device.index()) {
      previous_ = -1;
    } else {
      c10::cuda::set_device(device.index());
    }
  }
#else
  (void)device;
#endif
}

DeviceScope::~DeviceScope() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  // Also runs while an exception unwinds (a reload that raised): a second throw would be
  // std::terminate. After a CUDA error the device is lost anyway.
  if (previous_ >= 0) {
    try {
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(previous_));
    } catch (...) {
    }
  }
#endif
}

CurrentStream CurrentStream::of(const c10::Device& device) {
  CurrentStream c(device);
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (device.is_cuda()) {
    c.index_ = device.has_index() ? device.index() : c10::cuda::current_device();
    c.stream_ = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(c.index_)).stream();
  }
#endif
  return c;
}

bool CurrentStream::capturing() const {
#ifdef CKPT_OFFLOAD_WITH_CUDA
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
#else
  return false;
#endif
}

StreamPair::StreamPair(const c10::Device& device, bool side, bool to_host, bool demand)
    : StreamPair(CurrentStream::of(device), side, to_host, demand) {}

StreamPair::StreamPair(const CurrentStream& current, bool side, bool to_host, bool demand) {
  const c10::Device& device = current.device();
  if (device.is_cpu()) {
    CpuStreams& s = cpu_streams();
    compute_ = &s.compute;
    copy_ = !side ? static_cast<Stream*>(compute_) : to_host ? &s.d2h : demand ? &s.h2d_demand : &s.h2d;
    return;
  }
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (device.is_cuda()) {
    // Read by the caller, at every call: FSDP, recompute and user code switch streams.
    owned_compute_ = std::make_unique<cuda::CudaStream>(static_cast<cudaStream_t>(current.cuda_stream()),
                                                        current.index());
    compute_ = owned_compute_.get();
    const auto which = to_host ? cuda::SideStream::D2H : demand ? cuda::SideStream::H2DDemand : cuda::SideStream::H2D;
    copy_ = side ? &cuda::side_stream(current.index(), which) : compute_;
    return;
  }
#endif
  throw std::invalid_argument("ckpt_offload: no copy streams for device " + device.str());
}

CopyRange::CopyRange(const char* name, const c10::Device& device)
    : guard_(at::RecordScope::USER_SCOPE), nvtx_(device.is_cuda()) {
  if (guard_.isActive()) guard_.before(name);
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (nvtx_) cuda::nvtx_push(name);
#endif
}

CopyRange::~CopyRange() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (nvtx_) cuda::nvtx_pop();
#endif
}

int64_t device_allocated_bytes(const c10::Device& device) {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (device.is_cuda()) {
    const int index = device.has_index() ? device.index() : c10::cuda::current_device();
    return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].current;
  }
#endif
  (void)device;
  return -1;
}

void set_cpu_copy_delay_us(int64_t us) {
  cpu_streams().d2h.set_delay_us(us);
  cpu_streams().h2d.set_delay_us(us);
  cpu_streams().h2d_demand.set_delay_us(us);
}

int64_t cpu_copy_delay_us() { return cpu_streams().d2h.delay_us(); }

void synchronize_side_streams() {
  cpu_streams().d2h.drain();
  cpu_streams().h2d.drain();
  cpu_streams().h2d_demand.drain();
#ifdef CKPT_OFFLOAD_WITH_CUDA
  cuda::synchronize_side_streams();
#endif
  engine().synchronize();
}

bool current_stream_capturing(const c10::Device& device) {
  return device.is_cuda() && CurrentStream::of(device).capturing();
}

void install_capture_probe() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  set_capture_probe([]() -> bool {
    // No device, no capture; and no CUDA context is created just to ask. May throw (reading the
    // current device after a CUDA error): capture_active() turns that into "capturing".
    static const bool has_device = cuda::device_count() > 0;
    return has_device && current_stream_capturing(c10::Device(c10::kCUDA, c10::cuda::current_device()));
  });
#endif
}

namespace {
std::mutex g_probe_mu;
CaptureProbe g_saved_probe = nullptr;
bool g_probe_failing = false;
}  // namespace

void set_failing_capture_probe(bool on) {
  std::lock_guard<std::mutex> lock(g_probe_mu);
  if (on == g_probe_failing) return;
  g_probe_failing = on;
  if (on) {
    g_saved_probe = capture_probe();
    set_capture_probe([]() -> bool { throw std::runtime_error("ckpt_offload: injected capture-probe failure"); });
  } else {
    set_capture_probe(g_saved_probe);
  }
}

bool cuda_compiled() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

std::string cuda_runtime_version() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  return cuda::runtime_version();
#else
  return "";
#endif
}

std::shared_ptr<HostPool> make_pool(const std::string& backend_name, size_t max_bytes, size_t segment_bytes) {
  std::unique_ptr<Backend> backend;
  if (backend_name == "pageable") {
    backend = std::make_unique<PageableBackend>();
  } else if (backend_name == "pinned" || backend_name == "registered") {
#ifdef CKPT_OFFLOAD_WITH_CUDA
    if (cuda::device_count() == 0)
      throw std::invalid_argument("ckpt_offload: backend '" + backend_name +
                                  "' (pinned memory) needs a usable CUDA device, and none was found; pass "
                                  "pinned=False / backend='pageable' (or pinned=None to choose automatically)");
    if (backend_name == "pinned")
      backend = std::make_unique<cuda::PinnedBackend>();
    else
      backend = std::make_unique<cuda::RegisteredBackend>();
#else
    throw std::invalid_argument("ckpt_offload: backend '" + backend_name +
                                "' (pinned memory) needs ckpt_offload built with CUDA; this build is CPU-only. Pass "
                                "pinned=False / backend='pageable', or reinstall with CKPT_OFFLOAD_CUDA=1 where nvcc and "
                                "a CUDA build of torch exist");
#endif
  } else {
    throw std::invalid_argument("ckpt_offload: backend must be 'pinned', 'registered' or 'pageable', got '" +
                                backend_name + "'");
  }
  return std::make_shared<HostPool>(std::move(backend), max_bytes, segment_bytes);
}

}  // namespace ckpt_offload

#include "runtime.h"

#include <pthread.h>

#include <atomic>
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
  CpuStreams(int64_t delay_us, uint64_t generation_)
      : d2h(delay_us), h2d(delay_us), h2d_demand(delay_us), generation(generation_) {}
  InlineStream compute;
  WorkerStream d2h;
  WorkerStream h2d;
  WorkerStream h2d_demand;  // Note [Stream ordering] rule 4
  const uint64_t generation;  // the fork generation they were made in (Note [Fork])

  void drain() {
    d2h.drain();
    h2d.drain();
    h2d_demand.drain();
  }
};

// Note [Fork]
// fork() copies the memory of the process, not its threads: in the child, the CPU copy
// streams' worker threads do not exist, so a copy queued there never runs and a fence never
// fires (backward, or co.synchronize(), would wait forever). DataLoader workers and
// multiprocessing pools fork. So, with pthread_atfork:
//  - before the fork, in the parent, every copy already queued on the CPU streams is run to
//    its end (drain), so that every fence the child inherits has fired and every host block
//    holds its bytes; the lock that guards the streams is held across the fork, so that no
//    other thread of the parent is halfway through making them;
//  - in the child, the handler only bumps a counter (what runs between fork and exec must stay
//    simple); the next use of the streams makes fresh ones, with fresh worker threads. The old
//    ones are leaked: their threads cannot be joined, they do not exist there;
//  - the child never calls CUDA on our behalf when the parent had initialised it (torch refuses
//    CUDA in such a child anyway, and a call fails there): the capture probe answers "not
//    capturing" without asking the driver.
// The disk tier's I/O threads are the same case (see Note [Fork] in csrc/core/file_tier.h).
std::atomic<uint64_t> g_fork_generation{0};  // forks this process has come out of, as a child
std::atomic<bool> g_cuda_touched{false};     // this process (or its parent before a fork) called CUDA
std::atomic<bool> g_cuda_unusable{false};    // a fork child of a process that had called CUDA
std::mutex g_streams_mu;                     // making / replacing the CPU streams
std::atomic<CpuStreams*> g_streams{nullptr};

void before_fork() {
  g_streams_mu.lock();
  if (CpuStreams* s = g_streams.load(std::memory_order_acquire)) s->drain();
}

void after_fork_in_parent() { g_streams_mu.unlock(); }

void after_fork_in_child() {
  g_fork_generation.fetch_add(1, std::memory_order_acq_rel);
  if (g_cuda_touched.load(std::memory_order_relaxed)) g_cuda_unusable.store(true, std::memory_order_relaxed);
  g_streams_mu.unlock();  // held by this thread (the one that forked) since before_fork
}

void install_fork_handlers() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child); });
}

CpuStreams& cpu_streams() {
  // Two acquire loads per copy on the fast path; the generation only moves in a fork child.
  const uint64_t generation = g_fork_generation.load(std::memory_order_acquire);
  CpuStreams* s = g_streams.load(std::memory_order_acquire);
  if (s && s->generation == generation) return *s;
  install_fork_handlers();
  std::lock_guard<std::mutex> lock(g_streams_mu);
  s = g_streams.load(std::memory_order_acquire);
  if (!s || s->generation != generation) {
    // Leaked on purpose: worker threads must not be joined during interpreter teardown, and
    // the streams a fork left behind have no threads to join (Note [Fork]).
    s = new CpuStreams(s ? s->d2h.delay_us() : initial_delay(), generation);
    g_streams.store(s, std::memory_order_release);
  }
  return *s;
}

}  // namespace

uint64_t fork_generation() { return g_fork_generation.load(std::memory_order_acquire); }

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
  if (previous_ >= 0) c10::cuda::set_device(static_cast<c10::DeviceIndex>(previous_));
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
  cpu_streams().drain();
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (!g_cuda_unusable.load(std::memory_order_relaxed)) cuda::synchronize_side_streams();  // Note [Fork]
#endif
  engine().synchronize();
}

bool current_stream_capturing(const c10::Device& device) {
  return device.is_cuda() && CurrentStream::of(device).capturing();
}

void install_capture_probe() {
  install_fork_handlers();  // Note [Fork]
#ifdef CKPT_OFFLOAD_WITH_CUDA
  set_capture_probe([]() -> bool {
    // A fork child of a process that had called CUDA cannot use CUDA (and must not try):
    // nothing there captures. Note [Fork].
    if (g_cuda_unusable.load(std::memory_order_relaxed)) return false;
    // No device, no capture; and no CUDA context is created just to ask.
    static const bool has_device = [] {
      g_cuda_touched.store(true, std::memory_order_relaxed);
      return cuda::device_count() > 0;
    }();
    return has_device && current_stream_capturing(c10::Device(c10::kCUDA, c10::cuda::current_device()));
  });
#endif
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
  if (g_cuda_unusable.load(std::memory_order_relaxed)) return 0;  // Note [Fork]
  g_cuda_touched.store(true, std::memory_order_relaxed);
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
    if (cuda_device_count() == 0)
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

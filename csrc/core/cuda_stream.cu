#include "cuda_stream.h"

#include "numa.h"

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

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

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Per device: a timing event whose host time is known, so that a timed event's completion
// converts to the host's steady clock (cudaEventElapsedTime between the two). Reset at each
// profiler start: the elapsed time is a float of milliseconds and loses precision with age.
struct TimingEpoch {
  cudaEvent_t event = nullptr;
  int64_t host_ns = 0;
};
std::mutex epoch_mu;
TimingEpoch epochs[64];

// Needs epoch_mu.
void make_epoch_locked(int device) {
  TimingEpoch& e = epochs[device];
  DeviceGuard guard(device);
  check(cudaEventCreate(&e.event), "cudaEventCreate");
  // Recorded on the legacy stream with nothing queued after it: its completion is within
  // microseconds of the host time taken after the synchronize.
  check(cudaEventRecord(e.event, nullptr), "cudaEventRecord");
  check(cudaEventSynchronize(e.event), "cudaEventSynchronize");
  e.host_ns = steady_ns();
}

// Every copy records an event or two: reuse them instead of a cudaEventCreate/Destroy pair per
// copy. Safe because a stream that waited on an event captured its state at the wait; the event
// is handed out again only after its last owner (and so every query of it) is gone.
class EventPool {
 public:
  cudaEvent_t take(int device, bool timed) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = free_[device][timed];
      if (!free.empty()) {
        cudaEvent_t e = free.back();
        free.pop_back();
        return e;
      }
    }
    cudaEvent_t e;
    check(cudaEventCreateWithFlags(&e, timed ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return e;
  }
  void give(int device, bool timed, cudaEvent_t e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = free_[device][timed];
      if (free.size() < kMaxFree) {
        free.push_back(e);
        return;
      }
    }
    cudaEventDestroy(e);  // may fail after driver shutdown at exit: ignored
  }

 private:
  static constexpr size_t kMaxFree = 4096;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_[64][2];
};

EventPool& event_pool() {
  static EventPool* p = new EventPool();  // leaked: events may die during interpreter teardown
  return *p;
}

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device, bool timed = false)
      : event_(event_pool().take(device, timed)), device_(device), timed_(timed) {}
  ~CudaEvent() override {
    try {  // Note [No throw on teardown] (stream.h)
      event_pool().give(device_, timed_, event_);
    } catch (...) {
    }
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
  int64_t completion_ns() override {
    if (!timed_) return -1;
    synchronize();
    std::lock_guard<std::mutex> lock(epoch_mu);
    TimingEpoch& e = epochs[device_];
    if (!e.event) make_epoch_locked(device_);
    float ms = 0.f;
    check(cudaEventElapsedTime(&ms, e.event, event_), "cudaEventElapsedTime");
    return e.host_ns + static_cast<int64_t>(static_cast<double>(ms) * 1e6);
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
  int device_;
  bool timed_;
};

// One block per chunk (kBatchChunkBytes): 16-byte moves where source and destination share
// their alignment mod 16 (the batch layout arranges that), bytes elsewhere.
__global__ void copy_batch_kernel(BatchLaunch launch) {
  int seg = 0;
  size_t offset = 0, length = 0;
  locate_chunk(launch, blockIdx.x, &seg, &offset, &length);
  const char* src = static_cast<const char*>(launch.segments[seg].src) + offset;
  char* dst = static_cast<char*>(launch.segments[seg].dst) + offset;
  const uintptr_t s = reinterpret_cast<uintptr_t>(src), d = reinterpret_cast<uintptr_t>(dst);
  size_t head = length, body = 0;
  if ((s & 15) == (d & 15)) {
    head = (16 - (s & 15)) & 15;
    if (head > length) head = length;
    body = (length - head) / 16;
  }
  for (size_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
  const uint4* src4 = reinterpret_cast<const uint4*>(src + head);
  uint4* dst4 = reinterpret_cast<uint4*>(dst + head);
  for (size_t i = threadIdx.x; i < body; i += blockDim.x) dst4[i] = src4[i];
  for (size_t i = head + body * 16 + threadIdx.x; i < length; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

std::shared_ptr<Event> CudaStream::record() {
  DeviceGuard guard(device_);
  auto ev = std::make_shared<CudaEvent>(device_);
  check(cudaEventRecord(ev->get(), stream_), "cudaEventRecord");
  return ev;
}

std::shared_ptr<Event> CudaStream::record_timed() {
  DeviceGuard guard(device_);
  auto ev = std::make_shared<CudaEvent>(device_, /*timed=*/true);
  check(cudaEventRecord(ev->get(), stream_), "cudaEventRecord");
  return ev;
}

void CudaStream::memcpy_batch(const std::vector<CopySegment>& segments, CopyKind kind) {
  DeviceGuard guard(device_);
  if (kind != CopyKind::DeviceToDevice) {
    // Host memory (pinned, registered or pageable) need not be addressable by a kernel: one
    // copy per segment. Used when there was no device memory for a staging block.
    for (const CopySegment& s : segments) memcpy(s.dst, s.src, s.bytes, kind);
    return;
  }
  BatchLaunch launch;
  for (size_t first = 0; first < segments.size(); first += kBatchMaxSegments) {
    const int n = static_cast<int>(std::min<size_t>(kBatchMaxSegments, segments.size() - first));
    const uint32_t chunks = plan_batch_launch(segments.data() + first, n, &launch);
    if (chunks == 0) continue;
    copy_batch_kernel<<<chunks, 256, 0, stream_>>>(launch);
    check(cudaGetLastError(), "launching the gather/scatter kernel");
  }
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
  cudaMemcpyKind k = kind == CopyKind::DeviceToHost     ? cudaMemcpyDeviceToHost
                     : kind == CopyKind::HostToDevice   ? cudaMemcpyHostToDevice
                     : kind == CopyKind::DeviceToDevice ? cudaMemcpyDeviceToDevice
                                                        : cudaMemcpyHostToHost;
  check(cudaMemcpyAsync(dst, src, bytes, k, stream_), "cudaMemcpyAsync");
}

namespace {
constexpr int kMaxDevices = 64;
std::mutex side_mu;
CudaStream* side_streams[kMaxDevices][static_cast<int>(SideStream::kCount)] =
    {};  // leaked on purpose: no teardown-order hazards at exit
}  // namespace

void synchronize_side_streams() {
  // The streams are looked up under the lock, waited for outside it: side_stream() takes the
  // lock on every pack, which must not wait for this synchronize (co.synchronize()).
  std::vector<CudaStream*> all;
  {
    std::lock_guard<std::mutex> lock(side_mu);
    for (auto& per_device : side_streams)
      for (CudaStream* s : per_device)
        if (s) all.push_back(s);  // never destroyed: safe to use after the lock
  }
  for (CudaStream* s : all) check(cudaStreamSynchronize(s->handle()), "cudaStreamSynchronize");
}

CudaStream& side_stream(int device, SideStream which) {
  if (device < 0 || device >= kMaxDevices) throw std::out_of_range("ckpt_offload: CUDA device index out of range");
  std::lock_guard<std::mutex> lock(side_mu);
  auto& streams = side_streams;
  CudaStream*& s = streams[device][static_cast<int>(which)];
  if (!s) {
    DeviceGuard guard(device);
    cudaStream_t raw;
    int least = 0, greatest = 0;
    check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    // Non-blocking: the copy stream must not serialize with the legacy default stream. Demand
    // reloads get the highest priority: backward is stalled on them.
    check(cudaStreamCreateWithPriority(&raw, cudaStreamNonBlocking, which == SideStream::H2DDemand ? greatest : least),
          "cudaStreamCreateWithPriority");
    s = new CudaStream(raw, device);
  }
  return *s;
}

namespace {

// Note [NUMA-local segments]: memory placed on `node` (every page faulted in), then pinned.
void* pinned_on_node(size_t bytes, int node) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t rounded = (bytes + page - 1) / page * page;
  void* p = numa::map_on_node(rounded, node);
  if (!p) return nullptr;
  if (cudaHostRegister(p, rounded, cudaHostRegisterPortable) != cudaSuccess) {
    cudaGetLastError();
    numa::unmap(p, rounded);
    return nullptr;
  }
  return p;
}

void release_pinned_on_node(void* ptr, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  cudaHostUnregister(ptr);
  numa::unmap(ptr, (bytes + page - 1) / page * page);
}

}  // namespace

void* PinnedBackend::allocate(size_t bytes) {
  if (numa_node_ >= 0) return pinned_on_node(bytes, numa_node_);
  void* p = nullptr;
  // Portable: the pool serves tensors of every device.
  cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void PinnedBackend::release(void* ptr, size_t bytes) {
  if (numa_node_ >= 0)
    release_pinned_on_node(ptr, bytes);
  else
    cudaFreeHost(ptr);
}

void* RegisteredBackend::allocate(size_t bytes) {
  if (numa_node_ >= 0) return pinned_on_node(bytes, numa_node_);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t rounded = (bytes + page - 1) / page * page;
  void* p = nullptr;
  if (posix_memalign(&p, page, rounded) != 0) return nullptr;
  // Touch every page first: registering faults the pages in under the driver's lock anyway,
  // and pre-faulted memory registers faster.
  for (size_t off = 0; off < rounded; off += page) static_cast<volatile char*>(p)[off] = 0;
  cudaError_t err = cudaHostRegister(p, rounded, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    std::free(p);
    return nullptr;
  }
  return p;
}

void RegisteredBackend::release(void* ptr, size_t bytes) {
  if (numa_node_ >= 0) {
    release_pinned_on_node(ptr, bytes);
    return;
  }
  cudaHostUnregister(ptr);
  std::free(ptr);
}

void nvtx_push(const char* name) { nvtxRangePushA(name); }
void nvtx_pop() { nvtxRangePop(); }

void start_timing_epochs() {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    current = -1;
  }
  std::vector<int> devices;
  {
    std::lock_guard<std::mutex> lock(side_mu);
    for (int d = 0; d < kMaxDevices; ++d)
      if (d == current || side_streams[d][0] || side_streams[d][1] || side_streams[d][2]) devices.push_back(d);
  }
  std::lock_guard<std::mutex> lock(epoch_mu);
  for (auto& e : epochs) {
    if (e.event) cudaEventDestroy(e.event);
    e.event = nullptr;
  }
  // The reference is taken now, at the profile's start, for the devices already in use (the
  // current one and those with copy streams), not at the first read: elapsed times are floats
  // of milliseconds, and every copy of the profile then lies a short time after its epoch.
  // Other devices (first used later in the profile) still get theirs at their first read.
  for (int d : devices) make_epoch_locked(d);
}

int64_t timing_epoch_ns(int device) {
  std::lock_guard<std::mutex> lock(epoch_mu);
  if (device < 0 || device >= kMaxDevices || !epochs[device].event) return -1;
  return epochs[device].host_ns;
}

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

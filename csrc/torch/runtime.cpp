// The device-independent half of runtime.h: the copy engine, the CPU "streams", and what routes
// a copy to them or to the device implementation (runtime_backend.h) the build chose.
#include "runtime.h"

#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "../core/cpu_stream.h"
#include "runtime_backend.h"

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
  if (device_runtime::stream_pair(current, side, to_host, demand, &owned_compute_, &compute_, &copy_)) return;
  throw std::invalid_argument("ckpt_offload: no copy streams for device " + device.str());
}

CopyRange::CopyRange(const char* name, const c10::Device& device)
    : guard_(at::RecordScope::USER_SCOPE), nvtx_(device.is_cuda()) {
  if (guard_.isActive()) guard_.before(name);
  if (nvtx_) device_runtime::range_push(name);
}

CopyRange::~CopyRange() {
  if (nvtx_) device_runtime::range_pop();
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
  device_runtime::synchronize_streams();
  engine().synchronize();
}

bool current_stream_capturing(const c10::Device& device) {
  return device.is_cuda() && CurrentStream::of(device).capturing();
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

std::shared_ptr<HostPool> make_pool(const std::string& backend_name, size_t max_bytes, size_t segment_bytes) {
  std::unique_ptr<Backend> backend;
  if (backend_name == "pageable") {
    backend = std::make_unique<PageableBackend>();
  } else if (backend_name == "pinned" || backend_name == "registered") {
    backend = device_runtime::pinned_backend(backend_name);
  } else {
    throw std::invalid_argument("ckpt_offload: backend must be 'pinned', 'registered' or 'pageable', got '" +
                                backend_name + "'");
  }
  return std::make_shared<HostPool>(std::move(backend), max_bytes, segment_bytes);
}

}  // namespace ckpt_offload

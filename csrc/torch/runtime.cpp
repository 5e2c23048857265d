// The device-independent half of runtime.h: the copy engine, the CPU "streams", and what routes
// a copy to them or to the device side (device_runtime.h) the build chose.
#include "runtime.h"

#include <pthread.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "../core/cpu_stream.h"
#include "../core/numa.h"
#include "../core/spill.h"
#include "pinned_fallback.h"
#include "device_runtime.h"

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
  WorkerStream h2d_demand;    // Note [Stream ordering] rule 4
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
//    holds its bytes, and so is every read and write queued on a disk tier (whose I/O threads
//    take pool locks: one held by a thread that does not exist in the child is never
//    released there); the lock that guards the streams is held across the fork, so that no
//    other thread of the parent is halfway through making them;
//  - in the child, the handler only bumps a counter (what runs between fork and exec must stay
//    simple); the next use of the streams makes fresh ones, with fresh worker threads. The old
//    ones are leaked: their threads cannot be joined, they do not exist there;
//  - the child never calls CUDA on our behalf when the parent had initialised it (torch refuses
//    CUDA in such a child anyway, and a call fails there): the capture probe answers "not
//    capturing" without asking the driver.
// The disk tier (csrc/core/file_tier.h) is the same case, and more: its I/O threads do not
// exist in the child either (a queued read or write would never run, joining them would never
// return), and its spill files are open descriptors shared with the parent (both would write
// the same ranges). So a tier is used only in the process that made it: in a child its writes,
// reads and reservations raise FileTierError saying so, synchronize() and empty_cache() do
// nothing, and its destructor leaks the threads instead of joining them. A child makes a pool
// of its own.
std::atomic<uint64_t> g_fork_generation{0};  // forks this process has come out of, as a child
std::atomic<bool> g_cuda_touched{false};     // this process (or its parent before a fork) called CUDA
std::atomic<bool> g_cuda_unusable{false};    // a fork child of a process that had called CUDA
std::mutex g_streams_mu;                     // making / replacing the CPU streams
std::atomic<CpuStreams*> g_streams{nullptr};

void before_fork() {
  g_streams_mu.lock();
  if (CpuStreams* s = g_streams.load(std::memory_order_acquire)) s->drain();
  // The disk tiers' I/O threads free each written staging block under its pool's lock: one
  // caught there by the fork would leave that lock held for good in the child.
  synchronize_spill_targets();
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

bool cuda_unusable_after_fork() { return g_cuda_unusable.load(std::memory_order_relaxed); }

void note_cuda_used() { g_cuda_touched.store(true, std::memory_order_relaxed); }

void ensure_fork_handlers() { install_fork_handlers(); }

uint64_t fork_generation() { return g_fork_generation.load(std::memory_order_acquire); }

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

void drain_cpu_streams() { cpu_streams().drain(); }

void synchronize_side_streams() {
  cpu_streams().drain();
  device_runtime::synchronize_streams();  // skips CUDA in a fork child (Note [Fork])
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

std::shared_ptr<HostPool> make_pool(const std::string& backend_name, size_t max_bytes, size_t segment_bytes,
                                    int numa_node) {
  // Note [NUMA-local segments]: a node this process may not use is refused here, not at the
  // first segment.
  if (numa_node >= 0) numa::check_node(numa_node);
  std::unique_ptr<Backend> backend;
  if (backend_name == "pageable") {
    backend = std::make_unique<PageableBackend>(numa_node);
  } else if (backend_name == "pinned" || backend_name == "registered") {
    // Note [Pinned fallback]: a refused pinned segment is taken as pageable memory.
    backend = std::make_unique<FallbackBackend>(pinned_or_simulated_backend(backend_name, numa_node));
  } else {
    throw std::invalid_argument("ckpt_offload: backend must be 'pinned', 'registered' or 'pageable', got '" +
                                backend_name + "'");
  }
  return std::make_shared<HostPool>(std::move(backend), max_bytes, segment_bytes);
}

}  // namespace ckpt_offload

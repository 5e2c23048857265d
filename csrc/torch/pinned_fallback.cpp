#include "pinned_fallback.h"

#include <sys/resource.h>

#include <cstdio>

#include "device_runtime.h"

namespace ckpt_offload {

// Note [Pinned fallback]
// Page-locked memory is a host resource the pool does not own: cudaHostAlloc maps every
// allocation (each counts against vm.max_map_count, 65530 by default; large pools on many ranks
// exhaust it, and the driver then fails with "out of memory" although free memory remains), and
// locked pages count against RLIMIT_MEMLOCK where the driver or a container enforces it. A
// refused segment is not a full pool: the pool's cap has room. So the segment is taken from
// pageable memory instead -- correct for every copy (a copy from pageable memory is staged by
// the driver, only slower and not asynchronous) -- and the first refusal's diagnosis is kept for
// Python to warn once, naming the limit. The pool keeps asking for pinned memory for later
// segments: a limit freed by another process is used again.

namespace {

std::mutex g_sim_mu;
std::string g_simulated_limit;

class SimulatedRefusingBackend final : public Backend {
 public:
  SimulatedRefusingBackend(std::string name, int numa_node) : name_(std::move(name)), numa_node_(numa_node) {}
  void* allocate(size_t) override { return nullptr; }
  void release(void*, size_t) override {}
  const char* name() const override { return name_.c_str(); }
  int numa_node() const override { return numa_node_; }

 private:
  std::string name_;
  int numa_node_;
};

// stdio, not fstream: Note [No iostreams in the extension] (csrc/core/text.h).
long read_long(const char* path) {
  FILE* f = std::fopen(path, "r");
  if (!f) return -1;
  long v = -1;
  if (std::fscanf(f, "%ld", &v) != 1) v = -1;
  std::fclose(f);
  return v;
}

long count_maps() {
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (!f) return -1;
  long n = 0;
  int c, last = '\n';
  while ((c = std::fgetc(f)) != EOF) {
    if (c == '\n') ++n;
    last = c;
  }
  if (last != '\n') ++n;  // a last line without its newline counts too
  std::fclose(f);
  return n;
}

std::string memlock_text(const struct rlimit& r) {
  if (r.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(static_cast<unsigned long long>(r.rlim_cur)) + " bytes";
}

}  // namespace

std::string diagnose_pinned_refusal(size_t bytes) {
  std::string simulated;
  {
    std::lock_guard<std::mutex> lock(g_sim_mu);
    simulated = g_simulated_limit;
  }
  const long max_maps = read_long("/proc/sys/vm/max_map_count");
  const long maps = count_maps();
  struct rlimit lock_limit{};
  const bool have_lock_limit = getrlimit(RLIMIT_MEMLOCK, &lock_limit) == 0;
  std::string s = "page-locked memory for a " + std::to_string(bytes) + "-byte segment was refused";
  if (!simulated.empty()) s += " (simulated " + simulated + " refusal)";
  const bool maps_near = max_maps > 0 && maps >= 0 && maps + 64 >= max_maps;
  const bool lock_finite = have_lock_limit && lock_limit.rlim_cur != RLIM_INFINITY;
  const std::string lock_text = have_lock_limit ? memlock_text(lock_limit) : std::string("unknown");
  if (simulated == "vm.max_map_count" || (simulated.empty() && maps_near)) {
    s += "; limit: vm.max_map_count (" + std::to_string(maps) + " mappings in use of " + std::to_string(max_maps) +
         "): raise it (sysctl -w vm.max_map_count=1048576) or use fewer, larger segments (segment_bytes=)";
  } else if (simulated == "RLIMIT_MEMLOCK" || (simulated.empty() && lock_finite)) {
    s += "; limit: RLIMIT_MEMLOCK (ulimit -l: " + lock_text +
         "): raise it (ulimit -l unlimited, or the container's memlock limit)";
  } else {
    s += "; limits: vm.max_map_count (" + std::to_string(maps) + " mappings of " + std::to_string(max_maps) +
         "), RLIMIT_MEMLOCK (" + lock_text +
         "): neither is exhausted, so the host is short of memory that can be locked";
  }
  return s;
}

// The pageable fallback goes on the pinned backend's node too (Note [NUMA-local segments]).
FallbackBackend::FallbackBackend(std::unique_ptr<Backend> pinned)
    : pinned_(std::move(pinned)), pageable_(pinned_->numa_node()) {}

void* FallbackBackend::allocate(size_t bytes) {
  if (void* p = pinned_->allocate(bytes)) return p;
  // Diagnosed before taking memory: reading /proc/self/maps must see the state that refused.
  std::string why = diagnose_pinned_refusal(bytes);
  void* p = pageable_.allocate(bytes);
  if (!p) return nullptr;  // not even pageable memory: the pool reports it full
  std::lock_guard<std::mutex> lock(mu_);
  pageable_ptrs_.insert(p);
  stats_.segments++;
  stats_.bytes += bytes;
  if (stats_.reason.empty()) stats_.reason = std::move(why);
  return p;
}

void FallbackBackend::release(void* ptr, size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pageable_ptrs_.find(ptr);
    if (it != pageable_ptrs_.end()) {
      pageable_ptrs_.erase(it);
      stats_.bytes -= bytes;
      pageable_.release(ptr, bytes);
      return;
    }
  }
  pinned_->release(ptr, bytes);
}

PinnedFallbackStats FallbackBackend::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

size_t FallbackBackend::segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_.segments;
}

void simulate_pinned_refusal(const std::string& limit) {
  if (!limit.empty() && limit != "vm.max_map_count" && limit != "RLIMIT_MEMLOCK")
    throw std::invalid_argument("ckpt_offload: limit must be 'vm.max_map_count', 'RLIMIT_MEMLOCK' or '', got '" +
                                limit + "'");
  std::lock_guard<std::mutex> lock(g_sim_mu);
  g_simulated_limit = limit;
}

std::unique_ptr<Backend> pinned_or_simulated_backend(const std::string& backend_name, int numa_node) {
  {
    std::lock_guard<std::mutex> lock(g_sim_mu);
    if (!g_simulated_limit.empty()) return std::make_unique<SimulatedRefusingBackend>(backend_name, numa_node);
  }
  return device_runtime::pinned_backend(backend_name, numa_node);
}

}  // namespace ckpt_offload

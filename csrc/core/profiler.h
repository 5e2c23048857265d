// Profiler: timestamped records of every copy, every consumer wait and every pool event,
// kept only while profiling is on (co.profile()). When it is off, the hot path pays one
// relaxed atomic load per call and records nothing.
//
// Copy and wait records hold the events that bound them (timing-enabled CUDA events on a
// GPU, timed fences on CPU); they are resolved to host steady-clock time when read, so
// recording never blocks on a copy.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "stream.h"

namespace ckpt_offload {
namespace profiler {

extern std::atomic<bool> g_enabled;
inline bool enabled() { return g_enabled.load(std::memory_order_relaxed); }

int64_t now_ns();  // steady_clock
// Clears the records, sets time 0 and turns recording on.
void start();
void stop();
int64_t epoch_ns();

// The module path current on this thread ("" for none): pack records take it.
void set_scope(std::string scope);
const std::string& scope();

uint64_t next_handle_id();

struct CopyRecord {
  CopyKind kind = CopyKind::DeviceToHost;
  uint64_t handle = 0;
  size_t bytes = 0;
  int device = -1;  // -1: CPU
  uintptr_t stream = 0;
  bool prefetch = false;
  int members = 1;
  std::shared_ptr<Event> start, end;
};
struct WaitRecord {
  uint64_t handle = 0;
  int device = -1;
  std::shared_ptr<Event> request, ready;
};
struct HandleRecord {
  uint64_t handle = 0;
  size_t bytes = 0;
  int device = -1;
  std::vector<int64_t> shape;
  std::string dtype, module;
  int members = 1;
};
struct KeepRecord {
  std::string reason, dtype, module;
  size_t bytes = 0;
  int device = -1;
  std::vector<int64_t> shape;
};
enum class PoolEventKind { BackendAlloc, BackendFree, CapHit };
struct PoolRecord {
  PoolEventKind kind;
  size_t bytes = 0;
  int64_t start_ns = 0, end_ns = 0;
};
// One spilled block written to (or read back from) the file tier, timed on the host: from its
// first chunk's start to its last chunk's end.
struct DiskRecord {
  bool write = true;
  uint64_t handle = 0;
  size_t bytes = 0;
  bool prefetch = false;  // a read started by backward's prefetch
  int64_t start_ns = 0, end_ns = 0;
};
struct RangeRecord {
  std::string name;
  int device = -1;
  std::shared_ptr<Event> start, end;
};
struct MemorySample {
  int64_t t_ns = 0;
  int64_t pool_bytes_in_use = 0;
  int64_t device_bytes_saved = 0;
  int64_t device_bytes_allocated = -1;  // -1: unknown (CPU)
  int64_t disk_bytes_in_use = 0;        // spilled to the pool's disk tier
};

void add(CopyRecord r);
void add(WaitRecord r);
void add(HandleRecord r);
void add(KeepRecord r);
void add(PoolRecord r);
void add(RangeRecord r);
void add(DiskRecord r);
void add(MemorySample s);

// Resolved records: times in nanoseconds since start(); -1 when an event had no time.
struct Snapshot {
  struct Copy {
    CopyRecord r;
    int64_t start_ns, end_ns;
  };
  struct Wait {
    WaitRecord r;
    int64_t request_ns, ready_ns;
  };
  struct Range {
    RangeRecord r;
    int64_t start_ns, end_ns;
  };
  std::vector<Copy> copies;
  std::vector<Wait> waits;
  std::vector<HandleRecord> handles;
  std::vector<KeepRecord> keeps;
  std::vector<PoolRecord> pool;
  std::vector<DiskRecord> disk;
  std::vector<Range> ranges;
  std::vector<MemorySample> memory;
  uint64_t dropped = 0;
};
// Waits for every recorded event (the caller drains the copy streams first) and converts.
Snapshot snapshot();

}  // namespace profiler
}  // namespace ckpt_offload

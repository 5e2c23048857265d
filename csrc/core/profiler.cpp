#include "profiler.h"

#include <chrono>

namespace ckpt_offload {
namespace profiler {

std::atomic<bool> g_enabled{false};

namespace {

// A profile of a long run must not eat the host: past this many records, new ones are counted
// as dropped.
constexpr size_t kMaxRecords = 4u << 20;

struct Store {
  std::mutex mu;
  int64_t epoch = 0;
  std::vector<CopyRecord> copies;
  std::vector<WaitRecord> waits;
  std::vector<HandleRecord> handles;
  std::vector<KeepRecord> keeps;
  std::vector<PoolRecord> pool;
  std::vector<DiskRecord> disk;
  std::vector<RangeRecord> ranges;
  std::vector<MemorySample> memory;
  size_t count = 0;
  uint64_t dropped = 0;
};

Store& store() {
  static Store* s = new Store();  // leaked: records may hold events past interpreter teardown
  return *s;
}

thread_local std::string t_scope;
std::atomic<uint64_t> g_next_handle{1};

template <typename T>
void push(std::vector<T>& into, T r) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.count >= kMaxRecords) {
    ++s.dropped;
    return;
  }
  ++s.count;
  into.push_back(std::move(r));
}

int64_t resolve(const std::shared_ptr<Event>& ev, int64_t epoch) {
  if (!ev) return -1;
  const int64_t t = ev->completion_ns();
  return t < 0 ? -1 : t - epoch;
}

}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void start() {
  Store& s = store();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.copies.clear();
    s.waits.clear();
    s.handles.clear();
    s.keeps.clear();
    s.pool.clear();
    s.disk.clear();
    s.ranges.clear();
    s.memory.clear();
    s.count = 0;
    s.dropped = 0;
    s.epoch = now_ns();
  }
  g_enabled.store(true);
}

void stop() { g_enabled.store(false); }

int64_t epoch_ns() {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.epoch;
}

void set_scope(std::string scope) { t_scope = std::move(scope); }
const std::string& scope() { return t_scope; }
uint64_t next_handle_id() { return g_next_handle.fetch_add(1, std::memory_order_relaxed); }

void add(CopyRecord r) { push(store().copies, std::move(r)); }
void add(WaitRecord r) { push(store().waits, std::move(r)); }
void add(HandleRecord r) { push(store().handles, std::move(r)); }
void add(KeepRecord r) { push(store().keeps, std::move(r)); }
void add(PoolRecord r) { push(store().pool, std::move(r)); }
void add(RangeRecord r) { push(store().ranges, std::move(r)); }
void add(DiskRecord r) { push(store().disk, std::move(r)); }
void add(MemorySample m) { push(store().memory, std::move(m)); }

Snapshot snapshot() {
  Store& s = store();
  Snapshot out;
  std::vector<CopyRecord> copies;
  std::vector<WaitRecord> waits;
  std::vector<RangeRecord> ranges;
  int64_t epoch;
  {
    // Copy out under the lock, resolve (which may wait for events) outside it.
    std::lock_guard<std::mutex> lock(s.mu);
    epoch = s.epoch;
    copies = s.copies;
    waits = s.waits;
    ranges = s.ranges;
    out.handles = s.handles;
    out.keeps = s.keeps;
    out.pool = s.pool;
    out.disk = s.disk;
    out.memory = s.memory;
    out.dropped = s.dropped;
  }
  for (auto& p : out.pool) {
    p.start_ns -= epoch;
    p.end_ns -= epoch;
  }
  for (auto& d : out.disk) {
    d.start_ns -= epoch;
    d.end_ns -= epoch;
  }
  for (auto& m : out.memory) m.t_ns -= epoch;
  for (auto& c : copies) out.copies.push_back({c, resolve(c.start, epoch), resolve(c.end, epoch)});
  for (auto& w : waits) out.waits.push_back({w, resolve(w.request, epoch), resolve(w.ready, epoch)});
  for (auto& r : ranges) out.ranges.push_back({r, resolve(r.start, epoch), resolve(r.end, epoch)});
  return out;
}

}  // namespace profiler
}  // namespace ckpt_offload

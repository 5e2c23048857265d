#include "copy_engine.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

namespace ckpt_offload {

namespace {
std::atomic<CaptureProbe> g_capture_probe{nullptr};
}  // namespace

void set_capture_probe(CaptureProbe probe) { g_capture_probe.store(probe); }

CaptureProbe capture_probe() { return g_capture_probe.load(); }

bool capture_active() noexcept {
  CaptureProbe p = g_capture_probe.load(std::memory_order_relaxed);
  if (!p) return false;
  try {
    return p();
  } catch (...) {
    return true;  // see stream.h: defer every query rather than throw from a destructor
  }
}

HostBuffer::HostBuffer(std::shared_ptr<HostPool> pool, HostPool::Block* block, size_t nbytes)
    : pool_(std::move(pool)), block_(block), nbytes_(nbytes) {}

HostBuffer::~HostBuffer() {
  // Never throws (Note [No throw on teardown]): this runs when autograd drops a graph, also
  // during the unwinding of a backward that raised. A free that fails leaks the block.
  try {
    std::vector<std::shared_ptr<Event>> pending = std::move(readers_);
    if (ready_ && !ready_->settled()) pending.push_back(std::move(ready_));
    pool_->free(block_, std::move(pending));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_offload: warning: a host-pool block could not be returned (%s); it is leaked\n",
                 e.what());
  } catch (...) {
    std::fprintf(stderr, "ckpt_offload: warning: a host-pool block could not be returned; it is leaked\n");
  }
}

std::shared_ptr<Event> HostBuffer::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
}

void HostBuffer::set_ready(std::shared_ptr<Event> ev) {
  std::lock_guard<std::mutex> lock(mu_);
  ready_ = std::move(ev);
}

void HostBuffer::add_reader(std::shared_ptr<Event> ev) {
  // A copy known to have finished (an inline CPU copy) holds the block back from nothing.
  if (!ev || ev->settled()) return;
  std::lock_guard<std::mutex> lock(mu_);
  // Drop finished readers so a buffer reloaded many times (retain_graph) stays small.
  // A failed reader stays: HostPool::free then leaks the block. Note [No throw on teardown].
  // No queries under graph capture (Note [Graph capture]): the list is pruned next time.
  if (!capture_active())
    readers_.erase(std::remove_if(readers_.begin(), readers_.end(),
                                  [](const std::shared_ptr<Event>& e) { return e->state() == EventState::Done; }),
                   readers_.end());
  readers_.push_back(std::move(ev));
}

namespace {

// Starts a profiled copy: an event before it, when profiling is on.
std::shared_ptr<Event> copy_start(Stream& copy, bool profiling) { return profiling ? copy.record_timed() : nullptr; }

std::shared_ptr<Event> copy_end(Stream& copy, CopyKind kind, size_t bytes, const CopyTag& tag,
                                std::shared_ptr<Event> start) {
  if (!start) return copy.record();
  auto end = copy.record_timed();
  profiler::CopyRecord r;
  r.kind = kind;
  r.handle = tag.handle;
  r.bytes = bytes;
  r.device = tag.device;
  r.stream = copy.id();
  r.prefetch = tag.prefetch;
  r.members = tag.members;
  r.start = std::move(start);
  r.end = end;
  profiler::add(std::move(r));
  return end;
}

}  // namespace

namespace {
// A keepalive made already.
class GivenKeepalive final : public KeepaliveSource {
 public:
  explicit GivenKeepalive(std::shared_ptr<void> p) : p_(std::move(p)) {}
  std::shared_ptr<void> make() const override { return p_; }

 private:
  std::shared_ptr<void> p_;
};
}  // namespace

std::shared_ptr<HostBuffer> CopyEngine::offload(const std::shared_ptr<HostPool>& pool, const void* src, size_t bytes,
                                                Stream& compute, Stream& copy, std::shared_ptr<void> keepalive,
                                                const CopyTag& tag) {
  return offload(pool, src, bytes, compute, copy, GivenKeepalive(std::move(keepalive)), tag);
}

std::shared_ptr<HostBuffer> CopyEngine::offload(const std::shared_ptr<HostPool>& pool, const void* src, size_t bytes,
                                                Stream& compute, Stream& copy, const KeepaliveSource& keepalive,
                                                const CopyTag& tag) {
  poll();
  HostPool::Block* block = pool->allocate(bytes);
  if (!block) return nullptr;
  auto buf = std::make_shared<HostBuffer>(pool, block, bytes);
  if (&copy != &compute) {
    // The side stream must not read the source before the compute stream has written it.
    copy.wait(compute.record());
  }
  auto start = copy_start(copy, profiler::enabled());
  copy.memcpy(buf->data(), src, bytes, CopyKind::DeviceToHost);
  auto done = copy_end(copy, CopyKind::DeviceToHost, bytes, tag, std::move(start));
  buf->set_ready(done);
  // The source's memory may be reused by its allocator as soon as its tensor dies; hold
  // the tensor until the copy has read it.
  if (!done->query()) hold(copy.id(), done, keepalive.make());
  return buf;
}

std::shared_ptr<Event> CopyEngine::reload(HostBuffer& buf, void* dst, Stream& compute, Stream& copy,
                                          bool consumer_waits, const CopyTag& tag) {
  poll();
  if (&copy != &compute) {
    // dst was allocated in compute order: its previous user may still be running there.
    copy.wait(compute.record());
  }
  // The host bytes are valid only once the offload copy has finished.
  copy.wait(buf.ready());
  auto start = copy_start(copy, profiler::enabled());
  copy.memcpy(dst, buf.data(), buf.nbytes(), CopyKind::HostToDevice);
  auto done = copy_end(copy, CopyKind::HostToDevice, buf.nbytes(), tag, std::move(start));
  buf.add_reader(done);
  // The consumer runs on the compute stream: it must not read dst before the copy ends.
  if (consumer_waits && &copy != &compute) compute.wait(done);
  return done;
}

std::shared_ptr<HostBuffer> CopyEngine::offload_gather(const std::shared_ptr<HostPool>& pool,
                                                       const std::vector<BatchSpan>& spans, size_t block_bytes,
                                                       void* staging, Stream& compute, Stream& copy,
                                                       std::shared_ptr<void> keepalive, const CopyTag& tag,
                                                       const std::vector<std::shared_ptr<Event>>& producers) {
  poll();
  HostPool::Block* block = pool->allocate(block_bytes);
  if (!block) return nullptr;
  auto buf = std::make_shared<HostBuffer>(pool, block, block_bytes);
  if (&copy != &compute) copy.wait(compute.record());  // the sources (and staging) are ready in compute order
  for (const auto& ev : producers) copy.wait(ev);      // and in the order of the streams that wrote them
  char* into = staging ? static_cast<char*>(staging) : static_cast<char*>(buf->data());
  std::vector<CopySegment> segments;
  segments.reserve(spans.size());
  for (const BatchSpan& s : spans) segments.push_back({into + s.offset, s.ptr, s.bytes});
  auto start = copy_start(copy, profiler::enabled());
  copy.memcpy_batch(segments, staging ? CopyKind::DeviceToDevice : CopyKind::DeviceToHost);
  if (staging) copy.memcpy(buf->data(), staging, block_bytes, CopyKind::DeviceToHost);
  auto done = copy_end(copy, CopyKind::DeviceToHost, block_bytes, tag, std::move(start));
  buf->set_ready(done);
  if (!done->query()) hold(copy.id(), done, std::move(keepalive));
  return buf;
}

std::shared_ptr<Event> CopyEngine::reload_scatter(HostBuffer& buf, const std::vector<BatchSpan>& spans, void* staging,
                                                  Stream& compute, Stream& copy, std::shared_ptr<void> keepalive,
                                                  bool consumer_waits, const CopyTag& tag) {
  poll();
  // The destinations and the staging block were allocated in compute order.
  if (&copy != &compute) copy.wait(compute.record());
  copy.wait(buf.ready());
  auto start = copy_start(copy, profiler::enabled());
  const char* from = static_cast<const char*>(buf.data());
  if (staging) {
    copy.memcpy(staging, buf.data(), buf.nbytes(), CopyKind::HostToDevice);
    from = static_cast<const char*>(staging);
  }
  std::vector<CopySegment> segments;
  segments.reserve(spans.size());
  for (const BatchSpan& s : spans) segments.push_back({s.ptr, from + s.offset, s.bytes});
  copy.memcpy_batch(segments, staging ? CopyKind::DeviceToDevice : CopyKind::HostToDevice);
  auto done = copy_end(copy, CopyKind::HostToDevice, buf.nbytes(), tag, std::move(start));
  buf.add_reader(done);
  if (keepalive && !done->query()) hold(copy.id(), done, std::move(keepalive));
  if (consumer_waits && &copy != &compute) compute.wait(done);
  return done;
}

void CopyEngine::keep_until(Stream& copy, std::shared_ptr<Event> done, std::shared_ptr<void> keepalive) {
  // Called from destructors (~OffloadedStorage): never throws. A failed event means the device
  // is lost (a sticky error): nothing runs on it again, so the memory is let go now, by whoever
  // drops `keepalive`. See Note [No throw on teardown].
  if (!done) return;
  if (capture_active() || done->state() == EventState::Pending) hold(copy.id(), std::move(done), std::move(keepalive));
}

// Note [Poll with nothing held]
// poll() runs at every copy and whenever a saved tensor dies (~SavedTensor: sources released
// with their graph), kept tensors included, and most of those calls find nothing held: every
// inline copy (stream="compute", an idle CPU worker) finished before it could be held. So it
// first reads the count without the lock and returns on zero, before the capture probe (a
// driver call per poll on a CUDA build) and the engine's mutex. Every write of the count is
// atomic (under mu_ too), so that read is no data race; a keepalive another thread holds at that
// moment is seen by the next poll, as it would be had this poll taken the lock a moment earlier.
// (The core is C++17: no std::atomic_ref; GCC's and Clang's atomic builtins, which the thread
// sanitizer knows, on the plain member.)
namespace {
struct HeldCount {
  size_t& n;
  size_t load(int order) const { return __atomic_load_n(&n, order); }
  void store(size_t v, int order) { __atomic_store_n(&n, v, order); }
  void fetch_add(size_t v, int order) { __atomic_fetch_add(&n, v, order); }
  void fetch_sub(size_t v, int order) { __atomic_fetch_sub(&n, v, order); }
};
HeldCount held_count(size_t& n) { return HeldCount{n}; }
}  // namespace

void CopyEngine::hold(uintptr_t stream_id, std::shared_ptr<Event> done, std::shared_ptr<void> keepalive) {
  std::lock_guard<std::mutex> lock(mu_);
  held_[stream_id].push_back({std::move(done), std::move(keepalive)});
  held_count(num_held_).fetch_add(1, __ATOMIC_RELEASE);
}

void CopyEngine::poll() {
  if (held_count(num_held_).load(__ATOMIC_ACQUIRE) == 0) return;  // Note [Poll with nothing held]
  if (capture_active()) return;                                   // Note [Graph capture]: no event query, no release
  std::vector<std::shared_ptr<void>> release;                     // destroyed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (held_count(num_held_).load(__ATOMIC_RELAXED) == 0) return;
    for (auto& kv : held_) {
      auto& q = kv.second;
      while (!q.empty() && q.front().done->query()) {
        release.push_back(std::move(q.front().keepalive));
        q.pop_front();
        held_count(num_held_).fetch_sub(1, __ATOMIC_RELAXED);
      }
    }
  }
}

void CopyEngine::synchronize() {
  std::vector<Held> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : held_)
      for (auto& h : kv.second) all.push_back(std::move(h));
    held_.clear();
    held_count(num_held_).store(0, __ATOMIC_RELAXED);
  }
  for (auto& h : all) h.done->synchronize();
}

size_t CopyEngine::num_keepalives() {
  std::lock_guard<std::mutex> lock(mu_);
  return held_count(num_held_).load(__ATOMIC_RELAXED);
}

}  // namespace ckpt_offload

#include "saved_tensor.h"

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <sstream>

#include "runtime.h"

#ifdef CKPT_OFFLOAD_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace py = pybind11;

namespace ckpt_offload {

const char* keep_reason_name(KeepReason r) {
  switch (r) {
    case KeepReason::Parameter: return "parameter";
    case KeepReason::Buffer: return "buffer";
    case KeepReason::TooSmall: return "too_small";
    case KeepReason::Device: return "device";
    case KeepReason::Layout: return "layout";
    case KeepReason::Subclass: return "subclass";
    case KeepReason::PoolFull: return "pool_full";
    case KeepReason::GraphCapture: return "cuda_graph_capture";
    case KeepReason::DiskFull: return "disk_full";
    default: return "unknown";
  }
}

namespace {

std::string describe(c10::ScalarType dtype, const std::vector<int64_t>& sizes, const c10::Device& device) {
  std::ostringstream s;
  s << "[" << c10::toString(dtype) << " on " << device << ", shape [";
  for (size_t i = 0; i < sizes.size(); ++i) s << (i ? ", " : "") << sizes[i];
  s << "]]";
  return s.str();
}

std::string human_bytes(size_t bytes) {
  static const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  std::ostringstream s;
  if (u == 0) {
    s << bytes << " bytes";
  } else {
    s.precision(1);
    s << std::fixed << v << " " << units[u];
  }
  return s.str();
}

// Layouts whose bytes are not plain strided memory, or whose flags a raw copy would drop.
bool unsupported_layout(const at::Tensor& t) {
  return t.layout() != c10::kStrided || t.is_nested() || t.is_quantized() || t.is_mkldnn() || t.is_meta() ||
         t.is_conj() || t.is_neg() || !t.has_storage();
}

// Wrapper tensors (functorch, functionalization, __torch_dispatch__ subclasses) have a
// storage that is not theirs to copy.
bool wrapped_tensor(const at::Tensor& t) {
  static const c10::DispatchKeySet wrappers({c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                             c10::DispatchKey::Functionalize, c10::DispatchKey::Python,
                                             c10::DispatchKey::BatchedNestedTensor});
  return t.key_set().has_any(wrappers);
}

// Elements of its storage a tensor reaches, from its first one. An expanded tensor (stride 0)
// reaches only its source's elements, so it does not grow on the host.
int64_t extent_elements(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  return extent;
}

bool is_parameter_object(PyObject* obj) { return PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(ParameterClass)); }

int device_index(const c10::Device& d) { return d.is_cuda() ? d.index() : -1; }

// torch's Python names ("float32", "bfloat16"), which is what users read in traces and CSVs.
std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kDouble: return "float64";
    case c10::kHalf: return "float16";
    case c10::kBFloat16: return "bfloat16";
    case c10::kByte: return "uint8";
    case c10::kChar: return "int8";
    case c10::kShort: return "int16";
    case c10::kInt: return "int32";
    case c10::kLong: return "int64";
    case c10::kBool: return "bool";
    case c10::kComplexFloat: return "complex64";
    case c10::kComplexDouble: return "complex128";
    default: return c10::toString(t);
  }
}

at::Tensor device_bytes(const c10::Device& device, size_t n) {
  return at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte).device(device));
}

// Holds a source storage until its copy has read it, counted in the memory timeline meanwhile.
std::shared_ptr<void> tracked_keepalive(const c10::Storage& st, int64_t bytes) {
  profiler::g_device_bytes_saved += bytes;
  return std::shared_ptr<void>(new c10::Storage(st), [bytes](void* p) {
    profiler::g_device_bytes_saved -= bytes;
    delete static_cast<c10::Storage*>(p);
  });
}

void sample_memory(HostPool* pool, const c10::Device& device) {
  if (!profiler::enabled()) return;
  profiler::MemorySample m;
  m.t_ns = profiler::now_ns();
  m.pool_bytes_in_use = pool ? static_cast<int64_t>(pool->stats().bytes_in_use) : 0;
  if (auto target = pool ? spill_target(pool) : nullptr)
    m.disk_bytes_in_use = static_cast<int64_t>(target->tier()->stats().bytes_requested);
  m.device_bytes_saved = profiler::g_device_bytes_saved.load();
  m.device_bytes_allocated = device_allocated_bytes(device);
  profiler::add(m);
}

}  // namespace

// ---- Prefetcher ----------------------------------------------------------------------------

std::atomic<int> g_failing_prefetches{0};

void fail_next_prefetches(int n) { g_failing_prefetches.store(n); }

std::atomic<bool> g_batch_staging{true};

void set_batch_staging(bool on) { g_batch_staging.store(on); }

namespace {
// Test hook: makes the next prefetches raise, as an out-of-memory would.
void maybe_fail_prefetch() {
  if (g_failing_prefetches.load(std::memory_order_relaxed) > 0 && g_failing_prefetches.fetch_sub(1) > 0)
    throw std::runtime_error("ckpt_offload: injected prefetch failure (test hook)");
}

// A device block for a batch's gather or scatter. Undefined when device memory is short (or
// the test hook turned staging off): the batch then copies each member on its own, between
// its device memory and the host block, which needs no extra device memory.
at::Tensor staging_block(const c10::Device& device, size_t bytes) {
  if (!device.is_cuda() || !g_batch_staging.load()) return at::Tensor();
  try {
    return device_bytes(device, bytes);
  } catch (const c10::OutOfMemoryError&) {
    return at::Tensor();
  }
}
}  // namespace

uint64_t Prefetcher::add(std::weak_ptr<Reloadable> r) {
  std::lock_guard<std::mutex> lock(mu_);
  if (order_.size() >= prune_at_) {
    for (auto it = order_.begin(); it != order_.end();) it = it->second.expired() ? order_.erase(it) : std::next(it);
    prune_at_ = std::max<size_t>(1024, 2 * order_.size());
  }
  const uint64_t seq = next_++;
  order_.emplace(seq, std::move(r));
  return seq;
}

void Prefetcher::after_unpack(uint64_t seq) {
  // Backward needs the handles packed just before this one next: walk down from it.
  constexpr int kMaxScan = 64;
  std::vector<std::shared_ptr<Reloadable>> release_outside;  // destroyed after the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto it = order_.lower_bound(seq);
  int scanned = 0;
  while (it != order_.begin() && scanned < kMaxScan) {
    --it;
    ++scanned;
    auto r = it->second.lock();
    if (!r) {
      it = order_.erase(it);
      continue;
    }
    const int64_t want = r->prefetchable_bytes();
    if (want > 0) {
      if (outstanding_.load() + want > budget_) break;
      int64_t got = 0;
      try {
        got = r->start_prefetch();
      } catch (const std::exception&) {
        // Prefetch is only an optimization: out of device memory (or any other failure) here
        // must not fail the backward that asked for something else. The tensor is reloaded
        // on demand when its unpack comes.
        counters_->prefetch_failures++;
        break;
      }
      const int64_t now = outstanding_ += got;
      int64_t peak = counters_->peak_prefetch_bytes.load();
      while (now > peak && !counters_->peak_prefetch_bytes.compare_exchange_weak(peak, now)) {
      }
    }
    release_outside.push_back(std::move(r));
  }
}

// ---- OffloadedStorage -------------------------------------------------------------------------

OffloadedStorage::OffloadedStorage(std::shared_ptr<TieredBuffer> buffer, c10::Device device, size_t pad,
                                   bool side_stream, std::shared_ptr<PackerCounters> counters)
    : buffer_(std::move(buffer)),
      device_(device),
      pad_(pad),
      nbytes_(buffer_->nbytes()),
      side_stream_(side_stream),
      handle_(profiler::next_handle_id()),
      counters_(std::move(counters)) {}

OffloadedStorage::OffloadedStorage(std::shared_ptr<Batch> batch, c10::Device device, size_t pad, size_t nbytes,
                                   bool side_stream, std::shared_ptr<PackerCounters> counters)
    : batch_(std::move(batch)),
      device_(device),
      pad_(pad),
      nbytes_(nbytes),
      side_stream_(side_stream),
      handle_(batch_->handle()),
      counters_(std::move(counters)) {}

HostPool* OffloadedStorage::pool() const { return buffer_ ? buffer_->pool() : batch_->pool(); }

OffloadedStorage::~OffloadedStorage() {
  std::lock_guard<std::mutex> lock(mu_);
  drop_staged_locked();
  if (disk_prefetch_) {
    if (prefetcher_) prefetcher_->release(static_cast<int64_t>(nbytes_));
    if (counters_) counters_->prefetches_unused++;
  }
}

void OffloadedStorage::set_order(std::shared_ptr<Prefetcher> prefetcher, uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  prefetcher_ = std::move(prefetcher);
  seq_ = seq;
}

bool OffloadedStorage::resident_locked() { return static_cast<bool>(staged_.storage) || !reloaded_.expired(); }

void OffloadedStorage::link() {
  std::lock_guard<std::mutex> lock(mu_);
  ++pending_;
}

void OffloadedStorage::unlink() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--pending_ == 0 && staged_.held) drop_staged_locked();
}

bool OffloadedStorage::stage_locked(Staged staged) {
  if (resident_locked()) {
    // Another unpack got here first: give the copy back once it has finished.
    if (staged.copy && staged.ready)
      engine().keep_until(*staged.copy, staged.ready, std::make_shared<c10::Storage>(std::move(staged.storage)));
    return false;
  }
  staged_ = std::move(staged);
  profiler::g_device_bytes_saved += static_cast<int64_t>(pad_ + nbytes_);
  return true;
}

void OffloadedStorage::drop_staged_locked() {
  if (!static_cast<bool>(staged_.storage)) return;
  if (staged_.held) {
    staged_ = Staged{};
    return;
  }
  profiler::g_device_bytes_saved -= static_cast<int64_t>(pad_ + nbytes_);
  if (staged_.prefetch) {
    if (prefetcher_) prefetcher_->release(static_cast<int64_t>(nbytes_));
    if (counters_) counters_->prefetches_unused++;
  }
  // Nobody waited for this copy on the compute stream: the memory must not go back to the
  // allocator (in compute order) before the copy stream is done writing it.
  if (staged_.copy && staged_.ready)
    engine().keep_until(*staged_.copy, staged_.ready, std::make_shared<c10::Storage>(std::move(staged_.storage)));
  staged_ = Staged{};
}

int64_t OffloadedStorage::prefetchable_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  if (batch_ || pending_ <= 0 || !side_stream_ || resident_locked() || disk_prefetch_) return 0;
  return static_cast<int64_t>(nbytes_);
}

int64_t OffloadedStorage::start_prefetch() {
  std::lock_guard<std::mutex> lock(mu_);
  if (batch_ || pending_ <= 0 || !side_stream_ || resident_locked() || disk_prefetch_) return 0;
  maybe_fail_prefetch();
  if (buffer_->spilled()) {
    // Note [Spilling offloaded blocks]: the disk is the slow leg, so a prefetch starts the read
    // back into host memory (I/O threads, nothing waits); the H2D copy follows on demand.
    buffer_->start_read(/*prefetch=*/true);
    disk_prefetch_ = true;
    counters_->disk_prefetches++;
    return static_cast<int64_t>(nbytes_);
  }
  StreamPair streams(device_, /*side=*/true, /*to_host=*/false);
  CopyRange range("ckpt_offload::prefetch", device_);
  // Allocated on the compute stream, which will consume it; the copy stream waits for it.
  at::Tensor bytes = device_bytes(device_, pad_ + nbytes_);
  c10::Storage storage = bytes.storage();
  char* dst = static_cast<char*>(storage.mutable_data()) + pad_;
  CopyTag tag{handle_, device_index(device_), /*prefetch=*/true, 1};
  auto done = engine().reload(*buffer_->host(), dst, streams.compute(), streams.copy(), /*consumer_waits=*/false, tag);
  stage_locked(Staged{std::move(storage), done, &streams.copy(), true});
  counters_->prefetches++;
  counters_->bytes_prefetched += static_cast<int64_t>(nbytes_);
  return static_cast<int64_t>(nbytes_);
}

c10::Storage OffloadedStorage::materialize(bool first, bool* shared, int64_t* fresh_bytes) {
  *shared = false;
  *fresh_bytes = 0;
  c10::Storage out;
  std::shared_ptr<Prefetcher> prefetcher;
  uint64_t seq = 0;
  for (int attempt = 0;; ++attempt) {
    std::shared_ptr<Event> request;
    if (batch_) {
      if (!batch_->flushed()) batch_->flush();
      bool need;
      {
        std::lock_guard<std::mutex> lock(mu_);
        need = !resident_locked();
      }
      if (need) {
        // Asked for now: the whole wait for this reload is a stall of the compute stream.
        if (profiler::enabled()) request = StreamPair(device_, side_stream_, false).compute().record_timed();
        batch_->reload(/*prefetch=*/false);
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    StreamPair streams(device_, side_stream_, /*to_host=*/false);
    if (static_cast<bool>(staged_.storage) && staged_.held) {
      // Kept from an earlier unpack for the saved tensors still to come.
      streams.compute().wait(staged_.ready);
      *shared = true;
      out = staged_.storage;
    } else if (static_cast<bool>(staged_.storage)) {
      Staged st = std::move(staged_);
      staged_ = Staged{};
      profiler::g_device_bytes_saved -= static_cast<int64_t>(pad_ + nbytes_);
      if (profiler::enabled() && st.ready)
        profiler::add(profiler::WaitRecord{handle_, device_index(device_),
                                           request ? request : streams.compute().record_timed(), st.ready});
      if (st.ready) streams.compute().wait(st.ready);
      if (st.prefetch) {
        if (prefetcher_) prefetcher_->release(static_cast<int64_t>(nbytes_));
        counters_->prefetch_hits++;
      }
      reloaded_ = st.storage.getWeakStorageImpl();
      reloaded_ready_ = st.ready;
      *fresh_bytes = static_cast<int64_t>(pad_ + nbytes_);
      out = std::move(st.storage);
    } else if (auto alive = reloaded_.lock()) {
      // Another view (or an earlier unpack) already brought these bytes back. The copy may
      // have been ordered on another stream: order this one after it too.
      streams.compute().wait(reloaded_ready_);
      *shared = true;
      out = c10::Storage(std::move(alive));
    } else if (batch_) {
      // A concurrent unpack took the batch's reload of this member and already let it go.
      if (attempt < 3) continue;
      throw std::logic_error("ckpt_offload: a batched saved tensor could not be reloaded");
    } else {
      CopyRange range("ckpt_offload::reload", device_);
      auto request_ev = profiler::enabled() ? streams.compute().record_timed() : nullptr;
      // Allocated on the compute stream, which consumes it: no cross-stream reuse hazard.
      at::Tensor bytes = device_bytes(device_, pad_ + nbytes_);
      c10::Storage storage = bytes.storage();
      char* dst = static_cast<char*>(storage.mutable_data()) + pad_;
      CopyTag tag{handle_, device_index(device_), false, 1};
      // A spilled buffer is read back first (waiting for the disk; SpillError on a bad checksum).
      reloaded_ready_ = engine().reload(*buffer_->host(), dst, streams.compute(), streams.copy(), true, tag);
      if (buffer_->spilled()) {
        buffer_->release_host();  // the disk keeps the bytes; the host block goes after the copy
        if (disk_prefetch_) {
          disk_prefetch_ = false;
          if (prefetcher_) prefetcher_->release(static_cast<int64_t>(nbytes_));
          counters_->prefetch_hits++;
        }
      }
      if (request_ev) profiler::add(profiler::WaitRecord{handle_, device_index(device_), request_ev, reloaded_ready_});
      reloaded_ = storage.getWeakStorageImpl();
      *fresh_bytes = static_cast<int64_t>(pad_ + nbytes_);
      out = std::move(storage);
    }
    if (first) --pending_;
    if (pending_ > 0 && !static_cast<bool>(staged_.storage)) {
      // Other saved tensors of this storage are still to unpack: keep the bytes for them.
      staged_ = Staged{out, reloaded_ready_, nullptr, false, true};
    } else if (pending_ <= 0 && staged_.held) {
      drop_staged_locked();
    }
    prefetcher = prefetcher_;
    seq = seq_;
    break;
  }
  if (prefetcher) prefetcher->after_unpack(seq);
  return out;
}

// ---- Batch ------------------------------------------------------------------------------------

Batch::Batch(c10::Device device, bool side_stream, std::shared_ptr<HostPool> pool,
             std::shared_ptr<PackerCounters> counters, std::shared_ptr<Prefetcher> prefetcher)
    : device_(device),
      side_stream_(side_stream),
      pool_(std::move(pool)),
      counters_(std::move(counters)),
      handle_(profiler::next_handle_id()),
      prefetcher_(std::move(prefetcher)) {}

Batch::~Batch() {
  if (disk_prefetch_bytes_) {
    if (prefetcher_) prefetcher_->release(disk_prefetch_bytes_);
    counters_->prefetches_unused++;
  }
}

std::shared_ptr<OffloadedStorage> Batch::add(const at::Tensor& t, int64_t lo, int64_t span) {
  std::lock_guard<std::mutex> lock(mu_);
  if (flushed_) return nullptr;
  const char* src = static_cast<const char*>(t.storage().data()) + lo;
  // Each member starts at its source's address mod 16, so the kernel moves 16 bytes at a time
  // both ways (the reload destination keeps that alignment too: its pad is lo mod 512).
  const size_t offset = (block_bytes_ + 15) / 16 * 16 + reinterpret_cast<uintptr_t>(src) % 16;
  const size_t pad = static_cast<size_t>(lo) % OffloadedStorage::kReloadAlignment;
  auto member = std::make_shared<OffloadedStorage>(shared_from_this(), device_, pad, static_cast<size_t>(span),
                                                   side_stream_, counters_);
  Member m;
  m.storage = member;
  m.source = tracked_keepalive(t.storage(), span);
  m.src = src;
  m.lo = static_cast<size_t>(lo);
  m.offset = offset;
  m.bytes = static_cast<size_t>(span);
  m.pad = pad;
  members_.push_back(std::move(m));
  block_bytes_ = offset + static_cast<size_t>(span);
  return member;
}

bool Batch::flushed() {
  std::lock_guard<std::mutex> lock(mu_);
  return flushed_;
}

bool Batch::flush() {
  std::vector<std::shared_ptr<OffloadedStorage>> alive;
  bool ok = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (flushed_) return true;
    flushed_ = true;
    if (members_.empty()) return true;
    StreamPair streams(device_, side_stream_, /*to_host=*/true);
    CopyRange range("ckpt_offload::offload_batch", device_);
    std::vector<BatchSpan> spans;
    auto sources = std::make_shared<std::vector<std::shared_ptr<void>>>();
    for (Member& m : members_) {
      spans.push_back({const_cast<char*>(m.src), m.offset, m.bytes});
      sources->push_back(m.source);
    }
    at::Tensor staging = staging_block(device_, block_bytes_);
    std::shared_ptr<void> keepalive(new std::pair<decltype(sources), at::Tensor>(sources, staging), [](void* p) {
      delete static_cast<std::pair<std::shared_ptr<std::vector<std::shared_ptr<void>>>, at::Tensor>*>(p);
    });
    sources.reset();
    CopyTag tag{handle_, device_index(device_), false, static_cast<int>(members_.size())};
    buffer_ = offload_tiered(pool_, handle_, [&](const std::shared_ptr<HostPool>& into) {
      return engine().offload_gather(into, spans, block_bytes_, staging.defined() ? staging.data_ptr() : nullptr,
                                     streams.compute(), streams.copy(), keepalive, tag);
    }, &refusal_);
    keepalive.reset();
    if (buffer_) {
      counters_->batches++;
      if (buffer_->spilled()) {
        counters_->tensors_spilled += static_cast<int64_t>(members_.size());
        counters_->bytes_spilled += static_cast<int64_t>(block_bytes_);
      }
      if (profiler::enabled()) {
        profiler::HandleRecord h;
        h.handle = handle_;
        h.bytes = block_bytes_;
        h.device = device_index(device_);
        h.dtype = "batch";
        h.module = profiler::scope();
        h.members = static_cast<int>(members_.size());
        profiler::add(std::move(h));
      }
      for (Member& m : members_) m.source.reset();  // the engine holds them until the copy has read them
    } else {
      ok = false;
      // The pool is full: give every member a device copy of its own in the reload layout, so
      // the saved tensors still come back, and count them as kept.
      for (Member& m : members_) {
        auto member = m.storage.lock();
        if (member) {
          const c10::Storage& src_storage = *static_cast<c10::Storage*>(m.source.get());
          at::Tensor whole = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device_));
          whole.set_(src_storage, 0, {static_cast<int64_t>(src_storage.nbytes())}, {1});
          at::Tensor copy = device_bytes(device_, m.pad + m.bytes);
          copy.narrow(0, static_cast<int64_t>(m.pad), static_cast<int64_t>(m.bytes))
              .copy_(whole.narrow(0, static_cast<int64_t>(m.lo), static_cast<int64_t>(m.bytes)));
          std::lock_guard<std::mutex> mlock(member->mu_);
          member->stage_locked(OffloadedStorage::Staged{copy.storage(), nullptr, nullptr, false});
        }
        counters_->tensors_offloaded--;
        counters_->bytes_offloaded -= static_cast<int64_t>(m.bytes);
        counters_->tensors_batched--;
        const int why = static_cast<int>(refusal_ == TieredRefusal::DiskFull ? KeepReason::DiskFull : KeepReason::PoolFull);
        counters_->kept_tensors[why]++;
        counters_->kept_bytes[why] += static_cast<int64_t>(m.bytes);
        m.source.reset();
      }
    }
    if (buffer_ && prefetcher_)
      for (Member& m : members_)
        if (auto member = m.storage.lock()) alive.push_back(std::move(member));
  }
  if (!alive.empty()) {
    // Outside the batch's lock: the prefetcher locks itself, then batches (after_unpack).
    seq_ = prefetcher_->add(weak_from_this());
    for (auto& member : alive) member->set_order(prefetcher_, seq_);
  }
  return ok;
}

int64_t Batch::prefetchable_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!buffer_ || !side_stream_ || disk_prefetch_bytes_) return 0;
  int64_t total = 0;
  for (Member& m : members_) {
    auto member = m.storage.lock();
    if (!member) continue;
    std::lock_guard<std::mutex> mlock(member->mu_);
    if (member->pending_ > 0 && !member->resident_locked()) total += static_cast<int64_t>(m.bytes);
  }
  return total;
}

int64_t Batch::reload(bool prefetch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!buffer_) return 0;
  if (prefetch && !side_stream_) return 0;
  if (buffer_->spilled() && prefetch) {
    // As OffloadedStorage::start_prefetch: only the disk read starts now, no device memory.
    if (disk_prefetch_bytes_) return 0;
    int64_t want = 0;
    for (Member& m : members_) {
      auto member = m.storage.lock();
      if (!member) continue;
      std::lock_guard<std::mutex> mlock(member->mu_);
      if (!member->resident_locked() && member->pending_ > 0) want += static_cast<int64_t>(m.bytes);
    }
    if (want == 0) return 0;
    maybe_fail_prefetch();
    buffer_->start_read(/*prefetch=*/true);
    disk_prefetch_bytes_ = want;
    counters_->disk_prefetches++;
    return want;
  }
  struct Target {
    std::shared_ptr<OffloadedStorage> member;
    c10::Storage storage;
  };
  std::vector<Target> targets;
  std::vector<BatchSpan> spans;
  for (Member& m : members_) {
    auto member = m.storage.lock();
    if (!member) continue;
    {
      std::lock_guard<std::mutex> mlock(member->mu_);
      if (member->resident_locked() || (prefetch && member->pending_ <= 0)) continue;
    }
    // Allocated on the compute stream, which consumes them; the copy stream waits for them.
    at::Tensor bytes = device_bytes(device_, m.pad + m.bytes);
    spans.push_back({static_cast<char*>(bytes.data_ptr()) + m.pad, m.offset, m.bytes});
    targets.push_back({std::move(member), bytes.storage()});
  }
  if (targets.empty()) return 0;
  if (prefetch) maybe_fail_prefetch();
  // A spilled batch is read back first (waiting for the disk; SpillError on a bad checksum).
  std::shared_ptr<HostBuffer> host = buffer_->host();
  StreamPair streams(device_, side_stream_, /*to_host=*/false);
  CopyRange range(prefetch ? "ckpt_offload::prefetch_batch" : "ckpt_offload::reload_batch", device_);
  at::Tensor staging = staging_block(device_, block_bytes_);
  CopyTag tag{handle_, device_index(device_), prefetch, static_cast<int>(targets.size())};
  auto done = engine().reload_scatter(*host, spans, staging.defined() ? staging.data_ptr() : nullptr,
                                      streams.compute(), streams.copy(), std::make_shared<at::Tensor>(staging),
                                      /*consumer_waits=*/!prefetch, tag);
  if (buffer_->spilled()) {
    host.reset();
    buffer_->release_host();
    if (disk_prefetch_bytes_) {
      if (prefetcher_) prefetcher_->release(disk_prefetch_bytes_);
      disk_prefetch_bytes_ = 0;
      counters_->prefetch_hits++;
    }
  }
  int64_t staged = 0, count = 0;
  for (Target& t : targets) {
    std::lock_guard<std::mutex> mlock(t.member->mu_);
    const size_t nbytes = t.member->nbytes_;
    if (t.member->stage_locked(OffloadedStorage::Staged{std::move(t.storage), done,
                                                        prefetch ? &streams.copy() : nullptr, prefetch}) &&
        prefetch) {
      staged += static_cast<int64_t>(nbytes);
      ++count;
    }
  }
  if (prefetch) {
    counters_->prefetches += count;
    counters_->bytes_prefetched += staged;
  }
  return staged;
}

void SavedTensor::check_version() const {
  if (!version_.enabled()) return;
  const uint32_t now = version_.current_version();
  if (now == saved_version_) return;
  std::ostringstream msg;
  msg << "one of the variables needed for gradient computation has been modified by an inplace operation: "
      << describe(dtype_, sizes_, device_) << " is at version " << now << "; expected version " << saved_version_
      << " instead. (Detected by ckpt_offload: the tensor was modified in place after autograd saved it, so "
      << "backward would have used the wrong values.) Hint: clone the tensor before modifying it in place, or "
      << "use the out-of-place operation.";
  throw std::runtime_error(msg.str());
}

SavedTensor::~SavedTensor() {
  if (device_held_) profiler::g_device_bytes_saved -= device_held_;
  if (storage_ && !unpacked_) storage_->unlink();
}

at::Tensor SavedTensor::unpack() {
  check_version();
  if (!storage_) return kept_;
  bool shared = false;
  int64_t fresh = 0;
  c10::Storage st = storage_->materialize(!unpacked_, &shared, &fresh);
  unpacked_ = true;
  if (shared) {
    counters_->tensors_reload_shared++;
  } else {
    counters_->tensors_reloaded++;
    counters_->bytes_reloaded += static_cast<int64_t>(storage_->nbytes());
  }
  if (fresh) {
    // The reloaded storage lives about as long as the node that unpacked it, which is when
    // autograd drops this SavedTensor: the memory timeline counts it until then.
    device_held_ += fresh;
    profiler::g_device_bytes_saved += fresh;
  }
  sample_memory(storage_->pool(), device_);
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(dtype_).device(st.device()));
  out.set_(st, offset_, sizes_, strides_);
  return out;
}

Packer::Packer(PackerOptions options) : options_(std::move(options)), counters_(std::make_shared<PackerCounters>()) {
  if (!options_.pool) throw std::invalid_argument("ckpt_offload: Packer needs a pool");
  // Prefetching on the compute stream would only move the same stall earlier.
  if (options_.prefetch_bytes > 0 && options_.side_stream)
    prefetcher_ = std::make_shared<Prefetcher>(options_.prefetch_bytes, counters_);
}

void Packer::flush_batches() {
  std::map<int, std::shared_ptr<Batch>> open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    open.swap(open_batches_);
  }
  size_t refused = 0, refused_bytes = 0;
  TieredRefusal why = TieredRefusal::PoolFull;
  for (auto& kv : open) {
    if (!kv.second->flush()) {
      refused += kv.second->size();
      refused_bytes += kv.second->block_bytes();
      why = kv.second->refusal();
    }
  }
  if (refused && options_.raise_on_full)
    throw PoolFull(full_message(why, *options_.pool, "a batch of " + std::to_string(refused) + " small saved tensors",
                                static_cast<int64_t>(refused_bytes)) +
                   " (The batch's tensors were kept on the device, so backward still works.)");
}

void Packer::begin() {
  std::lock_guard<std::mutex> lock(mu_);
  parameter_storages_.clear();
  buffer_storages_.clear();
}

void Packer::end(bool keep_dedup) {
  flush_batches();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!keep_dedup) dedup_.clear();
    parameter_storages_.clear();
    buffer_storages_.clear();
  }
  engine().poll();
}

void Packer::note_module_state(py::handle parameters, py::handle buffers) {
  std::lock_guard<std::mutex> lock(mu_);
  auto add = [](py::handle dict, std::unordered_set<const void*>& into) {
    if (!dict || dict.is_none()) return;
    for (auto item : py::reinterpret_borrow<py::dict>(dict)) {
      PyObject* v = item.second.ptr();
      if (v == Py_None || !THPVariable_Check(v)) continue;
      const at::Tensor& t = THPVariable_Unpack(v);
      if (t.has_storage()) into.insert(t.storage().unsafeGetStorageImpl());
    }
  };
  add(parameters, parameter_storages_);
  add(buffers, buffer_storages_);
}

py::object Packer::keep(const at::Tensor& t, KeepReason why, int64_t nbytes) {
  counters_->kept_tensors[static_cast<int>(why)]++;
  counters_->kept_bytes[static_cast<int>(why)] += nbytes;
  auto saved = SavedTensor::describe_layout(t, counters_);
  // A detached alias: same storage and version counter, but no grad_fn, so an output saved
  // by its own node does not form a reference cycle that would leak the graph.
  saved->kept_ = t.detach();
  saved->nbytes_ = nbytes;
  if (why != KeepReason::Parameter && why != KeepReason::Buffer) {
    saved->device_held_ = nbytes;
    profiler::g_device_bytes_saved += nbytes;
  }
  if (profiler::enabled()) {
    profiler::KeepRecord k;
    k.reason = keep_reason_name(why);
    k.dtype = dtype_name(t.scalar_type());
    k.module = profiler::scope();
    k.bytes = static_cast<size_t>(nbytes);
    k.device = device_index(t.device());
    k.shape = t.sizes().vec();
    profiler::add(std::move(k));
    sample_memory(options_.pool.get(), t.device());
  }
  return py::cast(std::move(saved));
}

py::object Packer::pack(py::handle obj) {
  PyObject* o = obj.ptr();
  if (!THPVariable_Check(o)) return py::reinterpret_borrow<py::object>(obj);
  const at::Tensor& t = THPVariable_Unpack(o);
  const int64_t itemsize = static_cast<int64_t>(t.dtype().itemsize());
  const int64_t logical_bytes = t.numel() * itemsize;

  if (is_parameter_object(o)) return keep(t, KeepReason::Parameter, logical_bytes);
  if (!THPVariable_CheckExact(o) || wrapped_tensor(t)) return keep(t, KeepReason::Subclass, logical_bytes);
  if (unsupported_layout(t)) return keep(t, KeepReason::Layout, logical_bytes);
  const c10::Device device = t.device();
  const bool device_ok = (device.is_cpu() && options_.offload_cpu) || (device.is_cuda() && options_.offload_cuda);
  if (!device_ok) return keep(t, KeepReason::Device, logical_bytes);
#ifdef CKPT_OFFLOAD_WITH_CUDA
  // Under CUDA graph capture events cannot be queried and the pool's addresses would be baked
  // into the graph: leave such tensors alone.
  if (device.is_cuda() && c10::cuda::captureStatusMayInitCtx(c10::cuda::getCurrentCUDAStream(device.index()).stream()) !=
                               c10::cuda::CaptureStatus::None)
    return keep(t, KeepReason::GraphCapture, logical_bytes);
#endif

  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (parameter_storages_.count(storage)) return keep(t, KeepReason::Parameter, logical_bytes);
    if (buffer_storages_.count(storage)) return keep(t, KeepReason::Buffer, logical_bytes);
  }
  if (t.is_view()) {
    // nn.Linear saves weight.t(): a plain Tensor whose base is the Parameter.
    const at::TensorBase& base = t._base();
    PyObject* base_obj = THPVariable_Wrap(base);
    const bool param_base = base_obj && is_parameter_object(base_obj);
    Py_XDECREF(base_obj);
    if (param_base) return keep(t, KeepReason::Parameter, logical_bytes);
  }

  const int64_t extent = extent_elements(t);
  if (extent == 0) return keep(t, KeepReason::TooSmall, 0);
  const int64_t lo = t.storage_offset() * itemsize;
  const int64_t hi = lo + extent * itemsize;
  const int64_t span = hi - lo;
  if (span < options_.min_bytes) return keep(t, KeepReason::TooSmall, span);

  const auto& vc = t.unsafeGetTensorImpl()->version_counter();
  const uint32_t version = vc.enabled() ? vc.current_version() : 0;

  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = dedup_.find(storage);
    if (it != dedup_.end()) {
      DedupEntry& e = it->second;
      auto alive = e.storage.lock();
      auto held = e.offloaded.lock();
      if (alive.get() == storage && held && e.version == version && lo >= e.lo && hi <= e.hi &&
          (lo - e.lo) % itemsize == 0) {
        auto saved = SavedTensor::describe_layout(t, counters_);
        saved->side_stream_ = options_.side_stream;
        saved->storage_ = std::move(held);
        saved->storage_->link();
        saved->offset_ = static_cast<int64_t>(saved->storage_->pad() + (lo - e.lo)) / itemsize;
        counters_->tensors_deduplicated++;
        counters_->bytes_deduplicated += span;
        return py::cast(std::move(saved));
      }
    }
  }

  std::shared_ptr<SavedTensor> saved;
  if (options_.batch_below > 0 && span < options_.batch_below) {
    saved = SavedTensor::describe_layout(t, counters_);
    saved->side_stream_ = options_.side_stream;
    const int key = device_index(device);
    for (;;) {
      std::shared_ptr<Batch> batch, full;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto& open = open_batches_[key];
        if (open && (open->flushed() || open->block_bytes() + static_cast<size_t>(span) + 16 >
                                            static_cast<size_t>(options_.batch_bytes))) {
          full = std::move(open);
          open.reset();
        }
        if (!open) open = std::make_shared<Batch>(device, options_.side_stream, options_.pool, counters_, prefetcher_);
        batch = open;
      }
      if (full && !full->flush() && options_.raise_on_full)
        throw PoolFull(full_message(full->refusal(), *options_.pool, "a batch of " + std::to_string(full->size()) +
                                    " small saved tensors", static_cast<int64_t>(full->block_bytes())) +
                       " (The batch's tensors were kept on the device, so backward still works.)");
      // Null when an unpack flushed the batch meanwhile: take a new one.
      saved->storage_ = batch->add(t, lo, span);
      if (saved->storage_) {
        saved->storage_->link();
        break;
      }
    }
    saved->offset_ = static_cast<int64_t>(saved->storage_->pad()) / itemsize;
    counters_->tensors_batched++;
  } else {
    TieredRefusal why = TieredRefusal::None;
    saved = SavedTensor::offload(t, options_.pool, options_.side_stream, counters_, &why);
    if (!saved) {
      if (options_.raise_on_full)
        throw PoolFull(full_message(why, *options_.pool,
                                    "a saved tensor " + describe(t.scalar_type(), t.sizes().vec(), t.device()), span));
      return keep(t, why == TieredRefusal::DiskFull ? KeepReason::DiskFull : KeepReason::PoolFull, span);
    }
    if (prefetcher_) saved->storage_->set_order(prefetcher_, prefetcher_->add(saved->storage_));
  }
  counters_->tensors_offloaded++;
  counters_->bytes_offloaded += span;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (dedup_.size() >= prune_at_) {
      for (auto it = dedup_.begin(); it != dedup_.end();) {
        if (it->second.offloaded.expired() || it->second.storage.expired())
          it = dedup_.erase(it);
        else
          ++it;
      }
      prune_at_ = std::max<size_t>(1024, 2 * dedup_.size());
    }
    DedupEntry& e = dedup_[storage];
    e.storage = t.storage().getWeakStorageImpl();
    e.offloaded = saved->storage_;
    e.version = version;
    e.lo = lo;
    e.hi = hi;
  }
  sample_memory(options_.pool.get(), device);
  return py::cast(std::move(saved));
}

std::string pool_full_message(HostPool& pool, const at::Tensor& t, int64_t span) {
  return pool_full_message(pool, "a saved tensor " + describe(t.scalar_type(), t.sizes().vec(), t.device()), span);
}

std::string disk_full_message(HostPool& pool, const std::string& what, int64_t span) {
  auto target = spill_target(&pool);
  std::ostringstream msg;
  msg << "ckpt_offload: the host pool is full and its disk tier has no room. Asked for " << human_bytes(span) << " ("
      << span << " bytes) for " << what;
  if (target) {
    const FileTierStats ds = target->tier()->stats();
    msg << "; spill_dir " << target->tier()->options().dir << ": " << human_bytes(ds.bytes_in_use) << " in use, "
        << human_bytes(ds.bytes_reserved) << " preallocated, cap "
        << (ds.max_bytes ? human_bytes(ds.max_bytes) : std::string("none (the file system is full)"));
  }
  msg << ". Raise spill_max_bytes, free space on the disk, offload less, or pass on_full=\"keep\" to keep such "
      << "tensors on the device.";
  return msg.str();
}

std::string full_message(TieredRefusal why, HostPool& pool, const std::string& what, int64_t span) {
  return why == TieredRefusal::DiskFull ? disk_full_message(pool, what, span) : pool_full_message(pool, what, span);
}

std::string pool_full_message(HostPool& pool, const std::string& what, int64_t span) {
  PoolStats ps = pool.stats();
  std::ostringstream msg;
  msg << "ckpt_offload: the host pool is full. Asked for " << human_bytes(span) << " (" << span
      << " bytes) for " << what << "; "
      << human_bytes(ps.bytes_in_use) << " in use, " << human_bytes(ps.bytes_pending) << " waiting for copies, "
      << human_bytes(ps.bytes_reserved) << " reserved, cap "
      << (ps.max_bytes ? human_bytes(ps.max_bytes) : std::string("none (the backend refused the memory)")) << ". Raise the cap (co.HostPool(max_bytes=...) or "
      << "pool.set_max_bytes(...)), offload less (a larger min_bytes), or pass on_full=\"keep\" to keep such "
      << "tensors on the device.";
  return msg.str();
}

std::shared_ptr<SavedTensor> SavedTensor::describe_layout(const at::Tensor& t,
                                                          std::shared_ptr<PackerCounters> counters) {
  auto saved = std::make_shared<SavedTensor>();
  saved->dtype_ = t.scalar_type();
  saved->device_ = t.device();
  saved->sizes_ = t.sizes().vec();
  saved->strides_ = t.strides().vec();
  saved->counters_ = std::move(counters);
  const auto& vc = t.unsafeGetTensorImpl()->version_counter();
  if (vc.enabled()) {
    saved->version_ = vc;
    saved->saved_version_ = vc.current_version();
  }
  saved->nbytes_ = extent_elements(t) * static_cast<int64_t>(t.dtype().itemsize());
  return saved;
}

std::shared_ptr<SavedTensor> SavedTensor::offload(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                                  bool side_stream, std::shared_ptr<PackerCounters> counters,
                                                  TieredRefusal* why) {
  auto saved = describe_layout(t, counters);
  saved->side_stream_ = side_stream;
  const int64_t lo = t.storage_offset() * static_cast<int64_t>(t.dtype().itemsize());
  StreamPair streams(t.device(), side_stream, /*to_host=*/true);
  CopyRange range("ckpt_offload::offload", t.device());
  // Hold the storage (not the tensor: no autograd metadata) until the copy has read it.
  auto keepalive = tracked_keepalive(t.storage(), saved->nbytes_);
  const char* src = static_cast<const char*>(t.storage().data()) + lo;
  const uint64_t handle = profiler::next_handle_id();
  CopyTag tag{handle, device_index(t.device()), false, 1};
  // Into the pool; when it is at its cap, through staging memory to its disk tier, if any.
  TieredRefusal refusal = TieredRefusal::None;
  auto buffer = offload_tiered(pool, handle, [&](const std::shared_ptr<HostPool>& into) {
    return engine().offload(into, src, static_cast<size_t>(saved->nbytes_), streams.compute(), streams.copy(),
                            keepalive, tag);
  }, &refusal);
  keepalive.reset();
  if (why) *why = refusal;
  if (!buffer) return nullptr;
  if (buffer->spilled() && counters) {
    counters->tensors_spilled++;
    counters->bytes_spilled += saved->nbytes_;
  }
  const size_t pad = static_cast<size_t>(lo) % OffloadedStorage::kReloadAlignment;
  saved->storage_ = std::make_shared<OffloadedStorage>(std::move(buffer), t.device(), pad, side_stream, counters);
  saved->storage_->link();
  saved->storage_->handle_ = handle;
  saved->offset_ = static_cast<int64_t>(pad) / static_cast<int64_t>(t.dtype().itemsize());
  if (profiler::enabled()) {
    profiler::HandleRecord h;
    h.handle = handle;
    h.bytes = static_cast<size_t>(saved->nbytes_);
    h.device = device_index(t.device());
    h.shape = saved->sizes_;
    h.dtype = dtype_name(saved->dtype_);
    h.module = profiler::scope();
    profiler::add(std::move(h));
  }
  return saved;
}

std::shared_ptr<SavedTensor> offload_tensor(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                            bool side_stream) {
  if (!t.defined()) throw std::invalid_argument("ckpt_offload.offload_tensor: tensor is undefined");
  if (unsupported_layout(t) || wrapped_tensor(t))
    throw std::invalid_argument("ckpt_offload.offload_tensor: tensor must be a plain strided tensor, got layout " +
                                c10::str(t.layout()) + (t.is_conj() ? " with the conjugate bit set" : "") +
                                (t.is_neg() ? " with the negative bit set" : ""));
  if (!t.device().is_cpu() && !t.device().is_cuda())
    throw std::invalid_argument("ckpt_offload.offload_tensor: tensor must be on 'cpu' or 'cuda', got " +
                                t.device().str());
  if (t.device().is_cuda() && !cuda_compiled())
    throw std::invalid_argument("ckpt_offload.offload_tensor: this build has no CUDA");
  TieredRefusal why = TieredRefusal::None;
  auto saved = SavedTensor::offload(t, pool, side_stream, std::make_shared<PackerCounters>(), &why);
  if (!saved)
    throw PoolFull(full_message(why, *pool, "a saved tensor " + describe(t.scalar_type(), t.sizes().vec(), t.device()),
                                SavedTensor::describe_layout(t, nullptr)->nbytes()));
  return saved;
}

at::Tensor Packer::unpack(py::handle obj) {
  if (!py::isinstance<SavedTensor>(obj)) {
    if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr());
    throw py::type_error("ckpt_offload: unpack got an object that ckpt_offload did not pack");
  }
  return obj.cast<SavedTensor&>().unpack();
}

py::dict Packer::stats() const {
  const PackerCounters& c = *counters_;
  py::dict kept_by_reason, kept_bytes_by_reason;
  int64_t kept = 0, kept_bytes = 0;
  for (int r = 0; r < static_cast<int>(KeepReason::kCount); ++r) {
    const int64_t n = c.kept_tensors[r].load();
    const int64_t b = c.kept_bytes[r].load();
    kept += n;
    kept_bytes += b;
    if (n) {
      kept_by_reason[keep_reason_name(static_cast<KeepReason>(r))] = n;
      kept_bytes_by_reason[keep_reason_name(static_cast<KeepReason>(r))] = b;
    }
  }
  py::dict d;
  d["tensors_offloaded"] = c.tensors_offloaded.load();
  d["bytes_offloaded"] = c.bytes_offloaded.load();
  d["tensors_deduplicated"] = c.tensors_deduplicated.load();
  d["bytes_deduplicated"] = c.bytes_deduplicated.load();
  d["tensors_kept"] = kept;
  d["bytes_kept"] = kept_bytes;
  d["kept_by_reason"] = kept_by_reason;
  d["kept_bytes_by_reason"] = kept_bytes_by_reason;
  d["tensors_reloaded"] = c.tensors_reloaded.load();
  d["bytes_reloaded"] = c.bytes_reloaded.load();
  d["tensors_reload_shared"] = c.tensors_reload_shared.load();
  d["tensors_batched"] = c.tensors_batched.load();
  d["batches"] = c.batches.load();
  d["prefetches"] = c.prefetches.load();
  d["bytes_prefetched"] = c.bytes_prefetched.load();
  d["prefetch_hits"] = c.prefetch_hits.load();
  d["prefetches_unused"] = c.prefetches_unused.load();
  d["peak_prefetch_bytes"] = c.peak_prefetch_bytes.load();
  d["prefetch_failures"] = c.prefetch_failures.load();
  d["tensors_spilled"] = c.tensors_spilled.load();
  d["bytes_spilled"] = c.bytes_spilled.load();
  d["disk_prefetches"] = c.disk_prefetches.load();
  return d;
}

}  // namespace ckpt_offload

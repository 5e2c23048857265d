// The host copy of one span of a storage (offloaded_storage.h), and how it comes back to the device.
#include "offloaded_storage.h"

#include <algorithm>

#include "../core/profiler.h"
#include "device_memory.h"
#include "runtime.h"
#include "tensor_layout.h"

namespace ckpt_offload {

OffloadedStorage::OffloadedStorage(std::shared_ptr<TieredBuffer> buffer, c10::Device device, int64_t lo, size_t pad,
                                   bool side_stream, uint64_t handle, std::shared_ptr<PackerCounters> counters)
    : device_(device),
      pad_(pad),
      nbytes_(buffer->nbytes()),
      side_stream_(side_stream),
      handle_(handle),
      counters_(std::move(counters)) {
  lo_ = lo;
  pieces_.push_back(Piece{std::move(buffer), lo});
}

OffloadedStorage::OffloadedStorage(std::shared_ptr<Batch> batch, c10::Device device, int64_t lo, size_t pad,
                                   size_t nbytes, bool side_stream, std::shared_ptr<PackerCounters> counters)
    : batch_(std::move(batch)),
      device_(device),
      pad_(pad),
      nbytes_(nbytes),
      side_stream_(side_stream),
      handle_(batch_->handle()),
      counters_(std::move(counters)) {
  lo_ = lo;
}

HostPool* OffloadedStorage::pool() const { return batch_ ? batch_->pool() : pieces_.front().buffer->pool(); }

bool OffloadedStorage::extendable() {
  std::lock_guard<std::mutex> lock(mu_);
  return extendable_locked();
}

bool OffloadedStorage::extend(std::vector<Piece> pieces, int pending) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!extendable_locked()) return false;
  int64_t lo = lo_, hi = lo_ + static_cast<int64_t>(nbytes_);
  for (auto& p : pieces) {
    lo = std::min(lo, p.from);
    hi = std::max(hi, p.from + static_cast<int64_t>(p.buffer->nbytes()));
    pieces_.push_back(std::move(p));
  }
  lo_ = lo;
  pad_ = static_cast<size_t>(lo) % kReloadAlignment;
  nbytes_ = static_cast<size_t>(hi - lo);
  pending_ += pending;
  return true;
}

bool OffloadedStorage::absorb_into(const std::shared_ptr<OffloadedStorage>& into, std::vector<Piece>* pieces,
                                   int* pending) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!extendable_locked()) return false;
  pieces->assign(std::make_move_iterator(pieces_.begin()), std::make_move_iterator(pieces_.end()));
  pieces_.clear();
  *pending = pending_;
  pending_ = 0;
  merged_into_ = into;
  return true;
}

void OffloadedStorage::restore(std::vector<Piece> pieces, int pending) {
  std::lock_guard<std::mutex> lock(mu_);
  pieces_.assign(std::make_move_iterator(pieces.begin()), std::make_move_iterator(pieces.end()));
  pending_ += pending;
  merged_into_.reset();
}

std::shared_ptr<OffloadedStorage> OffloadedStorage::resolve(std::shared_ptr<OffloadedStorage> self) {
  for (;;) {
    std::shared_ptr<OffloadedStorage> next;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      next = self->merged_into_;
    }
    if (!next) return self;
    self = std::move(next);
  }
}

bool OffloadedStorage::any_spilled_locked() const {
  for (const auto& p : pieces_)
    if (p.buffer->spilled()) return true;
  return false;
}

std::shared_ptr<Event> OffloadedStorage::reload_pieces_locked(c10::Storage& storage, Stream& compute, Stream& copy,
                                                              bool consumer_waits, const CopyTag& tag) {
  char* dst = static_cast<char*>(storage.mutable_data()) + pad_;
  std::shared_ptr<Event> last;
  for (const auto& p : pieces_) {
    // A spilled piece is read back first (waiting for the disk; SpillError on a bad checksum).
    last = engine().reload(*p.buffer->host(), dst + (p.from - lo_), compute, copy, consumer_waits, tag);
    if (p.buffer->spilled() && consumer_waits) p.buffer->release_host();  // the host block goes after the copy
  }
  return last;
}

OffloadedStorage::~OffloadedStorage() {
  // Never throws (Note [No throw on teardown], core/stream.h): a failure here leaves the staged
  // copy to its own destructor and the prefetch budget as it was.
  try {
    std::lock_guard<std::mutex> lock(mu_);
    drop_staged_locked();
    drop_disk_prefetch_locked();
  } catch (...) {
  }
}

void OffloadedStorage::drop_disk_prefetch_locked() {
  if (!disk_prefetch_) return;
  disk_prefetch_ = false;
  for (auto& p : pieces_)
    if (p.buffer->spilled()) p.buffer->release_host();  // a read still running keeps its host block until it ends
  if (prefetcher_) prefetcher_->release(static_cast<int64_t>(nbytes_));
  if (counters_) counters_->prefetches_unused++;
}

void OffloadedStorage::keep_on_device(c10::Storage storage) {
  std::lock_guard<std::mutex> lock(mu_);
  on_device_ = std::move(storage);
  on_device_bytes_.set(static_cast<int64_t>(pad_ + nbytes_));
}

void OffloadedStorage::drop_prefetch() {
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<bool>(staged_.storage) && staged_.prefetch && !staged_.held) drop_staged_locked();
  drop_disk_prefetch_locked();
}

void OffloadedStorage::set_order(std::shared_ptr<Prefetcher> prefetcher, uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  prefetcher_ = std::move(prefetcher);
  seq_ = seq;
}

bool OffloadedStorage::resident_locked() {
  return static_cast<bool>(on_device_) || static_cast<bool>(staged_.storage) || !reloaded_.expired();
}

void OffloadedStorage::link() {
  std::lock_guard<std::mutex> lock(mu_);
  ++pending_;
}

void OffloadedStorage::unlink() {
  std::shared_ptr<OffloadedStorage> into;
  {
    std::lock_guard<std::mutex> lock(mu_);
    into = merged_into_;  // its pending saved tensors moved there (Note [One copy per storage])
    if (!into && --pending_ == 0 && staged_.held) drop_staged_locked();
  }
  if (into) into->unlink();
}

bool OffloadedStorage::wants_reload(bool prefetch) {
  std::lock_guard<std::mutex> lock(mu_);
  return !resident_locked() && !(prefetch && pending_ <= 0);
}

bool OffloadedStorage::stage(Staged staged) {
  std::lock_guard<std::mutex> lock(mu_);
  return stage_locked(std::move(staged));
}

bool OffloadedStorage::stage_locked(Staged staged) {
  if (resident_locked()) {
    // Another unpack got here first: give the copy back once it has finished.
    release_after_copy(std::move(staged.storage), staged.copy, staged.ready);
    return false;
  }
  staged_ = std::move(staged);
  staged_.counted.set(static_cast<int64_t>(pad_ + nbytes_));
  return true;
}

void OffloadedStorage::drop_staged_locked() {
  if (!static_cast<bool>(staged_.storage)) return;
  if (staged_.held) {
    staged_ = Staged{};
    return;
  }
  staged_.counted.reset();
  if (staged_.prefetch) {
    if (prefetcher_) prefetcher_->release(static_cast<int64_t>(nbytes_));
    if (counters_) counters_->prefetches_unused++;
  }
  // Nobody waited for this copy on the compute stream: the memory must not go back to the
  // allocator (in compute order) before the copy stream is done writing it.
  release_after_copy(std::move(staged_.storage), staged_.copy, staged_.ready);
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
  sealed_ = true;  // Note [One copy per storage]
  if (any_spilled_locked()) {
    // Note [Spilling offloaded blocks]: the disk is the slow leg, so a prefetch starts the read
    // back into host memory (I/O threads, nothing waits); the H2D copy follows on demand.
    for (auto& p : pieces_)
      if (p.buffer->spilled()) p.buffer->start_read(/*prefetch=*/true);
    disk_prefetch_ = true;
    counters_->disk_prefetches++;
    return static_cast<int64_t>(nbytes_);
  }
  DeviceScope scope(device_);  // Note [Stream ordering] rule 6: device A's streams and memory
  StreamPair streams(device_, /*side=*/true, /*to_host=*/false);
  CopyRange range(copy_ranges::kPrefetch, device_);
  // Allocated on the compute stream, which will consume it; the copy stream waits for it.
  c10::Storage storage = device_storage(device_, pad_ + nbytes_);
  CopyTag tag{handle_, device_index(device_), /*prefetch=*/true, 1};
  auto done = reload_pieces_locked(storage, streams.compute(), streams.copy(), /*consumer_waits=*/false, tag);
  stage_locked(Staged{std::move(storage), done, &streams.copy(), true});
  counters_->prefetches++;
  counters_->bytes_prefetched += static_cast<int64_t>(nbytes_);
  return static_cast<int64_t>(nbytes_);
}

// Note [Same view, same tensor]
// tanh saves its output and the next Linear saves the same tensor as its input: two saved
// tensors of one copy, viewing it the same way. The reload is held for the second (Staged::held),
// and so is the tensor the first unpack made over it: the second unpack hands back that same
// tensor (after the version check of Note [One version per device copy], the tensor's own counter)
// instead of making another tensor and Python object over the same bytes. Autograd does the same
// without hooks, where every node that saved a tensor unpacks the tensor itself (and a node that
// needs a grad_fn gets its own shallow copy from autograd, either way). Only an identical view
// (dtype, sizes, strides, offset) shares; a tensor is never held past the last saved tensor of the
// copy that is still to unpack, nor past the reload it views. Never for a tensor selective
// checkpointing caches (View::share_object false: packed from torch's SAC cache, or by
// co.selective_offload_context's packer): those are handed out as the outputs of different ops,
// which must be different tensors ("the same as the input base tensor" in a view op otherwise).
static bool same_view(const at::Tensor& t, const OffloadedStorage::View& v, int64_t offset) {
  return t.scalar_type() == v.dtype && t.storage_offset() == offset && t.sizes() == v.sizes && t.strides() == v.strides;
}

at::Tensor OffloadedStorage::materialize(bool first, const View& view, bool accept_modified, bool* shared,
                                         int64_t* fresh_bytes) {
  *shared = false;
  *fresh_bytes = 0;
  c10::Storage out;
  std::shared_ptr<Prefetcher> prefetcher;
  uint64_t seq = 0;
  // For the prefetch window's lead (Note [Prefetch window]): this unpack consumed a fresh
  // reload (consumed), and backward had to wait for it (waited).
  bool consumed = false, waited = false;
  DeviceScope scope(device_);
  std::unique_lock<std::mutex> lock(mu_);
  sealed_ = true;  // Note [One copy per storage]: a device copy exists from here on
  if (on_device_) {
    // Kept on the device when its batch found the pool full: the same copy, for every unpack
    // (retain_graph, double backward); it has no host bytes to reload from.
    at::Tensor t = over_locked(on_device_, view, accept_modified, /*fresh=*/false);
    if (first) --pending_;
    *shared = true;
    record_consumer(on_device_, device_);
    return t;
  }
  for (int attempt = 0;; ++attempt) {
    std::shared_ptr<Event> request;
    if (batch_) {
      lock.unlock();  // Note [Lock order]: the batch flushes and reloads before this takes its lock
      if (!batch_->flushed()) batch_->flush();
      bool need;
      {
        std::lock_guard<std::mutex> relock(mu_);
        if (on_device_) {
          // This unpack's flush found the pool full: the batch kept its members on the device
          // (as above), and there are no host bytes to reload.
          at::Tensor t = over_locked(on_device_, view, accept_modified, /*fresh=*/false);
          if (first) --pending_;
          *shared = true;
          record_consumer(on_device_, device_);
          return t;
        }
        need = !resident_locked();
      }
      if (need) {
        // Asked for now: the whole wait for this reload is a stall of the compute stream.
        if (profiler::enabled()) request = StreamPair(device_, side_stream_, false).compute().record_timed();
        batch_->reload(/*prefetch=*/false);
        waited = true;
      }
      lock.lock();
    }
    // Asked for now: a reload started here runs on the demand stream, never behind queued
    // prefetches (Note [Stream ordering] rule 4).
    StreamPair streams(device_, side_stream_, /*to_host=*/false, /*demand=*/true);
    at::Tensor tensor;
    if (static_cast<bool>(staged_.storage) && staged_.held) {
      // Kept from an earlier unpack for the saved tensors still to come.
      if (view.share_object && staged_.tensor.defined() &&
          same_view(staged_.tensor, view, offset_of(view.lo, view.dtype))) {
        version_.check(accept_modified, view.dtype, view.sizes, device_);  // Note [Same view, same tensor]
        tensor = staged_.tensor;
      } else {
        tensor = over_locked(staged_.storage, view, accept_modified, /*fresh=*/false);
      }
      streams.compute().wait(staged_.ready);
      *shared = true;
      out = staged_.storage;
      record_consumer(out, device_);  // rule 3: the consumer may be another stream
    } else if (static_cast<bool>(staged_.storage)) {
      Staged st = std::move(staged_);
      staged_ = Staged{};
      st.counted.reset();  // the unpacking saved tensor counts them from here (fresh_bytes)
      if (profiler::enabled() && st.ready)
        profiler::add(profiler::WaitRecord{handle_, device_index(device_),
                                           request ? request : streams.compute().record_timed(), st.ready});
      consumed = true;
      if (st.ready && st.prefetch && st.ready->state() != EventState::Done) waited = true;
      try {
        if (st.ready) streams.compute().wait(st.ready);
      } catch (...) {
        // The unpack raises (a CUDA error): leave nothing half-taken -- the copy's memory goes
        // back once the copy is done, and a prefetch gives its budget back.
        if (st.prefetch && prefetcher_) prefetcher_->release(static_cast<int64_t>(nbytes_));
        release_after_copy(std::move(st.storage), st.copy, st.ready);
        throw;
      }
      if (st.prefetch) {
        if (prefetcher_) prefetcher_->release(static_cast<int64_t>(nbytes_));
        counters_->prefetch_hits++;
      }
      reloaded_ = st.storage.getWeakStorageImpl();
      reloaded_ready_ = st.ready;
      *fresh_bytes = static_cast<int64_t>(pad_ + nbytes_);
      out = std::move(st.storage);
      // A prefetch was allocated under the stream current when it started (rule 3).
      record_consumer(out, device_);
    } else if (auto alive = reloaded_.lock()) {
      // Another view (or an earlier unpack) already brought these bytes back. The copy may
      // have been ordered on another stream: order this one after it too.
      out = c10::Storage(std::move(alive));
      tensor = over_locked(out, view, accept_modified, /*fresh=*/false);
      streams.compute().wait(reloaded_ready_);
      *shared = true;
      record_consumer(out, device_);  // rule 3
    } else if (batch_) {
      // A concurrent unpack took the batch's reload of this member and already let it go.
      if (attempt < 3) continue;
      throw std::logic_error("ckpt_offload: a batched saved tensor could not be reloaded");
    } else {
      consumed = waited = true;
      CopyRange range(copy_ranges::kReload, device_);
      auto request_ev = profiler::enabled() ? streams.compute().record_timed() : nullptr;
      // Allocated on the compute stream, which consumes it: no cross-stream reuse hazard.
      c10::Storage storage = device_storage(device_, pad_ + nbytes_);
      CopyTag tag{handle_, device_index(device_), false, 1};
      // Spilled pieces are read back first; the disk keeps their bytes, their host blocks go
      // after the copies.
      reloaded_ready_ = reload_pieces_locked(storage, streams.compute(), streams.copy(), true, tag);
      if (any_spilled_locked()) {
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
    if (!tensor.defined()) tensor = over_locked(out, view, false, /*fresh=*/true);
    if (first) --pending_;
    if (pending_ > 0 && !static_cast<bool>(staged_.storage)) {
      // Other saved tensors of this storage are still to unpack: keep the bytes for them.
      staged_ = Staged{out, reloaded_ready_, nullptr, false, true};
      if (view.share_object) staged_.tensor = tensor;  // Note [Same view, same tensor]
    } else if (pending_ <= 0 && staged_.held) {
      drop_staged_locked();
    }
    prefetcher = prefetcher_;
    seq = seq_;
    lock.unlock();
    if (prefetcher) {
      if (consumed) prefetcher->note_unpack(waited);
      prefetcher->after_unpack(seq, device_);
    }
    return tensor;
  }
}

at::Tensor OffloadedStorage::over_locked(const c10::Storage& storage, const View& view, bool accept_modified,
                                         bool fresh) {
  // Note [One version per device copy]: a shared copy is checked before the unpack takes it.
  if (!fresh && version_.started()) version_.check(accept_modified, view.dtype, view.sizes, device_);
  at::Tensor t = tensor_over(storage, view.dtype, view.sizes, view.strides, offset_of(view.lo, view.dtype));
  if (fresh || !version_.started())
    version_.start(t);
  else
    version_.share(t);
  return t;
}

}  // namespace ckpt_offload

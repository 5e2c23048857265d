// The saved-tensor hooks: pack decides keep / offload / deduplicate for each tensor autograd
// saves, unpack brings it back. This is the per-tensor hot path, hence C++.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "../core/host_pool.h"
#include "copy_tables.h"
#include "counters.h"
#include "keep_rules.h"
#include "offloaded_storage.h"
#include "prefetcher.h"
#include "runtime.h"
#include "saved_tensor.h"
#include "store_dtype.h"

namespace ckpt_offload {

// Note [Lock order]
// The torch layer's mutexes are taken in this order, never the reverse (a thread holding one
// may take only those after it):
//   Packer::mu_ (its open batches), CopyTables::mu_ (never held together)
//     -> ConvertedCopy::mu_ -> Prefetcher::mu_ -> Batch::mu_ -> OffloadedStorage::mu_
//     -> the core's leaf locks: HostBuffer::mu_, CopyEngine::mu_, HostPool::mu_
//        (and in cuda_stream.cu side_mu, epoch_mu, the event pool's lock, none nested).
// KeepRules::mu_ is a leaf too: nothing is taken under it, and it is taken under nothing.
// Where this bites:
//  - Prefetcher::after_unpack holds its lock while it asks batches and storages for bytes and
//    starts their prefetches; so Batch::flush registers with the prefetcher (Prefetcher::add)
//    only after releasing the batch's lock, and Prefetcher::drop_unused calls into storages
//    after releasing its own.
//  - CopyTables::join holds the tables' lock while it absorbs and extends the exact copies it
//    joins (each takes its OffloadedStorage::mu_): the copies a look-up found cannot change
//    under it.
//  - ConvertedCopy::materialize (saved_tensor.h) holds its lock while it reloads the narrow bytes
//    through their own SavedTensor (prefetcher, storage) and converts them back, so that two
//    unpacks of one copy convert it once; nothing after it in the order calls back into it.
//  - OffloadedStorage::materialize flushes and reloads its batch before taking its own lock.
//  - Batch reaches its members only through their methods (wants_reload, stage,
//    keep_on_device, drop_prefetch), each of which takes the member's lock itself.
//  - A `_locked` helper assumes the caller holds that object's own mutex and nothing after it
//    in the order; it may take only the leaf locks (the engine, the pool).
// Nothing waits for a copy while holding any of these (event waits happen on streams, or after
// the locks are released), and the GIL is never taken under them.

// What a Packer does, set field by field by the Packer binding (bindings.cpp) from Python's
// OffloadOptions (ckpt_offload/options.py), where the defaults are written: the zeros here only
// keep a field from being read uninitialised.
struct PackerOptions {
  int64_t min_bytes = 0;
  bool offload_cpu = false;
  bool offload_cuda = false;
  bool side_stream = false;
  bool raise_on_full = false;
  // Backward reloads the next handles (reverse pack order) while this many bytes of reloads
  // wait unconsumed; 0 turns prefetch off. Only with side streams.
  int64_t prefetch_bytes = 0;
  // prefetch_bytes is the cap of a window that follows the model (Note [Prefetch window]).
  bool prefetch_auto = false;
  // Tensors spanning fewer bytes than this (and at least min_bytes) are gathered into shared
  // blocks of about batch_bytes, copied once; 0 turns batching off.
  int64_t batch_below = 0;
  int64_t batch_bytes = 0;
  // Note [Low-precision storage]: floating-point tensors wider than this format, spanning at
  // least store_min_bytes, are stored narrower; None: every byte exact. measure_error: record
  // the relative error each conversion introduces (synchronizes with the device per tensor).
  lowp::Format store_format = lowp::Format::None;
  int64_t store_min_bytes = 0;
  bool measure_error = false;
  std::shared_ptr<HostPool> pool;
};

// What a context exit checks (Note [Offloaded nothing], the pool- and disk-full warnings), read
// from the counters without building stats(); bound as _C.ExitCounts.
struct ExitCounts {
  int64_t offloaded_or_shared = 0;  // saved tensors offloaded or deduplicated
  int64_t too_small_tensors = 0, too_small_bytes = 0;
  int64_t device_tensors = 0;
  int64_t pool_full_tensors = 0, pool_full_bytes = 0;
  int64_t disk_full_tensors = 0, disk_full_bytes = 0;
};

class Packer {
 public:
  explicit Packer(PackerOptions options);
  pybind11::object pack(pybind11::handle obj);
  at::Tensor unpack(pybind11::handle obj);
  // Starts / ends an activation of the context. The deduplication table lives in between, or
  // across activations with keep_dedup (co.checkpoint: an input shared by every layer, such
  // as a rotary table or a mask, is stored once); its entries are weak either way.
  void begin();
  // Flushes the open batches, ends the activation whatever the flush did, then rethrows the
  // flush's error (PoolFull with raise_on_full).
  void end(bool keep_dedup);
  // Copies the open batches to the host (context exit, or before a batch member is unpacked).
  void flush_batches();
  pybind11::dict stats() const;
  void reset_stats() {
    counters_->reset();
    store_errors_->reset();
  }
  // (tensors, bytes) kept for `why` so far: what a context exit checks, without building stats().
  std::pair<int64_t, int64_t> kept(KeepReason why) const {
    return {counters_->kept_tensors[static_cast<int>(why)].load(), counters_->kept_bytes[static_cast<int>(why)].load()};
  }
  // Saved tensors offloaded or deduplicated so far (any host copy made or shared): what the
  // offloaded-nothing check at context exit reads, without building stats().
  int64_t offloaded_or_shared() const {
    return counters_->tensors_offloaded.load(std::memory_order_relaxed) +
           counters_->tensors_deduplicated.load(std::memory_order_relaxed);
  }
  ExitCounts exit_counts() const;
  const PackerOptions& options() const { return options_; }
  // Every tensor this packer saves unpacks to a tensor object of its own (a selective
  // checkpoint's cache: Note [Same view, same tensor]).
  bool distinct_unpacks() const { return distinct_unpacks_; }
  void set_distinct_unpacks(bool on) { distinct_unpacks_ = on; }
  // What ends each backward that unpacked from this packer (an autograd final callback,
  // queued at the first unpack of the backward): drops the prefetches nobody took, lets the
  // engine release finished copies' memory, and gives the pool's retired segments back (the
  // device-synchronizing releases deferred out of forward; see HostPool::release_retired).
  static void end_of_backward(const std::shared_ptr<Prefetcher>& prefetcher, const std::shared_ptr<HostPool>& pool);

 private:
  // pack's steps, in order. classify: the reason to keep t where it is (then `*keep_bytes` is
  // what to count), or none and t's span.
  // `current` gets the device's current stream, read once here for the whole pack (Note
  // [Stream ordering]), when t is on a device this context offloads from.
  std::optional<KeepReason> classify(PyObject* obj, const at::Tensor& t, Span* span, int64_t* keep_bytes,
                                     std::optional<CurrentStream>* current);

  // Note [Pack decision]
  // A tensor classify did not keep is placed by `place`, in this order: onto an exact copy of
  // its storage that holds its span (Duplicate) or, sharing 512-byte cells with such copies,
  // joined to them (Joined: Note [One copy per storage]); with a store format, onto a narrow
  // copy of exactly its span (SharedConverted) or into a new one (Converted: Note [Low-precision
  // storage]); gathered into a batch when small (Batched); else into a copy of its own
  // (Single). The copies made so far are found in the copy tables (Note [Copy tables]). A copy
  // the pool (and its disk tier) refused leaves the tensor where it is, through `refuse` (kept,
  // or PoolFull with on_full="raise"). pack then counts it and records a new copy in the
  // tables for the tensors after it.
  enum class Placement { Duplicate, Joined, SharedConverted, Converted, Batched, Single };
  // What holds the tensor's bytes: an exact host copy (`storage`) or a narrow one (`copy`);
  // neither when a copy was refused (`*refused` says by which tier). `prefetch`: a new copy of
  // its own, to register with the prefetcher once its saved tensor links it.
  struct Placed {
    std::shared_ptr<OffloadedStorage> storage;
    std::shared_ptr<ConvertedCopy> copy;
    bool prefetch = false;
  };
  // `from_sac_cache`: pack was called by torch's selective checkpoint cache (sac_cache_pack).
  Placed place(const at::Tensor& t, const Span& span, const Span& wide, const CurrentStream& current,
               bool from_sac_cache, Placement* how, TieredRefusal* refused);
  // Joins t to the copies it touches, copying only the bytes of `wide` that none holds yet.
  // Null when it cannot (a batch member or a reloaded copy among them: t then gets a copy of
  // its own), and also with `*refused` set when the pool refused the missing bytes.
  std::shared_ptr<OffloadedStorage> join(const at::Tensor& t, const Span& span, const Span& wide,
                                         std::vector<CopyTables::Touched>& touched, const CurrentStream& current,
                                         TieredRefusal* refused);
  // The open batch of t's device that takes t's span (a full one is flushed first).
  std::shared_ptr<OffloadedStorage> batch(const at::Tensor& t, const Span& span, const CurrentStream& current);
  // Records the new copy `placed` holds, in the table of its kind.
  void remember(const at::Tensor& t, const Span& span, const Span& wide, const Placed& placed, Placement how);
  pybind11::object refuse(const at::Tensor& t, TieredRefusal why, int64_t bytes);
  pybind11::object keep(const at::Tensor& t, KeepReason why, int64_t nbytes);
  // Note [DTensor activations]: a DTensor packed through its local tensor; a null object when
  // `obj` is not a DTensor (it is then kept as a subclass).
  pybind11::object pack_dtensor(pybind11::handle obj, const at::Tensor& t, int64_t nbytes);

  PackerOptions options_;
  std::shared_ptr<PackerCounters> counters_;
  CopyTables tables_;
  KeepRules keep_rules_;
  std::mutex mu_;                                       // guards open_batches_
  std::shared_ptr<Prefetcher> prefetcher_;              // null without prefetch
  std::map<int, std::shared_ptr<Batch>> open_batches_;  // by device index (-1: CPU)
  std::atomic<int> last_graph_task_{-1};                // the backward whose end_of_backward is queued
  std::shared_ptr<StoreErrors> store_errors_ = std::make_shared<StoreErrors>();  // with measure_error
  bool distinct_unpacks_ = false;                                                // see distinct_unpacks()
};

}  // namespace ckpt_offload

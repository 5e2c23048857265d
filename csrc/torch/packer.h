// The saved-tensor hooks: pack decides keep / offload / deduplicate for each tensor autograd
// saves, unpack brings it back. This is the per-tensor hot path, hence C++.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <c10/util/SmallVector.h>

#include "../core/host_pool.h"
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
//   Packer::mu_ -> ConvertedCopy::mu_ -> Prefetcher::mu_ -> Batch::mu_ -> OffloadedStorage::mu_
//     -> the core's leaf locks: HostBuffer::mu_, CopyEngine::mu_, HostPool::mu_
//        (and in cuda_stream.cu side_mu, epoch_mu, the event pool's lock, none nested).
// KeepRules::mu_ is a leaf too: nothing is taken under it, and it is taken under nothing.
// Where this bites:
//  - Prefetcher::after_unpack holds its lock while it asks batches and storages for bytes and
//    starts their prefetches; so Batch::flush registers with the prefetcher (Prefetcher::add)
//    only after releasing the batch's lock, and Prefetcher::drop_unused calls into storages
//    after releasing its own.
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
  const PackerOptions& options() const { return options_; }
  // What ends each backward that unpacked from this packer (an autograd final callback,
  // queued at the first unpack of the backward): drops the prefetches nobody took, lets the
  // engine release finished copies' memory, and gives the pool's retired segments back (the
  // device-synchronizing releases deferred out of forward; see HostPool::release_retired).
  static void end_of_backward(const std::shared_ptr<Prefetcher>& prefetcher, const std::shared_ptr<HostPool>& pool);

 private:
  // The byte span of its storage a tensor to offload reaches.
  struct Span {
    int64_t lo = 0, hi = 0, itemsize = 1;
    uint32_t version = 0;
    int64_t bytes() const { return hi - lo; }
  };
  // pack's steps, in order. classify: the reason to keep t where it is (then `*keep_bytes` is
  // what to count), or none and t's span.
  // `current` gets the device's current stream, read once here for the whole pack (Note
  // [Stream ordering]), when t is on a device this context offloads from.
  std::optional<KeepReason> classify(PyObject* obj, const at::Tensor& t, Span* span, int64_t* keep_bytes,
                                     std::optional<CurrentStream>* current);
  // A copy of t's storage that a new view joins (Note [One copy per storage]).
  struct Touched {
    std::shared_ptr<OffloadedStorage> held;
    int64_t lo = 0, hi = 0;
    bool extendable = false;
    int64_t counted = 0;  // DedupGroup::counted
  };

  // Note [Pack decision]
  // A tensor classify did not keep is placed by `place`, in this order: onto an exact copy of
  // its storage that holds its span (Duplicate) or, sharing 512-byte cells with such copies,
  // joined to them (Joined: Note [One copy per storage]); with a store format, onto a narrow
  // copy of exactly its span (SharedConverted) or into a new one (Converted: Note [Low-precision
  // storage]); gathered into a batch when small (Batched); else into a copy of its own
  // (Single). A copy the pool (and its disk tier) refused leaves the tensor where it is,
  // through `refuse` (kept, or PoolFull with on_full="raise"). pack then counts it and
  // remembers a new copy for the tensors after it.
  enum class Placement { Duplicate, Joined, SharedConverted, Converted, Batched, Single };
  // What holds the tensor's bytes: an exact host copy (`storage`) or a narrow one (`copy`);
  // neither when a copy was refused (`*refused` says by which tier). `prefetch`: a new copy of
  // its own, to register with the prefetcher once its saved tensor links it.
  struct Placed {
    std::shared_ptr<OffloadedStorage> storage;
    std::shared_ptr<ConvertedCopy> copy;
    bool prefetch = false;
  };
  Placed place(const at::Tensor& t, const Span& span, const Span& wide, const CurrentStream& current, Placement* how,
               TieredRefusal* refused);
  // The exact copy of t's storage (same version) that holds `span`, or null; then `touched`
  // gets the copies whose cells `wide` shares.
  std::shared_ptr<OffloadedStorage> find_duplicate(const at::Tensor& t, const Span& span, const Span& wide,
                                                   std::vector<Touched>* touched);
  // Joins t to the copies it touches, copying only the bytes of `wide` that none holds yet.
  // Null when it cannot (a batch member or a reloaded copy among them: t then gets a copy of
  // its own), and also with `*refused` set when the pool refused the missing bytes.
  std::shared_ptr<OffloadedStorage> join(const at::Tensor& t, const Span& span, const Span& wide,
                                         std::vector<Touched>& touched, const CurrentStream& current,
                                         TieredRefusal* refused);
  // The open batch of t's device that takes t's span (a full one is flushed first).
  std::shared_ptr<OffloadedStorage> batch(const at::Tensor& t, const Span& span, const CurrentStream& current);
  // The narrow copy of exactly t's span (same storage, first and last byte, dtype, version)
  // made earlier, or null.
  std::shared_ptr<ConvertedCopy> find_converted(const at::Tensor& t, const Span& span);
  // Records the new copy `placed` holds, in the table of its kind.
  void remember(const at::Tensor& t, const Span& span, const Span& wide, const Placed& placed, Placement how);
  pybind11::object refuse(const at::Tensor& t, TieredRefusal why, int64_t bytes);
  pybind11::object keep(const at::Tensor& t, KeepReason why, int64_t nbytes);
  // Note [DTensor activations]: a DTensor packed through its local tensor; a null object when
  // `obj` is not a DTensor (it is then kept as a subclass).
  pybind11::object pack_dtensor(pybind11::handle obj, const at::Tensor& t, int64_t nbytes);

  // Note [Copy tables]
  // The host copies made this activation (or across activations, with keep_dedup), by the
  // storage they copy, for the tensors after them to share: exact copies (dedup_) and narrow
  // ones (converted_, apart: their host bytes are converted ones, which only a saved tensor of
  // the same span can share). Every reference is weak: a table keeps neither a storage nor a
  // copy alive. Read and written under mu_.
  template <class Group>
  struct CopyTable {
    struct Entry {
      c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
      c10::SmallVector<Group, 1> groups;  // disjoint copies of one storage (or of other versions)
    };
    std::unordered_map<const void*, Entry> entries;
    size_t prune_at = 1024;  // drop expired entries when the table grows past this

    // The entry of `storage`, or null (also when another storage lives at a freed one's address).
    Entry* find(c10::StorageImpl* storage) {
      auto it = entries.find(storage);
      if (it == entries.end() || it->second.storage.lock().get() != storage) return nullptr;
      return &it->second;
    }
    void add(const at::Tensor& t, Group g) {
      if (entries.size() >= prune_at) {
        for (auto it = entries.begin(); it != entries.end();) {
          auto& groups = it->second.groups;
          groups.erase(std::remove_if(groups.begin(), groups.end(), [](const Group& x) { return x.expired(); }),
                       groups.end());
          if (groups.empty() || it->second.storage.expired())
            it = entries.erase(it);
          else
            ++it;
        }
        prune_at = std::max<size_t>(1024, 2 * entries.size());
      }
      c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
      Entry& e = entries[storage];
      if (e.storage.lock().get() != storage) {  // new, or a freed storage's address reused
        e.storage = t.storage().getWeakStorageImpl();
        e.groups.clear();
      }
      e.groups.push_back(std::move(g));
    }
    void clear() { entries.clear(); }
  };
  // One exact host copy of a span of a storage (Note [One copy per storage]).
  struct DedupGroup {
    std::weak_ptr<OffloadedStorage> offloaded;
    uint32_t version = 0;
    int64_t lo = 0, hi = 0;   // byte range of the storage held on the host
    bool extendable = false;  // a copy of its own (not a batch member): can take more pieces
    int64_t counted = 0;      // its bytes in bytes_offloaded / bytes_stored (a joined copy: hi - lo)
    bool expired() const { return offloaded.expired(); }
  };
  // One narrow copy of a span (Note [Low-precision storage]).
  struct ConvertedGroup {
    std::weak_ptr<ConvertedCopy> copy;
    uint32_t version = 0;
    int64_t lo = 0, hi = 0;
    c10::ScalarType dtype = c10::kFloat;
    // Its elements are the span's (non-overlapping and dense); else only a view of the same
    // sizes and strides has the same elements, and so the same fp8 scale.
    bool dense = true;
    std::vector<int64_t> sizes, strides;  // when not dense
    bool expired() const { return copy.expired(); }
  };

  PackerOptions options_;
  std::shared_ptr<PackerCounters> counters_;
  std::mutex mu_;
  CopyTable<DedupGroup> dedup_;
  CopyTable<ConvertedGroup> converted_;
  KeepRules keep_rules_;
  std::shared_ptr<Prefetcher> prefetcher_;  // null without prefetch
  std::map<int, std::shared_ptr<Batch>> open_batches_;  // by device index (-1: CPU)
  std::atomic<int> last_graph_task_{-1};  // the backward whose end_of_backward is queued
  std::shared_ptr<StoreErrors> store_errors_ = std::make_shared<StoreErrors>();  // with measure_error

};

}  // namespace ckpt_offload

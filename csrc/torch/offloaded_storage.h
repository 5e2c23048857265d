// The host copies of saved tensors, and how they come back to the device: the copy of one span of
// a storage (OffloadedStorage), and the Batch that many small ones share. The two call each other
// (a batch stages its members' reloads; a member asks its batch to flush and reload), so they are
// declared together; batch.cpp defines Batch.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../core/copy_engine.h"
#include "../core/host_pool.h"
#include "../core/spill.h"
#include "counters.h"
#include "current_stream.h"
#include "device_bytes.h"
#include "device_memory.h"
#include "prefetcher.h"

namespace ckpt_offload {

class Batch;

// The host copy of one span of a storage, shared by every saved tensor that views it. Its
// bytes live in buffers of its own (pool blocks, or spilled to the pool's disk tier), or at an
// offset of a Batch's.
//
// Note [One copy per storage]
// Views of one storage (q, k, v chunked from one projection; x[::2] and x[1::2]) reach
// overlapping or interleaved spans of it. Each byte is copied to the host once and all of them
// come back in one device storage:
//  - a span is copied widened to the 512-byte cells of its storage it touches (its pool block
//    is rounded to 512 anyway; the extra bytes are the reload pad and at most 511 bytes after
//    the span, never past the storage's end), so the pieces of one storage tile its cells and
//    their pool blocks add up to at most the storage's bytes rounded to 512;
//  - a later view whose widened span shares a cell with this copy's span (of the same version)
//    is deduplicated onto it: if it reaches past the span, only the missing cells are copied,
//    as extra pieces of this same storage (extend); if it bridges two copies, the second's
//    pieces and pending saved tensors move into the first, which the second then forwards to
//    (absorb, resolve). Nothing already copied is copied again or changes: the earlier saved
//    tensors' reloads hold the same values, at their offset from base(), read at unpack;
//  - this only happens before the storage is sealed: its first reload (or prefetch) seals it,
//    since a device copy that exists cannot grow. A view that would need a sealed (or batched)
//    copy to grow gets a copy of its own, as before;
//  - views in disjoint cells stay separate copies: chunks of a batch reload (and are freed)
//    one at a time in backward instead of all at the first unpack.
class OffloadedStorage : public Reloadable {
 public:
  // One host buffer and the byte of the original storage it starts at.
  struct Piece {
    std::shared_ptr<TieredBuffer> buffer;
    int64_t from = 0;
  };
  // `lo`: the byte of the original storage the host copy starts at. `pad` bytes precede it in a
  // reloaded storage, so the data pointer keeps its original alignment (mod kReloadAlignment):
  // kernels choose code paths by alignment, and a different path could change the result's bits.
  OffloadedStorage(std::shared_ptr<TieredBuffer> buffer, c10::Device device, int64_t lo, size_t pad, bool side_stream,
                   uint64_t handle, std::shared_ptr<PackerCounters> counters);
  OffloadedStorage(std::shared_ptr<Batch> batch, c10::Device device, int64_t lo, size_t pad, size_t nbytes,
                   bool side_stream, std::shared_ptr<PackerCounters> counters);
  ~OffloadedStorage() override;
  static constexpr size_t kReloadAlignment = 512;

  // A reload (or a device copy) that no unpack has consumed yet.
  struct Staged {
    c10::Storage storage;
    std::shared_ptr<Event> ready;
    Stream* copy = nullptr;  // the side stream of a prefetch, which the consumer has not waited on
    bool prefetch = false;
    // A reload kept for the saved tensors that have not unpacked yet (tanh's output is also
    // the next Linear's input): they share it instead of copying the same bytes again.
    bool held = false;
    // Counts the bytes in the memory timeline while staged_ owns them (not when `held`: the
    // saved tensor that unpacked the reload counts them).
    DeviceBytesHeld counted;
    // With `held`: the tensor the unpack that reloaded made over `storage`, for the saved
    // tensors still to come that view it the same way (Note [Same view, same tensor]).
    at::Tensor tensor;
  };
  // How a saved tensor views this storage: what its unpack makes a tensor of. `lo`: its first
  // byte in the original storage (its element offset in a reload is (lo - base()) / itemsize).
  struct View {
    c10::ScalarType dtype;
    c10::IntArrayRef sizes, strides;
    int64_t lo;
    // May get (and leave for the next) the tensor another unpack of the same view made (Note
    // [Same view, same tensor]); false for a tensor selective checkpointing caches.
    bool share_object;
  };

  // A tensor over a device storage holding the bytes again, viewing them as `view` does. While
  // one reloaded storage is alive, later unpacks (other views, retain_graph, double backward)
  // share it instead of copying again, and every tensor made over it shares one version counter,
  // checked at each shared unpack (Note [One version per device copy]: DeviceCopyModified, raised
  // before anything changes, unless `accept_modified`).
  // `first`: the first unpack of one of the saved tensors that view this storage. `*shared`: the
  // device storage was shared; `*fresh_bytes`: device bytes this call brought back (0 when shared).
  at::Tensor materialize(bool first, const View& view, bool accept_modified, bool* shared, int64_t* fresh_bytes);
  // A saved tensor that views this storage was made / died before it was ever unpacked.
  void link();
  void unlink();
  size_t nbytes() const { return nbytes_; }
  size_t pad() const { return pad_; }
  // The byte of the original storage that byte 0 of a reloaded storage stands for: a saved
  // tensor's element offset there is (its byte offset - base()) / itemsize. Fixed once sealed
  // (read it after materialize).
  int64_t base() const { return lo_ - static_cast<int64_t>(pad_); }
  // The element offset in a reloaded storage of a view that starts at byte `lo` of the original
  // (read after materialize, as base()).
  int64_t offset_of(int64_t lo, c10::ScalarType dtype) const {
    return (lo - base()) / static_cast<int64_t>(c10::elementSize(dtype));
  }

  // Note [One copy per storage]. Whether more pieces can still be added (not sealed, not a
  // batch member, not absorbed).
  bool extendable();
  // Adds pieces covering bytes next to this copy's span (the caller makes the union one
  // contiguous span with no overlap), and `pending` saved tensors that view them; false (and
  // nothing changes) when no longer extendable.
  bool extend(std::vector<Piece> pieces, int pending);
  // Gives this copy's pieces and pending saved tensors to `into`, which it forwards to from now
  // on; false (and nothing changes) when not extendable.
  bool absorb_into(const std::shared_ptr<OffloadedStorage>& into, std::vector<Piece>* pieces, int* pending);
  // Puts back what absorb_into gave, when `into` refused them.
  void restore(std::vector<Piece> pieces, int pending);
  // This copy, or the one it was absorbed into.
  static std::shared_ptr<OffloadedStorage> resolve(std::shared_ptr<OffloadedStorage> self);
  uint64_t handle() const { return handle_; }
  HostPool* pool() const;
  void set_order(std::shared_ptr<Prefetcher> prefetcher, uint64_t seq);
  int64_t prefetchable_bytes() override;
  int64_t start_prefetch() override;

  // For the batch this is a member of (each takes this storage's lock; see Note [Lock order]).
  // Whether a batch reload should bring this member back: not on the device already, and for
  // a prefetch, some saved tensor still to unpack it.
  bool wants_reload(bool prefetch);
  // Takes a staged reload; false (and the copy is let go once finished) when the bytes are
  // already on the device.
  bool stage(Staged staged);
  // The pool was full when the batch flushed: `storage` (in the reload layout) is this member's
  // device copy for as long as it lives, returned by every unpack.
  void keep_on_device(c10::Storage storage);
  // End of a backward: a prefetched reload no unpack has taken is let go (after its copy).
  void drop_prefetch() override;
  c10::Device device() const override { return device_; }

 private:
  // The `_locked` helpers assume mu_ is held by the caller (Note [Lock order], packer.h).
  bool resident_locked();
  // A tensor over `storage` (this copy's device copy) as `view` sees it: the copy's version
  // counter starts with it when `fresh` (or none has yet), else it is checked and shared
  // (Note [One version per device copy]).
  at::Tensor over_locked(const c10::Storage& storage, const View& view, bool accept_modified, bool fresh);
  bool stage_locked(Staged staged);
  void drop_staged_locked();

  // Lets a disk prefetch go that no unpack consumed (budget and counters).
  void drop_disk_prefetch_locked();
  bool extendable_locked() const { return !sealed_ && !batch_ && !merged_into_ && !pieces_.empty(); }
  bool any_spilled_locked() const;
  // Copies every piece to its place in `storage` (pad_ + nbytes_ bytes); the event of the last
  // copy (they run in order on `copy`).
  std::shared_ptr<Event> reload_pieces_locked(c10::Storage& storage, Stream& compute, Stream& copy, bool consumer_waits,
                                              const CopyTag& tag);

  // A storage of its own (in the pool or spilled), in pieces (Note [One copy per storage]);
  // almost always one, held inline.
  c10::SmallVector<Piece, 1> pieces_;
  std::shared_ptr<Batch> batch_;                   // or a member of a batch
  int64_t lo_ = 0;                                 // the original storage's byte at pad_
  bool sealed_ = false;                            // reloaded or prefetched once: no more pieces
  std::shared_ptr<OffloadedStorage> merged_into_;  // absorbed: forwards there
  // A prefetch that only started the disk read of a spilled buffer: counted in the prefetch
  // budget until an unpack consumes it (the H2D copy then runs on demand).
  bool disk_prefetch_ = false;
  c10::Device device_;
  size_t pad_, nbytes_;
  bool side_stream_;
  uint64_t handle_;
  std::shared_ptr<PackerCounters> counters_;
  std::mutex mu_;
  c10::weak_intrusive_ptr<c10::StorageImpl> reloaded_{c10::intrusive_ptr<c10::StorageImpl>()};
  // The version counter of the device copy (reloaded_, a held reload, on_device_) that unpacks
  // share (Note [One version per device copy]).
  DeviceCopyVersion version_;
  std::shared_ptr<Event> reloaded_ready_;
  Staged staged_;
  c10::Storage on_device_;  // see keep_on_device
  DeviceBytesHeld on_device_bytes_;
  int pending_ = 0;  // saved tensors viewing this storage that have not unpacked yet
  std::shared_ptr<Prefetcher> prefetcher_;
  uint64_t seq_ = 0;
};

// Small saved tensors of one device, gathered into one host block and copied once (a gather
// kernel on a GPU), scattered back into storages of their own on reload.
class Batch : public Reloadable, public std::enable_shared_from_this<Batch> {
 public:
  Batch(c10::Device device, bool side_stream, std::shared_ptr<HostPool> pool, std::shared_ptr<PackerCounters> counters,
        std::shared_ptr<Prefetcher> prefetcher);
  ~Batch() override;
  // Adds t's span [lo, lo + span) of its storage; the batch holds the storage until flush.
  // `current`: t's device's current stream, as pack read it.
  std::shared_ptr<OffloadedStorage> add(const at::Tensor& t, int64_t lo, int64_t span, const CurrentStream& current);
  size_t block_bytes() const { return block_bytes_; }
  size_t size() const { return members_.size(); }
  // Copies the members to the host (once). When the pool (and its disk tier) is full, every
  // member instead gets a device copy of its own, counted as kept for pool_full (disk_full);
  // returns false then.
  bool flush();
  TieredRefusal refusal() const { return refusal_; }
  bool flushed();
  // Reloads every member that is alive and not on the device; prefetch: without making the
  // compute stream wait. Returns the bytes staged.
  int64_t reload(bool prefetch);
  int64_t prefetchable_bytes() override;
  int64_t start_prefetch() override { return reload(true); }
  void drop_prefetch() override;
  c10::Device device() const override { return device_; }
  // A member whose storage spans more than 2 * its bytes + this is copied out at add (so the
  // batch does not hold a whole activation for a small view of it until the flush).
  static constexpr size_t kCopyOutSlack = 4096;
  uint64_t handle() const { return handle_; }
  HostPool* pool() const { return pool_.get(); }

 private:
  struct Member {
    std::weak_ptr<OffloadedStorage> storage;
    std::shared_ptr<void> source;  // the source storage, until flush
    const char* src = nullptr;
    size_t lo = 0, offset = 0, bytes = 0, pad = 0;
  };
  c10::Device device_;
  bool side_stream_;
  std::shared_ptr<HostPool> pool_;
  std::shared_ptr<PackerCounters> counters_;
  uint64_t handle_;
  std::mutex mu_;
  std::vector<Member> members_;
  size_t block_bytes_ = 0;
  bool flushed_ = false;
  TieredRefusal refusal_ = TieredRefusal::None;
  std::shared_ptr<TieredBuffer> buffer_;
  int64_t disk_prefetch_bytes_ = 0;  // as OffloadedStorage::disk_prefetch_, for the whole batch
  void drop_disk_prefetch_locked();
  // The latest event of every stream that produced a member, by stream id, until the flush.
  std::map<uintptr_t, std::shared_ptr<Event>> producers_;
  std::shared_ptr<Prefetcher> prefetcher_;
  uint64_t seq_ = 0;
};

}  // namespace ckpt_offload

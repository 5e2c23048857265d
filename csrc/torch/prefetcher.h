// Prefetch: backward reloads the handles it will need next while it computes.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <c10/core/Device.h>

#include "counters.h"

namespace ckpt_offload {

// Something backward can reload ahead of need: one offloaded storage, or a batch of them.
class Reloadable {
 public:
  virtual ~Reloadable() = default;
  // Upper bound of the device bytes a prefetch would take now; 0 when there is nothing to
  // prefetch (already on the device, prefetched, or unpacked before).
  virtual int64_t prefetchable_bytes() = 0;
  // Starts the reload without making the compute stream wait; returns the bytes staged.
  virtual int64_t start_prefetch() = 0;
  // Lets go of a prefetched reload no unpack has taken (end of backward).
  virtual void drop_prefetch() = 0;
  // The device its bytes go back to.
  virtual c10::Device device() const = 0;
};

// Remembers the order handles were packed in; after each unpack it starts the reloads of the
// handles packed just before (the ones backward needs next), within a byte budget of reloads
// nobody has consumed yet. Correct for any unpack order: a prefetched reload is only a staged
// copy, used by whichever unpack comes first and dropped (after its copy) if none does.
//
// Note [Prefetch window]
// With a fixed budget (the user's prefetch_bytes) the window is that many bytes. In auto mode
// (the default) it follows the model, so that backward holds about one block more than the
// block it differentiates, not the whole step:
//  - block: the unit the pack order shows. Each activation of the context (Packer::begin:
//    every co.checkpoint / co.apply block enters it once) marks a boundary; when the step came
//    from a single activation (plain co.offload), the block is the shortest period of the
//    sequence of packed sizes (a stack of repeated layers packs the same sizes again and
//    again), or a quarter of the step when the sequence has no period. Computed once per
//    backward, at its first unpack, from the handles of the forward it differentiates -- no
//    module hook, nothing on the pack path but one size per handle.
//  - lead: how many blocks ahead copies start. It grows (doubling, up to kMaxLead) after a
//    backward in which unpacks had to wait for their copy (a prefetch still running, or a
//    demand reload the window did not reach), and shrinks by one after a backward with no
//    wait: copies start as far ahead as they need to hide behind compute, no further.
//  - window = min(lead * block, cap); at least one reload may always be in flight.
class Prefetcher {
 public:
  static constexpr int kMaxLead = 8;
  // budget: the fixed window, or the cap of the automatic one (auto_window).
  Prefetcher(int64_t budget, std::shared_ptr<PackerCounters> counters, bool auto_window = false)
      : budget_(budget), counters_(std::move(counters)), auto_(auto_window) {}
  uint64_t add(std::weak_ptr<Reloadable> r);
  // After the unpack of handle `seq` on `device`: prefetches only handles of that device, so
  // the work never runs on another device's streams from this (the unpacking device's) thread.
  // Note [Stream ordering] rule 6 (runtime.h).
  void after_unpack(uint64_t seq, const c10::Device& device);
  void release(int64_t bytes) { outstanding_ -= bytes; }
  // A new activation of the context: the handles added from now on belong to the next block.
  void mark_block();
  // An unpack consumed a reload; waited: its copy was not finished (or had not been started)
  // when backward asked for it. Feeds the lead (Note [Prefetch window]).
  void note_unpack(bool waited);
  // End of a backward: drops the prefetches it started that no unpack took, so their device
  // memory does not outlive the backward (it would until the graph died, or the next offload).
  void drop_unused();
  int64_t outstanding() const { return outstanding_.load(); }
  bool auto_window() const { return auto_; }
  int64_t window() const { return window_.load(); }
  int64_t block_bytes() const { return block_bytes_.load(); }
  int lead() const { return lead_.load(); }

 private:
  struct Entry {
    std::weak_ptr<Reloadable> r;
    int64_t bytes = 0;   // device bytes when added (the block estimate's unit)
    uint64_t block = 0;  // mark_block count when added
  };
  // The window for the backward that begins with an unpack of `seq` (mu_ held).
  int64_t compute_window_locked(uint64_t seq);

  int64_t budget_;
  std::shared_ptr<PackerCounters> counters_;
  const bool auto_;
  std::atomic<int64_t> window_{0}, block_bytes_{0};
  std::atomic<int> lead_{1};
  bool in_backward_ = false;
  uint64_t block_ = 0;
  int64_t unpacks_ = 0, waits_ = 0;  // this backward's, for the lead
  std::mutex mu_;
  std::map<uint64_t, Entry> order_;
  uint64_t next_ = 0;
  size_t prune_at_ = 1024;
  std::atomic<int64_t> outstanding_{0};
  std::vector<std::weak_ptr<Reloadable>> started_;  // prefetched since the last drop_unused
};

}  // namespace ckpt_offload

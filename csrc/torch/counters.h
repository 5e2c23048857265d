// What the saved-tensor hooks did, counted for Packer::stats(), and why tensors were kept.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "device_bytes.h"

namespace ckpt_offload {

// Note [Stats table]
// The counters of Packer::stats() are listed once, here: the struct's fields, reset(), the
// dict stats() builds and the key lists Python reads (_C.stats_keys(), _C.keep_reasons(): the
// zeros of a handle without offload, how several contexts' stats merge, the profile report's
// reasons) are all generated from these two tables. A new counter or keep reason is one row.
//
// CKPT_OFFLOAD_COUNTERS(X): X(key, merge), one atomic counter each, zeroed by reset(). `merge`
// says how several contexts' values combine (handle.stats()): Sum, or Max for a peak.
#define CKPT_OFFLOAD_COUNTERS(X)                                                                \
  X(tensors_offloaded, Sum)                                                                     \
  X(bytes_offloaded, Sum)                                                                       \
  X(tensors_deduplicated, Sum)                                                                  \
  X(bytes_deduplicated, Sum)                                                                    \
  X(tensors_reloaded, Sum)                                                                      \
  X(bytes_reloaded, Sum)                                                                        \
  X(tensors_reload_shared, Sum)                                                                 \
  X(tensors_batched, Sum)                                                                       \
  X(batches, Sum)                                                                               \
  X(prefetches, Sum)                                                                            \
  X(bytes_prefetched, Sum)                                                                      \
  X(prefetch_hits, Sum)                                                                         \
  X(prefetches_unused, Sum)                                                                     \
  X(peak_prefetch_bytes, Max)                                                                   \
  /* prefetches that raised (e.g. out of device memory) */                                      \
  X(prefetch_failures, Sum)                                                                     \
  /* offloads the pool refused that went to its disk tier; reads started by prefetch */         \
  X(tensors_spilled, Sum)                                                                       \
  X(bytes_spilled, Sum)                                                                         \
  X(disk_prefetches, Sum)                                                                       \
  /* the most device bytes of saved activations (DeviceBytesHeld::total(), every context of */  \
  /* the process) seen right after this packer packed or unpacked a tensor: the moments that */ \
  /* count can rise for the tensors it handles (a kept tensor, a reload, the prefetches an */   \
  /* unpack starts) */                                                                          \
  X(device_saved_peak_bytes, Max)                                                               \
  /* bytes the host holds for offloaded tensors (bytes_offloaded: what exact storage would */   \
  /* hold), and the tensors stored narrower (Note [Low-precision storage]) */                   \
  X(bytes_stored, Sum)                                                                          \
  X(tensors_converted, Sum)

// CKPT_OFFLOAD_KEEP_REASONS(X): X(enumerator, name): why a saved tensor stayed where it was,
// counted per reason (kept_by_reason / kept_bytes_by_reason, every reason listed, zeros included).
#define CKPT_OFFLOAD_KEEP_REASONS(X)                                  \
  X(Parameter, "parameter")                                           \
  X(Buffer, "buffer")                                                 \
  X(TooSmall, "too_small")                                            \
  X(Device, "device")                                                 \
  X(Layout, "layout")                                                 \
  X(Subclass, "subclass")                                             \
  X(PoolFull, "pool_full")                                            \
  X(GraphCapture, "cuda_graph_capture")                               \
  X(DiskFull, "disk_full")                                            \
  X(AutocastCast, "autocast_cast")                                    \
  /* ZeroTensors, tensors without storage or data: nothing to copy */ \
  X(NoData, "no_data")

// The keys stats() adds that are not counters: totals over the keep reasons, the per-reason
// dicts (PerReason: a dict of sums), and the prefetch window backward used last (State: what
// the prefetcher has learned, not a count, so reset() leaves it; contexts merge it by Max).
#define CKPT_OFFLOAD_DERIVED_STATS(X)                                                        \
  X(tensors_kept, Sum)                                                                       \
  X(bytes_kept, Sum)                                                                         \
  X(kept_by_reason, PerReason)                                                               \
  X(kept_bytes_by_reason, PerReason)                                                         \
  X(prefetch_window_bytes, State)                                                            \
  X(prefetch_block_bytes, State)                                                             \
  X(prefetch_lead, State)                                                                    \
  /* Note [Low-precision storage]: the storage dtype's name (Name: None or one name), and */ \
  /* with measure_error the error per tensor class (ByClass: counts add, means weighted) */  \
  X(store_dtype, Name)                                                                       \
  X(store_error, ByClass)

// Every key of the two tables as a constant (stat_keys::tensors_kept is "tensors_kept"): the code
// that fills a derived key names it through the table, so a key the table lacks does not compile.
namespace stat_keys {
#define CKPT_OFFLOAD_STAT_KEY_CONSTANT(key, merge) inline constexpr char key[] = #key;
CKPT_OFFLOAD_COUNTERS(CKPT_OFFLOAD_STAT_KEY_CONSTANT)
CKPT_OFFLOAD_DERIVED_STATS(CKPT_OFFLOAD_STAT_KEY_CONSTANT)
#undef CKPT_OFFLOAD_STAT_KEY_CONSTANT
}  // namespace stat_keys

enum class KeepReason : int {
#define CKPT_OFFLOAD_KEEP_ENUM(e, name) e,
  CKPT_OFFLOAD_KEEP_REASONS(CKPT_OFFLOAD_KEEP_ENUM)
#undef CKPT_OFFLOAD_KEEP_ENUM
      kCount
};
const char* keep_reason_name(KeepReason r);

// How a key of stats() combines across contexts: "sum", "max", "per_reason" (a dict of sums
// by keep reason), or "state" (the largest; not zeroed by reset()).
struct StatKey {
  const char* name;
  const char* merge;
};
// Every key of Packer::stats(), in the dict's order.
const std::vector<StatKey>& stats_keys();

struct PackerCounters {
#define CKPT_OFFLOAD_COUNTER_FIELD(key, merge) std::atomic<int64_t> key{0};
  CKPT_OFFLOAD_COUNTERS(CKPT_OFFLOAD_COUNTER_FIELD)
#undef CKPT_OFFLOAD_COUNTER_FIELD
  std::array<std::atomic<int64_t>, static_cast<int>(KeepReason::kCount)> kept_tensors{};
  std::array<std::atomic<int64_t>, static_cast<int>(KeepReason::kCount)> kept_bytes{};

  void note_device_peak() noexcept {
    const int64_t now = DeviceBytesHeld::total();
    int64_t seen = device_saved_peak_bytes.load(std::memory_order_relaxed);
    while (now > seen && !device_saved_peak_bytes.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }

  // Back to zero (co.offload().reset_stats()), every counter of the table; counts racing with
  // it land on either side.
  void reset() {
#define CKPT_OFFLOAD_COUNTER_RESET(key, merge) key.store(0);
    CKPT_OFFLOAD_COUNTERS(CKPT_OFFLOAD_COUNTER_RESET)
#undef CKPT_OFFLOAD_COUNTER_RESET
    for (auto& c : kept_tensors) c.store(0);
    for (auto& c : kept_bytes) c.store(0);
  }
};

}  // namespace ckpt_offload

// What the saved-tensor hooks did, counted for Packer::stats(), and why tensors were kept.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <stdexcept>

#include "device_bytes.h"

namespace ckpt_offload {

// Raised by pack when the pool is at its cap and on_full="raise".
class PoolFull : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Why a saved tensor stayed where it was.
enum class KeepReason : int { Parameter = 0, Buffer, TooSmall, Device, Layout, Subclass, PoolFull, GraphCapture, DiskFull,
                        AutocastCast, NoData, kCount };
const char* keep_reason_name(KeepReason r);

struct PackerCounters {
  std::atomic<int64_t> tensors_offloaded{0}, bytes_offloaded{0};
  std::atomic<int64_t> tensors_deduplicated{0}, bytes_deduplicated{0};
  std::atomic<int64_t> tensors_reloaded{0}, bytes_reloaded{0};
  std::atomic<int64_t> tensors_reload_shared{0};
  std::atomic<int64_t> tensors_batched{0}, batches{0};
  std::atomic<int64_t> prefetches{0}, bytes_prefetched{0}, prefetch_hits{0}, prefetches_unused{0};
  std::atomic<int64_t> peak_prefetch_bytes{0};
  std::atomic<int64_t> prefetch_failures{0};  // prefetches that raised (e.g. out of device memory)
  // Offloads the pool refused that went to its disk tier; reads started by prefetch.
  std::atomic<int64_t> tensors_spilled{0}, bytes_spilled{0}, disk_prefetches{0};
  // The most device bytes of saved activations (DeviceBytesHeld::total(), every context of the
  // process) seen right after this packer packed or unpacked a tensor: the moments that count
  // can rise for the tensors it handles (a kept tensor, a reload, the prefetches an unpack starts).
  std::atomic<int64_t> device_saved_peak{0};
  std::array<std::atomic<int64_t>, static_cast<int>(KeepReason::kCount)> kept_tensors{};
  std::array<std::atomic<int64_t>, static_cast<int>(KeepReason::kCount)> kept_bytes{};

  void note_device_peak() noexcept {
    const int64_t now = DeviceBytesHeld::total();
    int64_t seen = device_saved_peak.load(std::memory_order_relaxed);
    while (now > seen && !device_saved_peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }

  // Back to zero (co.offload().reset_stats()); counts racing with it land on either side.
  void reset() {
    for (auto* c : {&tensors_offloaded, &bytes_offloaded, &tensors_deduplicated, &bytes_deduplicated,
                    &tensors_reloaded, &bytes_reloaded, &tensors_reload_shared, &tensors_batched, &batches,
                    &prefetches, &bytes_prefetched, &prefetch_hits, &prefetches_unused, &peak_prefetch_bytes,
                    &prefetch_failures, &device_saved_peak})
      c->store(0);
    for (auto& c : kept_tensors) c.store(0);
    for (auto& c : kept_bytes) c.store(0);
  }
};

}  // namespace ckpt_offload

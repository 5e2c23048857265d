// A pinned backend that, when the driver refuses page-locked memory, hands out pageable memory
// instead of failing, and says which host limit refused it (Note [Pinned fallback]).
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

#include "../core/host_pool.h"

namespace ckpt_offload {

struct PinnedFallbackStats {
  size_t segments = 0;  // segments taken as pageable memory since the pool was made
  size_t bytes = 0;     // pageable bytes the pool holds now
  std::string reason;   // the first refusal: the limit it names and its values
};

class FallbackBackend final : public Backend {
 public:
  explicit FallbackBackend(std::unique_ptr<Backend> pinned);
  void* allocate(size_t bytes) override;
  void release(void* ptr, size_t bytes) override;
  const char* name() const override { return pinned_->name(); }
  int numa_node() const override { return pinned_->numa_node(); }
  PinnedFallbackStats stats() const;
  // stats().segments without copying the reason: what every context exit asks.
  size_t segments() const;

 private:
  std::unique_ptr<Backend> pinned_;
  PageableBackend pageable_;
  mutable std::mutex mu_;
  std::unordered_set<void*> pageable_ptrs_;
  PinnedFallbackStats stats_;
};

// The host limit most likely to have refused `bytes` of page-locked memory, with its values:
// vm.max_map_count (mappings in use near the limit), RLIMIT_MEMLOCK (a finite lock limit), or
// the memory itself.
std::string diagnose_pinned_refusal(size_t bytes);

// Test seam: while `limit` is non-empty, pools made with a pinned backend get one that refuses
// every allocation as if `limit` ("vm.max_map_count" or "RLIMIT_MEMLOCK") were exhausted, on any
// build; empty restores the real backend.
void simulate_pinned_refusal(const std::string& limit);
// The backend make_pool uses for "pinned" / "registered": the device's, or the simulated one
// (on `numa_node` when >= 0).
std::unique_ptr<Backend> pinned_or_simulated_backend(const std::string& backend_name, int numa_node);

}  // namespace ckpt_offload

#include "prefetcher.h"

#include <algorithm>
#include <exception>
#include <vector>

namespace ckpt_offload {

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

void Prefetcher::after_unpack(uint64_t seq, const c10::Device& device) {
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
    if (r->device() != device) {  // another device's handle: its own backward fetches it
      release_outside.push_back(std::move(r));
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
      if (got > 0) started_.push_back(r);
      const int64_t now = outstanding_ += got;
      int64_t peak = counters_->peak_prefetch_bytes.load();
      while (now > peak && !counters_->peak_prefetch_bytes.compare_exchange_weak(peak, now)) {
      }
    }
    release_outside.push_back(std::move(r));
  }
}

void Prefetcher::drop_unused() {
  std::vector<std::weak_ptr<Reloadable>> started;
  {
    std::lock_guard<std::mutex> lock(mu_);
    started.swap(started_);
  }
  // Outside mu_: dropping takes the storages' (and batches') locks. Note [Lock order].
  for (auto& w : started)
    if (auto r = w.lock()) r->drop_prefetch();
}

}  // namespace ckpt_offload

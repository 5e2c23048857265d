#include "prefetcher.h"

#include <algorithm>
#include <exception>
#include <vector>

namespace ckpt_offload {

uint64_t Prefetcher::add(std::weak_ptr<Reloadable> r) {
  // Before mu_: the handle's own lock comes after the prefetcher's (Note [Lock order]), and
  // nothing here needs both.
  int64_t bytes = 0;
  if (auto alive = r.lock()) bytes = alive->prefetchable_bytes();
  std::lock_guard<std::mutex> lock(mu_);
  if (order_.size() >= prune_at_) {
    for (auto it = order_.begin(); it != order_.end();) it = it->second.r.expired() ? order_.erase(it) : std::next(it);
    prune_at_ = std::max<size_t>(1024, 2 * order_.size());
  }
  const uint64_t seq = next_++;
  order_.emplace(seq, Entry{std::move(r), bytes, block_});
  return seq;
}

void Prefetcher::mark_block() {
  std::lock_guard<std::mutex> lock(mu_);
  ++block_;
}

void Prefetcher::note_unpack(bool waited) {
  std::lock_guard<std::mutex> lock(mu_);
  ++unpacks_;
  if (waited) ++waits_;
}

int64_t Prefetcher::compute_window_locked(uint64_t seq) {
  // The forward this backward differentiates: the live handles packed up to `seq`, newest
  // last. Bounded, so that a huge step costs a bounded scan once per backward.
  constexpr size_t kMaxEntries = 2048;
  std::vector<int64_t> sizes;
  std::vector<uint64_t> blocks;
  for (auto it = order_.upper_bound(seq); it != order_.begin() && sizes.size() < kMaxEntries;) {
    --it;
    if (it->second.r.expired() || it->second.bytes <= 0) continue;
    sizes.push_back(it->second.bytes);
    blocks.push_back(it->second.block);
  }
  std::reverse(sizes.begin(), sizes.end());
  std::reverse(blocks.begin(), blocks.end());
  const size_t n = sizes.size();
  int64_t block = 0;
  if (n > 0 && blocks.front() != blocks.back()) {
    // Marked blocks (one activation of the context each): the largest one.
    int64_t sum = 0;
    for (size_t i = 0; i < n; ++i) {
      if (i > 0 && blocks[i] != blocks[i - 1]) sum = 0;
      sum += sizes[i];
      block = std::max(block, sum);
    }
  } else if (n > 0) {
    // One activation: the shortest period p of the sizes that repeats at least twice and
    // explains three quarters of the sequence (embeddings and the head break an exact one).
    size_t period = 0;
    for (size_t p = 1; 2 * p <= n && !period; ++p) {
      size_t same = 0;
      for (size_t i = 0; i + p < n; ++i) same += sizes[i] == sizes[i + p];
      if (4 * same >= 3 * (n - p)) period = p;
    }
    int64_t total = 0;
    for (int64_t b : sizes) total += b;
    if (period) {
      int64_t sum = 0;
      for (size_t i = 0; i < n; ++i) {
        sum += sizes[i];
        if (i >= period) sum -= sizes[i - period];
        block = std::max(block, sum);
      }
    } else {
      block = (total + 3) / 4;
    }
  }
  block_bytes_ = block;
  const int64_t want = block * lead_.load();
  return std::min(budget_, std::max<int64_t>(want, 0));
}

void Prefetcher::after_unpack(uint64_t seq, const c10::Device& device) {
  // Backward needs the handles packed just before this one next: walk down from it.
  constexpr int kMaxScan = 64;
  std::vector<std::shared_ptr<Reloadable>> release_outside;  // destroyed after the lock
  std::lock_guard<std::mutex> lock(mu_);
  int64_t budget = budget_;
  if (auto_) {
    if (!in_backward_) {
      in_backward_ = true;
      window_ = compute_window_locked(seq);
    }
    budget = window_.load();
  }
  auto it = order_.lower_bound(seq);
  int scanned = 0;
  while (it != order_.begin() && scanned < kMaxScan) {
    --it;
    ++scanned;
    auto r = it->second.r.lock();
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
      // Auto mode: one reload may always be in flight, or a block larger than its estimate
      // (or a single tensor larger than the window) would never be prefetched.
      const int64_t out = outstanding_.load();
      if (out + want > budget && !(auto_ && out == 0)) break;
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
    if (auto_ && in_backward_) {
      // The first unpack of a backward always waits (nothing was ahead of it): not a signal.
      const int64_t waits = std::max<int64_t>(0, waits_ - 1);
      if (unpacks_ > 1 && 20 * waits > unpacks_) {
        lead_ = std::min(kMaxLead, 2 * lead_.load());
      } else if (waits == 0 && lead_.load() > 1) {
        lead_ = lead_.load() - 1;
      }
    }
    in_backward_ = false;
    unpacks_ = waits_ = 0;
  }
  // Outside mu_: dropping takes the storages' (and batches') locks. Note [Lock order].
  for (auto& w : started)
    if (auto r = w.lock()) r->drop_prefetch();
}

}  // namespace ckpt_offload

#include "spill.h"

#include <new>
#include <unordered_map>
#include <vector>

#include "profiler.h"

namespace ckpt_offload {

SpillTarget::SpillTarget(std::shared_ptr<FileTier> tier, std::shared_ptr<HostPool> staging, size_t staging_bytes)
    : tier_(std::move(tier)), staging_(std::move(staging)), staging_bytes_(staging_bytes) {
  if (!tier_ || !staging_) throw std::invalid_argument("ckpt_offload: SpillTarget needs a tier and a staging pool");
}

void SpillTarget::throttle() {
  // Note [Fork] (csrc/torch/runtime.cpp): a child's writes are refused; the parent's it inherited never end there.
  if (tier_->forked()) return;
  for (;;) {
    std::shared_ptr<FileTier::Ticket> oldest;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (!writes_.empty() && writes_.front()->query()) writes_.pop_front();
      if (writes_.empty() || staging_->stats().bytes_in_use <= staging_bytes_) return;
      oldest = writes_.front();
    }
    const int64_t t0 = profiler::now_ns();
    try {
      oldest->wait();
    } catch (const FileTierError&) {
      // Reported to whoever reads the block back; here it only had to finish.
    }
    throttle_stalls++;
    throttle_stall_ns += profiler::now_ns() - t0;
  }
}

std::shared_ptr<TieredBuffer> SpillTarget::spill(std::shared_ptr<HostBuffer> staged,
                                                 const std::shared_ptr<HostPool>& pool, uint64_t handle) {
  const size_t n = staged->nbytes();
  void* src = staged->data();
  auto after = staged->ready();
  // The tier holds the staging block until it is on disk, then lets it go (Note [Spill ordering]).
  auto spill = tier_->write(src, n, std::move(staged), std::move(after), handle);
  if (!spill) {
    blocks_refused++;
    return nullptr;
  }
  blocks_spilled++;
  bytes_spilled += n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writes_.push_back(spill->written());
  }
  return std::make_shared<TieredBuffer>(shared_from_this(), std::move(spill), pool, n);
}

namespace {

struct Registry {
  std::mutex mu;
  struct Entry {
    std::weak_ptr<HostPool> pool;
    std::weak_ptr<SpillTarget> target;
  };
  std::unordered_map<const HostPool*, Entry> entries;

  void prune_locked() {
    // A dead pool's entry would hand its tier to a new pool allocated at the same address.
    for (auto it = entries.begin(); it != entries.end();)
      it = it->second.pool.expired() || it->second.target.expired() ? entries.erase(it) : std::next(it);
  }
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked: pools may die during interpreter teardown
  return *r;
}

}  // namespace

void attach_spill(const std::shared_ptr<HostPool>& pool, std::shared_ptr<SpillTarget> target) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.prune_locked();
  if (target) {
    r.entries[pool.get()] = Registry::Entry{pool, std::move(target)};
  } else {
    r.entries.erase(pool.get());
  }
}

void synchronize_spill_targets() {
  std::vector<std::shared_ptr<SpillTarget>> targets;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto& e : r.entries)
      if (auto t = e.second.target.lock()) targets.push_back(std::move(t));
  }
  for (auto& t : targets) t->tier()->synchronize();
}

std::shared_ptr<SpillTarget> spill_target(const HostPool* pool) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(pool);
  if (it == r.entries.end()) return nullptr;
  auto target = it->second.target.lock();
  if (it->second.pool.expired() || !target) {
    r.entries.erase(it);
    return nullptr;
  }
  return target;
}

TieredBuffer::TieredBuffer(std::shared_ptr<HostBuffer> resident)
    : resident_(std::move(resident)), pool_(resident_->pool()), nbytes_(resident_->nbytes()) {}

TieredBuffer::TieredBuffer(std::shared_ptr<SpillTarget> target, std::shared_ptr<FileTier::Spill> spill,
                           std::shared_ptr<HostPool> pool, size_t nbytes)
    : target_(std::move(target)), spill_(std::move(spill)), pool_(std::move(pool)), nbytes_(nbytes) {}

void TieredBuffer::start_read_locked(bool prefetch) {
  if (!spill_ || read_) return;
  // Into the pool when it has room (it is the memory meant for this), else staging memory.
  std::shared_ptr<HostPool> into = pool_;
  HostPool::Block* block = pool_->allocate(nbytes_);
  if (!block) {
    into = target_->staging();
    block = into->allocate(nbytes_);
  }
  if (!block) throw std::bad_alloc();
  readback_ = std::make_shared<HostBuffer>(into, block, nbytes_);
  read_ = target_->tier()->read(spill_, readback_->data(), readback_, prefetch);
}

void TieredBuffer::start_read(bool prefetch) {
  std::lock_guard<std::mutex> lock(mu_);
  start_read_locked(prefetch);
}

bool TieredBuffer::reading() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<bool>(read_);
}

std::shared_ptr<HostBuffer> TieredBuffer::host() {
  if (!spill_) return resident_;
  std::shared_ptr<HostBuffer> buf;
  std::shared_ptr<FileTier::Ticket> read;
  {
    std::lock_guard<std::mutex> lock(mu_);
    start_read_locked(false);
    buf = readback_;
    read = read_;
  }
  read->wait();  // outside the lock: another thread may prefetch or release meanwhile
  return buf;
}

void TieredBuffer::release_host() {
  std::lock_guard<std::mutex> lock(mu_);
  // A read still running keeps its block (the ticket's keepalive) until it ends.
  readback_.reset();
  read_.reset();
}

std::shared_ptr<TieredBuffer> offload_spilled(
    const std::shared_ptr<HostPool>& pool, uint64_t handle,
    const std::function<std::shared_ptr<HostBuffer>(const std::shared_ptr<HostPool>&)>& copy_into, TieredRefusal* why) {
  auto target = spill_target(pool.get());
  if (!target) {
    *why = TieredRefusal::PoolFull;
    return nullptr;
  }
  // Note [Fork] (csrc/torch/runtime.cpp): in a fork child the tier refuses every write, and its
  // staging pool may be locked for good -- by one of the parent's I/O threads, freeing a
  // written block as the fork happened, which does not exist here. So refuse before touching it.
  target->tier()->check_process("a spill write");
  target->throttle();
  auto staged = copy_into(target->staging());
  if (!staged) {
    *why = TieredRefusal::PoolFull;  // the backend itself refused staging memory
    return nullptr;
  }
  auto tiered = target->spill(std::move(staged), pool, handle);
  if (!tiered) *why = TieredRefusal::DiskFull;
  return tiered;
}

}  // namespace ckpt_offload

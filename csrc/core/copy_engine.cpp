#include "copy_engine.h"

#include <algorithm>

namespace ckpt_offload {

HostBuffer::HostBuffer(std::shared_ptr<HostPool> pool, HostPool::Block* block, size_t nbytes)
    : pool_(std::move(pool)), block_(block), nbytes_(nbytes) {}

HostBuffer::~HostBuffer() {
  std::vector<std::shared_ptr<Event>> pending = std::move(readers_);
  if (ready_) pending.push_back(std::move(ready_));
  pool_->free(block_, std::move(pending));
}

std::shared_ptr<Event> HostBuffer::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
}

void HostBuffer::set_ready(std::shared_ptr<Event> ev) {
  std::lock_guard<std::mutex> lock(mu_);
  ready_ = std::move(ev);
}

void HostBuffer::add_reader(std::shared_ptr<Event> ev) {
  std::lock_guard<std::mutex> lock(mu_);
  // Drop finished readers so a buffer reloaded many times (retain_graph) stays small.
  readers_.erase(std::remove_if(readers_.begin(), readers_.end(),
                                [](const std::shared_ptr<Event>& e) { return e->query(); }),
                 readers_.end());
  readers_.push_back(std::move(ev));
}

std::shared_ptr<HostBuffer> CopyEngine::offload(const std::shared_ptr<HostPool>& pool, const void* src,
                                                size_t bytes, Stream& compute, Stream& copy,
                                                std::shared_ptr<void> keepalive) {
  poll();
  HostPool::Block* block = pool->allocate(bytes);
  if (!block) return nullptr;
  auto buf = std::make_shared<HostBuffer>(pool, block, bytes);
  if (&copy != &compute) {
    // The side stream must not read the source before the compute stream has written it.
    copy.wait(compute.record());
  }
  copy.memcpy(buf->data(), src, bytes, CopyKind::DeviceToHost);
  auto done = copy.record();
  buf->set_ready(done);
  // The source's memory may be reused by its allocator as soon as its tensor dies; hold
  // the tensor until the copy has read it.
  if (!done->query()) hold(copy.id(), done, std::move(keepalive));
  return buf;
}

std::shared_ptr<Event> CopyEngine::reload(HostBuffer& buf, void* dst, Stream& compute, Stream& copy) {
  poll();
  if (&copy != &compute) {
    // dst was allocated in compute order: its previous user may still be running there.
    copy.wait(compute.record());
  }
  // The host bytes are valid only once the offload copy has finished.
  copy.wait(buf.ready());
  copy.memcpy(dst, buf.data(), buf.nbytes(), CopyKind::HostToDevice);
  auto done = copy.record();
  buf.add_reader(done);
  // The consumer runs on the compute stream: it must not read dst before the copy ends.
  if (&copy != &compute) compute.wait(done);
  return done;
}

void CopyEngine::hold(uintptr_t stream_id, std::shared_ptr<Event> done, std::shared_ptr<void> keepalive) {
  std::lock_guard<std::mutex> lock(mu_);
  held_[stream_id].push_back({std::move(done), std::move(keepalive)});
  ++num_held_;
}

void CopyEngine::poll() {
  std::vector<std::shared_ptr<void>> release;  // destroyed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (num_held_ == 0) return;
    for (auto& kv : held_) {
      auto& q = kv.second;
      while (!q.empty() && q.front().done->query()) {
        release.push_back(std::move(q.front().keepalive));
        q.pop_front();
        --num_held_;
      }
    }
  }
}

void CopyEngine::synchronize() {
  std::vector<Held> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : held_)
      for (auto& h : kv.second) all.push_back(std::move(h));
    held_.clear();
    num_held_ = 0;
  }
  for (auto& h : all) h.done->synchronize();
}

size_t CopyEngine::num_keepalives() {
  std::lock_guard<std::mutex> lock(mu_);
  return num_held_;
}

}  // namespace ckpt_offload

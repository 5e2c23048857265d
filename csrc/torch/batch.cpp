// Batching: many small saved tensors copied as one (the Batch of offloaded_storage.h).
#include "offloaded_storage.h"

#include "../core/profiler.h"
#include "device_memory.h"
#include "runtime.h"
#include "tensor_layout.h"

namespace ckpt_offload {

Batch::Batch(c10::Device device, bool side_stream, std::shared_ptr<HostPool> pool,
             std::shared_ptr<PackerCounters> counters, std::shared_ptr<Prefetcher> prefetcher)
    : device_(device),
      side_stream_(side_stream),
      pool_(std::move(pool)),
      counters_(std::move(counters)),
      handle_(profiler::next_handle_id()),
      prefetcher_(std::move(prefetcher)) {}

Batch::~Batch() {
  try {  // Note [No throw on teardown] (core/stream.h)
    drop_disk_prefetch_locked();
  } catch (...) {
  }
}

void Batch::drop_disk_prefetch_locked() {
  if (!disk_prefetch_bytes_) return;
  buffer_->release_host();
  if (prefetcher_) prefetcher_->release(disk_prefetch_bytes_);
  disk_prefetch_bytes_ = 0;
  counters_->prefetches_unused++;
}

std::shared_ptr<OffloadedStorage> Batch::add(const at::Tensor& t, int64_t lo, int64_t span,
                                             const CurrentStream& current) {
  DeviceScope scope(device_);
  std::lock_guard<std::mutex> lock(mu_);
  if (flushed_) return nullptr;
  c10::Storage source = t.storage();
  int64_t source_lo = lo;
  if (source.nbytes() > 2 * static_cast<size_t>(span) + kCopyOutSlack) {
    // A small view of a large activation: holding its storage until the flush would keep the
    // whole activation alive. Copy the member's bytes out (in stream order, on the producing
    // stream) and hold only those; the address keeps its value mod 16 for the gather.
    const int64_t head = lo % 16;
    at::Tensor piece = device_bytes(device_, static_cast<size_t>(head + span));
    at::Tensor whole = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device_));
    whole.set_(source, 0, {static_cast<int64_t>(source.nbytes())}, {1});
    piece.narrow(0, head, span).copy_(whole.narrow(0, lo, span));
    source = piece.storage();
    source_lo = head;
  }
  // Note [Stream ordering] rule 1: the gather runs at flush, after whatever stream is current
  // then; it must also wait for the stream that produced this member (a layer run under
  // torch.cuda.stream(s)). The latest event of each producing stream covers its members so far.
  StreamPair streams(current, /*side=*/false, /*to_host=*/true);
  producers_[streams.compute().id()] = streams.compute().record();
  const char* src = static_cast<const char*>(source.data()) + source_lo;
  // Each member starts at its source's address mod 16, so the kernel moves 16 bytes at a time
  // both ways (the reload destination keeps that alignment too: its pad is lo mod 512).
  const size_t offset = (block_bytes_ + 15) / 16 * 16 + reinterpret_cast<uintptr_t>(src) % 16;
  const size_t pad = static_cast<size_t>(lo) % OffloadedStorage::kReloadAlignment;
  auto member = std::make_shared<OffloadedStorage>(shared_from_this(), device_, lo, pad, static_cast<size_t>(span),
                                                   side_stream_, counters_);
  Member m;
  m.storage = member;
  m.source = tracked_keepalive(source, span);
  m.src = src;
  m.lo = static_cast<size_t>(source_lo);
  m.offset = offset;
  m.bytes = static_cast<size_t>(span);
  m.pad = pad;
  members_.push_back(std::move(m));
  block_bytes_ = offset + static_cast<size_t>(span);
  return member;
}

bool Batch::flushed() {
  std::lock_guard<std::mutex> lock(mu_);
  return flushed_;
}

bool Batch::flush() {
  std::vector<std::shared_ptr<OffloadedStorage>> alive;
  bool ok = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (flushed_) return true;
    flushed_ = true;
    if (members_.empty()) return true;
    DeviceScope scope(device_);
    StreamPair streams(device_, side_stream_, /*to_host=*/true);
    std::vector<std::shared_ptr<Event>> producers;
    for (auto& kv : producers_) producers.push_back(kv.second);
    producers_.clear();
    CopyRange range(copy_ranges::kOffloadBatch, device_);
    std::vector<BatchSpan> spans;
    auto sources = std::make_shared<std::vector<std::shared_ptr<void>>>();
    for (Member& m : members_) {
      spans.push_back({const_cast<char*>(m.src), m.offset, m.bytes});
      sources->push_back(m.source);
    }
    at::Tensor staging = staging_block(device_, block_bytes_);
    std::shared_ptr<void> keepalive(new std::pair<decltype(sources), at::Tensor>(sources, staging), [](void* p) {
      delete static_cast<std::pair<std::shared_ptr<std::vector<std::shared_ptr<void>>>, at::Tensor>*>(p);
    });
    sources.reset();
    CopyTag tag{handle_, device_index(device_), false, static_cast<int>(members_.size())};
    // Into the pool; when it is at its cap, through staging memory to its disk tier, if any.
    buffer_ = offload_tiered(
        pool_, handle_,
        [&](const std::shared_ptr<HostPool>& into) {
          return engine().offload_gather(into, spans, block_bytes_, staging.defined() ? staging.data_ptr() : nullptr,
                                         streams.compute(), streams.copy(), keepalive, tag, producers);
        },
        &refusal_);
    keepalive.reset();
    if (buffer_) {
      counters_->batches++;
      if (buffer_->spilled()) {
        counters_->tensors_spilled += static_cast<int64_t>(members_.size());
        counters_->bytes_spilled += static_cast<int64_t>(block_bytes_);
      }
      if (profiler::enabled()) {
        profiler::HandleRecord h;
        h.handle = handle_;
        h.bytes = block_bytes_;
        h.device = device_index(device_);
        h.dtype = "batch";
        h.module = profiler::scope();
        h.members = static_cast<int>(members_.size());
        profiler::add(std::move(h));
      }
      for (Member& m : members_) m.source.reset();  // the engine holds them until the copy has read them
    } else {
      ok = false;
      // The pool is full: give every member a device copy of its own in the reload layout, so
      // the saved tensors still come back, and count them as kept. The copies run on the
      // current stream: after the members' producers (rule 1), and the sources are held until
      // the copies have read them (they may belong to another stream's allocations).
      for (auto& ev : producers) streams.compute().wait(ev);
      auto sources_read = std::make_shared<std::vector<std::shared_ptr<void>>>();
      for (Member& m : members_) {
        auto member = m.storage.lock();
        if (member) {
          const c10::Storage& src_storage = *static_cast<c10::Storage*>(m.source.get());
          at::Tensor whole = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device_));
          whole.set_(src_storage, 0, {static_cast<int64_t>(src_storage.nbytes())}, {1});
          at::Tensor copy = device_bytes(device_, m.pad + m.bytes);
          copy.narrow(0, static_cast<int64_t>(m.pad), static_cast<int64_t>(m.bytes))
              .copy_(whole.narrow(0, static_cast<int64_t>(m.lo), static_cast<int64_t>(m.bytes)));
          member->keep_on_device(copy.storage());
        }
        counters_->tensors_offloaded--;
        counters_->bytes_offloaded -= static_cast<int64_t>(m.bytes);
        counters_->bytes_stored -= static_cast<int64_t>(m.bytes);
        counters_->tensors_batched--;
        const int why =
            static_cast<int>(refusal_ == TieredRefusal::DiskFull ? KeepReason::DiskFull : KeepReason::PoolFull);
        counters_->kept_tensors[why]++;
        counters_->kept_bytes[why] += static_cast<int64_t>(m.bytes);
        sources_read->push_back(std::move(m.source));
      }
      engine().keep_until(streams.compute(), streams.compute().record(), std::move(sources_read));
    }
    if (buffer_ && prefetcher_)
      for (Member& m : members_)
        if (auto member = m.storage.lock()) alive.push_back(std::move(member));
  }
  if (!alive.empty()) {
    // Outside the batch's lock: the prefetcher locks itself, then batches (after_unpack).
    // See Note [Lock order] (packer.h).
    seq_ = prefetcher_->add(weak_from_this());
    for (auto& member : alive) member->set_order(prefetcher_, seq_);
  }
  return ok;
}

int64_t Batch::prefetchable_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!buffer_ || !side_stream_ || disk_prefetch_bytes_) return 0;
  int64_t total = 0;
  for (Member& m : members_) {
    auto member = m.storage.lock();
    if (!member) continue;
    if (member->wants_reload(/*prefetch=*/true)) total += static_cast<int64_t>(m.bytes);
  }
  return total;
}

void Batch::drop_prefetch() {
  std::lock_guard<std::mutex> lock(mu_);  // then each member's (Note [Lock order])
  for (Member& m : members_)
    if (auto member = m.storage.lock()) member->drop_prefetch();
  drop_disk_prefetch_locked();
}

int64_t Batch::reload(bool prefetch) {
  DeviceScope scope(device_);
  std::lock_guard<std::mutex> lock(mu_);
  if (!buffer_) return 0;
  if (prefetch && !side_stream_) return 0;
  if (buffer_->spilled() && prefetch) {
    // As OffloadedStorage::start_prefetch: only the disk read starts now, no device memory.
    if (disk_prefetch_bytes_) return 0;
    int64_t want = 0;
    for (Member& m : members_)
      if (auto member = m.storage.lock())
        if (member->wants_reload(/*prefetch=*/true)) want += static_cast<int64_t>(m.bytes);
    if (want == 0) return 0;
    maybe_fail_prefetch();
    buffer_->start_read(/*prefetch=*/true);
    disk_prefetch_bytes_ = want;
    counters_->disk_prefetches++;
    return want;
  }
  struct Target {
    std::shared_ptr<OffloadedStorage> member;
    c10::Storage storage;
  };
  std::vector<Target> targets;
  std::vector<BatchSpan> spans;
  for (Member& m : members_) {
    auto member = m.storage.lock();
    if (!member) continue;
    if (!member->wants_reload(prefetch)) continue;
    // Allocated on the compute stream, which consumes them; the copy stream waits for them.
    at::Tensor bytes = device_bytes(device_, m.pad + m.bytes);
    spans.push_back({static_cast<char*>(bytes.data_ptr()) + m.pad, m.offset, m.bytes});
    targets.push_back({std::move(member), bytes.storage()});
  }
  if (targets.empty()) return 0;
  if (prefetch) maybe_fail_prefetch();
  // A spilled batch is read back first (waiting for the disk; SpillError on a bad checksum).
  std::shared_ptr<HostBuffer> host = buffer_->host();
  // A demand reload (backward waits for it) never queues behind prefetches (rule 4).
  StreamPair streams(device_, side_stream_, /*to_host=*/false, /*demand=*/!prefetch);
  CopyRange range(prefetch ? copy_ranges::kPrefetchBatch : copy_ranges::kReloadBatch, device_);
  at::Tensor staging = staging_block(device_, block_bytes_);
  CopyTag tag{handle_, device_index(device_), prefetch, static_cast<int>(targets.size())};
  auto done = engine().reload_scatter(*host, spans, staging.defined() ? staging.data_ptr() : nullptr, streams.compute(),
                                      streams.copy(), nullptr, /*consumer_waits=*/!prefetch, tag);
  if (buffer_->spilled()) {
    host.reset();
    buffer_->release_host();  // the disk keeps the bytes; the host block goes after the copy
    if (disk_prefetch_bytes_) {
      if (prefetcher_) prefetcher_->release(disk_prefetch_bytes_);
      disk_prefetch_bytes_ = 0;
      counters_->prefetch_hits++;
    }
  }
  // The staging block goes back to the allocator now, with record_stream on the copy stream:
  // not held until a later poll (the next offload), which could be after backward ended.
  if (staging.defined()) release_after_copy(staging.storage(), &streams.copy(), done);
  int64_t staged = 0, count = 0;
  for (Target& t : targets) {
    const size_t nbytes = t.member->nbytes();
    if (t.member->stage(
            OffloadedStorage::Staged{std::move(t.storage), done, prefetch ? &streams.copy() : nullptr, prefetch}) &&
        prefetch) {
      staged += static_cast<int64_t>(nbytes);
      ++count;
    }
  }
  if (prefetch) {
    counters_->prefetches += count;
    counters_->bytes_prefetched += staged;
  }
  return staged;
}

}  // namespace ckpt_offload

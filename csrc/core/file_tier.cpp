#include "file_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "file_tier_core.h"
#include "profiler.h"

namespace ckpt_offload {

// --- FileTier -----------------------------------------------------------------------------

std::shared_ptr<FileTier> FileTier::create(FileTierOptions o) {
  if (o.dir.empty()) throw std::invalid_argument("ckpt_offload: spill_dir must name a directory, got ''");
  struct stat st;
  if (::stat(o.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw std::invalid_argument("ckpt_offload: spill_dir=" + o.dir +
                                " is not an existing directory; create it (on a local disk) first");
  if (::access(o.dir.c_str(), W_OK | X_OK) != 0)
    throw std::invalid_argument("ckpt_offload: spill_dir=" + o.dir + " is not writable by this process");
  if (o.io_threads < 1 || o.io_threads > 64)
    throw std::invalid_argument("ckpt_offload: io_threads must be in [1, 64], got " + std::to_string(o.io_threads));
  if (o.chunk_bytes == 0 || o.chunk_bytes % kFileAlignment || o.chunk_bytes > (size_t(1) << 30))
    throw std::invalid_argument("ckpt_offload: chunk_bytes must be a positive multiple of " +
                                std::to_string(kFileAlignment) + " up to 1 GiB, got " + std::to_string(o.chunk_bytes));
  if (o.file_bytes == 0) throw std::invalid_argument("ckpt_offload: file_bytes must be positive");
  o.file_bytes = (o.file_bytes + kFileAlignment - 1) / kFileAlignment * kFileAlignment;
  // Rounded down to whole file pages; a cap below one page would round to 0, which means
  // "no cap": refused instead.
  if (o.max_bytes != 0 && o.max_bytes < kFileAlignment)
    throw std::invalid_argument("ckpt_offload: spill_max_bytes=" + std::to_string(o.max_bytes) +
                                " is below the disk tier's minimum of " + std::to_string(kFileAlignment) +
                                " bytes (one file page, the least a spilled block takes); pass spill_max_bytes >= " +
                                std::to_string(kFileAlignment) + ", or None for what the disk has");
  o.max_bytes = o.max_bytes / kFileAlignment * kFileAlignment;
  auto core = std::make_shared<Core>(std::move(o));
  core->stats.max_bytes = core->options.max_bytes;
  std::shared_ptr<FileTier> tier(new FileTier(core));
  return tier;
}

FileTier::FileTier(std::shared_ptr<Core> core) : core_(std::move(core)) {
  try {
    // Each thread holds the core: if this object is ever destroyed on one of its own threads
    // (a keepalive that owned the tier), the threads outlive it safely (see ~FileTier).
    for (int i = 0; i < core_->options.io_threads; ++i) threads_.emplace_back([core = core_] { core->worker(); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(core_->qmu);
      core_->stop = true;
    }
    core_->qcv.notify_all();
    for (auto& t : threads_) t.join();
    throw;
  }
}

void FileTier::Core::check_process(const char* what) const {
  if (!forked()) return;
  throw FileTierError(
      "ckpt_offload: " + std::string(what) + " in process " + std::to_string(::getpid()) +
      " with a disk tier (spill_dir=" + options.dir + ") made in process " + std::to_string(pid) +
      " before it forked: a forked child has none of its I/O threads and shares its spill files "
      "with the parent, so it cannot spill to it or read from it. Make a new co.HostPool(spill_dir=...) "
      "in the child (or use the 'spawn' start method).");
}

FileTier::~FileTier() {
  if (core_->forked()) {
    // Note [Fork]: the threads do not exist in this process; joining them would wait forever.
    // Their std::thread objects are leaked (destroying a joinable one terminates).
    new std::vector<std::thread>(std::move(threads_));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(core_->qmu);
    core_->stop = true;
  }
  core_->qcv.notify_all();
  const auto self = std::this_thread::get_id();
  const bool on_worker =
      std::any_of(threads_.begin(), threads_.end(), [&](const std::thread& t) { return t.get_id() == self; });
  for (auto& t : threads_) {
    // Workers drain the queue before they stop. A worker cannot join itself: then all are
    // detached, each keeping the core (files, queue) alive until it has finished.
    if (on_worker) {
      t.detach();
    } else {
      t.join();
    }
  }
}

std::shared_ptr<FileTier::Spill> FileTier::write(const void* src, size_t bytes, std::shared_ptr<void> keepalive,
                                                 std::shared_ptr<Event> after, uint64_t handle) {
  core_->check_process("a spill write");
  if (bytes > std::numeric_limits<size_t>::max() / 2) return nullptr;
  auto state = std::make_shared<SpillState>();
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    BlockAllocator::Range r;
    if (!core_->alloc.allocate(bytes, &r)) {
      if (!core_->grow_locked(core_->alloc.round(std::max<size_t>(bytes, 1))) || !core_->alloc.allocate(bytes, &r))
        return nullptr;
    }
    state->range = r;
    state->file = r.region;
    auto& st = core_->stats;
    st.bytes_in_use += r.size;
    st.bytes_requested += bytes;
    st.num_blocks_in_use++;
    st.peak_bytes_in_use = std::max(st.peak_bytes_in_use, st.bytes_in_use);
  }
  state->nbytes = bytes;
  state->handle = handle;
  state->crcs.assign(core_->nchunks(bytes), 0);
  state->inflight = 1;
  auto t = std::make_shared<Ticket>();
  t->core_ = core_;
  t->spill_ = state;
  t->write_ = true;
  t->user_ = const_cast<char*>(static_cast<const char*>(src));  // only read from
  t->bytes_ = bytes;
  t->handle_ = handle;
  t->keepalive_ = std::move(keepalive);
  t->after_ = std::move(after);
  t->remaining_ = core_->nchunks(bytes);
  std::shared_ptr<Spill> spill(new Spill(shared_from_this(), state));
  spill->write_ = t;
  core_->enqueue(t);
  return spill;
}

std::shared_ptr<FileTier::Ticket> FileTier::read(const std::shared_ptr<Spill>& spill, void* dst,
                                                 std::shared_ptr<void> keepalive, bool prefetch) {
  if (!spill) throw std::invalid_argument("ckpt_offload: FileTier::read of a null spill");
  core_->check_process("a spill read");
  if (spill->tier_.get() != this) throw std::invalid_argument("ckpt_offload: FileTier::read of another tier's spill");
  auto& state = spill->state_;
  auto t = std::make_shared<Ticket>();
  t->core_ = core_;
  t->spill_ = state;
  t->prefetch_ = prefetch;
  t->user_ = static_cast<char*>(dst);
  t->bytes_ = state->nbytes;
  t->handle_ = state->handle;
  t->keepalive_ = std::move(keepalive);
  t->remaining_ = core_->nchunks(state->nbytes);
  if (prefetch) {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->stats.reads_prefetch++;
  }
  std::string write_error;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->inflight++;
    if (!state->written) {
      // Note [Spill ordering]: starts when the write ends (Core::finish enqueues it).
      state->after_write.push_back(t);
      return t;
    }
    write_error = state->write_error;
  }
  if (write_error.empty()) {
    core_->enqueue(t);
  } else {
    {
      std::lock_guard<std::mutex> lock(t->mu_);
      t->error_ = write_error;
    }
    core_->finish(t);
  }
  return t;
}

FileTierStats FileTier::stats() {
  std::lock_guard<std::mutex> lock(core_->mu);
  FileTierStats s = core_->stats;
  // Include the time of the I/O running now, so bandwidth is right while a long write runs.
  const int64_t t = profiler::now_ns();
  if (core_->active[1]) s.write_busy_ns += t - core_->busy_since[1];
  if (core_->active[0]) s.read_busy_ns += t - core_->busy_since[0];
  return s;
}

void FileTier::reset_peak() {
  std::lock_guard<std::mutex> lock(core_->mu);
  core_->stats.reset_peaks();
}

size_t FileTier::reserve(size_t bytes) {
  core_->check_process("reserving spill space");
  if (bytes == 0 || bytes > std::numeric_limits<size_t>::max() / 2) return 0;
  std::lock_guard<std::mutex> lock(core_->mu);
  const size_t before = core_->stats.bytes_reserved;
  const size_t saved = core_->options.file_bytes;
  core_->options.file_bytes = core_->alloc.round(bytes);  // a file of exactly this size
  bool ok = false;
  try {
    ok = core_->grow_locked(core_->alloc.round(bytes));
  } catch (...) {
    core_->options.file_bytes = saved;
    throw;
  }
  core_->options.file_bytes = saved;
  return ok ? core_->stats.bytes_reserved - before : 0;
}

size_t FileTier::empty_cache() {
  if (core_->forked()) return 0;  // the files are the parent's too
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->close_free_files_locked();
}

void FileTier::synchronize() {
  if (core_->forked()) return;  // Note [Fork]: nothing of this process is queued on it
  std::unique_lock<std::mutex> lock(core_->qmu);
  core_->idle_cv.wait(lock, [&] { return core_->queue.empty() && core_->running == 0; });
}

const FileTierOptions& FileTier::options() const { return core_->options; }

bool FileTier::forked() const { return core_->forked(); }

void FileTier::check_process(const char* what) const { core_->check_process(what); }

std::vector<FileTier::FileInfo> FileTier::files() {
  std::lock_guard<std::mutex> lock(core_->mu);
  std::vector<FileInfo> out;
  for (auto& f : core_->files)
    if (f)
      out.push_back(FileInfo{f->fd, f->path, "/proc/self/fd/" + std::to_string(f->fd), f->bytes, f->direct.load()});
  return out;
}

bool FileTier::check_invariants(std::string* why) {
  std::lock_guard<std::mutex> lock(core_->mu);
  std::string e;
  core_->alloc.check_invariants(&e);
  size_t reserved = 0, open = 0;
  for (auto& f : core_->files)
    if (f) {
      reserved += f->bytes;
      ++open;
    }
  if (reserved != core_->stats.bytes_reserved) e += "bytes_reserved mismatch; ";
  if (open != core_->stats.num_files || open != core_->alloc.num_regions()) e += "file count mismatch; ";
  if (core_->stats.bytes_reserved - core_->alloc.free_bytes() != core_->stats.bytes_in_use)
    e += "bytes_in_use mismatch; ";
  if (why) *why = e;
  return e.empty();
}

// --- Spill / Ticket -------------------------------------------------------------------------

FileTier::Spill::Spill(std::shared_ptr<FileTier> tier, std::shared_ptr<SpillState> state)
    : tier_(std::move(tier)), state_(std::move(state)) {}

FileTier::Spill::~Spill() {
  // Note [Spill ordering]: the range is reused only after the I/O still touching it.
  bool free_now;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->dead = true;
    free_now = state_->inflight == 0;
  }
  if (free_now) tier_->core_->free_range(*state_);
}

size_t FileTier::Spill::nbytes() const { return state_->nbytes; }
uint64_t FileTier::Spill::offset() const { return state_->range.offset; }

std::string FileTier::Spill::proc_path() const {
  std::lock_guard<std::mutex> lock(tier_->core_->mu);
  return "/proc/self/fd/" + std::to_string(tier_->core_->files[state_->file]->fd);
}

void FileTier::Ticket::wait() {
  if (!query()) {
    const int64_t t0 = profiler::now_ns();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return done_.load(std::memory_order_acquire); });
    }
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->stats.read_stalls++;
    core_->stats.read_stall_ns += profiler::now_ns() - t0;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.empty()) throw FileTierError(error_);
}

std::string FileTier::Ticket::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

}  // namespace ckpt_offload

#include "file_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <sstream>

#include "block_allocator.h"
#include "crc32c.h"
#include "profiler.h"

namespace ckpt_offload {

namespace {

int64_t now_ns() { return profiler::now_ns(); }

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<char, AlignedFree>;

AlignedBuffer aligned_buffer(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kFileAlignment, bytes) != 0) throw std::bad_alloc();
  return AlignedBuffer(static_cast<char*>(p));
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kFileAlignment == 0; }

}  // namespace

struct SpillFile {
  int fd = -1;
  size_t bytes = 0;
  std::string path;
  std::atomic<bool> direct{false};
};

struct SpillState {
  uint32_t file = 0;  // region of the allocator: index into Core::files
  BlockAllocator::Range range;
  size_t nbytes = 0;
  uint64_t handle = 0;
  std::vector<uint32_t> crcs;  // one per chunk; written by the write's chunks, read after it
  std::mutex mu;
  bool written = false;
  std::string write_error;
  std::vector<std::shared_ptr<FileTier::Ticket>> after_write;  // reads waiting for the write
  int inflight = 0;   // tickets of this block not finished
  bool dead = false;  // the Spill handle is gone: free the range when inflight reaches 0
};

struct FileTier::Core {
  explicit Core(FileTierOptions o) : options(std::move(o)), alloc(kFileAlignment) {}
  ~Core() {
    for (auto& f : files)
      if (f && f->fd >= 0) ::close(f->fd);
  }

  FileTierOptions options;

  // Space: files, the allocator over them, stats. Guarded by mu.
  std::mutex mu;
  BlockAllocator alloc;
  std::vector<std::unique_ptr<SpillFile>> files;  // index = allocator region; null once closed
  FileTierStats stats;
  int active[2] = {0, 0};  // running chunks per direction (0: read, 1: write)
  int64_t busy_since[2] = {0, 0};

  // Work: one task per chunk. Guarded by qmu.
  struct Task {
    std::shared_ptr<Ticket> ticket;
    size_t chunk;
  };
  std::mutex qmu;
  std::condition_variable qcv, idle_cv;
  std::deque<Task> queue;
  size_t running = 0;  // tasks popped and not finished
  bool stop = false;

  size_t nchunks(size_t bytes) const { return std::max<size_t>(1, (bytes + options.chunk_bytes - 1) / options.chunk_bytes); }

  // --- files ------------------------------------------------------------------------------
  int open_file(bool* direct, int* err) {
    const int flags = O_RDWR | O_CLOEXEC;
    if (options.tmpfile) {
      int fd = ::open(options.dir.c_str(), flags | O_TMPFILE | (options.direct ? O_DIRECT : 0), 0600);
      *direct = options.direct;
      if (fd < 0 && options.direct && errno == EINVAL) {  // no O_DIRECT on this file system
        fd = ::open(options.dir.c_str(), flags | O_TMPFILE, 0600);
        *direct = false;
      }
      if (fd >= 0) return fd;
      *err = errno;
      // EOPNOTSUPP/EISDIR/EINVAL: no O_TMPFILE here (file system or kernel); else a real failure.
      if (*err != EOPNOTSUPP && *err != EISDIR && *err != EINVAL) return -1;
    }
    std::string path = options.dir + "/ckpt_offload-spill-XXXXXX";
    std::vector<char> name(path.begin(), path.end());
    name.push_back('\0');
    const int fd = ::mkostemp(name.data(), O_CLOEXEC);
    if (fd < 0) {
      *err = errno;
      return -1;
    }
    ::unlink(name.data());  // Note [Spill files leave no debris]
    *direct = options.direct && ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_DIRECT) == 0;
    return fd;
  }

  static std::string fd_path(int fd) {
    char buf[4096];
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf) - 1);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : link;
  }

  // Adds a file able to hold `need` bytes. False when the cap or the disk refuses.
  bool grow_locked(size_t need) {
    size_t size = need >= options.file_bytes / 2 ? need : options.file_bytes;
    if (options.max_bytes) {
      if (stats.bytes_reserved + need > options.max_bytes) {
        close_free_files_locked();
        if (stats.bytes_reserved + need > options.max_bytes) {
          stats.num_cap_hits++;
          return false;
        }
      }
      const size_t room = (options.max_bytes - stats.bytes_reserved) / kFileAlignment * kFileAlignment;
      size = std::min(size, room);  // room >= need here
    }
    bool direct = false;
    int err = 0;
    const int fd = open_file(&direct, &err);
    if (fd < 0) {
      if (err == ENOSPC || err == EDQUOT) {
        stats.num_disk_full++;
        return false;
      }
      throw FileTierError("ckpt_offload: cannot create a spill file in " + options.dir + ": " + errno_text(err) +
                          ". Pass a spill_dir on a writable local disk.");
    }
    // Space up front: a write into fallocate'd space cannot fail for lack of room later.
    int rc = ::fallocate(fd, 0, 0, static_cast<off_t>(size));
    if (rc != 0 && errno == ENOSPC && size > need) {
      size = need;
      rc = ::fallocate(fd, 0, 0, static_cast<off_t>(size));
    }
    if (rc != 0) {
      const int e = errno;
      if (e == EOPNOTSUPP) {
        // No fallocate (some network/FUSE file systems): a sparse file; a full disk then shows
        // as a write error (FileTierError), not as a refusal here.
        rc = ::ftruncate(fd, static_cast<off_t>(size));
      }
      if (rc != 0) {
        const int e2 = e == EOPNOTSUPP ? errno : e;
        ::close(fd);
        if (e2 == ENOSPC || e2 == EDQUOT || e2 == EFBIG) {
          stats.num_disk_full++;
          return false;
        }
        throw FileTierError("ckpt_offload: cannot preallocate " + std::to_string(size) + " bytes for a spill file in " +
                            options.dir + ": " + errno_text(e2));
      }
    }
    auto f = std::make_unique<SpillFile>();
    f->fd = fd;
    f->bytes = size;
    f->path = fd_path(fd);
    f->direct = direct;
    stats.direct_io = direct;
    // A closed file's index is reused, so indices stay small and the allocator's regions few.
    uint32_t index = 0;
    while (index < files.size() && files[index]) ++index;
    if (index == files.size()) files.emplace_back();
    files[index] = std::move(f);
    alloc.add_region(index, size);
    stats.bytes_reserved += size;
    stats.peak_bytes_reserved = std::max(stats.peak_bytes_reserved, stats.bytes_reserved);
    stats.num_files++;
    return true;
  }

  size_t close_free_files_locked() {
    size_t released = 0;
    for (uint32_t i = 0; i < files.size(); ++i) {
      if (!files[i] || !alloc.region_is_free(i)) continue;
      alloc.remove_region(i);
      ::close(files[i]->fd);
      released += files[i]->bytes;
      stats.bytes_reserved -= files[i]->bytes;
      stats.num_files--;
      files[i].reset();
    }
    return released;
  }

  void free_range(SpillState& s) {
    std::lock_guard<std::mutex> lock(mu);
    alloc.free(s.range);
    stats.bytes_in_use -= s.range.size;
    stats.bytes_requested -= s.nbytes;
    stats.num_blocks_in_use--;
  }

  // --- I/O ----------------------------------------------------------------------------------
  void enqueue(const std::shared_ptr<Ticket>& t) {
    const size_t n = nchunks(t->bytes_);
    {
      std::lock_guard<std::mutex> lock(qmu);
      for (size_t i = 0; i < n; ++i) queue.push_back(Task{t, i});
    }
    if (n == 1) {
      qcv.notify_one();
    } else {
      qcv.notify_all();
    }
  }

  void busy(int dir, bool begin) {
    std::lock_guard<std::mutex> lock(mu);
    const int64_t t = now_ns();
    if (begin) {
      if (active[dir]++ == 0) busy_since[dir] = t;
    } else if (--active[dir] == 0) {
      (dir ? stats.write_busy_ns : stats.read_busy_ns) += t - busy_since[dir];
    }
  }

  // Full-length pwrite/pread: retries EINTR and short transfers; on EINVAL from an O_DIRECT
  // file, drops O_DIRECT for that file (Note [Direct I/O]) and tells the caller to redo the
  // chunk buffered.
  enum class IoResult { Ok, Retry, Error };
  IoResult transfer(SpillFile& f, bool write, char* buf, size_t len, uint64_t off, bool direct, int* err) {
    size_t done = 0;
    while (done < len) {
      const ssize_t n = write ? ::pwrite(f.fd, buf + done, len - done, static_cast<off_t>(off + done))
                              : ::pread(f.fd, buf + done, len - done, static_cast<off_t>(off + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EINVAL && direct) {
        std::lock_guard<std::mutex> lock(mu);
        if (f.direct.exchange(false)) ::fcntl(f.fd, F_SETFL, ::fcntl(f.fd, F_GETFL) & ~O_DIRECT);
        stats.direct_io = false;
        return IoResult::Retry;
      }
      if (n < 0) {
        *err = errno;
        return IoResult::Error;
      }
      if (n == 0) {
        *err = 0;  // end of file: cannot happen inside a preallocated range
        return IoResult::Error;
      }
      done += static_cast<size_t>(n);
    }
    return IoResult::Ok;
  }

  std::string where(const SpillFile& f, const SpillState& s, size_t chunk) const {
    std::ostringstream os;
    os << "spill file " << f.path << ", block at offset " << s.range.offset << " (" << s.nbytes << " bytes), chunk "
       << chunk + 1 << " of " << nchunks(s.nbytes);
    return os.str();
  }

  // One chunk of a ticket. Returns "" or what went wrong.
  std::string run_chunk(Ticket& t, size_t chunk, char* bounce) {
    SpillState& s = *t.spill_;
    SpillFile* fp;
    {
      std::lock_guard<std::mutex> lock(mu);
      fp = files[s.file].get();  // stays open: the range is allocated
    }
    SpillFile& f = *fp;
    const size_t off = chunk * options.chunk_bytes;
    const size_t len = std::min(options.chunk_bytes, t.bytes_ - off);
    const size_t padded = (len + kFileAlignment - 1) / kFileAlignment * kFileAlignment;
    const uint64_t file_off = s.range.offset + off;
    if (len == 0) return "";  // an empty block: nothing to move, its CRC is crc32c("") = 0
    char* user = t.user_ + off;
    for (;;) {
      const bool direct = f.direct.load();
      // O_DIRECT straight from/to the caller's memory when it is aligned; a bounce otherwise.
      const bool in_place = !direct || (aligned(user) && len % kFileAlignment == 0);
      char* buf = in_place ? user : bounce;
      const size_t n = direct ? padded : len;
      int err = 0;
      if (t.write_) {
        if (!in_place) {
          std::memcpy(bounce, user, len);
          std::memset(bounce + len, 0, padded - len);  // no stale memory on disk
        }
        s.crcs[chunk] = crc32c(buf, len);
        const IoResult r = transfer(f, true, buf, n, file_off, direct, &err);
        if (r == IoResult::Retry) continue;
        if (r == IoResult::Error) {
          std::lock_guard<std::mutex> lock(mu);
          stats.write_errors++;
          return "ckpt_offload: writing " + where(f, s, chunk) + " failed: " + errno_text(err);
        }
        return "";
      }
      const IoResult r = transfer(f, false, buf, n, file_off, direct, &err);
      if (r == IoResult::Retry) continue;
      if (r == IoResult::Error) {
        std::lock_guard<std::mutex> lock(mu);
        stats.read_errors++;
        return "ckpt_offload: reading " + where(f, s, chunk) + " failed: " +
               (err ? errno_text(err) : std::string("unexpected end of file"));
      }
      const uint32_t crc = crc32c(buf, len);
      if (crc != s.crcs[chunk]) {
        std::lock_guard<std::mutex> lock(mu);
        stats.checksum_errors++;
        std::ostringstream os;
        os << "ckpt_offload: checksum mismatch reading " << where(f, s, chunk) << ": CRC32C 0x" << std::hex << crc
           << ", written as 0x" << s.crcs[chunk]
           << ". The spilled activations changed on disk (something else wrote to the file, or the "
              "disk corrupted it); refusing to compute gradients from them.";
        return os.str();
      }
      if (!in_place) std::memcpy(user, bounce, len);
      return "";
    }
  }

  void finish(const std::shared_ptr<Ticket>& tp) {
    Ticket& t = *tp;
    SpillState& s = *t.spill_;
    std::string error;
    {
      std::lock_guard<std::mutex> lock(t.mu_);
      error = t.error_;
    }
    const int64_t end = now_ns();
    {
      std::lock_guard<std::mutex> lock(mu);
      if (error.empty()) {
        if (t.write_) {
          stats.blocks_written++;
          stats.bytes_written += t.bytes_;
        } else {
          stats.blocks_read++;
          stats.bytes_read += t.bytes_;
        }
      }
    }
    if (profiler::enabled())
      profiler::add(profiler::DiskRecord{t.write_, t.handle_, t.bytes_, t.prefetch_,
                                         t.start_ns_.load() ? t.start_ns_.load() : end, end});
    std::vector<std::shared_ptr<Ticket>> reads;
    if (t.write_) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.written = true;
      s.write_error = error;
      reads.swap(s.after_write);
    }
    for (auto& r : reads) {
      if (error.empty()) {
        enqueue(r);
      } else {
        {
          std::lock_guard<std::mutex> lock(r->mu_);
          r->error_ = error;
        }
        finish(r);
      }
    }
    // The source (write) or destination (read) is no longer touched: let its owner go.
    t.keepalive_.reset();
    t.after_.reset();
    // The range before the ticket: whoever sees the ticket done and drops the handle (or sees
    // it dropped) finds the space already back in the tier's stats.
    bool free_now;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      free_now = --s.inflight == 0 && s.dead;
    }
    if (free_now) free_range(s);
    {
      std::lock_guard<std::mutex> lock(t.mu_);
      t.done_.store(true, std::memory_order_release);
    }
    t.cv_.notify_all();
  }

  void worker() {
    AlignedBuffer bounce = aligned_buffer(options.chunk_bytes);
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(qmu);
        qcv.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;  // stop, and nothing left to do
        task = std::move(queue.front());
        queue.pop_front();
        ++running;
      }
      Ticket& t = *task.ticket;
      const int dir = t.write_ ? 1 : 0;
      std::string error;
      bool was_busy = false;
      try {
        bool failed;
        {
          std::lock_guard<std::mutex> lock(t.mu_);
          failed = !t.error_.empty();
        }
        if (!failed) {
          // Note [Spill ordering]: the source is complete only once its D2H copy is. That wait
          // is not disk time: bandwidth and the profiler's record start after it.
          if (t.after_) std::call_once(t.after_once_, [&] { t.after_->synchronize(); });
          int64_t expected = 0;
          t.start_ns_.compare_exchange_strong(expected, now_ns());
          busy(dir, true);
          was_busy = true;
          error = run_chunk(t, task.chunk, bounce.get());
        }
      } catch (const std::exception& e) {
        error = std::string("ckpt_offload: spill I/O failed: ") + e.what();
      } catch (...) {
        error = "ckpt_offload: spill I/O failed with an unknown exception";
      }
      if (was_busy) busy(dir, false);
      if (!error.empty()) {
        std::lock_guard<std::mutex> lock(t.mu_);
        if (t.error_.empty()) t.error_ = error;  // the first failure explains the rest
      }
      if (t.remaining_.fetch_sub(1) == 1) finish(task.ticket);
      task.ticket.reset();
      {
        std::lock_guard<std::mutex> lock(qmu);
        --running;
        if (running == 0 && queue.empty()) idle_cv.notify_all();
      }
    }
  }
};

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
    for (int i = 0; i < core_->options.io_threads; ++i)
      threads_.emplace_back([core = core_] { core->worker(); });
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

FileTier::~FileTier() {
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
  const int64_t t = now_ns();
  if (core_->active[1]) s.write_busy_ns += t - core_->busy_since[1];
  if (core_->active[0]) s.read_busy_ns += t - core_->busy_since[0];
  return s;
}

void FileTier::reset_peak() {
  std::lock_guard<std::mutex> lock(core_->mu);
  core_->stats.peak_bytes_in_use = core_->stats.bytes_in_use;
  core_->stats.peak_bytes_reserved = core_->stats.bytes_reserved;
}

size_t FileTier::reserve(size_t bytes) {
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
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->close_free_files_locked();
}

void FileTier::synchronize() {
  std::unique_lock<std::mutex> lock(core_->qmu);
  core_->idle_cv.wait(lock, [&] { return core_->queue.empty() && core_->running == 0; });
}

const FileTierOptions& FileTier::options() const { return core_->options; }

std::vector<FileTier::FileInfo> FileTier::files() {
  std::lock_guard<std::mutex> lock(core_->mu);
  std::vector<FileInfo> out;
  for (auto& f : core_->files)
    if (f) out.push_back(FileInfo{f->fd, f->path, "/proc/self/fd/" + std::to_string(f->fd), f->bytes, f->direct.load()});
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
  if (core_->stats.bytes_reserved - core_->alloc.free_bytes() != core_->stats.bytes_in_use) e += "bytes_in_use mismatch; ";
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
    const int64_t t0 = now_ns();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return done_.load(std::memory_order_acquire); });
    }
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->stats.stalls++;
    core_->stats.stall_ns += now_ns() - t0;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.empty()) throw FileTierError(error_);
}

std::string FileTier::Ticket::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

}  // namespace ckpt_offload

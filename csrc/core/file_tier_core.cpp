// FileTier::Core (file_tier_core.h): the spill files, their space, and the I/O threads.
#include "file_tier_core.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "crc32c.h"
#include "profiler.h"
#include "text.h"

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

FileTier::Core::~Core() {
  for (auto& f : files)
    if (f && f->fd >= 0) ::close(f->fd);
}

int FileTier::Core::open_file(bool* direct, int* err) {
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

std::string FileTier::Core::fd_path(int fd) {
  char buf[4096];
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : link;
}

bool FileTier::Core::grow_locked(size_t need) {
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

size_t FileTier::Core::close_free_files_locked() {
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

void FileTier::Core::free_range(SpillState& s) {
  std::lock_guard<std::mutex> lock(mu);
  alloc.free(s.range);
  stats.bytes_in_use -= s.range.size;
  stats.bytes_requested -= s.nbytes;
  stats.num_blocks_in_use--;
}

void FileTier::Core::enqueue(const std::shared_ptr<Ticket>& t) {
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

void FileTier::Core::busy(int dir, bool begin) {
  std::lock_guard<std::mutex> lock(mu);
  const int64_t t = now_ns();
  if (begin) {
    if (active[dir]++ == 0) busy_since[dir] = t;
  } else if (--active[dir] == 0) {
    (dir ? stats.write_busy_ns : stats.read_busy_ns) += t - busy_since[dir];
  }
}

FileTier::Core::IoResult FileTier::Core::transfer(SpillFile& f, bool write, char* buf, size_t len, uint64_t off,
                                                  bool direct, int* err) {
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

std::string FileTier::Core::where(const SpillFile& f, const SpillState& s, size_t chunk) const {
  return "spill file " + f.path + ", block at offset " + std::to_string(s.range.offset) + " (" +
         std::to_string(s.nbytes) + " bytes), chunk " + std::to_string(chunk + 1) + " of " +
         std::to_string(nchunks(s.nbytes));
}

std::string FileTier::Core::run_chunk(Ticket& t, size_t chunk, char* bounce) {
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
      return "ckpt_offload: reading " + where(f, s, chunk) +
             " failed: " + (err ? errno_text(err) : std::string("unexpected end of file"));
    }
    const uint32_t crc = crc32c(buf, len);
    if (crc != s.crcs[chunk]) {
      std::lock_guard<std::mutex> lock(mu);
      stats.checksum_errors++;
      return "ckpt_offload: checksum mismatch reading " + where(f, s, chunk) + ": CRC32C " + hex32(crc) +
             ", written as " + hex32(s.crcs[chunk]) +
             ". The spilled activations changed on disk (something else wrote to the file, or the disk corrupted "
             "it); refusing to compute gradients from them.";
    }
    if (!in_place) std::memcpy(user, bounce, len);
    return "";
  }
}

void FileTier::Core::finish(const std::shared_ptr<Ticket>& tp) {
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

void FileTier::Core::worker() {
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

}  // namespace ckpt_offload

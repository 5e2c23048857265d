// FileTier::Core, private to file_tier.cpp and file_tier_core.cpp: the tier's spill files,
// the allocator over them and the I/O threads (the Notes are in file_tier.h).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "block_allocator.h"
#include "file_tier.h"

namespace ckpt_offload {

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
  int inflight = 0;                                            // tickets of this block not finished
  bool dead = false;  // the Spill handle is gone: free the range when inflight reaches 0
};

struct FileTier::Core {
  explicit Core(FileTierOptions o) : options(std::move(o)), alloc(kFileAlignment) {}
  ~Core();

  FileTierOptions options;
  // The process that made the tier. Note [Fork] (csrc/torch/runtime.cpp): a fork child has none of its
  // I/O threads and shares its files' descriptors with the parent; it must not use it.
  const pid_t pid = ::getpid();
  bool forked() const { return ::getpid() != pid; }
  // Throws FileTierError in a fork child (what: the operation refused).
  void check_process(const char* what) const;

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
  size_t nchunks(size_t bytes) const {
    return std::max<size_t>(1, (bytes + options.chunk_bytes - 1) / options.chunk_bytes);
  }

  // --- files ------------------------------------------------------------------------------
  int open_file(bool* direct, int* err);
  static std::string fd_path(int fd);

  // Adds a file able to hold `need` bytes. False when the cap or the disk refuses.
  bool grow_locked(size_t need);
  size_t close_free_files_locked();
  void free_range(SpillState& s);

  // --- I/O ----------------------------------------------------------------------------------
  void enqueue(const std::shared_ptr<Ticket>& t);
  void busy(int dir, bool begin);

  // Full-length pwrite/pread: retries EINTR and short transfers; on EINVAL from an O_DIRECT
  // file, drops O_DIRECT for that file (Note [Direct I/O]) and tells the caller to redo the
  // chunk buffered.
  enum class IoResult { Ok, Retry, Error };
  IoResult transfer(SpillFile& f, bool write, char* buf, size_t len, uint64_t off, bool direct, int* err);
  std::string where(const SpillFile& f, const SpillState& s, size_t chunk) const;

  // One chunk of a ticket. Returns "" or what went wrong.
  std::string run_chunk(Ticket& t, size_t chunk, char* bounce);
  void finish(const std::shared_ptr<Ticket>& tp);
  void worker();
};

}  // namespace ckpt_offload

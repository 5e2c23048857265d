// FileTier: spill space below the host pool, in a few preallocated files on a local disk.
//
// A spilled block is a best-fit range of one of the tier's files (BlockAllocator; files are
// grown in large fallocate'd pieces, never one per block). A small pool of I/O threads does the
// pwrite/pread, chunk by chunk, so one large block is written by all of them at once. Every
// chunk carries a CRC32C kept in memory (not in the file), checked on read: bytes that changed
// on disk raise FileTierError naming the file, never come back silently wrong.
//
// Note [Spill files leave no debris]: files are opened O_TMPFILE (no name at all) or, where the
// file system lacks it, created and unlinked at once; their space goes back to the file system
// when the descriptor is closed, which a crash does too.
//
// Note [Direct I/O]: files are opened O_DIRECT where the file system takes it, so spilled
// activations do not fill the page cache (which would take the very host memory the spill
// frees). O_DIRECT needs offsets, lengths and buffers aligned to kFileAlignment: ranges are
// aligned, and a chunk whose memory or length is not goes through an aligned bounce buffer
// of its worker. Where the flag is refused (at open or at the first I/O), that file falls back
// to buffered I/O.
//
// Note [Spill ordering]: a write starts only after its `after` event (the D2H copy filling the
// source) has completed and keeps `keepalive` (the source's owner) until its last chunk is on
// disk; a read of a block whose write is still running starts when the write ends. A block's
// range is reused only after every read and write of it has finished, however early its Spill
// handle dies.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "stats_table.h"
#include "stream.h"

namespace ckpt_offload {

constexpr size_t kFileAlignment = 4096;                  // O_DIRECT offsets, lengths, buffers
constexpr size_t kDefaultFileBytes = size_t(256) << 20;  // one preallocated file
constexpr size_t kDefaultChunkBytes = size_t(1) << 20;   // unit of I/O, checksum, parallelism

struct FileTierOptions {
  std::string dir;                          // an existing directory on the disk to spill to
  size_t max_bytes = 0;                     // cap on the files' total size; 0: what the disk has
  size_t file_bytes = kDefaultFileBytes;    // size of each preallocated file
  size_t chunk_bytes = kDefaultChunkBytes;  // a multiple of kFileAlignment
  int io_threads = 2;
  bool direct = true;   // O_DIRECT where the file system takes it (Note [Direct I/O])
  bool tmpfile = true;  // O_TMPFILE where supported; false: a named file unlinked at once
};

// A spilled block could not be written or read back intact. The message names the file.
class FileTierError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// FileTier::stats(), one row a stat (Note [Stats tables] in stats_table.h), in the order of the
// dict FileTier.stats() returns.
#define CKPT_OFFLOAD_FILE_TIER_STATS(FIELD, PEAK, KEY)                                           \
  KEY(dir)                              /* the tier's directory */                               \
  FIELD(size_t, bytes_in_use, Value)    /* file space held by live spilled blocks */             \
                                        /* (aligned sizes) */                                    \
  FIELD(size_t, bytes_requested, Value) /* the bytes they hold */                                \
  PEAK(size_t, peak_bytes_in_use, bytes_in_use)                                                  \
  FIELD(size_t, bytes_reserved, Value) /* the files' total (preallocated) size */                \
  PEAK(size_t, peak_bytes_reserved, bytes_reserved)                                              \
  FIELD(size_t, max_bytes, Cap)                                                                  \
  FIELD(size_t, num_files, Value)                                                                \
  FIELD(uint64_t, num_blocks_in_use, Value)                                                      \
  FIELD(uint64_t, blocks_written, Value)                                                         \
  FIELD(uint64_t, bytes_written, Value)                                                          \
  FIELD(uint64_t, blocks_read, Value)                                                            \
  FIELD(uint64_t, bytes_read, Value)                                                             \
  /* Wall time during which at least one write (read) was running: bytes / busy = bandwidth. */  \
  FIELD(int64_t, write_busy_ns, Internal)                                                        \
  FIELD(int64_t, read_busy_ns, Internal)                                                         \
  KEY(write_seconds)                                                                             \
  KEY(read_seconds)                                                                              \
  KEY(write_bandwidth) /* bytes/s while busy, None before any I/O */                             \
  KEY(read_bandwidth)                                                                            \
  FIELD(uint64_t, reads_prefetch, Value)  /* reads started ahead of need (backward's */          \
                                          /* prefetch) */                                        \
  FIELD(uint64_t, read_stalls, Value)     /* Ticket::wait calls that had to block on the disk */ \
  FIELD(int64_t, read_stall_ns, Internal) /* and how long they blocked */                        \
  KEY(read_stall_seconds)                                                                        \
  FIELD(uint64_t, num_cap_hits, Value)  /* write() refused by max_bytes */                       \
  FIELD(uint64_t, num_disk_full, Value) /* write() refused: the file system had no room */       \
  FIELD(uint64_t, write_errors, Value)                                                           \
  FIELD(uint64_t, read_errors, Value)                                                            \
  FIELD(uint64_t, checksum_errors, Value)                                                        \
  FIELD(bool, direct_io, Value) /* the last file opened uses O_DIRECT */

struct FileTierStats {
  CKPT_OFFLOAD_STATS_STRUCT_BODY(CKPT_OFFLOAD_FILE_TIER_STATS)
};

// A tier is used only in the process that made it (Note [Fork], csrc/torch/runtime.cpp): in a
// fork child, write(), read() and reserve() raise FileTierError saying so, synchronize() and
// empty_cache() do nothing, and the destructor leaks the threads instead of joining them.
class FileTier : public std::enable_shared_from_this<FileTier> {
 public:
  class Spill;
  class Ticket;
  struct Core;

  // Checks the options (std::invalid_argument naming the bad one) and starts the I/O threads.
  // No file is created before the first write() or reserve().
  static std::shared_ptr<FileTier> create(FileTierOptions options);
  // Waits for the queued I/O, stops the threads. Spill handles keep the tier alive, so none is
  // left when this runs.
  ~FileTier();
  FileTier(const FileTier&) = delete;
  FileTier& operator=(const FileTier&) = delete;

  // Starts writing `bytes` bytes at `src` to a new range of a file, once `after` (may be null)
  // has completed. `keepalive` owns the source; it is released when the last chunk is written.
  // Returns nullptr when there is no room: the cap (num_cap_hits) or a full disk
  // (num_disk_full). Never blocks on I/O; may create (fallocate) a file.
  std::shared_ptr<Spill> write(const void* src, size_t bytes, std::shared_ptr<void> keepalive,
                               std::shared_ptr<Event> after = nullptr, uint64_t handle = 0);
  // Starts reading `spill` back into `dst` (spill->nbytes() bytes), after its write if that is
  // still running. `keepalive` owns dst until the read has finished. `prefetch`: counted (and
  // profiled) as a read started ahead of need.
  std::shared_ptr<Ticket> read(const std::shared_ptr<Spill>& spill, void* dst, std::shared_ptr<void> keepalive,
                               bool prefetch = false);

  FileTierStats stats();
  void reset_peak();
  // Preallocates at least `bytes` of file space now (within the cap). Returns the bytes added,
  // 0 when the cap or the disk refused.
  size_t reserve(size_t bytes);
  // Closes the files that hold no block (their space goes back to the file system).
  size_t empty_cache();
  // Blocks until every read and write queued before the call has finished.
  void synchronize();
  const FileTierOptions& options() const;
  // True in a fork child of the process that made the tier (Note [Fork]).
  bool forked() const;
  // Raises FileTierError, naming `what` and the fix, in a fork child of the process that made
  // the tier (Note [Fork]); nothing otherwise.
  void check_process(const char* what) const;

  struct FileInfo {
    int fd;
    std::string path;       // as /proc names it: "<dir>/#123 (deleted)" for an O_TMPFILE file
    std::string proc_path;  // "/proc/self/fd/<fd>": opens the file (tests inject corruption)
    size_t bytes;
    bool direct;
  };
  std::vector<FileInfo> files();
  // Ranges tile the files, stats match. Test-only.
  bool check_invariants(std::string* why);

 private:
  explicit FileTier(std::shared_ptr<Core> core);
  std::shared_ptr<Core> core_;
  std::vector<std::thread> threads_;
};

struct SpillState;

// One block's bytes in a file. Dropping the handle frees the range once its I/O has finished.
class FileTier::Spill {
 public:
  ~Spill();
  Spill(const Spill&) = delete;
  Spill& operator=(const Spill&) = delete;
  size_t nbytes() const;
  // The write: complete once every chunk is on disk (wait() raises if the write failed).
  const std::shared_ptr<Ticket>& written() const { return write_; }
  // Where the bytes are (tests): the file's /proc path and the offset of the range.
  std::string proc_path() const;
  uint64_t offset() const;

 private:
  friend class FileTier;
  Spill(std::shared_ptr<FileTier> tier, std::shared_ptr<SpillState> state);
  std::shared_ptr<FileTier> tier_;
  std::shared_ptr<SpillState> state_;
  std::shared_ptr<Ticket> write_;
};

// One read or write in flight.
class FileTier::Ticket {
 public:
  // Non-blocking: true once every chunk has finished (successfully or not).
  bool query() const { return done_.load(std::memory_order_acquire); }
  // Blocks until finished (counted as a stall when it had to wait); raises FileTierError,
  // naming the file, when the I/O failed or a checksum did not match.
  void wait();
  // The failure ("" while running or after success).
  std::string error() const;
  size_t nbytes() const { return bytes_; }
  bool is_write() const { return write_; }

 private:
  friend class FileTier;
  friend struct FileTier::Core;
  std::shared_ptr<Core> core_;
  std::shared_ptr<SpillState> spill_;
  bool write_ = false;
  bool prefetch_ = false;
  char* user_ = nullptr;  // the source (write) or destination (read)
  size_t bytes_ = 0;
  uint64_t handle_ = 0;
  std::shared_ptr<void> keepalive_;
  std::shared_ptr<Event> after_;
  std::atomic<size_t> remaining_{0};  // chunks not finished
  std::atomic<int64_t> start_ns_{0};  // when the first chunk started (profiler)
  std::once_flag after_once_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::string error_;
};

}  // namespace ckpt_offload

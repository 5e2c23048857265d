// FileTier: CRC32C, round trips (direct and buffered I/O, aligned and unaligned memory, one
// chunk and many), the ordering rules (a write waits for its `after` event, a read for its
// write, a range outlives its handle while I/O runs), corruption detected on read, the cap and
// a really full disk (a 1 MiB tmpfs in a private mount namespace, where the test may mount
// one), no files left in the directory or open after the tier dies, profiler records, and
// many threads writing and reading at once.
#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "cpu_stream.h"
#include "crc32c.h"
#include "file_tier.h"
#include "profiler.h"

using namespace ckpt_offload;
using namespace std::chrono_literals;

#define CHECK_TIER(tier)                                                                                            \
  do {                                                                                                              \
    std::string check_why_;                                                                                         \
    if (!(tier).check_invariants(&check_why_)) ::check::fail(__FILE__, __LINE__, "tier invariants: " + check_why_); \
  } while (0)

namespace {

constexpr size_t KiB = size_t(1) << 10;
constexpr size_t MiB = size_t(1) << 20;

// A fresh directory under `parent`, removed (it must be empty by then) when the test ends.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& parent) {
    std::string t = parent + "/ckpt_offload_tier_XXXXXX";
    std::vector<char> name(t.begin(), t.end());
    name.push_back('\0');
    CHECK(::mkdtemp(name.data()) != nullptr);
    path = name.data();
  }
  ~TempDir() { ::rmdir(path.c_str()); }
  // Names in the directory (spill files must never have one for long).
  int entries() const {
    DIR* d = ::opendir(path.c_str());
    CHECK(d != nullptr);
    int n = 0;
    while (dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) ++n;
    ::closedir(d);
    return n;
  }
};

// Open descriptors of this process whose target lies in `dir` (deleted files included).
int open_files_in(const std::string& dir) {
  DIR* d = ::opendir("/proc/self/fd");
  CHECK(d != nullptr);
  int n = 0;
  while (dirent* e = ::readdir(d)) {
    char buf[4096];
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t len = ::readlink(link.c_str(), buf, sizeof(buf) - 1);
    if (len <= 0) continue;
    if (std::string(buf, static_cast<size_t>(len)).rfind(dir + "/", 0) == 0) ++n;
  }
  ::closedir(d);
  return n;
}

std::vector<char> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

FileTierOptions opts(const std::string& dir, bool direct, size_t chunk = 64 * KiB) {
  FileTierOptions o;
  o.dir = dir;
  o.direct = direct;
  o.chunk_bytes = chunk;
  o.file_bytes = 1 * MiB;
  o.io_threads = 3;
  return o;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const FileTierError& e) {
    return e.what();
  }
  return "";
}

bool have_dir(const char* d) {
  struct stat st;
  return ::stat(d, &st) == 0 && S_ISDIR(st.st_mode) && ::access(d, W_OK) == 0;
}

std::vector<std::string> spill_parents() {
  std::vector<std::string> out{"/tmp"};                 // a disk file system (O_DIRECT)
  if (have_dir("/dev/shm")) out.push_back("/dev/shm");  // tmpfs
  return out;
}

void test_crc32c() {
  CHECK_EQ(crc32c("123456789", 9), 0xE3069283u);
  CHECK_EQ(crc32c_portable("123456789", 9), 0xE3069283u);
  const std::vector<char> zeros(32, 0);
  CHECK_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  CHECK_EQ(crc32c(nullptr, 0), 0u);
  const auto data = random_bytes(10000, 1);
  for (size_t off : {0, 1, 3, 7}) {
    for (size_t n : {0, 1, 7, 8, 9, 63, 64, 1000, 9000}) {
      const uint32_t whole = crc32c_portable(data.data() + off, n);
      CHECK_EQ(crc32c(data.data() + off, n), whole);
      // Continuation: crc(a + b) from crc(a).
      const size_t half = n / 3;
      CHECK_EQ(crc32c(data.data() + off + half, n - half, crc32c(data.data() + off, half)), whole);
    }
  }
  std::printf("  crc32c: %s\n", crc32c_hardware() ? "sse4.2" : "table");
}

void round_trips(const std::string& parent, bool direct) {
  TempDir dir(parent);
  auto tier = FileTier::create(opts(dir.path, direct));
  // Sizes around the alignment and the chunk; offsets that break O_DIRECT's alignment.
  const size_t sizes[] = {0, 1, 4095, 4096, 4097, 64 * KiB, 64 * KiB + 1, 3 * 64 * KiB - 5, 1 * MiB + 7};
  uint64_t seed = 10;
  size_t total = 0;
  for (size_t n : sizes) {
    for (size_t src_off : {size_t(0), size_t(1), size_t(512)}) {
      char* src_mem = nullptr;
      CHECK_EQ(posix_memalign(reinterpret_cast<void**>(&src_mem), kFileAlignment, n + 4096), 0);
      std::unique_ptr<char, decltype(&std::free)> src_own(src_mem, &std::free);
      const auto data = random_bytes(n, ++seed);
      if (n) std::memcpy(src_mem + src_off, data.data(), n);
      auto spill = tier->write(src_mem + src_off, n, nullptr);
      CHECK(spill != nullptr);
      CHECK_EQ(spill->nbytes(), n);
      spill->written()->wait();
      total += n;
      for (size_t dst_off : {size_t(0), size_t(3)}) {
        std::vector<char> back(n + dst_off + 1, 'x');
        tier->read(spill, back.data() + dst_off, nullptr)->wait();
        CHECK_MSG(n == 0 || std::memcmp(back.data() + dst_off, data.data(), n) == 0,
                  "bytes differ: size " << n << " src_off " << src_off << " dst_off " << dst_off);
        CHECK_EQ(back[n + dst_off], 'x');  // nothing written past the end
      }
      CHECK_TIER(*tier);
    }
  }
  const auto st = tier->stats();
  CHECK_EQ(st.bytes_written, total);
  CHECK_EQ(st.bytes_read, 2 * total);
  CHECK_EQ(st.bytes_in_use, 0u);
  CHECK_EQ(st.num_blocks_in_use, 0u);
  CHECK_EQ(st.checksum_errors + st.read_errors + st.write_errors, 0u);
  CHECK_GT(st.write_busy_ns, 0);
  CHECK_GT(st.read_busy_ns, 0);
  CHECK_GE(st.num_files, 1u);
  CHECK_EQ(st.direct_io, direct);  // both file systems here take O_DIRECT
  // Note [Spill files leave no debris]: nothing has a name, and closing frees everything.
  CHECK_EQ(dir.entries(), 0);
  CHECK_GE(open_files_in(dir.path), 1);
  CHECK_EQ(tier->empty_cache(), st.bytes_reserved);
  CHECK_EQ(open_files_in(dir.path), 0);
  CHECK_EQ(tier->stats().num_files, 0u);
}

void test_round_trips() {
  for (const auto& parent : spill_parents()) {
    for (bool direct : {true, false}) {
      std::printf("  %s, %s\n", parent.c_str(), direct ? "O_DIRECT" : "buffered");
      round_trips(parent, direct);
    }
  }
}

// Without O_TMPFILE the file gets a name for an instant: none may remain.
void test_named_files_unlinked() {
  TempDir dir("/tmp");
  auto o = opts(dir.path, true);
  o.tmpfile = false;
  {
    auto tier = FileTier::create(o);
    const auto data = random_bytes(100 * KiB, 3);
    auto spill = tier->write(data.data(), data.size(), nullptr);
    std::vector<char> back(data.size());
    tier->read(spill, back.data(), nullptr)->wait();
    CHECK(back == data);
    CHECK_EQ(dir.entries(), 0);
    CHECK_EQ(open_files_in(dir.path), 1);
    CHECK(tier->files().at(0).direct);  // O_DIRECT set with fcntl after mkostemp
  }
  CHECK_EQ(open_files_in(dir.path), 0);
}

// Note [Spill ordering]: a write reads its source only after `after`; a read that arrives
// before the write has finished starts when it has; the keepalive goes once the write is done.
void test_ordering() {
  TempDir dir("/tmp");
  auto tier = FileTier::create(opts(dir.path, true));
  const size_t n = 200 * KiB + 3;
  auto src = std::make_shared<std::vector<char>>(n, 'a');  // the "D2H copy" has not run yet
  std::weak_ptr<std::vector<char>> src_alive = src;
  auto copied = std::make_shared<FenceEvent>(false);
  auto spill = tier->write(src->data(), n, src, copied);
  char* src_data = src->data();
  src.reset();  // the tier's keepalive holds it now
  std::vector<char> back(n);
  auto read = tier->read(spill, back.data(), nullptr, /*prefetch=*/true);
  std::this_thread::sleep_for(50ms);
  CHECK(!spill->written()->query());
  CHECK(!read->query());
  CHECK(!src_alive.expired());
  const auto data = random_bytes(n, 4);
  std::memcpy(src_data, data.data(), n);  // the copy lands, then its event fires
  copied->signal();
  read->wait();
  CHECK(spill->written()->query());
  CHECK(back == data);
  CHECK(src_alive.expired());  // released once on disk: the pinned block can be reused
  const auto st = tier->stats();
  CHECK_EQ(st.reads_prefetch, 1u);
  CHECK_GE(st.read_stalls, 1u);  // read->wait() had to block
}

// A handle dropped while its I/O runs: the range stays allocated until the I/O has finished.
void test_drop_while_in_flight() {
  TempDir dir("/tmp");
  auto tier = FileTier::create(opts(dir.path, false));
  const auto data = random_bytes(300 * KiB, 5);
  auto copied = std::make_shared<FenceEvent>(false);
  auto spill = tier->write(data.data(), data.size(), nullptr, copied);
  std::vector<char> back(data.size());
  auto read = tier->read(spill, back.data(), nullptr);
  spill.reset();
  CHECK_GT(tier->stats().bytes_in_use, 0u);
  copied->signal();
  read->wait();
  CHECK(back == data);
  tier->synchronize();
  CHECK_EQ(tier->stats().bytes_in_use, 0u);
  CHECK_TIER(*tier);
}

void test_corruption(const std::string& parent, bool direct) {
  TempDir dir(parent);
  auto tier = FileTier::create(opts(dir.path, direct));
  const auto data = random_bytes(200 * KiB, 6);
  auto spill = tier->write(data.data(), data.size(), nullptr);
  spill->written()->wait();
  // Flip one byte in the second chunk, through another descriptor of the same file.
  const int fd = ::open(spill->proc_path().c_str(), O_RDWR);
  CHECK_GE(fd, 0);
  const off_t at = static_cast<off_t>(spill->offset() + 64 * KiB + 100);
  char c = 0;
  CHECK_EQ(::pread(fd, &c, 1, at), 1);
  c = static_cast<char>(c ^ 0x10);
  CHECK_EQ(::pwrite(fd, &c, 1, at), 1);
  ::close(fd);
  std::vector<char> back(data.size());
  auto read = tier->read(spill, back.data(), nullptr);
  const std::string err = error_of([&] { read->wait(); });
  CHECK_MSG(err.find("checksum mismatch") != std::string::npos, err);
  CHECK_MSG(err.find(dir.path + "/") != std::string::npos, "the message names the file: " << err);
  CHECK_MSG(err.find("chunk 2 of 4") != std::string::npos, err);
  CHECK_EQ(read->error(), err);
  CHECK_EQ(tier->stats().checksum_errors, 1u);
  // The error sticks to that read only: a block not touched reads back fine.
  auto other = tier->write(data.data(), data.size(), nullptr);
  tier->read(other, back.data(), nullptr)->wait();
  CHECK(back == data);
}

void test_corruption_all() {
  for (const auto& parent : spill_parents())
    for (bool direct : {true, false}) test_corruption(parent, direct);
}

// The cap refuses a write (nullptr, counted) instead of growing past it; space comes back.
void test_cap() {
  TempDir dir("/tmp");
  auto o = opts(dir.path, true);
  o.max_bytes = 1 * MiB;
  o.file_bytes = 256 * KiB;
  auto tier = FileTier::create(o);
  const auto data = random_bytes(100 * KiB, 7);
  std::vector<std::shared_ptr<FileTier::Spill>> spills;
  while (auto s = tier->write(data.data(), data.size(), nullptr)) {
    spills.push_back(s);
    CHECK_LE(spills.size(), 12u);
  }
  auto st = tier->stats();
  CHECK_EQ(spills.size(), 8u);  // two 100 KiB blocks (aligned: 2 x 100 KiB) per 256 KiB file
  CHECK_EQ(st.num_cap_hits, 1u);
  CHECK_EQ(st.num_disk_full, 0u);
  CHECK_LE(st.bytes_reserved, o.max_bytes);
  CHECK(tier->write(data.data(), 2 * MiB, nullptr) == nullptr);  // larger than the cap
  for (auto& s : spills) {
    std::vector<char> back(data.size());
    tier->read(s, back.data(), nullptr)->wait();
    CHECK(back == data);
  }
  spills.clear();
  tier->synchronize();
  CHECK_EQ(tier->stats().bytes_in_use, 0u);
  // A block larger than a file, within the cap: the free files are closed to make room for it.
  const auto big_data = random_bytes(600 * KiB, 11);
  auto big = tier->write(big_data.data(), big_data.size(), nullptr);
  CHECK(big != nullptr);
  big.reset();
  tier->synchronize();
  CHECK_TIER(*tier);
}

// ENOSPC from the file system (not the cap): a 1 MiB tmpfs mounted in this process's own
// mount namespace, so nothing outside sees it and it vanishes with the process.
bool g_small_fs = false;
std::string g_small_fs_dir;

void setup_small_fs() {
  // Must run before any thread starts: unshare(CLONE_NEWNS) refuses a multi-threaded process.
  char name[] = "/tmp/ckpt_offload_smallfs_XXXXXX";
  if (!::mkdtemp(name)) return;
  g_small_fs_dir = name;
  if (::unshare(CLONE_NEWNS) == 0 && ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 &&
      ::mount("tmpfs", name, "tmpfs", 0, "size=1m") == 0) {
    g_small_fs = true;
  } else {
    ::rmdir(name);
  }
}

void test_disk_full() {
  if (!g_small_fs) {
    std::printf("  skipped: cannot mount a small tmpfs here (needs CAP_SYS_ADMIN)\n");
    return;
  }
  {
    auto o = opts(g_small_fs_dir, true);
    o.file_bytes = 256 * KiB;  // no cap: the file system is the limit
    auto tier = FileTier::create(o);
    const auto data = random_bytes(64 * KiB, 8);
    std::vector<std::shared_ptr<FileTier::Spill>> spills;
    while (auto s = tier->write(data.data(), data.size(), nullptr)) {
      spills.push_back(s);
      CHECK_LE(spills.size(), 32u);
    }
    const auto st = tier->stats();
    CHECK_EQ(st.num_disk_full, 1u);
    CHECK_EQ(st.num_cap_hits, 0u);
    CHECK_GE(spills.size(), 8u);  // most of the 1 MiB was usable
    for (auto& s : spills) {
      std::vector<char> back(data.size());
      tier->read(s, back.data(), nullptr)->wait();
      CHECK(back == data);
    }
    spills.clear();
    tier->synchronize();
    tier->empty_cache();
    // All the space is back: a fresh block fits again.
    auto again = tier->write(data.data(), data.size(), nullptr);
    CHECK(again != nullptr);
    again->written()->wait();  // `data` must outlive the write
  }
  ::umount(g_small_fs_dir.c_str());
  ::rmdir(g_small_fs_dir.c_str());
}

void test_profiler_records() {
  TempDir dir("/tmp");
  auto tier = FileTier::create(opts(dir.path, true));
  const auto data = random_bytes(150 * KiB, 9);
  profiler::start();
  auto spill = tier->write(data.data(), data.size(), nullptr, nullptr, /*handle=*/42);
  std::vector<char> back(data.size());
  tier->read(spill, back.data(), nullptr, /*prefetch=*/true)->wait();
  profiler::stop();
  const auto snap = profiler::snapshot();
  CHECK_EQ(snap.disk.size(), 2u);
  CHECK(snap.disk[0].write);
  CHECK(!snap.disk[1].write);
  CHECK(snap.disk[1].prefetch);
  for (const auto& d : snap.disk) {
    CHECK_EQ(d.handle, 42u);
    CHECK_EQ(d.bytes, data.size());
    CHECK_GE(d.start_ns, 0);
    CHECK_LE(d.start_ns, d.end_ns);
  }
  CHECK_LE(snap.disk[0].end_ns, snap.disk[1].start_ns);  // the read ran after the write
}

void test_bad_options() {
  auto invalid = [](FileTierOptions o) {
    try {
      FileTier::create(o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  FileTierOptions o;
  o.dir = "/nonexistent/ckpt_offload";
  CHECK(invalid(o).find("spill_dir=/nonexistent/ckpt_offload is not an existing directory") != std::string::npos);
  o.dir = "/tmp";
  o.chunk_bytes = 1000;
  CHECK(invalid(o).find("chunk_bytes") != std::string::npos);
  o.chunk_bytes = kDefaultChunkBytes;
  o.io_threads = 0;
  CHECK(invalid(o).find("io_threads") != std::string::npos);
}

// The last owner of the tier may be a keepalive released on one of its own I/O threads.
void test_destroyed_on_worker() {
  TempDir dir("/tmp");
  std::weak_ptr<FileTier> weak;
  {
    auto tier = FileTier::create(opts(dir.path, false));
    weak = tier;
    const auto data = random_bytes(10 * KiB, 10);
    auto copied = std::make_shared<FenceEvent>(false);
    auto spill = tier->write(data.data(), data.size(), tier, copied);
    auto ticket = spill->written();
    spill.reset();
    tier.reset();
    CHECK(!weak.expired());
    copied->signal();
    ticket->wait();  // the worker released the keepalive (the tier) before marking it done
  }
  for (int i = 0; i < 500 && !weak.expired(); ++i) std::this_thread::sleep_for(10ms);
  CHECK(weak.expired());
  // The detached workers exit on their own and the core closes the file.
  for (int i = 0; i < 500 && open_files_in(dir.path); ++i) std::this_thread::sleep_for(10ms);
  CHECK_EQ(open_files_in(dir.path), 0);
}

// Many threads writing, reading back (some before the write has finished) and dropping blocks
// of random sizes, under a cap small enough to refuse some writes.
void test_threads() {
  TempDir dir("/tmp");
  auto o = opts(dir.path, true, 16 * KiB);
  o.max_bytes = 1536 * KiB;
  o.file_bytes = 256 * KiB;
  auto tier = FileTier::create(o);
  std::atomic<uint64_t> refused{0}, verified{0};
  auto worker = [&](int tid) {
    std::mt19937_64 rng(1234 + tid);
    struct Live {
      std::shared_ptr<FileTier::Spill> spill;
      std::shared_ptr<std::vector<char>> data;
    };
    std::vector<Live> live;
    for (int op = 0; op < 300; ++op) {
      if (live.size() < 6 && rng() % 3) {
        const size_t n = 1 + rng() % (rng() % 4 ? 20 * KiB : 300 * KiB);
        auto data = std::make_shared<std::vector<char>>(random_bytes(n, rng()));
        auto s = tier->write(data->data(), n, data);
        if (!s) {
          ++refused;
          continue;
        }
        live.push_back({s, data});
      } else if (!live.empty()) {
        const size_t i = rng() % live.size();
        std::vector<char> back(live[i].data->size() + 1, 'z');
        auto t = tier->read(live[i].spill, back.data(), nullptr, rng() % 2);
        t->wait();
        CHECK(std::memcmp(back.data(), live[i].data->data(), live[i].data->size()) == 0);
        CHECK_EQ(back.back(), 'z');
        ++verified;
        if (rng() % 2) {
          live[i] = live.back();
          live.pop_back();
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  tier->synchronize();
  const auto st = tier->stats();
  std::printf("  verified %llu reads, %llu writes refused by the cap\n",
              static_cast<unsigned long long>(verified.load()), static_cast<unsigned long long>(refused.load()));
  CHECK_GT(verified.load(), 100u);
  CHECK_GT(refused.load(), 0u);
  CHECK_EQ(st.num_cap_hits, refused.load());
  CHECK_EQ(st.bytes_in_use, 0u);
  CHECK_LE(st.peak_bytes_reserved, o.max_bytes);
  CHECK_EQ(st.checksum_errors + st.read_errors + st.write_errors, 0u);
  CHECK_TIER(*tier);
}

}  // namespace

int main() {
  setup_small_fs();
  check::run("crc32c", test_crc32c);
  check::run("round_trips", test_round_trips);
  check::run("named_files_unlinked", test_named_files_unlinked);
  check::run("ordering", test_ordering);
  check::run("drop_while_in_flight", test_drop_while_in_flight);
  check::run("corruption", test_corruption_all);
  check::run("cap", test_cap);
  check::run("disk_full", test_disk_full);
  check::run("profiler_records", test_profiler_records);
  check::run("bad_options", test_bad_options);
  check::run("destroyed_on_worker", test_destroyed_on_worker);
  check::run("threads", test_threads);
  return 0;
}

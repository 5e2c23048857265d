// Note [NUMA-local segments] (numa.h).
#include "numa.h"

#include <cerrno>
#include <cstdint>
#include <stdexcept>

#if defined(__linux__)
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__linux__) && defined(SYS_mbind) && defined(SYS_get_mempolicy) && defined(SYS_move_pages)
#define CKPT_OFFLOAD_HAVE_NUMA 1
#endif

namespace ckpt_offload {
namespace numa {

#ifdef CKPT_OFFLOAD_HAVE_NUMA
namespace {

// The kernel's constants (linux/mempolicy.h), spelled out: that header is not on every build host.
constexpr int kMpolPreferred = 1;
constexpr unsigned long kMpolFNode = 1, kMpolFAddr = 2, kMpolFMemsAllowed = 4;
constexpr int kMadvPopulateWrite = 23;  // Linux 5.14
// Node masks as large as any kernel's (MAX_NUMNODES is at most 1 << 10).
constexpr int kMaxNodes = 1024;
constexpr int kBitsPerLong = 8 * sizeof(unsigned long);
struct NodeMask {
  unsigned long bits[kMaxNodes / kBitsPerLong] = {};
  void set(int node) { bits[node / kBitsPerLong] |= 1UL << (node % kBitsPerLong); }
  bool has(int node) const { return bits[node / kBitsPerLong] >> (node % kBitsPerLong) & 1UL; }
  std::vector<int> nodes() const {
    std::vector<int> out;
    for (int n = 0; n < kMaxNodes; ++n)
      if (has(n)) out.push_back(n);
    return out;
  }
};

size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// get_mempolicy writes as many bits as maxnode asks for and refuses fewer than the kernel's
// node count; mbind reads maxnode - 1 bits (a historical off-by-one every caller matches).
long get_mempolicy(int* mode, NodeMask* mask, const void* addr, unsigned long flags) {
  return syscall(SYS_get_mempolicy, mode, mask ? mask->bits : nullptr, mask ? kMaxNodes : 0, addr, flags);
}

}  // namespace

std::vector<int> allowed_nodes() {
  NodeMask mask;
  if (get_mempolicy(nullptr, &mask, nullptr, kMpolFMemsAllowed) != 0) return {};
  return mask.nodes();
}

void* map_on_node(size_t bytes, int node) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  if (node >= 0 && node < kMaxNodes) {
    NodeMask mask;
    mask.set(node);
    // Before any page exists, so every fault below follows it. A refusal (a node gone offline
    // since check_node) leaves the default policy: placement() then shows where the pages went.
    (void)syscall(SYS_mbind, p, bytes, kMpolPreferred, mask.bits, static_cast<unsigned long>(kMaxNodes + 1), 0u);
  }
  // Fault every page in now, so that the placement is made (and measurable) at allocation: one
  // call where the kernel has MADV_POPULATE_WRITE, a write per page where it does not. The
  // madvise reports a lack of memory as an error, where touching would wake the OOM killer.
  if (madvise(p, bytes, kMadvPopulateWrite) != 0) {
    if (errno != EINVAL) {
      munmap(p, bytes);
      return nullptr;
    }
    const size_t page = page_size();
    for (size_t off = 0; off < bytes; off += page) static_cast<volatile char*>(p)[off] = 0;
  }
  return p;
}

void unmap(void* ptr, size_t bytes) {
  if (ptr) munmap(ptr, bytes);
}

std::vector<std::pair<int, size_t>> placement(const void* ptr, size_t bytes) {
  const size_t page = page_size();
  const uintptr_t start = reinterpret_cast<uintptr_t>(ptr) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(ptr) + bytes;
  std::vector<std::pair<int, size_t>> out;
  constexpr size_t kChunk = 4096;  // pages per move_pages call
  std::vector<void*> pages;
  std::vector<int> status;
  for (uintptr_t at = start; at < end;) {
    pages.clear();
    for (; at < end && pages.size() < kChunk; at += page) pages.push_back(reinterpret_cast<void*>(at));
    status.assign(pages.size(), -1);
    // No target nodes: move_pages only reports each page's node (or -ENOENT when not present).
    if (syscall(SYS_move_pages, 0, pages.size(), pages.data(), nullptr, status.data(), 0) != 0) return {};
    for (int node : status) {
      if (node < 0) continue;
      auto it = out.begin();
      while (it != out.end() && it->first < node) ++it;
      if (it == out.end() || it->first != node) it = out.insert(it, {node, 0});
      it->second += page;
    }
  }
  return out;
}

int node_of(const void* ptr) {
  int node = -1;
  if (get_mempolicy(&node, nullptr, ptr, kMpolFNode | kMpolFAddr) != 0) return -1;
  return node;
}

bool policy_of(const void* ptr, int* mode, std::vector<int>* nodes) {
  NodeMask mask;
  int m = -1;
  if (get_mempolicy(&m, &mask, ptr, kMpolFAddr) != 0) return false;
  if (mode) *mode = m;
  if (nodes) *nodes = mask.nodes();
  return true;
}

#else  // no NUMA system calls: nothing to bind, nothing to report

std::vector<int> allowed_nodes() { return {}; }
void* map_on_node(size_t, int) { return nullptr; }
void unmap(void*, size_t) {}
std::vector<std::pair<int, size_t>> placement(const void*, size_t) { return {}; }
int node_of(const void*) { return -1; }
bool policy_of(const void*, int*, std::vector<int>*) { return false; }

#endif

void check_node(int node) {
  const std::vector<int> allowed = allowed_nodes();
  for (int n : allowed)
    if (n == node) return;
  if (allowed.empty())
    throw std::invalid_argument("ckpt_offload: numa_node=" + std::to_string(node) +
                                ": this system gives no NUMA placement (get_mempolicy reports no node this "
                                "process may use); pass numa_node=None");
  std::string list;
  for (int n : allowed) list += (list.empty() ? "" : ", ") + std::to_string(n);
  throw std::invalid_argument("ckpt_offload: numa_node=" + std::to_string(node) +
                              " is not a node this process may place memory on (allowed: " + list +
                              "); pass one of those, 'auto' (the GPU's node) or None");
}

}  // namespace numa
}  // namespace ckpt_offload

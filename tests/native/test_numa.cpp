// NUMA-bound segments (Note [NUMA-local segments] in numa.h), against the real kernel: the
// policy set on the range, the node of every page, the placement the pool reports, and the
// nodes a process may not use. Skipped (exit 77) where the kernel gives no NUMA placement.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "host_pool.h"
#include "numa.h"

using namespace ckpt_offload;

namespace {

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));
std::vector<int> g_nodes;

using Placement = std::vector<std::pair<int, size_t>>;

std::string show(const Placement& p) {
  std::string s;
  for (const auto& np : p) s += "(" + std::to_string(np.first) + ", " + std::to_string(np.second) + ") ";
  return s;
}

// The node of every page of [p, p + bytes), read one page at a time with get_mempolicy.
void check_every_page_on(const void* p, size_t bytes, int node) {
  for (size_t off = 0; off < bytes; off += kPage) {
    const int at = numa::node_of(static_cast<const char*>(p) + off);
    CHECK_MSG(at == node, "page at offset " << off << " is on node " << at << ", not " << node);
  }
}

// The range's policy is "preferred: node", its pages are all there (on a host with several
// nodes, every allowed node is tried: a node other than the first-touch default proves the
// binding moved them), and placement() counts them.
void test_map_on_node() {
  for (int node : g_nodes) {
    const size_t bytes = 64 * kPage;
    void* p = numa::map_on_node(bytes, node);
    CHECK(p != nullptr);
    int mode = -1;
    std::vector<int> nodes;
    CHECK(numa::policy_of(p, &mode, &nodes));
    CHECK_EQ(mode, numa::kPolicyPreferred);
    CHECK_EQ(nodes.size(), 1u);
    CHECK_EQ(nodes[0], node);
    check_every_page_on(p, bytes, node);
    const Placement placed = numa::placement(p, bytes);
    CHECK_MSG(placed == Placement({{node, bytes}}), show(placed));
    std::memset(p, 0xab, bytes);  // writable, every byte
    numa::unmap(p, bytes);
  }
}

// Pages never touched are not counted: placement() measures, it does not assume.
void test_placement_counts_present_pages_only() {
  const size_t bytes = 16 * kPage;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(p != MAP_FAILED);
  CHECK(numa::placement(p, bytes).empty());
  for (size_t off = 0; off < bytes / 2; off += kPage) static_cast<char*>(p)[off] = 1;
  size_t counted = 0;
  for (const auto& np : numa::placement(p, bytes)) counted += np.second;
  CHECK_EQ(counted, bytes / 2);
  munmap(p, bytes);
}

void test_check_node() {
  numa::check_node(g_nodes.front());  // allowed: no throw
  for (int bad : {-1, g_nodes.back() + 1, 5000}) {
    bool threw = false;
    try {
      numa::check_node(bad);
    } catch (const std::invalid_argument& e) {
      threw = true;
      const std::string what = e.what();
      CHECK_MSG(what.find("numa_node=" + std::to_string(bad)) != std::string::npos, what);
      CHECK_MSG(what.find("allowed: " + std::to_string(g_nodes.front())) != std::string::npos, what);
    }
    CHECK(threw);
  }
}

// A pool on a bound backend: its blocks live in memory with the node's policy, bytes_by_node()
// follows the segments as they are taken and given back, and the invariants hold.
void test_pool_on_node() {
  const int node = g_nodes.back();
  const size_t seg = 256 * kPage;
  HostPool pool(std::make_unique<PageableBackend>(node), /*max_bytes=*/0, seg);
  CHECK_EQ(pool.backend().numa_node(), node);
  CHECK(pool.bytes_by_node().empty());
  HostPool::Block* a = pool.allocate(seg / 8);  // carved from a segment of seg bytes
  HostPool::Block* b = pool.allocate(2 * seg);  // a segment of its own
  CHECK(a && b);
  const size_t reserved = pool.stats().bytes_reserved;
  CHECK_EQ(reserved, 3 * seg);
  CHECK_MSG(pool.bytes_by_node() == Placement({{node, reserved}}), show(pool.bytes_by_node()));
  int mode = -1;
  std::vector<int> nodes;
  CHECK(numa::policy_of(HostPool::data(b), &mode, &nodes));
  CHECK_EQ(mode, numa::kPolicyPreferred);
  check_every_page_on(HostPool::data(b), HostPool::size(b), node);
  CHECK_POOL(pool);
  pool.free(b);
  CHECK_EQ(pool.empty_cache(), 2 * seg);  // b's segment goes back; a's stays
  CHECK_MSG(pool.bytes_by_node() == Placement({{node, seg}}), show(pool.bytes_by_node()));
  CHECK_POOL(pool);
  pool.free(a);
  pool.empty_cache();
  CHECK(pool.bytes_by_node().empty());
  CHECK_POOL_EMPTY(pool);
}

// An unbound pool places nothing and reports nothing: what every pool did before.
void test_unbound_pool_reports_no_placement() {
  HostPool pool(std::make_unique<PageableBackend>(), 0, 64 * kPage);
  CHECK_EQ(pool.backend().numa_node(), -1);
  HostPool::Block* a = pool.allocate(kPage);
  CHECK(a != nullptr);
  CHECK(pool.bytes_by_node().empty());
  pool.free(a);
  CHECK_POOL(pool);
}

}  // namespace

int main() {
  g_nodes = numa::allowed_nodes();
  if (g_nodes.empty()) {
    std::printf("skipped: this kernel gives no NUMA placement (get_mempolicy(MPOL_F_MEMS_ALLOWED) failed)\n");
    return 77;
  }
  std::printf("nodes this process may use: %zu (first %d, last %d)\n", g_nodes.size(), g_nodes.front(), g_nodes.back());
  check::run("map_on_node", test_map_on_node);
  check::run("placement_counts_present_pages_only", test_placement_counts_present_pages_only);
  check::run("check_node", test_check_node);
  check::run("pool_on_node", test_pool_on_node);
  check::run("unbound_pool_reports_no_placement", test_unbound_pool_reports_no_placement);
  std::printf("all NUMA tests passed\n");
  return 0;
}

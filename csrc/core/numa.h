// Host memory on a chosen NUMA node, and where a range's pages lie, through the kernel's own
// system calls (mbind, get_mempolicy, move_pages): no libnuma.
//
// Note [NUMA-local segments]
// On a host with several NUMA nodes a copy between a GPU and host memory on another node crosses
// the inter-socket link, at a fraction of the bandwidth of memory on the GPU's own node. Pages
// are placed where they are first touched, so a pool filled from whichever core the process ran
// on may sit on the far node. A pool bound to a node (co.HostPool(numa_node=...), whose "auto"
// picks the GPU's node from sysfs) takes every segment as anonymous memory from mmap, sets the
// range's policy with mbind before any page exists, then faults every page in (so the pages are
// placed now, by that policy) and, for the pinned backends, pins them with cudaHostRegister:
// cudaHostAlloc allocates and touches its pages inside the driver, where no policy of ours set
// on the range could apply first. The policy is MPOL_PREFERRED, not MPOL_BIND: a node that is
// full gives pages from another node instead of having the kernel kill the process, and the pool
// reports where the pages really are (placement(), measured with move_pages when the segment is
// taken; pinned pages do not move after that). An unbound pool (numa_node < 0) allocates as it
// always has.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace ckpt_offload {
namespace numa {

// The nodes this process may place memory on (get_mempolicy(MPOL_F_MEMS_ALLOWED): the cpuset's
// mems, which a container may narrow), ascending; empty where the kernel has no NUMA support.
std::vector<int> allowed_nodes();

// Throws std::invalid_argument naming numa_node and the allowed nodes when `node` is not one of
// allowed_nodes().
void check_node(int node);

// `bytes` (a multiple of the page size) of anonymous memory whose pages the kernel prefers on
// `node`, every page faulted in; nullptr when the memory cannot be had. Where the kernel refuses
// the policy the memory is still returned, placed as the kernel places it (placement() says where).
void* map_on_node(size_t bytes, int node);
// Gives back what map_on_node returned.
void unmap(void* ptr, size_t bytes);

// Where the pages of [ptr, ptr + bytes) are: (node, bytes) pairs, ascending by node. Pages not
// present (never touched) are not counted; empty where the kernel cannot say.
std::vector<std::pair<int, size_t>> placement(const void* ptr, size_t bytes);

// The node of the page holding `ptr` (get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR)), -1 when unknown.
int node_of(const void* ptr);
// The policy of the mapping holding `ptr` (get_mempolicy(MPOL_F_ADDR)): its mode (MPOL_DEFAULT 0,
// MPOL_PREFERRED 1, MPOL_BIND 2, ...) and its nodes; false when the kernel cannot say.
bool policy_of(const void* ptr, int* mode, std::vector<int>* nodes);
constexpr int kPolicyPreferred = 1;

}  // namespace numa
}  // namespace ckpt_offload

// BlockAllocator: best-fit ranges inside regions, split on allocation, coalesced on free.
//
// It hands out offsets, not pointers, so one implementation serves any space that comes in
// large regions and is carved into blocks: file extents of the FileTier today, HostPool's
// memory segments (region = segment, offset = ptr - base). It only does the
// bookkeeping: it does not lock (the owner holds its own mutex), does not know about copies
// (a block waiting for a copy is simply still allocated), and does not get regions itself.
//
// Ties between equally good free ranges go to the lowest region, then the lowest offset, so
// allocations pack into the first regions and the last ones become wholly free (and can be
// given back) as soon as possible.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <iterator>
#include <stdexcept>
#include <string>
#include <tuple>

namespace ckpt_offload {

class BlockAllocator {
 public:
  struct Range {
    uint32_t region = 0;
    uint64_t offset = 0;
    uint64_t size = 0;  // a multiple of the alignment
  };

  explicit BlockAllocator(uint64_t alignment) : alignment_(alignment) {}

  uint64_t alignment() const { return alignment_; }
  uint64_t round(uint64_t bytes) const { return (bytes + alignment_ - 1) / alignment_ * alignment_; }

  // A new, wholly free region of `size` bytes (a multiple of the alignment).
  void add_region(uint32_t region, uint64_t size) {
    regions_[region][0] = Node{size, true};
    free_.insert(Key{size, region, 0});
    free_bytes_ += size;
  }

  // The smallest free range that fits `bytes` (rounded up to the alignment), split so that
  // `out->size` is exactly the rounded size. False when no free range fits.
  bool allocate(uint64_t bytes, Range* out) {
    const uint64_t need = round(bytes == 0 ? 1 : bytes);
    if (need < bytes) return false;  // rounding wrapped around
    auto it = free_.lower_bound(Key{need, 0, 0});
    if (it == free_.end()) return false;
    const auto [size, region, offset] = *it;
    free_.erase(it);
    auto& nodes = regions_[region];
    Node& n = nodes[offset];
    n.free = false;
    if (size > need) {
      n.size = need;
      nodes[offset + need] = Node{size - need, true};
      free_.insert(Key{size - need, region, offset + need});
    }
    free_bytes_ -= need;
    *out = Range{region, offset, need};
    return true;
  }

  // Returns a range that allocate() gave out; it merges with free neighbours.
  void free(const Range& r) {
    auto& nodes = regions_.at(r.region);
    auto it = nodes.find(r.offset);
    if (it == nodes.end() || it->second.free || it->second.size != r.size)
      throw std::logic_error("ckpt_offload: BlockAllocator::free of a range that is not allocated");
    it->second.free = true;
    free_bytes_ += r.size;
    if (it != nodes.begin()) {
      auto prev = std::prev(it);
      if (prev->second.free) {
        free_.erase(Key{prev->second.size, r.region, prev->first});
        prev->second.size += it->second.size;
        nodes.erase(it);
        it = prev;
      }
    }
    auto next = std::next(it);
    if (next != nodes.end() && next->second.free) {
      free_.erase(Key{next->second.size, r.region, next->first});
      it->second.size += next->second.size;
      nodes.erase(next);
    }
    free_.insert(Key{it->second.size, r.region, it->first});
  }

  // True when nothing in the region is allocated.
  bool region_is_free(uint32_t region) const {
    auto it = regions_.find(region);
    return it != regions_.end() && it->second.size() == 1 && it->second.begin()->second.free;
  }

  // Forgets a wholly free region (the owner then gives its space back).
  void remove_region(uint32_t region) {
    if (!region_is_free(region))
      throw std::logic_error("ckpt_offload: BlockAllocator::remove_region of a region in use");
    const uint64_t size = regions_.at(region).begin()->second.size;
    free_.erase(Key{size, region, 0});
    free_bytes_ -= size;
    regions_.erase(region);
  }

  // True when `r` is a range allocate() gave out and free() has not taken back. Test-only (the
  // owners' invariant checks).
  bool is_allocated(const Range& r) const {
    auto region = regions_.find(r.region);
    if (region == regions_.end()) return false;
    auto it = region->second.find(r.offset);
    return it != region->second.end() && !it->second.free && it->second.size == r.size;
  }

  uint64_t free_bytes() const { return free_bytes_; }
  size_t num_regions() const { return regions_.size(); }

  // The ranges tile every region, free ranges are coalesced and indexed. Test-only.
  bool check_invariants(std::string* why) const {
    std::string err;  // Note [No iostreams in the extension] (text.h)
    size_t free_count = 0;
    uint64_t free_bytes = 0;
    for (const auto& [region, nodes] : regions_) {
      uint64_t expect = 0;
      bool prev_free = false;
      for (const auto& [offset, n] : nodes) {
        if (offset != expect)
          err += "gap or overlap in region " + std::to_string(region) + " at " + std::to_string(offset) + "; ";
        if (n.size == 0 || n.size % alignment_) err += "bad range size " + std::to_string(n.size) + "; ";
        if (n.free) {
          ++free_count;
          free_bytes += n.size;
          if (!free_.count(Key{n.size, region, offset})) err += "free range missing from the index; ";
          if (prev_free) err += "adjacent free ranges not coalesced; ";
        }
        prev_free = n.free;
        expect = offset + n.size;
      }
    }
    if (free_count != free_.size()) err += "free index holds ranges of no region; ";
    if (free_bytes != free_bytes_) err += "free_bytes mismatch; ";
    if (why) *why = err;
    return err.empty();
  }

 private:
  struct Node {
    uint64_t size;
    bool free;
  };
  using Key = std::tuple<uint64_t, uint32_t, uint64_t>;  // size, region, offset: best fit first

  uint64_t alignment_;
  std::map<uint32_t, std::map<uint64_t, Node>> regions_;  // by offset: neighbours for coalescing
  std::set<Key> free_;
  uint64_t free_bytes_ = 0;
};

}  // namespace ckpt_offload

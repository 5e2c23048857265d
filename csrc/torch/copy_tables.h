// The host copies made so far, for the saved tensors after them to share (Note [Copy tables]).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "offloaded_storage.h"
#include "saved_tensor.h"

namespace ckpt_offload {

// The byte span of its storage a saved tensor to offload reaches, at the storage's version.
struct Span {
  int64_t lo = 0, hi = 0, itemsize = 1;
  uint32_t version = 0;
  int64_t bytes() const { return hi - lo; }
};

// Note [Copy tables]
// The host copies made this activation (or across activations, with keep_dedup), by the
// storage they copy, for the tensors after them to share: exact copies (Note [One copy per
// storage]) and narrow ones (Note [Low-precision storage]; apart: their host bytes are converted
// ones, which only a saved tensor of the same span can share). Every reference is weak: a table
// keeps neither a storage nor a copy alive, and a copy whose saved tensors are all gone is
// dropped when a look-up meets it (find_live). Read and written under the tables' own lock
// (Note [Lock order]).
class CopyTables {
 public:
  // An exact copy of t's storage that a new view joins (Note [One copy per storage]).
  struct Touched {
    std::shared_ptr<OffloadedStorage> held;
    int64_t lo = 0, hi = 0;
    bool extendable = false;
    int64_t counted = 0;  // Exact::counted
  };

  // The exact copy of t's storage (same version) that holds `span`, or null; then `touched`
  // gets the copies whose 512-byte cells `wide` shares.
  std::shared_ptr<OffloadedStorage> find_exact(const at::Tensor& t, const Span& span, const Span& wide,
                                               std::vector<Touched>* touched);
  // The narrow copy of exactly t's span (same storage, first and last byte, dtype, version)
  // made earlier, or null.
  std::shared_ptr<ConvertedCopy> find_converted(const at::Tensor& t, const Span& span);
  // Records a new exact copy of t's storage: `copy` holds `held` (the widened span for a copy of
  // its own, which can take more pieces: `own`; the span itself for a batch member).
  void add_exact(const at::Tensor& t, const Span& span, const Span& held, const std::shared_ptr<OffloadedStorage>& copy,
                 bool own);
  // Records a new narrow copy of t's span.
  void add_converted(const at::Tensor& t, const Span& span, const std::shared_ptr<ConvertedCopy>& copy);
  // The last step of a join (Note [One copy per storage]): the copies `touched` (that find_exact
  // found) become one, the first, extended by `pieces` to [lo, hi). Null (and nothing changed)
  // when another thread changed them meanwhile or one of them can no longer grow: the view then
  // gets a copy of its own. `*counted`: what the joined copy counts in bytes_offloaded and
  // bytes_stored beyond what its views had counted.
  std::shared_ptr<OffloadedStorage> join(const at::Tensor& t, const Span& span, std::vector<Touched>& touched,
                                         std::vector<OffloadedStorage::Piece> pieces, int64_t lo, int64_t hi,
                                         int64_t* counted);
  void clear();

 private:
  // One exact host copy of a span of a storage.
  struct Exact {
    using Copy = OffloadedStorage;
    std::weak_ptr<OffloadedStorage> copy;
    uint32_t version = 0;
    int64_t lo = 0, hi = 0;   // byte range of the storage held on the host
    bool extendable = false;  // a copy of its own (not a batch member): can take more pieces
    int64_t counted = 0;      // its bytes in bytes_offloaded / bytes_stored (a joined copy: hi - lo)
  };
  // One narrow copy of a span.
  struct Converted {
    using Copy = ConvertedCopy;
    std::weak_ptr<ConvertedCopy> copy;
    uint32_t version = 0;
    int64_t lo = 0, hi = 0;
    c10::ScalarType dtype = c10::kFloat;
    // Its elements are the span's (non-overlapping and dense); else only a view of the same
    // sizes and strides has the same elements, and so the same fp8 scale.
    bool dense = true;
    std::vector<int64_t> sizes, strides;  // when not dense
  };

  // The copies of one kind, by the storage they copy.
  template <class Group>
  struct Table {
    struct Entry {
      c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
      c10::SmallVector<Group, 1> groups;  // disjoint copies of one storage (or of other versions)
    };
    std::unordered_map<const void*, Entry> entries;
    size_t prune_at = 1024;  // drop expired entries when the table grows past this

    // The entry of `storage`, or null (also when another storage lives at a freed one's address).
    Entry* find(c10::StorageImpl* storage) {
      auto it = entries.find(storage);
      if (it == entries.end() || it->second.storage.lock().get() != storage) return nullptr;
      return &it->second;
    }
    // The copies of `storage` still alive, in order: the first for which match(group, copy) is
    // true, or null. A copy whose saved tensors are all gone is dropped on the way. `match` may
    // take `copy` (move from it) when it returns false.
    template <class Match>
    std::shared_ptr<typename Group::Copy> find_live(c10::StorageImpl* storage, Match&& match) {
      Entry* e = find(storage);
      if (!e) return nullptr;
      for (size_t i = 0; i < e->groups.size();) {
        Group& g = e->groups[i];
        auto copy = g.copy.lock();
        if (!copy) {
          e->groups.erase(e->groups.begin() + i);
          continue;
        }
        ++i;
        if (match(g, copy)) return copy;
      }
      return nullptr;
    }
    void add(const at::Tensor& t, Group g) {
      if (entries.size() >= prune_at) {
        for (auto it = entries.begin(); it != entries.end();) {
          auto& groups = it->second.groups;
          groups.erase(std::remove_if(groups.begin(), groups.end(), [](const Group& x) { return x.copy.expired(); }),
                       groups.end());
          if (groups.empty() || it->second.storage.expired())
            it = entries.erase(it);
          else
            ++it;
        }
        prune_at = std::max<size_t>(1024, 2 * entries.size());
      }
      c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
      Entry& e = entries[storage];
      if (e.storage.lock().get() != storage) {  // new, or a freed storage's address reused
        e.storage = t.storage().getWeakStorageImpl();
        e.groups.clear();
      }
      e.groups.push_back(std::move(g));
    }
    void clear() { entries.clear(); }
  };

  std::mutex mu_;
  Table<Exact> exact_;
  Table<Converted> converted_;
};

}  // namespace ckpt_offload

// Note [Copy tables]: the host copies made so far, looked up and joined under one lock.
#include "copy_tables.h"

namespace ckpt_offload {

std::shared_ptr<OffloadedStorage> CopyTables::find_exact(const at::Tensor& t, const Span& span, const Span& wide,
                                                         std::vector<Touched>* touched) {
  std::lock_guard<std::mutex> lock(mu_);
  return exact_.find_live(t.storage().unsafeGetStorageImpl(),
                          [&](const Exact& g, std::shared_ptr<OffloadedStorage>& copy) {
                            if (g.version != span.version) return false;
                            if (span.lo >= g.lo && span.hi <= g.hi) {
                              touched->clear();
                              return true;
                            }
                            // Shares a 512-byte cell with this copy: joins it (Note [One copy per storage]).
                            if (wide.lo < g.hi && wide.hi > g.lo)
                              touched->push_back(Touched{std::move(copy), g.lo, g.hi, g.extendable, g.counted});
                            return false;
                          });
}

std::shared_ptr<ConvertedCopy> CopyTables::find_converted(const at::Tensor& t, const Span& span) {
  std::lock_guard<std::mutex> lock(mu_);
  // The same bytes, read as the same elements at the same version: converting them again
  // would give the same bits (fp8's scale is their amax), so they are shared. Spans that only
  // overlap convert on their own.
  return converted_.find_live(t.storage().unsafeGetStorageImpl(), [&](const Converted& g,
                                                                      const std::shared_ptr<ConvertedCopy>&) {
    return g.version == span.version && g.lo == span.lo && g.hi == span.hi && g.dtype == t.scalar_type() &&
           (g.dense ? t.is_non_overlapping_and_dense() : t.sizes().equals(g.sizes) && t.strides().equals(g.strides));
  });
}

void CopyTables::add_exact(const at::Tensor& t, const Span& span, const Span& held,
                           const std::shared_ptr<OffloadedStorage>& copy, bool own) {
  Exact g;
  g.copy = copy;
  g.version = span.version;
  g.lo = held.lo;
  g.hi = held.hi;
  g.extendable = own;
  g.counted = span.bytes();
  std::lock_guard<std::mutex> lock(mu_);
  exact_.add(t, std::move(g));
}

void CopyTables::add_converted(const at::Tensor& t, const Span& span, const std::shared_ptr<ConvertedCopy>& copy) {
  Converted g;
  g.copy = copy;
  g.version = span.version;
  g.lo = span.lo;
  g.hi = span.hi;
  g.dtype = t.scalar_type();
  g.dense = t.is_non_overlapping_and_dense();
  if (!g.dense) {
    g.sizes = t.sizes().vec();
    g.strides = t.strides().vec();
  }
  std::lock_guard<std::mutex> lock(mu_);
  converted_.add(t, std::move(g));
}

std::shared_ptr<OffloadedStorage> CopyTables::join(const at::Tensor& t, const Span& span, std::vector<Touched>& touched,
                                                   std::vector<OffloadedStorage::Piece> pieces, int64_t lo, int64_t hi,
                                                   int64_t* counted) {
  const std::shared_ptr<OffloadedStorage>& target = touched.front().held;
  std::lock_guard<std::mutex> lock(mu_);
  auto* entry = exact_.find(t.storage().unsafeGetStorageImpl());
  if (!entry) return nullptr;
  auto& groups = entry->groups;
  // Another thread may have changed these copies since find_exact: then this view gets a copy
  // of its own (correct, if not minimal).
  std::vector<size_t> at;
  for (const auto& g : touched) {
    size_t i = 0;
    while (i < groups.size() && !(groups[i].copy.lock() == g.held && groups[i].lo == g.lo && groups[i].hi == g.hi &&
                                  groups[i].version == span.version))
      ++i;
    if (i == groups.size()) return nullptr;
    at.push_back(i);
  }
  std::vector<std::pair<std::shared_ptr<OffloadedStorage>, std::pair<std::vector<OffloadedStorage::Piece>, int>>>
      absorbed;
  int pending = 0;
  bool ok = true;
  for (size_t k = 1; k < touched.size() && ok; ++k) {
    std::vector<OffloadedStorage::Piece> theirs;
    int their_pending = 0;
    ok = touched[k].held->absorb_into(target, &theirs, &their_pending);
    if (!ok) break;
    pending += their_pending;
    for (const auto& p : theirs) pieces.push_back(p);
    absorbed.push_back({touched[k].held, {std::move(theirs), their_pending}});
  }
  ok = ok && target->extend(std::move(pieces), pending);
  if (!ok) {
    for (auto& a : absorbed) a.first->restore(std::move(a.second.first), a.second.second);
    return nullptr;
  }
  groups[at[0]].lo = lo;
  groups[at[0]].hi = hi;
  // The joined copy holds lo..hi on the host: what its views had counted becomes that.
  int64_t before = 0;
  for (const auto& g : touched) before += g.counted;
  groups[at[0]].counted = hi - lo;
  *counted = hi - lo - before;
  std::sort(at.begin() + 1, at.end());
  for (size_t k = at.size(); k-- > 1;) groups.erase(groups.begin() + at[k]);
  return target;
}

void CopyTables::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  exact_.clear();
  converted_.clear();
}

}  // namespace ckpt_offload

#include "counters.h"

namespace ckpt_offload {

const char* keep_reason_name(KeepReason r) {
  switch (r) {
#define CKPT_OFFLOAD_KEEP_CASE(e, name) \
  case KeepReason::e:                   \
    return name;
    CKPT_OFFLOAD_KEEP_REASONS(CKPT_OFFLOAD_KEEP_CASE)
#undef CKPT_OFFLOAD_KEEP_CASE
    default:
      return "unknown";
  }
}

namespace {
// The `merge` column of the tables, as Python reads it.
constexpr const char* kStatMergeSum = "sum";
constexpr const char* kStatMergeMax = "max";
constexpr const char* kStatMergePerReason = "per_reason";
constexpr const char* kStatMergeState = "state";
constexpr const char* kStatMergeName = "name";
constexpr const char* kStatMergeByClass = "by_class";
}  // namespace

const std::vector<StatKey>& stats_keys() {
  // Counters first, then the derived keys: the order Packer::stats() builds its dict in.
  static const std::vector<StatKey> keys = {
#define CKPT_OFFLOAD_STAT_KEY(key, merge) {#key, kStatMerge##merge},
      CKPT_OFFLOAD_COUNTERS(CKPT_OFFLOAD_STAT_KEY) CKPT_OFFLOAD_DERIVED_STATS(CKPT_OFFLOAD_STAT_KEY)
#undef CKPT_OFFLOAD_STAT_KEY
  };
  return keys;
}

}  // namespace ckpt_offload

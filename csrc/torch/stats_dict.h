// A stats table as a Python dict (Note [Stats tables] in csrc/core/stats_table.h).
//
//   CKPT_OFFLOAD_STATS_EXTRA(PoolExtra, CKPT_OFFLOAD_POOL_STATS);  // one py::object per KEY row
//   PoolExtra extra;
//   extra.backend = py::str(pool.backend_name());
//   py::dict d = CKPT_OFFLOAD_STATS_DICT(CKPT_OFFLOAD_POOL_STATS, stats, extra);
//
// The dict holds every row but the Internal fields, in the table's order; a KEY row the caller
// did not fill is None.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <vector>

#include "../core/stats_table.h"

namespace ckpt_offload {

// Cap: 0 means no cap, shown as None.
inline pybind11::object stats_cap(size_t v) {
  return v ? pybind11::object(pybind11::int_(v)) : pybind11::object(pybind11::none());
}

// A table's keys as the tuple Python reads (_C.POOL_STATS_KEYS, ...).
inline pybind11::tuple stats_keys_tuple(const std::vector<const char*>& keys) {
  pybind11::tuple t(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) t[i] = pybind11::str(keys[i]);
  return t;
}

}  // namespace ckpt_offload

#define CKPT_OFFLOAD_STATS_EXTRA_MEMBER(key) pybind11::object key = pybind11::none();
#define CKPT_OFFLOAD_STATS_EXTRA(name, TABLE)                                                      \
  struct name {                                                                                    \
    TABLE(CKPT_OFFLOAD_STATS_NOTHING, CKPT_OFFLOAD_STATS_NOTHING, CKPT_OFFLOAD_STATS_EXTRA_MEMBER) \
  }

#define CKPT_OFFLOAD_STATS_DICT_Value(d, s, key) d[#key] = s.key;
#define CKPT_OFFLOAD_STATS_DICT_Cap(d, s, key) d[#key] = ::ckpt_offload::stats_cap(s.key);
#define CKPT_OFFLOAD_STATS_DICT_Internal(d, s, key)
#define CKPT_OFFLOAD_STATS_DICT_FIELD(type, key, form) CKPT_OFFLOAD_STATS_DICT_##form(stats_d_, stats_s_, key)
#define CKPT_OFFLOAD_STATS_DICT_PEAK(type, key, of) stats_d_[#key] = stats_s_.key;
#define CKPT_OFFLOAD_STATS_DICT_KEY(key) stats_d_[#key] = stats_e_.key;
// An expression: the dict of `stats` (the table's struct) and `extra` (its KEY rows).
#define CKPT_OFFLOAD_STATS_DICT(TABLE, stats, extra)                                                \
  [&](const auto& stats_s_, const auto& stats_e_) {                                                 \
    pybind11::dict stats_d_;                                                                        \
    TABLE(CKPT_OFFLOAD_STATS_DICT_FIELD, CKPT_OFFLOAD_STATS_DICT_PEAK, CKPT_OFFLOAD_STATS_DICT_KEY) \
    return stats_d_;                                                                                \
  }(stats, extra)

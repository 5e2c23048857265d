// Note [Stats tables]
// A family of stats (the pool's, the disk tier's) is listed once, as a table of rows, and its
// struct, its reset_peaks(), the dict the bindings build and the key list Python reads
// (_C.POOL_STATS_KEYS, ...) are all generated from it. The table is a macro of three row kinds,
// TABLE(FIELD, PEAK, KEY), in the dict's order:
//
//   FIELD(type, key, form)  a member of the struct; `form` says how the dict shows it:
//                           Value (as it is), Cap (0 shows as None: no cap), or Internal
//                           (not in the dict: a raw count a KEY row below is computed from).
//   PEAK(type, key, of)     a member holding the largest `of` seen; reset_peaks() sets it back
//                           to `of`.
//   KEY(key)                a key of the dict that is not a member (a name, a rate computed
//                           from members, another object's count): the bindings fill it, in a
//                           struct generated from the same rows, so a key cannot be forgotten.
//
// A new stat is one row. This header is plain C++: the core knows no Python, the torch layer's
// stats_dict.h turns a table into a dict.
#pragma once

#include <cstddef>
#include <vector>

// Generators used inside a struct: its members, and reset_peaks().
#define CKPT_OFFLOAD_STATS_MEMBER(type, key, form) type key{};
#define CKPT_OFFLOAD_STATS_PEAK_MEMBER(type, key, of) type key{};
#define CKPT_OFFLOAD_STATS_NOTHING(...)
#define CKPT_OFFLOAD_STATS_RESET_PEAK(type, key, of) key = of;

#define CKPT_OFFLOAD_STATS_STRUCT_BODY(TABLE)                                                                         \
  TABLE(CKPT_OFFLOAD_STATS_MEMBER, CKPT_OFFLOAD_STATS_PEAK_MEMBER, CKPT_OFFLOAD_STATS_NOTHING)                        \
  /* Every PEAK row back to the value it is the peak of. */                                                           \
  void reset_peaks() { TABLE(CKPT_OFFLOAD_STATS_NOTHING, CKPT_OFFLOAD_STATS_RESET_PEAK, CKPT_OFFLOAD_STATS_NOTHING) } \
  /* The dict's keys, in order. */                                                                                    \
  static const std::vector<const char*>& keys() {                                                                     \
    static const std::vector<const char*> k = {CKPT_OFFLOAD_STATS_KEYS(TABLE)};                                       \
    return k;                                                                                                         \
  }

// The dict's keys, in order: every row but the Internal fields.
#define CKPT_OFFLOAD_STATS_KEY_OF_Value(key) #key,
#define CKPT_OFFLOAD_STATS_KEY_OF_Cap(key) #key,
#define CKPT_OFFLOAD_STATS_KEY_OF_Internal(key)
#define CKPT_OFFLOAD_STATS_FIELD_KEY(type, key, form) CKPT_OFFLOAD_STATS_KEY_OF_##form(key)
#define CKPT_OFFLOAD_STATS_PEAK_KEY(type, key, of) #key,
#define CKPT_OFFLOAD_STATS_KEY_KEY(key) #key,
#define CKPT_OFFLOAD_STATS_KEYS(TABLE) \
  TABLE(CKPT_OFFLOAD_STATS_FIELD_KEY, CKPT_OFFLOAD_STATS_PEAK_KEY, CKPT_OFFLOAD_STATS_KEY_KEY)

#include "low_precision.h"

#include <cmath>

namespace ckpt_offload {
namespace lowp {

void down_cpu(Source s, const void* src, int64_t n, Format f, void* dst, const uint32_t* word) {
  Scaling sc;
  if (format_scaled(f)) {
    uint32_t w;
    if (word) {
      w = *word;
    } else {
      float amax = 0.0f;
      bool inf = false;
      for (int64_t i = 0; i < n; ++i) {
        const float v = load(s, src, i);
        if (is_finite(v))
          amax = std::fmax(amax, std::fabs(v));
        else if (is_inf(v))
          inf = true;  // NaN: neither
      }
      w = scale_word(amax, inf);
    }
    std::memcpy(static_cast<char*>(dst) + amax_offset(f, n), &w, 4);
    sc = scaling_from_word(f, w);
  }
  if (format_bytes(f) == 2) {
    auto* out = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(encode(f, load(s, src, i), sc));
  } else {
    auto* out = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(encode(f, load(s, src, i), sc));
  }
}

void up_cpu(Source s, void* dst, int64_t n, Format f, const void* src) {
  Scaling sc;
  if (format_scaled(f)) {
    uint32_t w;
    std::memcpy(&w, static_cast<const char*>(src) + amax_offset(f, n), 4);
    sc = scaling_from_word(f, w);
  }
  if (format_bytes(f) == 2) {
    const auto* in = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) store(s, dst, i, decode(f, in[i], sc));
  } else {
    const auto* in = static_cast<const uint8_t*>(src);
    for (int64_t i = 0; i < n; ++i) store(s, dst, i, decode(f, in[i], sc));
  }
}

}  // namespace lowp
}  // namespace ckpt_offload

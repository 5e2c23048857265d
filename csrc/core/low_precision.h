// Low-precision storage of offloaded tensors (co.offload(store_dtype=...)): the element
// conversions, shared by the CPU loops (low_precision.cpp) and the CUDA kernels
// (low_precision_kernels.cu), so both round every value the same way. No torch here.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CKPT_HD __host__ __device__ __forceinline__
#else
#define CKPT_HD inline
#endif

namespace ckpt_offload {
namespace lowp {

// The element type of the tensor being stored (its storage span read as an element array).
enum class Source : int { F32 = 0, F64, F16, BF16 };
// The storage format. E4M3 / E5M2 keep a per-tensor scale (from the absolute maximum) with them.
enum class Format : int { None = 0, BF16, F16, E4M3, E5M2 };

CKPT_HD int format_bytes(Format f) { return (f == Format::BF16 || f == Format::F16) ? 2 : 1; }
CKPT_HD bool format_scaled(Format f) { return f == Format::E4M3 || f == Format::E5M2; }
inline int source_bytes(Source s) { return s == Source::F64 ? 8 : (s == Source::F32 ? 4 : 2); }
// Bytes stored for n elements: the elements, then (scaled formats) the fp32 absolute maximum,
// 4-byte aligned. The maximum travels with the data in the same copy, so neither direction
// synchronizes with the device to learn it.
inline int64_t stored_bytes(Format f, int64_t n) {
  const int64_t data = n * format_bytes(f);
  return format_scaled(f) ? ((data + 3) / 4) * 4 + 4 : data;
}
inline int64_t amax_offset(Format f, int64_t n) { return ((n * format_bytes(f) + 3) / 4) * 4; }

// The largest finite value of a scaled format: scale = amax / this, so the largest magnitude
// lands on it.
CKPT_HD float format_max(Format f) { return f == Format::E4M3 ? 448.0f : 57344.0f; }
CKPT_HD float scale_from_amax(Format f, float amax) {
  // amax is finite and >= 0 (NaN is skipped by fmaxf); 0 or inf: no scaling.
  return (amax > 0.0f && amax <= 3.402823466e38f) ? amax / format_max(f) : 1.0f;
}

CKPT_HD uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
CKPT_HD float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

// Round-to-nearest-even of m >> s.
CKPT_HD uint32_t rne_shift(uint32_t m, int s) {
  if (s <= 0) return m;
  if (s >= 32) return 0;
  const uint32_t q = m >> s;
  const uint32_t rem = m & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN. torch's rounding.
CKPT_HD uint16_t to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // c10's NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
CKPT_HD float from_bf16(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// fp32 -> a small float of `ebits` exponent and `mbits` mantissa bits (fp16: 5/10, e5m2: 5/2,
// e4m3fn: 4/3), round to nearest even, with subnormals. `fn`: no infinity (e4m3fn): the all-ones
// code is NaN and overflow gives NaN; otherwise overflow gives infinity. Returned in the low
// 1 + ebits + mbits bits. This is the rounding of torch's casts (c10's Half and Float8 types).
CKPT_HD uint32_t to_small(float x, int ebits, int mbits, bool fn) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 31) << (ebits + mbits);
  const uint32_t a = u & 0x7fffffffu;
  const int bias = (1 << (ebits - 1)) - 1;
  const uint32_t all_ones = (1u << (ebits + mbits)) - 1u;
  const uint32_t inf_code = ((1u << ebits) - 1u) << mbits;
  // c10's NaN codes: e4m3fn all ones, e5m2 0x7F, fp16 0x7E00 (sign kept).
  const uint32_t nan_code = fn ? all_ones : (mbits == 2 ? inf_code | 3u : inf_code | (1u << (mbits - 1)));
  const uint32_t max_code = fn ? all_ones - 1u : inf_code - 1u;  // largest finite
  if (a > 0x7f800000u) return sign | nan_code;
  if (a == 0x7f800000u) return sign | (fn ? nan_code : inf_code);
  const int e = static_cast<int>(a >> 23) - 127;  // fp32 denormals: far below every target
  if (e < -126) return sign;
  uint32_t code;
  if (e < 1 - bias) {
    // Subnormal in the target: a multiple of 2^(1 - bias - mbits).
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;  // value = m * 2^(e - 23)
    code = rne_shift(m, 23 + (1 - bias - mbits) - e);
  } else {
    // Normal: drop the low mantissa bits (a carry moves into the exponent), then rebias.
    code = rne_shift(a, 23 - mbits) - (static_cast<uint32_t>(127 - bias) << mbits);
  }
  if (code > max_code) code = fn ? nan_code : inf_code;
  return sign | code;
}

CKPT_HD float from_small(uint32_t c, int ebits, int mbits, bool fn) {
  const uint32_t sign = ((c >> (ebits + mbits)) & 1u) << 31;
  const uint32_t e = (c >> mbits) & ((1u << ebits) - 1u);
  const uint32_t m = c & ((1u << mbits) - 1u);
  const int bias = (1 << (ebits - 1)) - 1;
  if (fn && e == (1u << ebits) - 1u && m == (1u << mbits) - 1u) return bits_float(sign | 0x7fc00000u);
  if (!fn && e == (1u << ebits) - 1u) return bits_float(sign | (m ? 0x7fc00000u : 0x7f800000u));
  if (e == 0) {
    if (m == 0) return bits_float(sign);
    // m * 2^(1 - bias - mbits), exact in fp32: normalize the mantissa.
    int shift = 0;
    uint32_t mm = m;
    while (!(mm & (1u << mbits))) {
      mm <<= 1;
      ++shift;
    }
    const uint32_t exp32 = static_cast<uint32_t>(1 - bias - shift + 127);
    return bits_float(sign | (exp32 << 23) | ((mm & ((1u << mbits) - 1u)) << (23 - mbits)));
  }
  return bits_float(sign | ((e - bias + 127) << 23) | (m << (23 - mbits)));
}

CKPT_HD uint16_t to_f16(float x) { return static_cast<uint16_t>(to_small(x, 5, 10, false)); }
CKPT_HD float from_f16(uint16_t h) { return from_small(h, 5, 10, false); }

// One element into / out of format f (scaled formats: x / scale is what is rounded; the value
// comes back as code * scale, in fp32).
CKPT_HD uint32_t encode(Format f, float x, float scale) {
  switch (f) {
    case Format::BF16: return to_bf16(x);
    case Format::F16: return to_f16(x);
    case Format::E4M3: return to_small(x / scale, 4, 3, true);
    default: return to_small(x / scale, 5, 2, false);
  }
}
CKPT_HD float decode(Format f, uint32_t c, float scale) {
  switch (f) {
    case Format::BF16: return from_bf16(static_cast<uint16_t>(c));
    case Format::F16: return from_f16(static_cast<uint16_t>(c));
    case Format::E4M3: return from_small(c, 4, 3, true) * scale;
    default: return from_small(c, 5, 2, false) * scale;
  }
}

// CPU: n elements of `src` (type s) into `dst` (stored_bytes(f, n) bytes, the amax included).
void down_cpu(Source s, const void* src, int64_t n, Format f, void* dst);
// CPU: back from `src` (as down_cpu wrote it) into n elements of type s at `dst`.
void up_cpu(Source s, void* dst, int64_t n, Format f, const void* src);

#ifdef CKPT_OFFLOAD_WITH_CUDA
// The same on a CUDA stream (a cudaStream_t), asynchronously: a scaled format runs an amax
// pass then the cast; bf16 / fp16 one cast pass. Pointers are device memory; `dst` must stay
// alive until the stream has run them. Throws std::runtime_error on a launch error.
void down_cuda(Source s, const void* src, int64_t n, Format f, void* dst, void* stream);
void up_cuda(Source s, void* dst, int64_t n, Format f, const void* src, void* stream);
#endif

}  // namespace lowp
}  // namespace ckpt_offload

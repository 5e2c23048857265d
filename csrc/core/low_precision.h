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
// The storage format. E4M3 / E5M2 keep a per-tensor scale (from the absolute maximum of the
// tensor's own finite elements) with them.
enum class Format : int { None = 0, BF16, F16, E4M3, E5M2 };

CKPT_HD int format_bytes(Format f) { return (f == Format::BF16 || f == Format::F16) ? 2 : 1; }
CKPT_HD bool format_scaled(Format f) { return f == Format::E4M3 || f == Format::E5M2; }
inline int source_bytes(Source s) { return s == Source::F64 ? 8 : (s == Source::F32 ? 4 : 2); }
// Bytes stored for n elements: the elements, then (scaled formats) the scale word, 4-byte
// aligned. The word travels with the data in the same copy, so neither direction synchronizes
// with the device to learn it.
inline int64_t stored_bytes(Format f, int64_t n) {
  const int64_t data = n * format_bytes(f);
  return format_scaled(f) ? ((data + 3) / 4) * 4 + 4 : data;
}
CKPT_HD int64_t amax_offset(Format f, int64_t n) { return ((n * format_bytes(f) + 3) / 4) * 4; }

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
CKPT_HD bool is_inf(float x) { return (float_bits(x) & 0x7fffffffu) == 0x7f800000u; }
CKPT_HD bool is_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

// Note [fp8 scale word]
// The 4 bytes after a scaled format's codes: the fp32 absolute maximum of the tensor's own
// finite elements (NaN and +-inf skipped; gaps of a strided view's span are not its elements),
// and in bit 31 (free: the maximum is >= 0) whether the tensor holds an infinity.
//  - scale = amax / the format's largest finite value, so the largest finite magnitude lands on
//    it; x is stored as round(x / scale) and read back as code * scale (1 when amax is 0).
//  - e5m2 has infinities: +-inf are stored as themselves.
//  - e4m3fn has none: a tensor holding +-inf scales its finite values to 416 (the next code
//    down) instead of 448, and stores +-inf as the codes of +-448, which it leaves free.
//  - NaN stays NaN. A finite value beyond the scale's range (only the gaps of a strided view
//    can be) saturates to the largest finite code instead of becoming NaN or inf.
constexpr uint32_t kInfFlag = 0x80000000u;
CKPT_HD float format_max(Format f, bool inf) { return f == Format::E4M3 ? (inf ? 416.0f : 448.0f) : 57344.0f; }
struct Scaling {
  float scale = 1.0f;
  bool inf = false;  // the tensor holds an infinity (e4m3fn: its +-448 codes are +-inf)
};
CKPT_HD uint32_t scale_word(float amax, bool inf) { return float_bits(amax) | (inf ? kInfFlag : 0u); }
CKPT_HD Scaling scaling_from_word(Format f, uint32_t word) {
  Scaling sc;
  sc.inf = (word & kInfFlag) != 0;
  const float amax = bits_float(word & ~kInfFlag);  // finite and >= 0
  if (amax > 0.0f) {
    sc.scale = amax / format_max(f, sc.inf);
    if (!(sc.scale > 0.0f)) sc.scale = 1.40129846e-45f;  // amax below the format's max times 2^-149
  }
  return sc;
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
// code is NaN and overflow gives NaN; otherwise overflow gives infinity; `saturate`: overflow
// (an infinity included) gives the largest finite code instead. Returned in the low
// 1 + ebits + mbits bits. This is the rounding of torch's casts (c10's Half and Float8 types).
CKPT_HD uint32_t to_small(float x, int ebits, int mbits, bool fn, bool saturate = false) {
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
  if (a == 0x7f800000u) return sign | (saturate ? max_code : (fn ? nan_code : inf_code));
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
  if (code > max_code) code = saturate ? max_code : (fn ? nan_code : inf_code);
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
// comes back as code * scale, in fp32; infinities as Note [fp8 scale word] says).
CKPT_HD uint32_t encode(Format f, float x, Scaling sc) {
  switch (f) {
    case Format::BF16:
      return to_bf16(x);
    case Format::F16:
      return to_f16(x);
    case Format::E4M3:
      if (is_inf(x)) return ((float_bits(x) >> 31) << 7) | 0x7eu;  // the code of +-448
      return to_small(x / sc.scale, 4, 3, true, /*saturate=*/true);
    default:
      if (is_inf(x)) return to_small(x, 5, 2, false);
      return to_small(x / sc.scale, 5, 2, false, /*saturate=*/true);
  }
}
CKPT_HD float decode(Format f, uint32_t c, Scaling sc) {
  switch (f) {
    case Format::BF16:
      return from_bf16(static_cast<uint16_t>(c));
    case Format::F16:
      return from_f16(static_cast<uint16_t>(c));
    case Format::E4M3:
      if (sc.inf && (c & 0x7fu) == 0x7eu) return bits_float(((c & 0x80u) << 24) | 0x7f800000u);
      return from_small(c, 4, 3, true) * sc.scale;
    default:
      return from_small(c, 5, 2, false) * sc.scale;
  }
}

// Element i of a buffer of source type s, as fp32 / written from fp32 (CPU loops and CUDA kernels).
// Every source is read as fp32 first: fp64 -> fp32 -> narrow is what torch's casts do too
// (double rounding included), so results match `t.to(dtype)` bit for bit.
CKPT_HD float load(Source s, const void* p, int64_t i) {
  switch (s) {
    case Source::F32:
      return static_cast<const float*>(p)[i];
    case Source::F64:
      return static_cast<float>(static_cast<const double*>(p)[i]);
    case Source::F16:
      return from_f16(static_cast<const uint16_t*>(p)[i]);
    default:
      return from_bf16(static_cast<const uint16_t*>(p)[i]);
  }
}

CKPT_HD void store(Source s, void* p, int64_t i, float v) {
  switch (s) {
    case Source::F32:
      static_cast<float*>(p)[i] = v;
      break;
    case Source::F64:
      static_cast<double*>(p)[i] = v;
      break;
    case Source::F16:
      static_cast<uint16_t*>(p)[i] = to_f16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = to_bf16(v);
      break;
  }
}

// CPU: n elements of `src` (type s) into `dst` (stored_bytes(f, n) bytes, the scale word
// included). `word`: the scale word when the caller has it (a strided view's own elements,
// not the span's); null: from the n elements.
void down_cpu(Source s, const void* src, int64_t n, Format f, void* dst, const uint32_t* word = nullptr);
// CPU: back from `src` (as down_cpu wrote it) into n elements of type s at `dst`.
void up_cpu(Source s, void* dst, int64_t n, Format f, const void* src);

#ifdef CKPT_OFFLOAD_WITH_CUDA
// The same on a CUDA stream (a cudaStream_t), asynchronously: a scaled format runs an amax
// pass then the cast; bf16 / fp16 one cast pass. Pointers are device memory; `dst` must stay
// alive until the stream has run them. Scaled formats: `scratch` is 8 bytes of device memory
// (the finite amax's bits, then a nonzero int32 when an infinity was seen), alive as long;
// `scratch_ready`: the caller has written it on the stream (a strided view's own elements),
// and the amax pass is skipped. Throws std::runtime_error on a launch error.
void down_cuda(Source s, const void* src, int64_t n, Format f, void* dst, void* scratch, bool scratch_ready,
               void* stream);
void up_cuda(Source s, void* dst, int64_t n, Format f, const void* src, void* stream);
#endif

}  // namespace lowp
}  // namespace ckpt_offload

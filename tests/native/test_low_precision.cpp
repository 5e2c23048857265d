// The element conversions of low-precision storage (csrc/core/low_precision.h): every code of
// each format reads back and rounds to itself, values between two codes round to the nearer
// (ties to even), overflow follows each format's rule, and the CPU loops keep the amax.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "check.h"
#include "low_precision.h"

using namespace ckpt_offload::lowp;

namespace {

bool is_nan(float x) { return x != x; }

// Every finite code c of a small format: from_small(c) is exact, to_small of it gives c back,
// and the midpoint to the next code rounds to whichever of the two is even.
void codes_round_trip(int ebits, int mbits, bool fn) {
  const uint32_t n = 1u << (1 + ebits + mbits);
  for (uint32_t c = 0; c < n; ++c) {
    const float v = from_small(c, ebits, mbits, fn);
    if (is_nan(v) || std::isinf(v)) continue;
    CHECK_EQ(to_small(v, ebits, mbits, fn), c);
    const uint32_t next = c + 1;
    if ((next & ((1u << (ebits + mbits)) - 1u)) == 0) continue;  // sign wraps
    const float w = from_small(next, ebits, mbits, fn);
    if (is_nan(w) || std::isinf(w)) continue;
    const float mid = 0.5f * (v + w);  // exact in fp32 for these formats
    CHECK_EQ(to_small(mid, ebits, mbits, fn), (c & 1u) ? next : c);
  }
}

void test_small_formats() {
  codes_round_trip(4, 3, true);    // e4m3fn
  codes_round_trip(5, 2, false);   // e5m2
  codes_round_trip(5, 10, false);  // fp16
}

void test_bf16() {
  for (uint32_t c = 0; c < 0x10000u; ++c) {
    const float v = from_bf16(static_cast<uint16_t>(c));
    if (is_nan(v)) {
      CHECK_EQ(to_bf16(v), 0x7fc0u);
      continue;
    }
    CHECK_EQ(to_bf16(v), c);
  }
  // a tie (1 + 2^-8) goes to the even code 1.0; just above it goes up
  CHECK_EQ(to_bf16(1.0f + 0x1p-8f), to_bf16(1.0f));
  CHECK_EQ(from_bf16(to_bf16(1.0f + 0x1.2p-8f)), 1.0f + 0x1p-7f);
}

void test_overflow() {
  CHECK_EQ(to_small(464.0f, 4, 3, true), 0x7eu);  // tie between 448 and "480": to 448 (even)
  CHECK_EQ(to_small(470.0f, 4, 3, true), 0x7fu);  // past it: NaN, as torch's e4m3fn cast
  CHECK_EQ(to_small(INFINITY, 4, 3, true), 0x7fu);
  CHECK_EQ(to_small(-1e30f, 5, 2, false), 0xfcu);       // e5m2: -inf
  CHECK_EQ(to_small(65520.0f, 5, 10, false), 0x7c00u);  // fp16: the tie past 65504 goes to inf
  CHECK_EQ(to_small(65519.0f, 5, 10, false), 0x7bffu);
  CHECK(is_nan(from_small(0x7f, 4, 3, true)));
}

void test_cpu_loops() {
  std::vector<float> x = {0.5f, -3.0f, 1e-3f, 2.0f, -0.25f};
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint8_t> stored(static_cast<size_t>(stored_bytes(Format::E4M3, n)));
  CHECK_EQ(stored.size(), 12u);  // 5 codes, 3 bytes of padding, the fp32 amax
  down_cpu(Source::F32, x.data(), n, Format::E4M3, stored.data());
  float amax;
  std::memcpy(&amax, stored.data() + amax_offset(Format::E4M3, n), 4);
  CHECK_EQ(amax, 3.0f);
  std::vector<float> back(x.size());
  up_cpu(Source::F32, back.data(), n, Format::E4M3, stored.data());
  CHECK_EQ(back[1], -3.0f);  // the largest magnitude lands on 448 exactly
  for (size_t i = 0; i < x.size(); ++i) CHECK(std::fabs(back[i] - x[i]) <= std::fabs(x[i]) * 0.0625f);
  std::vector<double> d = {1.0 / 3.0, -2.5};
  std::vector<uint8_t> half(static_cast<size_t>(stored_bytes(Format::BF16, 2)));
  down_cpu(Source::F64, d.data(), 2, Format::BF16, half.data());
  std::vector<double> dback(2);
  up_cpu(Source::F64, dback.data(), 2, Format::BF16, half.data());
  CHECK_EQ(dback[1], -2.5);
  CHECK_EQ(dback[0], static_cast<double>(from_bf16(to_bf16(static_cast<float>(1.0 / 3.0)))));
}

}  // namespace

int main() {
  check::run("small_formats", test_small_formats);
  check::run("bf16", test_bf16);
  check::run("overflow", test_overflow);
  check::run("cpu_loops", test_cpu_loops);
  return 0;
}

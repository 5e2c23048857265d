#include "crc32c.h"

#include <array>
#include <cstring>

namespace ckpt_offload {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
      t[0][i] = c;
    }
    for (int s = 1; s < 8; ++s)
      for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

const Tables& tables() {
  static const Tables tab;
  return tab;
}

uint32_t portable(const unsigned char* p, size_t n, uint32_t c) {
  const auto& t = tables().t;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // unaligned-safe load (UBSan)
    w ^= c;                 // little-endian: the low 4 bytes fold in the running CRC
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CKPT_OFFLOAD_CRC32C_HW 1
__attribute__((target("sse4.2"))) uint32_t hardware(const unsigned char* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = __builtin_ia32_crc32di(c64, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

}  // namespace

bool crc32c_hardware() {
#ifdef CKPT_OFFLOAD_CRC32C_HW
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc) {
  return ~portable(static_cast<const unsigned char*>(data), n, ~crc);
}

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
#ifdef CKPT_OFFLOAD_CRC32C_HW
  if (crc32c_hardware()) return ~hardware(static_cast<const unsigned char*>(data), n, ~crc);
#endif
  return crc32c_portable(data, n, crc);
}

}  // namespace ckpt_offload

// CRC32C (Castagnoli), the checksum the file tier stores for every spilled chunk.
//
// Table-driven (slicing by 8) everywhere; the SSE4.2 crc32 instruction where the CPU has it,
// which runs at several GB/s, above what a disk delivers, so checking costs no bandwidth.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ckpt_offload {

// Continues a CRC32C over `n` more bytes: crc32c(b, crc32c(a)) == crc32c(a + b). Start with 0.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// The portable table-driven implementation, whatever the CPU (tests compare the two).
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc = 0);
// True when crc32c() uses the CPU's crc32 instruction.
bool crc32c_hardware();

}  // namespace ckpt_offload

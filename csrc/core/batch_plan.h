// The index computation shared by the gather/scatter kernel (cuda_stream.cu) and its CPU
// analogue (cpu_stream.cpp): many small copies are cut into fixed-size chunks, and chunk `b`
// of the whole batch is located by a binary search over the prefix sums of chunks per copy.
// Kept in one header, usable from host and device code, so the CPU tests check the very
// arithmetic the GPU runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define CKPT_OFFLOAD_HD __host__ __device__
#else
#define CKPT_OFFLOAD_HD
#endif

namespace ckpt_offload {

// One copy of a batch: `bytes` bytes from `src` to `dst`.
struct CopySegment {
  void* dst;
  const void* src;
  size_t bytes;
};

// Bytes one kernel block (or one CPU step) copies. Large enough to amortize the search, small
// enough that a batch of 256 KiB tensors still spreads across the GPU's multiprocessors.
constexpr size_t kBatchChunkBytes = 16 * 1024;
// Copies per kernel launch: their table travels as a kernel argument (under 4 KiB).
constexpr int kBatchMaxSegments = 64;

struct BatchLaunch {
  int num_segments = 0;
  uint32_t chunk_begin[kBatchMaxSegments + 1] = {};  // chunk_begin[i]: first chunk of copy i
  CopySegment segments[kBatchMaxSegments] = {};
};

CKPT_OFFLOAD_HD inline uint32_t chunks_of(size_t bytes) {
  return static_cast<uint32_t>((bytes + kBatchChunkBytes - 1) / kBatchChunkBytes);
}

// Fills `launch` with segments[first, first + n) (n <= kBatchMaxSegments); returns the
// number of chunks, i.e. of kernel blocks.
inline uint32_t plan_batch_launch(const CopySegment* segments, int n, BatchLaunch* launch) {
  launch->num_segments = n;
  uint32_t total = 0;
  for (int i = 0; i < n; ++i) {
    launch->segments[i] = segments[i];
    launch->chunk_begin[i] = total;
    total += chunks_of(segments[i].bytes);
  }
  launch->chunk_begin[n] = total;
  return total;
}

// Which copy chunk `b` belongs to, and the byte range of that copy it covers.
CKPT_OFFLOAD_HD inline void locate_chunk(const BatchLaunch& launch, uint32_t b, int* segment, size_t* offset,
                                         size_t* length) {
  // The last copy whose first chunk is <= b; empty copies (no chunks) are skipped naturally
  // because the next copy shares their chunk_begin.
  int lo = 0, hi = launch.num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (launch.chunk_begin[mid] <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  *segment = lo;
  *offset = static_cast<size_t>(b - launch.chunk_begin[lo]) * kBatchChunkBytes;
  const size_t bytes = launch.segments[lo].bytes;
  *length = bytes - *offset < kBatchChunkBytes ? bytes - *offset : kBatchChunkBytes;
}

// Runs a batch on the host, chunk by chunk through the same plan the kernel uses.
void copy_batch_on_host(const std::vector<CopySegment>& segments);

}  // namespace ckpt_offload

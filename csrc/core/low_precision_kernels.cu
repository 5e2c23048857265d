// CUDA kernels of low-precision storage (co.offload(store_dtype=...)). Element rounding is
// low_precision.h's, shared with the CPU loops, so a tensor converts to the same bits on
// either device. Every launch is on the caller's stream: the stream the D2H copy waits on
// (down), or the reload's consumer stream (up); see Note [Stream ordering].
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "low_precision.h"

namespace ckpt_offload {
namespace lowp {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;  // elements per thread per step: one 16-byte load of fp32

// Loads kVec consecutive elements from i (i a multiple of kVec); a 16-byte vector load when
// fp32 and aligned, else element by element (tail, other sources).
__device__ __forceinline__ void load_vec(Source s, const void* p, int64_t i, int64_t n, bool aligned, float* v) {
  if (s == Source::F32 && aligned && i + kVec <= n) {
    const float4 q = reinterpret_cast<const float4*>(p)[i / kVec];
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
    return;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) v[k] = (i + k < n) ? load(s, p, i + k) : 0.0f;
}

// Absolute maximum of the finite elements (NaN and +-inf skipped) into scratch[0], which
// starts at 0: a block reduction, then an integer atomicMax (the bits of non-negative floats
// order as integers); scratch[1] gets a nonzero value when an element is infinite.
__global__ void amax_kernel(Source s, const void* src, int64_t n, bool aligned, unsigned int* scratch) {
  __shared__ float part[kThreads / 32];
  float m = 0.0f;
  int inf = 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < n; i += step) {
    float v[kVec];
    load_vec(s, src, i, n, aligned, v);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (is_finite(v[k]))
        m = fmaxf(m, fabsf(v[k]));
      else if (is_inf(v[k]))
        inf = 1;
    }
  }
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, off));
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = m;
  const int any_inf = __syncthreads_or(inf);  // also the barrier before part[] is read
  if (threadIdx.x < 32) {
    m = threadIdx.x < kThreads / 32 ? part[threadIdx.x] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, off));
    if (threadIdx.x == 0) {
      atomicMax(scratch, float_bits(m));
      if (any_inf) atomicOr(scratch + 1, 1u);
    }
  }
}

// The scale word (Note [fp8 scale word]) from the scratch the amax pass (or the caller) wrote.
__device__ __forceinline__ uint32_t word_of(const unsigned int* scratch) {
  return scratch[0] | (scratch[1] ? kInfFlag : 0u);
}

// The cast: each thread converts kVec elements per step and writes them as one 8-byte (2-byte
// formats) or 4-byte (1-byte formats) store.
__global__ void down_kernel(Source s, const void* src, int64_t n, Format f, bool aligned, void* dst,
                            const unsigned int* scratch) {
  Scaling sc;
  if (format_scaled(f)) {
    const uint32_t word = word_of(scratch);
    sc = scaling_from_word(f, word);
    // The stored word: nothing in this kernel reads it (it reads the scratch).
    if (blockIdx.x == 0 && threadIdx.x == 0)
      *reinterpret_cast<uint32_t*>(static_cast<char*>(dst) + amax_offset(f, n)) = word;
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < n; i += step) {
    float v[kVec];
    load_vec(s, src, i, n, aligned, v);
    uint32_t c[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) c[k] = encode(f, v[k], sc);
    if (i + kVec <= n) {
      if (format_bytes(f) == 2) {
        uint2 w;
        w.x = c[0] | (c[1] << 16);
        w.y = c[2] | (c[3] << 16);
        reinterpret_cast<uint2*>(dst)[i / kVec] = w;  // dst is a fresh allocation: aligned
      } else {
        reinterpret_cast<uint32_t*>(dst)[i / kVec] = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
      }
    } else {
      for (int k = 0; i + k < n; ++k) {
        if (format_bytes(f) == 2)
          static_cast<uint16_t*>(dst)[i + k] = static_cast<uint16_t>(c[k]);
        else
          static_cast<uint8_t*>(dst)[i + k] = static_cast<uint8_t>(c[k]);
      }
    }
  }
}

__global__ void up_kernel(Source s, void* dst, int64_t n, Format f, const void* src, bool aligned,
                          const uint32_t* word) {
  const Scaling sc = format_scaled(f) ? scaling_from_word(f, *word) : Scaling{};
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < n; i += step) {
    uint32_t c[kVec];
    if (aligned && i + kVec <= n) {
      if (format_bytes(f) == 2) {
        const uint2 w = reinterpret_cast<const uint2*>(src)[i / kVec];
        c[0] = w.x & 0xffffu;
        c[1] = w.x >> 16;
        c[2] = w.y & 0xffffu;
        c[3] = w.y >> 16;
      } else {
        const uint32_t w = reinterpret_cast<const uint32_t*>(src)[i / kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) c[k] = (w >> (8 * k)) & 0xffu;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) store(s, dst, i + k, decode(f, c[k], sc));
    } else {
      for (int k = 0; i + k < n; ++k) {
        const uint32_t code =
            format_bytes(f) == 2 ? static_cast<const uint16_t*>(src)[i + k] : static_cast<const uint8_t*>(src)[i + k];
        store(s, dst, i + k, decode(f, code, sc));
      }
    }
  }
}

int blocks_for(int64_t n) {
  const int64_t want = (n + static_cast<int64_t>(kThreads) * kVec - 1) / (static_cast<int64_t>(kThreads) * kVec);
  return static_cast<int>(want < 1 ? 1 : (want > 65535 ? 65535 : want));
}

void check(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("ckpt_offload: ") + what +
                             " kernel launch failed: " + cudaGetErrorString(err));
}

}  // namespace

void down_cuda(Source s, const void* src, int64_t n, Format f, void* dst, void* scratch, bool scratch_ready,
               void* stream) {
  if (n <= 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  const bool aligned = (reinterpret_cast<uintptr_t>(src) % 16) == 0;
  auto* words = static_cast<unsigned int*>(scratch);
  if (format_scaled(f) && !scratch_ready) {
    if (cudaMemsetAsync(words, 0, 8, st) != cudaSuccess) check("amax reset");
    amax_kernel<<<blocks_for(n), kThreads, 0, st>>>(s, src, n, aligned, words);
    check("store_dtype amax");
  }
  down_kernel<<<blocks_for(n), kThreads, 0, st>>>(s, src, n, f, aligned, dst, words);
  check("store_dtype down-conversion");
}

void up_cuda(Source s, void* dst, int64_t n, Format f, const void* src, void* stream) {
  if (n <= 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  const uint32_t* word =
      format_scaled(f) ? reinterpret_cast<const uint32_t*>(static_cast<const char*>(src) + amax_offset(f, n)) : nullptr;
  const bool aligned = (reinterpret_cast<uintptr_t>(src) % 8) == 0;
  up_kernel<<<blocks_for(n), kThreads, 0, st>>>(s, dst, n, f, src, aligned, word);
  check("store_dtype up-conversion");
}

}  // namespace lowp
}  // namespace ckpt_offload

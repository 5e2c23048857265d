// CUDA streams/events and the pinned backend, through the same CopyEngine paths the torch
// layer uses. Built only with -DCKPT_OFFLOAD_WITH_CUDA=ON; without a usable device it reports
// itself skipped (exit code 77, which ctest shows as "Not Run / Skipped").
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "check.h"
#include "copy_engine.h"
#include "cuda_stream.h"
#include "host_pool.h"

using namespace ckpt_offload;

namespace {

constexpr size_t KiB = size_t(1) << 10;
constexpr size_t MiB = size_t(1) << 20;

#define CUDA_OK(expr) CHECK_EQ(cudaError_t(expr), cudaSuccess)

std::vector<char> pattern(size_t n, uint32_t seed) {
  std::vector<char> v(n);
  std::mt19937 rng(seed);
  for (auto& c : v) c = char(rng());
  return v;
}

void test_pinned_pool() {
  auto pool = std::make_shared<HostPool>(std::make_unique<cuda::PinnedBackend>(), 0, 8 * MiB);
  CHECK_EQ(std::string(pool->backend_name()), "pinned");
  HostPool::Block* b = pool->allocate(3 * MiB);
  CHECK(b != nullptr);
  cudaPointerAttributes attr{};
  CUDA_OK(cudaPointerGetAttributes(&attr, HostPool::data(b)));
  CHECK_EQ(int(attr.type), int(cudaMemoryTypeHost));  // page-locked, not pageable
  pool->free(b);
  CHECK_POOL(*pool);
  CHECK_EQ(pool->empty_cache(), 8 * MiB);
}

// Offload device bytes to pinned host memory on the D2H side stream and back on the H2D side
// stream, with the default stream as "compute" (kernels-free: a device memset is the producer).
void test_side_stream_roundtrip() {
  const int device = 0;
  CUDA_OK(cudaSetDevice(device));
  auto pool = std::make_shared<HostPool>(std::make_unique<cuda::PinnedBackend>(), 0, 64 * MiB);
  CopyEngine engine;
  cudaStream_t raw_compute;
  CUDA_OK(cudaStreamCreateWithFlags(&raw_compute, cudaStreamNonBlocking));
  cuda::CudaStream compute(raw_compute, device);
  cuda::CudaStream& d2h = cuda::side_stream(device, cuda::SideStream::D2H);
  cuda::CudaStream& h2d = cuda::side_stream(device, cuda::SideStream::H2D);
  CHECK_NE(d2h.id(), h2d.id());
  CHECK_EQ(cuda::CudaStream(raw_compute, device).id(), compute.id());  // wrappers share the queue id

  for (size_t n : {size_t(1), size_t(4096), size_t(1 * MiB + 7), size_t(32 * MiB)}) {
    const auto expected = pattern(n, uint32_t(n));
    void* dev = nullptr;
    void* back = nullptr;
    CUDA_OK(cudaMalloc(&dev, n));
    CUDA_OK(cudaMalloc(&back, n));
    // Produce the source on the compute stream, asynchronously (from a pinned staging copy).
    std::vector<char> staging_bytes = expected;
    CUDA_OK(cudaMemcpyAsync(dev, staging_bytes.data(), n, cudaMemcpyHostToDevice, raw_compute));
    CUDA_OK(cudaStreamSynchronize(raw_compute));
    // Then overwrite it after a delay-free memset chain so the D2H copy must follow compute.
    CUDA_OK(cudaMemsetAsync(dev, 0x3c, n, raw_compute));
    CUDA_OK(cudaMemcpyAsync(dev, staging_bytes.data(), n, cudaMemcpyHostToDevice, raw_compute));
    std::shared_ptr<void> keep(dev, [](void* p) { cudaFree(p); });
    auto buf = engine.offload(pool, dev, n, compute, d2h, keep);
    keep.reset();
    CHECK(buf != nullptr);
    CUDA_OK(cudaMemsetAsync(back, 0, n, raw_compute));
    auto done = engine.reload(*buf, back, compute, h2d);
    std::vector<char> got(n, 0);
    CUDA_OK(cudaMemcpyAsync(got.data(), back, n, cudaMemcpyDeviceToHost, raw_compute));
    CUDA_OK(cudaStreamSynchronize(raw_compute));
    CHECK(done->query());
    CHECK(std::memcmp(got.data(), expected.data(), n) == 0);
    CHECK(std::memcmp(buf->data(), expected.data(), n) == 0);
    buf.reset();
    CUDA_OK(cudaFree(back));
  }
  cuda::synchronize_side_streams();
  engine.synchronize();
  CHECK_EQ(engine.num_keepalives(), 0u);
  CHECK_POOL_EMPTY(*pool);
  CUDA_OK(cudaStreamDestroy(raw_compute));
}

// CopyKind::DeviceToDevice is a device-to-device cudaMemcpyAsync (it was mapped to
// cudaMemcpyHostToHost, which fails or copies wrongly for device pointers).
void test_device_to_device_copy() {
  const size_t n = 1 * MiB + 7;
  auto expected = pattern(n, 11);
  void *a = nullptr, *b = nullptr;
  CUDA_OK(cudaMalloc(&a, n));
  CUDA_OK(cudaMalloc(&b, n));
  CUDA_OK(cudaMemcpy(a, expected.data(), n, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(b, 0, n));
  cudaStream_t raw = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  cuda::CudaStream s(raw, 0);
  s.memcpy(b, a, n, CopyKind::DeviceToDevice);
  s.record()->synchronize();
  std::vector<char> got(n);
  CUDA_OK(cudaMemcpy(got.data(), b, n, cudaMemcpyDeviceToHost));
  CHECK(std::memcmp(got.data(), expected.data(), n) == 0);
  CUDA_OK(cudaStreamDestroy(raw));
  CUDA_OK(cudaFree(a));
  CUDA_OK(cudaFree(b));
}

}  // namespace

int main() {
  const int n = cuda::device_count();
  std::printf("CUDA runtime %s, %d device(s)\n", cuda::runtime_version().c_str(), n);
  if (n == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  check::run("pinned_pool", test_pinned_pool);
  check::run("side_stream_roundtrip", test_side_stream_roundtrip);
  check::run("device_to_device_copy", test_device_to_device_copy);
  std::printf("all CUDA stream tests passed\n");
  return 0;
}

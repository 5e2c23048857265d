#include "device_memory.h"

#include <atomic>
#include <stdexcept>
#include <string>

#include <c10/core/CPUAllocator.h>

#include "../core/profiler.h"
#include "../core/spill.h"
#include "device_bytes.h"
#include "device_runtime.h"
#include "runtime.h"
#include "tensor_layout.h"

namespace ckpt_offload {

at::Tensor device_bytes(const c10::Device& device, size_t n) {
  return at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte).device(device));
}

c10::Storage device_storage(const c10::Device& device, size_t n) {
  // What at::empty uses on a CUDA device (on the current device, which callers set with
  // DeviceScope, and in the current stream's order).
  if (device.is_cuda())
    if (c10::Allocator* cuda = device_runtime::cuda_allocator())
      return c10::Storage(c10::Storage::use_byte_size_t(), n, cuda, /*resizable=*/false);
  if (!device.is_cpu()) return device_bytes(device, n).storage();
  return c10::Storage(c10::Storage::use_byte_size_t(), n, c10::GetCPUAllocator(), /*resizable=*/false);
}

at::Tensor tensor_over(c10::Storage storage, c10::ScalarType dtype, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                       int64_t offset) {
  const c10::Device device = storage.device();
  const c10::DispatchKey key = c10::computeDispatchKey(dtype, c10::kStrided, device);
  // TensorImpl adds the autograd and ADInplaceOrView keys to the backend's key, as at::empty does.
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_and_strides(sizes, strides, offset);
  return at::Tensor(std::move(impl));
}

void DeviceCopyVersion::check(bool accept_modified, c10::ScalarType dtype, c10::IntArrayRef sizes,
                              const c10::Device& device) {
  if (!modified()) return;
  if (accept_modified) {
    accept();
    return;
  }
  throw DeviceCopyModified(inplace_message(
      dtype, sizes, device, counter_.current_version(), at_,
      "a backward wrote a tensor it unpacked in place, and another saved tensor views the same bytes, so its "
      "backward would have read the written values.",
      "the backward that modified its saved tensor must clone it first."));
}

// record_consumer: the device side's (cuda/device_memory.cpp, cpu/device_memory.cpp).

void release_after_copy(c10::Storage storage, Stream* copy, std::shared_ptr<Event> done) noexcept {
  if (!storage || !copy || !done) return;  // dropping `storage` is enough
  try {
    // CUDA memory on a CUDA copy stream: back to the caching allocator now, with record_stream.
    if (device_runtime::release_on_copy_stream(storage, copy)) return;
    engine().keep_until(*copy, std::move(done), std::make_shared<c10::Storage>(std::move(storage)));
  } catch (...) {
    // After a CUDA error: the device runs nothing again; the memory is let go with `storage`.
  }
}

// Holds a source storage until its copy has read it, counted in the memory timeline meanwhile.
std::shared_ptr<void> tracked_keepalive(const c10::Storage& st, int64_t bytes) {
  struct Held {
    c10::Storage storage;
    DeviceBytesHeld bytes;
  };
  auto held = std::make_shared<Held>(Held{st, DeviceBytesHeld(bytes)});
  // Points at the storage (batch.cpp reads it through the pointer), owns both.
  return std::shared_ptr<void>(held, &held->storage);
}

void sample_memory(HostPool* pool, const c10::Device& device) {
  if (!profiler::enabled()) return;
  profiler::MemorySample m;
  m.t_ns = profiler::now_ns();
  m.pool_bytes_in_use = pool ? static_cast<int64_t>(pool->stats().bytes_in_use) : 0;
  if (auto target = pool ? spill_target(pool) : nullptr)
    m.disk_bytes_in_use = static_cast<int64_t>(target->tier()->stats().bytes_requested);
  m.device_bytes_saved = DeviceBytesHeld::total();
  m.device_bytes_allocated = device_allocated_bytes(device);
  profiler::add(m);
}

namespace {
std::atomic<int> g_failing_prefetches{0};
std::atomic<bool> g_batch_staging{true};
}  // namespace

void fail_next_prefetches(int n) { g_failing_prefetches.store(n); }

void set_batch_staging(bool on) { g_batch_staging.store(on); }

// Test hook: makes the next prefetches raise, as an out-of-memory would.
void maybe_fail_prefetch() {
  if (g_failing_prefetches.load(std::memory_order_relaxed) > 0 && g_failing_prefetches.fetch_sub(1) > 0)
    throw std::runtime_error("ckpt_offload: injected prefetch failure (test hook)");
}

// A device block for a batch's gather or scatter. Undefined when device memory is short (or
// the test hook turned staging off): the batch then copies each member on its own, between
// its device memory and the host block, which needs no extra device memory.
at::Tensor staging_block(const c10::Device& device, size_t bytes) {
  if (!device.is_cuda() || !g_batch_staging.load()) return at::Tensor();
  try {
    return device_bytes(device, bytes);
  } catch (const c10::OutOfMemoryError&) {
    return at::Tensor();
  }
}

}  // namespace ckpt_offload

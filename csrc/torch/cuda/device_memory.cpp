// device_memory.h's device side for the CUDA build (device_runtime.h): torch's CUDA caching
// allocator and its record_stream. The C++-only build compiles ../cpu/device_memory.cpp instead.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include "../../core/cuda_stream.h"
#include "../device_memory.h"
#include "../device_runtime.h"

namespace ckpt_offload {

void record_consumer(const c10::Storage& storage, const c10::Device& device) {
  if (!device.is_cuda() || !storage || !storage.data()) return;
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  c10::cuda::CUDACachingAllocator::recordStream(storage.data_ptr(), c10::cuda::getCurrentCUDAStream(index));
}

namespace device_runtime {

c10::Allocator* cuda_allocator() { return c10::cuda::CUDACachingAllocator::get(); }

bool release_on_copy_stream(const c10::Storage& storage, Stream* copy) {
  auto* cs = dynamic_cast<cuda::CudaStream*>(copy);
  if (!cs || !storage.device().is_cuda() || !storage.data()) return false;
  c10::cuda::CUDACachingAllocator::recordStream(
      storage.data_ptr(), c10::cuda::getStreamFromExternal(cs->handle(), static_cast<c10::DeviceIndex>(cs->device())));
  return true;
}

}  // namespace device_runtime
}  // namespace ckpt_offload

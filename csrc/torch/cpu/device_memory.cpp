// device_memory.h's device side for the C++-only build (device_runtime.h): no device memory but
// the CPU's, which needs no stream bookkeeping. The CUDA build compiles ../cuda/device_memory.cpp
// instead.
#include "../device_memory.h"
#include "../device_runtime.h"

namespace ckpt_offload {

void record_consumer(const c10::Storage&, const c10::Device&) {}

namespace device_runtime {

c10::Allocator* cuda_allocator() { return nullptr; }

bool release_on_copy_stream(const c10::Storage&, Stream*) { return false; }

}  // namespace device_runtime
}  // namespace ckpt_offload

// runtime.h's device side for the C++-only build (device_runtime.h): no device but the CPU,
// whose streams runtime.cpp owns. The CUDA build compiles ../cuda/runtime.cpp instead.
#include <stdexcept>

#include "../device_runtime.h"
#include "../runtime.h"

namespace ckpt_offload {

DeviceScope::DeviceScope(const c10::Device& device) { (void)device; }

DeviceScope::~DeviceScope() = default;

CurrentStream CurrentStream::of(const c10::Device& device) { return CurrentStream(device); }

bool CurrentStream::capturing() const { return false; }

int64_t device_allocated_bytes(const c10::Device& device) {
  (void)device;
  return -1;
}

// No CUDA graphs: the core's default probe (never capturing) stays; the fork handlers are
// registered here, at import, as in the CUDA build (Note [Fork]).
void install_capture_probe() { ensure_fork_handlers(); }

bool cuda_compiled() { return false; }

int cuda_device_count() { return 0; }

std::string cuda_runtime_version() { return ""; }

namespace device_runtime {

bool stream_pair(const CurrentStream&, bool, bool, bool, std::unique_ptr<Stream>*, Stream**, Stream**) { return false; }

void range_push(const char*) {}

void range_pop() {}

void synchronize_streams() {}

std::unique_ptr<Backend> pinned_backend(const std::string& backend_name, int) {
  throw std::invalid_argument("ckpt_offload: backend '" + backend_name +
                              "' (pinned memory) needs ckpt_offload built with CUDA; this build is CPU-only. Pass "
                              "pinned=False / backend='pageable', or reinstall with CKPT_OFFLOAD_CUDA=1 where nvcc and "
                              "a CUDA build of torch exist");
}

void start_timing_epochs() {}

int64_t timing_epoch_ns(int) { return -1; }

}  // namespace device_runtime
}  // namespace ckpt_offload

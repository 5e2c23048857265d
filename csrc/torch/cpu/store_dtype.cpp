// store_dtype's conversions on a device (device_runtime.h) for the C++-only build: none, the
// CPU's are store_dtype.cpp's own. The CUDA build compiles ../cuda/store_dtype.cpp instead.
#include "../device_runtime.h"

namespace ckpt_offload {
namespace device_runtime {

at::Tensor store_down(lowp::Source, const void*, int64_t, lowp::Format, const c10::Device&, const CurrentStream&,
                      const std::pair<at::Tensor, at::Tensor>*) {
  return at::Tensor();
}

bool store_up(lowp::Source, void*, int64_t, lowp::Format, const at::Tensor&, const CurrentStream&) { return false; }

}  // namespace device_runtime
}  // namespace ckpt_offload

// store_dtype's conversions on a CUDA device (device_runtime.h): the kernels of
// core/low_precision_kernels.cu, on the current stream. The C++-only build compiles
// ../cpu/store_dtype.cpp instead.
#include "../device_memory.h"
#include "../device_runtime.h"

namespace ckpt_offload {
namespace device_runtime {

at::Tensor store_down(lowp::Source s, const void* src, int64_t n, lowp::Format f, const c10::Device& device,
                      const CurrentStream& current, const std::pair<at::Tensor, at::Tensor>* own_amax) {
  if (!device.is_cuda()) return at::Tensor();
  const int64_t stored = lowp::stored_bytes(f, n);
  // Scaled formats: 8 bytes of scratch after the stored bytes (the amax pass's result, which
  // the cast reads), in the same allocation and never copied to the host.
  const int64_t scratch = lowp::format_scaled(f) ? 8 : 0;
  at::Tensor out = device_bytes(device, static_cast<size_t>(stored + scratch));
  char* base = static_cast<char*>(out.data_ptr());
  if (own_amax) {
    const auto& [amax, inf] = *own_amax;
    const auto opts = at::TensorOptions().dtype(at::kInt).device(device);
    at::Tensor words = at::from_blob(base + stored, {2}, opts);
    words.narrow(0, 0, 1).copy_(amax.view(at::kInt).reshape({1}));
    words.narrow(0, 1, 1).copy_(inf.to(at::kInt).reshape({1}));
  }
  lowp::down_cuda(s, src, n, f, base, scratch ? base + stored : nullptr, own_amax != nullptr, current.cuda_stream());
  return scratch ? out.narrow(0, 0, stored) : out;
}

bool store_up(lowp::Source s, void* out, int64_t n, lowp::Format f, const at::Tensor& stored,
              const CurrentStream& current) {
  if (!stored.device().is_cuda()) return false;
  lowp::up_cuda(s, out, n, f, stored.data_ptr(), current.cuda_stream());
  return true;
}

}  // namespace device_runtime
}  // namespace ckpt_offload

// The current stream of a tensor's device: what the torch layer hands the device side
// (device_runtime.h) and every copy, declared apart so that the device side's interface needs
// nothing else of runtime.h. Defined by the build's device side ({cuda,cpu}/runtime.cpp).
#pragma once

#include <c10/core/Device.h>

namespace ckpt_offload {

// The current stream of a tensor's device, read once per pack and handed to what needs it
// (the capture check, the copy's StreamPair): each read is a thread-local lookup, and the
// capture check a driver call. Note [Stream ordering]: it is still read at every pack, since
// FSDP, recompute and user code switch streams between tensors. For CPU it holds nothing.
class CurrentStream {
 public:
  static CurrentStream of(const c10::Device& device);
  // True while this stream captures a CUDA graph (Note [Graph capture]); never for CPU.
  bool capturing() const;
  const c10::Device& device() const { return device_; }
  int index() const { return index_; }
  void* cuda_stream() const { return stream_; }  // the cudaStream_t; null for CPU

 private:
  explicit CurrentStream(const c10::Device& device) : device_(device) {}
  c10::Device device_;
  int index_ = -1;
  void* stream_ = nullptr;
};

}  // namespace ckpt_offload

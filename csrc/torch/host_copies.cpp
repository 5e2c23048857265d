// What pack copies to the host (host_copies.h): exact copies, narrow ones, co.offload_tensor's.
#include "host_copies.h"

#include <stdexcept>
#include <string>

#include "../core/profiler.h"
#include "device_memory.h"
#include "runtime.h"
#include "tensor_layout.h"

namespace ckpt_offload {

std::shared_ptr<TieredBuffer> offload_bytes(const at::Tensor& t, int64_t from, int64_t to,
                                            const std::shared_ptr<HostPool>& pool, bool side_stream,
                                            const CurrentStream* current, uint64_t handle, TieredRefusal* why) {
  DeviceScope scope(t.device());  // Note [Stream ordering] rule 6
  StreamPair streams(current ? *current : CurrentStream::of(t.device()), side_stream, /*to_host=*/true);
  CopyRange range(copy_ranges::kOffload, t.device());
  const int64_t bytes = to - from;
  // Hold the storage (not the tensor: no autograd metadata) until the copy has read it.
  const SourceKeepalive keepalive(t.storage(), bytes);
  const char* src = static_cast<const char*>(t.storage().data()) + from;
  CopyTag tag{handle, device_index(t.device()), false, 1};
  TieredRefusal refusal = TieredRefusal::None;
  auto buffer = offload_tiered(pool, handle, [&](const std::shared_ptr<HostPool>& into) {
    return engine().offload(into, src, static_cast<size_t>(bytes), streams.compute(), streams.copy(), keepalive, tag);
  }, &refusal);
  if (why) *why = refusal;
  return buffer;
}

std::shared_ptr<OffloadedStorage> copy_to_host(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                               bool side_stream, const std::shared_ptr<PackerCounters>& counters,
                                               TieredRefusal* why, const CurrentStream* current, int64_t from,
                                               int64_t to) {
  const int64_t item = static_cast<int64_t>(t.dtype().itemsize());
  const int64_t nbytes = extent_elements(t) * item;
  if (from < 0) {
    from = t.storage_offset() * item;
    to = from + nbytes;
  }
  const uint64_t handle = profiler::next_handle_id();
  auto buffer = offload_bytes(t, from, to, pool, side_stream, current, handle, why);
  if (!buffer) return nullptr;
  if (buffer->spilled() && counters) {
    counters->tensors_spilled++;
    counters->bytes_spilled += to - from;
  }
  const size_t pad = static_cast<size_t>(from) % OffloadedStorage::kReloadAlignment;
  auto storage = std::make_shared<OffloadedStorage>(std::move(buffer), t.device(), from, pad, side_stream, handle,
                                                    counters);
  if (profiler::enabled()) {
    profiler::HandleRecord h;
    h.handle = handle;
    h.bytes = static_cast<size_t>(nbytes);
    h.device = device_index(t.device());
    h.shape = t.sizes().vec();
    h.dtype = dtype_name(t.scalar_type());
    h.module = profiler::scope();
    profiler::add(std::move(h));
  }
  return storage;
}

std::shared_ptr<ConvertedCopy> convert_to_host(const at::Tensor& t, lowp::Source s, lowp::Format f,
                                               const std::shared_ptr<HostPool>& pool, bool side_stream,
                                               const std::shared_ptr<PackerCounters>& counters, TieredRefusal* why,
                                               const CurrentStream* current, StoreErrors* errors) {
  DeviceScope scope(t.device());  // Note [Stream ordering] rule 6
  const CurrentStream cur = current ? *current : CurrentStream::of(t.device());
  const int64_t item = static_cast<int64_t>(t.dtype().itemsize());
  const int64_t lo = t.storage_offset() * item;
  const int64_t n = extent_elements(t);
  const void* src = static_cast<const char*>(t.storage().data()) + lo;
  // Dense over its span (the common case): the span's n elements are its own, and the scale
  // comes from them in the conversion's own pass. Else from its elements (Note [fp8 scale word]).
  const bool dense = t.is_non_overlapping_and_dense();
  at::Tensor staged = store_down(s, src, n, f, t.device(), cur, dense ? nullptr : &t);
  double error = 0.0;
  if (errors) error = store_relative_error(t, s, n, f, staged, cur);
  // The staging tensor goes through the exact path; its keep-alive holds it until the copy has
  // read it, and its copy waits on `cur`, where the conversion ran.
  auto inner = copy_to_host(staged, pool, side_stream, counters, why, &cur);
  if (!inner) return nullptr;  // kept as it is: never converted, so no error to count
  if (errors) {
    std::string cls = dtype_name(t.scalar_type()) + "->" + store_format_name(f);
    if (!profiler::scope().empty()) cls += " @ " + profiler::scope();
    errors->add(cls, error);
  }
  return std::make_shared<ConvertedCopy>(SavedTensor(staged, std::move(inner), counters), f, s,
                                         t.scalar_type(), t.device(), lo, n);
}

std::shared_ptr<SavedTensor> offload_tensor(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                            bool side_stream) {
  if (!t.defined()) throw std::invalid_argument("ckpt_offload.offload_tensor: tensor is undefined");
  if (unsupported_layout(t) || wrapped_tensor(t))
    throw std::invalid_argument("ckpt_offload.offload_tensor: tensor must be a plain strided tensor, got layout " +
                                layout_name(t.layout()) + (t.is_conj() ? " with the conjugate bit set" : "") +
                                (t.is_neg() ? " with the negative bit set" : ""));
  if (!t.device().is_cpu() && !t.device().is_cuda())
    throw std::invalid_argument("ckpt_offload.offload_tensor: tensor must be on 'cpu' or 'cuda', got " +
                                t.device().str());
  if (t.device().is_cuda() && !cuda_compiled())
    throw std::invalid_argument("ckpt_offload.offload_tensor: this build has no CUDA");
  // Note [Tensors without data]: nothing to copy (a resized storage gets the message below).
  if (t._is_zerotensor() || !t.has_storage() ||
      (t.numel() > 0 && t.storage().nbytes() > 0 && t.storage().data() == nullptr))
    throw std::invalid_argument(
        "ckpt_offload.offload_tensor: tensor has no data of its own to copy (a ZeroTensor, e.g. a zero tangent of "
        "forward-mode AD, or a tensor without storage); keep it as it is, or materialize it first "
        "(torch.zeros_like(tensor))");
  // The Python wrapper checks this first; here it keeps any other caller from copying past the
  // end of a storage resized below the tensor's span (resize_(0) leaves sizes and strides as
  // they were), which reads freed memory on the copy thread.
  const int64_t item = static_cast<int64_t>(t.dtype().itemsize());
  const int64_t end = (t.storage_offset() + extent_elements(t)) * item;
  if (t.numel() > 0 && static_cast<size_t>(end) > t.storage().nbytes())
    throw std::invalid_argument("ckpt_offload.offload_tensor: tensor reaches byte " + std::to_string(end) +
                                " of its storage, which holds " + std::to_string(t.storage().nbytes()) +
                                " bytes (was the storage resized?)");
  TieredRefusal why = TieredRefusal::None;
  auto counters = std::make_shared<PackerCounters>();
  auto storage = copy_to_host(t, pool, side_stream, counters, &why);
  if (!storage) throw PoolFull(full_message(why, *pool, t, extent_elements(t) * item));
  return std::make_shared<SavedTensor>(t, std::move(storage), std::move(counters));
}

}  // namespace ckpt_offload

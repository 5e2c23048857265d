// What pack copies to the host (host_copies.h): exact copies, narrow ones, co.offload_tensor's.
#include "host_copies.h"

#include <torch/csrc/autograd/python_variable.h>

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
  auto buffer = offload_tiered(
      pool, handle,
      [&](const std::shared_ptr<HostPool>& into) {
        return engine().offload(into, src, static_cast<size_t>(bytes), streams.compute(), streams.copy(), keepalive,
                                tag);
      },
      &refusal);
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
  auto storage =
      std::make_shared<OffloadedStorage>(std::move(buffer), t.device(), from, pad, side_stream, handle, counters);
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
  return std::make_shared<ConvertedCopy>(SavedTensor(staged, std::move(inner), counters), f, s, t.scalar_type(),
                                         t.device(), lo, n);
}

namespace {

[[noreturn]] void not_plain(const std::string& kind) {
  throw std::invalid_argument("tensor: must be a plain strided tensor (dense, on 'cpu' or 'cuda'), got " + kind);
}

// The name of t's Python class ("MyTensor"), for a message.
std::string python_class_name(const at::Tensor& t) {
  PyObject* obj = THPVariable_Wrap(t);
  std::string name = obj ? Py_TYPE(obj)->tp_name : "a tensor subclass";
  Py_XDECREF(obj);
  PyErr_Clear();
  return name;
}

// What co.offload_tensor checks of its tensor, the one place it is checked (the Python wrapper
// checks the arguments' types only): its bytes must be one plain strided span of its own
// storage, which is copied as raw bytes. Raises ValueError (std::invalid_argument) naming what
// the tensor is instead.
void check_copyable(const at::Tensor& t) {
  if (!t.defined()) throw std::invalid_argument("tensor: is undefined");
  if (t.is_meta()) not_plain("a meta tensor (it has no data)");
  // Note [Tensors without data]: its values are implied, not stored (a null data pointer).
  if (t._is_zerotensor())
    throw std::invalid_argument(
        "tensor: is a ZeroTensor (e.g. a zero tangent of forward-mode AD, or torch._efficientzerotensor), which has "
        "no data to copy; keep it as it is, or materialize it first (torch.zeros_like(tensor))");
  if (t.is_nested()) not_plain("a nested tensor");
  if (t.is_quantized()) not_plain("a quantized tensor");
  if (t.is_mkldnn()) not_plain("an MKL-DNN tensor");
  if (t.layout() != c10::kStrided) {
    std::string layout = layout_name(t.layout());
    if (layout.rfind("torch.", 0) == 0) layout = layout.substr(6);
    not_plain("a " + layout + " tensor");
  }
  if (t.is_conj()) not_plain("a conjugate view (resolve it first: tensor.resolve_conj())");
  if (t.is_neg()) not_plain("a negative-bit view (resolve it first: tensor.resolve_neg())");
  if (t.key_set().has(c10::DispatchKey::Python))
    not_plain("a __torch_dispatch__ tensor subclass (" + python_class_name(t) + "), whose storage is not its data");
  if (wrapped_tensor(t)) not_plain("a functorch or functionalization wrapper, whose storage is not its data");
  if (!t.device().is_cpu() && !t.device().is_cuda())
    throw std::invalid_argument("tensor: must be on 'cpu' or 'cuda', got " + t.device().str());
  if (t.device().is_cuda() && !cuda_compiled())
    throw std::invalid_argument("tensor: is on " + t.device().str() + ", but this build of ckpt_offload has no CUDA");
  const char* no_data =
      "tensor: has no data of its own to copy (no storage, or a null data pointer); keep it as it is, or "
      "materialize it first (torch.zeros_like(tensor))";
  if (!t.has_storage()) throw std::invalid_argument(no_data);
  if (t.numel() == 0) return;
  if (t.storage().nbytes() > 0 && t.storage().data() == nullptr) throw std::invalid_argument(no_data);
  // Reading past the end of a storage resized below the tensor's span (resize_(0) leaves sizes
  // and strides as they were; FSDP and torch.compile do it) would read freed memory on the copy
  // thread.
  const int64_t end = (t.storage_offset() + extent_elements(t)) * static_cast<int64_t>(t.dtype().itemsize());
  const size_t have = t.storage().nbytes();
  if (static_cast<size_t>(end) > have)
    throw std::invalid_argument("tensor: reaches byte " + std::to_string(end) + " of its storage, which holds " +
                                std::to_string(have) +
                                " bytes (was the storage resized, e.g. untyped_storage().resize_(0)?); offload a "
                                "tensor whose storage holds its data");
}

}  // namespace

std::shared_ptr<SavedTensor> offload_tensor(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                            bool side_stream) {
  check_copyable(t);
  TieredRefusal why = TieredRefusal::None;
  auto counters = std::make_shared<PackerCounters>();
  auto storage = copy_to_host(t, pool, side_stream, counters, &why);
  if (!storage) {
    // The engine's facts, and offload_tensor's own remedies: it takes no on_full or min_bytes.
    const int64_t span = extent_elements(t) * static_cast<int64_t>(t.dtype().itemsize());
    throw PoolFull(
        full_facts(why, *pool, "the tensor " + describe(t.scalar_type(), t.sizes().vec(), t.device()), span),
        std::string("co.offload_tensor stores every tensor it is given, so at the cap it raises: ") +
            (why == TieredRefusal::DiskFull ? "raise spill_max_bytes or free space on the disk, " : "") +
            "raise the pool's cap (co.HostPool(max_bytes=...) or pool.set_max_bytes(...)), pass a larger pool "
            "(pool=...), drop handles you no longer need (a handle's block returns to the pool when it dies), or "
            "catch co.PoolFullError and keep the tensor where it is.");
  }
  return std::make_shared<SavedTensor>(t, std::move(storage), std::move(counters));
}

}  // namespace ckpt_offload

#include "store_dtype.h"

#include <stdexcept>

#include "../core/profiler.h"
#include "device_memory.h"
#include "device_runtime.h"
#include "runtime.h"
#include "tensor_layout.h"

namespace py = pybind11;

namespace ckpt_offload {

lowp::Format store_format_from_name(const std::string& name) {
  if (name.empty()) return lowp::Format::None;
  if (name == "bfloat16") return lowp::Format::BF16;
  if (name == "float16") return lowp::Format::F16;
  if (name == "float8_e4m3fn") return lowp::Format::E4M3;
  if (name == "float8_e5m2") return lowp::Format::E5M2;
  throw std::invalid_argument("store_dtype must be None, torch.bfloat16, torch.float16, torch.float8_e4m3fn or "
                              "torch.float8_e5m2; got " + name);
}

const char* store_format_name(lowp::Format f) {
  switch (f) {
    case lowp::Format::BF16: return "bfloat16";
    case lowp::Format::F16: return "float16";
    case lowp::Format::E4M3: return "float8_e4m3fn";
    case lowp::Format::E5M2: return "float8_e5m2";
    default: return "";
  }
}

std::optional<lowp::Source> store_source(const at::Tensor& t, lowp::Format f) {
  if (f == lowp::Format::None) return std::nullopt;
  lowp::Source s;
  switch (t.scalar_type()) {
    case at::kFloat: s = lowp::Source::F32; break;
    case at::kDouble: s = lowp::Source::F64; break;
    case at::kHalf: s = lowp::Source::F16; break;
    case at::kBFloat16: s = lowp::Source::BF16; break;
    default: return std::nullopt;  // integers, bool, complex, fp8 already: stored exactly
  }
  // Only wider than the format: bf16 into fp16 (or the reverse) would lose range or bits for
  // no bytes saved.
  if (lowp::source_bytes(s) <= lowp::format_bytes(f)) return std::nullopt;
  return s;
}

namespace {
// The finite amax of `t`'s own elements read as fp32 (as the conversion reads them: fp64 is
// rounded first), and whether one is infinite, as 0-dim tensors on t's device (no sync).
std::pair<at::Tensor, at::Tensor> own_amax(const at::Tensor& t) {
  const at::Tensor a = t.detach().to(at::kFloat).abs();
  const at::Tensor amax = at::where(at::isfinite(a), a, at::zeros({}, a.options())).max();
  return {amax, at::isinf(a).any()};
}
}  // namespace

at::Tensor store_down(lowp::Source s, const void* src, int64_t n, lowp::Format f, const c10::Device& device,
                      const CurrentStream& current, const at::Tensor* elements) {
  if (!lowp::format_scaled(f)) elements = nullptr;
  const int64_t stored = lowp::stored_bytes(f, n);
  if (device.is_cpu()) {
    // From the caching allocator in the current stream's order: the conversion runs on that
    // stream, and the D2H copy waits on it.
    at::Tensor out = device_bytes(device, static_cast<size_t>(stored));
    if (elements) {
      const auto [amax, inf] = own_amax(*elements);
      const uint32_t word = lowp::scale_word(amax.item<float>(), inf.item<bool>());
      lowp::down_cpu(s, src, n, f, out.data_ptr(), &word);
    } else {
      lowp::down_cpu(s, src, n, f, out.data_ptr());
    }
    return out;
  }
  // The CUDA build's kernels (device_runtime.h); the amax is asked for only where they run.
  if (device.is_cuda() && cuda_compiled()) {
    std::pair<at::Tensor, at::Tensor> own;
    if (elements) own = own_amax(*elements);
    at::Tensor out = device_runtime::store_down(s, src, n, f, device, current, elements ? &own : nullptr);
    if (out.defined()) return out;
  }
  throw std::runtime_error("ckpt_offload: store_dtype has no conversion for tensors on " + device.str());
}

void store_up(lowp::Source s, void* out, int64_t n, lowp::Format f, const at::Tensor& stored,
              const CurrentStream& current) {
  if (stored.device().is_cpu()) {
    lowp::up_cpu(s, out, n, f, stored.data_ptr());
    return;
  }
  if (device_runtime::store_up(s, out, n, f, stored, current)) return;  // the CUDA build's kernels
  throw std::runtime_error("ckpt_offload: store_dtype has no conversion for tensors on " + stored.device().str());
}

namespace {
at::ScalarType scalar_of(lowp::Source s) {
  switch (s) {
    case lowp::Source::F32: return at::kFloat;
    case lowp::Source::F64: return at::kDouble;
    case lowp::Source::F16: return at::kHalf;
    default: return at::kBFloat16;
  }
}
}  // namespace

double store_relative_error(const at::Tensor& t, lowp::Source s, int64_t n, lowp::Format f, const at::Tensor& stored,
                            const CurrentStream& current) {
  const auto opts = at::TensorOptions().dtype(scalar_of(s)).device(t.device());
  at::Tensor back = at::empty({n}, opts);
  store_up(s, back.data_ptr(), n, f, stored, current);
  // The tensor's own elements, in its layout over the span (index 0 is its first byte).
  const at::Tensor xd = t.detach().to(at::kDouble);
  const at::Tensor bd = back.as_strided(t.sizes(), t.strides(), 0).to(at::kDouble);
  const at::Tensor zero = at::zeros({}, xd.options());
  const at::Tensor exact = at::eq(xd, bd).logical_or(at::isnan(xd).logical_and(at::isnan(bd)));
  const double norm = at::where(at::isfinite(xd), xd, zero).norm().item<double>();
  const double diff = at::where(exact, zero, bd - xd).norm().item<double>();
  return norm > 0.0 ? diff / norm : (diff > 0.0 ? 1.0 : 0.0);
}

void StoreErrors::add(const std::string& cls, double rel_error) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = by_class_[cls];
  e.tensors++;
  e.sum += rel_error;
  if (rel_error > e.max || rel_error != rel_error) e.max = rel_error;
}

py::dict StoreErrors::to_dict() const {
  std::lock_guard<std::mutex> lock(mu_);
  py::dict d;
  for (const auto& [cls, e] : by_class_) {
    py::dict v;
    v["tensors"] = e.tensors;
    v["mean_rel_error"] = e.tensors ? e.sum / static_cast<double>(e.tensors) : 0.0;
    v["max_rel_error"] = e.max;
    d[py::str(cls)] = v;
  }
  return d;
}

void StoreErrors::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  by_class_.clear();
}

}  // namespace ckpt_offload

// SavedTensor's low-precision path lives here, next to the conversions it calls.
#include "saved_tensor.h"

namespace ckpt_offload {

std::shared_ptr<SavedTensor> SavedTensor::offload_converted(const at::Tensor& t, lowp::Source s, lowp::Format f,
                                                            const std::shared_ptr<HostPool>& pool, bool side_stream,
                                                            std::shared_ptr<PackerCounters> counters,
                                                            TieredRefusal* why, const CurrentStream* current,
                                                            StoreErrors* errors) {
  auto saved = describe_layout(t, counters);
  saved->side_stream_ = side_stream;
  DeviceScope scope(t.device());  // Note [Stream ordering] rule 6
  const CurrentStream cur = current ? *current : CurrentStream::of(t.device());
  const int64_t item = static_cast<int64_t>(t.dtype().itemsize());
  const int64_t lo = t.storage_offset() * item;
  const int64_t n = saved->nbytes_ / item;
  const void* src = static_cast<const char*>(t.storage().data()) + lo;
  // Dense over its span (the common case): the span's n elements are its own, and the scale
  // comes from them in the conversion's own pass. Else from its elements (Note [fp8 scale word]).
  const bool dense = t.is_non_overlapping_and_dense();
  at::Tensor staged = store_down(s, src, n, f, t.device(), cur, dense ? nullptr : &t);
  double error = 0.0;
  if (errors) error = store_relative_error(t, s, n, f, staged, cur);
  // The staging tensor goes through the exact path; its keep-alive holds it until the copy has
  // read it, and its copy waits on `cur`, where the conversion ran.
  auto inner = offload(staged, pool, side_stream, counters, why, &cur);
  if (!inner) return nullptr;  // kept as it is: never converted, so no error to count
  if (errors) {
    std::string cls = dtype_name(t.scalar_type()) + "->" + store_format_name(f);
    if (!profiler::scope().empty()) cls += " @ " + profiler::scope();
    errors->add(cls, error);
  }
  saved->converted_ = std::make_shared<ConvertedCopy>(std::move(inner), f, s, t.scalar_type(), t.device(), lo, n);
  saved->converted_->link();
  return saved;
}

std::shared_ptr<SavedTensor> SavedTensor::share_converted(const at::Tensor& t, std::shared_ptr<ConvertedCopy> copy,
                                                          bool side_stream, std::shared_ptr<PackerCounters> counters) {
  auto saved = describe_layout(t, std::move(counters));
  saved->side_stream_ = side_stream;
  saved->converted_ = std::move(copy);
  saved->converted_->link();
  return saved;
}

int64_t ConvertedCopy::stored_nbytes() const { return stored_->nbytes(); }

void ConvertedCopy::link() {
  std::lock_guard<std::mutex> lock(mu_);
  ++pending_;
}

void ConvertedCopy::unlink() {
  c10::Storage drop;  // freed after the lock is released
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_ > 0 && --pending_ == 0) drop = std::move(held_);
}

c10::Storage ConvertedCopy::materialize(bool first, int64_t* offset, int64_t* fresh_bytes) {
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype_));
  // The new storage keeps the original data pointer's alignment mod kReloadAlignment, as exact
  // reloads do (lo_ is the span's first byte in its original storage).
  *offset = static_cast<int64_t>(static_cast<size_t>(lo_) % OffloadedStorage::kReloadAlignment) / item;
  *fresh_bytes = 0;
  c10::Storage drop;
  std::lock_guard<std::mutex> lock(mu_);
  c10::Storage st;
  if (auto alive = reloaded_.lock()) {
    st = c10::Storage(std::move(alive));
    if (!device_.is_cpu()) {
      // Converted back on the stream current at that unpack: order this one's after it too,
      // and keep the allocator from reusing the storage before this stream is done (Note
      // [Stream ordering] rule 3).
      StreamPair streams(device_, false, false);
      if (ready_) streams.compute().wait(ready_);
      record_consumer(st, device_);
    }
  } else {
    at::Tensor narrow = stored_->unpack();  // ready on the current stream; refuses under graph capture
    DeviceScope scope(device_);
    const CurrentStream cur = CurrentStream::of(device_);
    const int64_t bytes = (*offset + elems_) * item;
    // The full-width tensor is what backward keeps: allocated inside a profiler range of its own,
    // so that torch.profiler's memory events tell it from backward's temporaries (the planner's
    // measured peak counts allocations made in ckpt_offload's reload ranges).
    CopyRange range(copy_ranges::kReloadConvert, device_);
    st = device_storage(device_, static_cast<size_t>(bytes));
    store_up(source_, static_cast<char*>(st.mutable_data()) + *offset * item, elems_, format_, narrow, cur);
    if (!device_.is_cpu()) ready_ = StreamPair(cur, false, false).compute().record();
    reloaded_ = st.getWeakStorageImpl();
    *fresh_bytes = bytes;
  }
  if (first && pending_ > 0) --pending_;
  // Kept for the saved tensors over this copy that have not unpacked yet (the attention
  // probabilities softmax saves are also, reshaped, the next matmul's input): they share it
  // instead of converting again.
  if (pending_ > 0)
    held_ = st;
  else
    drop = std::move(held_);
  return st;
}

at::Tensor SavedTensor::unpack_converted() {
  int64_t offset = 0, fresh = 0;
  c10::Storage st = converted_->materialize(!unpacked_, &offset, &fresh);
  // A fresh reload is counted by the staging tensor's own unpack.
  if (!fresh) counters_->tensors_reload_shared++;
  if (!unpacked_) {
    unpacked_ = true;
    if (fresh) device_held_.set(device_held_.bytes() + fresh);
  }
  return tensor_over(std::move(st), dtype_, sizes_, strides_, offset);
}

}  // namespace ckpt_offload

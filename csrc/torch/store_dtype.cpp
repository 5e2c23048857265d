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
  throw std::invalid_argument(
      "store_dtype must be None, torch.bfloat16, torch.float16, torch.float8_e4m3fn or "
      "torch.float8_e5m2; got " +
      name);
}

const char* store_format_name(lowp::Format f) {
  switch (f) {
    case lowp::Format::BF16:
      return "bfloat16";
    case lowp::Format::F16:
      return "float16";
    case lowp::Format::E4M3:
      return "float8_e4m3fn";
    case lowp::Format::E5M2:
      return "float8_e5m2";
    default:
      return "";
  }
}

std::optional<lowp::Source> store_source(const at::Tensor& t, lowp::Format f) {
  if (f == lowp::Format::None) return std::nullopt;
  lowp::Source s;
  switch (t.scalar_type()) {
    case at::kFloat:
      s = lowp::Source::F32;
      break;
    case at::kDouble:
      s = lowp::Source::F64;
      break;
    case at::kHalf:
      s = lowp::Source::F16;
      break;
    case at::kBFloat16:
      s = lowp::Source::BF16;
      break;
    default:
      return std::nullopt;  // integers, bool, complex, fp8 already: stored exactly
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
    case lowp::Source::F32:
      return at::kFloat;
    case lowp::Source::F64:
      return at::kDouble;
    case lowp::Source::F16:
      return at::kHalf;
    default:
      return at::kBFloat16;
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

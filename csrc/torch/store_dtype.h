// Low-precision storage of offloaded tensors (co.offload(store_dtype=...)): which saved tensors
// are stored narrower, the conversions around their copies, and the error they introduce.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "../core/low_precision.h"
#include "runtime.h"

namespace ckpt_offload {

// Note [Low-precision storage]
// With a store format, a floating-point saved tensor wider than the format is stored narrower:
//  - pack converts the span of its storage the tensor reaches, read as an element array of the
//    tensor's dtype, into a staging tensor (uint8, from the device's caching allocator, in the
//    current stream's order), and offloads that as a tensor of its own (the single-copy path:
//    never batched, never joined to the exact copies of Note [One copy per storage]). The D2H
//    copy waits on the current stream (Note [Stream ordering]), so it reads the staging bytes
//    after the conversion wrote them; the copy's keep-alive holds the staging storage until the
//    copy has read it.
//  - unpack reloads the staging bytes (or takes them from a prefetch) into a device tensor that
//    is ready on the current stream, and converts them back on the current stream into a new
//    storage of the tensor's dtype: the consumer, on that stream too, runs after it.
//  - a later saved tensor whose span is exactly that of a converted one (same storage, first
//    and last byte, dtype and version counter value), within one activation of the context or
//    across them with keep_dedup, shares its ConvertedCopy (saved_tensor.h) instead of converting
//    again when both are dense over the span (or have the same sizes and strides): the same
//    elements give the same bits (fp8's scale is their amax), so gradients equal those of
//    converting it twice. Its layout may differ (softmax's output, and the same
//    storage reshaped for the next bmm): each SavedTensor keeps its own sizes and strides and
//    rebuilds them over the one full-width storage, which is converted back once and kept for
//    the saved tensors of the copy that have not unpacked yet. Counted as deduplicated, not
//    offloaded. Spans that only overlap are converted apart: a narrow copy of a span cannot be
//    extended the way an exact copy is (fp8's scale covers the whole span).
//  - fp8 formats store a scale word after the elements, in the same buffer (Note [fp8 scale
//    word], core/low_precision.h): the fp32 absolute maximum of the tensor's own finite
//    elements, and whether it holds an infinity. A strided view (q of qkv.chunk(3, -1)) is
//    converted over its span, but its scale comes from its own elements, not from the gaps
//    (k and v): those are converted with its scale (saturating) and never read. Neither
//    direction synchronizes with the device for it.
// fp64 is read as fp32 first (as torch's casts do), and the element rounding is round to
// nearest even, the same on CPU and CUDA (csrc/core/low_precision.h).

// The format from its Python name ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"), or
// Format::None for "".
lowp::Format store_format_from_name(const std::string& name);
const char* store_format_name(lowp::Format f);
// t's element kind when a store format f converts it (floating point, wider than f), else none.
std::optional<lowp::Source> store_source(const at::Tensor& t, lowp::Format f);

// The stored bytes of `n` elements of kind `s` at `src` (a device or host pointer on
// `device`), as a new uint8 tensor on `device` (the staging buffer). `elements`: the tensor
// whose own elements give a scaled format's scale when they are not all n of the span (a
// strided or overlapping view); null: the n elements.
at::Tensor store_down(lowp::Source s, const void* src, int64_t n, lowp::Format f, const c10::Device& device,
                      const CurrentStream& current, const at::Tensor* elements = nullptr);
// Back: `stored` (as store_down wrote it, on `out`'s device) into n elements at `out`.
void store_up(lowp::Source s, void* out, int64_t n, lowp::Format f, const at::Tensor& stored,
              const CurrentStream& current);

// Relative error (||x - stored(x)|| / ||x||) introduced per tensor class, with measure_error.
class StoreErrors {
 public:
  void add(const std::string& cls, double rel_error);
  pybind11::dict to_dict() const;
  void reset();

 private:
  struct Entry {
    int64_t tensors = 0;
    double sum = 0.0, max = 0.0;
  };
  mutable std::mutex mu_;
  std::map<std::string, Entry> by_class_;
};

// The relative error of storing `t` (of kind s, its span n elements) as `stored`, over t's own
// elements: equal infinities and NaN where t has NaN count as exact, and the norm is that of
// t's finite values (synchronizes with the device: only with measure_error).
double store_relative_error(const at::Tensor& t, lowp::Source s, int64_t n, lowp::Format f, const at::Tensor& stored,
                            const CurrentStream& current);

}  // namespace ckpt_offload

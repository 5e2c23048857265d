#include "tensor_layout.h"

#include "../core/text.h"

namespace ckpt_offload {

// Strings only, no ostringstream: Note [No iostreams in the extension] (csrc/core/text.h).
std::string describe(c10::ScalarType dtype, const std::vector<int64_t>& sizes, const c10::Device& device) {
  std::string s = "[";
  s += c10::toString(dtype);
  s += " on ";
  s += device.str();
  s += ", shape [";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  s += "]]";
  return s;
}

std::string layout_name(c10::Layout layout) {
  switch (layout) {
    case c10::kStrided:
      return "torch.strided";
    case c10::kSparse:
      return "torch.sparse_coo";
    case c10::kSparseCsr:
      return "torch.sparse_csr";
    case c10::kSparseCsc:
      return "torch.sparse_csc";
    case c10::kSparseBsr:
      return "torch.sparse_bsr";
    case c10::kSparseBsc:
      return "torch.sparse_bsc";
    case c10::kMkldnn:
      return "torch._mkldnn";
    case c10::kJagged:
      return "torch.jagged";
    default:
      return "layout " + std::to_string(static_cast<int>(layout));
  }
}

std::string human_bytes(size_t bytes) {
  static const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return std::to_string(bytes) + " bytes";
  return fixed1(v) + " " + units[u];
}

bool unsupported_layout(const at::Tensor& t) {
  return t.layout() != c10::kStrided || t.is_nested() || t.is_quantized() || t.is_mkldnn() || t.is_meta() ||
         t.is_conj() || t.is_neg();
}

// Note [Tensors without data]
// A ZeroTensor (forward-mode AD's zero tangents, at::_efficientzerotensor) is strided and has a
// storage, but its data pointer is null: its values are implied, not stored. A tensor whose
// storage was freed under it (resize_(0), as FSDP and torch.compile do) or that has no storage
// at all is the same to a copy. Copying any of them reads address 0 (or freed memory), so
// they are kept as they are (KeepReason::NoData) and offload_tensor refuses them.
bool without_data(const at::Tensor& t) {
  return t._is_zerotensor() || storage_lacks_span(*t.unsafeGetTensorImpl(), extent_elements(t));
}

bool wrapped_tensor(const at::Tensor& t) { return t.key_set().has_any(wrapper_keys()); }

int64_t extent_elements(const at::Tensor& t) { return extent_elements(*t.unsafeGetTensorImpl()); }

int device_index(const c10::Device& d) { return d.is_cuda() ? d.index() : -1; }

// torch's Python names ("float32", "bfloat16"), which is what users read in traces and CSVs.
std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return "float32";
    case c10::kDouble:
      return "float64";
    case c10::kHalf:
      return "float16";
    case c10::kBFloat16:
      return "bfloat16";
    case c10::kByte:
      return "uint8";
    case c10::kChar:
      return "int8";
    case c10::kShort:
      return "int16";
    case c10::kInt:
      return "int32";
    case c10::kLong:
      return "int64";
    case c10::kBool:
      return "bool";
    case c10::kComplexFloat:
      return "complex64";
    case c10::kComplexDouble:
      return "complex128";
    default:
      return c10::toString(t);
  }
}

std::string saved_tensor_name(const at::Tensor& t) {
  return "a saved tensor " + describe(t.scalar_type(), t.sizes().vec(), t.device());
}

std::string full_facts(TieredRefusal why, HostPool& pool, const std::string& what, int64_t span) {
  const std::string asked = human_bytes(span) + " (" + std::to_string(span) + " bytes) for " + what;
  if (why == TieredRefusal::DiskFull) {
    std::string facts = "ckpt_offload: the host pool is full and its disk tier has no room. Asked for " + asked;
    if (auto target = spill_target(&pool)) {
      const FileTierStats ds = target->tier()->stats();
      facts += "; spill_dir " + target->tier()->options().dir + ": " + human_bytes(ds.bytes_in_use) + " in use, " +
               human_bytes(ds.bytes_reserved) + " preallocated, cap " +
               (ds.max_bytes ? human_bytes(ds.max_bytes) : std::string("none (the file system is full)"));
    }
    return facts;
  }
  const PoolStats ps = pool.stats();
  return "ckpt_offload: the host pool is full. Asked for " + asked + "; " + human_bytes(ps.bytes_in_use) + " in use, " +
         human_bytes(ps.bytes_pending) + " waiting for copies, " + human_bytes(ps.bytes_reserved) + " reserved, cap " +
         (ps.max_bytes ? human_bytes(ps.max_bytes) : std::string("none (the backend refused the memory)"));
}

PoolFull pool_full(TieredRefusal why, HostPool& pool, const std::string& what, int64_t span) {
  return PoolFull(full_facts(why, pool, what, span),
                  why == TieredRefusal::DiskFull
                      ? "Raise spill_max_bytes, free space on the disk, offload less, or pass on_full=\"keep\" to keep "
                        "such tensors on the device."
                      : "Raise the cap (co.HostPool(max_bytes=...) or pool.set_max_bytes(...)), offload less (a larger "
                        "min_bytes), or pass on_full=\"keep\" to keep such tensors on the device.");
}

std::string inplace_message(c10::ScalarType dtype, c10::IntArrayRef sizes, const c10::Device& device, uint32_t now,
                            uint32_t expected, const char* why, const char* hint) {
  // A string, not an ostringstream: Note [No iostreams in the extension] (csrc/core/text.h).
  return "one of the variables needed for gradient computation has been modified by an inplace operation: " +
         describe(dtype, sizes.vec(), device) + " is at version " + std::to_string(now) + "; expected version " +
         std::to_string(expected) + " instead. (Detected by ckpt_offload: " + why + ") Hint: " + hint;
}

}  // namespace ckpt_offload

// Note [Saved tensor kinds]: what every kind shares, the Kept kind, and the one unpack dispatch.
#include "saved_tensor.h"

#include <stdexcept>

#include "runtime.h"
#include "saved_converted.h"
#include "tensor_layout.h"

namespace ckpt_offload {

SavedVersion::SavedVersion(const at::Tensor& t) {
  const auto& vc = t.unsafeGetTensorImpl()->version_counter();
  if (vc.enabled()) {
    version_ = vc;
    saved_ = vc.current_version();
  }
}

void SavedVersion::check(c10::ScalarType dtype, c10::IntArrayRef sizes, const c10::Device& device) const {
  if (!modified()) return;
  // A string, not an ostringstream: Note [No iostreams in the extension] (csrc/core/text.h).
  throw std::runtime_error(
      "one of the variables needed for gradient computation has been modified by an inplace operation: " +
      describe(dtype, sizes.vec(), device) + " is at version " + std::to_string(version_.current_version()) +
      "; expected version " + std::to_string(saved_) +
      " instead. (Detected by ckpt_offload: the tensor was modified in place after autograd saved it, so backward "
      "would have used the wrong values.) Hint: clone the tensor before modifying it in place, or use the "
      "out-of-place operation.");
}

SavedTensor::SavedTensor(const at::Tensor& t, bool layout, std::shared_ptr<PackerCounters> counters, Bytes bytes)
    : bytes_(std::move(bytes)),
      version_(t),
      dtype_(t.scalar_type()),
      device_(t.device()),
      counters_(std::move(counters)) {
  if (!layout) return;
  const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
  const c10::IntArrayRef sizes = impl.sizes(), strides = impl.strides();
  sizes_.assign(sizes.begin(), sizes.end());
  strides_.assign(strides.begin(), strides.end());
  int64_t extent = impl.numel() > 0 ? 1 : 0;  // extent_elements, from what is at hand
  if (extent)
    for (size_t d = 0; d < sizes.size(); ++d) extent += (sizes[d] - 1) * strides[d];
  const int64_t item = static_cast<int64_t>(impl.dtype().itemsize());
  nbytes_ = extent * item;
  lo_ = impl.storage_offset() * item;
}

SavedTensor::SavedTensor(KeptTag, const at::Tensor& t, at::Tensor alias, int64_t nbytes, int64_t device_bytes,
                         std::shared_ptr<PackerCounters> counters)
    : SavedTensor(t, /*layout=*/false, std::move(counters), Kept{std::move(alias)}) {
  nbytes_ = nbytes;
  if (device_bytes) device_held_.set(device_bytes);
}

SavedTensor::SavedTensor(const at::Tensor& t, std::shared_ptr<OffloadedStorage> storage,
                         std::shared_ptr<PackerCounters> counters)
    : SavedTensor(t, /*layout=*/true, std::move(counters), Offloaded{std::move(storage)}) {
  std::get<Offloaded>(bytes_).storage->link();
}

SavedTensor::SavedTensor(const at::Tensor& t, std::shared_ptr<ConvertedCopy> copy,
                         std::shared_ptr<PackerCounters> counters)
    : SavedTensor(t, /*layout=*/true, std::move(counters), Converted{std::move(copy)}) {
  std::get<Converted>(bytes_).copy->link();
}

SavedTensor::~SavedTensor() {
  // Autograd drops saved tensors from destructors and while a raising backward unwinds: never
  // throw from here (Note [No throw on teardown], core/stream.h). A moved-from one holds nothing.
  bool copied = false;
  try {
    if (auto* o = std::get_if<Offloaded>(&bytes_); o && o->storage) {
      copied = true;
      if (!unpacked_) o->storage->unlink();
    } else if (auto* c = std::get_if<Converted>(&bytes_); c && c->copy) {
      copied = true;
      if (!unpacked_) c->copy->unlink();
    }
  } catch (...) {
  }
  // Note [Sources released with their graph]: a side-stream copy holds its source (the device
  // tensor autograd, or a selective checkpoint's cache, saved) until the engine sees it finished,
  // and the engine looks only when something is copied, at the end of a backward or at
  // synchronize(). A graph dropped without a backward (or a checkpoint's cache dropped with it)
  // would leave those device tensors alive until the next step; the copies that have finished
  // let go of their sources here, as the graph that saved them goes (a kept tensor's graph
  // holds copies too, whose saved tensors poll as they go).
  if (!copied) return;
  try {
    engine().poll();
  } catch (...) {
  }
}

void SavedTensor::check_version() const {
  if (!version_.modified()) return;
  if (const auto* k = std::get_if<Kept>(&bytes_); k && k->alias.defined())
    version_.check(dtype_, k->alias.sizes(), device_);
  else
    version_.check(dtype_, sizes_, device_);
}

int64_t SavedTensor::stored_nbytes() const {
  if (const auto* c = std::get_if<Converted>(&bytes_)) return c->copy->stored_nbytes();
  return nbytes_;
}

at::Tensor SavedTensor::unpack(bool accept_modified) {
  check_version();
  switch (bytes_.index()) {
    case 0: return std::get<Kept>(bytes_).alias;
    case 1: return unpack_offloaded(std::get<Offloaded>(bytes_), accept_modified);
    default: return unpack_converted(std::get<Converted>(bytes_), accept_modified);
  }
}

}  // namespace ckpt_offload

// Note [Saved tensor kinds]: what every kind shares, the one unpack dispatch and its three branches
// (Kept, Offloaded, Converted with its ConvertedCopy).
#include "saved_tensor.h"

#include <stdexcept>

#include "../core/profiler.h"
#include "device_memory.h"
#include "runtime.h"
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
  throw std::runtime_error(inplace_message(
      dtype, sizes, device, version_.current_version(), saved_,
      "the tensor was modified in place after autograd saved it, so backward would have used the wrong values.",
      "clone the tensor before modifying it in place, or use the out-of-place operation."));
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
  const int64_t item = static_cast<int64_t>(impl.dtype().itemsize());
  nbytes_ = extent_elements(impl) * item;  // Note [Span of a tensor]
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
    case 0:
      return std::get<Kept>(bytes_).alias;
    case 1:
      return unpack_offloaded(std::get<Offloaded>(bytes_), accept_modified);
    default:
      return unpack_converted(std::get<Converted>(bytes_), accept_modified);
  }
}

at::Tensor SavedTensor::unpack_offloaded(Offloaded& o, bool accept_modified) {
  if (current_stream_capturing(device_))
    // Note [Graph capture]: a reload copy (and its event waits) would be baked into the graph,
    // replayed later against host memory that may hold other bytes by then.
    throw std::runtime_error(
        "ckpt_offload: a saved tensor held in the host pool was unpacked while a CUDA graph is being captured "
        "on " +
        device_.str() +
        "; reloads cannot be captured. Run the backward outside the capture, or capture "
        "the forward under the capture too (tensors saved during capture stay on the device), or leave this "
        "region out of co.offload.");
  // A copy absorbed into another since this was packed forwards there (Note [One copy per
  // storage]); its pending count moved along, so the destructor's unlink goes there too.
  o.storage = OffloadedStorage::resolve(std::move(o.storage));
  bool shared = false;
  int64_t fresh = 0;
  const OffloadedStorage::View view{dtype_, sizes_, strides_, lo_, /*share_object=*/!distinct_};
  at::Tensor out = o.storage->materialize(!unpacked_, view, accept_modified, &shared, &fresh);
  unpacked_ = true;
  if (shared) {
    counters_->tensors_reload_shared++;
  } else {
    counters_->tensors_reloaded++;
    counters_->bytes_reloaded += static_cast<int64_t>(o.storage->nbytes());
  }
  if (fresh) {
    // The reloaded storage lives about as long as the node that unpacked it, which is when
    // autograd drops this SavedTensor: the memory timeline counts it until then.
    device_held_.set(device_held_.bytes() + fresh);
  }
  sample_memory(o.storage->pool(), device_);
  return out;
}

at::Tensor SavedTensor::unpack_converted(Converted& c, bool accept_modified) {
  int64_t fresh = 0;
  at::Tensor out = c.copy->materialize(!unpacked_, sizes_, strides_, accept_modified, &fresh);
  // A fresh reload is counted by the staging tensor's own unpack.
  if (!fresh) counters_->tensors_reload_shared++;
  if (!unpacked_) {
    unpacked_ = true;
    if (fresh) device_held_.set(device_held_.bytes() + fresh);
  }
  return out;
}

void ConvertedCopy::link() {
  std::lock_guard<std::mutex> lock(mu_);
  ++pending_;
}

void ConvertedCopy::unlink() {
  c10::Storage drop;  // freed after the lock is released
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_ > 0 && --pending_ == 0) drop = std::move(held_);
}

at::Tensor ConvertedCopy::materialize(bool first, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                                      bool accept_modified, int64_t* fresh_bytes) {
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype_));
  // The new storage keeps the original data pointer's alignment mod kReloadAlignment, as exact
  // reloads do (lo_ is the span's first byte in its original storage).
  const int64_t offset = static_cast<int64_t>(static_cast<size_t>(lo_) % OffloadedStorage::kReloadAlignment) / item;
  *fresh_bytes = 0;
  c10::Storage drop;
  std::lock_guard<std::mutex> lock(mu_);
  c10::Storage st;
  at::Tensor out;
  if (auto alive = reloaded_.lock()) {
    st = c10::Storage(std::move(alive));
    // Checked before anything changes (Note [One version per device copy]).
    version_.check(accept_modified, dtype_, sizes, device_);
    out = tensor_over(st, dtype_, sizes, strides, offset);
    version_.share(out);
    if (!device_.is_cpu()) {
      // Converted back on the stream current at that unpack: order this one's after it too,
      // and keep the allocator from reusing the storage before this stream is done (Note
      // [Stream ordering] rule 3).
      StreamPair streams(device_, false, false);
      if (ready_) streams.compute().wait(ready_);
      record_consumer(st, device_);
    }
  } else {
    at::Tensor narrow = stored_.unpack();  // ready on the current stream; refuses under graph capture
    DeviceScope scope(device_);
    const CurrentStream cur = CurrentStream::of(device_);
    const int64_t bytes = (offset + elems_) * item;
    // The full-width tensor is what backward keeps: allocated inside a profiler range of its own,
    // so that torch.profiler's memory events tell it from backward's temporaries (the planner's
    // measured peak counts allocations made in ckpt_offload's reload ranges).
    CopyRange range(copy_ranges::kReloadConvert, device_);
    st = device_storage(device_, static_cast<size_t>(bytes));
    store_up(source_, static_cast<char*>(st.mutable_data()) + offset * item, elems_, format_, narrow, cur);
    if (!device_.is_cpu()) ready_ = StreamPair(cur, false, false).compute().record();
    reloaded_ = st.getWeakStorageImpl();
    *fresh_bytes = bytes;
    out = tensor_over(st, dtype_, sizes, strides, offset);
    version_.start(out);
  }
  if (first && pending_ > 0) --pending_;
  // Kept for the saved tensors over this copy that have not unpacked yet (the attention
  // probabilities softmax saves are also, reshaped, the next matmul's input): they share it
  // instead of converting again.
  if (pending_ > 0)
    held_ = st;
  else
    drop = std::move(held_);
  return out;
}

}  // namespace ckpt_offload

// Note [Saved tensor kinds]: the Converted kind, next to the narrow copy it views.
#include "saved_converted.h"

#include <string>

#include "../core/profiler.h"
#include "device_memory.h"
#include "tensor_layout.h"

namespace ckpt_offload {

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

}  // namespace ckpt_offload

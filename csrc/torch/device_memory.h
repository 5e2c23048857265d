// Device memory the saved-tensor hooks allocate or hold, and the test hooks that make its
// allocation fail.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <stdexcept>

#include "../core/copy_engine.h"
#include "../core/host_pool.h"
#include "../core/stream.h"

namespace ckpt_offload {

// `n` uninitialized bytes on `device`, from torch's allocator, in the current stream's order.
at::Tensor device_bytes(const c10::Device& device, size_t n);
// The same bytes as a bare storage, straight from the device's allocator: no tensor and no
// dispatcher call, which the reload path (once per saved tensor in backward) cannot afford.
c10::Storage device_storage(const c10::Device& device, size_t n);
// A tensor of `dtype` over `storage` with this layout, made directly (what at::empty + set_
// produce, without their two dispatcher round trips). The caller guarantees that the layout
// stays inside the storage: it was the saved tensor's own, checked when it was packed.
at::Tensor tensor_over(c10::Storage storage, c10::ScalarType dtype, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                       int64_t offset);
// Note [One version per device copy]
// Autograd without hooks hands every node that saved a tensor the tensor itself, and checks its
// version at every unpack; views of one base share that counter. With hooks it checks nothing,
// but gives the unpacked tensor's counter to what the node gets (SavedVariable::unpack). A device
// copy that several unpacks share -- a reload held for the saved tensors still to come, a reload
// still alive (retain_graph, double backward, another view of the storage), a batch member kept
// on the device, a converted reload -- plays that base: every tensor made over it shares one
// version counter, and an unpack that shares the copy first checks that the counter has not moved
// since the copy was made. A backward that wrote its saved tensor in place (a kernel reusing its
// input as scratch) then makes the next unpack of those bytes raise autograd's error, as it does
// without hooks, instead of handing that node the written bytes. (An identical view may get the
// very tensor another unpack made: Note [Same view, same tensor], offloaded_storage.cpp.)
class DeviceCopyVersion {
 public:
  // `t`, the first tensor made over a new device copy: its counter becomes the copy's.
  void start(const at::Tensor& t) {
    counter_ = t.unsafeGetTensorImpl()->version_counter();
    at_ = counter_.enabled() ? counter_.current_version() : 0;
  }
  // Another tensor over the same copy shares the counter (as views of one base do).
  void share(const at::Tensor& t) const {
    if (counter_.enabled() && t.unsafeGetTensorImpl()->version_counter().enabled())
      t.unsafeGetTensorImpl()->set_version_counter(counter_);
  }
  bool started() const { return counter_.enabled(); }
  bool modified() const { return counter_.enabled() && counter_.current_version() != at_; }
  // Takes the write as the copy's value from now on (Note [Selective checkpoint cache mutation]).
  void accept() { at_ = counter_.enabled() ? counter_.current_version() : 0; }
  // Raises DeviceCopyModified, describing the saved tensor as `dtype`, `sizes`, `device`, when
  // modified() and the caller did not accept the write.
  void check(bool accept_modified, c10::ScalarType dtype, c10::IntArrayRef sizes, const c10::Device& device);

 private:
  c10::VariableVersion counter_;  // disabled until a copy starts
  uint32_t at_ = 0;
};

// Autograd's in-place error for a shared device copy written since it was made
// (Note [One version per device copy]). Raised before the unpack changes anything, so that the
// caller may retry it accepting the write where torch allows it.
class DeviceCopyModified : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Holds a source storage until its copy has read it, counted in the memory timeline meanwhile.
// The pointer is the c10::Storage.
std::shared_ptr<void> tracked_keepalive(const c10::Storage& st, int64_t bytes);
// tracked_keepalive(st, bytes), made by CopyEngine::offload only when the copy still runs once
// enqueued (an inline copy holds nothing: no allocation, no count).
class SourceKeepalive final : public KeepaliveSource {
 public:
  SourceKeepalive(const c10::Storage& st, int64_t bytes) : st_(st), bytes_(bytes) {}
  std::shared_ptr<void> make() const override { return tracked_keepalive(st_, bytes_); }

 private:
  const c10::Storage& st_;
  int64_t bytes_;
};
// Adds a memory sample (pool bytes, device bytes saved/allocated) to the profiler, when on.
void sample_memory(HostPool* pool, const c10::Device& device);
// A device block for a batch's gather or scatter. Undefined when device memory is short (or
// the test hook turned staging off): the batch then copies each member on its own, between
// its device memory and the host block, which needs no extra device memory.
at::Tensor staging_block(const c10::Device& device, size_t bytes);

// A reload buffer handed to the current stream of its device, which may not be the stream
// that allocated it (a prefetch made under another stream, a reload shared between unpacks):
// record_stream on the consumer, so the caching allocator does not reuse the memory while the
// consumer's kernels are queued. A no-op for CPU, and (in the allocator) for the allocating
// stream itself. Note [Stream ordering] rule 3.
void record_consumer(const c10::Storage& storage, const c10::Device& device);
// Lets go of `storage`, which the copy ending at `done` on `copy` may still write or read:
// CUDA memory is released now with record_stream on `copy` (the allocator defers its reuse
// until the copy stream's work is done, so nothing waits for a later poll); other memory is
// held by the engine until `done` completes. Never throws (destructor paths; Note [No throw
// on teardown] in core/stream.h).
void release_after_copy(c10::Storage storage, Stream* copy, std::shared_ptr<Event> done) noexcept;

// Test hook: the next `n` prefetches raise (as running out of device memory would).
void fail_next_prefetches(int n);
// Test hook: batches gather through a device staging block (default) or copy member by member.
void set_batch_staging(bool on);
// Raises when fail_next_prefetches asked for it.
void maybe_fail_prefetch();

}  // namespace ckpt_offload

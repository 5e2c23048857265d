// Note [Offload inside a compiled graph]
// Under torch.compile(fullgraph=True) a checkpoint's offloaded input cannot go through saved-
// tensor hooks (AOTAutograd hands them its saved tensors only when the whole forward ends). The
// wrapper instead builds the offload into the graph with two ops (ckpt_offload/_compile_ops.py):
// `to_host(x)` returns an ordinary CPU tensor whose storage is a pool block (what AOTAutograd
// saves for backward), `to_device(h)` a device tensor with its values again (the first op of the
// checkpointed region, so the recompute in backward starts with it). The copies run on the
// engine's streams under Note [Stream ordering]:
//  - to_host: the copy waits for the compute stream (rule 1); the engine holds the source until
//    the copy has read it. A CUDA source is first cloned on the compute stream, and the copy
//    reads the clone: the compiled graph may reuse the source's memory for a later buffer as
//    soon as to_host returns (Inductor reuses dead buffers without the allocator), while the
//    clone is ours alone. The clone also serves the forward's own to_device (a device-to-device
//    copy on the compute stream, instead of waiting for the host copy and copying it back); it
//    is let go at that first to_device.
//  - to_device: allocated on the compute stream, the copy waits for it and for the offload copy,
//    and the compute stream waits for the copy (rule 2), on the demand stream (rule 4).
//  - the block is freed when the CPU tensor's storage dies, reusable once every copy that read
//    or wrote it has finished (rule 5, the HostBuffer's events).
// CPU tensors copy inline on the compute "stream": the values are in the block when to_host
// returns.
//
// Note [Span copies in a compiled graph]
// The ops copy what the eager route copies: the span of storage the tensor reaches from its
// first element (extent_elements, tensor_layout.h). to_host's CPU tensor and to_device's device
// tensor both have the source's sizes and strides over a storage of exactly that span (offset
// 0), so a broadcast input (expand: stride 0) takes its source's bytes in the pool and on the
// device again, not its expanded size, and a transposed input comes back transposed, as the
// block saw it. The fake kernels (ckpt_offload/_compile_ops.py) say the same strides, which is
// what the compiled graph is planned with.
#include "compile_ops.h"

#include <c10/core/Storage.h>

#include <mutex>
#include <stdexcept>
#include <utility>

#include "../core/copy_engine.h"
#include "counters.h"
#include "runtime.h"
#include "tensor_layout.h"

namespace ckpt_offload {

namespace {

// What a pool-backed CPU tensor's storage owns: the block, and the clone of a CUDA source until
// the first to_device took it (Note [Offload inside a compiled graph]).
struct HostCopy {
  std::shared_ptr<HostBuffer> buffer;
  std::mutex mu;
  at::Tensor snapshot;
};

void delete_host_copy(void* ctx) {
  // ~HostBuffer never throws (Note [No throw on teardown]); the snapshot is a tensor.
  delete static_cast<HostCopy*>(ctx);
}

size_t span_bytes(const at::Tensor& t) { return static_cast<size_t>(extent_elements(t)) * t.element_size(); }

// The HostCopy behind `t` when `t` reaches exactly its block from the block's start (what
// to_host returned, or a view of it with the same span), else nullptr.
HostCopy* host_copy_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  auto* ctx = t.storage().data_ptr().cast_context<HostCopy>(&delete_host_copy);
  if (!ctx || t.storage_offset() != 0 || span_bytes(t) != ctx->buffer->nbytes() || t.data_ptr() != ctx->buffer->data())
    return nullptr;
  return ctx;
}

// A tensor on `options`' device with `like`'s sizes and strides over a storage of exactly its
// span, offset 0 (Note [Span copies in a compiled graph]); `span` is that storage as one dimension.
at::Tensor empty_like_span(const at::Tensor& like, const at::TensorOptions& options, at::Tensor* span) {
  at::Tensor out = at::empty_strided(like.sizes(), like.strides(), options);
  if (span) *span = out.as_strided({extent_elements(out)}, {1}, 0);
  return out;
}

void check_source(const at::Tensor& x, const char* op) {
  if (!x.defined()) throw std::invalid_argument(std::string(op) + ": tensor is undefined");
  if (x.layout() != at::kStrided || x.is_conj() || x.is_neg())
    throw std::invalid_argument(std::string(op) + ": tensor must be a plain strided tensor");
  if (!x.device().is_cpu() && !x.device().is_cuda())
    throw std::invalid_argument(std::string(op) + ": tensor must be on 'cpu' or 'cuda', got " + x.device().str());
  if (x.device().is_cuda() && !cuda_compiled())
    throw std::invalid_argument(std::string(op) + ": this build of ckpt_offload has no CUDA");
}

}  // namespace

at::Tensor compile_to_host(const at::Tensor& x, const std::shared_ptr<HostPool>& pool, bool side_stream) {
  check_source(x, "ckpt_offload::to_host");
  if (!pool) throw std::invalid_argument("ckpt_offload::to_host: no pool");
  const at::TensorOptions host_options = x.options().device(at::kCPU);
  if (x.numel() == 0) return at::empty_strided(x.sizes(), x.strides(), host_options);
  if (without_data(x)) throw std::invalid_argument("ckpt_offload::to_host: tensor has no data to copy");
  const c10::Device device = x.device();
  DeviceScope scope(device);
  // The span the tensor reaches, as one dimension (Note [Span copies in a compiled graph]). A
  // CUDA source: a clone of our own (Note [Offload inside a compiled graph]); a CPU one is
  // copied inline below, before this returns.
  const at::Tensor span = x.as_strided({extent_elements(x)}, {1});
  at::Tensor source = device.is_cuda() ? span.clone() : span;
  const size_t bytes = source.nbytes();
  const bool side = side_stream && device.is_cuda();
  StreamPair streams(device, side, /*to_host=*/true);
  CopyRange range(copy_ranges::kOffload, device);
  CopyTag tag{0, device_index(device), false, 1};
  auto buffer = engine().offload(pool, source.data_ptr(), bytes, streams.compute(), streams.copy(),
                                 std::make_shared<at::Tensor>(source), tag);
  if (!buffer) throw pool_full(TieredRefusal::PoolFull, *pool, saved_tensor_name(x), static_cast<int64_t>(bytes));
  auto* ctx = new HostCopy{buffer, {}, device.is_cuda() ? source : at::Tensor()};
  c10::DataPtr data(buffer->data(), ctx, &delete_host_copy, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  at::Tensor out = at::empty({0}, host_options);
  out.set_(storage, 0, x.sizes(), x.strides());
  return out;
}

at::Tensor compile_to_device(const at::Tensor& host, const std::string& device_name, bool side_stream) {
  const c10::Device device(device_name);
  if (!host.defined() || !host.device().is_cpu())
    throw std::invalid_argument("ckpt_offload::to_device: expects a CPU tensor, got one on " +
                                (host.defined() ? host.device().str() : std::string("(undefined)")));
  if (!device.is_cpu() && !device.is_cuda())
    throw std::invalid_argument("ckpt_offload::to_device: device must be 'cpu' or 'cuda', got " + device.str());
  const at::TensorOptions options = host.options().device(device);
  DeviceScope scope(device);
  at::Tensor span;
  HostCopy* ctx = host_copy_of(host);
  if (!ctx || host.numel() == 0) {
    // Not a to_host copy: an ordinary one, of the span, with host's sizes and strides all the same.
    at::Tensor out = empty_like_span(host, options, &span);
    if (host.numel() != 0) span.copy_(host.as_strided({extent_elements(host)}, {1}));
    return out;
  }
  at::Tensor snapshot;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    snapshot = std::move(ctx->snapshot);
    ctx->snapshot = at::Tensor();
  }
  if (snapshot.defined() && snapshot.device() == device) {
    // The forward's own reload: the clone is still on the device (stream order: same stream).
    at::Tensor out = empty_like_span(host, options, &span);
    span.copy_(snapshot);
    return out;
  }
  const bool side = side_stream && device.is_cuda();
  StreamPair streams(device, side, /*to_host=*/false, /*demand=*/true);
  CopyRange range(copy_ranges::kReload, device);
  at::Tensor out = empty_like_span(host, options, nullptr);
  CopyTag tag{0, device_index(device), false, 1};
  engine().reload(*ctx->buffer, out.data_ptr(), streams.compute(), streams.copy(), /*consumer_waits=*/true, tag);
  return out;
}

bool compile_pool_backed(const at::Tensor& t) { return host_copy_of(t) != nullptr; }

}  // namespace ckpt_offload

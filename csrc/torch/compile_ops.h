// The copies behind ckpt_offload's torch.library ops (ckpt_offload/_compile_ops.py), which put a
// checkpoint's offloaded input inside a compiled graph: see Note [Offload inside a compiled graph].
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "../core/host_pool.h"

namespace ckpt_offload {

// A CPU tensor over a block of `pool` holding a copy of the span of storage `x` (CPU or CUDA)
// reaches, with `x`'s sizes and strides: an expanded tensor takes its source's bytes (Note [Span
// copies in a compiled graph]). The block goes back to the pool when the tensor's storage dies,
// reusable once every copy that touched it has finished. Throws PoolFull when the pool cannot hold it.
at::Tensor compile_to_host(const at::Tensor& x, const std::shared_ptr<HostPool>& pool, bool side_stream);
// A tensor on `device` with the values, sizes and strides of `host`, over a storage of its span
// (one compile_to_host made: the copy waits for the offload's copy on the device's streams; any
// other CPU tensor: an ordinary copy).
at::Tensor compile_to_device(const at::Tensor& host, const std::string& device, bool side_stream);
// Whether `t`'s storage is a pool block compile_to_host made (tests).
bool compile_pool_backed(const at::Tensor& t);

}  // namespace ckpt_offload

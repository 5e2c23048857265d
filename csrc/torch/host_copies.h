// What pack copies to the host for a saved tensor: an exact copy of its span (copy_to_host, and
// the missing pieces of a joined copy, offload_bytes), a narrow one (convert_to_host, Note
// [Low-precision storage]), and co.offload_tensor, which makes one on its own. The saved tensors
// that view these copies, and their unpack, are saved_tensor.h's.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

#include "../core/host_pool.h"
#include "../core/low_precision.h"
#include "../core/spill.h"
#include "counters.h"
#include "current_stream.h"
#include "offloaded_storage.h"
#include "saved_tensor.h"
#include "store_dtype.h"

namespace ckpt_offload {

// An exact copy (what an Offloaded saved tensor views). Copies bytes [from, to) of t's storage
// (-1: t's span) into `pool` (or, at its cap, through its disk tier: Note [Spilling offloaded
// blocks]), in t's device's stream order (`current`, or read here), as a host copy whose byte 0
// stands for byte `from` of t's storage. Null when neither can take them; `why` (optional) then
// says which refused.
std::shared_ptr<OffloadedStorage> copy_to_host(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                               bool side_stream, const std::shared_ptr<PackerCounters>& counters,
                                               TieredRefusal* why = nullptr, const CurrentStream* current = nullptr,
                                               int64_t from = -1, int64_t to = -1);

// The bytes [from, to) of t's storage as pool (or disk tier) buffers: copy_to_host's copy, and
// the missing pieces of a joined copy (Note [One copy per storage]).
std::shared_ptr<TieredBuffer> offload_bytes(const at::Tensor& t, int64_t from, int64_t to,
                                            const std::shared_ptr<HostPool>& pool, bool side_stream,
                                            const CurrentStream* current, uint64_t handle, TieredRefusal* why);

// The standalone engine entry point (co.offload_tensor): checks the tensor (ValueError naming
// what it is, the only check of it), copies it, raises PoolFull with its own remedies.
std::shared_ptr<SavedTensor> offload_tensor(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                            bool side_stream);

// A narrow copy (what a Converted saved tensor views): t (of kind s) converted to format f into a
// staging tensor, which copy_to_host copies: the narrow copy of t's span, or null when the pool
// (and its disk tier) refused it (`why` says which). `errors`: where the error is added, with measure_error (else null).
std::shared_ptr<ConvertedCopy> convert_to_host(const at::Tensor& t, lowp::Source s, lowp::Format f,
                                               const std::shared_ptr<HostPool>& pool, bool side_stream,
                                               const std::shared_ptr<PackerCounters>& counters, TieredRefusal* why,
                                               const CurrentStream* current, StoreErrors* errors);

}  // namespace ckpt_offload

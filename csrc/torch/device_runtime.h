// What the torch layer asks of the device side the build chose, the way pytorch's extension-cpp
// example selects sources (setup.py, scripts/build_env.py): the CUDA build compiles
// csrc/torch/cuda/*.cpp, the C++-only build the CPU fallbacks of csrc/torch/cpu/*.cpp, and
// exactly one of them defines these. The files of csrc/torch/ itself hold no CUDA code and no
// CUDA #ifdef (tests/core/test_packaging.py checks it). The public pieces of the torch layer's
// headers that only the device side has are defined there too: in {cuda,cpu}/runtime.cpp
// DeviceScope, CurrentStream, cuda_*, device_allocated_bytes and install_capture_probe
// (runtime.h); in {cuda,cpu}/device_memory.cpp record_consumer (device_memory.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "../core/host_pool.h"
#include "../core/low_precision.h"
#include "../core/stream.h"
#include "current_stream.h"

namespace ckpt_offload {
// Note [Fork] (runtime.cpp): true in a fork child of a process that had called CUDA, which must
// not call CUDA; note_cuda_used() marks this process as one that has. ensure_fork_handlers()
// registers the fork handlers once (install_capture_probe calls it, at import).
bool cuda_unusable_after_fork();
void note_cuda_used();
void ensure_fork_handlers();

namespace device_runtime {

// --- streams and devices (runtime.cpp) ---
// The streams of a copy on a non-CPU device (Note [Stream ordering]): sets `*compute` (owned
// by `*owned` when it wraps the current stream) and `*copy`; false when this build has no
// streams for the device.
bool stream_pair(const CurrentStream& current, bool side, bool to_host, bool demand, std::unique_ptr<Stream>* owned,
                 Stream** compute, Stream** copy);
// The NVTX range of a CopyRange on a CUDA device (nothing in the C++-only build).
void range_push(const char* name);
void range_pop();
// Waits for the device side streams (after the CPU ones have drained).
void synchronize_streams();
// The backend of a pool of pinned ("pinned" / "registered") memory, its segments placed on
// `numa_node` when >= 0 (Note [NUMA-local segments]); throws a message naming the fix when this
// build or machine cannot have one.
std::unique_ptr<Backend> pinned_backend(const std::string& backend_name, int numa_node);

// --- the profiler's device clocks (profiling.cpp) ---
// Takes fresh GPU timing epochs when there is a GPU (co.profile()'s start).
void start_timing_epochs();
// The host time (ns) of `device`'s GPU timing epoch; -1 when it has none (or no CUDA).
int64_t timing_epoch_ns(int device);

// --- device memory (device_memory.cpp) ---
// The allocator of a bare storage on a CUDA device (what at::empty uses there: the current
// device, in the current stream's order); null when this build has none.
c10::Allocator* cuda_allocator();
// Lets go of CUDA `storage` that the copy on `copy` (a CUDA stream) may still use, with
// record_stream on that stream; false (nothing done) for other memory or streams.
bool release_on_copy_stream(const c10::Storage& storage, Stream* copy);

// --- store_dtype's conversions on a CUDA device (store_dtype.cpp's store_down / store_up) ---
// `n` elements of type `s` at `src` (device memory) converted into format `f` on `current`'s
// stream: the stored bytes, allocated on `device`. `own_amax`: for a scaled format, the
// (finite amax, any infinity) of a strided view's own elements as 0-dim device tensors, null to
// take them from the n elements. Undefined when this build has no conversion for the device.
at::Tensor store_down(lowp::Source s, const void* src, int64_t n, lowp::Format f, const c10::Device& device,
                      const CurrentStream& current, const std::pair<at::Tensor, at::Tensor>* own_amax);
// Back from `stored` (as store_down made it) into n elements of type `s` at `out`, on
// `current`'s stream; false when this build has no conversion for stored's device.
bool store_up(lowp::Source s, void* out, int64_t n, lowp::Format f, const at::Tensor& stored,
              const CurrentStream& current);

}  // namespace device_runtime
}  // namespace ckpt_offload

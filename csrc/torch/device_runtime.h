// What runtime.cpp asks of the device implementation the build chose: runtime_cuda.cpp in the
// CUDA build (CKPT_OFFLOAD_WITH_CUDA), runtime_cpu.cpp in the C++-only build. Each of those
// files is guarded as a whole, so both can be globbed (setup.py) and parsed together
// (scripts/check_torch_headers.sh) and exactly one defines these. The public pieces of
// runtime.h that only the device side has (DeviceScope, CurrentStream, cuda_*,
// device_allocated_bytes, install_capture_probe) are defined there too.
#pragma once

#include <memory>
#include <string>

#include "../core/host_pool.h"
#include "../core/stream.h"
#include "runtime.h"

namespace ckpt_offload {
// Note [Fork] (runtime.cpp): true in a fork child of a process that had called CUDA, which must
// not call CUDA; note_cuda_used() marks this process as one that has. ensure_fork_handlers()
// registers the fork handlers once (install_capture_probe calls it, at import).
bool cuda_unusable_after_fork();
void note_cuda_used();
void ensure_fork_handlers();

namespace device_runtime {

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
// The backend of a pool of pinned ("pinned" / "registered") memory; throws a message naming
// the fix when this build or machine cannot have one.
std::unique_ptr<Backend> pinned_backend(const std::string& backend_name);

}  // namespace device_runtime
}  // namespace ckpt_offload

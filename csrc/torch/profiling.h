// The torch-facing side of the profiler: compute ranges timed on the current stream, and the
// records converted for Python (co.profile()).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace ckpt_offload {

// Starts a profile: clears records, takes fresh GPU timing epochs, turns recording on.
void profiler_start();
// Begins or ends a compute range named `name` on `device`'s current stream ("cpu": host
// clock). Ranges nest per thread; an end without its begin is ignored.
void profiler_range(const std::string& name, const std::string& device, bool begin);
// Drains the copy streams and returns every record, times in microseconds since the start.
pybind11::dict profiler_records();
// The keys of each kind of record profiler_records() returns: kind -> tuple of keys, in order
// (Note [Profiler record tables]).
pybind11::dict profiler_record_keys();
// Test hook: the host time (ns) of `device`'s GPU timing epoch, -1 when it has none (or no CUDA).
int64_t timing_epoch_ns(int device);

}  // namespace ckpt_offload

#include "profiling.h"

#include <c10/core/Device.h>

#include <algorithm>
#include <vector>

#include "../core/profiler.h"
#include "device_runtime.h"
#include "runtime.h"

namespace py = pybind11;

namespace ckpt_offload {
namespace {

struct OpenRange {
  std::string name;
  int device;
  std::shared_ptr<Event> start;
};
thread_local std::vector<OpenRange> t_ranges;

std::string device_name(int device) { return device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device); }

py::object us(int64_t ns) { return ns < 0 ? py::object(py::none()) : py::object(py::float_(ns / 1000.0)); }

py::list shape_list(const std::vector<int64_t>& shape) {
  py::list l;
  for (int64_t d : shape) l.append(d);
  return l;
}

const char* pool_kind(profiler::PoolEventKind k) {
  switch (k) {
    case profiler::PoolEventKind::BackendAlloc:
      return "backend_alloc";
    case profiler::PoolEventKind::BackendFree:
      return "backend_free";
    default:
      return "cap_hit";
  }
}

// A wait's stall: from the request to the data being ready, None when either had no time.
py::object stall_us(const profiler::Snapshot::Wait& w) {
  const bool known = w.request_ns >= 0 && w.ready_ns >= 0;
  return known ? py::object(py::float_(std::max<int64_t>(0, w.ready_ns - w.request_ns) / 1000.0))
               : py::object(py::none());
}

// -1 (unknown) as None.
py::object known_or_none(int64_t v) { return v < 0 ? py::object(py::none()) : py::object(py::int_(v)); }

}  // namespace

void profiler_start() {
  device_runtime::start_timing_epochs();
  t_ranges.clear();
  profiler::start();
}

int64_t timing_epoch_ns(int device) { return device_runtime::timing_epoch_ns(device); }

void profiler_range(const std::string& name, const std::string& device, bool begin) {
  if (!profiler::enabled()) return;
  c10::Device d(device);
  StreamPair streams(d, /*side=*/false, /*to_host=*/false);
  auto ev = streams.compute().record_timed();
  const int index = d.is_cuda() ? (d.has_index() ? d.index() : 0) : -1;
  if (begin) {
    t_ranges.push_back({name, index, std::move(ev)});
    return;
  }
  for (size_t i = t_ranges.size(); i-- > 0;) {
    if (t_ranges[i].name != name) continue;
    profiler::RangeRecord r;
    r.name = name;
    r.device = t_ranges[i].device;
    r.start = std::move(t_ranges[i].start);
    r.end = std::move(ev);
    t_ranges.erase(t_ranges.begin() + static_cast<std::ptrdiff_t>(i), t_ranges.end());
    profiler::add(std::move(r));
    return;
  }
}

// Note [Profiler record tables]
// Each kind of record co.profile() returns is one table of X(key, value) rows, in the order of
// its dict: `value` is an expression of the resolved record `r` (profiler::Snapshot's). The dicts
// profiler_records() builds and _C.PROFILER_RECORD_KEYS (what Python reads of them) both come
// from these tables. Times are microseconds since the start, None when an event had no time.
#define CKPT_OFFLOAD_COPY_RECORD(X)                           \
  X(id, id++)                                                 \
  X(kind, r.r.kind == CopyKind::DeviceToHost ? "d2h" : "h2d") \
  X(handle, r.r.handle)                                       \
  X(bytes, r.r.bytes)                                         \
  X(device, device_name(r.r.device))                          \
  X(stream, static_cast<uint64_t>(r.r.stream))                \
  X(start_us, us(r.start_ns))                                 \
  X(end_us, us(r.end_ns))                                     \
  X(prefetch, r.r.prefetch)                                   \
  X(members, r.r.members)
#define CKPT_OFFLOAD_DISK_RECORD(X)             \
  X(kind, r.write ? "disk_write" : "disk_read") \
  X(handle, r.handle)                           \
  X(bytes, r.bytes)                             \
  X(prefetch, r.prefetch)                       \
  X(start_us, r.start_ns / 1000.0)              \
  X(end_us, r.end_ns / 1000.0)
#define CKPT_OFFLOAD_WAIT_RECORD(X)  \
  X(handle, r.r.handle)              \
  X(device, device_name(r.r.device)) \
  X(request_us, us(r.request_ns))    \
  X(ready_us, us(r.ready_ns))        \
  X(stall_us, stall_us(r))
#define CKPT_OFFLOAD_HANDLE_RECORD(X) \
  X(handle, r.handle)                 \
  X(bytes, r.bytes)                   \
  X(shape, shape_list(r.shape))       \
  X(dtype, r.dtype)                   \
  X(device, device_name(r.device))    \
  X(module, r.module)                 \
  X(members, r.members)
#define CKPT_OFFLOAD_KEEP_RECORD(X) \
  X(reason, r.reason)               \
  X(bytes, r.bytes)                 \
  X(module, r.module)               \
  X(shape, shape_list(r.shape))     \
  X(dtype, r.dtype)                 \
  X(device, device_name(r.device))
#define CKPT_OFFLOAD_POOL_RECORD(X) \
  X(kind, pool_kind(r.kind))        \
  X(bytes, r.bytes)                 \
  X(start_us, r.start_ns / 1000.0)  \
  X(end_us, r.end_ns / 1000.0)
#define CKPT_OFFLOAD_RANGE_RECORD(X) \
  X(name, r.r.name)                  \
  X(device, device_name(r.r.device)) \
  X(start_us, us(r.start_ns))        \
  X(end_us, us(r.end_ns))
#define CKPT_OFFLOAD_MEMORY_SAMPLE(X)         \
  X(t_us, r.t_ns / 1000.0)                    \
  X(pool_bytes_in_use, r.pool_bytes_in_use)   \
  X(disk_bytes_in_use, r.disk_bytes_in_use)   \
  X(device_bytes_saved, r.device_bytes_saved) \
  X(device_bytes_allocated, known_or_none(r.device_bytes_allocated))

// R(kind, member, TABLE): the records' lists, in the order of profiler_records()'s dict: the key,
// the Snapshot member it comes from, and the table of one record. The dict ends with "dropped".
#define CKPT_OFFLOAD_PROFILER_RECORDS(R)          \
  R(copies, copies, CKPT_OFFLOAD_COPY_RECORD)     \
  R(disk, disk, CKPT_OFFLOAD_DISK_RECORD)         \
  R(waits, waits, CKPT_OFFLOAD_WAIT_RECORD)       \
  R(handles, handles, CKPT_OFFLOAD_HANDLE_RECORD) \
  R(keeps, keeps, CKPT_OFFLOAD_KEEP_RECORD)       \
  R(pool, pool, CKPT_OFFLOAD_POOL_RECORD)         \
  R(compute, ranges, CKPT_OFFLOAD_RANGE_RECORD)   \
  R(memory, memory, CKPT_OFFLOAD_MEMORY_SAMPLE)

py::dict profiler_records() {
  profiler::Snapshot snap;
  {
    py::gil_scoped_release release;
    synchronize_side_streams();
    snap = profiler::snapshot();
  }
  uint64_t id = 0;  // the copies' ids, in record order
  py::dict out;
#define CKPT_OFFLOAD_RECORD_VALUE(key, value) d[#key] = value;
#define CKPT_OFFLOAD_RECORD_LIST(kind, member, TABLE) \
  {                                                   \
    py::list records;                                 \
    for (const auto& r : snap.member) {               \
      py::dict d;                                     \
      TABLE(CKPT_OFFLOAD_RECORD_VALUE)                \
      records.append(d);                              \
    }                                                 \
    out[#kind] = records;                             \
  }
  CKPT_OFFLOAD_PROFILER_RECORDS(CKPT_OFFLOAD_RECORD_LIST)
#undef CKPT_OFFLOAD_RECORD_LIST
#undef CKPT_OFFLOAD_RECORD_VALUE
  out["dropped"] = snap.dropped;
  return out;
}

py::dict profiler_record_keys() {
  py::dict out;
#define CKPT_OFFLOAD_RECORD_KEY(key, value) keys.append(#key);
#define CKPT_OFFLOAD_RECORD_KEYS(kind, member, TABLE) \
  {                                                   \
    py::list keys;                                    \
    TABLE(CKPT_OFFLOAD_RECORD_KEY)                    \
    out[#kind] = py::tuple(keys);                     \
  }
  CKPT_OFFLOAD_PROFILER_RECORDS(CKPT_OFFLOAD_RECORD_KEYS)
#undef CKPT_OFFLOAD_RECORD_KEYS
#undef CKPT_OFFLOAD_RECORD_KEY
  return out;
}

}  // namespace ckpt_offload

#include "profiling.h"

#include <c10/core/Device.h>

#include <vector>

#include "../core/profiler.h"
#include "runtime.h"

#ifdef CKPT_OFFLOAD_WITH_CUDA
#include "../core/cuda_stream.h"
#endif

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
    case profiler::PoolEventKind::BackendAlloc: return "backend_alloc";
    case profiler::PoolEventKind::BackendFree: return "backend_free";
    default: return "cap_hit";
  }
}

}  // namespace

void profiler_start() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (cuda_device_count() > 0) cuda::start_timing_epochs();
#endif
  t_ranges.clear();
  profiler::start();
}

int64_t timing_epoch_ns(int device) {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  return cuda::timing_epoch_ns(device);
#else
  (void)device;
  return -1;
#endif
}

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

py::dict profiler_records() {
  profiler::Snapshot snap;
  {
    py::gil_scoped_release release;
    synchronize_side_streams();
    snap = profiler::snapshot();
  }
  py::list copies, waits, handles, keeps, pool, compute, memory, disk;
  uint64_t id = 0;
  for (const auto& c : snap.copies) {
    py::dict d;
    d["id"] = id++;
    d["kind"] = c.r.kind == CopyKind::DeviceToHost ? "d2h" : "h2d";
    d["handle"] = c.r.handle;
    d["bytes"] = c.r.bytes;
    d["device"] = device_name(c.r.device);
    d["stream"] = static_cast<uint64_t>(c.r.stream);
    d["start_us"] = us(c.start_ns);
    d["end_us"] = us(c.end_ns);
    d["prefetch"] = c.r.prefetch;
    d["members"] = c.r.members;
    copies.append(d);
  }
  for (const auto& w : snap.waits) {
    py::dict d;
    d["handle"] = w.r.handle;
    d["device"] = device_name(w.r.device);
    d["request_us"] = us(w.request_ns);
    d["ready_us"] = us(w.ready_ns);
    const bool known = w.request_ns >= 0 && w.ready_ns >= 0;
    d["stall_us"] = known ? py::object(py::float_(std::max<int64_t>(0, w.ready_ns - w.request_ns) / 1000.0))
                          : py::object(py::none());
    waits.append(d);
  }
  for (const auto& h : snap.handles) {
    py::dict d;
    d["handle"] = h.handle;
    d["bytes"] = h.bytes;
    d["shape"] = shape_list(h.shape);
    d["dtype"] = h.dtype;
    d["device"] = device_name(h.device);
    d["module"] = h.module;
    d["members"] = h.members;
    handles.append(d);
  }
  for (const auto& k : snap.keeps) {
    py::dict d;
    d["reason"] = k.reason;
    d["bytes"] = k.bytes;
    d["module"] = k.module;
    d["shape"] = shape_list(k.shape);
    d["dtype"] = k.dtype;
    d["device"] = device_name(k.device);
    keeps.append(d);
  }
  for (const auto& p : snap.pool) {
    py::dict d;
    d["kind"] = pool_kind(p.kind);
    d["bytes"] = p.bytes;
    d["start_us"] = p.start_ns / 1000.0;
    d["end_us"] = p.end_ns / 1000.0;
    pool.append(d);
  }
  for (const auto& r : snap.ranges) {
    py::dict d;
    d["name"] = r.r.name;
    d["device"] = device_name(r.r.device);
    d["start_us"] = us(r.start_ns);
    d["end_us"] = us(r.end_ns);
    compute.append(d);
  }
  for (const auto& m : snap.memory) {
    py::dict d;
    d["t_us"] = m.t_ns / 1000.0;
    d["pool_bytes_in_use"] = m.pool_bytes_in_use;
    d["disk_bytes_in_use"] = m.disk_bytes_in_use;
    d["device_bytes_saved"] = m.device_bytes_saved;
    d["device_bytes_allocated"] =
        m.device_bytes_allocated < 0 ? py::object(py::none()) : py::object(py::int_(m.device_bytes_allocated));
    memory.append(d);
  }
  for (const auto& r : snap.disk) {
    py::dict d;
    d["kind"] = r.write ? "disk_write" : "disk_read";
    d["handle"] = r.handle;
    d["bytes"] = r.bytes;
    d["prefetch"] = r.prefetch;
    d["start_us"] = r.start_ns / 1000.0;
    d["end_us"] = r.end_ns / 1000.0;
    disk.append(d);
  }
  py::dict out;
  out["copies"] = copies;
  out["disk"] = disk;
  out["waits"] = waits;
  out["handles"] = handles;
  out["keeps"] = keeps;
  out["pool"] = pool;
  out["compute"] = compute;
  out["memory"] = memory;
  out["dropped"] = snap.dropped;
  return out;
}

}  // namespace ckpt_offload

// pybind11 bindings: a thin list of defs, no logic.
#include <torch/extension.h>

#include "../core/host_pool.h"
#include "runtime.h"
#include "saved_tensor.h"

namespace py = pybind11;
using namespace ckpt_offload;

namespace {

py::dict pool_stats(HostPool& pool) {
  PoolStats s = pool.stats();
  py::dict d;
  d["bytes_in_use"] = s.bytes_in_use;
  d["bytes_requested"] = s.bytes_requested;
  d["bytes_pending"] = s.bytes_pending;
  d["bytes_reserved"] = s.bytes_reserved;
  d["peak_bytes_in_use"] = s.peak_bytes_in_use;
  d["peak_bytes_reserved"] = s.peak_bytes_reserved;
  d["max_bytes"] = s.max_bytes ? py::object(py::int_(s.max_bytes)) : py::object(py::none());
  d["num_segments"] = s.num_segments;
  d["num_blocks_in_use"] = s.num_blocks_in_use;
  d["num_allocs"] = s.num_allocs;
  d["num_frees"] = s.num_frees;
  d["num_backend_allocs"] = s.num_backend_allocs;
  d["num_backend_frees"] = s.num_backend_frees;
  d["num_cap_hits"] = s.num_cap_hits;
  d["backend"] = pool.backend_name();
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ckpt_offload native core (see the ckpt_offload package for the API)";

  py::register_exception<PoolFull>(m, "PoolFullError", PyExc_MemoryError);

  py::class_<HostPool, std::shared_ptr<HostPool>>(m, "HostPool")
      .def(py::init(&make_pool), py::arg("pinned"), py::arg("max_bytes"), py::arg("segment_bytes"))
      .def("stats", &pool_stats)
      .def("reset_peak", &HostPool::reset_peak)
      .def("empty_cache", &HostPool::empty_cache, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &HostPool::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("reserve", &HostPool::reserve, py::call_guard<py::gil_scoped_release>())
      .def("set_max_bytes", &HostPool::set_max_bytes)
      .def("check_invariants", [](HostPool& p) {
        std::string why;
        p.check_invariants(&why);
        return why;
      })
      .def_property_readonly("backend", &HostPool::backend_name)
      .def_property_readonly("segment_bytes", &HostPool::segment_bytes);

  py::class_<SavedTensor, std::shared_ptr<SavedTensor>>(m, "SavedTensor")
      .def_property_readonly("offloaded", &SavedTensor::offloaded)
      .def_property_readonly("nbytes", &SavedTensor::nbytes)
      .def_property_readonly("device", [](const SavedTensor& s) { return s.device().str(); })
      .def("reload", &SavedTensor::unpack);

  m.def("offload_tensor", &offload_tensor, py::arg("tensor"), py::arg("pool"), py::arg("side_stream"));

  py::class_<Packer, std::shared_ptr<Packer>>(m, "Packer")
      .def(py::init([](std::shared_ptr<HostPool> pool, int64_t min_bytes, bool offload_cpu, bool offload_cuda,
                       bool side_stream, bool raise_on_full) {
             PackerOptions o;
             o.pool = std::move(pool);
             o.min_bytes = min_bytes;
             o.offload_cpu = offload_cpu;
             o.offload_cuda = offload_cuda;
             o.side_stream = side_stream;
             o.raise_on_full = raise_on_full;
             return std::make_shared<Packer>(std::move(o));
           }),
           py::arg("pool"), py::arg("min_bytes"), py::arg("offload_cpu"), py::arg("offload_cuda"),
           py::arg("side_stream"), py::arg("raise_on_full"))
      .def("pack", &Packer::pack)
      .def("unpack", &Packer::unpack)
      .def("note_module_state", &Packer::note_module_state)
      .def("begin", &Packer::begin)
      .def("end", &Packer::end, py::arg("keep_dedup") = false)
      .def("stats", &Packer::stats);

  m.def("cuda_compiled", &cuda_compiled);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_runtime_version", &cuda_runtime_version);
  m.def("set_cpu_copy_delay_us", &set_cpu_copy_delay_us);
  m.def("cpu_copy_delay_us", &cpu_copy_delay_us);
  m.def("synchronize", &synchronize_side_streams, py::call_guard<py::gil_scoped_release>());
  m.def("poll", [] { engine().poll(); });
  m.def("num_keepalives", [] { return engine().num_keepalives(); });
  m.attr("ALIGNMENT") = kAlignment;
  m.attr("DEFAULT_SEGMENT_BYTES") = kDefaultSegmentBytes;
}

// pybind11 bindings of the disk tier (FileTier, spilling a HostPool): a thin list of defs.
#include <torch/extension.h>

#include "../core/file_tier.h"
#include "../core/spill.h"
#include "runtime.h"

namespace py = pybind11;

namespace ckpt_offload {

namespace {

py::dict tier_stats(FileTier& tier) {
  const FileTierStats s = tier.stats();
  auto bandwidth = [](uint64_t bytes, int64_t ns) {
    return ns > 0 ? py::object(py::float_(static_cast<double>(bytes) * 1e9 / static_cast<double>(ns)))
                  : py::object(py::none());
  };
  py::dict d;
  d["dir"] = tier.options().dir;
  d["bytes_in_use"] = s.bytes_in_use;
  d["bytes_requested"] = s.bytes_requested;
  d["peak_bytes_in_use"] = s.peak_bytes_in_use;
  d["bytes_reserved"] = s.bytes_reserved;
  d["peak_bytes_reserved"] = s.peak_bytes_reserved;
  d["max_bytes"] = s.max_bytes ? py::object(py::int_(s.max_bytes)) : py::object(py::none());
  d["num_files"] = s.num_files;
  d["num_blocks_in_use"] = s.num_blocks_in_use;
  d["blocks_written"] = s.blocks_written;
  d["bytes_written"] = s.bytes_written;
  d["blocks_read"] = s.blocks_read;
  d["bytes_read"] = s.bytes_read;
  d["write_seconds"] = static_cast<double>(s.write_busy_ns) * 1e-9;
  d["read_seconds"] = static_cast<double>(s.read_busy_ns) * 1e-9;
  d["write_bandwidth"] = bandwidth(s.bytes_written, s.write_busy_ns);
  d["read_bandwidth"] = bandwidth(s.bytes_read, s.read_busy_ns);
  d["reads_prefetch"] = s.reads_prefetch;
  d["read_stalls"] = s.stalls;
  d["read_stall_seconds"] = static_cast<double>(s.stall_ns) * 1e-9;
  d["num_cap_hits"] = s.num_cap_hits;
  d["num_disk_full"] = s.num_disk_full;
  d["write_errors"] = s.write_errors;
  d["read_errors"] = s.read_errors;
  d["checksum_errors"] = s.checksum_errors;
  d["direct_io"] = s.direct_io;
  return d;
}

// Keeps a CPU tensor's memory alive for the I/O threads (a C++ reference: no GIL needed to drop it).
std::shared_ptr<void> hold(const at::Tensor& t) { return std::make_shared<at::Tensor>(t); }

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  if (!t.device().is_cpu() || !t.is_contiguous())
    throw std::invalid_argument(std::string("ckpt_offload: ") + name + " must be a contiguous CPU tensor");
}

}  // namespace

void bind_spill(py::module_& m) {
  py::register_exception<FileTierError>(m, "SpillError", PyExc_RuntimeError);

  py::class_<FileTier, std::shared_ptr<FileTier>>(m, "FileTier")
      .def(py::init([](const std::string& dir, size_t max_bytes, size_t file_bytes, size_t chunk_bytes, int io_threads,
                       bool direct) {
             FileTierOptions o;
             o.dir = dir;
             o.max_bytes = max_bytes;
             o.file_bytes = file_bytes;
             o.chunk_bytes = chunk_bytes;
             o.io_threads = io_threads;
             o.direct = direct;
             return FileTier::create(std::move(o));
           }),
           py::arg("dir"), py::arg("max_bytes") = 0, py::arg("file_bytes") = kDefaultFileBytes,
           py::arg("chunk_bytes") = kDefaultChunkBytes, py::arg("io_threads") = 2, py::arg("direct") = true)
      .def("stats", &tier_stats)
      .def("reset_peak", &FileTier::reset_peak)
      .def("empty_cache", &FileTier::empty_cache, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &FileTier::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("reserve", &FileTier::reserve, py::call_guard<py::gil_scoped_release>())
      .def("files",
           [](FileTier& t) {
             py::list out;
             for (const auto& f : t.files()) {
               py::dict d;
               d["path"] = f.path;
               d["proc_path"] = f.proc_path;
               d["bytes"] = f.bytes;
               d["direct"] = f.direct;
               out.append(d);
             }
             return out;
           })
      .def("write",
           [](FileTier& tier, const at::Tensor& src) -> py::object {
             check_cpu_contiguous(src, "src");
             auto s = tier.write(src.data_ptr(), src.nbytes(), hold(src));
             return s ? py::cast(s) : py::none();
           },
           py::arg("src"))
      .def("read",
           [](FileTier& tier, const std::shared_ptr<FileTier::Spill>& spill, const at::Tensor& dst, bool prefetch) {
             check_cpu_contiguous(dst, "dst");
             if (dst.nbytes() < spill->nbytes())
               throw std::invalid_argument("ckpt_offload: dst has fewer bytes than the spilled block");
             return tier.read(spill, dst.data_ptr(), hold(dst), prefetch);
           },
           py::arg("spill"), py::arg("dst"), py::arg("prefetch") = false);

  py::class_<FileTier::Spill, std::shared_ptr<FileTier::Spill>>(m, "FileSpill")
      .def_property_readonly("nbytes", &FileTier::Spill::nbytes)
      .def_property_readonly("offset", &FileTier::Spill::offset)
      .def_property_readonly("proc_path", &FileTier::Spill::proc_path)
      .def("wait_written", [](FileTier::Spill& s) { s.written()->wait(); }, py::call_guard<py::gil_scoped_release>());

  py::class_<FileTier::Ticket, std::shared_ptr<FileTier::Ticket>>(m, "FileTicket")
      .def("done", &FileTier::Ticket::query)
      .def("wait", &FileTier::Ticket::wait, py::call_guard<py::gil_scoped_release>());

  // Opaque: co.HostPool owns it; the pool spills through it while it is alive.
  py::class_<SpillTarget, std::shared_ptr<SpillTarget>>(m, "SpillTarget");
  m.def(
      "attach_spill",
      [](const std::shared_ptr<HostPool>& pool, const std::shared_ptr<FileTier>& tier,
         const std::shared_ptr<HostPool>& staging, size_t staging_bytes) {
        auto target = std::make_shared<SpillTarget>(tier, staging, staging_bytes);
        attach_spill(pool, target);
        return target;
      },
      py::arg("pool"), py::arg("tier"), py::arg("staging"), py::arg("staging_bytes"));
  m.def("spill_stats", [](const std::shared_ptr<HostPool>& pool) -> py::object {
    auto target = spill_target(pool.get());
    if (!target) return py::none();
    py::dict d = tier_stats(*target->tier());
    d["blocks_spilled"] = target->blocks_spilled.load();
    d["bytes_spilled"] = target->bytes_spilled.load();
    d["blocks_refused"] = target->blocks_refused.load();
    d["write_stalls"] = target->throttle_stalls.load();
    d["write_stall_seconds"] = static_cast<double>(target->throttle_stall_ns.load()) * 1e-9;
    const PoolStats st = target->staging()->stats();
    d["staging_bytes_in_use"] = st.bytes_in_use;
    d["staging_peak_bytes_in_use"] = st.peak_bytes_in_use;
    d["staging_bytes_reserved"] = st.bytes_reserved;
    d["staging_max_bytes"] = target->staging_bytes();
    return d;
  });
}

}  // namespace ckpt_offload

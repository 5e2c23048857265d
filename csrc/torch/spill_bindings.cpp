// pybind11 bindings of the disk tier (FileTier, spilling a HostPool): a thin list of defs.
#include <torch/extension.h>

#include "../core/file_tier.h"
#include "../core/spill.h"
#include "runtime.h"
#include "stats_dict.h"

namespace py = pybind11;

namespace ckpt_offload {

namespace {

CKPT_OFFLOAD_STATS_EXTRA(FileTierStatsExtra, CKPT_OFFLOAD_FILE_TIER_STATS);

py::object seconds(int64_t ns) { return py::float_(static_cast<double>(ns) * 1e-9); }

py::dict tier_stats(FileTier& tier) {
  const FileTierStats s = tier.stats();
  auto bandwidth = [](uint64_t bytes, int64_t ns) {
    return ns > 0 ? py::object(py::float_(static_cast<double>(bytes) * 1e9 / static_cast<double>(ns)))
                  : py::object(py::none());
  };
  FileTierStatsExtra e;
  e.dir = py::str(tier.options().dir);
  e.write_seconds = seconds(s.write_busy_ns);
  e.read_seconds = seconds(s.read_busy_ns);
  e.write_bandwidth = bandwidth(s.bytes_written, s.write_busy_ns);
  e.read_bandwidth = bandwidth(s.bytes_read, s.read_busy_ns);
  e.read_stall_seconds = seconds(s.read_stall_ns);
  return CKPT_OFFLOAD_STATS_DICT(CKPT_OFFLOAD_FILE_TIER_STATS, s, e);
}

// What pool.stats()["disk"] adds to its tier's dict (Note [Stats tables]): the spill target's
// counts and its staging pool's. Every row is a KEY: the values live in SpillTarget's atomics and
// in the staging pool's own table.
#define CKPT_OFFLOAD_SPILL_STATS(FIELD, PEAK, KEY)                           \
  KEY(blocks_spilled)                                                        \
  KEY(bytes_spilled)                                                         \
  KEY(blocks_refused) /* the tier had no room */                             \
  KEY(write_stalls)   /* offloads that waited for a write to free staging */ \
  KEY(write_stall_seconds)                                                   \
  KEY(staging_bytes_in_use)                                                  \
  KEY(staging_peak_bytes_in_use)                                             \
  KEY(staging_bytes_reserved)                                                \
  KEY(staging_max_bytes)

struct SpillStats {
  CKPT_OFFLOAD_STATS_STRUCT_BODY(CKPT_OFFLOAD_SPILL_STATS)
};
CKPT_OFFLOAD_STATS_EXTRA(SpillStatsExtra, CKPT_OFFLOAD_SPILL_STATS);

py::dict spill_stats(const SpillTarget& target) {
  SpillStatsExtra e;
  e.blocks_spilled = py::int_(target.blocks_spilled.load());
  e.bytes_spilled = py::int_(target.bytes_spilled.load());
  e.blocks_refused = py::int_(target.blocks_refused.load());
  e.write_stalls = py::int_(target.throttle_stalls.load());
  e.write_stall_seconds = seconds(target.throttle_stall_ns.load());
  const PoolStats st = target.staging()->stats();
  e.staging_bytes_in_use = py::int_(st.bytes_in_use);
  e.staging_peak_bytes_in_use = py::int_(st.peak_bytes_in_use);
  e.staging_bytes_reserved = py::int_(st.bytes_reserved);
  e.staging_max_bytes = py::int_(target.staging_bytes());
  py::dict d = tier_stats(*target.tier());
  for (auto item : CKPT_OFFLOAD_STATS_DICT(CKPT_OFFLOAD_SPILL_STATS, SpillStats{}, e)) d[item.first] = item.second;
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
      .def(
          "write",
          [](FileTier& tier, const at::Tensor& src) -> py::object {
            check_cpu_contiguous(src, "src");
            auto s = tier.write(src.data_ptr(), src.nbytes(), hold(src));
            return s ? py::cast(s) : py::none();
          },
          py::arg("src"))
      .def(
          "read",
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
    return py::object(spill_stats(*target));
  });
  // Note [Stats tables]: the keys of FileTier.stats() and of pool.stats()["disk"], for Python.
  m.attr("FILE_TIER_STATS_KEYS") = stats_keys_tuple(FileTierStats::keys());
  {
    std::vector<const char*> keys = FileTierStats::keys();
    keys.insert(keys.end(), SpillStats::keys().begin(), SpillStats::keys().end());
    m.attr("DISK_STATS_KEYS") = stats_keys_tuple(keys);
  }
}

}  // namespace ckpt_offload

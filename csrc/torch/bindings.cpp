// pybind11 bindings: a thin list of defs, no logic.
#include <torch/extension.h>

#include <atomic>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../core/host_pool.h"
#include "../core/profiler.h"
#include "compile_ops.h"
#include "profiling.h"
#include "runtime.h"
#include "device_bytes.h"
#include "device_memory.h"
#include "activation.h"
#include "hooks.h"
#include "host_copies.h"
#include "packer.h"
#include "pinned_fallback.h"
#include "store_dtype.h"
#include "tensor_layout.h"
#include "saved_tensor.h"
#include "stats_dict.h"

namespace py = pybind11;
using namespace ckpt_offload;

namespace ckpt_offload {
void bind_spill(py::module_& m);  // spill_bindings.cpp
}

namespace {

// The Packer's options at the C++ boundary, written once: each name with the field it sets. The
// defaults are not here: Python's OffloadOptions (ckpt_offload/options.py) has them, and its
// packer_kwargs() passes every one of these by keyword (_C.PACKER_OPTIONS lists them for its test).
using SetOption = void (*)(PackerOptions&, const py::handle&);
const std::vector<std::pair<const char*, SetOption>>& packer_option_table() {
  static const std::vector<std::pair<const char*, SetOption>> table = {
      {"min_bytes", [](PackerOptions& o, const py::handle& v) { o.min_bytes = v.cast<int64_t>(); }},
      {"offload_cpu", [](PackerOptions& o, const py::handle& v) { o.offload_cpu = v.cast<bool>(); }},
      {"offload_cuda", [](PackerOptions& o, const py::handle& v) { o.offload_cuda = v.cast<bool>(); }},
      {"side_stream", [](PackerOptions& o, const py::handle& v) { o.side_stream = v.cast<bool>(); }},
      {"raise_on_full", [](PackerOptions& o, const py::handle& v) { o.raise_on_full = v.cast<bool>(); }},
      {"prefetch_bytes", [](PackerOptions& o, const py::handle& v) { o.prefetch_bytes = v.cast<int64_t>(); }},
      {"prefetch_auto", [](PackerOptions& o, const py::handle& v) { o.prefetch_auto = v.cast<bool>(); }},
      {"batch_below", [](PackerOptions& o, const py::handle& v) { o.batch_below = v.cast<int64_t>(); }},
      {"batch_bytes", [](PackerOptions& o, const py::handle& v) { o.batch_bytes = v.cast<int64_t>(); }},
      {"store_dtype",
       [](PackerOptions& o, const py::handle& v) { o.store_format = store_format_from_name(v.cast<std::string>()); }},
      {"store_min_bytes", [](PackerOptions& o, const py::handle& v) { o.store_min_bytes = v.cast<int64_t>(); }},
      {"measure_error", [](PackerOptions& o, const py::handle& v) { o.measure_error = v.cast<bool>(); }},
  };
  return table;
}

// Every option must be given, and nothing else: a missing one would run with a zero the user
// never chose, an unknown one would be a name that reaches nothing.
PackerOptions packer_options(std::shared_ptr<HostPool> pool, const py::kwargs& kwargs) {
  PackerOptions o;
  o.pool = std::move(pool);
  size_t used = 0;
  for (const auto& [name, set] : packer_option_table()) {
    if (!kwargs.contains(name)) throw py::type_error(std::string("Packer: missing option '") + name + "'");
    try {
      set(o, kwargs[name]);
    } catch (const py::cast_error&) {
      throw py::type_error(std::string("Packer: option '") + name + "' has the wrong type");
    }
    ++used;
  }
  if (used != kwargs.size()) {
    for (const auto& item : kwargs) {
      const std::string key = py::str(item.first);
      bool known = false;
      for (const auto& entry : packer_option_table()) known = known || key == entry.first;
      if (!known) throw py::type_error("Packer: unknown option '" + key + "'");
    }
  }
  return o;
}

CKPT_OFFLOAD_STATS_EXTRA(PoolStatsExtra, CKPT_OFFLOAD_POOL_STATS);

py::dict pool_stats(HostPool& pool) {
  PoolStatsExtra extra;
  extra.backend = py::str(pool.backend_name());
  // Note [NUMA-local segments]: where a bound pool's bytes are; None for an unbound pool.
  const int node = pool.backend().numa_node();
  if (node >= 0) {
    extra.numa_node = py::int_(node);
    py::dict by_node;
    for (const auto& [n, bytes] : pool.bytes_by_node()) by_node[py::int_(n)] = bytes;
    extra.bytes_by_node = by_node;
  }
  return CKPT_OFFLOAD_STATS_DICT(CKPT_OFFLOAD_POOL_STATS, pool.stats(), extra);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ckpt_offload native core (see the ckpt_offload package for the API)";

  {
    // PoolFull as PoolFullError, its message's parts as attributes (Python words its own
    // remedies from `facts` without parsing the message).
    static PyObject* pool_full_error = nullptr;  // the type, kept for the process
    py::exception<PoolFull> error(m, "PoolFullError", PyExc_MemoryError);
    error.attr("facts") = py::none();     // what was asked for and what the pool holds (None: raised in Python)
    error.attr("remedies") = py::none();  // the ways out
    pool_full_error = error.inc_ref().ptr();
    py::register_exception_translator([](std::exception_ptr p) {
      try {
        if (p) std::rethrow_exception(p);
      } catch (const PoolFull& e) {
        py::object raised = py::handle(pool_full_error)(e.what());
        raised.attr("facts") = e.facts();
        raised.attr("remedies") = e.remedies();
        PyErr_SetObject(pool_full_error, raised.ptr());
      }
    });
  }
  install_capture_probe();  // Note [Graph capture]

  py::class_<HostPool, std::shared_ptr<HostPool>>(m, "HostPool")
      .def(py::init(&make_pool), py::arg("backend"), py::arg("max_bytes"), py::arg("segment_bytes"),
           py::arg("numa_node") = -1)
      .def("stats", &pool_stats)
      .def("bytes_in_use", &HostPool::bytes_in_use)
      .def("reset_peak", &HostPool::reset_peak)
      .def("empty_cache", &HostPool::empty_cache, py::call_guard<py::gil_scoped_release>())
      .def("release_retired", &HostPool::release_retired, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &HostPool::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("reserve", &HostPool::reserve, py::call_guard<py::gil_scoped_release>())
      .def("set_max_bytes", &HostPool::set_max_bytes)
      .def("check_invariants",
           [](HostPool& p) {
             std::string why;
             p.check_invariants(&why);
             return why;
           })
      .def("pinned_fallback",
           [](HostPool& p) -> py::object {
             // Note [Pinned fallback]: None for a pageable pool, else what was taken as pageable.
             auto* f = dynamic_cast<FallbackBackend*>(&p.backend());
             if (!f) return py::none();
             const PinnedFallbackStats s = f->stats();
             py::dict d;
             d["segments"] = s.segments;
             d["bytes"] = s.bytes;
             d["reason"] = s.reason;
             return d;
           })
      .def_property_readonly("backend", &HostPool::backend_name)
      .def_property_readonly("segment_bytes", &HostPool::segment_bytes);

  py::class_<SavedTensor, std::shared_ptr<SavedTensor>>(m, "SavedTensor")
      .def_property_readonly("offloaded", &SavedTensor::offloaded)
      .def_property_readonly("nbytes", &SavedTensor::nbytes)
      .def_property_readonly("device", [](const SavedTensor& s) { return s.device().str(); })
      .def("reload", [](SavedTensor& self) { return self.unpack(); });

  m.def("offload_tensor", &offload_tensor, py::arg("tensor"), py::arg("pool"), py::arg("side_stream"));
  m.def(
      "span_bytes", [](const at::Tensor& t) { return extent_elements(t) * static_cast<int64_t>(t.dtype().itemsize()); },
      py::arg("tensor"),
      "The bytes of its storage a tensor spans, from its first element to its last: what co.offload copies for "
      "it (Note [Span of a tensor], csrc/torch/tensor_layout.h). 0 for an empty tensor.");
  // The kernels of the ops that offload inside a compiled graph (ckpt_offload/_compile_ops.py).
  m.def("compile_to_host", &compile_to_host, py::arg("tensor"), py::arg("pool"), py::arg("side_stream"));
  m.def("compile_to_device", &compile_to_device, py::arg("host"), py::arg("device"), py::arg("side_stream"));
  m.def("compile_pool_backed", &compile_pool_backed, py::arg("tensor"));
  // For tests of Note [Low-precision storage]: a contiguous copy of `tensor` converted to
  // `store_dtype` (the stored bytes, the fp8 amax included) and what those bytes read back as,
  // by the same CPU loops or CUDA kernels that offload uses.
  m.def(
      "_store_convert",
      [](const at::Tensor& tensor, const std::string& store_dtype) {
        const lowp::Format f = store_format_from_name(store_dtype);
        const auto s = store_source(tensor, f);
        if (!s)
          throw std::invalid_argument("store_dtype " + store_dtype + " does not convert a " +
                                      dtype_name(tensor.scalar_type()) + " tensor");
        const at::Tensor c = tensor.contiguous();
        DeviceScope scope(c.device());
        const CurrentStream current = CurrentStream::of(c.device());
        at::Tensor stored = store_down(*s, c.data_ptr(), c.numel(), f, c.device(), current);
        at::Tensor back = at::empty_like(c);
        store_up(*s, back.data_ptr(), c.numel(), f, stored, current);
        return py::make_tuple(stored, back);
      },
      py::arg("tensor"), py::arg("store_dtype"));

  // The storage rules, for the planner and the option checks (Note [Low-precision storage]): the
  // formats store_dtype= takes, and the bytes one of them stores for a saved tensor of `dtype`
  // spanning `span` bytes (None: stored exactly), by the store_source / stored_bytes the packer uses.
  m.def("store_formats", [] {
    std::vector<std::string> names;
    for (int i = static_cast<int>(lowp::Format::None) + 1; *store_format_name(static_cast<lowp::Format>(i)); ++i)
      names.emplace_back(store_format_name(static_cast<lowp::Format>(i)));
    return names;
  });
  m.def(
      "stored_bytes",
      [](at::ScalarType dtype, int64_t span, const std::string& store_dtype) -> py::object {
        const lowp::Format f = store_format_from_name(store_dtype);
        const auto s = store_source(at::empty({0}, at::TensorOptions().dtype(dtype)), f);
        if (!s || span <= 0) return py::none();
        return py::int_(lowp::stored_bytes(f, span / lowp::source_bytes(*s)));
      },
      py::arg("dtype"), py::arg("span"), py::arg("store_dtype"));

  // The options of packer_options() made once, without a pool: co.offload makes a Packer per
  // context, and reading a dozen keywords cost more than the rest of its construction together
  // (Note [Fixed cost per call], ckpt_offload/options.py). Read-only: one object serves every
  // context made from the same options.
  py::class_<PackerOptions>(m, "PackerOptions")
      .def(py::init([](const py::kwargs& options) { return packer_options(nullptr, options); }))
      .def_property_readonly("min_bytes", [](const PackerOptions& o) { return o.min_bytes; })
      .def_property_readonly("side_stream", [](const PackerOptions& o) { return o.side_stream; });

  py::class_<ExitCounts>(m, "ExitCounts",
                         "What a context exit checks, from a Packer's counters (Note [Offloaded nothing]): "
                         "Packer.exit_counts().")
      .def_readonly("offloaded_or_shared", &ExitCounts::offloaded_or_shared)
      .def_readonly("too_small_tensors", &ExitCounts::too_small_tensors)
      .def_readonly("too_small_bytes", &ExitCounts::too_small_bytes)
      .def_readonly("device_tensors", &ExitCounts::device_tensors)
      .def_readonly("pool_full_tensors", &ExitCounts::pool_full_tensors)
      .def_readonly("pool_full_bytes", &ExitCounts::pool_full_bytes)
      .def_readonly("disk_full_tensors", &ExitCounts::disk_full_tensors)
      .def_readonly("disk_full_bytes", &ExitCounts::disk_full_bytes);

  py::class_<Packer, std::shared_ptr<Packer>>(m, "Packer")
      // First: the overload co.offload calls, tried before the keyword one.
      .def(py::init([](const PackerOptions& options, std::shared_ptr<HostPool> pool) {
             PackerOptions o = options;
             o.pool = std::move(pool);
             return std::make_shared<Packer>(std::move(o));
           }),
           py::arg("options"), py::arg("pool"))
      .def(py::init([](std::shared_ptr<HostPool> pool, const py::kwargs& options) {
             return std::make_shared<Packer>(packer_options(std::move(pool), options));
           }),
           py::arg("pool"))
      // Note [Hook entry points]: each read gives a new function object; push and compare the
      // same one.
      .def_property_readonly("pack", [](std::shared_ptr<Packer> p) { return hook_function(std::move(p), true); })
      .def_property_readonly("unpack", [](std::shared_ptr<Packer> p) { return hook_function(std::move(p), false); })
      .def("begin", &Packer::begin)
      // Returns exit_counts(), read after the activation ended.
      .def(
          "end",
          [](Packer& p, bool keep_dedup) {
            p.end(keep_dedup);
            return p.exit_counts();
          },
          py::arg("keep_dedup") = false)
      .def("flush_batches", &Packer::flush_batches)
      .def("stats", &Packer::stats)
      // Note [Same view, same tensor]: a selective checkpoint's cache sets it.
      .def_property("distinct_unpacks", &Packer::distinct_unpacks, &Packer::set_distinct_unpacks)
      .def("exit_counts", &Packer::exit_counts)
      .def("reset_stats", &Packer::reset_stats);

  m.def("cuda_compiled", &cuda_compiled);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_runtime_version", &cuda_runtime_version);
  m.def("synchronize", &synchronize_side_streams, py::call_guard<py::gil_scoped_release>());
  bind_activation(m);
  m.def("poll", [] { engine().poll(); });
  m.def("num_keepalives", [] { return engine().num_keepalives(); });
  m.def("profiler_start", &profiler_start);
  m.def("profiler_stop", &profiler::stop);
  m.def("profiler_enabled", &profiler::enabled);
  m.def("profiler_set_scope", &profiler::set_scope, py::arg("scope"));
  m.def("profiler_range", &profiler_range, py::arg("name"), py::arg("device"), py::arg("begin"));
  m.def("profiler_records", &profiler_records);
  m.def("device_bytes_saved", [] { return DeviceBytesHeld::total(); });
  // Note [Stats table]: what Python knows of Packer::stats() comes from here, not from lists of its own.
  m.def(
      "stats_keys",
      [] {
        std::vector<std::pair<std::string, std::string>> out;
        for (const StatKey& k : stats_keys()) out.emplace_back(k.name, k.merge);
        return out;
      },
      "Every key of Packer.stats(), in order, with how contexts merge it: 'sum', 'max', 'per_reason' or 'state'.");
  m.def(
      "keep_reasons",
      [] {
        std::vector<std::string> out;
        for (int r = 0; r < static_cast<int>(KeepReason::kCount); ++r)
          out.emplace_back(keep_reason_name(static_cast<KeepReason>(r)));
        return out;
      },
      "Every reason Packer.stats()['kept_by_reason'] lists, in order.");
  m.def("_timing_epoch_ns", &timing_epoch_ns, py::arg("device"));

  // Test hooks live in _C.testing, apart from what the library itself calls: knobs that inject
  // delays and failures, and the kernel's chunk plan run on the host.
  py::module_ testing = m.def_submodule("testing", "test hooks: delays, injected failures, host-side kernel plan");
  testing.def("set_cpu_copy_delay_us", &set_cpu_copy_delay_us, py::arg("us"),
              "Delay before every copy on the CPU worker streams (default: CKPT_OFFLOAD_CPU_COPY_DELAY_US).");
  testing.def("cpu_copy_delay_us", &cpu_copy_delay_us);
  testing.def("drain_cpu_streams", &drain_cpu_streams, py::call_guard<py::gil_scoped_release>(),
              "Waits for the copies on the CPU worker streams to finish without releasing what the copy "
              "engine holds for them (co.synchronize() does both).");
  testing.def("fail_next_prefetches", &fail_next_prefetches, py::arg("n"),
              "The next n prefetches raise, as running out of device memory would.");
  testing.def("set_failing_capture_probe", &set_failing_capture_probe, py::arg("on"),
              "On: the graph-capture probe raises, as it does after a CUDA error; off: the previous probe.");
  testing.def("simulate_pinned_refusal", &simulate_pinned_refusal, py::arg("limit"),
              "While limit ('vm.max_map_count' or 'RLIMIT_MEMLOCK') is set, pools made with a pinned backend get "
              "one that refuses every segment as that limit would, on any build; '' restores the real backend.");
  testing.def("set_batch_staging", &set_batch_staging, py::arg("on"),
              "Off: batches find no device staging block and copy each member on its own.");
  testing.def("copy_batch_on_host", [](std::vector<std::tuple<uintptr_t, uintptr_t, size_t>> segs) {
    // Runs the gather/scatter kernel's chunk plan on the host.
    std::vector<CopySegment> s;
    for (auto& t : segs)
      s.push_back(
          {reinterpret_cast<void*>(std::get<0>(t)), reinterpret_cast<const void*>(std::get<1>(t)), std::get<2>(t)});
    copy_batch_on_host(s);
  });
  // The old top-level names, for code written before the move (branches in flight); remove
  // them once nothing calls co._C.<hook> any more.
  for (const char* name : {"set_cpu_copy_delay_us", "cpu_copy_delay_us", "copy_batch_on_host"})
    m.attr(name) = testing.attr(name);
  m.attr("_fail_next_prefetches") = testing.attr("fail_next_prefetches");
  m.attr("_set_batch_staging") = testing.attr("set_batch_staging");
  m.attr("BATCH_CHUNK_BYTES") = kBatchChunkBytes;
  {
    py::list names;
    for (const auto& entry : packer_option_table()) names.append(entry.first);
    m.attr("PACKER_OPTIONS") = names;
  }
  {
    py::dict ranges;  // the copy ranges' names, defined once in runtime.h
    ranges["offload"] = copy_ranges::kOffload;
    ranges["offload_batch"] = copy_ranges::kOffloadBatch;
    ranges["reload"] = copy_ranges::kReload;
    ranges["reload_batch"] = copy_ranges::kReloadBatch;
    ranges["prefetch"] = copy_ranges::kPrefetch;
    ranges["prefetch_batch"] = copy_ranges::kPrefetchBatch;
    ranges["reload_convert"] = copy_ranges::kReloadConvert;
    m.attr("COPY_RANGES") = ranges;
  }
  // Note [Stats tables]: the keys of HostPool.stats(), for Python's lists.
  m.attr("POOL_STATS_KEYS") = stats_keys_tuple(PoolStats::keys());
  // Note [Profiler record tables]: each kind of record profiler_records() returns, with its keys.
  m.attr("PROFILER_RECORD_KEYS") = profiler_record_keys();
  m.attr("ALIGNMENT") = kAlignment;
  m.attr("DEFAULT_SEGMENT_BYTES") = kDefaultSegmentBytes;
  bind_spill(m);
}
